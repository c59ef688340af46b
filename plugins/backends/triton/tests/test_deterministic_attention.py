"""--deterministic attention on the triton backend, under Triton's
interpreter: with every step through the ragged kernel at one fixed launch
and key blocks at absolute multiples of BLOCK_N, rows computed every way
(``plinth.testing.invariance``: decode, verification, chunked prefill with
earlier K/V from the pages, page sizes 16 and 7, among other sequences) are
bit-identical. The default mode (split-K decode, whose split count follows
the batch, and key blocks that start where a window starts) is not. What
the interpreter cannot show: a GPU's tl.dot at the fixed launch (not run
here). The tests shrink BLOCK_N to 16 (tl.dot's least) so that their short
sequences cross key-block boundaries: the interpreter is slow."""

import os

import pytest
import torch
from plinth.api import SelectionContext, load_accelerator
from plinth.testing import attention_backend
from plinth.testing.invariance import InvarianceCase, attention_invariance_problems

CPU = torch.device("cpu")


def _ops(dtype, deterministic):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    return attention_backend(SelectionContext(accelerator=load_accelerator("cpu"), dtype=dtype, deterministic=deterministic), "triton")


@pytest.fixture(autouse=True)
def small_key_blocks(monkeypatch):
    from plinth_plugin_triton import attention

    monkeypatch.setattr(attention, "BLOCK_N", 16)


@pytest.mark.parametrize("dtype,window", [(torch.bfloat16, None), (torch.float32, 20)])
def test_rows_are_bit_identical_every_way(dtype, window):
    case = InvarianceCase(length=36, window=window)
    problems = attention_invariance_problems(_ops(dtype, True), dtype, CPU, case=case)
    assert not problems, "\n".join(problems)


def test_default_mode_is_not_batch_invariant():
    problems = attention_invariance_problems(_ops(torch.float32, False), torch.float32, CPU, case=InvarianceCase(length=24, window=20))
    assert problems
