"""check() judges the planned layout (``ctx.layout``) without importing
deep_ep: every upstream limit is refused with its number, deepep is chosen
with the fake installed on a planned SM90 layout, and choosing it by name
on this machine fails with its reasons before any model loads. What DeepEP
needs of the host (its API, one NCCL, V2's NCCL / torch / GIN, IBGDA for the
low-latency kernels) is judged on a scripted host (tests/fake_nccl.py: a
real ``libnccl.so.2`` mapped into the process)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from plinth.api import PlannedLayout, PluginError, SelectionContext
from plinth.testing import discover_all
from plinth_plugin_deepep import a2a as deepep_a2a
from plinth_plugin_deepep import host
from plinth_plugin_deepep.a2a import LEGACY_RANKS, LOW_LATENCY_HIDDEN, DeepEPAllToAll

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
import fake_nccl  # noqa: E402

FAKE = str(HERE / "fake")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine: check() may pass")


def plan(**kw) -> PlannedLayout:
    base = dict(world=8, dp=8, ep=8, local_world=8, device_type="cuda", capability="sm_90", hidden_size=4096,
                num_experts=64, top_k=8, max_tokens_per_step=2048, max_num_seqs=128)  # fmt: skip
    return PlannedLayout(**{**base, **kw})


def check(options=None, **kw) -> list[str]:
    return DeepEPAllToAll.check(SelectionContext(ep=kw.get("ep", 8), options=dict(options or {}), layout=plan(**kw)))


@pytest.fixture
def fake_installed(monkeypatch):
    """The fake deep_ep on a host where it runs: NCCL 2.30.4 loaded and
    linked, an RDMA device, IBGDA enabled."""
    monkeypatch.syspath_prepend(FAKE)
    sys.modules.pop("deep_ep", None)
    fake_nccl.use(monkeypatch, fake_nccl.scripted_host())
    for name in ("EP_DISABLE_GIN", "EP_SUPPRESS_NCCL_CHECK"):
        monkeypatch.delenv(name, raising=False)
    yield
    assert "deep_ep" not in sys.modules  # check() never imports it


def test_chosen_with_the_fake_on_a_planned_sm90_layout(fake_installed):
    assert check() == []
    assert check({"deepep_generation": "legacy"}) == []
    assert check({"deepep_generation": "legacy", "deepep_low_latency": "on"}) == []


@no_gpu
def test_every_reason_on_a_cpu_machine():
    reasons = DeepEPAllToAll.check(SelectionContext(ep=2, layout=plan(world=2, dp=2, ep=2, device_type="cpu", capability="")))
    text = "; ".join(reasons)
    assert "deep_ep is not installed" in text and "needs CUDA SM90+ (the planned device is cpu)" in text
    assert "world is not set up" not in text  # judged before any group exists
    assert "deep_ep" not in sys.modules


def test_each_upstream_limit_is_refused_with_its_number(fake_installed, monkeypatch):
    assert any("sm_80" in r for r in check(capability="sm_80"))
    legacy = {"deepep_generation": "legacy"}
    assert any("not 3" in r and str(LEGACY_RANKS[:2]).rstrip(")") in r for r in check(legacy, world=3, dp=3, ep=3, num_experts=63))
    assert any("multiple of 8 NVLink peers" in r for r in check(legacy, world=12, dp=12, ep=12, num_experts=48))  # 12 is not in the map either
    assert any("1024" in r for r in check(legacy, num_experts=8 * 1032))
    assert any("do not split over ep 8" in r for r in check(num_experts=60))
    assert any("16 bytes" in r for r in check(hidden_size=1001))
    ll = {"deepep_generation": "legacy", "deepep_low_latency": "on"}
    assert any(str(LOW_LATENCY_HIDDEN) in r and "not 1024" in r for r in check(ll, hidden_size=1024))
    assert any("top-k <= 11" in r and "not 12" in r for r in check(ll, top_k=12))
    assert any("NVSHMEM_QP_DEPTH 1024 < 2 x (max tokens per rank 512 + 1) = 1026" in r for r in check(ll, max_num_seqs=512))
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "2048")
    assert check(ll, max_num_seqs=512) == []
    assert check({"deepep_generation": "legacy"}, hidden_size=1024) == []  # auto: decode takes the normal kernels
    assert any("deepep_fp8 is not offered" in r for r in check({"deepep_fp8": True}))
    assert any("must be auto, legacy or v2" in r for r in check({"deepep_generation": "v3"}))
    assert any("must be auto, on or off" in r for r in check({"deepep_low_latency": "sometimes"}))


@no_gpu
def test_start_up_with_a2a_deepep_fails_with_its_reasons_before_any_model_loads():
    from plinth import LLM

    with pytest.raises(PluginError) as err:  # the model path does not exist: nothing was located or loaded
        LLM("/nonexistent/model", ep=2, a2a="deepep", device="cpu")
    assert "deep_ep is not installed" in str(err.value) and "needs CUDA SM90+" in str(err.value)


def test_platform_plugins_answers_without_a_plan():
    reasons = discover_all().get("a2a", "deepep").evaluate(SelectionContext())
    assert all("planned" not in r for r in reasons)


# ---- what DeepEP needs of the host ------------------------------------------------------------


def test_v2_is_chosen_only_with_its_prerequisites(fake_installed, monkeypatch):
    """NCCL >= 2.30.4 and torch >= 2.10 (DeepEP README), GIN with more than
    one rank unless EP_DISABLE_GIN (nccl.cu:86-90): auto falls back to the
    legacy Buffer and says why; v2 by name is refused with the reasons."""
    v2 = {"deepep_generation": "v2"}
    assert check(v2) == []
    assert deepep_a2a._generation({}, "2.1.0", deepep_a2a.host_report(8).v2_why) == "v2"
    monkeypatch.setenv("PLINTH_DEEPEP_HOST_ROOT", fake_nccl.scripted_host(rdma=False)["PLINTH_DEEPEP_HOST_ROOT"])
    why = deepep_a2a.host_report(8).v2_why
    assert any("needs NCCL GIN" in r and "nccl.cu:86-90" in r for r in why), why
    assert deepep_a2a._generation({}, "2.1.0", why) == "legacy"
    assert check() == []  # auto: the legacy Buffer (normal kernels on one node)
    assert any("needs NCCL GIN" in r for r in check(v2))
    assert deepep_a2a.host_report(1).v2_why == []  # one rank needs no GIN
    monkeypatch.setenv("EP_DISABLE_GIN", "1")
    assert check(v2) == []
    monkeypatch.setattr(host, "torch_version", lambda: (2, 9, 1))
    assert any("V2 needs torch >= 2.10" in r and "2.9.1" in r for r in check(v2))


def _check_in_child(env: dict, code: str) -> dict:
    """check()'s host probes in a fresh interpreter (a process keeps the NCCL it mapped)."""
    program = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {FAKE!r})
        from plinth_plugin_deepep import a2a, host
        {code}
    """)
    child_env = {**os.environ, **env}
    child_env.pop("EP_DISABLE_GIN", None)
    out = subprocess.run([sys.executable, "-c", program], env=child_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch_s_pinned_nccl_is_below_v2_s_minimum():
    """torch 2.11's wheels pin NCCL 2.28.9 (cu13): V2 is not taken, and by name refused."""
    env = fake_nccl.scripted_host(version=(2, 28, 9))
    got = _check_in_child(env, """
        r = a2a.host_report(8)
        from plinth.api import PlannedLayout
        ctx = a2a.SelectionContext(ep=8, options={"deepep_generation": "v2"}, layout=PlannedLayout(
            world=8, dp=8, ep=8, device_type="cuda", capability="sm_90", hidden_size=4096, num_experts=64, top_k=8,
            max_tokens_per_step=2048, max_num_seqs=128))
        print(json.dumps({"v2_why": r.v2_why, "problems": r.problems, "reasons": a2a.DeepEPAllToAll.check(ctx)}))
    """)
    assert got["problems"] == []  # one NCCL, the one DeepEP linked: importable (the legacy Buffer runs)
    assert any("V2 needs NCCL >= 2.30.4" in r and "loaded 2.28.9" in r for r in got["v2_why"]), got
    assert any("V2 needs NCCL >= 2.30.4" in r for r in got["reasons"])


