"""A contract change tells vendors: a public name of ``plinth.api`` (or a
member of one of its classes) or a hook's arguments changing fails here
unless ``PLUGIN_API_VERSION`` and docs/plugins.md's changelog change with
it, and the new surface is recorded (``plugin_api_surface.py record``)."""

from __future__ import annotations

import plugin_api_surface as pas
from plinth.api import PLUGIN_API_VERSION


def test_the_contract_matches_its_version_and_changelog() -> None:
    found = pas.problems(pas.surface(), PLUGIN_API_VERSION, pas.recorded(), pas.changelog())
    assert not found, "\n".join(found)


def test_the_surface_sees_names_members_and_hook_arguments() -> None:
    s = pas.surface()
    assert s["plinth.api.Accelerator.memory"].startswith("abstract method(self, index: int = 0)")
    assert s["plinth.api.SelectionContext.tp"] == "field: int = 1"
    assert s["hook plinth_add_cli_arguments(parser)"] == "argument Any"
    assert s["plinth.api.load_accelerator"].startswith("function(name: str = 'auto'")
    assert "plinth.api.PLUGIN_API_VERSION" not in s


# the guard on made-up surfaces: each way of changing the contract silently is caught

V1 = {"plinth.api.Foo": "class()", "plinth.api.Foo.run": "abstract method(self)", "hook plinth_x": "returns list"}
LOG = {"1.0": "the first stable contract."}


def test_an_unchanged_contract_passes() -> None:
    assert pas.problems(V1, "1.0", {"1.0": V1}, LOG) == []


def test_a_new_name_without_a_new_version_fails() -> None:
    now = {**V1, "plinth.api.bar": "function()"}
    found = pas.problems(now, "1.0", {"1.0": V1}, LOG)
    assert len(found) == 1 and "changed without a new version" in found[0] and "added    plinth.api.bar" in found[0]


def test_a_changed_signature_without_a_new_version_fails() -> None:
    now = {**V1, "plinth.api.Foo.run": "abstract method(self, x)"}
    assert any("plinth.api.Foo.run" in p for p in pas.problems(now, "1.0", {"1.0": V1}, LOG))


def test_a_bump_needs_the_record_and_a_changelog_entry_naming_the_change() -> None:
    now = {**V1, "plinth.api.bar": "function()"}
    found = pas.problems(now, "1.1", {"1.0": V1}, LOG)
    assert any("1.1 is not recorded" in p for p in found)
    assert any("must open with an entry for 1.1" in p for p in found)
    recorded = {"1.0": V1, "1.1": now}
    found = pas.problems(now, "1.1", recorded, {"1.1": "Foo got a friend.", **LOG})
    assert found == ["the changelog entry for 1.1 does not name what changed since 1.0: bar"]
    assert pas.problems(now, "1.1", recorded, {"1.1": "`bar`, a helper.", **LOG}) == []
    # a member changed: the entry names the class, or the member in backticks (all classes that inherit it)
    member = {**V1, "plinth.api.Foo.run": "abstract method(self, x=None)"}
    recorded = {"1.0": V1, "1.1": member}
    assert pas.problems(member, "1.1", recorded, {"1.1": "`run` takes x.", **LOG}) == []
    assert pas.problems(member, "1.1", recorded, {"1.1": "Foo.run takes x.", **LOG}) == []
    assert pas.problems(member, "1.1", recorded, {"1.1": "`Base.run()` takes x.", **LOG}) == []
    assert pas.problems(member, "1.1", recorded, {"1.1": "run takes x.", **LOG}) != []


def test_what_breaks_plugins_needs_a_major_version() -> None:
    removed = {k: v for k, v in V1.items() if k != "plinth.api.Foo.run"}
    log = {"1.1": "Foo lost run.", **LOG}
    found = pas.problems(removed, "1.1", {"1.0": V1, "1.1": removed}, log)
    assert found == ["1.0 -> 1.1 breaks plugins, which needs a new major version: removed plinth.api.Foo.run"]
    assert pas.problems(removed, "2.0", {"1.0": V1, "2.0": removed}, {"2.0": "Foo lost run.", **LOG}) == []
    more = {**V1, "plinth.api.Foo.stop": "abstract method(self)"}
    found = pas.problems(more, "1.1", {"1.0": V1, "1.1": more}, {"1.1": "Foo must stop.", **LOG})
    assert found == ["1.0 -> 1.1 breaks plugins, which needs a new major version: new abstract method plinth.api.Foo.stop"]
    hook_arg = {**V1, "hook plinth_x(parser)": "argument Any"}  # a new hook argument: opt-in, a minor version
    assert pas.problems(hook_arg, "1.1", {"1.0": V1, "1.1": hook_arg}, {"1.1": "plinth_x takes parser.", **LOG}) == []


def test_the_changelog_is_read_from_the_page_newest_first() -> None:
    entries = pas.changelog()
    assert PLUGIN_API_VERSION in entries and list(entries)[0] == PLUGIN_API_VERSION
