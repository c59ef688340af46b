"""Start-up probes: every kernel path the CPU claims runs once, in a child
process, before the backend offers it.

Why: ``/proc/cpuinfo`` says what the CPU has, not what runs. A compiler can
build a path wrong (GCC 12's ``_tile_loadconfig`` let the AMX tile
configuration's stores be deleted: an Intel Xeon then died of SIGILL or
SIGSEGV at the first request), and a VM or kernel can refuse state the flags
advertise. So before the backend builds its ops, a child process loads the
kernels built for the claimed instruction sets and runs each path on small
problems, from the thread pool with 2 threads: the vector paths against torch
in float32, the AMX paths against the vector paths (and, where the docs say
bit-identical, bit for bit). A path whose child dies (a signal), hangs or
disagrees is dropped with its reason, the instruction sets it needs leave the
set, and the probe runs again on the build for what is left, down to the
portable build. The answer is cached on disk per build and machine (the
sources, flags and torch; the CPU's identity, flags and microcode; the
kernel release), so a start-up pays it once. ``platform plugins`` and the
start-up log show what was dropped and why.

``PLINTH_CPU_PROBE_FAULT=<text>=<SIGNAL or "mismatch">`` makes the child
fail the first check whose name holds the text, for the tests of the
fallback (e.g. ``on avx2+fma (fp32 fma)=SIGILL``: each check's name says the
path it runs, "linear_small float32 on avx2+fma (fp32 fma) rows=16").

Run as ``python -m plinth_plugin_cpukernels.probe ISA [--rows 1,2,...]``: the
child (it prints one line per check before running it, then ``ok``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

log = logging.getLogger("plinth.cpukernels")

FAULT_ENV = "PLINTH_CPU_PROBE_FAULT"
#: how long the child may run its checks (the builds are made before it starts)
CHECK_TIMEOUT_S = 180.0
#: activation rows each linear is checked at: one, a few, a partial tile, a
#: full 16-row tile, a padded second tile, four tiles (the AMX kernels take 16-row tiles)
ROWS = (1, 2, 7, 16, 33, 64)
#: the kernel paths that can be dropped, in the order a check names them, and
#: the instruction sets each takes with it when dropped
TIERS: dict[str, tuple[str, ...]] = {
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
    "avx512-bf16": ("avx512_bf16",),
    "avx512-vnni": ("avx512_vnni",),
    "avx-vnni": ("avx_vnni",),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_vnni"),
    "avx2": ("avx", "avx2", "fma", "f16c", "avx_vnni"),
    "arm-extensions": ("sve", "bf16", "i8mm", "asimddp", "asimdhp"),
}


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What the probes left: ``isa``, the instruction sets the backend builds
    for; ``dropped``, a line per path it refused ("amx: probe died with
    SIGILL in linear_amx rows=16; using avx512-bf16 (vdpbf16ps)");
    ``error``, why not even the portable build runs (the backend is then
    unavailable)."""

    isa: tuple[str, ...]
    dropped: tuple[str, ...] = ()
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class ChildOutcome:
    """One child's run: the check it was in when it stopped (None: it passed
    them all), why it stopped, and the checks it started, in order."""

    failed_check: str | None
    why: str = ""
    checks: tuple[str, ...] = dataclasses.field(default=(), compare=False)


# ---------------------------------------------------------------- the checks (in the child)


def _tier_of_linear(isa: set[str]) -> str | None:
    from plinth_plugin_cpukernels.gemm import VDPBF16PS_PATH, linear_kernel_path

    path = linear_kernel_path(isa)
    if path == VDPBF16PS_PATH:
        return "avx512-bf16"
    return {"avx512f (fp32 fma)": "avx512", "avx2+fma (fp32 fma)": "avx2"}.get(path, _tier_of_vector(isa))


def _tier_of_vector(isa: set[str]) -> str | None:
    if "avx512f" in isa:
        return "avx512"
    if "avx2" in isa or "avx" in isa:
        return "avx2"
    if isa & set(TIERS["arm-extensions"]):
        return "arm-extensions"
    return None  # the portable build: nothing left to drop


def _vector_path(isa: set[str]) -> str:
    """The vector code attention and the row-wise ops compile to (csrc/cpu_ops.cpp)."""
    if "avx512f" in isa:
        return "avx512" + ("-bf16" if "avx512_bf16" in isa else "")
    if "avx2" in isa:
        return "avx2"
    return "portable loops"


