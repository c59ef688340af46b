"""Which model plugin builds a model: two plugins claiming one architecture
are resolved by priority with a log line; a model name a plugin serves
(``ModelDescriptor.named_models``) resolves to the path it gives."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from plinth.api import ConfigError, ModelDescriptor, ModelLoader, ModelSource, SelectionContext, hookimpl  # noqa: E402
from plinth.engine.model_source import locate_model, named_model_path  # noqa: E402
from plinth.engine.startup import choose_model_loader  # noqa: E402
from plugin_fakes import impl_module, plugin_module, registry_of  # noqa: E402


class FakeLoader(ModelLoader):
    """Never asked to load: only the choice of loader is under test."""

    def load_config(self, source):
        raise AssertionError("not called")

    def load_tokenizer(self, source):
        raise AssertionError("not called")

    def load_model(self, source, config, ctx):
        raise AssertionError("not called")


impl_module().FakeLoader = FakeLoader
LOADER = f"{impl_module().__name__}:FakeLoader"


def model_plugin(name: str, priority: int, **kw):
    descriptor = ModelDescriptor(name=name, impl=LOADER, priority=priority, architectures=("ToyForCausalLM",), **kw)

    @hookimpl
    def plinth_register_model_loaders():
        return [descriptor]

    return plugin_module(name, plinth_register_model_loaders=plinth_register_model_loaders)


SOURCE = ModelSource(path="/nowhere", format="hf", architecture="ToyForCausalLM")


def test_two_plugins_claiming_an_architecture_resolve_by_priority_with_a_log_line(caplog) -> None:
    reg = registry_of(("dist-low", "1.0", model_plugin("low", 5)), ("dist-high", "2.0", model_plugin("high", 20)))
    with caplog.at_level(logging.INFO, logger="plinth.startup"):
        entry = choose_model_loader(reg, SOURCE, SelectionContext())
    assert entry.name == "high"
    assert (
        "model: hf 'ToyForCausalLM' is claimed by high (dist-high 2.0) priority 20, low (dist-low 1.0) priority 5: "
        "using high (highest priority)" in caplog.text
    )


def test_a_priority_tie_goes_to_the_first_name_whatever_the_install_order(caplog) -> None:
    for order in ((("d-b", "1", model_plugin("bravo", 7)), ("d-a", "1", model_plugin("alpha", 7))),
                  (("d-a", "1", model_plugin("alpha", 7)), ("d-b", "1", model_plugin("bravo", 7)))):
        with caplog.at_level(logging.INFO, logger="plinth.startup"):
            assert choose_model_loader(registry_of(*order), SOURCE, SelectionContext()).name == "alpha"
    assert "using alpha (highest priority, then name)" in caplog.text


def test_one_claimant_says_nothing(caplog) -> None:
    reg = registry_of(("dist-one", "1.0", model_plugin("one", 0)))
    with caplog.at_level(logging.INFO, logger="plinth.startup"):
        assert choose_model_loader(reg, SOURCE, SelectionContext()).name == "one"
    assert "is claimed by" not in caplog.text


def test_a_model_name_resolves_to_the_path_its_plugin_gives() -> None:
    # tempfile.gettempdir: a real importable function returning a real path
    reg = registry_of(("dist-named", "1.0", model_plugin("named", 0, named_models=(("toy-1b", "tempfile:gettempdir"),))))
    assert named_model_path("toy-1b", reg) == tempfile.gettempdir()
    assert named_model_path("other", reg) is None
    with pytest.raises(ConfigError, match="no config.json"):  # the name became the folder, which holds no model
        locate_model("toy-1b", reg)
    with pytest.raises(ConfigError, match="a name a model plugin serves"):
        locate_model("no-such-model", reg)


def test_a_file_of_that_name_wins_over_a_plugin_name(tmp_path, monkeypatch) -> None:
    reg = registry_of(("dist-named", "1.0", model_plugin("named", 0, named_models=(("toy-1b", "tempfile:gettempdir"),))))
    (tmp_path / "toy-1b").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"{os.sep}?toy-1b: no config.json"):
        locate_model("toy-1b", reg)


def test_a_name_whose_function_cannot_import_fails_naming_it() -> None:
    reg = registry_of(("dist-bad", "1.0", model_plugin("bad", 0, named_models=(("toy-2b", "no_such_module:path"),))))
    with pytest.raises(ConfigError, match="model 'toy-2b' .*cannot import no_such_module:path"):
        locate_model("toy-2b", reg)
