"""What DeepEP needs of this host and of its own build, read without
importing deep_ep (written against DeepEP main, 2.1.0, dd758ca):

* the API: PyPI's ``deep-ep`` is DeepEP 1.0.0 (Feb 2025), whose
  ``low_latency_dispatch`` has no ``use_fp8``; the package's own source is
  parsed for it (``ast``), never imported;
* one NCCL: ``import deep_ep`` asserts that every NCCL library mapped into
  the process is one file, byte-equal to the one it linked
  (``deep_ep/__init__.py:46-68``, ``check_nccl_so``; skipped with
  ``EP_SUPPRESS_NCCL_CHECK``), found as ``find_nccl_root`` finds it
  (``deep_ep/utils/find_pkgs.py:8-68``);
* V2 (``ElasticBuffer``): NCCL >= 2.30.4 and torch >= 2.10 (README.md,
  "Requirements"), and with more than one rank NCCL GIN
  (``csrc/kernels/backend/nccl.cu:86-90`` asserts it unless
  ``EP_DISABLE_GIN``), which needs an RDMA NIC;
* the legacy low-latency kernels: IBGDA, "all the ranks (no matter
  intranode or internode) should be visible via RDMA"
  (``deep_ep/buffers/legacy.py:561-563``): an RDMA NIC and either the
  driver's ``EnableStreamMemOPs`` with ``PeerMappingOverride`` or GDRCopy's
  ``gdrdrv`` (docs/nvshmem.md, "Enable NVSHMEM IBGDA support").

Each probe returns the reasons it fails (empty: fine). The host's files
(sysfs, the driver's parameters) are read under ``PLINTH_DEEPEP_HOST_ROOT``
(default ``/``): tests point it at a scripted tree, in spawned ranks too.
The NCCL probes read this process's own ``/proc/self/maps``: tests load a
scripted ``libnccl.so`` for real.
"""

from __future__ import annotations

import ast
import ctypes
import filecmp
import glob
import importlib.metadata
import importlib.util
import os
import pathlib
import sys

#: where DeepEP's source is (PyPI's ``deep-ep`` is the old 1.0.0)
DEEPEP_SOURCE = "https://github.com/deepseek-ai/DeepEP"
#: how to install it: DeepEP's setup.py imports torch, so no build isolation
INSTALL_HINT = (
    "build DeepEP 2.x from source on the GPU machine: pip install --no-build-isolation 'plinth-plugin-deepep[gpu]' "
    f"({DEEPEP_SOURCE}; PyPI's deep-ep is 1.0.0, another API)"
)
#: README.md "Requirements" of DeepEP 2.x, for V2 (ElasticBuffer)
V2_MIN_NCCL = (2, 30, 4)
V2_MIN_TORCH = (2, 10)
PROC_MAPS = "/proc/self/maps"
#: RDMA devices (InfiniBand / RoCE), as ibverbs lists them
SYSFS_INFINIBAND = "sys/class/infiniband"
#: the NVIDIA driver's parameters (IBGDA's driver route) and GDRCopy's module (its CPU-assisted route)
NVIDIA_PARAMS = "proc/driver/nvidia/params"
GDRDRV = ("sys/module/gdrdrv", "dev/gdrdrv")


def host_path(relative: str) -> str:
    return os.path.join(os.environ.get("PLINTH_DEEPEP_HOST_ROOT", "/"), relative)


def _flag(name: str) -> bool:
    """DeepEP's own reading of its switches: ``int(os.environ.get(name, 0))``."""
    try:
        return int(os.environ.get(name, "0") or "0") != 0
    except ValueError:
        return False


