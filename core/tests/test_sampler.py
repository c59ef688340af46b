"""The sampler on synthetic logits: filters, seeds, penalties, logprobs."""

import math

import pytest
import torch
from plinth.engine.sampler import ARGMAX_CHUNK, Sampler, SampleRow, first_argmax, make_generator
from plinth.engine.sampling_params import SamplingParams


def _row(params, gen=None, prompt=(), out=(), **kw):
    return SampleRow(params=params, prompt_ids=prompt, output_ids=out, generator=gen, **kw)


def _draw(logits, params, seed=None, n=1):
    sampler = Sampler()
    gen = make_generator(seed)
    return [sampler(logits.clone(), [_row(params, gen)])[0][0] for _ in range(n)]


def test_greedy_and_top_k_1_take_the_argmax():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    want = logits.argmax(-1).tolist()
    s = Sampler()
    assert s(logits, [_row(SamplingParams(temperature=0))] * 4)[0] == want
    assert s(logits, [_row(SamplingParams(temperature=1.5, top_k=1))] * 4)[0] == want


@pytest.mark.parametrize("vocab", [100, ARGMAX_CHUNK * 2, ARGMAX_CHUNK * 48, ARGMAX_CHUNK * 48 + 17, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_argmax_is_argmax_with_ties_infinities_and_nans(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(8, vocab, generator=g).to(dtype)
    x[1] = float("-inf")  # nothing allowed: index 0, as argmax
    for at in (vocab - 1, vocab // 3, 5):  # a tie across chunks and into the tail: the first wins
        x[2, at] = x[2].max()
    x[3, vocab - 1] = float("nan")  # a NaN counts as the largest, in the tail too
    x[4, vocab // 2] = x[4, vocab - 1] = float("nan")
    x[5, vocab - 1] = 1e4  # the largest value in the tail
    x[6, 0] = x[6, vocab - 2] = float("inf")
    x[7, ARGMAX_CHUNK - 1 if vocab > ARGMAX_CHUNK else 0] = 1e4  # a chunk's last token
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))
    assert first_argmax(x).tolist() == [int(row.argmax()) for row in x]


def test_same_seed_same_tokens_regardless_of_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, 500)
    p = SamplingParams(temperature=1.0, seed=7)
    s = Sampler()
    alone = [s(logits[1:2], [_row(p, make_generator(7))])[0][0] for _ in range(1)]
    rows = [_row(SamplingParams(temperature=1.0)), _row(p, make_generator(7)), _row(SamplingParams(temperature=0.5))]
    batched = s(logits, rows)[0][1]
    assert alone[0] == batched
    g = make_generator(7)
    seq_a = [s(logits[1:2], [_row(p, g)])[0][0] for _ in range(20)]
    g = make_generator(7)
    seq_b = [s(logits[1:2], [_row(p, g)])[0][0] for _ in range(20)]
    assert seq_a == seq_b and len(set(seq_a)) > 1


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05]]))
    seen = set(_draw(logits, SamplingParams(top_k=2, seed=1), seed=1, n=200))
    assert seen == {0, 1}
    seen = set(_draw(logits, SamplingParams(top_p=0.75), seed=2, n=300))
    assert seen == {0, 1, 2}  # 0.4 + 0.3 < 0.75: the third token is needed
    seen = set(_draw(logits, SamplingParams(min_p=0.6), seed=3, n=200))
    assert seen == {0, 1}  # 0.2 < 0.6 * 0.4


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    draws = _draw(torch.log(probs)[None], SamplingParams(temperature=1.0), seed=11, n=3000)
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.04)


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    s = Sampler()
    # repetition: positive logits divided, negative multiplied, for seen tokens
    p = SamplingParams(temperature=0, repetition_penalty=4.0)
    assert s(logits.clone(), [_row(p, prompt=[0], out=[])])[0] == [1]  # 2.0 / 4 = 0.5 < 1.0
    # presence and frequency apply to output tokens
    p = SamplingParams(temperature=0, frequency_penalty=0.6)
    assert s(logits.clone(), [_row(p, out=[0, 0])])[0] == [1]  # 2.0 - 1.2 = 0.8 < 1.0
    p = SamplingParams(temperature=0, presence_penalty=1.5)
    assert s(logits.clone(), [_row(p, out=[0, 0, 0])])[0] == [1]  # 2.0 - 1.5 = 0.5


def test_logprobs_are_the_raw_log_softmax_with_ranks():
    torch.manual_seed(3)
    logits = torch.randn(2, 50)
    p = SamplingParams(temperature=0.7, logprobs=3, seed=5)
    tokens, lps = Sampler()(logits, [_row(p, make_generator(5)), _row(p, make_generator(6))])
    ref = torch.log_softmax(logits, -1)
    for r in range(2):
        e = lps[r]
        assert e.token_id == tokens[r]
        assert math.isclose(e.logprob, ref[r, tokens[r]].item(), abs_tol=1e-5)
        top = ref[r].topk(3)
        assert [x.token_id for x in e.top] == top.indices.tolist()
        assert all(math.isclose(x.logprob, v, abs_tol=1e-5) for x, v in zip(e.top, top.values.tolist()))
        assert e.rank == int((ref[r] > ref[r, tokens[r]]).sum()) + 1


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    tokens, _ = Sampler()(logits, [_row(SamplingParams(temperature=0), banned=[0])])
    assert tokens == [1]


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_k": 0}, {"min_p": 2}, {"n": 0}, {"logprobs": 50}])
def test_invalid_params_are_refused(bad):
    from plinth.errors import RequestError

    with pytest.raises(RequestError):
        SamplingParams(**bad)


