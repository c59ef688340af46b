"""Every engine setting is declared once (``plinth.engine.config``): the
flags of ``platform serve`` / ``generate`` / ``bench offline`` and the
signature of ``LLM`` are made from the declarations, and no other place in
the engine, its command line or the plugin contract writes a setting's
default again. Start-up's result is frozen; so is the selection context."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any

import plinth
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from plinth.api import ResolvedConfig, SelectionContext  # noqa: E402
from plinth.cli import build_parser, engine_kwargs  # noqa: E402
from plinth.engine.config import (  # noqa: E402
    SECTIONS,
    EngineConfig,
    iter_settings,
    setting_defaults,
    setting_sections,
)
from plinth.errors import ConfigError  # noqa: E402
from plugin_fakes import registry_of  # noqa: E402

PACKAGE = Path(plinth.__file__).parent
DEFAULTS = setting_defaults()
#: other names a setting goes by in the code
ALIASES = {"utilization": "gpu_memory_utilization"}
#: where a setting's default may be written: its declaration
DECLARED_IN = PACKAGE / "engine" / "config.py"
#: not scanned: the conformance kit's fixtures (small pools, fixed seeds for its own checks) and the
#: benchmarks' workload knobs (``--seed`` of a prompt generator); bench offline's engine flags are
#: checked below through its parser
NOT_SCANNED = (PACKAGE / "testing", PACKAGE / "bench")


def _literal(node: ast.expr | None) -> tuple[bool, Any]:
    if isinstance(node, ast.Constant):
        return True, node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return True, -node.operand.value  # type: ignore[operator]
    return False, None


def _same(name: str, value: Any) -> bool:
    default = DEFAULTS[ALIASES.get(name, name)]
    return value is not None and type(value) is type(default) and value == default


def restated_defaults(path: Path, root: Path = PACKAGE) -> list[str]:
    """Where ``path`` writes a setting's default again: a parameter or a
    dataclass field named as the setting, or a flag spelled as the setting's,
    with the same literal default (None, "not given", is no default)."""
    tree = ast.parse(path.read_text())
    names = set(DEFAULTS) | set(ALIASES)
    flags = {"--" + n.replace("_", "-"): n for n in DEFAULTS}
    found = []
    contract = "contract" in path.parts
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults) :], a.defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
            for arg, default in pairs:
                is_literal, value = _literal(default)
                if arg.arg in names and is_literal and _same(arg.arg, value):
                    found.append(f"{path.relative_to(root)}:{arg.lineno} {node.name}({arg.arg}={value!r})")
        elif isinstance(node, ast.ClassDef) and not contract:
            # the contract's context dataclasses (SelectionContext, LoadContext, PlannedLayout) hold what a
            # plugin is told with nothing said (one rank): the contract cannot import the engine's settings
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id in names:
                    is_literal, value = _literal(stmt.value)
                    if is_literal and _same(stmt.target.id, value):
                        found.append(f"{path.relative_to(root)}:{stmt.lineno} {node.name}.{stmt.target.id} = {value!r}")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args:
            is_literal, flag = _literal(node.args[0])
            if is_literal and flag in flags:
                for kw in node.keywords:
                    if kw.arg == "default" and _literal(kw.value)[0] and _same(flags[flag], _literal(kw.value)[1]):
                        found.append(f"{path.relative_to(root)}:{kw.value.lineno} add_argument({flag}, default={_literal(kw.value)[1]!r})")
    return found


def test_no_default_is_written_twice() -> None:
    paths = [p for p in PACKAGE.rglob("*.py") if p != DECLARED_IN and not any(p.is_relative_to(d) for d in NOT_SCANNED)]
    assert len(paths) > 50
    found = [hit for p in sorted(paths) for hit in restated_defaults(p)]
    assert not found, "a setting's default written outside plinth/engine/config.py:\n" + "\n".join(found)


def test_the_scan_sees_a_second_default(tmp_path: Path) -> None:
    """Each kind of second declaration the scan is meant to catch, in one file."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def build(*, page_size: int = 16, utilization: float = 0.9): ...\n"
        "class Opts:\n    max_num_seqs: int = 64\n"
        "parser.add_argument('--max-num-batched-tokens', default='auto')\n"
        "def fine(page_size: int = 4, seed=None): ...\n"
    )
    found = restated_defaults(bad, tmp_path)
    assert [h.split(" ", 1)[1] for h in found] == [
        "build(page_size=16)", "build(utilization=0.9)", "Opts.max_num_seqs = 64", "add_argument(--max-num-batched-tokens, default='auto')",
    ]  # fmt: skip


