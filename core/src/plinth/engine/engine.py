"""The synchronous engine: requests in, one scheduled step at a time,
outputs out.

``LLMEngine`` is an ``EngineCore`` driven by one thread (the offline ``LLM``
loop or the ``AsyncLLM`` worker thread); nothing in it is shared with other
threads. It schedules, and hands each step to its ``Executor``
(``plinth.engine.executor``), which runs the forward and samples on however
many ranks hold the model: the engine never knows how many.
``plinth.engine.factory`` builds it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any
from typing import Sequence as Seq

import torch

from plinth.engine.detokenizer import detokenize_step, find_stop
from plinth.engine.executor import Executor
from plinth.engine.interfaces import CLOSE_TIMEOUT_S, EngineCore, EngineDraining
from plinth.engine.kv_cache_manager import KVCacheManager
from plinth.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from plinth.engine.sampler import SampleJob, SampleRow, make_generator
from plinth.engine.sampling_params import SamplingParams
from plinth.engine.scheduler import ScheduledBatch, Scheduler
from plinth.engine.sequence import Request, Sequence
from plinth.errors import RequestError

log = logging.getLogger("plinth.engine")


@dataclass
class StepRows:
    """The logits rows a step computes, and what each is for."""

    #: flat token index of each logits row
    rows: list[int] = field(default_factory=list)
    #: the sequences sampling after this step, and their rows
    samplers: list[Sequence] = field(default_factory=list)
    sample_at: list[int] = field(default_factory=list)
    #: prompt logprobs: sequence, first row, first position, count
    prompt_lp: list[tuple[Sequence, int, int, int]] = field(default_factory=list)
    #: sequences with proposals: sequence, its batch index, first row
    spec_at: list[tuple[Sequence, int, int]] = field(default_factory=list)


def step_rows(batch: ScheduledBatch) -> StepRows:
    out = StepRows()
    offset = 0
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
        c = seq.num_computed
        if seq.request.prompt_logprobs is not None and seq.index == 0 and c < seq.num_prompt_tokens - 1:
            count = min(c + n, seq.num_prompt_tokens - 1) - c
            out.prompt_lp.append((seq, len(out.rows), c, count))
            out.rows.extend(range(offset, offset + count))
        if seq.spec_tokens:  # a decode scoring k proposals: the rows of all 1 + k positions
            out.spec_at.append((seq, i, len(out.rows)))
            out.rows.extend(range(offset, offset + n))
        elif c + n == seq.num_tokens:
            out.samplers.append(seq)
            out.sample_at.append(len(out.rows))
            out.rows.append(offset + n - 1)
        offset += n
    return out


@dataclass
class StepSampling:
    """What a step samples: the job, and the sequence each sampled row
    belongs to (n > 1 forks expanded: ``forks`` holds their children)."""

    job: SampleJob = field(default_factory=lambda: SampleJob([], []))
    seqs: list[Sequence] = field(default_factory=list)
    forks: list[tuple[Sequence, list[Sequence]]] = field(default_factory=list)


class LLMEngine(EngineCore):
    def __init__(
        self,
        *,
        executor: Executor,
        tokenizer: Any,
        model_config: Any,
        scheduler: Scheduler,
        max_model_len: int,
        components: Any = None,
        spec: Any = None,
    ) -> None:
        #: runs each step's forward and samples it (``LocalExecutor``: this process's model runner)
        self.executor = executor
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.scheduler = scheduler
        #: the one owner of KV pages (the scheduler's)
        self.kv: KVCacheManager = scheduler.kv
        if self.kv.copy_pages is None:
            self.kv.copy_pages = executor.copy_pages
        self.max_model_len = max_model_len
        self.components = components  # what startup resolved (plugins, config)
        #: speculative decoding (``plinth.engine.speculative.SpecDecoder``), or None
        self.spec = spec
        self.requests: dict[str, Request] = {}
        vocab = model_config.vocab_size
        self.eos_token_ids = frozenset(
            t for t in (*getattr(tokenizer, "eos_token_ids", ()), *model_config.eos_token_ids) if 0 <= t < vocab
        )
        # counters for metrics
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.closed = False

    # ---- requests ------------------------------------------------------------

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raise RequestError for what this engine cannot run."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise RequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})", param="prompt")
        if n >= self.max_model_len:
            raise RequestError(
                f"the prompt has {n} tokens; this model's maximum context length is {self.max_model_len}, "
                "which leaves no room to generate",
                param="prompt",
                code="context_length_exceeded",
            )
        bad = next((t for t in params.logit_bias or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})", param="logit_bias")
        if params.min_tokens > self.max_model_len:
            raise RequestError(
                f"min_tokens {params.min_tokens} is beyond this model's maximum context length, {self.max_model_len}",
                param="min_tokens",
                code="context_length_exceeded",
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {n + params.max_tokens} "
                f"were requested ({n} in the prompt, {params.max_tokens} to generate): lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        capacity = self.kv.token_capacity
        if n + 1 > capacity:
            raise RequestError(
                f"the prompt has {n} tokens but the KV cache holds {capacity}", param="prompt", code="context_length_exceeded"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
    ) -> Request:
        if self.closed:
            raise EngineDraining("the engine is closed")
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running", param="request_id")
        prompt_token_ids = list(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        if params.max_tokens is None:  # as many as the context leaves
            params = params.clone(max_tokens=self.max_model_len - len(prompt_token_ids))
        req = Request(request_id, prompt, prompt_token_ids, params)
        seq = Sequence(req, 0, list(prompt_token_ids), generator=make_generator(params.seed))
        seq.grammar = params.grammar
        seq.pending_fork = params.n > 1
        req.seqs.append(seq)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self.requests[request_id] = req
        self.scheduler.add(seq)
        self.num_prompt_tokens += len(prompt_token_ids)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        req.finished_time = time.monotonic()
        return self._request_output(req)

    def has_unfinished(self) -> bool:
        # a failed executor is reported by the next step, even with nothing in flight
        return bool(self.requests) or self.executor.failure is not None

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ---- one step ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report every request that
        moved (including those that finished)."""
        self.executor.check()
        proposed = self._propose() if self.spec is not None else []
        batch = self.scheduler.schedule()
        if proposed:
            self._trim_proposals(batch, proposed)
        touched: dict[str, Request] = {}
        for seq in batch.evicted:  # can never fit in the KV pool, or failed to load its KV
            touched[seq.request.request_id] = seq.request
            if seq.request.error is not None:
                for other in seq.request.seqs:
                    if not other.finished:
                        self.scheduler.finish(other, "error")
                self.requests.pop(seq.request.request_id, None)
            if seq.request.finished or seq.request.error is not None:
                seq.request.finished_time = time.monotonic()
        if batch.seqs:
            self.num_steps += 1
            shape = self.spec.decode_shape(batch) if self.spec is not None and not batch.preempted else None
            self._run(batch, touched)
            if self.spec is not None:
                self.spec.step_done(shape)
        elif self.kv.connector is not None and self.kv.connector.pending():
            self.kv.connector.wait(0.01)  # only KV lookups in flight: do not spin
        outputs = []
        for req in touched.values():
            out = self._request_output(req)
            outputs.append(out)
            if out.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    def _run(self, batch: ScheduledBatch, touched: dict[str, Request]) -> None:
        plan = step_rows(batch)
        sampling = self._sampling(plan)
        out = self.executor.execute(batch, plan.rows, sampling.job)
        result = out.sampled
        if plan.spec_at:
            if out.logits is None:
                raise RuntimeError("speculative verification needs the logits in this process")
            for seq, v in self._verify(batch, plan.spec_at, out.logits):
                touched[seq.request.request_id] = seq.request
                self._append_verified(seq, v)
        self.scheduler.mark_computed(batch)

        for (seq, _, _, _), entries in zip(plan.prompt_lp, result.prompt_logprobs):
            seq.request.prompt_logprobs.extend(entries)
        for parent, children in sampling.forks:
            self._place_children(parent, children)
        if self.spec is not None and self.spec.wants_hidden:
            for seq, row in zip(sampling.seqs, sampling.job.at):
                self.spec.hidden[seq.seq_id] = self._target_hidden(row)
        for seq, token, lp in zip(sampling.seqs, result.tokens, result.logprobs):
            touched[seq.request.request_id] = seq.request
            self._append_token(seq, token, lp)

    def _sampling(self, plan: StepRows) -> StepSampling:
        """The step's SampleJob. n > 1: a prompt finished prefill once; its n
        samples fork from it here (the children exist before the forward, so
        the job samples them; they take pages once the parent's are computed)."""
        out = StepSampling()
        at: list[int] = []
        for seq, row in zip(plan.samplers, plan.sample_at):
            family = [seq]
            if seq.pending_fork:
                seq.pending_fork = False
                family += self._fork_children(seq)
                out.forks.append((seq, family[1:]))
            out.seqs += family
            at += [row] * len(family)
        prompt = [(first, seq.token_ids[pos + 1 : pos + 1 + count], seq.params.prompt_logprobs or 0) for seq, first, pos, count in plan.prompt_lp]
        out.job = SampleJob(rows=[self._sample_row(seq) for seq in out.seqs], at=at, prompt=prompt)
        return out

    def _sample_row(self, seq: Sequence, extra: Seq[int] = (), grammar: Any = None) -> SampleRow:
        """``extra``: speculative proposals taken as already generated, with
        ``grammar`` the grammar's state after them (verification)."""
        p = seq.params
        banned: Seq[int] = ()
        if seq.num_output_tokens + len(extra) < p.min_tokens:
            banned = [*(p.stop_token_ids or ()), *(() if p.ignore_eos else self.eos_token_ids)]
        return SampleRow(
            params=p,
            prompt_ids=seq.token_ids[: seq.num_prompt_tokens] if p.repetition_penalty != 1.0 else (),
            output_ids=([*seq.output_ids, *extra] if extra else seq.output_ids) if p.needs_penalties else (),
            generator=seq.generator,
            grammar=seq.grammar if grammar is None else grammar,
            banned=banned,
        )

    # ---- speculative decoding (plinth.engine.speculative) ------------------------------

    def _propose(self) -> list[Sequence]:
        sched = self.scheduler
        live = {s.seq_id for s in sched.running} | {s.seq_id for s in sched.waiting}
        return self.spec.propose(sched.running, live, self.max_model_len)

    def _trim_proposals(self, batch: ScheduledBatch, proposed: list[Sequence]) -> None:
        """Keep the proposals the scheduler made room for (a full budget or
        pool cuts them; a preempted sequence drops them)."""
        scheduled = {s.seq_id: n for s, n in zip(batch.seqs, batch.num_tokens)}
        for seq in proposed:
            n = scheduled.get(seq.seq_id, 0)
            seq.spec_tokens = seq.spec_tokens[: max(0, n - seq.remaining)] if n else []

    def _verify(self, batch: ScheduledBatch, spec_at: list[tuple[Sequence, int, int]], logits: torch.Tensor) -> list[Any]:
        verified = self.spec.verify([(seq, first) for seq, _, first in spec_at], logits, self._sample_row)
        out = []
        for (seq, i, first), v in zip(spec_at, verified):
            seq.spec_tokens = []
            if self.spec.wants_hidden:  # the row behind the token the target added itself
                self.spec.hidden[seq.seq_id] = self._target_hidden(first + v.accepted)
            batch.num_tokens[i] = 0  # _append_verified advances what was computed, not mark_computed
            out.append((seq, v))
        return out

    def _target_hidden(self, row: int) -> torch.Tensor:
        """The target's hidden state at a logits row of this step (proposers that read it)."""
        hidden = self.executor.last_hidden
        if hidden is None:
            raise RuntimeError("the proposer reads the target's hidden states: this executor keeps none")
        return hidden[row]

    def _append_verified(self, seq: Sequence, v: Any) -> None:
        """Append what verification kept. The forward computed the K/V of the
        last token and of every proposal; a proposal's counts as computed
        (and its page may enter the prefix cache) only once it joined the
        sequence, so no page holding a rejected or dropped token is ever
        registered: the pages and hashes are those of a run without
        speculation. Trailing pages that held only rejected K/V go back."""
        self._advance_computed(seq)  # the last token
        for j, (token, lp) in enumerate(zip(v.tokens, v.logprobs)):
            self._append_token(seq, token, lp)
            if seq.finished:  # EOS, a stop string, max_tokens: the rest is dropped (pages freed)
                return
            if j < v.accepted:
                self._advance_computed(seq)
        self.kv.rollback(seq, seq.num_computed)

    def _advance_computed(self, seq: Sequence) -> None:
        self.kv.commit(seq, 1)

    def _fork_children(self, parent: Sequence) -> list[Sequence]:
        """Sequences 1..n-1 of a request whose prompt is being computed: its
        tokens, a grammar fork and sample i's seed (seed + i); no pages yet."""
        req = parent.request
        children = []
        for i in range(1, req.params.n):
            seed = None if req.params.seed is None else req.params.seed + i
            child = Sequence(req, i, list(parent.token_ids), generator=make_generator(seed))
            child.grammar = parent.grammar.fork() if parent.grammar is not None else None
            children.append(child)
        return children

    def _place_children(self, parent: Sequence, children: list[Sequence]) -> None:
        """The n sequences continue from the parent's computed pages through
        the KV-cache manager (or, with no page free for the copy of its
        partial last page, wait and recompute from the prefix cache)."""
        for child in children:
            if self.kv.fork(parent, child):
                self.scheduler.add_running(child)
            else:
                self.scheduler.add(child)
            parent.request.seqs.append(child)

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> None:
        req = seq.request
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        seq.token_ids.append(token)
        self.num_generation_tokens += 1
        if lp is not None and seq.logprobs is not None:
            seq.logprobs.append(lp)
            seq.cumulative_logprob += lp.logprob
        p = seq.params
        if seq.grammar is not None and not seq.grammar.accept(token):
            # only when no token was allowed at all; more text could not parse
            log.warning("request %s: the grammar rejected token %d; ending the sequence", req.request_id, token)
            return self._finish(seq, "stop", "grammar")
        can_stop = seq.num_output_tokens > p.min_tokens or p.min_tokens == 0
        if can_stop and not p.ignore_eos and token in self.eos_token_ids:
            return self._finish(seq, "stop", token)
        if can_stop and token in (p.stop_token_ids or ()):
            return self._finish(seq, "stop", token)
        delta = detokenize_step(self.tokenizer, seq)
        if delta:
            seq.text += delta
            stops = [p.stop] if isinstance(p.stop, str) else p.stop  # a list after SamplingParams.__post_init__
            if stops and can_stop:
                hit = find_stop(seq.text, len(delta), stops)
                if hit is not None:
                    start, stop = hit
                    seq.text = seq.text[: start + (len(stop) if p.include_stop_str_in_output else 0)]
                    return self._finish(seq, "stop", stop)
        if seq.grammar is not None and seq.grammar.is_terminated():
            return self._finish(seq, "stop")
        if seq.num_output_tokens >= p.limit or seq.num_tokens >= self.max_model_len:
            seq.text += detokenize_step(self.tokenizer, seq, final=True)
            return self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, stop_reason: Any = None) -> None:
        self.scheduler.finish(seq, reason, stop_reason)
        if self.spec is not None:
            self.spec.release(seq.seq_id)
        if seq.request.finished:
            seq.request.finished_time = time.monotonic()

    # ---- outputs ------------------------------------------------------------------

    def _request_output(self, req: Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=s.output_ids,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob,
            )
            for s in sorted(req.seqs, key=lambda s: s.index)
            if s.num_output_tokens > 0 or s.finished
        ]
        finished = req.finished or req.request_id not in self.requests
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["first_token_time"] = req.first_token_time
        if req.finished_time is not None:
            metrics["finished_time"] = req.finished_time
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=req.num_cached_tokens,
            num_external_cached_tokens=req.num_external_cached_tokens,
            metrics=metrics,
            prompt_logprobs=req.prompt_logprobs,
            error=req.error,
        )

    # ---- introspection -------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            **self.kv.stats(),
            "preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "steps": self.num_steps,
            **(self.spec.stats() if self.spec is not None else {}),
            **self.executor.stats(),
        }

    def describe(self) -> dict[str, Any]:
        return {**(self.components.describe() if self.components is not None else {}), **self.executor.describe()}

    def kv_transfer(self) -> Any:
        return self.kv.connector

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Take no new request, end the running ones (``abort``), write what
        they computed to the KV connector and wait for its saves (at most
        ``timeout``; the rest are cancelled), stop its threads and the
        KV-event publisher, and close the executor (its ranks)."""
        if self.closed:
            return
        self.closed = True
        bound = time.monotonic() + timeout
        for rid in list(self.requests):
            self.abort_request(rid)
        if self.kv.connector is not None:
            self.kv.connector.close(timeout)
        self.kv.close()
        self.executor.close(max(0.0, bound - time.monotonic()))

    @property
    def pool(self) -> Any:
        """The KV-cache manager's page pool (read it for statistics; pages
        are handed out only through ``self.kv``)."""
        return self.kv.pool

    def pages_held(self) -> int:
        """Pages referenced by live sequences (0 when idle: nothing leaked)."""
        return self.kv.pages_held()
