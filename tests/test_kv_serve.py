"""The KV connector over HTTP, with real `platform serve` processes on
127.0.0.1 and the official openai client:

* one server on the local connector: --kv-transfer-config (vLLM's spelling)
  is accepted; usage.prompt_tokens_details.cached_tokens; /metrics exports
  the connector's counters; /health ok.
* prefill/decode disaggregation: a --role prefill and a --role decode server
  on one shared disk tier behind `platform proxy`: greedy output identical
  to a single instance, streamed and whole; the decode instance reports the
  prompt's full pages as external cached tokens; the prefill instance saved
  them; two of each are balanced.
"""

import json

import httpx
import pytest
from kv_servers import Proc, metric, serve
from tiny_models import tiny_model_dir

pytest.importorskip("plinth_plugin_kv_local")
openai = pytest.importorskip("openai")

SHARED = [(i * 37) % 250 + 1 for i in range(160)]  # 10 pages of 16


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _complete(client, prompt, n=8):
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text, r.usage


def _stream(client, prompt, n=8):
    text = ""
    for chunk in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ):
        if chunk.choices:
            text += chunk.choices[0].text
    return text


@pytest.fixture(scope="module")
def model(tiny_root):
    return tiny_model_dir("llama", tiny_root)


def test_http_surface(model, tmp_path):
    cfg = {"kv_connector": "local", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes": 1 << 24}}
    s = Proc(
        ["serve", model, "--dtype", "float32", "--backend", "torch", "--num-pages", "256", "--served-model-name", "tiny",
         "--kv-transfer-config", json.dumps(cfg)],
        str(tmp_path / "serve.log"),
    )
    try:
        assert s.health() == {"status": "ok"}
        c = _client(s.url)
        first, u1 = _complete(c, SHARED + [5, 6])
        assert u1.prompt_tokens == 162 and u1.prompt_tokens_details.cached_tokens == 0
        again, u2 = _complete(c, SHARED + [5, 6])
        assert again == first
        assert u2.prompt_tokens_details.cached_tokens == 160  # the local prefix cache
        m = s.metrics()
        assert metric(m, "plinth:prefix_cache_local_hit_tokens_total") == 160
        assert metric(m, "plinth:prefix_cache_external_hit_tokens_total") == 0
        assert metric(m, "plinth:kv_connector_saved_pages_total") >= 10
        assert metric(m, "plinth:kv_connector_saved_bytes_total") > 0
        assert metric(m, "plinth:kv_connector_breaker_state", state="closed") == 1
        assert metric(m, "plinth:kv_connector_healthy") == 1
        assert metric(m, "plinth:kv_connector_save_latency_seconds_count") >= 1
        assert "plinth:kv_connector_load_latency_seconds_bucket" in "".join(m)
    finally:
        s.stop()


def test_role_needs_a_connector(model, tmp_path):
    with pytest.raises(RuntimeError, match="--role prefill needs a KV connector"):
        serve(model, str(tmp_path / "bad.log"), "--role", "prefill")


def test_prefill_decode_behind_the_proxy(model, tmp_path):
    kv = {"cpu_bytes": 0, "disk_dir": str(tmp_path / "kv")}
    prompts = [SHARED + [i, i + 3, i + 7] for i in range(1, 5)]
    procs = []
    try:
        single = serve(model, str(tmp_path / "single.log"))
        procs.append(single)
        ref = [_complete(_client(single.url), p)[0] for p in prompts]
        single.stop()
        pre = [serve(model, str(tmp_path / f"pre{i}.log"), "--role", "prefill", connector="local", config=kv) for i in range(2)]
        dec = [serve(model, str(tmp_path / f"dec{i}.log"), "--role", "decode", connector="local", config=kv) for i in range(2)]
        procs += pre + dec
        proxy = Proc(["proxy", "--prefill", *[p.url for p in pre], "--decode", *[d.url for d in dec]], str(tmp_path / "proxy.log"))
        procs.append(proxy)
        c = _client(proxy.url)
        text, usage = _complete(c, prompts[0])
        assert text == ref[0]
        assert usage.prompt_tokens_details.cached_tokens == 160  # loaded through the connector
        assert _stream(c, prompts[1]) == ref[1]
        for p, r in zip(prompts[2:], ref[2:]):
            assert _complete(c, p)[0] == r
        # two requests each way: the proxy took turns (no request overlapped)
        for p in pre:
            m = p.metrics()
            assert metric(m, "plinth:kv_connector_saved_pages_total") >= 1
            assert metric(m, "plinth:request_success_total") == 2
            assert metric(m, "plinth:request_generation_tokens_sum") == 2  # one token each
        ext = 0
        for d in dec:
            m = d.metrics()
            assert metric(m, "plinth:request_success_total") == 2
            assert metric(m, "plinth:kv_connector_saved_pages_total") == 0  # kv_consumer saves nothing
            ext += metric(m, "plinth:prefix_cache_external_hit_tokens_total")
        # the shared prefix and the decode instance's own prefix cache: every
        # request found its 160 tokens, and the first on each decode instance loaded them
        assert ext >= 2 * 160
        h = httpx.get(proxy.url + "/health", timeout=10).json()
        assert h["status"] == "ok", h
    finally:
        for p in procs:
            p.stop()
