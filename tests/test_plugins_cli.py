"""`platform plugins` in the project's environment (make setup installed every
plugin): what this machine shows, selection errors, allow and block lists.

Each test runs the real `platform` console script of this venv as a
subprocess; nothing is patched.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PLATFORM = str(Path(sys.executable).with_name("platform"))
ACCELERATORS = ("cpu", "cuda", "ascend", "tpu", "xpu")


def platform(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PLINTH_PLUGINS_")}
    return subprocess.run([PLATFORM, *args], capture_output=True, text=True, env={**base, **(env or {})}, timeout=120)


def plugins_json(*args: str, env: dict[str, str] | None = None) -> dict:
    proc = platform("plugins", "--json", *args, env=env)
    assert proc.stdout, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def listing() -> dict:
    """`platform plugins --json` with no options, run once for the module."""
    return plugins_json()


def accel_rows(doc: dict) -> dict[str, dict]:
    return {r["name"]: r for r in doc["plugins"] if r["category"] == "accelerator"}


def _torch_build() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


CPU_TORCH = "+cpu" in _torch_build()


def test_every_accelerator_plugin_is_installed(listing: dict) -> None:
    rows = accel_rows(listing)
    for name in ACCELERATORS:
        assert name in rows, f"plinth-plugin-{name} is not installed (make setup installs it)"
        assert rows[name]["distribution"] == f"plinth-plugin-{name}"
    assert [rows[n]["priority"] for n in ("cuda", "ascend", "tpu", "xpu", "cpu")] == [100, 90, 80, 70, 0]


def test_this_machine_shows_cpu_ok_and_the_others_unavailable_with_reasons(listing: dict) -> None:
    rows = accel_rows(listing)
    assert rows["cpu"]["status"] == "ok"
    assert rows["cpu"]["info"]["device_type"] == "cpu" and rows["cpu"]["info"]["dist_backend"] == "gloo"
    for name in ("cuda", "ascend", "tpu", "xpu"):
        row = rows[name]
        assert row["status"] in ("ok", "unavailable"), row
        if row["status"] == "unavailable":
            assert row["reasons"] and all(isinstance(r, str) and r for r in row["reasons"]), row
    # what this machine (CPU-only torch, no NPU/TPU stack) must say, exactly
    if CPU_TORCH:
        build = _torch_build()
        assert rows["cuda"]["reasons"] == [f"torch was built without CUDA (torch {build})"]
        assert rows["xpu"]["reasons"] == [f"torch was built without XPU support (torch {build})"]
    if importlib.util.find_spec("torch_npu") is None:
        assert rows["ascend"]["status"] == "unavailable"
        assert "torch_npu is not installed" in rows["ascend"]["reasons"]
        if importlib.util.find_spec("dlinfer") is None:
            assert "dlinfer is not installed (pip install dlinfer-ascend)" in rows["ascend"]["reasons"]
    if importlib.util.find_spec("torch_xla") is None:
        assert rows["tpu"]["status"] == "unavailable"
        assert "torch_xla is not installed (pip install 'torch_xla[tpu]')" in rows["tpu"]["reasons"]

    table = platform("plugins").stdout
    for name in ACCELERATORS:
        row = rows[name]
        detail = "; ".join(row["reasons"]) if row["reasons"] else ""
        pattern = rf"accelerator\s+{name}\s+plinth-plugin-{name}\s+\S+\s+{row['status']}\s+{re.escape(detail)}"
        assert re.search(pattern, table), f"{name} row missing or wrong:\n{table}"


def test_listing_imports_no_vendor_library_and_stays_fast() -> None:
    """`platform plugins` asks every plugin whether it can run: that must not
    import a vendor SDK (and, on a CPU torch build, not even torch)."""
    code = (
        "import sys, json; from plinth.cli import main; rc = main(['plugins', '--json']);"
        "print('MODULES', json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("MODULES "))
    loaded = set(json.loads(line.split(" ", 1)[1]))
    assert not loaded & {"torch_npu", "torch_xla", "dlinfer", "deep_ep", "mooncake"}


def test_device_nosuch_fails_listing_the_names_and_why_others_are_unavailable(listing: dict) -> None:
    proc = platform("plugins", "--device", "nosuch")
    assert proc.returncode == 2
    err = proc.stderr
    assert "no accelerator named 'nosuch' (usable here: cpu" in err
    rows = accel_rows(listing)
    for name in ACCELERATORS:
        row = rows[name]
        line = next((ln for ln in err.splitlines() if ln.strip().startswith(f"{name} (plinth-plugin-{name} ")), None)
        assert line is not None, f"{name} missing from:\n{err}"
        assert row["status"] in line
        for reason in row["reasons"]:
            assert reason in line


def test_named_unavailable_accelerator_fails_loudly_with_every_reason(listing: dict) -> None:
    rows = accel_rows(listing)
    unavailable = [n for n in ("cuda", "ascend", "tpu", "xpu") if rows[n]["status"] == "unavailable"]
    if not unavailable:
        pytest.skip("every accelerator is available here")
    name = unavailable[0]
    proc = platform("plugins", "--device", name)
    assert proc.returncode == 2
    assert f"accelerator {name} (plinth-plugin-{name} " in proc.stderr and "cannot be used: " in proc.stderr
    assert "; ".join(rows[name]["reasons"]) in proc.stderr
    assert "cpu (plinth-plugin-cpu " in proc.stderr  # every candidate is listed


def test_auto_takes_the_highest_priority_usable_accelerator() -> None:
    doc = plugins_json("--check")
    rows = accel_rows(doc)
    usable = sorted((r for r in rows.values() if r["status"] == "ok"), key=lambda r: (-r["priority"], r["name"]))
    assert doc["selected"]["accelerator"]["name"] == usable[0]["name"] == doc["auto"]["accelerator"]
    proc = platform("plugins", "--check")
    assert proc.returncode == 0
    assert re.search(rf"accelerator\s+{usable[0]['name']} \(plinth-plugin-{usable[0]['name']} ", proc.stdout)
    assert f"auto chose {usable[0]['name']}" in proc.stderr  # the choice is logged


def test_serve_choices_come_from_the_registrations(listing: dict) -> None:
    rows = accel_rows(listing)
    help_text = platform("serve", "--help").stdout
    assert "--device {auto," + ",".join(sorted(rows)) + "}" in help_text
    assert "--cpu-threads" in help_text  # a plugin's own CLI option
    blocked = platform("serve", "--help", "--plugins-block", "cuda").stdout
    assert "--device {auto," + ",".join(sorted(set(rows) - {"cuda"})) + "}" in blocked


# ---- allow and block lists ----------------------------------------------------


@pytest.mark.parametrize(
    "args, env",
    [
        (["--plugins-block", "cuda,tpu"], None),
        (["--plugins-block", "plinth-plugin-cuda", "--plugins-block", "tp*"], None),
        ([], {"PLINTH_PLUGINS_BLOCK": "cuda, tpu"}),
    ],
    ids=["flag", "flag-repeat-and-glob", "env"],
)
def test_block_list(args: list[str], env: dict[str, str] | None) -> None:
    # a repeated flag: the last one wins (argparse); the env var is a comma list
    doc = plugins_json(*args, env=env)
    status = {r["name"]: r["status"] for r in doc["plugins"]}
    expected_blocked = {"tpu"} if args[:2] == ["--plugins-block", "plinth-plugin-cuda"] else {"cuda", "tpu"}
    for name in expected_blocked:
        assert status[name] == "blocked"
    assert status["cpu"] == "ok"
    blocked_row = next(r for r in doc["plugins"] if r["name"] == "tpu")
    assert blocked_row["reasons"] == ["blocked by the plugin block list"]


def test_allow_list_by_name_distribution_and_category() -> None:
    for allow in ("cpu", "plinth-plugin-cpu", "accelerator:cpu"):
        doc = plugins_json("--plugins-allow", allow)
        status = {r["name"]: r["status"] for r in doc["plugins"]}
        assert status["cpu"] == "ok", allow
        assert all(s == "blocked" for n, s in status.items() if n != "cpu"), (allow, status)
    doc = plugins_json(env={"PLINTH_PLUGINS_ALLOW": "cpu,cuda"})
    status = {r["name"]: r["status"] for r in doc["plugins"]}
    assert status["cpu"] == "ok" and status["cuda"] != "blocked" and status["xpu"] == "blocked"


def test_flag_overrides_environment_and_block_beats_allow() -> None:
    doc = plugins_json("--plugins-allow", "xpu", env={"PLINTH_PLUGINS_ALLOW": "cpu"})
    status = {r["name"]: r["status"] for r in doc["plugins"]}
    assert status["cpu"] == "blocked" and status["xpu"] != "blocked"
    doc = plugins_json("--plugins-allow", "cpu,xpu", "--plugins-block", "xpu")
    status = {r["name"]: r["status"] for r in doc["plugins"]}
    assert status["cpu"] == "ok" and status["xpu"] == "blocked"


def test_choosing_a_blocked_plugin_fails_with_why() -> None:
    proc = platform("plugins", "--plugins-block", "cpu", "--device", "cpu")
    assert proc.returncode == 2
    assert "plugin cpu (plinth-plugin-cpu " in proc.stderr and "is blocked: blocked by the plugin block list" in proc.stderr


def test_blocked_plugins_are_never_imported() -> None:
    code = (
        "import sys; from plinth.plugins import PluginRegistry;"
        "PluginRegistry.discover(block=sys.argv[1], allow='');"
        "print(sorted(m for m in sys.modules if m.startswith('plinth_plugin_')))"
    )
    run = lambda block: subprocess.run([sys.executable, "-c", code, block], capture_output=True, text=True).stdout  # noqa: E731
    assert "plinth_plugin_ascend" in run("")
    loaded = run("ascend,plinth-plugin-xpu")
    assert "plinth_plugin_ascend" not in loaded and "plinth_plugin_xpu" not in loaded and "plinth_plugin_cpu" in loaded


def test_serve_and_generate_fail_the_same_way_before_loading_anything(listing: dict) -> None:
    """The engine's start-up uses the same selection: a bad --device stops
    `platform generate` / `platform serve` at once, with the same message."""
    proc = platform("generate", "--prompt", "hi", "--device", "nosuch")
    assert proc.returncode == 2
    assert "no accelerator named 'nosuch' (usable here: cpu" in proc.stderr
    assert "cuda (plinth-plugin-cuda " in proc.stderr
    rows = accel_rows(listing)
    if rows["cuda"]["status"] == "unavailable":
        proc = platform("serve", "--device", "cuda", "--port", "1")
        assert proc.returncode == 2
        assert "accelerator cuda (plinth-plugin-cuda 0.1.0) cannot be used: " + "; ".join(rows["cuda"]["reasons"]) in proc.stderr


# Runs the CLI with build_parser spied on: what the environment holds, and
# whether torch is loaded, once discovery is done and before any command runs.
SPY_ENV = """
import json, os, sys
from plinth import cli
seen = {}
build = cli.build_parser
def spy(registry):
    seen.update(env=os.environ.get("GOMP_SPINCOUNT"), torch="torch" in sys.modules)
    return build(registry)
