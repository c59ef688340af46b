"""A fake ``deep_ep`` for CPU tests, faithful to DeepEP 2.1 (main,
deepseek-ai/DeepEP dd758ca): the legacy ``Buffer`` (normal and low-latency
kernels, ``Config`` hints, ``clean_low_latency_buffer``) and the V2
``ElasticBuffer`` with ``EPHandle``. Every method asserts what upstream
asserts, each quoted with its file and line (``legacy.py`` =
deep_ep/buffers/legacy.py, ``elastic.py`` = deep_ep/buffers/elastic.py,
``buffer.hpp`` = csrc/legacy/buffer.hpp, ``elastic/buffer.hpp`` =
csrc/elastic/buffer.hpp, ``internode_ll.cu`` = csrc/kernels/legacy/
internode_ll.cu), and computes the right result with the data moved by
``torch.distributed.all_gather_object`` over the group (gloo).

What a CPU fake cannot be faithful to, and says so: ``is_cuda`` asserts
(tensors are CPU tensors here); what upstream does silently wrong the fake
makes loud: low-latency kernels on a buffer dirtied by normal kernels
without ``clean_low_latency_buffer`` (legacy.py:540-543 says it is "vital"),
and a second NVSHMEM initialisation in one process (fails across nodes).
Every call is recorded in ``CALLS`` for the tests.

At import, as upstream: the NCCL check of ``deep_ep/__init__.py:46-68``
(``check_nccl_so``: every ``libnccl`` in ``/proc/self/maps`` one file, byte-
equal to the first ``libnccl.so*`` under ``find_nccl_root()``/lib, which is
``EP_NCCL_ROOT_DIR`` or the ``nvidia-nccl`` distribution,
``deep_ep/utils/find_pkgs.py:21-68``; skipped with ``EP_SUPPRESS_NCCL_CHECK``),
then the extension's load (``init_jit``, __init__.py:71-85), which fails on an
NCCL older than the 2.30.4 DeepEP 2.x is built against (README.md
"Requirements": its device-communicator symbols are missing). CPU tests load
a scripted ``libnccl.so`` into the process for real (tests/fake_nccl.py).
``ElasticBuffer`` takes the group's communicator as ``get_nccl_comm_handle``
does (``deep_ep/utils/comm.py:61-64``: ``_comm_ptr()``, 0 before NCCL made
one) and fails on a null one as NCCL does; with more than one rank it
asserts NCCL GIN unless ``EP_DISABLE_GIN`` (csrc/kernels/backend/nccl.cu:86-90),
GIN being there when the host has an RDMA device."""

from __future__ import annotations

import ctypes
import filecmp
import glob
import math
import os
from typing import Any

import torch
import torch.distributed as dist

__version__ = "2.1.0"


def _find_nccl_root() -> str:
    """find_pkgs.py:21-54 (``EP_NCCL_ROOT_DIR`` / ``NCCL_DIR``, else the nvidia-nccl distribution)."""
    for name in ("EP_NCCL_ROOT_DIR", "NCCL_DIR"):
        if name in os.environ:
            return os.environ[name]
    import importlib.metadata

    for d in importlib.metadata.distributions():
        if "nvidia-nccl" in (d.metadata["Name"] or "").lower():
            for f in d.files or []:
                if "libnccl.so" in str(f):
                    lib_dir = os.path.dirname(str(f.locate()))
                    return os.path.dirname(lib_dir) if os.path.basename(lib_dir) == "lib" else lib_dir
    raise AssertionError("Cannot find package: nccl")  # find_pkgs.py:53


def check_nccl_so() -> None:
    """deep_ep/__init__.py:46-68, line for line."""
    if int(os.environ.get("EP_SUPPRESS_NCCL_CHECK", 0)):
        return
    with open("/proc/self/maps") as f:
        loaded_nccl_so = None
        for so in [line.strip().split(" ")[-1] for line in f if "libnccl" in line]:
            loaded_nccl_so = so if loaded_nccl_so is None else loaded_nccl_so
            assert so == loaded_nccl_so, f"Duplicate NCCL runtime found in the current system: {so} and {loaded_nccl_so}"  # :59
    linked_nccl_so_candidates = sorted(glob.glob(f"{_find_nccl_root()}/lib/libnccl.so*"))
    assert linked_nccl_so_candidates, f"No libnccl.so found in {_find_nccl_root()}/lib/"  # :61
    linked_nccl_so = linked_nccl_so_candidates[0]
    # :66 (a None loaded path raises TypeError in filecmp, as upstream's does)
    assert filecmp.cmp(loaded_nccl_so, linked_nccl_so, shallow=False), (  # type: ignore[arg-type]
        f"Invalid NCCL versions: {loaded_nccl_so} (loaded) v.s. {linked_nccl_so} (expected)"
    )


