"""Ranks start as fresh interpreters running plinth's worker entry point
(``python -m plinth.engine.worker``), never by re-importing the user's
``__main__``: ``LLM(tp=2)`` works from a script without a main guard, from
``python -`` (stdin) and from code run by ``exec`` as a notebook cell is,
and gives one process's greedy tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from plinth import LLM, SamplingParams
from tiny_models import tiny_model_dir

KW = dict(device="cpu", backend="torch", dtype="float32", num_pages=64, load_progress=False, max_num_batched_tokens=256)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
NEW = 6

# no `if __name__ == "__main__":` guard, on purpose
SCRIPT = """
import json
from plinth import LLM, SamplingParams
llm = LLM({model!r}, tp=2, **{kw!r})
outs = llm.generate({prompts!r}, SamplingParams(max_tokens={new}, temperature=0, ignore_eos=True))
print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
llm.close()
"""


def tokens_of(proc: subprocess.CompletedProcess) -> list[list[int]]:
    line = next((x for x in proc.stdout.splitlines() if x.startswith("TOKENS ")), None)
    assert proc.returncode == 0 and line, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[len("TOKENS ") :])


@pytest.fixture(scope="module")
def case(tiny_root):
    model = tiny_model_dir("llama", tiny_root)
    with LLM(model, **KW) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    return model, SCRIPT.format(model=model, kw=KW, prompts=PROMPTS, new=NEW), [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_script_without_main_guard(case, tmp_path):
    model, code, want = case
    script = tmp_path / "no_guard.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert tokens_of(proc) == want


@pytest.mark.slow
def test_python_stdin(case, tmp_path):
    model, code, want = case
    proc = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert tokens_of(proc) == want


@pytest.mark.slow
def test_notebook_like_exec(case, tmp_path):
    """A notebook runs each cell with exec() in the namespace of a __main__
    that has no file (the kernel's)."""
    model, code, want = case
    runner = f"cell = {code!r}\nexec(compile(cell, '<cell 1>', 'exec'), {{'__name__': '__main__'}})\n"
    proc = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert tokens_of(proc) == want