def package_dir() -> pathlib.Path | None:
    spec = importlib.util.find_spec("deep_ep")
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def api_problems(pkg: pathlib.Path) -> list[str]:
    """The installed deep_ep's ``Buffer.low_latency_dispatch`` must take
    ``use_fp8`` (the plugin passes ``use_fp8=False``): 1.0.0's does not, a
    TypeError on the first decode step."""
    params = None
    for path in sorted(pkg.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (OSError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Buffer":
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "low_latency_dispatch":
                        args = item.args
                        params = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    if params is None:
        return [f"the deep_ep at {pkg} has no Buffer.low_latency_dispatch: not DeepEP ({INSTALL_HINT})"]
    if "use_fp8" not in params:
        return [f"the deep_ep at {pkg} is an old DeepEP: its low_latency_dispatch takes no use_fp8 ({INSTALL_HINT})"]
    return []


def _persistent_envs(pkg: pathlib.Path | None) -> dict[str, str]:
    """``deep_ep/envs.py``'s ``persistent_envs``, written at build time
    (setup.py:13: EP_NCCL_ROOT_DIR among them); deep_ep sets each unless
    already set (__init__.py:10-17)."""
    if pkg is None:
        return {}
    try:
        tree = ast.parse((pkg / "envs.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "persistent_envs" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return {}
            return {str(k): str(v) for k, v in dict(value).items()}
    return {}


def nccl_root(pkg: pathlib.Path | None = None) -> str | None:
    """``find_nccl_root``: ``EP_NCCL_ROOT_DIR`` / ``NCCL_DIR``, else the
    ``nvidia-nccl-*`` distribution holding ``libnccl.so`` nearest the front
    of sys.path (find_pkgs.py:21-54)."""
    env = {**_persistent_envs(pkg), **os.environ}
    for name in ("EP_NCCL_ROOT_DIR", "NCCL_DIR"):
        if name in env:
            return env[name]
    priority = {p: i for i, p in enumerate(sys.path)}
    best, best_priority = None, len(sys.path)
    for dist in importlib.metadata.distributions():
        dist_name = (dist.metadata["Name"] or "").lower()
        if "nvidia-nccl" not in dist_name and "nvidia_nccl" not in dist_name:
            continue
        site = str(getattr(dist, "_path", pathlib.Path(".")).parent)
        rank = priority.get(site, len(sys.path))
        if rank > best_priority:
            continue
        for f in dist.files or []:
            if "libnccl.so" in str(f):
                lib_dir = os.path.dirname(str(f.locate()))
                best = os.path.dirname(lib_dir) if os.path.basename(lib_dir) == "lib" else lib_dir
                best_priority = rank
                break
    return best


def loaded_nccl() -> list[str]:
    """The NCCL libraries mapped into this process, in the order
    ``/proc/self/maps`` lists them (a CUDA build of torch maps one at import)."""
    try:
        import torch.cuda.nccl

        torch.cuda.nccl.version()  # maps torch's NCCL where it loads lazily
    except Exception:  # a CPU build: nothing to load
        pass
    try:
        with open(PROC_MAPS) as f:
            return list(dict.fromkeys(line.strip().split(" ")[-1] for line in f if "libnccl" in line))
    except OSError:
        return []


def nccl_version(path: str) -> tuple[int, ...] | None:
    """The NCCL version of a loaded library, as DeepEP reads it at buffer
    creation (``ncclGetVersion``, nccl.cu:69): 23004 -> (2, 30, 4)."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY) if path else None
    except OSError:
        lib = None
    if lib is None:
        return None
    code = ctypes.c_int(0)
    try:
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except AttributeError:
        return None
    value = code.value  # NCCL_VERSION(X,Y,Z): X*10000 + Y*100 + Z from 2.9 on
    return (value // 10000, value % 10000 // 100, value % 100)


def nccl_problems(pkg: pathlib.Path | None) -> tuple[list[str], tuple[int, ...] | None]:
    """(reasons ``import deep_ep`` would assert, the loaded NCCL's version)."""
    loaded = loaded_nccl()
    version = nccl_version(loaded[0]) if loaded else None
    if _flag("EP_SUPPRESS_NCCL_CHECK"):
        return [], version
    if len(loaded) > 1:
        return [f"two NCCL libraries are loaded ({loaded[0]} and {loaded[1]}): import deep_ep asserts one (deep_ep/__init__.py:59)"], version
    if not loaded:
        return ["no NCCL library is loaded in this process (a CUDA build of torch loads one): import deep_ep asserts "
                "one equal to the one it linked (deep_ep/__init__.py:66)"], None  # fmt: skip
    root = nccl_root(pkg)
    candidates = sorted(glob.glob(f"{root}/lib/libnccl.so*")) if root else []
    if not candidates:
        return [f"no libnccl.so found in {root}/lib/ (deep_ep/__init__.py:61): set EP_NCCL_ROOT_DIR to the NCCL DeepEP was built with"], version
    if not filecmp.cmp(loaded[0], candidates[0], shallow=False):
        return [f"the NCCL torch loaded ({loaded[0]}) is not the one DeepEP linked ({candidates[0]}): "
                "import deep_ep asserts they are equal (deep_ep/__init__.py:66)"], version  # fmt: skip
    return [], version


def rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir(host_path(SYSFS_INFINIBAND)))
    except OSError:
        return []


def ibgda_problems() -> list[str]:
    """Why NVSHMEM's IBGDA cannot run here (legacy.py:105-110 turns it on for
    the low-latency kernels; docs/nvshmem.md says what it needs)."""
    if not rdma_devices():
        return [f"no RDMA device (nothing in {host_path(SYSFS_INFINIBAND)}): the low-latency kernels need IBGDA, "
                "every rank visible over RDMA (legacy.py:561-563)"]  # fmt: skip
    try:
        params = pathlib.Path(host_path(NVIDIA_PARAMS)).read_text()
    except OSError:
        params = ""
    driver = "EnableStreamMemOPs: 1" in params and "PeerMappingOverride=1" in params
    if driver or any(os.path.exists(host_path(p)) for p in GDRDRV):
        return []
    return ["IBGDA is not enabled: neither the driver's NVreg_EnableStreamMemOPs=1 with PeerMappingOverride=1 "
            f"({host_path(NVIDIA_PARAMS)}) nor GDRCopy's gdrdrv is there (DeepEP docs/nvshmem.md)"]  # fmt: skip


def _version_tuple(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def torch_version() -> tuple[int, ...]:
    try:
        return _version_tuple(importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        return ()


def v2_problems(ep: int, nccl: tuple[int, ...] | None) -> list[str]:
    """Why V2 (ElasticBuffer) cannot run with ``ep`` ranks on this host."""
    why = []
    if nccl is None:
        why.append(f"V2 needs NCCL >= {'.'.join(map(str, V2_MIN_NCCL))}: no loaded NCCL tells its version")
    elif nccl < V2_MIN_NCCL:
        why.append(
            f"V2 needs NCCL >= {'.'.join(map(str, V2_MIN_NCCL))} (DeepEP README), torch loaded {'.'.join(map(str, nccl))}: "
            f"pip install 'nvidia-nccl-cu13>={'.'.join(map(str, V2_MIN_NCCL))}' --no-deps, then rebuild DeepEP"
        )
    tv = torch_version()
    if tv and tv < V2_MIN_TORCH:
        why.append(f"V2 needs torch >= {'.'.join(map(str, V2_MIN_TORCH))} (DeepEP README), not {'.'.join(map(str, tv))}")
    if ep > 1 and not _flag("EP_DISABLE_GIN") and not rdma_devices():
        why.append(
            f"V2 over {ep} ranks needs NCCL GIN, which needs an RDMA device (nothing in {host_path(SYSFS_INFINIBAND)}): "
            "ElasticBuffer asserts it (csrc/kernels/backend/nccl.cu:86-90) unless EP_DISABLE_GIN=1"
        )
    return why
