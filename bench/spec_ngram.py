"""Speculative decoding (ngram) on SmolLM2-135M-Instruct: batch-1 decode and
throughput at concurrency 1, 4, 16, with and without ngram, in one process run
(issue 11's benchmark; docs/benchmarks.md).

    .venv/bin/python bench/spec_ngram.py [--json out.json] [--llamacpp]

Both engines (no speculation, ngram k=4) are loaded in the same process and
every figure is measured for the two back to back, so machine drift hits both.

* batch-1 decode ms/token: one request alone; the time from the step that
  produced the first token (the prefill step) to the last token, divided by
  the tokens after the first; median of --repeats runs. Acceptance: accepted /
  proposed tokens over those runs.
* output tok/s at concurrency c: --num-prompts requests, at most c in flight
  at once (a new one is added as soon as one finishes, like c clients), all
  output tokens / wall time, prefix cache emptied first.

Workloads (128 output tokens, EOS ignored):
* repetitive: the chat prompt "Repeat the following text exactly, word for
  word:" + a 6-sentence passage of 139 tokens (batch 1), which SmolLM2
  copies for all 128 output tokens; for the concurrency runs, request i
  starts the passage with "Passage {i+1}." and rotates its sentences by i
  mod 6. --short-passage: the first 3 sentences (83 tokens), the first
  version's workload, where the copy ends (EOS, ignored) after ~70 tokens
  and the rest is made up, so only about half the output can be copied.
* random: 64 random token ids in [1000, 40000) (seed 0 for batch 1; seed i+1
  for request i of the concurrency runs).
Sampling: greedy, or temperature 1 with seed 1234 (top-p/top-k off).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

PASSAGE = [
    "Speculative decoding lets a small proposer guess several tokens ahead, and the large model checks all of "
    "them in one forward pass.",
    "When the guesses are right, several tokens come out of a single step; when they are wrong, the model's own "
    "token is kept and nothing is lost but a little work.",
    "Prompt lookup is the simplest proposer: it copies what followed the last few tokens earlier in the text.",
    "It needs no second model and no training, only the prompt and the output so far.",
    "It works best when the answer repeats the question, as in editing, summarising or quoting a document.",
    "On random text it rarely finds a match, and then it proposes nothing at all.",
]
#: the first version's passage (--short-passage): 83 tokens, so SmolLM2 ended its copy
#: (EOS, ignored) after ~70 of the 128 output tokens and made up the rest
SHORT = 3
INSTRUCTION = "Repeat the following text exactly, word for word:\n\n"


def chat(tok, text: str) -> list[int]:
    return tok.encode(
        tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
        add_special_tokens=False,
    )


def random_prompt(seed: int, n: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def spec_counts(llm) -> tuple[int, int]:
    s = llm.engine.spec
    return (s.num_proposed, s.num_accepted) if s is not None else (0, 0)


def batch1(llm, prompt: list[int], params, rid: str) -> tuple[float, float, int]:
    """(decode ms/token after the first token, end-to-end ms/token, tokens)."""
    engine = llm.engine
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    t_first = None
    n = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if t_first is None and n >= 1:
                t_first, n_first = now, n
    t_end = time.perf_counter()
    return (t_end - t_first) / (n - n_first) * 1000, (t_end - t0) / n * 1000, n


def throughput(llm, prompts: list[list[int]], params, conc: int, tag: str) -> dict:
    engine = llm.engine
    engine.kv.reset_prefix_cache()
    pending = list(enumerate(prompts))
    done_tokens = 0
    inflight = set()
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < conc:
            i, p = pending.pop(0)
            rid = f"{tag}-{i}"
            engine.add_request(rid, p, params)
            inflight.add(rid)
        for o in engine.step():
            if o.finished:
                inflight.discard(o.request_id)
                done_tokens += len(o.outputs[0].token_ids)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": done_tokens, "output_tok_s": done_tokens / dt}


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--skip", default="", help="comma-separated: batch1, throughput")
    ap.add_argument("--throughput-sampled", action="store_true", help="also the concurrency runs at temperature 1")
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp batch-1 on the same GGUF (llama_cpp installed)")
    ap.add_argument("--short-passage", action="store_true", help="the first version's 3-sentence passage")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    import torch
    from plinth.engine.llm import LLM
    from plinth.engine.sampling_params import SamplingParams

    res: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
                 "args": vars(args), "load_start": loadavg()}
    llms = {
        "none": LLM(load_progress=False, kv_cache_memory=1.0),
        "ngram": LLM(load_progress=False, kv_cache_memory=1.0, speculative_method="ngram", num_speculative_tokens=args.k),
    }
    d = llms["none"].engine.components.describe()
    res["engine"] = {k: d.get(k) for k in ("device", "device_name", "isa", "backend", "dtype")}
    res["model"] = str(llms["none"].engine.components.source.path)
    print(f"cpu: {d.get('device_name')}; isa: {','.join(d.get('isa') or [])}; backend {d.get('backend')}, "
          f"{d.get('dtype')}; {res['threads']} threads; torch {res['torch']}; load {res['load_start']}", flush=True)

    tok = llms["none"].get_tokenizer()
    passage = PASSAGE[:SHORT] if args.short_passage else PASSAGE
    rep = chat(tok, INSTRUCTION + " ".join(passage))
    rnd = random_prompt(0)
    N = args.max_tokens
    samplings = {
        "greedy": SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
        "T=1": SamplingParams(max_tokens=N, temperature=1.0, seed=1234, ignore_eos=True),
    }
    for llm in llms.values():  # warm up both, on both prompts
        for p in (rep, rnd):
            llm.generate([p], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))

    if "batch1" not in skip:
        res["batch1"] = []
        for wname, prompt in (("repetitive", rep), ("random", rnd)):
            for sname, sp in samplings.items():
                row = {"workload": wname, "sampling": sname, "prompt_tokens": len(prompt), "load": loadavg()}
                for name, llm in llms.items():
                    p0 = spec_counts(llm)
                    dec, e2e = [], []
                    for r in range(args.repeats):
                        a, b, n = batch1(llm, prompt, sp, f"b1-{name}-{wname}-{sname}-{r}")
                        assert n == N, n
                        dec.append(a)
                        e2e.append(b)
                    p1 = spec_counts(llm)
                    row[name] = {"decode_ms": statistics.median(dec), "decode_ms_all": dec,
                                 "e2e_ms": statistics.median(e2e)}
                    if name != "none":
                        prop, acc = p1[0] - p0[0], p1[1] - p0[1]
                        row[name].update(proposed=prop, accepted=acc, acceptance=acc / prop if prop else 0.0)
                row["speedup"] = row["none"]["decode_ms"] / row["ngram"]["decode_ms"]
                res["batch1"].append(row)
                g = row["ngram"]
                print(f"batch1 {wname:10s} {sname:6s} none {row['none']['decode_ms']:.2f} ms/tok  ngram {g['decode_ms']:.2f} "
                      f"ms/tok  speed-up {row['speedup']:.2f}x  acceptance {g['acceptance']:.2f} ({g['accepted']}/{g['proposed']})"
                      f"  [runs none {[f'{x:.1f}' for x in row['none']['decode_ms_all']]} ngram "
                      f"{[f'{x:.1f}' for x in g['decode_ms_all']]}; load {row['load']}]", flush=True)

    if "throughput" not in skip:
        res["throughput"] = []
        m = len(passage)
        reps = [chat(tok, INSTRUCTION + f"Passage {i + 1}. " + " ".join(passage[i % m:] + passage[: i % m]))
                for i in range(args.num_prompts)]
        rnds = [random_prompt(i + 1) for i in range(args.num_prompts)]
        sets = [("repetitive", reps, "greedy"), ("random", rnds, "greedy")]
        if args.throughput_sampled:
            sets += [("repetitive", reps, "T=1"), ("random", rnds, "T=1")]
        for wname, prompts, sname in sets:
            for c in [int(x) for x in args.concurrency.split(",")]:
                row = {"workload": wname, "sampling": sname, "concurrency": c, "load": loadavg()}
                for name, llm in llms.items():
                    p0 = spec_counts(llm)
                    row[name] = throughput(llm, prompts, samplings[sname], c, f"tp-{name}-{wname}-{sname}-{c}")
                    p1 = spec_counts(llm)
                    if name != "none":
                        prop, acc = p1[0] - p0[0], p1[1] - p0[1]
                        row[name].update(proposed=prop, accepted=acc, acceptance=acc / prop if prop else 0.0)
                row["speedup"] = row["ngram"]["output_tok_s"] / row["none"]["output_tok_s"]
                res["throughput"].append(row)
                print(f"tput {wname:10s} {sname:6s} c={c:2d} none {row['none']['output_tok_s']:.1f} tok/s  ngram "
                      f"{row['ngram']['output_tok_s']:.1f} tok/s  ratio {row['speedup']:.2f}x  acceptance "
                      f"{row['ngram']['acceptance']:.2f}  [load {row['load']}]", flush=True)

    model_path = res["model"]
    del llms
    if args.llamacpp and model_path.endswith(".gguf"):
        import llama_cpp

        lc = llama_cpp.Llama(model_path=model_path, n_ctx=2048, n_threads=res["threads"], n_batch=512, verbose=False)
        res["llamacpp"] = []
        for wname, prompt in (("repetitive", rep), ("random", rnd)):
            times = []
            for _ in range(args.repeats):
                lc.reset()
                lc.eval(prompt)
                tk = lc.sample(temp=0.0)
                t = time.perf_counter()
                for _ in range(N - 1):
                    lc.eval([tk])
                    tk = lc.sample(temp=0.0)
                times.append((time.perf_counter() - t) / (N - 1) * 1000)
            res["llamacpp"].append({"workload": wname, "sampling": "greedy", "decode_ms": statistics.median(times),
                                    "decode_ms_all": times, "load": loadavg()})
            print(f"llama.cpp batch1 {wname:10s} greedy {statistics.median(times):.2f} ms/tok "
                  f"[{[f'{x:.1f}' for x in times]}; load {loadavg()}]", flush=True)
    res["load_end"] = loadavg()
    print(f"load at end: {res['load_end']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
