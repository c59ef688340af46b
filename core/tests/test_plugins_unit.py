"""Unit tests of plinth.plugins: descriptors, API ranges, patterns, selection,
validation of hook implementations, reports. Installs are covered by
tests/test_plugins_install.py."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from plinth.api import (  # noqa: E402
    PLUGIN_API_VERSION,
    Accelerator,
    AcceleratorDescriptor,
    AcceleratorInfo,
    BackendDescriptor,
    PluginError,
    SelectionContext,
    hookimpl,
)
from plinth.plugins import (  # noqa: E402
    BLOCKED,
    FAILED,
    INCOMPATIBLE,
    OK,
    UNAVAILABLE,
    PluginRegistry,
    _api_compatible,
    _matches,
    _split_patterns,
    stub_methods,
)
from plugin_fakes import accel, plugin_module, registry_of  # noqa: E402

CTX = SelectionContext()


# ---- descriptors, API ranges, patterns -----------------------------------------


@pytest.mark.parametrize(
    "process_env, error",
    [
        ([("OMP_X", "1")], "must be a tuple"),
        ((("OMP_X",),), "not a \\(name, value\\) pair"),
        ((("OMP_X", 1),), "not a \\(name, value\\) pair"),
        ((("", "1"),), "cannot set"),
        ((("A=B", "1"),), "cannot set"),
        ((("A", "x\0y"),), "cannot set"),
        ((("A", "1"), ("A", "2")), "sets A twice"),
    ],
)
def test_accelerator_descriptor_rejects_a_process_env_the_cli_could_not_set(process_env: object, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        AcceleratorDescriptor(name="npu", impl="pkg.mod:Cls", process_env=process_env)  # type: ignore[arg-type]
    ok = AcceleratorDescriptor(name="npu", impl="pkg.mod:Cls", process_env=(("GOMP_SPINCOUNT", "20000"), ("EMPTY", "")))
    assert ok.process_env[0] == ("GOMP_SPINCOUNT", "20000")


def test_descriptor_validates_name_and_impl_path() -> None:
    AcceleratorDescriptor(name="my-npu.v2", impl="pkg.mod:Cls")
    with pytest.raises(ValueError, match="simple identifier"):
        AcceleratorDescriptor(name="bad name", impl="pkg.mod:Cls")
    with pytest.raises(ValueError, match="'module:attr'"):
        AcceleratorDescriptor(name="x", impl="pkg.mod.Cls")
    assert AcceleratorDescriptor.category == "accelerator" and BackendDescriptor.category == "backend"


@pytest.mark.parametrize(
    "spec, ok",
    [(">=2.0,<3", True), (">=1", True), ("~=2.0", True), (">=1.0,<2", False), (">=3,<4", False), ("<2", False), ("not a spec", False)],
)
def test_api_ranges(spec: str, ok: bool) -> None:
    assert _api_compatible(spec)[0] is ok
    if not ok:
        assert spec in _api_compatible(spec)[1]


def test_patterns() -> None:
    assert _split_patterns(" a, b ,,c") == ["a", "b", "c"]
    assert _split_patterns(["a,b", "c"]) == ["a", "b", "c"]
    assert _split_patterns(None) == [] and _split_patterns("") == []
    assert _matches(["plinth-plugin-*"], "cpu", "plinth-plugin-cpu")
    assert _matches(["accelerator:cpu"], "accelerator:cpu")
    assert not _matches(["cpu"], "cuda", "plinth-plugin-cuda")


# ---- selection ---------------------------------------------------------------


def _three() -> PluginRegistry:
    return registry_of(
        ("dist-a", "1.0", plugin_module("a", accel("alpha", priority=10))),
        ("dist-b", "2.0", plugin_module("b", accel("beta", ["no beta device"], priority=20))),
        ("dist-c", "3.0", plugin_module("c", accel("gamma", priority=5))),
    )


def test_auto_takes_highest_priority_that_validates_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    reg = _three()
    with caplog.at_level(logging.INFO, logger="plinth.plugins"):
        entry = reg.select("accelerator", "auto", CTX)
    assert entry.name == "alpha" and entry.distribution == "dist-a" and entry.version == "1.0"
    assert "auto chose alpha (dist-a 1.0) (skipped beta: no beta device)" in caplog.text
    assert reg.select("accelerator", None, CTX).name == "alpha"


def test_prefer_orders_before_priority() -> None:
    reg = _three()
    assert reg.select("accelerator", "auto", CTX, prefer=["gamma"]).name == "gamma"
    # a preferred name that cannot run is skipped, not fatal
    assert reg.select("accelerator", "auto", CTX, prefer=["beta", "gamma"]).name == "gamma"


def test_named_choice_validates_or_fails_with_every_candidates_reasons() -> None:
    reg = _three()
    assert reg.select("accelerator", "gamma", CTX).name == "gamma"
    with pytest.raises(PluginError) as exc:
        reg.select("accelerator", "beta", CTX)
    msg = str(exc.value)
    assert "accelerator beta (dist-b 2.0) cannot be used: no beta device" in msg
    assert "alpha (dist-a 1.0): ok" in msg and "gamma (dist-c 3.0): ok" in msg


def test_unknown_name_lists_usable_names_and_reasons() -> None:
    with pytest.raises(PluginError) as exc:
        _three().select("accelerator", "nosuch", CTX)
    msg = str(exc.value)
    assert "no accelerator named 'nosuch' (usable here: alpha, gamma)" in msg
    assert "beta (dist-b 2.0): unavailable: no beta device" in msg


def test_nothing_usable_lists_every_candidate() -> None:
    reg = registry_of(("d", "1", plugin_module("x", accel("x1", ["needs X"]), )))
    with pytest.raises(PluginError, match=r"no usable accelerator plugin\. Installed accelerator plugins:\n  x1 \(d 1\): unavailable: needs X"):
        reg.select("accelerator", "auto", CTX)
    empty = registry_of()
    with pytest.raises(PluginError, match="No accelerator plugins are installed"):
        empty.select("accelerator", "auto", CTX)


def test_check_that_raises_is_a_failure_not_a_fallback() -> None:
    reg = registry_of(
        ("d1", "1", plugin_module("r", accel("raiser", raises=RuntimeError("boom"), priority=50))),
        ("d2", "1", plugin_module("o", accel("other"))),
    )
    with pytest.raises(PluginError, match=r"check\(\) raised RuntimeError: boom"):
        reg.select("accelerator", "raiser", CTX)
    row = next(r for r in reg.report() if r["name"] == "raiser")
    assert row["status"] == FAILED and row["reasons"] == ["check() raised RuntimeError: boom"]


def test_impl_that_cannot_import_or_is_not_a_subclass_fails() -> None:
    reg = registry_of(
        ("d1", "1", plugin_module("m", accel("missing", impl="no_such_module_xyz:Cls"))),
        ("d2", "1", plugin_module("w", accel("wrong", impl="builtins:dict"))),
    )
    rows = {r["name"]: r for r in reg.report()}
    assert rows["missing"]["status"] == FAILED
    assert rows["missing"]["reasons"][0].startswith("cannot import no_such_module_xyz:Cls: ModuleNotFoundError")
    assert rows["wrong"]["status"] == FAILED
    assert rows["wrong"]["reasons"] == ["builtins:dict is not a subclass of plinth.api.Accelerator"]
    with pytest.raises(PluginError, match="cannot import no_such_module_xyz"):
        reg.select("accelerator", "missing", CTX)


def test_duplicate_name_is_an_error_naming_both_distributions() -> None:
    reg = registry_of(
        ("vendor-one", "1.0", plugin_module("p", accel("npu"))),
        ("vendor-two", "2.0", plugin_module("q", accel("npu"))),
    )
    for name in ("npu", "auto"):
        with pytest.raises(PluginError) as exc:
            reg.select("accelerator", name, CTX)
        assert "vendor-one 1.0" in str(exc.value) and "vendor-two 2.0" in str(exc.value)
    assert reg.duplicates() == ["duplicate accelerator name 'npu': registered by vendor-one 1.0 and vendor-two 2.0"]
    rows = [r for r in reg.report() if r["name"] == "npu"]
    assert [r["status"] for r in rows] == [FAILED, FAILED]
    assert rows[0]["reasons"][0] == "duplicate name: also registered by vendor-two 2.0"


def test_incompatible_api_is_shown_and_cannot_be_chosen() -> None:
    reg = registry_of(
        ("new", "9", plugin_module("n", accel("future", api=">=3,<4", priority=99))),
        ("old", "1", plugin_module("o", accel("present"))),
    )
    row = next(r for r in reg.report() if r["name"] == "future")
    assert row["status"] == INCOMPATIBLE and row["reasons"] == [f"supports plugin API >=3,<4, core provides {PLUGIN_API_VERSION}"]
    assert reg.select("accelerator", "auto", CTX).name == "present"
    with pytest.raises(PluginError, match="supports plugin API >=3,<4"):
        reg.select("accelerator", "future", CTX)


def test_status_of_unavailable_and_ok() -> None:
    rows = {r["name"]: r for r in _three().report()}
    assert rows["alpha"]["status"] == OK and rows["beta"]["status"] == UNAVAILABLE
    assert rows["beta"]["reasons"] == ["no beta device"]
    assert {"category", "name", "distribution", "version", "status", "reasons", "priority", "impl", "api"} <= set(rows["alpha"])


# ---- hook implementations ------------------------------------------------------


def test_registration_hook_returning_the_wrong_descriptor_fails_the_plugin() -> None:
    @hookimpl
    def plinth_register_backends():
        return [accel("not-a-backend")]

    reg = registry_of(("bad", "1", plugin_module("bad", accel("fine"), plinth_register_backends=plinth_register_backends)))
    info = reg.entry_points[0]
    assert info.status == FAILED
    assert info.error == "plinth_register_backends() returned AcceleratorDescriptor, expected BackendDescriptor"
    assert reg.entries["accelerator"] == []  # nothing of a half-registered plugin is kept


def test_registration_hook_that_raises_fails_the_plugin_only() -> None:
    @hookimpl
    def plinth_register_accelerators():
        raise RuntimeError("driver probe exploded")

    bad = plugin_module("bad")
    bad.plinth_register_accelerators = plinth_register_accelerators
    reg = registry_of(("bad", "1", bad), ("good", "1", plugin_module("good", accel("fine"))))
    assert reg.entry_points[0].status == FAILED
    assert reg.entry_points[0].error == "plinth_register_accelerators() raised RuntimeError: driver probe exploded"
    assert reg.names("accelerator") == ["fine"]
    row = next(r for r in reg.report() if r["distribution"] == "bad")
    assert row["status"] == FAILED and "driver probe exploded" in row["reasons"][0]


def test_a_bad_process_env_fails_its_plugin_at_discovery_with_the_reason() -> None:
    @hookimpl
    def plinth_register_accelerators():
        return [AcceleratorDescriptor(name="npu", impl="pkg.mod:Cls", process_env=(("A=B", "1"),))]

    bad = plugin_module("npu")
    bad.plinth_register_accelerators = plinth_register_accelerators
    reg = registry_of(("npu", "1", bad), ("good", "1", plugin_module("good", accel("fine"))))
    assert reg.entry_points[0].status == FAILED
    assert "process_env cannot set 'A=B'='1'" in reg.entry_points[0].error
    assert reg.names("accelerator") == ["fine"]  # the CLI never sees it, so never sets it


def test_unknown_hook_and_bad_signature_are_rejected() -> None:
    @hookimpl
    def plinth_register_widgets():
        return []

    @hookimpl
    def plinth_add_cli_arguments(parsr):  # a misspelt argument
        pass

    reg = registry_of(
        ("w", "1", plugin_module("w", plinth_register_widgets=plinth_register_widgets)),
        ("s", "1", plugin_module("s", plinth_add_cli_arguments=plinth_add_cli_arguments)),
    )
    w, s = reg.entry_points
    assert w.status == FAILED and "'plinth_register_widgets', which is not a plinth hook" in w.error
    assert s.status == FAILED and s.error.startswith("invalid hook implementation")


def test_hooks_are_called_by_keyword_and_arguments_are_opt_in() -> None:
    calls = []

    @hookimpl
    def plinth_add_cli_arguments(parser):
        calls.append(parser)

    noargs = plugin_module("n")
    noargs.plinth_add_cli_arguments = hookimpl(lambda: calls.append("no args"))
    reg = registry_of(("a", "1", plugin_module("a", plinth_add_cli_arguments=plinth_add_cli_arguments)), ("n", "1", noargs))
    assert all(i.status == OK for i in reg.entry_points)
    reg.hook.plinth_add_cli_arguments(parser="P")
    assert sorted(map(str, calls)) == ["P", "no args"]


# ---- allow / block on descriptors ---------------------------------------------------


def test_block_and_allow_by_category_qualified_name() -> None:
    mods = lambda: (("d", "1", plugin_module("m", accel("one"), accel("two"))),)  # noqa: E731
    reg = registry_of(*mods(), block=["accelerator:two"])
    status = {r["name"]: r["status"] for r in reg.report()}
    assert status == {"one": OK, "two": BLOCKED}
    reg = registry_of(*mods(), allow=["one"])
    status = {r["name"]: r["status"] for r in reg.report()}
    assert status == {"one": OK, "two": BLOCKED}
    with pytest.raises(PluginError, match="not in the plugin allow list"):
        reg.select("accelerator", "two", CTX)


# ---- the real discovery, in this environment ---------------------------------------------


def test_discovery_reads_installed_distributions() -> None:
    reg = PluginRegistry.discover(allow="", block="")
    cpu = reg.get("accelerator", "cpu")
    assert cpu.distribution == "plinth-plugin-cpu"
    assert cpu.version == importlib.metadata.version("plinth-plugin-cpu")
    assert cpu.source.value == "plinth_plugin_cpu.plugin"
    assert {"cpu", "cuda", "ascend", "tpu", "xpu"} <= set(reg.names("accelerator"))


def test_discovery_honours_the_environment_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLINTH_PLUGINS_BLOCK", "cuda")
    reg = PluginRegistry.discover()
    assert next(i for i in reg.entry_points if i.name == "cuda").status == BLOCKED
    assert "cuda" not in reg.names("accelerator")
    # an explicit list (the CLI flag) wins over the environment
    reg = PluginRegistry.discover(block="")
    assert "cuda" in reg.names("accelerator")


# ---- scaffold stubs: methods that only raise NotImplementedError ----------------


class _Stubbed(Accelerator):
    device_type = "cpu"

    def info(self) -> AcceleratorInfo:
        """The contract, as a scaffold writes it."""
        raise NotImplementedError("_Stubbed.info(): not implemented yet")

    def memory(self, index: int = 0) -> tuple[int, int]:
        raise NotImplementedError

    @classmethod
    def helper(cls) -> int:
        raise NotImplementedError()

    def written(self) -> int:
        if self.device_type:
            raise NotImplementedError("only sometimes")
        return 1


class _HalfDone(_Stubbed):
    def info(self) -> AcceleratorInfo:
        return AcceleratorInfo("cpu", "gloo", 1, dtypes=("float32",), default_dtype="float32")


def test_stub_methods_are_those_that_only_raise_not_implemented() -> None:
    assert stub_methods(_Stubbed) == ["_Stubbed.helper", "_Stubbed.info", "_Stubbed.memory"]
    # a subclass that writes one keeps the others; plinth's own bases (whose
    # abstract methods raise NotImplementedError) are never the plugin's stubs
    assert stub_methods(_HalfDone) == ["_HalfDone.helper", "_HalfDone.memory"]
    assert stub_methods(type(accel_impl())) == []


def accel_impl() -> Accelerator:
    return PluginRegistry.discover(allow="cpu", block="").get("accelerator", "cpu").load()()


def test_a_plugin_with_stubs_is_unavailable_naming_them_and_never_chosen() -> None:
    module = sys.modules[__name__]
    reg = registry_of(("vendor-stub", "0.1.0", plugin_module("stub", accel("stubby", impl=f"{module.__name__}:_Stubbed"))))
    entry = reg.get("accelerator", "stubby")
    reasons = entry.evaluate(CTX)
    assert entry.status == UNAVAILABLE
    assert reasons == ["not implemented yet: _Stubbed.helper, _Stubbed.info, _Stubbed.memory (only raise NotImplementedError)"]
    with pytest.raises(PluginError, match="not implemented yet: _Stubbed.helper"):
        reg.select("accelerator", "stubby", CTX)
