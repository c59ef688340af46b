"""The multi-process engine on real processes over gloo (127.0.0.1, world 2):
``LLM(tp=2)`` and ``LLM(ep=2, a2a="nccl")`` (dp 2: one scheduler per dp
rank, idle ranks in dummy forwards) on a tiny Qwen3-MoE and a dense tiny
Llama under tp=2 give one process's greedy tokens; ``platform serve --tp 2
--ep 2 --a2a nccl`` answers the official openai client; a worker killed
mid-stream (SIGKILL) fails the stream and /health within seconds, and no
process is left behind."""

from __future__ import annotations

import functools
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "plugins/models/llama/tests"))

from plinth import LLM, SamplingParams  # noqa: E402
from server_fixtures import wait_until_healthy  # noqa: E402
from tiny_models import tiny_model_dir, write_tokenizer  # noqa: E402
from tiny_moe import prompts, saved_model  # noqa: E402

KW = dict(device="cpu", backend="torch", dtype="float32", num_pages=96, load_progress=False)
PLATFORM = str(pathlib.Path(sys.executable).with_name("platform"))
NEW = 12


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dist"))


def moe(root: str) -> str:
    path = saved_model("qwen3moe", root)
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        write_tokenizer(path)
    return path


def requests():
    """Concurrent prompts of different lengths, greedy, and one seeded n=2 sample (a fork: page copies)."""
    ps = prompts()
    params = [SamplingParams(max_tokens=NEW, temperature=0)] * len(ps)
    return ps + [ps[2]], params + [SamplingParams(max_tokens=NEW, temperature=1.0, seed=7, n=2)]


def world_of(llm: LLM):
    """Rank 0's world (``multiproc.RankWorld``): the dp front end's, or its one engine's executor's."""
    return getattr(llm.engine, "world", None) or llm.engine.executor.world  # type: ignore[attr-defined]


@functools.cache
def single(path: str):
    ps, params = requests()
    outs = LLM(path, **KW).generate(ps, params)
    return [[c.token_ids for c in o.outputs] for o in outs], [o.outputs[0].text for o in outs]


def run_parallel(path: str, **kw):
    ps, params = requests()
    before = set(threading.enumerate())  # earlier tests' threads are not this engine's
    t0 = time.monotonic()
    llm = LLM(path, **KW, **kw)
    try:
        out = [[c.token_ids for c in o.outputs] for o in llm.generate(ps, params)]
        assert llm.engine.pages_held() == 0
        return out, time.monotonic() - t0
    finally:
        llm.close()
        procs = world_of(llm).procs
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]  # stopped, not killed
        left = [t.name for t in threading.enumerate() if t.name.startswith("plinth-") and t not in before]
        assert not left, f"threads left after close(): {left}"  # watchdog, dp steps


@pytest.mark.parametrize("kw", [dict(tp=2), dict(ep=2, a2a="nccl")], ids=["tp2", "ep2-dp2"])
def test_moe_llm_matches_one_process(root, kw):
    path = moe(root)
    want, _ = single(path)
    got, took = run_parallel(path, **kw)
    assert got == want
    assert took < 90


def test_dense_llama_tp2_matches_one_process(root):
    path = tiny_model_dir("llama", root)
    want, _ = single(path)
    got, _ = run_parallel(path, tp=2)
    assert got == want


@pytest.mark.parametrize("kw", [dict(tp=2), dict(dp=2)], ids=["tp2", "dp2"])
def test_dropping_the_llm_releases_its_ranks_and_a_second_one_starts(root, kw):
    """``del llm`` without close(): the last reference dropping stops the
    worker ranks, the watchdog and the process groups as close() does, and
    a second multi-rank LLM in this process starts and gives the same tokens
    (before: the watchdog thread and an atexit hook kept the engine, its
    ranks ran on, and the second failed with "trying to initialize the
    default process group twice")."""
    import gc

    import torch.distributed as dist

    path = tiny_model_dir("llama", root)
    want, _ = single(path)
    ps, params = requests()
    before = set(threading.enumerate())
    llm = LLM(path, **KW, **kw)
    procs = list(world_of(llm).procs)
    first = [[c.token_ids for c in o.outputs] for o in llm.generate(ps, params)]
    del llm
    gc.collect()
    deadline = time.monotonic() + 15
    while any(p.exitcode is None for p in procs):
        assert time.monotonic() < deadline, "the worker ranks still run after the LLM was dropped"
        time.sleep(0.1)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]  # stopped, not killed
    assert not dist.is_initialized()
    while left := [t.name for t in threading.enumerate() if t.name.startswith("plinth-") and t not in before]:
        # an idle pool's threads leave once they see it gone (woken by its collection, not joined)
        assert time.monotonic() < deadline, f"threads left after the LLM was dropped: {left}"
        time.sleep(0.1)
    with LLM(path, **KW, **kw) as second:
        again = [[c.token_ids for c in o.outputs] for o in second.generate(ps, params)]
    assert first == again == want