def _loaded_nccl_version() -> tuple[int, int, int] | None:
    """What ``ncclGetVersion`` answers in this process (nccl.cu:69)."""
    with open("/proc/self/maps") as f:
        paths = [line.strip().split(" ")[-1] for line in f if "libnccl" in line]
    if not paths:
        return None
    code = ctypes.c_int(0)
    ctypes.CDLL(paths[0], mode=os.RTLD_NOLOAD | os.RTLD_LAZY).ncclGetVersion(ctypes.byref(code))
    return (code.value // 10000, code.value % 10000 // 100, code.value % 100)


def _load_extension() -> None:
    """``import deep_ep._C`` (__init__.py:76): built against NCCL >= 2.30.4
    (README.md), it does not load on an older one."""
    version = _loaded_nccl_version()
    if version is not None and version < (2, 30, 4):
        raise ImportError(
            f"deep_ep/_C.so: undefined symbol: ncclDevCommCreate (fake: the loaded NCCL is {'.'.join(map(str, version))}, "
            "DeepEP 2.x needs 2.30.4 or later)"
        )


check_nccl_so()  # __init__.py:88
_load_extension()  # __init__.py:89 (init_jit)
CALLS: list[tuple[str, dict]] = []
topk_idx_t = torch.int64

NUM_MAX_NVL_PEERS, NUM_MAX_RDMA_PEERS, NUM_MAX_LOCAL_EXPERTS = 8, 20, 1024  # compiled.cuh:5,6,8
NUM_WORKSPACE_BYTES, NUM_BUFFER_ALIGNMENT_BYTES = 32 * 1024 * 1024, 128  # compiled.cuh:7,9
LOW_LATENCY_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # launch.cuh:113-133 SWITCH_HIDDEN
LOW_LATENCY_MAX_TOPK = 11  # internode_ll.cu:493 / 1166
_NVSHMEM_INITIALISED = False  # one per process


class EventOverlap:
    def __init__(self, event: Any = None, extra_tensors: Any = None) -> None:
        self.event = event

    def current_stream_wait(self) -> None:
        pass


class Config:
    def __init__(self, num_sms: int, nvl_send: int, nvl_recv: int, rdma_send: int = 6, rdma_recv: int = 128) -> None:
        self.num_sms = num_sms
        self.nvl_send, self.nvl_recv, self.rdma_send, self.rdma_recv = nvl_send, nvl_recv, rdma_send, rdma_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        # the shape of csrc/legacy/config.hpp's hint: channels x ranks x recv tokens x token bytes, 128-aligned
        size = (self.num_sms // 2) * min(num_ranks, NUM_MAX_NVL_PEERS) * self.nvl_recv * (hidden_bytes + 64)
        return -(-size // NUM_BUFFER_ALIGNMENT_BYTES) * NUM_BUFFER_ALIGNMENT_BYTES

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:  # config.hpp: intranode needs no RDMA buffer
            return 0
        size = (self.num_sms // 2) * (num_ranks // NUM_MAX_NVL_PEERS) * self.rdma_recv * (hidden_bytes + 64) * 2
        return -(-size // NUM_BUFFER_ALIGNMENT_BYTES) * NUM_BUFFER_ALIGNMENT_BYTES


def _gather(group: Any, obj: Any) -> list[Any]:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _flat_dispatch(group: Any, x: Any, idx: Any, weights: Any, num_experts: int) -> tuple:
    """What the normal kernels deliver: every token that routes to this
    rank's experts once, its top-k ids made local (-1 elsewhere), its weights."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    per = num_experts // size
    lo, hi = rank * per, (rank + 1) * per
    rows, ids, ws, src = [], [], [], []
    for s, (xs, i_s, w_s) in enumerate(_gather(group, (x, idx, weights))):
        for t in range(xs.shape[0]):
            mine = (i_s[t] >= lo) & (i_s[t] < hi)
            if bool(mine.any()):
                rows.append(xs[t])
                ids.append(torch.where(mine, i_s[t] - lo, -1))
                ws.append(torch.where(mine, w_s[t], 0.0) if w_s is not None else torch.zeros(idx.shape[1]))
                src.append((s, t))
    k = idx.shape[1]
    recv_x = torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])
    recv_idx = torch.stack(ids) if ids else torch.zeros(0, k, dtype=torch.int64)
    recv_w = torch.stack(ws).float() if ws else torch.zeros(0, k)
    counts = [int((recv_idx == e).sum()) for e in range(per)]
    return recv_x, recv_idx, recv_w, counts, src


def _flat_combine(group: Any, y: Any, src: list, num_tokens: int) -> Any:
    """Sums (no weights) every rank's rows back to the token they came from."""
    rank = dist.get_rank(group)
    out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32)
    for their_src, their_y in _gather(group, (src, y[: len(src)])):
        for row, (s, t) in enumerate(their_src):
            if s == rank:
                out[t] += their_y[row].float()
    return out.to(torch.bfloat16)


def _split_fp8(x: Any) -> tuple[Any, Any]:
    x, scales = x if isinstance(x, tuple) else (x, None)
    if scales is not None:
        assert x.element_size() == 1  # buffer.hpp:498
        assert scales.dtype in (torch.float32, torch.int32)  # buffer.hpp:499
        assert scales.dim() == 2  # buffer.hpp:500
    return x, scales


class Buffer:
    """legacy.py:33 ``Buffer``."""

    num_sms = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm: Any = None) -> None:
        global _NVSHMEM_INITIALISED
        if group is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")  # legacy.py:91 (no mpi4py here)
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        num_ranks = self.group_size
        CALLS.append(("Buffer", dict(num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes, low_latency_mode=low_latency_mode,
                                     num_qps_per_rank=num_qps_per_rank)))  # fmt: skip
        # buffer.hpp:107-116
        assert num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0 and (num_nvl_bytes <= 2**31 - 1 or num_rdma_bytes == 0)
        assert num_rdma_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0 and (low_latency_mode or num_rdma_bytes <= 2**31 - 1)
        assert num_ranks <= NUM_MAX_NVL_PEERS * NUM_MAX_RDMA_PEERS or low_latency_mode  # buffer.hpp:113
        assert num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0  # buffer.hpp:114
        if num_rdma_bytes > 0:
            assert num_ranks > NUM_MAX_NVL_PEERS or low_latency_mode  # buffer.hpp:115-116
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_rdma_ranks = max(1, num_ranks // NUM_MAX_NVL_PEERS)  # buffer.hpp:121
        if self.num_rdma_ranks > 1 or low_latency_mode:  # legacy.py:104: NVSHMEM is initialised
            assert num_qps_per_rank > 0  # legacy.py:107
            if _NVSHMEM_INITIALISED:
                raise RuntimeError("fake deep_ep: NVSHMEM initialised a second time in this process (fails across nodes)")
            _NVSHMEM_INITIALISED = True
            self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))  # legacy.py:113
            self.num_qps_per_rank = num_qps_per_rank
        _gather(group, self.rank)  # legacy.py:96-101: device ids and IPC handles are all-gathered
        self._dirty = False  # the low-latency part of the buffer is zeroed at start
        self._flat_src: dict[int, tuple] = {}

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        config_map = {
            2: Config(Buffer.num_sms, 24, 256, 6, 128), 4: Config(Buffer.num_sms, 6, 256, 6, 128), 8: Config(Buffer.num_sms, 6, 256, 6, 128),
            16: Config(Buffer.num_sms, 36, 288, 20, 128), 24: Config(Buffer.num_sms, 32, 288, 8, 128),
            32: Config(Buffer.num_sms, 32, 288, 8, 128), 48: Config(Buffer.num_sms, 32, 288, 8, 128),
            64: Config(Buffer.num_sms, 32, 288, 8, 128), 96: Config(Buffer.num_sms, 20, 480, 12, 128),
            128: Config(Buffer.num_sms, 20, 560, 12, 128), 144: Config(Buffer.num_sms, 32, 720, 12, 128),
            160: Config(Buffer.num_sms, 28, 720, 12, 128),
        }  # legacy.py:246-258
        assert num_ranks in config_map, f"Unsupported number of EP ranks: {num_ranks}"  # legacy.py:259
        return config_map[num_ranks]

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        ranks = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
        assert num_ranks in ranks, f"Unsupported number of EP ranks: {num_ranks}"  # legacy.py:289
        return Config(Buffer.num_sms, 10, 256, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        # csrc/legacy/config.hpp LowLatencyLayout: two send/recv buffer pairs of bf16 messages, 128-aligned
        msg = 16 + hidden * 2
        size = 2 * (num_max_dispatch_tokens_per_rank * msg + num_experts * num_max_dispatch_tokens_per_rank * msg)
        return -(-size // NUM_BUFFER_ALIGNMENT_BYTES) * NUM_BUFFER_ALIGNMENT_BYTES

    # ---- normal kernels -------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, previous_event: Any = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> tuple:
        assert topk_idx.dim() == 2  # buffer.hpp:343
        assert topk_idx.is_contiguous()  # buffer.hpp:344
        assert num_experts > 0  # buffer.hpp:345
        assert topk_idx.dtype == topk_idx_t  # legacy.py:301 (docstring: dtype must be deep_ep.topk_idx_t)
        per = num_experts // self.group_size
        owner = torch.where(topk_idx >= 0, topk_idx // per, -1)
        in_rank = torch.stack([(owner == r).any(1) for r in range(self.group_size)], 1) if topk_idx.shape[0] else torch.zeros(0, self.group_size, dtype=torch.bool)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        per_rdma = None if self.num_rdma_ranks == 1 else in_rank.view(-1, self.num_rdma_ranks, NUM_MAX_NVL_PEERS).any(2).sum(0).int()
        return in_rank.sum(0).int(), per_rdma, per_expert, in_rank.contiguous(), EventOverlap()

    def dispatch(self, x: Any, handle: Any = None, num_tokens_per_rank: Any = None, num_tokens_per_rdma_rank: Any = None,
                 is_token_in_rank: Any = None, num_tokens_per_expert: Any = None, topk_idx: Any = None, topk_weights: Any = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Any = None, previous_event: Any = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        config = self.get_dispatch_config(self.group_size) if config is None else config  # legacy.py:375
        assert config.num_sms % 2 == 0  # buffer.hpp:436
        if self.num_rdma_ranks > 1:
            assert num_worst_tokens == 0, "Internode dispatch does not support `num_worst_tokens > 0`"  # legacy.py:379
        x, x_scales = _split_fp8(x)
        assert x.dim() == 2 and x.is_contiguous()  # buffer.hpp:457
        assert (x.shape[1] * x.element_size()) % 16 == 0  # buffer.hpp:458
        assert x.dtype == torch.bfloat16 or x_scales is not None  # legacy.py:341 (bf16, or fp8 with scales)
        CALLS.append(("dispatch", dict(cached=handle is not None, tokens=x.shape[0])))
        if handle is not None:
            assert topk_idx is None and topk_weights is None  # legacy.py:387
            recv_x, _, _, _, src = _flat_dispatch(self.group, x, handle["idx"], None, handle["num_experts"])
            self._flat_src[id(handle)] = src
            return recv_x, None, None, None, None, EventOverlap()
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None  # legacy.py:395
        assert is_token_in_rank.dtype == torch.bool  # buffer.hpp:447
        assert is_token_in_rank.dim() == 2 and is_token_in_rank.is_contiguous()  # buffer.hpp:459
        assert is_token_in_rank.shape[0] == x.shape[0] and is_token_in_rank.shape[1] == self.group_size  # buffer.hpp:460
        assert num_tokens_per_expert.dtype == torch.int32 and num_tokens_per_rank.dtype == torch.int32  # buffer.hpp:452-453
        assert num_tokens_per_expert.shape[0] % self.group_size == 0  # buffer.hpp:468
        assert num_tokens_per_expert.shape[0] // self.group_size <= NUM_MAX_LOCAL_EXPERTS  # buffer.hpp:469
        assert num_tokens_per_rank.shape[0] == self.group_size  # buffer.hpp:471
        assert (topk_idx is None) == (topk_weights is None)  # buffer.hpp:481
        num_experts = num_tokens_per_expert.shape[0]
        if topk_idx is not None:
            assert topk_idx.dim() == 2 and topk_idx.is_contiguous()  # buffer.hpp:485
            assert topk_weights.dim() == 2 and topk_weights.is_contiguous()  # buffer.hpp:486
            assert x.shape[0] == topk_idx.shape[0] == topk_weights.shape[0]  # buffer.hpp:487
            assert topk_idx.shape[1] == topk_weights.shape[1]  # buffer.hpp:488
            assert topk_weights.dtype == torch.float32  # buffer.hpp:489
        self._dirty = True  # the normal kernels use the buffer the low-latency ones need zeroed
        recv_x, recv_idx, recv_w, counts, src = _flat_dispatch(self.group, x, topk_idx, topk_weights, num_experts)
        handle = {"idx": topk_idx.clone(), "num_experts": num_experts, "num_tokens": x.shape[0], "recv": recv_x.shape[0]}
        self._flat_src[id(handle)] = src
        counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
        recv = (recv_x, x_scales) if x_scales is not None else recv_x
        return recv, recv_idx, recv_w, counts, handle, EventOverlap()

    def combine(self, x: Any, handle: Any, topk_weights: Any = None, bias: Any = None, config: Any = None,
                previous_event: Any = None, async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        config = self.get_combine_config(self.group_size) if config is None else config  # legacy.py:440
        assert config.num_sms % 2 == 0  # buffer.hpp:741
        assert x.dtype == torch.bfloat16  # legacy.py:423 (docstring: `[num_tokens, hidden]` with torch.bfloat16)
        assert x.shape[0] == handle["recv"]  # buffer.hpp:746 (src_idx.size(0) == num_tokens)
        assert (x.shape[1] * x.element_size()) % 16 == 0  # buffer.hpp:750
        if topk_weights is not None:
            assert topk_weights.dim() == 2 and topk_weights.is_contiguous()  # buffer.hpp:772
            assert topk_weights.shape[0] == x.shape[0]  # buffer.hpp:773
            assert topk_weights.dtype == torch.float32  # buffer.hpp:774
        CALLS.append(("combine", {}))
        self._dirty = True
        out = _flat_combine(self.group, x, self._flat_src.pop(id(handle)), handle["num_tokens"])
        return out, None, EventOverlap()

    # ---- low-latency kernels -----------------------------------------------------------------

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        assert self.low_latency_mode  # buffer.hpp:1432
        CALLS.append(("clean_low_latency_buffer", dict(num_max=num_max_dispatch_tokens_per_rank, hidden=hidden, num_experts=num_experts)))
        _gather(self.group, "clean")  # internode_ll.cu:82: a barrier before cleaning
        self._dirty = False

    def low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Any = None, dispatch_wait_recv_cost_stats: Any = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> tuple:
        assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2  # legacy.py:609
        assert self.low_latency_mode  # buffer.hpp:1474
        assert x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16  # buffer.hpp:1478
        assert x.shape[1] % 8 == 0 and x.shape[1] % 128 == 0  # buffer.hpp:1479
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous()  # buffer.hpp:1480
        assert x.shape[0] == topk_idx.shape[0] and x.shape[0] <= num_max_dispatch_tokens_per_rank  # buffer.hpp:1481
        assert topk_idx.dtype == topk_idx_t  # buffer.hpp:1482
        assert num_experts % self.group_size == 0  # buffer.hpp:1483
        assert topk_idx.shape[1] <= LOW_LATENCY_MAX_TOPK  # internode_ll.cu:501
        assert num_experts * 4 * 2 <= NUM_WORKSPACE_BYTES  # internode_ll.cu:506
        if use_ue8m0:
            assert round_scale, "UE8M0 SF requires `round_scale=True`"  # internode_ll.cu:510
        assert x.shape[1] in LOW_LATENCY_HIDDEN, "Unsupported hidden"  # launch.cuh:131 (SWITCH_HIDDEN default)
        assert self.num_qps_per_rank >= num_experts // self.group_size  # internode_ll.cu:284 (num_rc_per_pe >= local experts)
        if self._dirty:
            raise RuntimeError("fake deep_ep: low-latency kernels on a buffer the normal kernels used, without clean_low_latency_buffer (legacy.py:540-543)")
        CALLS.append(("low_latency_dispatch", dict(num_max=num_max_dispatch_tokens_per_rank, num_experts=num_experts, use_fp8=use_fp8, tokens=x.shape[0])))
        per = num_experts // self.group_size
        lo = self.rank * per
        slots = num_max_dispatch_tokens_per_rank * self.group_size
        packed = torch.zeros(per, slots, x.shape[1], dtype=torch.bfloat16)
        counts = torch.zeros(per, dtype=torch.int32)
        src_info = torch.full((per, slots), -1, dtype=torch.int32)
        layout_range = torch.zeros(per, self.group_size, dtype=torch.int64)
        for s, (xs, i_s) in enumerate(_gather(self.group, (x, topk_idx))):
            for e in range(per):
                tokens = [t for t in range(xs.shape[0]) if bool((i_s[t] == lo + e).any())]
                begin = int(counts[e])
                layout_range[e, s] = (begin << 32) | len(tokens)
                for j, t in enumerate(tokens):
                    packed[e, begin + j] = xs[t]
                    src_info[e, begin + j] = t
                counts[e] += len(tokens)
        handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)  # legacy.py:618
        if use_fp8:  # per-128 scales, e4m3 values
            blocks = packed.float().view(per, slots, -1, 128)
            scales = (blocks.abs().amax(-1) / 448.0).clamp(min=1e-10)
            values = (blocks / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).view(per, slots, -1)
            return (values, scales), counts, handle, EventOverlap(), None
        return packed, counts, handle, EventOverlap(), None

    def low_latency_combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out: Any = None, combine_wait_recv_cost_stats: Any = None) -> tuple:
        src_info, layout_range, num_max, hidden, num_experts = handle
        assert self.nvshmem_qp_depth >= (num_max + 1) * 2  # legacy.py:665
        assert self.low_latency_mode  # buffer.hpp:1612
        assert x.dim() == 3 and x.is_contiguous() and x.dtype == torch.bfloat16  # buffer.hpp:1615
        assert x.shape[0] == num_experts // self.group_size  # buffer.hpp:1616
        assert x.shape[1] == self.group_size * num_max  # buffer.hpp:1617
        assert x.shape[2] % 8 == 0 and x.shape[2] % 128 == 0  # buffer.hpp:1618
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous()  # buffer.hpp:1619
        assert topk_idx.shape == topk_weights.shape  # buffer.hpp:1620
        assert topk_idx.dtype == topk_idx_t  # buffer.hpp:1621
        assert topk_weights.dim() == 2 and topk_weights.is_contiguous()  # buffer.hpp:1622
        assert topk_weights.shape[0] <= num_max  # buffer.hpp:1623
        assert topk_weights.dtype == torch.float32  # buffer.hpp:1624
        assert topk_idx.shape[1] <= LOW_LATENCY_MAX_TOPK  # internode_ll.cu:1179
        assert not (zero_copy and use_logfmt)  # internode_ll.cu:1182
        CALLS.append(("low_latency_combine", {}))
        per = num_experts // self.group_size
        out_x = torch.zeros(topk_idx.shape[0], x.shape[2], dtype=torch.float32)
        # each expert's rows go back to the ranks that sent them; the receiver applies its own weights
        for e_rank, (their_x, their_layout, their_src) in enumerate(_gather(self.group, (x, layout_range, src_info))):
            their_lo = e_rank * per
            for e in range(per):
                begin, n = int(their_layout[e, self.rank]) >> 32, int(their_layout[e, self.rank]) & 0xFFFFFFFF
                for j in range(begin, begin + n):
                    t = int(their_src[e, j])
                    k = (topk_idx[t] == their_lo + e).nonzero()
                    out_x[t] += their_x[e, j].float() * topk_weights[t, k].sum()
        return out_x.to(torch.bfloat16), EventOverlap(), None


# ---- V2 ---------------------------------------------------------------------------------------


class EPHandle:
    """elastic.py:25 ``EPHandle`` (the fields the plugin and combine read):
    ``psum_num_recv_tokens_per_scaleup_rank`` (elastic.py:38-41, its last
    element the tokens received) and ``psum_num_recv_tokens_per_expert``
    (:42-48, inclusive) are device int tensors; ``num_recv_tokens`` and
    ``num_recv_tokens_per_expert_list`` are exact only after a CPU sync
    (without one: the worst case and an empty list, elastic buffer.hpp:1011-1070);
    ``recv_src_metadata`` has one row per received-tensor row (combine checks it)."""

    def __init__(self, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int, num_sms: int, topk_idx: Any,
                 num_recv_tokens: int, num_recv_tokens_per_expert_list: list, psum_per_rank: Any, psum_per_expert: Any,
                 rows: int, src: list, num_tokens: int) -> None:
        assert topk_idx is not None  # elastic.py:76
        self.do_expand = False
        self.num_experts, self.expert_alignment = num_experts, expert_alignment
        self.num_max_tokens_per_rank, self.num_sms = num_max_tokens_per_rank, num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_per_rank
        self.psum_num_recv_tokens_per_expert = psum_per_expert
        self.recv_src_metadata = torch.zeros(rows, topk_idx.shape[1] + 2, dtype=torch.int32)  # buffer.hpp:1081-1083
        self.src, self.num_tokens = src, num_tokens


def get_nccl_comm_handle(group: Any) -> Any:
    """comm.py:42-64: the process group's own communicator (``_comm_ptr()``).
    A torch NCCL group makes it at its first collective, or at once when
    ``init_process_group`` had a ``device_id`` (``bound_device_id``); before
    that the pointer is 0. Here (gloo) the group's collective count stands
    for the first."""
    made = getattr(group, "bound_device_id", None) is not None or group._get_sequence_number_for_group() > 0
    return _CommHandle(0x1000 + group.rank() if made else 0)


class _CommHandle:
    def __init__(self, ptr: int) -> None:
        self.nccl_comm = ptr

    def get(self) -> int:
        return self.nccl_comm


def _gin_type() -> str:
    """NCCL's ``props.ginType``: a GIN transport where the host has an RDMA
    device (read under ``PLINTH_DEEPEP_HOST_ROOT``, as the plugin's probe)."""
    root = os.path.join(os.environ.get("PLINTH_DEEPEP_HOST_ROOT", "/"), "sys/class/infiniband")
    return "gdaki" if os.path.isdir(root) and os.listdir(root) else "none"


class ElasticBuffer:
    """elastic.py:228 ``ElasticBuffer`` (sized from MoE settings)."""

    def __init__(self, group: Any, num_bytes: int | None = None, num_cpu_bytes: int = 0, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True,
                 sl_idx: int = 3, num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False) -> None:
        self.group, self.rank_idx, self.num_ranks = group, group.rank(), group.size()
        if num_cpu_bytes > 0:
            assert num_bytes is not None  # elastic.py:286
        comm = get_nccl_comm_handle(group).get()  # elastic.py:301
        if comm == 0:  # calculate_elastic_buffer_size / ncclCommQueryProperties on a null communicator
            raise RuntimeError("NCCL error: invalid argument (fake deep_ep: the group's communicator is null; "
                               "init_process_group without device_id and no collective on the group yet)")  # fmt: skip
        if self.num_ranks > 1 and int(os.environ.get("EP_DISABLE_GIN", 0)) == 0:  # nccl.cu:86-90
            assert _gin_type() != "none", (
                "NCCL GIN is unavailable. This is usually due to a network configuration issue, "
                "such as `allow_hybrid_mode=0` (disable direct RDMA kernels) in multi-plane network."
            )
        if num_bytes is None:
            assert num_max_tokens_per_rank > 0 and hidden > 0  # elastic/buffer.hpp:657
            assert -(-hidden // 32) * 4 <= hidden  # elastic/buffer.hpp:660
            token_bytes = hidden * (1 if use_fp8_dispatch else 2) + 32 * 8  # elastic/buffer.hpp:662: sized as for top-32
            num_bytes = -(-(num_max_tokens_per_rank * token_bytes * self.num_ranks * 2) // (2 << 20)) * (2 << 20)  # 2 MiB aligned
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_allocated_qps = num_allocated_qps or 17  # elastic.py:328-334 (no RDMA here)
        self.num_rdma_ranks = 1
        CALLS.append(("ElasticBuffer", dict(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk)))
        _gather(group, self.rank_idx)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0) -> int:
        assert num_scaleout_topk == 0  # elastic.py:757
        num_groups = 1  # one scale-up domain
        assert num_experts % num_groups == 0  # elastic.py:771 (num_experts None: TypeError, as upstream)
        expected = num_groups * (1 - math.comb(num_experts - num_experts // num_groups, num_topk) / math.comb(num_experts, num_topk))
        return max(4, 2 * round(expected * 8))

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        return min(num_sms + 1, 17)

    def dispatch(self, x: Any, topk_idx: Any = None, topk_weights: Any = None, cumulative_local_expert_recv_stats: Any = None,
                 num_experts: int | None = None, num_max_tokens_per_rank: int | None = None, expert_alignment: int | None = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event: Any = None, previous_event_before_epilogue: Any = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False, handle: Any = None,
                 do_handle_copy: bool = True, do_cpu_sync: bool | None = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False) -> tuple:
        num_topk = (handle.topk_idx if topk_idx is None else topk_idx).shape[1]  # elastic.py:927
        num_sms = self.get_theoretical_num_sms(num_experts, num_topk) if num_sms == 0 else num_sms  # elastic.py:928
        num_qps = self.get_theoretical_num_qps(num_sms) if num_qps == 0 else num_qps  # elastic.py:929
        assert num_qps <= self.num_allocated_qps, "Allocated QPs are not enough"  # elastic.py:930
        x, sf = _split_fp8(x)
        cached = handle is not None
        if cached:
            assert topk_idx is None  # elastic.py:938
            assert do_cpu_sync is None or not do_cpu_sync, "Cannot do CPU sync with cached handle"  # elastic.py:939
            topk_idx = handle.topk_idx
            num_max_tokens_per_rank = num_max_tokens_per_rank if num_max_tokens_per_rank is not None else handle.num_max_tokens_per_rank
            num_experts = num_experts if num_experts is not None else handle.num_experts
            expert_alignment = expert_alignment if expert_alignment is not None else handle.expert_alignment
            do_cpu_sync = False  # elastic.py:944
            assert (num_experts, expert_alignment, num_max_tokens_per_rank) == (
                handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)  # elastic.py:947
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync  # elastic.py:961
        num_max_tokens_per_rank = num_max_tokens_per_rank if num_max_tokens_per_rank is not None else self.num_max_tokens_per_rank
        expert_alignment = expert_alignment or 1
        assert x.is_contiguous()  # elastic/buffer.hpp:754 (is_cuda: a CPU fake)
        assert (x.shape[1] * x.element_size()) % 16 == 0  # elastic/buffer.hpp:755
        assert x.shape[0] <= num_max_tokens_per_rank  # elastic/buffer.hpp:756
        assert x.dtype == torch.bfloat16 or sf is not None  # elastic.py:883 (bf16, or fp8 with scale factors)
        assert topk_idx.shape[0] == x.shape[0]  # elastic/buffer.hpp:776
        assert topk_idx.dtype == topk_idx_t  # elastic/buffer.hpp:777
        assert topk_idx.is_contiguous()  # elastic/buffer.hpp:778
        if topk_weights is not None:
            assert topk_weights.shape[0] == x.shape[0]  # elastic/buffer.hpp:783
            assert topk_weights.is_contiguous()  # elastic/buffer.hpp:785
        assert num_experts % self.num_ranks == 0  # elastic/buffer.hpp:805
        CALLS.append(("elastic_dispatch", dict(cached=cached, tokens=x.shape[0], cpu_sync=do_cpu_sync, num_max=num_max_tokens_per_rank)))
        recv_x, recv_idx, recv_w, counts, src = _flat_dispatch(self.group, x, topk_idx, topk_weights, num_experts)
        arrived = len(src)
        # rows: exactly what arrived after a CPU sync, else the worst case (buffer.hpp:1067);
        # either way from torch::empty (buffer.hpp:1076): rows past the arrivals hold garbage,
        # here NaN and out-of-range expert ids, so that a reader who trusts them fails
        rows = arrived if do_cpu_sync else num_max_tokens_per_rank * self.num_ranks
        slack = rows - arrived
        recv_x = torch.cat([recv_x, torch.full((slack, recv_x.shape[1]), float("nan"), dtype=recv_x.dtype)])
        recv_idx = torch.cat([recv_idx, torch.full((slack, recv_idx.shape[1]), 10**6, dtype=torch.int64)])
        recv_w = torch.cat([recv_w, torch.full((slack, recv_w.shape[1]), float("nan"))])
        if not cached:
            psum_rank = torch.tensor([arrived], dtype=torch.int32)  # one scaleup domain
            psum_expert = torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0).to(torch.int32)
            handle = EPHandle(num_experts, expert_alignment, num_max_tokens_per_rank, num_sms, topk_idx.clone(),
                              arrived if do_cpu_sync else rows, counts if do_cpu_sync else [], psum_rank, psum_expert, rows,
                              src, x.shape[0])  # fmt: skip
        recv = (recv_x, sf) if sf is not None else recv_x
        return recv, recv_idx, (recv_w if topk_weights is not None else None), handle, EventOverlap()

    def combine(self, x: Any, handle: EPHandle, topk_weights: Any = None, bias: Any = None, num_sms: int = 0, num_qps: int = 0,
                previous_event: Any = None, previous_event_before_epilogue: Any = None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple:
        num_sms = handle.num_sms if num_sms == 0 else num_sms  # elastic.py:1086
        num_qps = self.get_theoretical_num_qps(num_sms) if num_qps == 0 else num_qps  # elastic.py:1087
        assert num_qps <= self.num_allocated_qps, "Allocated QPs are not enough"  # elastic.py:1088
        assert num_sms > 0  # elastic/buffer.hpp:1198
        assert x.is_contiguous()  # elastic/buffer.hpp:1202 (is_cuda: a CPU fake)
        assert x.dtype == torch.bfloat16  # elastic/buffer.hpp:1203
        assert (x.shape[1] * x.element_size()) % 16 == 0  # elastic/buffer.hpp:1204
        assert handle.topk_idx.dtype == topk_idx_t  # elastic/buffer.hpp:1210
        assert handle.topk_idx.shape[0] <= handle.num_max_tokens_per_rank  # elastic/buffer.hpp:1214
        assert handle.recv_src_metadata.shape[0] == x.shape[0]  # elastic/buffer.hpp:1219 (non-expanded layout)
        CALLS.append(("elastic_combine", {}))
        return _flat_combine(self.group, x, handle.src, handle.num_tokens), None, EventOverlap()
