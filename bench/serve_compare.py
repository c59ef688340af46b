#!/usr/bin/env python
"""Our server against `transformers serve`, on the same SmolLM2 weights, in one run.

    .venv/bin/python bench/serve_compare.py            # about 15-25 minutes on 2 cores

1. Converts the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) once into a
   Hugging Face folder in a temporary directory: `transformers serve` cannot
   load a GGUF file itself (the GGUF config names no architecture, and a
   GGUF-quantized model refuses `save_pretrained`), so the dequantized weights
   are copied into a plain LlamaForCausalLM and saved as float32 safetensors
   with the GGUF's tokenizer and chat template. Both servers then compute in
   bfloat16 from the same dequantized values.
2. Starts `platform serve` (the GGUF, --dtype bfloat16), runs `platform bench
   serve` at each concurrency, stops it; then does the same with `transformers
   serve FOLDER --device cpu --continuous-batching --dtype bfloat16`. Never
   both servers at once. Every run uses the same prompts (same seed, same
   tokenizer: the saved tokenizer.json) and fixed output lengths (ignore_eos
   for ours; for transformers, which rejects unknown fields, eos_token_id=-1
   through its `generation_config` request field).
3. Runs our offline engine (`plinth.LLM.generate`) on the prompts of the
   highest concurrency with max_num_seqs equal to that concurrency: the
   serving overhead is 1 - server throughput / offline throughput.
4. Writes the table, the ratios (ours / transformers), the machine and the
   command into the "Serving" section of docs/benchmarks.md (only between its
   markers) and a comparison plot next to it; every run's result JSON and plot
   go to bench/results/serve/ (not committed).

The machine is shared with whatever else runs on it: the load average before
each run is recorded, and a warning is printed when it is above 1.5.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
PLATFORM = str(VENV_BIN / "platform")
TRANSFORMERS = str(VENV_BIN / "transformers")
DOC = REPO / "docs" / "benchmarks.md"
DOC_PLOT = REPO / "docs" / "benchmarks-serving.png"
BEGIN, END = "<!-- serving:begin -->", "<!-- serving:end -->"

#: prompts per concurrency: several waves at each level
NUM_PROMPTS = {1: 8, 4: 16, 16: 32}
#: transformers serve's continuous batching, sized for this workload. Its
#: defaults on CPU (page 256, max_batch_tokens 8192, an attention mask of
#: max_batch_tokens x (cache + max_batch_tokens) every step) were several
#: times slower here; these are the best of the few we tried.
TRANSFORMERS_CB_ARGS = ["--cb-block-size", "16", "--cb-num-blocks", "1024", "--cb-max-batch-tokens", "256"]


def log(msg: str) -> None:
    print(f"[serve_compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> float:
    return os.getloadavg()[0]


def machine() -> dict:
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
                break
    except OSError:
        pass
    import importlib.metadata as md

    def ver(d: str) -> str:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            return "-"

    return {
        "cpu": cpu, "cores": os.cpu_count(), "memory": mem, "python": platform.python_version(),
        "torch": ver("torch"), "transformers": ver("transformers"), "plinth-core": ver("plinth-core"),
    }


# ---------------------------------------------------------------------------
# the weights for transformers serve
# ---------------------------------------------------------------------------


def prepare_hf_folder(out: Path) -> None:
    """Run in a child process: GGUF -> a plain HF folder (float32 safetensors + tokenizer)."""
    from plinth.bench.peers import gguf_to_hf_folder
    from plinth.engine.model_source import default_model_path

    gguf_to_hf_folder(default_model_path(), out)


# ---------------------------------------------------------------------------
# servers
# ---------------------------------------------------------------------------


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def start_server(cmd: list[str], url: str, logfile: Path, env: dict | None = None) -> subprocess.Popen:
    log(f"start: {shlex.join(cmd)}  (log: {logfile})")
    f = open(logfile, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    t = time.monotonic()
    wait_ready(url, proc)
    log(f"ready in {time.monotonic() - t:.0f} s")
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and its children, nothing else
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------


def bench_args(args: argparse.Namespace, url: str, model: str, tokenizer: str, conc: int, out: Path,
               extra: list[str]) -> list[str]:
    return [
        PLATFORM, "--log-level", "WARNING", "bench", "serve", "--base-url", url, "--model", model,
        "--endpoint", args.endpoint, "--dataset", "random", "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--num-prompts", str(NUM_PROMPTS.get(conc, 2 * conc)),
        "--max-concurrency", str(conc), "--seed", str(args.seed + conc), "--tokenizer", tokenizer,
        "--save-result", str(out.with_suffix(".json")), "--plot", str(out.with_suffix(".png")),
        "--metric-percentiles", "50,90,99", *extra,
    ]


def _busy_jiffies() -> int:
    """All CPUs' busy time (user, nice, system, irq, softirq, steal) from /proc/stat, in clock ticks."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)


