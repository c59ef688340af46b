"""Reuse across instances: two engine processes on one store (the local
connector's shared disk tier). B loads the pages A computed instead of
computing them: identical output, fewer prefill tokens, counted apart."""

import json
import os
import subprocess
import sys

import pytest
from tiny_models import tiny_model_dir

pytest.importorskip("plinth_plugin_kv_local")

HERE = os.path.dirname(__file__)
SHARED = [(i * 37) % 250 + 1 for i in range(160)]  # 10 pages of 16


def run_worker(model, connector, config, prompts, timeout=300):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "kv_worker.py"), model, connector, json.dumps(config), json.dumps(prompts)],
        capture_output=True, text=True, timeout=timeout,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, f"worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(line[len("RESULT "):])


def test_second_process_loads_the_shared_prefix(tiny_root, tmp_path):
    model = tiny_model_dir("llama", tiny_root)
    cfg = {"cpu_bytes": 0, "disk_dir": str(tmp_path / "kv")}
    a = run_worker(model, "local", cfg, [SHARED + [7, 8, 9]])
    assert a["cached"] == [0] and a["flushed"]
    assert a["stats"]["kv_connector_saved_pages"] >= 10
    b_prompt = SHARED + [20, 21]
    b = run_worker(model, "local", cfg, [b_prompt])
    ref = run_worker(model, "", None, [b_prompt])
    assert b["outputs"] == ref["outputs"]
    assert b["external"] == [160] and b["cached"] == [160]
    assert ref["cached"] == [0]
    assert b["stats"]["prefix_cache_external_hit_tokens"] == 160
    assert b["stats"]["prefix_cache_local_hit_tokens"] == 0
    assert b["stats"]["kv_connector_loaded_pages"] == 10


def test_foreign_model_values_are_misses(tiny_root, tmp_path):
    cfg = {"cpu_bytes": 0, "disk_dir": str(tmp_path / "kv")}
    run_worker(tiny_model_dir("llama", tiny_root), "local", cfg, [SHARED + [1]])
    other = run_worker(tiny_model_dir("qwen2", tiny_root), "local", cfg, [SHARED + [1]])
    assert other["external"] == [0]  # another model's keys never match
