"""Unit tests of plinth.cli: the parser takes its plugin choices and options
from the registry, `platform plugins` output, --check / --device selection."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from plinth.api import PLUGIN_API_VERSION, PluginError, hookimpl  # noqa: E402
from plinth.cli import CATEGORY_OPTIONS, build_parser, main, resolve_choices  # noqa: E402
from plinth.plugins import PluginRegistry  # noqa: E402
from plugin_fakes import accel, plugin_module, registry_of  # noqa: E402


@pytest.fixture(autouse=True)
def _no_env_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLINTH_PLUGINS_ALLOW", raising=False)
    monkeypatch.delenv("PLINTH_PLUGINS_BLOCK", raising=False)


def _vendor_registry() -> PluginRegistry:
    @hookimpl
    def plinth_add_cli_arguments(parser):
        parser.add_argument("--zeta-lanes", type=int, default=4, help="zeta: lanes")

    return registry_of(
        ("plinth-plugin-zeta", "3.1", plugin_module("zeta", accel("zeta", priority=7), plinth_add_cli_arguments=plinth_add_cli_arguments)),
        ("plinth-plugin-eta", "0.2", plugin_module("eta", accel("eta", ["no eta card"], priority=9))),
    )


def test_serve_choices_and_plugin_options_come_from_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser(_vendor_registry())
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--device {auto,eta,zeta}" in out
    assert "--zeta-lanes" in out
    args = parser.parse_args(["serve", "--device", "zeta", "--zeta-lanes", "8"])
    assert args.device == "zeta" and args.zeta_lanes == 8


def test_core_lists_no_plugin_names() -> None:
    """Each category's option is declared in core; the names never are."""
    assert set(CATEGORY_OPTIONS) == {"accelerator", "backend", "a2a", "kv_connector", "proposer"}
    parser = build_parser(registry_of())
    assert parser.parse_args(["serve", "--device", "anything-at-all"]).device == "anything-at-all"


def test_resolve_choices() -> None:
    reg = _vendor_registry()
    assert resolve_choices(reg, {"accelerator": "zeta"})["accelerator"].distribution == "plinth-plugin-zeta"
    assert resolve_choices(reg, {})["accelerator"].name == "zeta"  # auto: eta (priority 9) cannot run
    with pytest.raises(PluginError, match="no eta card"):
        resolve_choices(reg, {"accelerator": "eta"})
    with pytest.raises(PluginError, match="No backend plugins are installed"):
        resolve_choices(reg, {"accelerator": "zeta", "backend": "fast"})


def test_platform_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("plugins", "serve", "generate", "bench"):
        assert command in out
    with pytest.raises(SystemExit):
        main(["plugins", "--help"])
    out = capsys.readouterr().out
    assert "--check" in out and "--device" in out and "--plugins-block" in out


def test_plugins_json_in_this_environment(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plugin_api"] == PLUGIN_API_VERSION
    names = {r["name"] for r in doc["plugins"] if r["category"] == "accelerator"}
    assert {"cpu", "cuda", "ascend", "tpu", "xpu"} <= names
    assert doc["auto"]["accelerator"] == "cpu" or doc["auto"]["accelerator"] in names
    assert "selected" not in doc  # only with --check or a named plugin


def test_plugins_check_failure_exits_2_with_the_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--device", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no accelerator named 'nosuch'")
    assert main(["plugins", "--json", "--device", "nosuch"]) == 2
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["error"].startswith("no accelerator named 'nosuch'") and doc["selected"] == {}


def test_plugin_lists_are_accepted_before_and_after_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--plugins-block", "cuda", "plugins", "--json"], ["plugins", "--json", "--plugins-block", "cuda"]):
        assert main(argv) == 0
        rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["plugins"]}
        assert rows["cuda"]["status"] == "blocked", argv
