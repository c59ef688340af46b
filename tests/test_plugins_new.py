"""`platform plugins new` and `platform plugins check`, as a vendor runs them:
the scaffold of every category passes the project's ruff and pyright
settings as written; installed, it is listed as unavailable naming the
methods left to write, its own tests run and fail naming them, and `check`
reports them. `check` on shipped plugins passes and says what it saw.

Each command is the real `platform` console script (or its main()); the
generated distributions are installed with pip into a folder of their own
on PYTHONPATH, so this venv is never changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plinth.cli import main
from plinth.scaffold import KINDS

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: one name per category, with the separators a name may have
NAMES = {
    "accelerator": "acme-npu", "backend": "acme-kernels", "model": "acme-lm", "a2a": "acme_a2a", "kv_connector": "acmekv",
    "proposer": "acme-spec", "parser": "acme-fmt",
}  # fmt: skip
#: per category of `new`: (the category its plugin registers in, the methods left to write, as reasons name them)
STUBS = {
    "accelerator": [("accelerator", "AcmeNpuAccelerator.info, AcmeNpuAccelerator.memory")],
    "backend": [("backend", ", ".join([
        *(f"AcmeKernelsBackend.{op}" for op in ("fused_moe", "linear", "pack_linear", "rms_norm", "rotary", "silu_and_mul")),
        "AcmeKernelsAttention.build_plan", "AcmeKernelsAttention.forward",
    ]))],  # fmt: skip
    "model": [("model", "AcmeLmLoader.load_config, AcmeLmLoader.load_model")],
    "a2a": [("a2a", "AcmeA2aAllToAll.combine, AcmeA2aAllToAll.dispatch")],
    "kv_connector": [("kv_connector", "AcmekvConnector.load, AcmekvConnector.lookup, AcmekvConnector.save")],
    "proposer": [("proposer", "AcmeSpecProposer.propose")],
    "parser": [("tool_parser", "AcmeFmtToolParser.parse"), ("reasoning_parser", "AcmeFmtReasoningParser.parse")],
}


def run(*cmd: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PLINTH_PLUGINS_")}
    return subprocess.run(list(cmd), capture_output=True, text=True, env={**base, **(env or {})}, cwd=cwd, timeout=timeout)


def generate_all(root: Path) -> dict[str, Path]:
    """Every category's scaffold under root, through `platform plugins new`."""
    out = {}
    for category in KINDS:
        folder = root / f"plinth-plugin-{NAMES[category]}"
        assert main(["plugins", "new", category, NAMES[category], "--dir", str(folder)]) == 0
        out[category] = folder
    return out


def pyright_config(folder: Path) -> Path:
    """pyrightconfig.json in ``folder``: the repository's [tool.pyright]
    settings (this venv, core/src), over the generated code and its tests."""
    import tomllib

    settings = dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pyright"])
    for key in ("include", "exclude", "strict", "executionEnvironments"):
        settings.pop(key, None)
    settings.update(venvPath=str(ROOT), extraPaths=[str(ROOT / "core" / "src")])
    path = folder / "pyrightconfig.json"
    path.write_text(json.dumps(settings))
    return path


def test_every_category_has_a_scaffold() -> None:
    assert set(KINDS) == set(NAMES), "a category without a test name here"


def test_new_writes_distributions_that_pass_ruff_and_pyright(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folders = generate_all(tmp_path)
    out = capsys.readouterr().out
    for category, folder in folders.items():
        name = NAMES[category]
        package = "plinth_plugin_" + name.replace("-", "_")
        pyproject = (folder / "pyproject.toml").read_text()
        assert f'name = "plinth-plugin-{name}"' in pyproject and f'{name} = "{package}.plugin"' in pyproject
        assert "runtime = []" in pyproject  # the vendor's libraries, as an extra
        assert (folder / "README.md").is_file() and (folder / "tests" / "test_conformance.py").is_file()
        assert (folder / "src" / package / "plugin.py").is_file() and (folder / "src" / package / f"{KINDS[category].module}.py").is_file()
        readme = (folder / "README.md").read_text()
        assert all(any(f"`{stub}()`" in readme for stub in stubs.split(", ")) for _, stubs in STUBS[category]), readme
        assert f"pip install -e {folder}" in out and f"platform plugins check {folder}" in out
    ruff = run(str(BIN / "ruff"), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(tmp_path))
    assert ruff.returncode == 0, ruff.stdout + ruff.stderr
    pyright_config(tmp_path)
    pyright = run(str(BIN / "pyright"), "--outputjson", cwd=tmp_path)
    summary = json.loads(pyright.stdout)["summary"]
    assert pyright.returncode == 0 and summary["errorCount"] == 0, pyright.stdout[-4000:]
    assert summary["filesAnalyzed"] >= 4 * len(KINDS)


def test_new_refuses_a_bad_name_an_unknown_category_and_a_folder_with_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "new", "accelerator", "My Chip", "--dir", str(tmp_path / "a")]) == 2
    assert "use lower-case letters and digits" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plugins", "new", "gpu", "x"])
    assert exc.value.code == 2 and "invalid choice: 'gpu'" in capsys.readouterr().err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "mine.py").write_text("")
    assert main(["plugins", "new", "accelerator", "x", "--dir", str(tmp_path / "b")]) == 2
    assert "already exists and is not an empty folder" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["mine.py"]


