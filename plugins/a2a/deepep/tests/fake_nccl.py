"""A scripted NCCL for CPU tests: a real shared library named
``libnccl.so.2`` whose ``ncclGetVersion`` answers a chosen version, built
with the C compiler and loaded into the process for real, so that
``/proc/self/maps`` lists it as it lists a CUDA torch's NCCL. Both the
plugin's host probes and the fake ``deep_ep``'s import-time check read it
exactly as they read the real one.

``scripted_host(version=..., rdma=..., ibgda=...)`` lays out
``nccl-<version>/lib/libnccl.so.2`` and a host tree for
``PLINTH_DEEPEP_HOST_ROOT`` (sys/class/infiniband/mlx5_0, the driver's
IBGDA parameters) in one folder per process and returns the environment
that points at them. A process keeps what it loaded: it loads one version
only (two would be two NCCLs, which deep_ep refuses); other versions are
tried in child processes.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import pathlib
import shutil
import subprocess
import tempfile

#: one folder per process (the loaded library must stay where it was mapped from)
ROOT = pathlib.Path(tempfile.mkdtemp(prefix="plinth-fake-nccl-"))
atexit.register(shutil.rmtree, ROOT, True)

SOURCE = """
int ncclGetVersion(int *version) { *version = %d; return 0; }
"""


def build_libnccl(lib_dir: pathlib.Path, version: tuple[int, int, int]) -> pathlib.Path:
    lib_dir.mkdir(parents=True, exist_ok=True)
    path = lib_dir / "libnccl.so.2"
    if path.exists():
        return path
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
    assert cc, "a C compiler builds the scripted libnccl (the cpukernels plugin needs one too)"
    src = lib_dir / "nccl_version.c"
    major, minor, patch = version
    src.write_text(SOURCE % (major * 10000 + minor * 100 + patch))
    subprocess.run([cc, "-shared", "-fPIC", "-x", "c", str(src), "-o", str(path)], check=True)
    return path


def scripted_host(*, version: tuple[int, int, int] = (2, 30, 4), rdma: bool = True, ibgda: bool = True) -> dict[str, str]:
    """The environment of a host with that NCCL (built, not yet loaded) and,
    as asked, an RDMA device and IBGDA enabled in the driver."""
    root = ROOT / f"host-rdma{int(rdma)}-ibgda{int(ibgda)}"
    if rdma:
        (root / "sys/class/infiniband/mlx5_0").mkdir(parents=True, exist_ok=True)
    else:
        (root / "sys/class").mkdir(parents=True, exist_ok=True)
    if ibgda:
        params = root / "proc/driver/nvidia/params"
        params.parent.mkdir(parents=True, exist_ok=True)
        params.write_text('EnableStreamMemOPs: 1\nRegistryDwords: "PeerMappingOverride=1;"\n')
    lib = build_libnccl(ROOT / f"nccl-{'.'.join(map(str, version))}" / "lib", version)
    return {"PLINTH_DEEPEP_HOST_ROOT": str(root), "EP_NCCL_ROOT_DIR": str(lib.parent.parent), "LD_PRELOAD": str(lib)}


def use(monkeypatch, env: dict[str, str]) -> None:
    """Take ``env`` in this test (spawned ranks inherit it: ``LD_PRELOAD``
    maps the library there) and map the scripted NCCL into this process."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ctypes.CDLL(env["LD_PRELOAD"], mode=os.RTLD_GLOBAL)
