"""The kernels are built for the instruction sets the accelerator reports,
and a build is keyed by them: one made for another set is never loaded."""

import platform
import subprocess
import sys
import time

import pytest
import torch
from plinth_plugin_cpukernels import kernels
from plinth_plugin_cpukernels.kernels import (
    TORCH_LOCK_FILE,
    build_directory,
    build_lock,
    build_name,
    isa_cflags,
    load_kernels,
)

X86 = platform.machine().lower() in ("x86_64", "amd64")
#: a set every CPU of the machine's kind runs (built once, cached for the tests below)
BASIC = ("sse4_2",) if X86 else ()
LOAD_IN_A_NEW_PROCESS = [
    sys.executable, "-c",
    f"from plinth_plugin_cpukernels.kernels import load_kernels; load_kernels({BASIC!r}); print('loaded')",
]


def test_flags_follow_the_isa():
    avx2 = ("sse4_2", "avx", "avx2", "fma")
    flags = isa_cflags(avx2, machine="x86_64")
    assert "-mavx2" in flags and "-mfma" in flags and not any("avx512" in f for f in flags)
    assert "-march=native" not in flags  # native would use what a narrowed set excludes
    assert "-mavx512bf16" in isa_cflags(avx2 + ("avx512f", "avx512bw", "avx512_bf16"), machine="x86_64")
    assert isa_cflags(("asimd", "sve", "bf16"), machine="aarch64") == ["-march=armv8.2-a+sve+bf16"]
    assert isa_cflags((), machine="riscv64") == []


def test_builds_are_keyed_by_the_isa():
    assert build_name(("avx2", "fma")) != build_name(("avx2", "fma", "avx512f"))
    assert build_name(("fma", "avx2")) == build_name(("avx2", "fma"))


def test_builds_are_keyed_by_the_bound_functions():
    """Two checkouts that bind other functions of one source (one adds a
    kernel) must not share, and so rebuild, one directory."""
    assert build_name(("avx2", "fma"), functions=kernels.FUNCTIONS) == build_name(("avx2", "fma"))
    assert build_name(("avx2", "fma"), functions=[*kernels.FUNCTIONS, "another_kernel"]) != build_name(("avx2", "fma"))


def test_builds_are_keyed_by_the_shared_header(tmp_path, monkeypatch):
    """Every source is built after csrc/common.h's text: a change there must rebuild them all."""
    header = tmp_path / "common.h"
    header.write_text(kernels.SHARED.read_text())
    monkeypatch.setattr(kernels, "SHARED", header)
    before = build_name(("avx2", "fma"))
    header.write_text(header.read_text() + "\n// changed\n")
    assert build_name(("avx2", "fma")) != before


@pytest.mark.skipif(not X86, reason="an x86 build")
def test_a_build_without_avx_runs():
    """SSE4.2 only, no AVX at all (the set tests/test_cpu_isa.py narrows to as well)."""
    k = load_kernels(("sse4_2",))
    x = torch.randn(3, 2 * 8)
    torch.testing.assert_close(k.silu_and_mul(x), torch.nn.functional.silu(x[:, :8]) * x[:, 8:], rtol=1e-5, atol=1e-5)


def test_a_lock_file_left_by_a_killed_build_does_not_hang_the_next_start():
    """torch's lock file, as a build killed midway leaves it behind: the next
    process removes it under the flock and loads, where it used to wait forever."""
    load_kernels(BASIC)  # built, or already cached
    lock = build_directory(build_name(BASIC)) / TORCH_LOCK_FILE
    lock.touch()
    proc = subprocess.run(LOAD_IN_A_NEW_PROCESS, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-2000:]
    assert not lock.exists()


def test_a_live_build_is_waited_for():
    """While another process holds the build (here: this one), a start waits,
    and goes on once it is released."""
    load_kernels(BASIC)
    build_dir = build_directory(build_name(BASIC))
    with build_lock(build_dir):
        proc = subprocess.Popen(LOAD_IN_A_NEW_PROCESS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(8)  # ample for the import and the load of a cached build
            assert proc.poll() is None, "the start did not wait for the live build"
        except BaseException:
            proc.kill()
            raise
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "loaded" in out, err[-2000:]


def test_kernels_release_the_gil_while_they_run():
    """Another Python thread (the server's event loop) runs while a kernel
    does. The counting thread needs the GIL after every 0.5 ms sleep: during
    a call of ~60 ms (tens of ms on any CPU) it counts dozens of times if the
    kernel released the GIL, and at most a few times, at the call's edges,
    if it kept it (measured 86-104 against 1-4, AMD EPYC)."""
    import threading

    from plinth.api import load_accelerator
    from plinth_plugin_cpukernels.gemm import load_linear_kernels

    lin = load_linear_kernels(tuple(load_accelerator("cpu").info().isa))
    k, n = 2048, 8192
    x, w = torch.randn(64, k), lin.linear_pack(torch.randn(n, k))
    count, stop = [0], threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1
            time.sleep(0.0005)

    thread = threading.Thread(target=counter)
    thread.start()
    try:
        time.sleep(0.05)
        during = []
        for _ in range(3):
            before = count[0]
            lin.linear_small(x, w, n, k, None)
            during.append(count[0] - before)
    finally:
        stop.set()
        thread.join(10)
    assert max(during) > 15, f"the counting thread ran {during} times during the kernel calls"


@pytest.mark.skipif(not X86, reason="x86 mnemonics")
def test_the_attention_kernel_keeps_its_prefetches(native_kernels):
    """GCC dropped every _mm_prefetch of the attention kernel (cold K/V pages
    were read on demand, 2.8x slower); csrc/common.h's prefetches are volatile
    asm. Read the built kernel back: each block function prefetches into L2,
    inline or through an out-of-line prefetch helper."""
    import re
    import shutil

    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump (binutils) here")
    listing = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", "-C", native_kernels.__file__], capture_output=True, text=True, check=True
    ).stdout
    bodies: dict[str, str] = {}  # function -> its instructions, with its [clone ...] parts
    name = None
    for line in listing.splitlines():
        if line.endswith(">:"):
            name = re.sub(r" \[clone [^\]]*\]", "", line.split("<", 1)[1][: -len(">:")])
            bodies.setdefault(name, "")
        elif name is not None:
            bodies[name] += line + "\n"
    helpers = [n for n, body in bodies.items() if "prefetch_" in n and "prefetcht1" in body]
    tiles = {n: body for n, body in bodies.items() if "attend_tile<" in n}
    assert tiles, "no attend_tile in the built kernels"
    for n, body in tiles.items():
        calls_helper = any(h.split("(")[0] in body for h in helpers)
        assert "prefetcht1" in body or calls_helper, f"{n} has no L2 prefetch"
