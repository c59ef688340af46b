"""Mooncake's transfer engine comes as two distributions of one `mooncake`
package (mooncake-transfer-engine and -non-cuda): no install of the plugin
may bring both, and check() refuses a package that two provide."""

from __future__ import annotations

import pathlib
import re

import tomllib
from plinth.api import SelectionContext
from plinth_plugin_mooncake import connector
from plinth_plugin_mooncake.connector import MooncakeConnector

MOONCAKE_DISTRIBUTIONS = {"mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_no_extra_installs_a_second_mooncake():
    project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    base = {_name(r) for r in project["dependencies"]} & MOONCAKE_DISTRIBUTIONS
    extras = project.get("optional-dependencies", {})
    for extra, requirements in extras.items():
        brought = base | ({_name(r) for r in requirements} & MOONCAKE_DISTRIBUTIONS)
        assert len(brought) <= 1, f"pip install plinth-plugin-mooncake[{extra}] installs {sorted(brought)}: one package twice"
    # and each distribution is reachable through one extra (the hint names them)
    assert {d for reqs in extras.values() for d in map(_name, reqs)} & MOONCAKE_DISTRIBUTIONS == MOONCAKE_DISTRIBUTIONS
    assert "[tcp]" in connector.INSTALL_HINT and "[cuda]" in connector.INSTALL_HINT


def test_check_refuses_a_package_two_distributions_provide(monkeypatch):
    real = connector.importlib.util.find_spec
    monkeypatch.setattr(connector.importlib.util, "find_spec", lambda name, *a: object() if name == "mooncake" else real(name, *a))
    monkeypatch.setattr(connector, "mooncake_distributions", lambda: sorted(MOONCAKE_DISTRIBUTIONS))
    reasons = MooncakeConnector.check(SelectionContext())
    assert len(reasons) == 1 and "two distributions provide the mooncake package" in reasons[0]
    monkeypatch.setattr(connector, "mooncake_distributions", lambda: ["mooncake-transfer-engine-non-cuda"])
    assert MooncakeConnector.check(SelectionContext()) == []