# ---- the surfaces made from the declarations ---------------------------------------------------


def test_each_name_is_declared_in_one_section() -> None:
    owner = setting_sections()
    assert len(owner) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    assert {"page_size", "gpu_memory_utilization", "max_num_seqs", "deterministic", "max_num_batched_tokens"} <= set(owner)
    for _, f in iter_settings():
        assert f.metadata.get("help"), f"{f.name} has no help"


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_the_flags_take_the_declared_defaults(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser(registry_of())
    extra = ["--prompt", "x"] if command == "generate" else []
    args = parser.parse_args([command, *extra])
    kwargs = engine_kwargs(args)
    for _, f in iter_settings():
        commands = f.metadata.get("commands")
        if commands and command not in commands:
            assert f.name not in kwargs, f"--{f.name} is offered to `{command}`, which ignores it"
        elif f.metadata.get("cli", True) or f.name == "model":  # the model is the positional argument
            assert kwargs[f.name] == DEFAULTS[f.name], f.name
        else:
            assert f.name not in kwargs, f"{f.name} has no flag"
    assert EngineConfig.from_kwargs(**kwargs) == EngineConfig()
    with pytest.raises(SystemExit):
        parser.parse_args([command, *extra, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--page-size PAGE_SIZE tokens per KV page (any value >= 1) (default: 16)" in out
    assert "(default: 0.9)" in out and "(default: 64)" in out


def test_the_llm_signature_is_made_from_the_declarations() -> None:
    from plinth import LLM

    params = inspect.signature(LLM).parameters
    for name, default in DEFAULTS.items():
        assert params[name].default == default, name
    assert params["plugin_options"].default is None and params["registry"].default is None
    with pytest.raises(TypeError, match=r"page_sise \(did you mean page_size\?\)"):
        LLM(page_sise=32)  # before anything loads


def test_offline_bench_flags_are_the_engines() -> None:
    import argparse

    from plinth.bench.offline import ENGINE_SETTINGS, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, registry_of())
    args = parser.parse_args([])
    assert {name: getattr(args, name) for name in ENGINE_SETTINGS} == {name: DEFAULTS[name] for name in ENGINE_SETTINGS}


def test_from_kwargs_validates_each_section() -> None:
    config = EngineConfig.from_kwargs(page_size=32, tp=2, max_num_batched_tokens="128", speculative_method="none")
    assert (config.cache.page_size, config.parallel.tp, config.scheduler.max_num_batched_tokens) == (32, 2, 128)
    assert config.speculative.speculative_method is None and config.speculative.k == 0
    assert EngineConfig.from_kwargs(speculative_method="ngram").speculative.k == 4
    assert config.replace(page_size=8).cache.page_size == 8 and config.replace(page_size=8).parallel.tp == 2
    for bad in (dict(page_size=0), dict(gpu_memory_utilization=1.5), dict(tp=0), dict(max_num_seqs=0), dict(dist_timeout=0)):
        with pytest.raises(ConfigError):
            EngineConfig.from_kwargs(**bad)


# ---- frozen -------------------------------------------------------------------------------------


def test_the_settings_the_selection_context_and_the_resolved_config_are_frozen() -> None:
    import torch

    config = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.page_size = 8  # type: ignore[misc]
    ctx = SelectionContext()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.deterministic = True  # type: ignore[misc]
    resolved = ResolvedConfig(
        accelerator="cpu", backend="torch", dtype=torch.float32, deterministic=False, page_size=16, num_pages=(8,),
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
    )  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.deterministic = True  # type: ignore[misc]