def _proc_jiffies(pid: int) -> int:
    """utime + stime of one process (all its threads)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def wait_quiet(server_pid: int | None, max_cores: float, timeout: float, window: float = 5.0) -> float:
    """Wait (up to ``timeout`` s) for a ``window`` in which processes other than the server use under
    ``max_cores``; the other processes' cores in the last window."""
    hz = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + timeout
    said = False
    while True:
        b0, s0 = _busy_jiffies(), _proc_jiffies(server_pid) if server_pid else 0
        time.sleep(window)
        b1, s1 = _busy_jiffies(), _proc_jiffies(server_pid) if server_pid else 0
        other = max(0.0, ((b1 - b0) - (s1 - s0)) / hz / window)
        if other < max_cores or time.monotonic() > deadline:
            if said:
                log(f"other processes now use {other:.2f} cores: going on")
            return other
        if not said:
            log(f"waiting for a quiet machine: other processes use {other:.2f} cores")
            said = True


def run_bench(cmd: list[str], server_pid: int) -> dict:
    """One `platform bench serve` run, and the CPU the server, the client and everything else used meanwhile."""
    la = loadavg()
    if la > 1.5:
        log(f"warning: load average {la:.2f} before this run: other work on the machine skews it")
    log(shlex.join(cmd))
    srv0 = _proc_jiffies(server_pid)
    subprocess.run(cmd, check=True)
    srv1 = _proc_jiffies(server_pid)
    res = json.loads(Path(cmd[cmd.index("--save-result") + 1]).read_text())
    res["loadavg_before"] = la
    # average cores over the measured window; the server is idle outside it but for the one test request
    dur = res["duration"]
    res["cores_server"] = (srv1 - srv0) / os.sysconf("SC_CLK_TCK") / dur
    res["cores_client"] = res.get("client_cpu_cores") or 0.0
    busy = res.get("machine_busy_cores")
    res["cores_other"] = max(0.0, busy - res["cores_server"] - res["cores_client"]) if busy is not None else float("nan")
    if res["cores_other"] > 0.2:
        log(f"warning: other processes used {res['cores_other']:.2f} cores on average during this run")
    return res


OFFLINE_CODE = r"""
import json, sys, time
from plinth import LLM
from plinth.engine.sampling_params import SamplingParams
spec = json.loads(sys.argv[1])
llm = LLM(dtype="bfloat16", max_num_seqs=spec["max_num_seqs"], load_progress=False)
# warm up on other prompts of the same shape (the server was warm too; the same prompts would hit the prefix cache)
llm.generate(spec["warmup"], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in spec["output_lens"]]
t = time.perf_counter()
outs = llm.generate(spec["prompts"], params)
dt = time.perf_counter() - t
print(json.dumps({"duration": dt, "total_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                  "total_input_tokens": sum(len(o.prompt_token_ids) for o in outs), "num_prompts": len(outs)}))
"""


def run_offline(prompts: list[str], output_lens: list[int], max_num_seqs: int, warmup: list[str]) -> dict:
    la = loadavg()
    log(f"offline engine: {len(prompts)} prompts, max_num_seqs {max_num_seqs} (load average {la:.2f})")
    import resource

    spec = json.dumps({"prompts": prompts, "output_lens": output_lens, "max_num_seqs": max_num_seqs,
                       "warmup": warmup})
    hz = os.sysconf("SC_CLK_TCK")
    busy0, ru0, t0 = _busy_jiffies(), resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    out = subprocess.run([sys.executable, "-c", OFFLINE_CODE, spec], check=True, capture_output=True, text=True)
    wall = time.monotonic() - t0
    busy1, ru1 = _busy_jiffies(), resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["output_throughput"] = res["total_output_tokens"] / res["duration"]
    res["loadavg_before"] = la
    res["cores_other"] = max(0.0, (busy1 - busy0) / hz - mine) / wall  # over the whole child, loading included
    return res


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------