@pytest.mark.slow
def test_a_new_plugin_installs_is_unavailable_and_its_tests_and_check_name_what_to_write(tmp_path: Path) -> None:
    folders = generate_all(tmp_path / "src")
    site = tmp_path / "site"
    pip = run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site), *map(str, folders.values()))
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = {"PYTHONPATH": str(site)}

    listing = run(str(BIN / "platform"), "plugins", "--json", env=env)
    rows = {(r["category"], r["name"]): r for r in json.loads(listing.stdout)["plugins"]}
    for category, expected in STUBS.items():
        for registered, stubs in expected:
            row = rows[(registered, NAMES[category])]
            assert row["status"] == "unavailable", row
            assert row["reasons"][0] == f"not implemented yet: {stubs} (only raise NotImplementedError)"

    tests = run(
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib", "--rootdir", str(tmp_path),
        *(str(f / "tests") for f in folders.values()), env=env, cwd=tmp_path,
    )  # fmt: skip
    assert tests.returncode == 1, tests.stdout[-3000:]
    for category, expected in STUBS.items():
        for registered, stubs in expected:
            assert f"{registered} {NAMES[category]}: every method it defines is implemented: not implemented yet: {stubs}" in tests.stdout
    failed = [line for line in tests.stdout.splitlines() if line.startswith("FAILED ") and "::test_registration" in line]
    assert len(failed) == len(folders) + 1, tests.stdout[-3000:]  # the parser plugin's two test classes

    for category, folder in folders.items():
        check = run(str(BIN / "platform"), "--log-level", "WARNING", "plugins", "check", str(folder), "--json", env=env)
        assert check.returncode == 1, check.stdout[-2000:] + check.stderr[-2000:]
        doc = json.loads(check.stdout)
        assert doc["result"] == "fail" and doc["plugin"]["distribution"] == f"plinth-plugin-{NAMES[category]}"
        failed = [c["check"] for s in doc["sections"] for c in s["checks"] if c["status"] == "fail"]
        assert all(any(stubs in f for f in failed) for _, stubs in STUBS[category]), failed
        assert doc["counts"]["pass"] > 0  # the registration checks that hold are shown passing


def test_check_a_shipped_accelerator_reports_the_machine_memory_and_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "check", str(ROOT / "plugins" / "accelerators" / "cpu")]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# plinth conformance report: plinth-plugin-cpu ")
    for line in ("result      PASS", "plinth      plinth-core ", "accelerator cpu (plinth-plugin-cpu", "## registration: plinth-plugin-cpu",
                 "## accelerator cpu", "  distributed backend: gloo", "  memory: ", "  pass  torch.distributed knows the backend 'gloo'"):
        assert line in text, line
    assert main(["plugins", "check", "cpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["result"] == "pass" and doc["counts"]["fail"] == 0 and doc["plinth"]["plugin_api"]
    assert doc["plugin"]["plugins"] == [{"category": "accelerator", "name": "cpu", "api": doc["plugin"]["plugins"][0]["api"]}]
    assert {"host", "cpu", "python", "torch", "accelerator", "device"} <= set(doc["machine"])
    accelerator = next(s for s in doc["sections"] if s["title"] == "accelerator cpu")
    assert accelerator["facts"]["distributed backend"] == "gloo" and "free of" in accelerator["facts"]["memory"]


def test_check_a_proposer_by_its_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "check", "plinth-plugin-ngram"]) == 0
    doc_text = capsys.readouterr().out
    assert "## proposer ngram" in doc_text and "FAIL" not in doc_text


def test_check_installs_nothing_and_says_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "new", "proposer", "not-installed", "--dir", str(tmp_path / "p")]) == 0
    capsys.readouterr()
    assert main(["plugins", "check", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "plinth-plugin-not-installed" in err and f"pip install -e {tmp_path / 'p'}" in err and "installs nothing" in err
    assert main(["plugins", "check", "no-such-plugin"]) == 2
    assert "no installed plugin, plugin distribution or source folder is named 'no-such-plugin'" in capsys.readouterr().err
