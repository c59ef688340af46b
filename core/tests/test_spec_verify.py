"""Batched speculative verification on synthetic logits: a sequence's result
does not depend on the others verified with it, and greedy acceptance is the
longest prefix equal to the argmax."""

from types import SimpleNamespace

import torch
from plinth.engine.sampler import SampleRow, make_generator
from plinth.engine.sampling_params import SamplingParams
from plinth.engine.speculative import SpecDecoder


class _NoProposer:
    def free(self, key):
        pass


def _seq(seq_id, params, spec):
    return SimpleNamespace(seq_id=seq_id, params=params, spec_tokens=list(spec), grammar=None, generator=make_generator(params.seed))


def _make_row(seq, extra, grammar):
    return SampleRow(seq.params, (), [*extra], seq.generator, grammar)


def _verify(seqs, logits_per_seq):
    dec = SpecDecoder(_NoProposer(), 4, vocab_size=logits_per_seq[0].shape[-1])
    items, first = [], 0
    for s, lg in zip(seqs, logits_per_seq):
        items.append((s, first))
        first += lg.shape[0]
    return dec.verify(items, torch.cat(logits_per_seq), _make_row)


def test_greedy_keeps_the_prefix_equal_to_the_argmax_then_the_target_token():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    target = logits.argmax(-1).tolist()
    spec = [target[0], target[1], (target[2] + 1) % 50]
    (v,) = _verify([_seq(1, SamplingParams(temperature=0), spec)], [logits])
    assert v.accepted == 2 and v.proposed == 3
    assert v.tokens == [target[0], target[1], target[2]]
    (v,) = _verify([_seq(1, SamplingParams(temperature=0), target[:3])], [logits])
    assert v.tokens == target  # all pass: the bonus token follows


def test_a_sequence_verifies_the_same_alone_and_in_a_batch():
    torch.manual_seed(1)
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, logprobs=1),
        SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.3, seed=12),
        SamplingParams(temperature=1.2, seed=13),
    ]
    ks = [3, 2, 4, 1]
    logits = [torch.randn(k + 1, 40) * 2 for k in ks]
    specs = [lg.argmax(-1).tolist()[:k] for lg, k in zip(logits, ks)]  # likely proposals: some pass, some fail
    together = _verify([_seq(i, p, s) for i, (p, s) in enumerate(zip(params, specs))], logits)
    for i, (p, s) in enumerate(zip(params, specs)):
        (alone,) = _verify([_seq(i, p, s)], [logits[i]])
        assert (alone.tokens, alone.accepted) == (together[i].tokens, together[i].accepted)
        assert [e and (e.token_id, e.logprob) for e in alone.logprobs] == [e and (e.token_id, e.logprob) for e in together[i].logprobs]
    # both paths ran: a rejection (a correction drawn) and a full pass (a bonus drawn)
    assert {v.accepted < v.proposed for v in together} == {True, False}