def test_a_rank_loading_past_the_collective_timeout_is_waited_for(root, monkeypatch):
    """Rank 0 (this process) has its weights 5 s after rank 1, with a 1.5 s
    collective timeout: rank 1 waits for it through the rendezvous store
    (start-up's long timeout) before the profiling forward's first
    all-reduce, and the engine starts (before: rank 1's all-reduce timed out,
    the rank died and start-up failed)."""
    from plinth.api import SelectionContext
    from plinth.engine.model_source import locate_model
    from plinth.engine.startup import choose_model_loader
    from plinth.plugins import PluginRegistry

    path = tiny_model_dir("llama", root)
    want, _ = single(path)
    registry = PluginRegistry.discover()
    loader = choose_model_loader(registry, locate_model(path, registry), SelectionContext()).load()
    load_model = loader.load_model

    def late(self, *args, **kwargs):
        time.sleep(5.0)
        return load_model(self, *args, **kwargs)

    monkeypatch.setattr(loader, "load_model", late)
    kw = {**KW, "num_pages": None}  # sized from memory: the profiling forward runs, every rank together
    ps, params = requests()
    with LLM(path, tp=2, dist_timeout=1.5, registry=registry, **kw) as llm:
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(ps, params)]
    assert got == want


def test_bad_layouts_fail_before_loading(root):
    from plinth.errors import ConfigError

    with pytest.raises(ConfigError, match="ep must be 1 or the world"):
        LLM(moe(root), tp=2, dp=2, ep=2, a2a="nccl", **KW)
    with pytest.raises(ConfigError, match="cannot run with more than one rank"):
        LLM(moe(root), tp=2, speculative_method="ngram", **KW)


# ---- dp groups sample on their own ranks; two KV-cache groups across ranks -----------------------


def test_a_dp_groups_sample_job_crosses_as_ids_parameters_and_masks():
    """What rank 0 sends a dp group's rank (encode_job) samples there as the
    job samples here: seeded rows from their generators' uniforms, penalties,
    logit bias, min_tokens bans, a grammar as its mask, logprobs and prompt
    logprobs. No process: the wire format alone."""
    import torch
    from plinth.engine.sampler import SampleJob, Sampler, SampleRow, make_generator
    from plinth.engine.wire import decode_job, encode_job

    class EvenTokens:  # a grammar allowing only even token ids
        def mask_logits(self, logits):
            logits[1::2] = float("-inf")

    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    rows = lambda: [  # noqa: E731 - fresh generators for each side
        SampleRow(SamplingParams(temperature=0.9, seed=5, logprobs=3), [1, 2], [7], make_generator(5)),
        SampleRow(SamplingParams(temperature=0), [], [], None, grammar=EvenTokens()),
        SampleRow(SamplingParams(temperature=1.2, top_p=0.8, seed=9, repetition_penalty=1.3, frequency_penalty=0.5), [4, 4, 8], [8, 9], make_generator(9)),
        SampleRow(SamplingParams(temperature=0, logit_bias={11: 50.0}, logprobs=0), [], [], None, banned=[11]),
        SampleRow(SamplingParams(temperature=0.7, top_k=5, seed=2, min_p=0.05), [], [], make_generator(2), grammar=EvenTokens()),
    ]
    job = lambda r: SampleJob(r, at=[1, 2, 3, 4, 5], prompt=[(0, [12], 2)])  # noqa: E731
    here = job(rows()).run(logits, Sampler())
    data = encode_job(job(rows()), vocab)
    there = decode_job(data, vocab).run(logits, Sampler())
    assert there.tokens == here.tokens
    assert there.tokens[1] % 2 == 0 and there.tokens[4] % 2 == 0 and there.tokens[3] != 11
    assert there.logprobs == here.logprobs and there.logprobs[0] is not None
    assert there.prompt_logprobs == here.prompt_logprobs
    assert len(data) < logits.numel()  # parameters and ids, not a row of floats per request


