"""Real installs: fresh virtual environments, pip, and the venv's own `platform`.

One venv for the whole module (plinth-core installed once, about 20 s); each
test first makes the venv hold exactly the plugin distributions it needs
(pip install / uninstall), so the tests are independent of their order.
The fixture distributions are in tests/fixtures/ (see its README); nothing in
the discovery is patched.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from plinth.api import PLUGIN_API_VERSION
from plinth.testing import IsolatedEnv

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
#: distribution -> (source folder, install its dependencies?)
SOURCES: dict[str, tuple[Path, bool]] = {
    "plinth-plugin-cpu": (ROOT / "plugins" / "accelerators" / "cpu", False),  # its torch is not wanted here
    "plinth-plugin-npu": (FIXTURES / "npu", True),
    "plinth-plugin-broken": (FIXTURES / "broken", True),
    "plinth-plugin-npu-fork": (FIXTURES / "npu-fork", True),
    "plinth-plugin-future": (FIXTURES / "future", True),
}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> IsolatedEnv:
    env = IsolatedEnv.create(tmp_path_factory.mktemp("fresh") / "venv")
    yield env
    env.cleanup()


def only(venv: IsolatedEnv, *dists: str) -> IsolatedEnv:
    """Make the venv hold exactly these plugin distributions (of SOURCES)."""
    absent = [d for d in SOURCES if d not in dists]
    for deps in (True, False):
        venv.ensure({d: SOURCES[d][0] for d in dists if SOURCES[d][1] == deps}, absent=absent, deps=deps)
        absent = []
    return venv


def plugins_json(venv: IsolatedEnv, *args: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    proc = venv.platform("plugins", "--json", *args, env=env)
    assert proc.stdout, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def rows_by_name(doc: dict) -> dict[str, dict]:
    return {r["name"]: r for r in doc["plugins"]}


def test_core_alone_lists_no_plugins_and_says_how_to_install(venv: IsolatedEnv) -> None:
    only(venv)
    installed = {k.lower() for k in venv.distributions()}
    assert "plinth-core" in installed
    assert "torch" not in installed, "plinth-core must not depend on torch"

    proc = venv.platform("plugins")
    assert proc.returncode == 0, proc.stderr
    assert "No plinth plugins are installed." in proc.stdout
    assert "pip install plinth-plugin-<name>" in proc.stdout
    assert "make setup" in proc.stdout

    doc, _ = plugins_json(venv)
    assert doc["plugins"] == [] and doc["plugin_api"] == PLUGIN_API_VERSION

    # choosing needs a plugin: the error says none is installed and how to get one
    proc = venv.platform("plugins", "--check")
    assert proc.returncode == 2
    assert "No accelerator plugins are installed" in proc.stderr and "pip install" in proc.stderr

    help_text = venv.platform("serve", "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert "--device {auto}" in help_text.stdout


def _tree_state(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*.py"))}


def test_installing_one_plugin_makes_it_appear_with_core_untouched(venv: IsolatedEnv) -> None:
    only(venv)
    core_dir = Path(venv.run_python("import plinth, os; print(os.path.dirname(plinth.__file__))").stdout.strip())
    before = _tree_state(core_dir)

    only(venv, "plinth-plugin-cpu")
    assert _tree_state(core_dir) == before, "installing a plugin changed files of plinth-core"

    rows = rows_by_name(plugins_json(venv)[0])
    assert set(rows) == {"cpu"}
    cpu = rows["cpu"]
    assert (cpu["category"], cpu["distribution"], cpu["version"]) == ("accelerator", "plinth-plugin-cpu", "0.1.0")
    # installed without its torch dependency: listed, with the reason it cannot run
    assert cpu["status"] == "unavailable"
    assert cpu["reasons"] == ["torch is not installed (pip install torch)"]

    table = venv.platform("plugins").stdout
    assert re.search(r"accelerator\s+cpu\s+plinth-plugin-cpu\s+0\.1\.0\s+unavailable\s+torch is not installed", table), table


def test_vendor_npu_plugin_is_discovered_listed_and_selectable(venv: IsolatedEnv) -> None:
    only(venv, "plinth-plugin-npu", "plinth-plugin-cpu")

    doc, _ = plugins_json(venv)
    npu = rows_by_name(doc)["npu"]
    assert (npu["category"], npu["distribution"], npu["version"], npu["status"]) == (
        "accelerator",
        "plinth-plugin-npu",
        "1.2.0",
        "ok",
    )
    assert npu["info"]["device_name"] == "Acme NPU simulator" and npu["info"]["device_count"] == 2
    assert doc["auto"] == {"accelerator": "npu"}
    table = venv.platform("plugins").stdout
    assert re.search(r"accelerator\s+npu\s+plinth-plugin-npu\s+1\.2\.0\s+ok\s+2 x Acme NPU simulator", table), table

    # --device npu: selected the way `platform serve` selects
    proc = venv.platform("plugins", "--device", "npu")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"accelerator\s+npu \(plinth-plugin-npu 1\.2\.0\)", proc.stdout), proc.stdout
    doc, _ = plugins_json(venv, "--device", "npu")
    assert doc["selected"]["accelerator"] == {"name": "npu", "distribution": "plinth-plugin-npu", "version": "1.2.0"}
    assert doc["error"] is None

    # the same through the Python API, in that environment
    code = (
        "from plinth.plugins import PluginRegistry; from plinth.api import SelectionContext;"
        "e = PluginRegistry.discover().select('accelerator', 'npu', SelectionContext());"
        "acc = e.load()(); print(e.distribution, e.version, type(acc).__name__, acc.info().device_count)"
    )
    proc = venv.run_python(code)
    assert proc.stdout.split() == ["plinth-plugin-npu", "1.2.0", "NPUAccelerator", "2"], proc.stderr

    # serve's choices and plugin options come from what is installed
    help_text = venv.platform("serve", "--help").stdout
    assert "--device {auto,cpu,npu}" in help_text
    assert "--npu-cores" in help_text

    # unavailable: choosing it fails loudly with its reason (and everyone's)
    proc = venv.platform("plugins", "--device", "npu", env={"NPU_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2
    assert "npu (plinth-plugin-npu 1.2.0) cannot be used: no NPU is visible (NPU_VISIBLE_DEVICES is empty)" in proc.stderr
    assert "cpu (plinth-plugin-cpu 0.1.0): unavailable: torch is not installed" in proc.stderr

    # the conformance kit runs in that environment too (registration checks need no torch)
    code = (
        "from plinth.testing import check_registration, check_accelerator;"
        "print(check_registration('plinth-plugin-npu'));"
        "print(check_accelerator('npu', device=False))"
    )
    proc = venv.run_python(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 problems" in proc.stdout and "cheap" not in proc.stderr


def test_plugin_that_fails_to_import_is_listed_failed_and_never_replaced(venv: IsolatedEnv) -> None:
    only(venv, "plinth-plugin-npu", "plinth-plugin-broken")
    error = "ImportError: libbroken_vendor.so.3: cannot open shared object file (test fixture)"

    doc, _ = plugins_json(venv)
    rows = rows_by_name(doc)
    broken = rows["broken"]
    assert (broken["status"], broken["distribution"], broken["version"]) == ("failed", "plinth-plugin-broken", "0.1.0")
    assert broken["reasons"] == [error]
    assert rows["npu"]["status"] == "ok"  # the others still work
    table = venv.platform("plugins").stdout
    assert re.search(r"broken\s+plinth-plugin-broken\s+0\.1\.0\s+failed\s+ImportError: libbroken_vendor", table), table

    # choosing it fails with that error; it is not replaced by another plugin
    proc = venv.platform("plugins", "--device", "broken")
    assert proc.returncode == 2
    assert "plugin broken (plinth-plugin-broken 0.1.0) failed to load: " + error in proc.stderr
    assert "selected" not in proc.stdout

    # the other plugins are still selectable
    proc = venv.platform("plugins", "--device", "npu")
    assert proc.returncode == 0 and "npu (plinth-plugin-npu 1.2.0)" in proc.stdout

    # a blocked plugin is never imported: blocked, not failed
    doc, _ = plugins_json(venv, "--plugins-block", "broken")
    assert rows_by_name(doc)["broken"]["status"] == "blocked"
    assert rows_by_name(doc)["broken"]["reasons"] == ["blocked by the plugin block list"]
    doc, _ = plugins_json(venv, env={"PLINTH_PLUGINS_BLOCK": "plinth-plugin-broken"})
    assert rows_by_name(doc)["broken"]["status"] == "blocked"


def test_two_distributions_registering_one_name_is_an_error_naming_both(venv: IsolatedEnv) -> None:
    only(venv, "plinth-plugin-npu", "plinth-plugin-npu-fork")

    proc = venv.platform("plugins")
    assert proc.returncode == 1
    line = next(ln for ln in proc.stderr.splitlines() if "duplicate accelerator name 'npu'" in ln)
    assert "plinth-plugin-npu 1.2.0" in line and "plinth-plugin-npu-fork 0.3.0" in line

    doc, _ = plugins_json(venv)
    dup_rows = [r for r in doc["plugins"] if r["name"] == "npu"]
    assert {r["distribution"] for r in dup_rows} == {"plinth-plugin-npu", "plinth-plugin-npu-fork"}
    assert all(r["status"] == "failed" and "duplicate name" in r["reasons"][0] for r in dup_rows)

    for args in (["--device", "npu"], ["--check"]):
        proc = venv.platform("plugins", *args)
        assert proc.returncode == 2, args
        assert "plinth-plugin-npu 1.2.0" in proc.stderr and "plinth-plugin-npu-fork 0.3.0" in proc.stderr, proc.stderr

    # blocking one resolves it, and the blocked fork is never imported (it shares
    # the entry-point name `npu` with the original)
    proc = venv.platform("plugins", "--plugins-block", "plinth-plugin-npu-fork", "--device", "npu")
    assert proc.returncode == 0 and "npu (plinth-plugin-npu 1.2.0)" in proc.stdout, proc.stderr
    code = (
        "import sys; from plinth.plugins import PluginRegistry;"
        "r = PluginRegistry.discover(block='plinth-plugin-npu-fork');"
        "print(r.get('accelerator', 'npu').distribution, 'plinth_plugin_npu_fork' in sys.modules)"
    )
    assert venv.run_python(code).stdout.split() == ["plinth-plugin-npu", "False"]


def test_plugin_for_another_api_version_is_incompatible(venv: IsolatedEnv) -> None:
    only(venv, "plinth-plugin-npu", "plinth-plugin-future")
    why = f"supports plugin API >=3,<4, core provides {PLUGIN_API_VERSION}"

    future = rows_by_name(plugins_json(venv)[0])["future"]
    assert (future["status"], future["reasons"], future["distribution"]) == ("incompatible", [why], "plinth-plugin-future")
    table = venv.platform("plugins").stdout
    assert re.search(r"future\s+plinth-plugin-future\s+0\.9\.0\s+incompatible\s+" + re.escape(why), table), table

    proc = venv.platform("plugins", "--device", "future")
    assert proc.returncode == 2 and why in proc.stderr
    # auto passes over it although its priority (60) is above npu's (50)
    doc, _ = plugins_json(venv, "--check")
    assert doc["selected"]["accelerator"]["name"] == "npu"


DOC_FILE = re.compile(r"```[a-z]*\n(?:# file: |<!-- file: )(?P<path>\S+?)(?: -->)?\n(?P<body>.*?)```", re.S)


def test_docs_walkthrough_plugin_installs_and_passes_the_kit(venv: IsolatedEnv, tmp_path: Path) -> None:
    """docs/plugins.md's vendor walk-through, copied out file by file, is a
    working distribution: it installs, is listed (unavailable here, with its
    reason) and passes the registration checks."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    files = {m["path"]: m["body"] for m in DOC_FILE.finditer(text)}
    assert "plinth-plugin-acme/pyproject.toml" in files, sorted(files)
    for rel, body in files.items():
        target = tmp_path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body)
    only(venv)
    try:
        venv.install(tmp_path / "plinth-plugin-acme", deps=False)
        acme = rows_by_name(plugins_json(venv)[0])["acme"]
        assert (acme["distribution"], acme["status"]) == ("plinth-plugin-acme", "unavailable")
        assert "torch_acme is not installed (pip install torch-acme)" in acme["reasons"]
        code = (
            "from plinth.testing import check_registration, check_accelerator;"
            "check_registration('plinth-plugin-acme'); r = check_accelerator('acme');"
            "print(r.available, r.skipped)"
        )
        proc = venv.run_python(code)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.startswith("False")
    finally:
        venv.uninstall("plinth-plugin-acme")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
