"""bench/serve_compare.py's pieces that need no server: the vLLM and
transformers command lines, aggregation over repeats, the issue 12 verdicts,
the docs section and its markers. None of the comparison runs here."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sc():
    spec = importlib.util.spec_from_file_location("serve_compare", ROOT / "bench" / "serve_compare.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_compare"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_cpu_list(sc):
    assert sc.cpu_list({0, 1}) == "0-1"
    assert sc.cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert sc.cpu_list({3}) == "3"


def _args(sc, *argv):
    args = sc.parse_args(["--vllm-venv", "/opt/vv", *argv])
    args.dtype = args.dtype or "float32"
    return args


def test_servers_share_folder_dtype_and_name(sc):
    args = _args(sc, "--dtype", "bfloat16", "--vllm-enforce-eager")
    hf = Path("/tmp/hf")
    p = sc.make_server("plinth", args, hf, "/m.gguf", 1234, {})
    v = sc.make_server("vllm", args, hf, "/m.gguf", 1235, {"X": "1"})
    t = sc.make_server("transformers", args, hf, "/m.gguf", 1236, {})
    assert p.cmd[2] == str(hf) and "--dtype" in p.cmd and p.cmd[p.cmd.index("--dtype") + 1] == "bfloat16"
    assert v.cmd[:3] == ["/opt/vv/bin/vllm", "serve", str(hf)] and "--enforce-eager" in v.cmd
    assert v.cmd[v.cmd.index("--dtype") + 1] == "bfloat16" and v.cmd[v.cmd.index("--host") + 1] == "127.0.0.1"
    assert v.env["VLLM_CPU_OMP_THREADS_BIND"] == sc.cpu_list(os.sched_getaffinity(0))
    assert v.env["VLLM_CPU_KVCACHE_SPACE"] == "2" and v.env["X"] == "1"
    assert p.model == v.model == sc.SERVED_NAME and set(p.judges) == set(v.judges) == {"platform", "vllm"}
    assert t.judges == ("platform",) and t.cmd[t.cmd.index("--dtype") + 1] == "bfloat16"
    gguf = sc.make_server("plinth", _args(sc, "--plinth-gguf", "--plinth-args", "--cpu-bind auto"), hf, "/m.gguf", 1, {})
    assert gguf.cmd[2] == "/m.gguf" and gguf.cmd[-2:] == ["--cpu-bind", "auto"]


def test_vllm_judge_command(sc):
    args = _args(sc, "--num-prompts", "3")
    server = sc.make_server("plinth", args, Path("/tmp/hf"), "/m.gguf", 1, {})
    cmd, result = sc.judge_cmd("vllm", args, server, "http://127.0.0.1:1", Path("/tmp/hf"), 16, Path("/o/p-c16"))
    assert cmd[:3] == ["/opt/vv/bin/vllm", "bench", "serve"] and result == Path("/o/p-c16.json")
    for flag, value in (("--backend", "openai"), ("--num-prompts", "3"), ("--max-concurrency", "16"),
                        ("--tokenizer", "/tmp/hf"), ("--temperature", "0"), ("--model", "smollm2"),
                        ("--random-input-len", "128"), ("--result-filename", "p-c16.json")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--ignore-eos" in cmd and "--save-result" in cmd


def _run(tput, ttft, tpot=50.0):
    return {"output_throughput": tput, "median_ttft_ms": ttft, "median_tpot_ms": tpot, "completed": 8, "failed": 0,
            "p99_ttft_ms": ttft, "median_itl_ms": tpot, "median_e2el_ms": 1000.0, "cores_server": 1.9,
            "cores_client": 0.05, "cores_other": 0.0, "backend": "x"}


def test_aggregate_targets_and_section(sc, tmp_path, monkeypatch):
    runs = {"plinth": {"platform": {1: [_run(30, 100), _run(34, 120)], 16: [_run(200, 900), _run(220, 1000)]}},
            "vllm": {"platform": {1: [_run(20, 150), _run(30, 90)], 16: [_run(100, 2000), _run(160, 2100)]}}}
    agg = {n: {j: {c: sc.aggregate(rs) for c, rs in bc.items()} for j, bc in bj.items()} for n, bj in runs.items()}
    a = agg["plinth"]["platform"][1]
    assert a["output_throughput"] == 32 and a["range"]["output_throughput"] == (30, 34) and "backend" not in a
    assert sc.ratio(a, agg["vllm"]["platform"][1], "output_throughput") == (32 / 25, 30 / 30, 34 / 20)
    rows = {r["what"]: r for r in sc.target_rows(agg, ["platform"], [1, 16])}
    assert rows["output tok/s at concurrency 1"]["met"]  # 1.28x >= 1.2x
    assert rows["output tok/s at concurrency 16"]["met"]  # 1.62x >= 1.5x
    assert rows["median TTFT ms at concurrency 1"]["met"]  # medians 110 vs 120 ms
    assert rows["median TTFT ms at concurrency 16"]["ratio"][0] == 950 / 2050
    args = _args(sc, "--repeats", "2")
    info = {"cpu": "Test CPU", "cores": 2, "memory": "1 GiB", "isa": ["avx2", "avx512f"], "device": "cpu",
            "default_dtype": "float32", "commit": "abc123", "plinth-core": "0", "torch": "0", "vllm": "0.32.0",
            "omp_bind": "0-1"}
    text = sc.vllm_section(args, agg, ["platform"], [1, 16], info, None, None, "CMD", "2026-12-03 06:00 UTC", 60.0,
                           {"plinth": [10.0], "vllm": [40.0]})
    assert text.startswith(sc.VBEGIN) and text.rstrip().endswith(sc.VEND)
    assert "avx2, avx512f" in text and "abc123" in text and "CMD" in text and "**met**" in text
    assert "32.0 (30.0-34.0)" in text
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\n{sc.BEGIN}\nserving\n{sc.END}\n\nrest\n")
    monkeypatch.setattr(sc, "DOC", doc)
    sc.write_doc(text, sc.VBEGIN, sc.VEND, after=(sc.END,))
    first = doc.read_text()
    assert first.index(sc.END) < first.index(sc.VBEGIN) < first.index("rest") and "serving" in first
    sc.write_doc(text.replace("CMD", "CMD2"), sc.VBEGIN, sc.VEND, after=(sc.END,))
    assert doc.read_text() == first.replace("CMD", "CMD2")


def test_deterministic_flag_reaches_plinth_only(sc):
    hf = Path("/tmp/hf")
    for argv, want in (([], []), (["--deterministic"], ["--deterministic"]), (["--no-deterministic"], ["--no-deterministic"])):
        args = _args(sc, *argv)
        plinth = sc.make_server("plinth", args, hf, "/m.gguf", 1, {})
        assert [a for a in plinth.cmd if "deterministic" in a] == want
        assert not any("deterministic" in a for a in sc.make_server("vllm", args, hf, "/m.gguf", 2, {}).cmd)
        assert sc.mode_text({"deterministic": args.deterministic}) == (
            "" if not argv else f"; plinth {'with' if argv == ['--deterministic'] else 'without'} `--deterministic`"
        )



def test_offline_engine_run_takes_the_mode(sc, monkeypatch):
    import json
    import subprocess
    import types

    specs = []

    def fake_run(cmd, **kw):
        specs.append(json.loads(cmd[-1]))
        out = {"duration": 1.0, "total_output_tokens": 10, "total_input_tokens": 5, "num_prompts": 1}
        return types.SimpleNamespace(stdout=json.dumps(out) + "\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    for mode in (None, True, False):
        sc.run_offline("/m", "bfloat16", ["p"], [4], 1, ["w"], mode)
        assert specs[-1]["deterministic"] is mode


def test_the_page_and_its_generator_agree(sc, tmp_path, monkeypatch):
    """docs/benchmarks.md holds each section serve_compare.py writes once,
    between its markers, where write_doc puts it; writing both sections (as a
    full run of two servers at concurrency 1 and 16, two repeats, does)
    changes nothing outside the markers and keeps the page within 500 lines."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(page.splitlines()) <= 500
    spots = [page.index(m) for m in (sc.BEGIN, sc.END, sc.VBEGIN, sc.VEND)]
    assert all(page.count(m) == 1 for m in (sc.BEGIN, sc.END, sc.VBEGIN, sc.VEND))
    assert spots == sorted(spots)
    # the generated vLLM section is a ### under the serving section's ## heading
    assert page[spots[0]:spots[1]].lstrip(sc.BEGIN).lstrip().startswith("## Serving")
    assert page[spots[2]:spots[3]].lstrip(sc.VBEGIN).lstrip().startswith("### ")
    runs = {n: {j: {c: [_run(30 * c, 100), _run(32 * c, 120)] for c in (1, 16)} for j in ("platform", "vllm")}
            for n in ("plinth", "vllm", "transformers")}  # fmt: skip
    agg = {n: {j: {c: sc.aggregate(rs) for c, rs in bc.items()} for j, bc in bj.items()} for n, bj in runs.items()}
    info = {"cpu": "Test CPU", "cores": 2, "memory": "1 GiB", "isa": ["avx2"], "device": "cpu", "default_dtype": "bfloat16",
            "commit": "abc123", "plinth-core": "0", "torch": "0", "vllm": "0.32.0", "omp_bind": "0-1", "python": "3.11",
            "transformers": "5"}  # fmt: skip
    args = _args(sc, "--repeats", "2")
    doc = tmp_path / "benchmarks.md"
    doc.write_text(page)
    monkeypatch.setattr(sc, "DOC", doc)
    sc.write_doc(sc.section(args, agg, None, [1, 16], info, "CMD", "2026-12-08 00:00 UTC", 60.0), sc.BEGIN, sc.END)
    vllm = sc.vllm_section(args, agg, ["platform", "vllm"], [1, 16], info, None, None, "CMD", "2026-12-08 00:00 UTC", 60.0,
                           {"plinth": [10.0], "vllm": [40.0]})  # fmt: skip
    sc.write_doc(vllm, sc.VBEGIN, sc.VEND, after=(sc.END,))
    new = doc.read_text()
    assert len(new.splitlines()) <= 500, len(new.splitlines())

    def outside(text: str) -> str:
        head, rest = text.split(sc.BEGIN, 1)
        middle, tail = rest.split(sc.END, 1)[1].split(sc.VBEGIN, 1)
        return head + middle + tail.split(sc.VEND, 1)[1]

    assert outside(new) == outside(page)