cli.build_parser = spy
cli.main(sys.argv[1:])
print(json.dumps(seen))
"""


@pytest.mark.parametrize("user_value", [None, "7"], ids=["unset", "set-by-the-user"])
def test_accelerators_set_their_runtime_env_before_torch_loads(user_value: str | None) -> None:
    """AcceleratorDescriptor.process_env: the cpu plugin's OpenMP spin-wait
    (libgomp reads it once, when torch loads it) is set by the CLI before
    anything imports torch, unless the user set it."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT" and not k.startswith("PLINTH_PLUGINS_")}
    if user_value is not None:
        env["GOMP_SPINCOUNT"] = user_value
    proc = subprocess.run([sys.executable, "-c", SPY_ENV, "plugins"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"env": user_value or "2000", "torch": False}


def test_process_env_follows_the_named_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from plinth.cli import set_process_env
    from plinth.plugins import PluginRegistry

    registry = PluginRegistry.discover()
    monkeypatch.setenv("GOMP_SPINCOUNT", "")  # so the test's own setting is undone afterwards
    monkeypatch.delenv("GOMP_SPINCOUNT")
    assert set_process_env(registry, "cuda") == {}  # another accelerator: not the cpu's defaults
    assert "GOMP_SPINCOUNT" not in os.environ
    assert set_process_env(registry, "cpu") == {"GOMP_SPINCOUNT": "2000"}
    assert os.environ["GOMP_SPINCOUNT"] == "2000"
    assert set_process_env(registry, "cpu") == {}  # set once: a value already there is kept
