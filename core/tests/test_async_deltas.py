"""AsyncLLM hands out deltas: what is new since a request's previous output
(text, token ids, logprobs), never taking back text it sent (a stop string's
beginning is held back until it cannot be one), also to a reader that falls
behind and gets several outputs folded into one."""

from __future__ import annotations

import asyncio

import pytest
from plinth.engine.async_engine import AsyncLLM
from plinth.engine.outputs import CompletionOutput, DeltaCursor, RequestOutput
from plinth.engine.sampling_params import SamplingParams
from toy_engine import reference, toy_engine

PROMPT = [5, 9, 13]


def _text(ids: list[int]) -> str:
    return "".join(chr(0x40 + t) for t in ids)


@pytest.fixture
def llm():
    engine = AsyncLLM(toy_engine())
    yield engine
    engine.close()


def _collect(llm: AsyncLLM, params: SamplingParams, *, lag: float = 0.0) -> list:
    async def run() -> list:
        outs = []
        async for out in llm.generate(PROMPT, params):
            outs.append(out)
            if lag and len(outs) == 1:
                await asyncio.sleep(lag)  # the engine runs on: several outputs queue up
        return outs

    return asyncio.run(run())


def _joined(outs: list, index: int = 0) -> tuple[list[str], list[int], list]:
    texts, ids, lps = [], [], []
    for out in outs:
        for c in out.outputs:
            if c.index == index:
                texts.append(c.delta_text)
                ids += c.delta_token_ids
                lps += c.delta_logprobs or []
    return texts, ids, lps


def test_deltas_join_to_the_output(llm):
    ref = reference(PROMPT, 12, eos=False)
    outs = _collect(llm, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2))
    final = outs[-1].outputs[0]
    texts, ids, lps = _joined(outs)
    assert final.token_ids == ref and ids == ref
    assert "".join(texts) == final.text == _text(ref)
    assert [lp.token_id for lp in lps] == ref
    assert len(outs) > 1 and all(len(o.outputs[0].delta_token_ids) >= 1 for o in outs)


def test_stop_string_is_held_back_never_taken_back(llm):
    ref = reference(PROMPT, 12, eos=False)
    text = _text(ref)
    stop = text[4:7]  # spans three tokens
    outs = _collect(llm, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.text == text[: text.index(stop)]
    texts, _, _ = _joined(outs)
    sent = ""
    for piece in texts:
        sent += piece
        assert final.text.startswith(sent)  # nothing sent is ever cut off later
    assert sent == final.text


def test_cursor_holds_back_a_stop_strings_beginning():
    cursor = DeltaCursor(["xyz"])

    def out(text: str, finished: bool = False) -> RequestOutput:
        c = CompletionOutput(index=0, text=text, token_ids=list(range(len(text))), finish_reason="stop" if finished else None)
        return RequestOutput("r", None, [1], [c], finished=finished)

    assert cursor.advance(out("abx")).outputs[0].delta_text == "ab"  # "x" may begin "xyz"
    assert cursor.advance(out("abxy")).outputs[0].delta_text == ""
    assert cursor.advance(out("abxyq")).outputs[0].delta_text == "xyq"  # it did not: sent now
    assert cursor.advance(out("abxyqx")).outputs[0].delta_text == ""
    last = cursor.advance(out("abxyqxw")).outputs[0]
    assert last.delta_text == "xw" and last.delta_token_ids == [6]
    # a stop string found: the engine cuts it off, and its held-back beginning is never sent
    cursor = DeltaCursor(["xyz"])
    cursor.advance(out("abxy"))
    assert cursor.advance(out("ab", finished=True)).outputs[0].delta_text == ""


def test_include_stop_str_sends_without_holding_back(llm):
    ref = reference(PROMPT, 12, eos=False)
    text = _text(ref)
    stop = text[4:7]
    outs = _collect(llm, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))
    texts, _, _ = _joined(outs)
    assert "".join(texts) == outs[-1].outputs[0].text == text[: text.index(stop) + len(stop)]
    assert all(o.outputs[0].delta_text == o.outputs[0].text[-len(o.outputs[0].delta_text) :] for o in outs if o.outputs[0].delta_text)


def test_a_reader_that_falls_behind_gets_the_deltas_folded(llm):
    n_tokens = 40
    outs = _collect(llm, SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True, n=2, seed=1, logprobs=1), lag=0.3)
    assert len(outs) < n_tokens  # outputs were folded together
    final = outs[-1]
    assert final.finished
    for c in final.outputs:
        texts, ids, lps = _joined(outs, c.index)
        assert ids == c.token_ids and len(ids) == n_tokens
        assert "".join(texts) == c.text
        assert [lp.token_id for lp in lps] == c.token_ids


def test_a_step_wakes_the_event_loop_once_for_all_its_streams(llm):
    """Each step's outputs reach the event loop in one call (one wake-up of
    its thread), not one per stream, and every stream still gets all its tokens."""
    wakeups: list[int] = []

    async def run() -> list:
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            wakeups.append(len(args[0]) if args and isinstance(args[0], list) else 1)
            return plain(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

        async def one() -> list:
            return [out async for out in llm.generate(PROMPT, params)]

        return await asyncio.gather(*(one() for _ in range(4)))

    results = asyncio.run(run())
    ref = reference(PROMPT, 8, eos=False)
    assert all(outs[-1].outputs[0].token_ids == ref for outs in results)
    # every output handed over (a reader may fold several into one), in fewer
    # wake-ups than outputs: steps that ran all four streams woke the loop once
    assert sum(wakeups) >= sum(len(outs) for outs in results)
    assert max(wakeups) == 4 and len(wakeups) < sum(wakeups)
