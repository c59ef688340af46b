"""Deterministic serving end to end (``LLM(deterministic=True)``, issue 24):
a prompt's greedy tokens, and its logits bit for bit (``torch.equal``), do
not depend on what runs beside it, on a prefix-cache hit, on the page size,
on how its prefill is chunked (the step token budget) or on speculative
decoding (ngram and a draft model).

On the default path users get (SmolLM2-135M GGUF, bfloat16, the default
backend) and on a bfloat16 Hugging Face folder of SmolLM2's shape (random
weights: 576 hidden, 9 query / 3 KV heads, 1536 intermediate), the latter
also on the torch reference backend alone. Each model's
reference is each target prompt generated alone, on a fresh engine with
pages of 16 and a 256-token step budget."""

from __future__ import annotations

import bisect
import json
import os
import random
from typing import Any

import pytest
import torch
from plinth.engine.llm import LLM
from plinth.engine.sampling_params import SamplingParams
from server_fixtures import smollm2_missing
from tiny_models import VOCAB, write_tokenizer

#: greedy tokens each target generates (EOS ignored: every run the same length)
NEW_TOKENS = 16
BASE = dict(load_progress=False, dtype="bfloat16", max_model_len=1024, kv_cache_memory=0.5, max_num_seqs=32)


class LogitsRecorder:
    """Wraps the engine's model runner: every logits row it returns for a
    target prompt, by (prompt, position of the token it follows). A
    position computed again (after a preemption, or a rejected proposal)
    keeps its last computation, the one with the sequence's real tokens."""

    def __init__(self, llm: LLM, targets: list[list[int]]) -> None:
        self.targets = {tuple(t) for t in targets}
        self.rows: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
        runner: Any = llm.engine.executor.runner  # type: ignore[attr-defined]
        execute = runner.execute

        def recording(batch: Any, rows: Any) -> torch.Tensor:
            logits = execute(batch, rows)
            starts = [0]
            for n in batch.num_tokens:
                starts.append(starts[-1] + n)
            for j, flat in enumerate(rows):
                i = bisect.bisect_right(starts, flat) - 1
                seq = batch.seqs[i]
                prompt = tuple(seq.request.prompt_token_ids)
                if prompt in self.targets:
                    self.rows[(prompt, seq.num_computed + flat - starts[i])] = logits[j].clone()
            return logits

        runner.execute = recording

    def decode_rows(self, prompt: list[int]) -> list[torch.Tensor]:
        """The logits rows that chose each of the NEW_TOKENS tokens."""
        return [self.rows[(tuple(prompt), len(prompt) - 1 + k)] for k in range(NEW_TOKENS)]


def run(
    llm: LLM, targets: list[list[int]], others: list[tuple[list[int], int]] = (), *, seeded: bool = False
) -> tuple[list[list[int]], LogitsRecorder]:
    """The targets' greedy tokens (``seeded``: sampled at temperature 1 with
    top_p 0.9, each target's own seed), submitted at once with ``others``
    (prompt, max tokens) interleaved among them, and their logits."""
    rec = LogitsRecorder(llm, targets)
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    where: list[int] = []
    work = [(p, NEW_TOKENS, True) for p in targets] + [(p, n, False) for p, n in others]
    random.Random(len(work)).shuffle(work)
    for p, n, is_target in work:
        if is_target:
            where.append(len(prompts))
        prompts.append(p)
        if is_target and seeded:
            # the seed is the prompt's own (its length: the targets' differ), alone or among others
            params.append(SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9, seed=1000 + len(p), ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    outs = llm.generate(prompts, params)
    by_prompt = {tuple(prompts[i]): list(outs[i].outputs[0].token_ids) for i in where}
    return [by_prompt[tuple(t)] for t in targets], rec


def assert_same(ref: tuple[list[list[int]], LogitsRecorder], got: tuple[list[list[int]], LogitsRecorder], targets: list[list[int]], what: str) -> None:
    (want_tokens, want), (tokens, rec) = ref, got
    for t, (a, b) in enumerate(zip(want_tokens, tokens)):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert first is None, f"{what}: target {t} (prompt of {len(targets[t])} tokens) diverges at token {first}: {a[first:first + 4]} vs {b[first:first + 4]}"
    for t, prompt in enumerate(targets):
        for k, (x, y) in enumerate(zip(want.decode_rows(prompt), rec.decode_rows(prompt))):
            assert torch.equal(x, y), f"{what}: target {t}, logits of new token {k} differ (max |diff| {float((x - y).abs().max())})"


def workload(vocab: int, low: int) -> tuple[list[list[int]], list[tuple[list[int], int]]]:
    """Three targets (a short, a page-crossing and a longer prompt) and 16 short others of mixed lengths."""
    rng = random.Random(24)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(low, vocab) for _ in range(n)]

    phrase = prompt(20)  # the long target repeats itself: ngram speculation finds something to propose
    targets = [prompt(9), prompt(40), phrase * 4]
    others = [(prompt(rng.randint(4, 48)), rng.randint(4, 12)) for _ in range(16)]
    return targets, others