def test_one_nccl_equal_to_the_linked_one(tmp_path):
    """import deep_ep asserts one loaded NCCL, byte-equal to the one it
    linked (deep_ep/__init__.py:46-68): check() says so before any rank starts."""
    new, old = fake_nccl.scripted_host(version=(2, 30, 4)), fake_nccl.scripted_host(version=(2, 31, 0))
    code = 'print(json.dumps(a2a.host_report(8).problems))'
    assert _check_in_child(new, code) == []
    two = {**new, "LD_PRELOAD": f"{new['LD_PRELOAD']} {old['LD_PRELOAD']}"}
    assert any("two NCCL libraries are loaded" in r for r in _check_in_child(two, code))
    other = {**new, "EP_NCCL_ROOT_DIR": old["EP_NCCL_ROOT_DIR"]}
    assert any("is not the one DeepEP linked" in r for r in _check_in_child(other, code))
    assert _check_in_child({**other, "EP_SUPPRESS_NCCL_CHECK": "1"}, code) == []
    none = {k: v for k, v in new.items() if k != "LD_PRELOAD"}
    assert any("no NCCL library is loaded" in r for r in _check_in_child({**none, "LD_PRELOAD": ""}, code))


def test_the_hint_and_the_extra_point_at_deepep_s_source(monkeypatch):
    """PyPI's deep-ep is DeepEP 1.0.0: neither the hint nor the gpu extra may name it."""
    import tomllib

    real = deepep_a2a.importlib.util.find_spec
    monkeypatch.setattr(deepep_a2a.importlib.util, "find_spec", lambda name, *a: None if name == "deep_ep" else real(name, *a))
    text = "; ".join(DeepEPAllToAll.check(SelectionContext()))
    assert "deep_ep is not installed" in text and "from source" in text and "github.com/deepseek-ai/DeepEP" in text
    assert "pip install deep-ep" not in text
    project = tomllib.loads((HERE.parent / "pyproject.toml").read_text())["project"]
    (gpu,) = project["optional-dependencies"]["gpu"]
    assert gpu.replace(" ", "").startswith("deep_ep@git+https://github.com/deepseek-ai/DeepEP"), gpu


