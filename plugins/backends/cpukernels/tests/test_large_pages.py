"""Long-lived tensors the kernels stream every step (packed weights, KV pages)
sit on 2 MB pages: mappings aligned to 2 MB and advised MADV_HUGEPAGE
(csrc/common.h, ``plinth::large_page_zeros``). Read back from
/proc/self/smaps: the mapping's ``hg`` flag (the advice was given) and its
AnonHugePages (the kernel granted huge pages)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from plinth.api import QuantizedWeight, SelectionContext, load_accelerator
from plinth_plugin_cpukernels.backend import CPUKernelsBackend
from plinth_plugin_torch.backend import TorchBackend

sys.path.insert(0, os.path.dirname(__file__))
from test_quant import random_blocks  # noqa: E402

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="2 MB pages are asked of Linux only")
LARGE_PAGE = 2 << 20


def mapping(address: int) -> dict | None:
    """The /proc/self/smaps entry of the mapping holding ``address``: start,
    end, its VmFlags and its AnonHugePages in kB; None when nothing maps it."""
    entry = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: its address range
            lo, hi = (int(x, 16) for x in head.split("-"))
            entry = {"start": lo, "end": hi} if lo <= address < hi else None
        elif entry is not None and head == "AnonHugePages:":
            entry["anon_huge_kb"] = int(line.split()[1])
        elif entry is not None and head == "VmFlags:":  # its last line
            entry["flags"] = line.split()[1:]
            return entry
    return None


def thp_granted() -> bool:
    """Whether a fault in an advised range gets a 2 MB page even when none is
    free: huge pages not off, and the fault compacts memory for advised ranges
    (``defrag`` always, madvise or defer+madvise; with defer or never it only
    takes a free one, so the page may be 4 KB)."""
    defrag = THP.with_name("defrag")
    if not THP.exists() or "[never]" in THP.read_text() or not defrag.exists():
        return False
    return any(f"[{mode}]" in defrag.read_text() for mode in ("always", "madvise", "defer+madvise"))


def test_zeros_on_large_pages(native_kernels):
    big = native_kernels.zeros_on_large_pages([3, 1024, 16, 256], torch.bfloat16)  # 24 MiB: a mapping of its own
    assert big.shape == (3, 1024, 16, 256) and big.dtype == torch.bfloat16 and big.is_contiguous()
    assert not big.any()
    assert big.data_ptr() % LARGE_PAGE == 0
    region = mapping(big.data_ptr())
    assert region is not None and "hg" in region["flags"], region
    big.fill_(1)  # touched: the kernel now backs the advised range
    region = mapping(big.data_ptr())
    if thp_granted():
        assert region["anon_huge_kb"] >= 2048, region
    assert big.float().sum().item() == big.numel()


def test_small_tensors_are_carved_from_shared_chunks(native_kernels):
    size = 100 << 10  # 100 KiB: carved at 4 KiB boundaries
    tensors = [native_kernels.zeros_on_large_pages([size], torch.uint8) for _ in range(4)]
    ptrs = [t.data_ptr() for t in tensors]
    stride = (size + 4095) // 4096 * 4096
    for a, b in zip(ptrs, ptrs[1:]):
        assert b % 4096 == 0
        assert b - a == stride or b % LARGE_PAGE == 0  # the next slice, or the start of a new chunk
    for t in tensors:
        assert "hg" in mapping(t.data_ptr())["flags"]
        assert not t.any()
        t.fill_(7)  # the slices do not overlap
    assert all(int(t.sum()) == 7 * size for t in tensors)


def test_tiny_tensors_stay_with_the_allocator(native_kernels):
    t = native_kernels.zeros_on_large_pages([8, 8], torch.float32)
    assert t.shape == (8, 8) and not t.any()
    region = mapping(t.data_ptr())
    assert region is not None and "hg" not in region["flags"]


def test_a_large_tensor_unmaps_when_it_goes(native_kernels):
    t = native_kernels.zeros_on_large_pages([40 << 20], torch.uint8)  # 40 MiB: its own mapping
    address = t.data_ptr()
    assert mapping(address) is not None
    del t
    assert mapping(address) is None


def test_switched_off_by_the_environment():
    here = str(Path(__file__).parent)
    code = (
        "import torch, sys\n"
        f"sys.path.insert(0, {here!r})\n"
        "from test_large_pages import mapping\n"
        "from plinth.api import SelectionContext, load_accelerator\n"
        "from plinth_plugin_cpukernels.backend import accelerator_isa\n"
        "from plinth_plugin_cpukernels.kernels import load_kernels\n"
        "k = load_kernels(accelerator_isa(SelectionContext(accelerator=load_accelerator('cpu'))))\n"
        "t = k.zeros_on_large_pages([24 << 20], torch.uint8)\n"
        "print('hg' in mapping(t.data_ptr())['flags'], bool(t.any()))\n"
    )
    env = {**os.environ, "PLINTH_CPU_LARGE_PAGES": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


def test_kv_pages_and_packed_weights_come_on_large_pages():
    """Through the backend's ops: what the engine allocates and packs."""
    reference = TorchBackend(SelectionContext(accelerator=load_accelerator("cpu"))).ops()
    ops = dict(reference)
    ops.update(CPUKernelsBackend(SelectionContext(accelerator=load_accelerator("cpu")), reference).ops())
    from plinth.testing import attention_backend

    k, v = attention_backend(SelectionContext(accelerator=load_accelerator("cpu")), "cpukernels").allocate(
        num_pages=512, page_size=16, num_kv_heads=3, head_dim=64, v_head_dim=64, dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    for pages in (k, v):
        assert pages.shape == (3, 512, 16, 64) and pages.dtype == torch.bfloat16 and not pages.any()
        assert "hg" in mapping(pages.data_ptr())["flags"]
    blocks, dense = random_blocks("Q8_0", 576, 576)  # 344 KiB of blocks
    gguf = ops["pack_linear"](QuantizedWeight(format="gguf_q8_0", qweight=blocks, scale=torch.empty(0), shape=(576, 576), block_size=(1, 32)))
    assert torch.equal(gguf.blocks, blocks) and "hg" in mapping(gguf.blocks.data_ptr())["flags"]
    x = torch.randn(3, 576)
    torch.testing.assert_close(ops["linear"](x, gguf), x @ dense.t(), rtol=0, atol=2e-2 * (x @ dense.t()).abs().max().item())
    packed = ops["pack_linear"](torch.randn(3072, 576).bfloat16())
    if getattr(packed, "small", None) is None:
        pytest.skip("this build streams no bf16 weights (oneDNN only)")
    assert "hg" in mapping(packed.small.data_ptr())["flags"]