# ---- the models ----------------------------------------------------------------------------


def smol_shaped_bf16_folder(root: str) -> str:
    """A bfloat16 HF folder with SmolLM2-135M's layer shapes (4 layers, random
    weights) and the tiny test tokenizer."""
    import transformers

    path = os.path.join(root, "smol-shaped-bf16")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
        eos_token_id=263, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(24)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.06)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    return path


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("smollm2-gguf", marks=pytest.mark.slow),
        "bf16-folder",
        "bf16-folder-torch",  # the reference backend: the engine's side (sampler, scheduler, verification) on its own
    ],
)
def model(request, tiny_root) -> dict[str, Any]:
    """The model, its targets and others, the draft model, and the reference
    (each target alone, on a fresh engine)."""
    if request.param == "smollm2-gguf":
        why = smollm2_missing()
        if why:
            pytest.skip(why)
        path, vocab, low = None, 49152, 200
    else:
        path, vocab, low = smol_shaped_bf16_folder(tiny_root), VOCAB, 0
    engine = dict(BASE, backend="torch" if request.param.endswith("-torch") else "auto")
    targets, others = workload(vocab, low)
    llm = LLM(path, deterministic=True, page_size=16, max_num_batched_tokens=256, enable_prefix_caching=False, **engine)
    assert llm.engine.describe()["deterministic"] is True
    alone = [run(llm, [t]) for t in targets]
    rec = alone[0][1]
    for _, r in alone[1:]:
        rec.rows.update(r.rows)
    reference = ([tokens[0] for tokens, _ in alone], rec)
    if request.param == "smollm2-gguf":
        from test_speculative_smollm2 import tiny_draft_for

        draft = tiny_draft_for(llm.engine.components.source.path, vocab, os.path.join(tiny_root, "smollm2-draft"))  # type: ignore[attr-defined]
    else:
        from tiny_models import tiny_model_dir

        draft = tiny_model_dir("llama", tiny_root)
    yield dict(
        name=request.param, path=path, targets=targets, others=others, reference=reference, llm=llm, draft=draft, engine=engine
    )
    llm.close()


# ---- the guarantees ------------------------------------------------------------------------


def test_alone_equals_among_16_concurrent_others(model):
    got = run(model["llm"], model["targets"], model["others"])
    assert_same(model["reference"], got, model["targets"], f"{model['name']}: among 16 others")


def test_pages_of_7_chunked_prefill_and_a_prefix_cache_hit_change_nothing(model):
    """Pages of 7 and a 32-token step budget (the long prompts prefilled in
    chunks beside running decodes), cold; then the same again, each target's
    prompt pages now in the prefix cache."""
    with LLM(model["path"], deterministic=True, page_size=7, max_num_batched_tokens=32, **model["engine"]) as llm:
        cold = run(llm, model["targets"], model["others"])
        assert_same(model["reference"], cold, model["targets"], f"{model['name']}: pages of 7, 32-token steps")
        before = llm.engine.stats()["prefix_cache_local_hit_tokens"]
        warm = run(llm, model["targets"])
        assert llm.engine.stats()["prefix_cache_local_hit_tokens"] - before >= 35 + 77  # full pages of the two longer prompts
        assert_same(model["reference"], warm, model["targets"], f"{model['name']}: prefix-cache hit")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_equals_plain_decoding(model, method):
    # ngram: a one-token match is enough, so proposals come from any model's output (the test's
    # random-weight folder repeats no phrase of its own)
    extra = {"speculative_model": model["draft"]} if method == "draft" else {"plugin_options": {"ngram_min_n": 1}}
    with LLM(
        model["path"], deterministic=True, page_size=16, max_num_batched_tokens=256, speculative_method=method,
        num_speculative_tokens=4, **extra, **model["engine"],
    ) as llm:  # fmt: skip
        llm.engine.spec.cost_model = None  # type: ignore[attr-defined]  # every proposal scored, whatever this machine's timing
        got = run(llm, model["targets"], model["others"])
        stats = llm.engine.stats()
    assert_same(model["reference"], got, model["targets"], f"{model['name']}: {method} speculation")
    # verification ran (every position's logits from a several-token forward), whether or not a proposal passed
    assert stats["spec_proposed_tokens"] > 0