def plot(results: dict, offline: dict | None, concs: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("plinth", "transformers") if n in results]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = (("output_throughput", "output throughput (tok/s)", False), ("median_ttft_ms", "median TTFT (ms)", True),
              ("median_tpot_ms", "median TPOT (ms)", True), ("median_e2el_ms", "median E2EL (ms)", True))
    for ax, (key, title, logy) in zip(axes, panels, strict=True):
        for name in names:
            xs = [c for c in concs if c in results[name]]
            ax.plot(xs, [results[name][c][key] for c in xs], marker="o", label=name)
        if key == "output_throughput" and offline:
            ax.scatter([max(concs)], [offline["output_throughput"]], marker="*", s=150, color="k",
                       label="plinth offline engine", zorder=5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("max concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, bf16, 2 CPU cores: platform serve vs transformers serve")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def fmt(x: float, nd: int = 1) -> str:
    return f"{x:,.{nd}f}"


def tool_doc() -> list[str]:
    """How `platform bench serve` measures, with the dataset parameters read from the code."""
    from plinth.bench.serve import DEFAULT_SCALE, SCENARIOS, SHAREGPT_LIKE

    sg = SHAREGPT_LIKE
    L = ["### `platform bench serve`", ""]
    L.append(
        "`platform bench serve --base-url URL [--model NAME] [--endpoint /v1/completions|/v1/chat/completions] "
        "[--dataset random|sharegpt-like] [--input-len N] [--output-len N] [--range-ratio R] [--num-prompts N] "
        "[--max-concurrency N] [--request-rate RPS] [--seed S] [--scenario NAME [--scale F]] [--tokenizer PATH] "
        "[--save-result FILE.json] [--plot FILE.png]` streams every request (SSE, `stream_options.include_usage`) "
        "and reports what `vllm bench serve` reports, under its names: `completed`, `failed`, `duration`, "
        "`total_input_tokens`, `total_output_tokens`, `request_throughput`, `output_throughput`, "
        "`total_token_throughput`, `max_output_tokens_per_s`, `max_concurrent_requests`, and "
        "`mean_`/`median_`/`std_`/`p99_` (or `--metric-percentiles`) `ttft_ms`, `tpot_ms`, `itl_ms`, `e2el_ms`. "
        "TTFT: to the first content chunk. ITL: the gaps between content chunks. TPOT: (E2EL - TTFT) / (output "
        "tokens - 1). E2EL: until the stream ends. Output tokens come from the server's `usage`, else "
        "`--tokenizer`, else the count of content chunks. Requests arrive all at once (`--request-rate inf`, the "
        "default) or as a Poisson process. A failed request is counted, its error kept in the result file and "
        "summarised on screen; it never stops the run. `--ignore-eos` (on by default) keeps output lengths fixed."
    )
    L.append("")
    L.append(
        "Datasets are generated offline from `--seed`. `random`: random common English words fitted to the "
        "token length with `--tokenizer`, else the server's `/tokenize`, else characters / 4; lengths uniform in "
        "`[len*(1-r), len*(1+r)]` (`--range-ratio r`, default 0). `sharegpt-like`: the same kind of text with "
        f"input and output lengths drawn from log-normal distributions with ShareGPT's published means "
        f"({sg['input_mean']} input and {sg['output_mean']} output tokens per request, the vLLM paper, Kwon et "
        f"al. 2023, Fig. 11) and sigmas {sg['input_sigma']} and {sg['output_sigma']} (our choice, for ShareGPT's "
        f"long tail: medians about {_lognormal_median(sg['input_mean'], sg['input_sigma']):.0f} and "
        f"{_lognormal_median(sg['output_mean'], sg['output_sigma']):.0f}), clipped as vLLM filters ShareGPT (at "
        f"least {sg['min_len']} tokens, prompts at most {sg['max_input']}, prompt + output at most "
        f"{sg['max_total']}). Only the lengths are ShareGPT's; the text is random words."
    )
    L.append("")
    L.append(f"Scenarios (`--scenario`) are LMDeploy's four, with every token length multiplied by `--scale` "
             f"(default 1/{round(1 / DEFAULT_SCALE)}) so that SmolLM2-135M on 2 CPU cores runs each in minutes:")
    L.append("")
    L.append("| scenario | LMDeploy's lengths (in / out) | at the default scale | prompts |")
    L.append("|---|---|---|---:|")
    for name, sc in SCENARIOS.items():
        if sc["dataset"] == "random":
            full = f"{sc['input_len']} / {sc['output_len']}"
            scaled = f"{round(sc['input_len'] * DEFAULT_SCALE)} / {round(sc['output_len'] * DEFAULT_SCALE)}"
        else:
            full = f"ShareGPT-like, means {sg['input_mean']:.0f} / {sg['output_mean']:.0f}"
            scaled = (f"means about {sg['input_mean'] * DEFAULT_SCALE:.0f} / "
                      f"{sg['output_mean'] * DEFAULT_SCALE:.0f}")
        L.append(f"| `{name}` | {full} | {scaled} | {sc['num_prompts']} |")
    L.append("")
    return L


def _lognormal_median(mean: float, sigma: float) -> float:
    import math

    return math.exp(math.log(mean) - sigma**2 / 2)


def section(args: argparse.Namespace, results: dict, offline: dict | None, concs: list[int], info: dict,
            command: str, started: str, elapsed: float) -> str:
    L = [BEGIN, "## Serving", ""]
    L += tool_doc()
    L.append("### plinth vs `transformers serve`")
    L.append("")
    L.append(
        f"`platform bench serve` against `platform serve` (plinth) and `transformers serve` on the same "
        f"SmolLM2-135M-Instruct weights (the bundled Q4_1 GGUF, dequantized, computed in bfloat16), one server at a "
        f"time, the same prompts: `{args.endpoint}`, random words fitted to {args.input_len} prompt tokens, "
        f"{args.output_len} output tokens (EOS ignored), greedy, all requests at once up to the concurrency limit; "
        f"{', '.join(f'{NUM_PROMPTS.get(c, 2 * c)} prompts at concurrency {c}' for c in concs)} (a different "
        f"seed per level, so that no level hits the prefix cache of another)."
    )
    L.append("")
    L.append(f"Measured {started} on {info['cpu']} ({info['cores']} cores, {info['memory']}), Python "
             f"{info['python']}, torch {info['torch']}, transformers {info['transformers']}, plinth-core "
             f"{info['plinth-core']}; the whole run took {elapsed / 60:.0f} minutes. transformers serve ran with "
             f"`--continuous-batching {' '.join(TRANSFORMERS_CB_ARGS)}`: with its CPU defaults (pages of 256, "
             f"max_batch_tokens 8192) it was several times slower in our trials. The machine is shared: the last "
             f"column is the average number of cores the server, the benchmark client and all other processes "
             f"used during each run (from /proc). Before each run the script waits for other processes to go "
             f"below {args.quiet_cores} cores, and repeats a run they disturbed more than that on a fresh server (up "
             f"to {args.retries} times), keeping the least disturbed.")
    L.append("")
    L.append("Reproduce:")
    L.append("")
    L.append("```")
    L.append(command)
    L.append("```")
    L.append("")
    L.append("| server | concurrency | completed / failed | output tok/s | total tok/s | median TTFT ms | p99 TTFT ms "
             "| median TPOT ms | median ITL ms | median E2EL ms | cores: server / client / other |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("plinth", "transformers"):
        for c in concs:
            r = results.get(name, {}).get(c)
            if r is None:
                continue
            L.append(f"| {name} | {c} | {r['completed']} / {r['failed']} | {fmt(r['output_throughput'])} | "
                     f"{fmt(r['total_token_throughput'])} | {fmt(r['median_ttft_ms'], 0)} | {fmt(r['p99_ttft_ms'], 0)} | "
                     f"{fmt(r['median_tpot_ms'])} | {fmt(r['median_itl_ms'])} | {fmt(r['median_e2el_ms'], 0)} | "
                     f"{r['cores_server']:.2f} / {r['cores_client']:.2f} / {r['cores_other']:.2f} |")
    L.append("")
    if "plinth" in results and "transformers" in results:
        L.append("Ratios, plinth / transformers (throughput: higher is better for plinth above 1; TTFT: below 1):")
        L.append("")
        L.append("| concurrency | output throughput | median TTFT | median TPOT |")
        L.append("|---:|---:|---:|---:|")
        for c in concs:
            a, b = results["plinth"].get(c), results["transformers"].get(c)
            if not a or not b or not b["output_throughput"]:
                continue
            L.append(f"| {c} | {a['output_throughput'] / b['output_throughput']:.2f}x | "
                     f"{a['median_ttft_ms'] / max(b['median_ttft_ms'], 1e-9):.2f}x | "
                     f"{a['median_tpot_ms'] / max(b['median_tpot_ms'], 1e-9):.2f}x |")
        L.append("")
        top = max(concs)
        a, b = results["plinth"].get(top), results["transformers"].get(top)
        if a and b and b["output_throughput"]:
            ratio = a["output_throughput"] / b["output_throughput"]
            L.append(f"Target at concurrency {top}: at least 5x transformers serve's output throughput with a lower "
                     f"median TTFT. Measured: {ratio:.2f}x, median TTFT {fmt(a['median_ttft_ms'], 0)} ms vs "
                     f"{fmt(b['median_ttft_ms'], 0)} ms: **{'met' if ratio >= 5 and a['median_ttft_ms'] < b['median_ttft_ms'] else 'not met'}**.")
            L.append("")
    if offline and "plinth" in results and max(concs) in results["plinth"]:
        s = results["plinth"][max(concs)]
        overhead = 1 - s["output_throughput"] / offline["output_throughput"]
        L.append(f"Serving overhead: the offline engine (`plinth.LLM(dtype='bfloat16', max_num_seqs={max(concs)})"
                 f".generate`) on the same {offline['num_prompts']} prompts and lengths made "
                 f"{fmt(offline['output_throughput'])} output tok/s ({offline['duration']:.1f} s); the server at "
                 f"concurrency {max(concs)} made {fmt(s['output_throughput'])} tok/s: overhead "
                 f"{overhead * 100:.1f}% (target under 15%: **{'met' if overhead < 0.15 else 'not met'}**). Other "
                 f"processes used {offline['cores_other']:.2f} cores on average during the offline run.")
        L.append("")
    L.append(f"![serving comparison]({DOC_PLOT.name})")
    L.append("")
    L.append("TTFT is the time to the first streamed content chunk; ITL the gaps between chunks; TPOT "
             "(E2EL - TTFT) / (output tokens - 1); E2EL until the stream ends; output tokens from the servers' "
             "`usage`. The per-run result files and plots (histograms, tokens per second over time) are in "
             "bench/results/serve/ after a run.")
    L.append(END)
    return "\n".join(L) + "\n"


def write_doc(text: str) -> None:
    """Replace only our section (between the markers); add it at the end when absent."""
    old = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        new = head + text.rstrip("\n") + tail
    else:
        new = old.rstrip("\n") + "\n\n" + text
    DOC.write_text(new)


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--servers", nargs="+", default=["plinth", "transformers"], choices=("plinth", "transformers"))
    p.add_argument("--no-offline", action="store_true", help="skip the offline-engine run (serving overhead)")
    p.add_argument("--quiet-cores", type=float, default=0.25,
                   help="a run during which other processes used more cores than this is repeated (default: 0.25)")
    p.add_argument("--wait-quiet", type=float, default=900,
                   help="before each run, wait up to this many seconds for other processes to go below --quiet-cores")
    p.add_argument("--retries", type=int, default=2, help="repeats of a disturbed run; the least disturbed is kept")
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results" / "serve"))
    p.add_argument("--hf-dir", default=None, help="reuse a converted HF folder (default: a new temporary one)")
    p.add_argument("--_prepare", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._prepare:
        prepare_hf_folder(Path(args._prepare))
        return 0

    command = "make setup && " + shlex.join([".venv/bin/python", "bench/serve_compare.py", *sys.argv[1:]])
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    t_start = time.monotonic()
    info = machine()
    concs = sorted(args.concurrency)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")

    tmp = tempfile.TemporaryDirectory(prefix="serve_compare_")
    hf_dir = Path(args.hf_dir) if args.hf_dir else Path(tmp.name) / "smollm2-hf"
    if not (hf_dir / "config.json").exists():
        log(f"converting the GGUF into {hf_dir} for transformers serve")
        subprocess.run([sys.executable, __file__, "--_prepare", str(hf_dir)], check=True, env=env)
    tokenizer = str(hf_dir / "tokenizer.json")

    results: dict[str, dict[int, dict]] = {}
    try:
        for name in args.servers:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            if name == "plinth":
                cmd = [PLATFORM, "serve", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"]
                model, extra = None, []
            else:
                cmd = [TRANSFORMERS, "serve", str(hf_dir), "--device", "cpu", "--continuous-batching", "--dtype",
                       "bfloat16", "--host", "127.0.0.1", "--port", str(port), *TRANSFORMERS_CB_ARGS]
                model = str(hf_dir)
                # transformers serve answers 422 to unknown fields such as ignore_eos: disable EOS its own way
                gc = json.dumps({"eos_token_id": -1, "do_sample": False})
                extra = ["--no-ignore-eos", "--extra-body", json.dumps({"generation_config": gc})]
            proc = start_server(cmd, url, out_dir / f"{name}-server.log", env=env)
            try:
                if model is None:
                    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
                        model = json.load(r)["data"][0]["id"]
                results[name] = {}
                for c in concs:
                    tries: list[dict] = []
                    for attempt in range(args.retries + 1):
                        if attempt:  # a fresh server: the same prompts again would hit its prefix cache
                            log(f"{name} c={c}: other processes used {tries[-1]['cores_other']:.2f} cores: again")
                            stop_server(proc)
                            proc = start_server(cmd, url, out_dir / f"{name}-server-{c}-{attempt}.log", env=env)
                        wait_quiet(proc.pid, args.quiet_cores, args.wait_quiet)
                        res = run_bench(bench_args(args, url, model, tokenizer, c, out_dir / f"{name}-c{c}", extra),
                                        proc.pid)
                        res["attempt"] = attempt + 1
                        tries.append(res)
                        if not res["cores_other"] > args.quiet_cores:  # nan (no /proc): accept
                            break
                    res = min(tries, key=lambda r: r["cores_other"] if r["cores_other"] == r["cores_other"] else 0)
                    results[name][c] = res
                    log(f"{name} c={c}: {res['output_throughput']:.1f} output tok/s, median TTFT "
                        f"{res['median_ttft_ms']:.0f} ms, failed {res['failed']}, other cores {res['cores_other']:.2f}")
            finally:
                stop_server(proc)

        offline = None
        if not args.no_offline:
            top = max(concs)
            prompts = _prompts_of(args, tokenizer, top, args.seed + top)
            outs = [args.output_len] * len(prompts)
            warm = _prompts_of(args, tokenizer, top, args.seed + 1000)
            tries = []
            for _ in range(args.retries + 1):
                wait_quiet(None, args.quiet_cores, args.wait_quiet)
                tries.append(run_offline(prompts, outs, top, warm))
                if not tries[-1]["cores_other"] > args.quiet_cores:
                    break
            offline = min(tries, key=lambda r: r["cores_other"])
            log(f"offline: {offline['output_throughput']:.1f} output tok/s, other cores {offline['cores_other']:.2f}")
    finally:
        tmp.cleanup()

    elapsed = time.monotonic() - t_start
    summary = {
        "machine": info, "started": started, "elapsed_s": elapsed, "command": command,
        "transformers_cb_args": TRANSFORMERS_CB_ARGS, "offline": offline,
        "runs": {n: {str(c): {k: v for k, v in r.items() if not isinstance(v, list)} for c, r in rs.items()}
                 for n, rs in results.items()},
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    text = section(args, results, offline, concs, info, command, started, elapsed)
    print(text)
    if not args.no_docs:
        plot(results, offline, concs, DOC_PLOT)
        write_doc(text)
        log(f"wrote {DOC} and {DOC_PLOT}")
    else:
        plot(results, offline, concs, out_dir / "compare.png")
    return 0


def _prompts_of(args: argparse.Namespace, tokenizer: str, conc: int, seed: int) -> list[str]:
    """The prompts `platform bench serve` sends at this concurrency with this seed (same tokenizer)."""
    from plinth.bench.serve import BenchConfig, HFCounter, build_requests

    cfg = BenchConfig(input_len=args.input_len, output_len=args.output_len,
                      num_prompts=NUM_PROMPTS.get(conc, 2 * conc), seed=seed)
    return [r.prompt for r in build_requests(cfg, HFCounter(tokenizer).count)]


if __name__ == "__main__":
    sys.exit(main())