class _AllowOnly:
    def __init__(self, allowed):
        self.allowed = allowed

    def mask_logits(self, row):
        keep = row[self.allowed].clone()
        row.fill_(float("-inf"))
        row[self.allowed] = keep


def test_grammar_beats_min_tokens_ban_and_nothing_is_nan():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    # the grammar allows only token 0, which min_tokens bans: the grammar wins
    row = _row(SamplingParams(temperature=0.8, seed=1), make_generator(1), grammar=_AllowOnly([0]), banned=[0])
    assert Sampler()(logits, [row])[0] == [0]
    # a grammar allowing nothing: the model's own choice, never a NaN draw
    row = _row(SamplingParams(temperature=0), grammar=_AllowOnly([]))
    assert Sampler()(logits, [row])[0] == [2]


def test_tiny_temperature_is_greedy():
    logits = torch.tensor([[1.0, 50.0, 3.0]])
    assert Sampler()(logits, [_row(SamplingParams(temperature=1e-9))])[0] == [1]


def test_a_large_vocabulary_tail_keeps_its_mass_and_impossible_tokens_stay_impossible():
    # half the mass on one token, half spread thin over 150k others; the first
    # and last tokens are impossible (a draw is a search in float64 prefix sums)
    vocab = 150_000
    logits = torch.full((1, vocab), 0.0)
    logits[0, 0] = logits[0, -1] = float("-inf")
    logits[0, 7] = math.log(vocab - 3)  # as likely as all the rest together
    draws = _draw(logits, SamplingParams(temperature=1.0), seed=3, n=2000)
    head = sum(t == 7 for t in draws)
    assert abs(head - 1000) < 4 * math.sqrt(2000 * 0.25)  # 4 sigma
    assert 0 not in draws and vocab - 1 not in draws
    assert len(set(draws)) > 900  # the tail is really sampled, not collapsed onto a few ids


def _reference_probs(logits, p):
    """One row's sampling distribution by the definitions, with a full sort."""
    x = logits / p.temperature
    if p.top_k > 0:
        x = x.masked_fill(x < x.topk(min(p.top_k, x.numel())).values[-1], float("-inf"))
    probs = torch.softmax(x, -1)
    if p.top_p < 1:
        s = probs.sort(descending=True).values
        least = s[(s.cumsum(-1) - s) <= p.top_p].min()
        probs = probs.masked_fill(probs < least, 0.0)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


@pytest.mark.parametrize("bins", [1, 7, 2048, 100_000])
def test_batched_filters_equal_the_per_row_definitions(monkeypatch, bins):
    # sharp and flat rows; with 1 bin top-p sorts nearly the whole row
    from plinth.engine import sampler as mod

    monkeypatch.setattr(mod, "TOP_P_BINS", bins)
    torch.manual_seed(4)
    logits = torch.randn(6, 3000) * torch.tensor([[0.3], [1.0], [3.0], [6.0], [1.0], [2.0]])
    params = [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_p=0.5, top_k=40),
        SamplingParams(temperature=1.0, top_k=7),
        SamplingParams(temperature=0.9, top_p=0.95, min_p=0.05),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_p=0.3),
    ]
    rows = [_row(p) for p in params]
    got = mod.filtered_probs(logits, rows, list(range(6)))
    for r, p in enumerate(params):
        want = _reference_probs(logits[r], p)
        assert torch.equal(got[r] > 0, want > 0), r
        assert torch.allclose(got[r], want, atol=1e-7), r


def test_batched_penalties_equal_the_per_row_definitions():
    torch.manual_seed(5)
    vocab = 64
    logits = torch.randn(4, vocab) * 3
    specs = [
        (SamplingParams(temperature=0, repetition_penalty=1.7), [1, 2, 2, 70], [3, 3, 9]),
        (SamplingParams(temperature=0, frequency_penalty=0.4, presence_penalty=-0.3), [5], [6, 6, 6, 8]),
        (SamplingParams(temperature=0), [1], [2]),
        (SamplingParams(temperature=0, repetition_penalty=0.6, frequency_penalty=1.1), [4, 9], [9, 63, 63]),
    ]
    rows = [_row(p, prompt=pr, out=o) for p, pr, o in specs]
    from plinth.engine.sampler import process_logits

    got = process_logits(logits, rows)
    for r, (p, pr, o) in enumerate(specs):
        want = logits[r].clone()
        for t in {t for t in (*pr, *o) if t < vocab}:
            if p.repetition_penalty != 1:
                want[t] = want[t] / p.repetition_penalty if want[t] > 0 else want[t] * p.repetition_penalty
        for t in set(o):
            want[t] -= p.frequency_penalty * o.count(t) + p.presence_penalty
        assert torch.allclose(got[r], want, atol=1e-6), r


def test_a_seeded_row_ignores_its_neighbours_under_every_processor():
    torch.manual_seed(6)
    logits = torch.randn(5, 400) * 2
    mine = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.2, logprobs=2, seed=3)
    others = [
        _row(SamplingParams(temperature=0)),
        _row(SamplingParams(temperature=1.2, top_p=0.5), out=[1, 2]),
        _row(SamplingParams(temperature=0.6, presence_penalty=1.0, logit_bias={5: 3.0}), out=[7]),
        _row(SamplingParams(temperature=1.0, min_p=0.1, seed=9), make_generator(9)),
    ]
    s = Sampler()
    alone = s(logits[2:3], [_row(mine, make_generator(3), prompt=[4], out=[5])])
    batched = s(logits, [*others[:2], _row(mine, make_generator(3), prompt=[4], out=[5]), *others[2:]])
    assert batched[0][2] == alone[0][0]
    assert batched[1][2] == alone[1][0]