def _tier_of_gguf(isa: set[str]) -> str | None:
    from plinth_plugin_cpukernels.quant import gguf_kernel_path

    path = gguf_kernel_path(isa)
    return {
        "avx512-vnni (256-bit vpdpbusd)": "avx512-vnni",
        "avx-vnni (vpdpbusd)": "avx-vnni",
        "avx2+fma (vpmaddubsw)": "avx2",
    }.get(path, _tier_of_vector(isa))


def check_tier(name: str, isa: Iterable[str]) -> str | None:
    """The path a check (by its name's first word) exercises on a build for
    ``isa``: what is dropped when it fails (None: the portable build)."""
    isa = set(isa)
    kernel = name.split()[0]
    if kernel.endswith("_amx") or kernel == "amx_attention":
        return "amx"
    if kernel == "gguf_fused_linear":
        return "avx512-bf16"
    if kernel == "gguf_linear":
        return _tier_of_gguf(isa)
    if kernel == "linear_small" and "bfloat16" in name:
        return _tier_of_linear(isa)
    if kernel == "paged_attention" and "bfloat16" in name and "avx512_bf16" in isa:
        return "avx512-bf16"
    return _tier_of_vector(isa)


def _random_gguf_blocks(torch: Any, code: int, n: int, k: int, gen: Any) -> Any:
    """Blocks of a GGUF format (quant.py's codes) with random quants and sane
    float16 scales: every byte pattern of the quants is a valid block."""
    from plinth_plugin_cpukernels.quant import GGUF_FORMATS

    _, block, nbytes = next(spec for spec in GGUF_FORMATS.values() if spec[0] == code)
    blocks = torch.randint(0, 256, (n, k // block, nbytes), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // block, generator=gen) * 0.01 + 0.002).half().view(torch.uint8).view(n, k // block, 2)
    if block == 32:  # Q4_0/Q5_0/Q8_0: d first; Q4_1/Q5_1: d then m
        blocks[..., 0:2] = scale
        if nbytes in (20, 24):
            blocks[..., 2:4] = scale
    elif nbytes == 210:  # Q6_K: d last
        blocks[..., 208:210] = scale
    else:  # Q4_K/Q5_K: d, dmin first
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = scale
    return blocks.reshape(n, -1).contiguous()


def _reference_attention(torch: Any, q: Any, k_pages: Any, v_pages: Any, tables: Any, qsl: list[int], lens: list[int], scale: float) -> Any:
    """Causal attention over paged K/V in float32, a sequence at a time."""
    hq, hkv, ps = q.shape[1], k_pages.shape[0], k_pages.shape[2]
    out = torch.empty(q.shape[0], hq, v_pages.shape[-1])
    for b, length in enumerate(lens):
        pos = torch.arange(length)
        slots = tables[b, pos // ps].long()
        keys = k_pages[:, slots, pos % ps].float().repeat_interleave(hq // hkv, 0)  # [Hq, L, D]
        values = v_pages[:, slots, pos % ps].float().repeat_interleave(hq // hkv, 0)
        rows = q[qsl[b] : qsl[b + 1]].float().transpose(0, 1)  # [Hq, R, D]
        first = length - rows.shape[1]
        scores = rows @ keys.transpose(1, 2) * scale
        mask = pos[None, :] > (first + torch.arange(rows.shape[1]))[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
        out[qsl[b] : qsl[b + 1]] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out


def _close(torch: Any, got: Any, want: Any, bf16: bool) -> str | None:
    """None when ``got`` matches ``want`` to the dtype's rounding (the two sum
    the same products in other orders), else how far off it is."""
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} where {tuple(want.shape)} was expected"
    if not torch.isfinite(got).all():
        return "non-finite values"
    scale = max(1.0, float(want.abs().max()))
    bound = (2e-2 if bf16 else 1e-3) * scale
    diff = float((got - want).abs().max())
    return None if diff <= bound else f"max difference {diff:.4g} over the bound {bound:.4g}"


class _Checks:
    """Runs named checks in order, printing each name before it runs (so the
    parent knows which one a crash was in), and stops at the first failure."""

    def __init__(self, out: Any) -> None:
        import torch

        self.torch = torch
        self.out = out
        fault = os.environ.get(FAULT_ENV, "")
        self.fault_match, _, self.fault = fault.rpartition("=")

    def compare(self, name: str, kernel: Callable[..., Any], args: tuple[Any, ...], want: Any, *, bf16: bool, identical: Any = None) -> Any:
        """``kernel(*args)``, checked against ``want`` to the dtype's rounding
        (and bit for bit against ``identical`` when given); returns it."""
        print(json.dumps({"check": name}), file=self.out, flush=True)
        if self.fault_match and self.fault_match in name:
            if self.fault == "mismatch":
                raise _Mismatch(name, "a wrong result forced by " + FAULT_ENV)
            os.kill(os.getpid(), getattr(signal, self.fault or "SIGILL"))
        got = kernel(*args)
        if identical is not None and not self.torch.equal(got, identical):
            raise _Mismatch(name, "not bit-identical to the path the docs say it equals")
        problem = _close(self.torch, got, want, bf16)
        if problem:
            raise _Mismatch(name, problem)
        return got


class _Mismatch(Exception):
    def __init__(self, check: str, why: str) -> None:
        super().__init__(f"{check}: {why}")
        self.check, self.why = check, why


def _rms_norm(torch: Any, x: Any, w: Any, eps: float) -> Any:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def run_checks(isa: tuple[str, ...], rows: Iterable[int] = ROWS, out: Any = None) -> None:
    """Every path of the builds for ``isa`` on small problems (the child's
    work); raises _Mismatch at the first disagreement."""
    import torch
    import torch.nn.functional as F

    from plinth_plugin_cpukernels.gemm import linear_kernel_path, load_linear_kernels
    from plinth_plugin_cpukernels.kernels import load_kernels
    from plinth_plugin_cpukernels.quant import GGUF_FORMATS, gguf_kernel_path, load_quant_kernels

    checks = _Checks(out or sys.stdout)
    linear_path, gguf_path, vector_path = linear_kernel_path(isa), gguf_kernel_path(isa), _vector_path(set(isa))
    torch.set_num_threads(2)  # the thread pool, as the server runs it (parallel_take's steals too)
    gen = torch.Generator().manual_seed(0)
    rows = tuple(rows)
    lin, quant, attn = load_linear_kernels(isa), load_quant_kernels(isa), load_kernels(isa)
    n, k = 200, 576  # N not a multiple of 16 or of the AMX kernel's 4 blocks; K a multiple of 32
    xs = {m: torch.randn(m, k, generator=gen) for m in rows}

    # the streaming linears against F.linear in float32
    dense: dict[str, tuple[Any, Any, Any]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        packed = dense[str(dtype)] = (w, bias, lin.linear_pack(w))
        for m in rows:
            x = xs[m].to(dtype)
            want = F.linear(x.float(), w.float(), bias.float())
            name = f"linear_small {str(dtype).removeprefix('torch.')} on {linear_path} rows={m}"
            checks.compare(name, lin.linear_small, (x, packed[2], n, k, bias), want, bf16=dtype == torch.bfloat16)

    # the GGUF kernels: the integer one against F.linear on the dequantized weight
    # (activations quantized to int8 per block: about 1% of the largest output),
    # the fused records against the dense copy's bf16 values
    gguf = {}
    fused_formats = {int(c) for c in lin.gguf_fused_formats()}
    for type_name, (code, block, _) in GGUF_FORMATS.items():
        kk = k if block == 32 else 512
        blocks = _random_gguf_blocks(torch, code, n, kk, gen)
        weight = quant.gguf_dequantize(blocks, code, kk, 0, n, False)
        gguf[type_name] = (code, blocks, kk, weight)
        for m in rows:
            x = torch.randn(m, kk, generator=gen)
            checks.compare(f"gguf_linear {type_name} on {gguf_path} rows={m}", quant.gguf_linear, (x, blocks, code, False), F.linear(x, weight), bf16=True)
    fused_vector: dict[tuple[str, int], Any] = {}  # the AMX records' reference
    for type_name, (code, blocks, kk, weight) in gguf.items():
        if code not in fused_formats:
            continue
        records = lin.gguf_fused_pack(blocks, code, n, kk)
        for m in rows:
            x = xs[m][:, :kk].bfloat16()
            want = F.linear(x.float(), weight.bfloat16().float())
            name = f"gguf_fused_linear {type_name} on {linear_path} rows={m}"
            fused_vector[(type_name, m)] = checks.compare(name, lin.gguf_fused_linear, (x, records, code, n, kk, None), want, bf16=True)

    # attention: a sequence of every row count, its prompt rows after a cached part, pages out of order
    hq, hkv, d, ps = 4, 2, 64, 16
    lens = [m + 3 * (i + 1) for i, m in enumerate(rows)]
    qsl = [0]
    for m in rows:
        qsl.append(qsl[-1] + m)
    pages_per = [(length + ps - 1) // ps for length in lens]
    perm = torch.randperm(sum(pages_per), generator=gen).int()
    tables = torch.zeros(len(lens), max(pages_per), dtype=torch.int32)
    at = 0
    for b, count in enumerate(pages_per):
        tables[b, :count] = perm[at : at + count]
        at += count
    seq_lens, starts, scale = torch.tensor(lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int64), d**-0.5
    all_rows = ",".join(map(str, rows))
    attention: dict[str, tuple[tuple[Any, ...], Any]] = {}
    attn.set_amx_attention(False)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(qsl[-1], hq, d, generator=gen).to(dtype)
        kp = torch.randn(hkv, at, ps, d, generator=gen).to(dtype)
        vp = torch.randn(hkv, at, ps, d, generator=gen).to(dtype)
        args = (q, kp, vp, tables, starts, seq_lens, scale, 0)
        want = _reference_attention(torch, q, kp, vp, tables, qsl, lens, scale)
        name = f"paged_attention {str(dtype).removeprefix('torch.')} on {vector_path} rows={all_rows}"
        attention[str(dtype)] = (args, checks.compare(name, attn.paged_attention, args, want, bf16=dtype == torch.bfloat16))
    x_norm, w_norm = torch.randn(8, k, generator=gen), torch.rand(k, generator=gen) + 0.5
    checks.compare(f"rms_norm float32 on {vector_path}", lambda *a: attn.rms_norm(*a)[0], (x_norm, w_norm, 1e-6, None), _rms_norm(torch, x_norm, w_norm, 1e-6), bf16=False)

    if not lin.linear_amx_available():
        return
    # AMX: against the vector paths' results above; the fused records also bit
    # for bit against the AMX kernel on their dense copy (gemm.py, csrc/linear_ops.cpp)
    w, bias, packed_bf16 = dense[str(torch.bfloat16)]
    for m in rows:
        x = xs[m].bfloat16()
        want = lin.linear_small(x, packed_bf16, n, k, bias)
        checks.compare(f"linear_amx bfloat16 on amx tiles rows={m}", lin.linear_amx, (x, packed_bf16, n, k, bias), want, bf16=True)
    for type_name, (code, blocks, kk, _) in gguf.items():
        if code not in fused_formats:
            continue
        records = lin.gguf_fused_pack(blocks, code, n, kk)
        dense_packed = lin.linear_pack(quant.gguf_dequantize(blocks, code, kk, 0, n, True))
        for m in rows:
            x = xs[m][:, :kk].bfloat16()
            same = lin.linear_amx(x, dense_packed, n, kk, None)
            name = f"gguf_fused_linear_amx {type_name} on amx tiles rows={m}"
            checks.compare(name, lin.gguf_fused_linear_amx, (x, records, code, n, kk, None), fused_vector[(type_name, m)], bf16=True, identical=same)
    if attn.set_amx_attention(True):
        try:
            args, want = attention[str(torch.bfloat16)]
            checks.compare(f"amx_attention bfloat16 on amx tiles rows={all_rows}", attn.paged_attention, args, want, bf16=True)
        finally:
            attn.set_amx_attention(False)


def child_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m plinth_plugin_cpukernels.probe")
    parser.add_argument("isa", help="comma-separated instruction sets (the builds for them must exist)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = parser.parse_args(argv)
    isa = tuple(name for name in args.isa.split(",") if name)
    try:
        run_checks(isa, [int(r) for r in args.rows.split(",")])
    except _Mismatch as exc:
        print(json.dumps({"mismatch": exc.check, "why": exc.why}), flush=True)
        return 3
    print(json.dumps({"ok": True}), flush=True)
    return 0


# ---------------------------------------------------------------- the parent


def run_child(isa: tuple[str, ...], timeout: float = CHECK_TIMEOUT_S) -> ChildOutcome:
    """The checks for ``isa`` in a child process (its builds made first, in
    this process, so the timeout covers the checks only)."""
    from plinth_plugin_cpukernels.gemm import load_linear_kernels
    from plinth_plugin_cpukernels.kernels import load_kernels
    from plinth_plugin_cpukernels.quant import load_quant_kernels

    for load in (load_kernels, load_linear_kernels, load_quant_kernels):
        load(isa)
    cmd = [sys.executable, "-m", "plinth_plugin_cpukernels.probe", ",".join(isa)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
        return _outcome(stdout, "start-up", f"probe hung (no answer in {timeout:.0f} s)")
    for line in stdout.splitlines():
        record = _record(line)
        if "mismatch" in record:
            return _outcome(stdout, record["mismatch"], f"probe disagreed ({record['why']})")
    if proc.returncode == 0 and any(_record(line).get("ok") for line in stdout.splitlines()):
        return _outcome(stdout, None, "")
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        return _outcome(stdout, "start-up", f"probe died with {name}")
    tail = (stderr or "").strip().splitlines()[-1:] or [""]
    return _outcome(stdout, "start-up", f"probe exited with {proc.returncode} ({tail[0][-300:]})")


def _outcome(stdout: str, failed: str | None, why: str) -> ChildOutcome:
    """The outcome, with the checks the child started; a crash is placed in the last one started."""
    checks = tuple(c for c in (_record(line).get("check") for line in stdout.splitlines()) if c)
    if failed == "start-up" and checks:
        failed = checks[-1]
    return ChildOutcome(failed, why, checks)


def _record(line: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _path_name(isa: tuple[str, ...]) -> str:
    from plinth_plugin_cpukernels.gemm import linear_kernel_path

    return linear_kernel_path(isa)


def probe(claimed: Iterable[str], run: Callable[[tuple[str, ...]], ChildOutcome] = run_child) -> ProbeResult:
    """The instruction sets whose builds pass every check, from ``claimed``
    down, and what was dropped on the way (``run`` runs one child)."""
    isa = tuple(claimed)
    dropped: list[str] = []
    for _ in range(len(TIERS) + 1):
        outcome = run(isa)
        if outcome.failed_check is None:
            return ProbeResult(isa, tuple(dropped))
        tier = check_tier(outcome.failed_check, isa) if outcome.failed_check != "start-up" else _widest_tier(isa)
        names = set(TIERS.get(tier or "", ())) & set(isa)
        if not names:
            why = f"{outcome.why} in {outcome.failed_check}, on the portable build"
            return ProbeResult(isa, tuple(dropped), error=f"no kernel path runs here: {why}")
        isa = tuple(name for name in isa if name not in names)
        dropped.append(f"{tier}: {outcome.why} in {outcome.failed_check}; using {_path_name(isa)}")
    return ProbeResult(isa, tuple(dropped), error="the probes did not settle")


def _widest_tier(isa: tuple[str, ...]) -> str | None:
    return next((tier for tier, names in TIERS.items() if set(names) & set(isa)), None)


def _machine_identity() -> str:
    """What a cached answer is valid for besides the build: the CPU (its
    identity, flags, microcode) and the kernel."""
    keys = ("vendor_id", "cpu family", "model", "model name", "stepping", "microcode", "flags", "Features", "CPU part")
    seen: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in keys and key not in seen:
                    seen[key] = value.strip()
    except OSError:
        pass
    return json.dumps([seen, platform.machine(), os.uname().release if hasattr(os, "uname") else ""], sort_keys=True)


def cache_path(claimed: tuple[str, ...]) -> Path:
    """Where the answer for ``claimed`` on this machine is kept: keyed by the
    builds' names (sources, flags, torch), the machine and the fault setting."""
    from plinth_plugin_cpukernels.gemm import LINEAR_FUNCTIONS, LINEAR_SOURCE
    from plinth_plugin_cpukernels.kernels import FUNCTIONS, SOURCE, build_directory, build_name
    from plinth_plugin_cpukernels.quant import FUNCTIONS as QUANT_FUNCTIONS
    from plinth_plugin_cpukernels.quant import SOURCE as QUANT_SOURCE

    sources = ((SOURCE, FUNCTIONS), (LINEAR_SOURCE, LINEAR_FUNCTIONS), (QUANT_SOURCE, QUANT_FUNCTIONS))
    builds = [build_name(claimed, source, functions=functions) for source, functions in sources]
    key = json.dumps([sorted(claimed), builds, _machine_identity(), os.environ.get(FAULT_ENV, ""), Path(__file__).read_text()])
    return build_directory("probes") / f"{hashlib.blake2b(key.encode(), digest_size=8).hexdigest()}.json"


@functools.cache
def usable_isa(claimed: tuple[str, ...]) -> ProbeResult:
    """``probe(claimed)``, once per process and (on disk) per build and
    machine; a dropped path is logged once."""
    path = cache_path(claimed)
    result = None
    try:
        doc = json.loads(path.read_text())
        result = ProbeResult(tuple(doc["isa"]), tuple(doc["dropped"]), doc.get("error"))
    except (OSError, ValueError, KeyError, TypeError):
        result = None
    if result is None:
        result = probe(claimed)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(result)))
        tmp.replace(path)
    for line in result.dropped:
        log.warning("cpukernels: %s", line)
    if result.error:
        log.warning("cpukernels: %s", result.error)
    return result


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