OLD_DEEP_EP = """
class Buffer:  # deep_ep/buffer.py of PyPI's deep-ep 1.0.0: no use_fp8
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             async_finish=False, return_recv_hook=False):
        pass
"""


def test_an_api_without_use_fp8_is_refused(fake_installed, tmp_path, monkeypatch):
    """The plugin calls low_latency_dispatch(..., use_fp8=False): 1.0.0 would
    raise TypeError on the first decode step; check() reads the source."""
    old = tmp_path / "old" / "deep_ep"
    old.mkdir(parents=True)
    (old / "__init__.py").write_text("from .buffer import Buffer\n__version__ = '1.0.0'\n")
    (old / "buffer.py").write_text(OLD_DEEP_EP)
    monkeypatch.syspath_prepend(str(old.parent))
    reasons = check({"deepep_generation": "legacy"})
    assert any("old DeepEP: its low_latency_dispatch takes no use_fp8" in r and "from source" in r for r in reasons), reasons
    (old / "buffer.py").write_text("class Buffer:\n    pass\n")
    assert any("has no Buffer.low_latency_dispatch" in r for r in check({"deepep_generation": "legacy"}))


def test_low_latency_needs_rdma_and_ibgda(fake_installed, monkeypatch):
    """legacy.py:561-563: every rank visible over RDMA, IBGDA enabled."""
    ll = {"deepep_generation": "legacy", "deepep_low_latency": "on"}
    assert check(ll) == []
    monkeypatch.setenv("PLINTH_DEEPEP_HOST_ROOT", fake_nccl.scripted_host(rdma=False)["PLINTH_DEEPEP_HOST_ROOT"])
    assert any("no RDMA device" in r and "legacy.py:561-563" in r for r in check(ll))
    assert check({"deepep_generation": "legacy"}) == []  # auto: decode on the normal kernels
    monkeypatch.setenv("PLINTH_DEEPEP_HOST_ROOT", fake_nccl.scripted_host(ibgda=False)["PLINTH_DEEPEP_HOST_ROOT"])
    assert any("IBGDA is not enabled" in r for r in check(ll))
