"""The instruction sets decide: `auto` never picks a backend (or an op of one)
that the reported set cannot run, under every narrowing of this machine's set;
`platform plugins` shows the set, and exits quietly on a closed pipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from plinth.api import SelectionContext, load_accelerator
from plinth.engine.startup import resolve_ops
from plinth.plugins import PluginRegistry

PLATFORM = str(Path(sys.executable).with_name("platform"))

# what a Zen 3 (AVX2 only), a bare x86-64 and this machine as it is report
NARROWINGS = ["avx2,fma", "sse4_2", None]


@pytest.fixture(scope="module")
def registry():
    return PluginRegistry.discover()


@pytest.mark.parametrize("narrowed", NARROWINGS)
@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float32"])
def test_auto_never_picks_what_the_set_cannot_run(registry, monkeypatch, narrowed, dtype):
    if narrowed is None:
        monkeypatch.delenv("PLINTH_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("PLINTH_CPU_ISA", narrowed)
    accelerator = load_accelerator("cpu")
    info = accelerator.info()
    chosen_dtype = accelerator.default_dtype() if dtype == "auto" else getattr(torch, dtype)
    ctx = SelectionContext(accelerator=accelerator, dtype=chosen_dtype)
    entry = registry.select("backend", "auto", ctx, prefer=info.preferred_backends)
    impl = entry.load()
    assert impl.check(ctx) == [], f"auto picked {entry.name}, whose check() fails on {info.isa}"
    limits = impl.unsupported_ops(ctx)
    _, sources = resolve_ops(registry, entry, ctx)
    for op in limits:  # an op the set cannot run is served by the reference, never by the backend
        assert sources[op] != entry.name, (op, limits[op])
    if narrowed == "avx2,fma" and entry.name == "cpukernels":
        assert info.default_dtype == "float32"
        if chosen_dtype == torch.bfloat16:  # the Zen 3 crash: oneDNN's bf16 GEMM must not be chosen
            assert {"linear", "pack_linear"} <= set(limits) and sources["linear"] != "cpukernels"


def _run(*args, env=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("PLINTH_")}
    return subprocess.run(args, capture_output=True, text=True, env={**base, **(env or {})}, timeout=120)


def test_plugins_shows_the_sets_and_why():
    proc = _run(PLATFORM, "plugins", "--json", env={"PLINTH_CPU_ISA": "avx2,fma"})
    doc = json.loads(proc.stdout)
    rows = {(r["category"], r["name"]): r for r in doc["plugins"]}
    cpu = rows[("accelerator", "cpu")]
    assert cpu["info"]["isa"] == ["sse4_2", "avx", "avx2", "fma"]
    assert "narrowed" in cpu["info"]["capability"] and cpu["info"]["default_dtype"] == "float32"
    kernels = rows.get(("backend", "cpukernels"))
    if kernels and kernels["status"] == "ok":
        assert "avx512bw" in kernels["unsupported_ops"]["bfloat16"]["linear"]
    text = _run(PLATFORM, "plugins", env={"PLINTH_CPU_ISA": "avx2,fma"}).stdout
    assert "instruction sets: sse4_2,avx,avx2,fma" in text


def test_closed_pipe_is_quiet():
    proc = subprocess.run(
        f"'{PLATFORM}' plugins --json | head -1", shell=True, capture_output=True, text=True, timeout=120,
    )
    assert proc.stdout.strip() == "{"
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_seed_is_an_engine_option():
    from plinth.cli import PluginRegistry as Registry
    from plinth.cli import build_parser, engine_kwargs

    args = build_parser(Registry.discover()).parse_args(["serve", "--seed", "7"])
    kwargs = engine_kwargs(args)
    assert kwargs["seed"] == 7 and "seed" not in kwargs["plugin_options"]


def test_seed_makes_unseeded_sampling_reproducible(tiny_root):
    from plinth import LLM, SamplingParams
    from tiny_models import tiny_model_dir

    path = tiny_model_dir("llama", tiny_root)
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)  # no per-request seed

    def run(seed):
        llm = LLM(path, dtype="float32", backend="torch", load_progress=False, num_pages=64, seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5]], params)]

    first = run(7)
    assert run(7) == first
    assert run(8) != first