def test_dp2_ranks_send_sampled_ids_not_logits_and_seeded_sampling_matches_one_process(root):
    """dp=2 (two schedulers, rank 1 samples its own rows): seeded sampling
    with penalties and logprobs gives one process's tokens, and what rank 1
    sent back is far below one float32 logits row per sampled token."""
    path = tiny_model_dir("llama", root)
    ps = prompts()
    params = [
        SamplingParams(max_tokens=NEW, temperature=0.8, seed=100 + i, logprobs=2, presence_penalty=0.3, top_p=0.95)
        for i in range(len(ps))
    ]
    one = LLM(path, **KW)
    try:
        want = one.generate(ps, params)
    finally:
        one.close()
    llm = LLM(path, dp=2, **KW)
    try:
        got = llm.generate(ps, params)
        stats = llm.engine.stats()
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        assert [lp.token_id for lp in g.outputs[0].logprobs] == [lp.token_id for lp in w.outputs[0].logprobs]
        assert [lp.logprob for lp in g.outputs[0].logprobs] == pytest.approx([lp.logprob for lp in w.outputs[0].logprobs], abs=1e-4)
    # rows rank 1 sampled: the least loaded group takes every other request
    rows, sent = stats["rank_result_rows"], stats["rank_result_bytes"]
    assert rows >= len(ps) // 2  # each of its requests sampled at least once
    assert 0 < sent < rows * llm.engine.model_config.vocab_size * 4, (sent, rows)  # their logits alone would be this


def test_two_kv_group_model_tp2_matches_one_process(root):
    """A tiny Qwen3 with sliding-window and full-attention layers (two
    KV-cache groups, each its own block table in the step payload) at tp=2
    over gloo gives one process's tokens, the seeded n=2 fork included."""
    path = tiny_model_dir("qwen3-hybrid", root)
    want, _ = single(path)
    got, _ = run_parallel(path, tp=2)
    assert got == want


# ---- platform serve over HTTP, then a worker killed mid-stream ----------------------------------


def _children(pid: int) -> dict[int, str]:
    out = {}
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        return not pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def test_serve_tp2_ep2_then_a_dead_worker_fails_loudly(root):
    import openai

    path = moe(root)
    _, texts = single(path)
    with socket_port() as port:
        url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [PLATFORM, "serve", path, "--port", str(port), "--tp", "2", "--ep", "2", "--a2a", "nccl", "--device", "cpu",
         "--backend", "torch", "--dtype", "float32", "--num-pages", "96", "--max-model-len", "512"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    workers: list[int] = []
    try:
        wait_until_healthy(proc, url, timeout=120)
        workers = [pid for pid, cmd in _children(proc.pid).items() if "plinth.engine.worker" in cmd]
        assert len(workers) == 1, _children(proc.pid)

        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        model = client.models.list().data[0].id
        for i, p in enumerate(prompts()[:3]):  # greedy over HTTP = one process's tokens
            r = client.completions.create(model=model, prompt=p, max_tokens=NEW, temperature=0)
            assert r.usage.completion_tokens == NEW
            assert r.choices[0].text == texts[i]
        assert httpx.get(url + "/version").json()["engine"]["device"] == "cpu"

        # a long stream; its worker dies after the first chunks
        stream = client.completions.create(model=model, prompt=prompts()[0], max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = 0
        t_kill = None
        with pytest.raises((openai.APIError, httpx.HTTPError)) as err:
            for _ in stream:
                chunks += 1
                if chunks == 3:
                    os.kill(workers[0], signal.SIGKILL)
                    t_kill = time.monotonic()
        assert t_kill is not None, "the stream ended before the kill"
        assert time.monotonic() - t_kill < 10, "the stream did not fail within 10 s"
        assert chunks < 400
        deadline = t_kill + 10
        while httpx.get(url + "/health", timeout=2).status_code == 200:
            assert time.monotonic() < deadline, "/health still ok 10 s after a rank died"
            time.sleep(0.2)
        # new requests get an error at once, naming the failure
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as err:
            client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=4)
        assert time.monotonic() - t0 < 5
        assert "rank" in str(err.value), err.value
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        for pid in workers:
            assert not _alive(pid), f"worker {pid} left behind"


class socket_port:
    def __enter__(self) -> int:
        import socket

        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.s.close()


def test_a_stopped_worker_fails_the_engine_within_the_timeout(root):
    """SIGSTOP: the rank is alive but silent; the collective timeout (3 s
    here) turns it into DeadRankError, and shutdown leaves nothing behind."""
    from plinth.engine.interfaces import DeadRankError

    llm = LLM(moe(root), tp=2, dist_timeout=3.0, **KW)
    (proc,) = world_of(llm).procs
    timer = threading.Timer(1.0, os.kill, (proc.pid, signal.SIGSTOP))
    t0 = time.monotonic()
    try:
        timer.start()
        with pytest.raises(DeadRankError):
            llm.generate([prompts()[0]] * 8, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        assert time.monotonic() - t0 < 1.0 + 3.0 + 7.0, "not reported within the timeout"
        with pytest.raises(DeadRankError):  # and stays failed
            llm.generate([prompts()[0]], SamplingParams(max_tokens=2))
    finally:
        timer.cancel()
        llm.close()
    proc.join(5)
    assert proc.exitcode is not None, "the stopped worker was left behind"