def test_preemption_and_seeded_sampling_change_nothing(model):
    """Too few pages for the workload (sequences preempted and recomputed),
    greedy and then seeded sampling: each target's tokens and logits are
    those it gets alone."""
    with LLM(model["path"], deterministic=True, page_size=7, num_pages=40, max_num_batched_tokens=64, **model["engine"]) as llm:
        greedy = run(llm, model["targets"], model["others"])
        assert llm.engine.stats()["preemptions"] > 0  # 40 pages of 7 cannot hold the 19 sequences at once
        assert_same(model["reference"], greedy, model["targets"], f"{model['name']}: preempted")
        seeded = run(llm, model["targets"], model["others"], seeded=True)
    alone = [run(model["llm"], [t], seeded=True) for t in model["targets"]]
    for _, rec in alone[1:]:
        alone[0][1].rows.update(rec.rows)
    reference = ([tokens[0] for tokens, _ in alone], alone[0][1])
    assert reference[0] != model["reference"][0]  # sampling, not greedy
    assert_same(reference, seeded, model["targets"], f"{model['name']}: seeded sampling among others, preempted")


@pytest.mark.slow
def test_served_with_the_flag_over_http(tiny_root):
    """``platform serve --deterministic`` on the bf16 folder: /version says
    the mode, and the official openai client gets each prompt's greedy
    text (and token logprobs) alone equal to what it gets among 16
    concurrent others."""
    import signal
    import socket
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import httpx
    import openai
    from server_fixtures import wait_until_healthy

    path = smol_shaped_bf16_folder(tiny_root)
    targets, others = workload(VOCAB, 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [str(Path(sys.executable).with_name("platform")), "serve", path, "--port", str(port), "--deterministic"]
    cmd += ["--dtype", "bfloat16", "--max-model-len", "1024", "--kv-cache-memory", "0.5", "--max-num-batched-tokens", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_healthy(proc, url, timeout=240)
        assert httpx.get(url + "/version").json()["engine"]["deterministic"] is True
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id

        def complete(prompt: list[int], n: int = NEW_TOKENS) -> tuple[str, list[float]]:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
            return r.choices[0].text, list(r.choices[0].logprobs.token_logprobs)

        alone = [complete(t) for t in targets]
        work = [(t, NEW_TOKENS) for t in targets] + others
        with ThreadPoolExecutor(len(work)) as pool:
            together = list(pool.map(lambda w: complete(*w), work))[: len(targets)]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert all(len(lp) == NEW_TOKENS for _, lp in alone)
    assert together == alone


def tiny_moe_folder(root: str) -> str:
    """The tiny Qwen3-MoE folder of the llama plugin's tests, with the tiny tokenizer."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins/models/llama/tests"))
    from tiny_moe import saved_model

    path = saved_model("qwen3moe", root)
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        write_tokenizer(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(dict(tp=3), id="tp3"),  # the bf16 folder: 9 heads, 3 KV heads
        pytest.param(dict(ep=2, a2a="nccl"), id="ep2"),  # the tiny MoE: experts over 2 ranks (dp 2)
        pytest.param(dict(dp=2), id="dp2"),  # the tiny MoE: two schedulers
    ],
)
def test_parallel_alone_equals_among_16_concurrent_others(tiny_root, layout):
    """Across ranks (over gloo), each target's greedy tokens and their
    logprobs alone equal those among 16 others, in steps of 32 tokens
    (chunked prefills beside decodes). Without the mode, tp2, ep2 and dp2
    each gave all three targets other tokens or logprobs (measured once)."""
    if "tp" in layout:
        path, (targets, others) = smol_shaped_bf16_folder(tiny_root), workload(VOCAB, 0)
    else:
        path, (targets, others) = tiny_moe_folder(tiny_root), workload(250, 3)

    def generate(llm: LLM, work: list[tuple[list[int], int]]) -> list[tuple[list[int], list[float]]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0) for _, n in work]
        outs = llm.generate([p for p, _ in work], params)
        return [(list(o.outputs[0].token_ids), [lp.logprob for lp in o.outputs[0].logprobs or []]) for o in outs]

    with LLM(path, deterministic=True, page_size=16, max_num_batched_tokens=32, **dict(BASE, backend="auto"), **layout) as llm:
        alone = [generate(llm, [(t, NEW_TOKENS)])[0] for t in targets]
        work = [(t, NEW_TOKENS) for t in targets] + others
        random.Random(7).shuffle(work)
        together = generate(llm, work)
    by_prompt = {tuple(p): r for (p, _), r in zip(work, together)}
    for t, want in zip(targets, alone):
        assert len(want[1]) == NEW_TOKENS
        assert by_prompt[tuple(t)] == want
