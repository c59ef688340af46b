"""`platform bench a2a` end to end, as a user runs it: 2 real ranks over gloo,
one tiny shape, both modes; the saved result has sane numbers. Also the
spec parser and a plugin that cannot run here (skipped with its reasons,
not a failure)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from plinth.bench.a2a import parse_spec, split_label


def test_parse_spec():
    assert parse_spec("nccl") == ("nccl", {})
    assert parse_spec("deepep@deepep_generation=legacy,deepep_max_tokens_per_rank=128,deepep_fp8=true,x=0.5") == (
        "deepep",
        {"deepep_generation": "legacy", "deepep_max_tokens_per_rank": 128, "deepep_fp8": True, "x": 0.5},
    )
    with pytest.raises(ValueError):
        parse_spec("nccl@novalue")
    assert split_label("ll:deepep@deepep_generation=legacy") == ("ll", "deepep@deepep_generation=legacy")
    assert split_label("nccl@x=a:b") == ("nccl@x=a:b", "nccl@x=a:b")


@pytest.mark.slow  # two spawns of 2 ranks: 16-24 s on 2 shared cores
def test_bench_a2a_two_ranks(tmp_path):
    pytest.importorskip("plinth_plugin_nccl")
    out = tmp_path / "a2a.json"
    cmd = [
        sys.executable, "-m", "plinth.cli", "bench", "a2a", "--a2a", "nccl", "--a2a", "nccl@nccl_decode_layout=flat",
        "--ranks", "2", "--tokens", "8", "--hidden", "64", "--topk", "2", "--experts", "4",
        "--warmup", "1", "--iters", "3", "--timeout", "120", "--save-result", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["ranks"] == 2 and result["machine"]["dist_backend"] == "gloo"
    rows = result["plugins"]["nccl"]["rows"]
    assert {(r["mode"], r["layout"]) for r in rows} == {("prefill", "flat"), ("decode", "padded")}
    for r in rows:
        assert r["ok"], r
        assert (r["tokens"], r["hidden"], r["topk"], r["experts"]) == (8, 64, 2, 4)
        assert r["bytes_per_rank"] > 0
        for key in ("dispatch_us", "combine_us", "dispatch_GBps", "combine_GBps"):
            assert 0 < r[key] < float("inf"), (key, r)
        assert r["dispatch_us"] < 5e6 and r["combine_us"] < 5e6  # a tiny case: well under seconds
    # plugin options reach the plugin: the flat layout forced for decode
    assert {r["layout"] for r in result["plugins"]["nccl@nccl_decode_layout=flat"]["rows"]} == {"flat"}
    assert "dispatch us" in proc.stdout and "nccl" in proc.stdout


def test_unavailable_plugin_is_skipped_with_reasons(tmp_path):
    """deepep cannot run here (no GPU): listed with its check() reasons, exit 0, no ranks spawned."""
    pytest.importorskip("plinth_plugin_deepep")
    from plinth.api import SelectionContext
    from plinth.plugins import PluginRegistry

    registry = PluginRegistry.discover(allow="", block="")
    if not registry.get("a2a", "deepep").evaluate(SelectionContext(ep=1)):
        pytest.skip("deepep validates here")
    out = tmp_path / "a2a.json"
    cmd = [sys.executable, "-m", "plinth.cli", "bench", "a2a", "--a2a", "deepep", "--save-result", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())["plugins"]["deepep"]
    assert res["skipped"] and res["rows"] == []
    assert "deepep" in proc.stdout and "skipped: " in proc.stdout
