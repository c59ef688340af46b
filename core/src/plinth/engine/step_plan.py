"""Step planning: the token budget of one step, chosen from measurements.

``max_num_batched_tokens="auto"`` (the default) times the loaded model's own
forward (``ModelRunner.execute``, whatever backend and accelerator start-up
chose) on one-sequence prefills of growing size and picks the budget from the
measured curve:

* throughput: the smallest size whose cost per token is within
  ``SATURATION_TOLERANCE`` of the best measured one (bigger steps buy no
  more prefill throughput, only latency);
* latency: never a chunk whose step, with the decodes below added at the
  chunk's cost per token, would take longer than ``STEP_LATENCY_BOUND_S``,
  since a running stream waits for the whole step, prefill chunk included,
  before its next token;
* room for a full batch of decodes on top: the budget is the chosen prompt
  chunk plus the tokens ``max_num_seqs`` decodes take (one each, ``1 + k``
  with speculative decoding), since the scheduler gives the running streams
  their tokens first and a prompt only what is left. A budget of the chunk
  alone left a 128-token prompt 48 tokens a step beside 16 streams (three
  steps instead of one or two), and none beside a full batch: served at
  concurrency 16 on 2 Zen 4 cores, 64 tokens gave 453.9-469.0 output tok/s
  where 128 gave 460.2-504.3, with a shorter TTFT (docs/benchmarks.md).

The measurement is bounded: sizes from ``CANDIDATE_TOKENS`` up to the
model's context length and what the KV pool holds; it stops at the first
size over the latency bound, once the cost per token has stopped falling
for two sizes, or when ``MEASURE_TIME_BUDGET_S`` would be passed. A first
call's own cost (kernels compiled or autotuned: seconds for the triton MoE)
is kept out of both the timings and that budget.

Only the engine's own forward is timed: nothing here knows a device. A
distributed engine (more than one rank) does not measure: every rank would
have to run each probe forward together, so it takes
``DEFAULT_MAX_NUM_BATCHED_TOKENS`` (the plan says so). The choice logic
(``choose_budget``) and the measurement loop (``measure_curve``) take plain
values and an injectable clock, so tests give them made-up curves.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from plinth.engine.config import AUTO, DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig

log = logging.getLogger("plinth.step_plan")

#: prefill sizes probed, smallest first
CANDIDATE_TOKENS = (32, 64, 128, 256, 512, 1024, 2048)
#: "within a few % of the best": the cost per token counted as saturated
SATURATION_TOLERANCE = 0.05
#: longest step (seconds) a prefill chunk may make: every running stream's
#: next token waits for it. 0.25 s cost 20-30% of prefill throughput on
#: 2-core CPUs (a 128-token prompt in two 64-token steps took 346 ms where one
#: step took 277 on an AVX2-only EPYC, and lost its TTFT to vLLM's CPU build;
#: four 128-token chunks of a 512-token prompt 590 ms against 452 for one on
#: an AVX-512 one); half a second is what the unmeasured default's 512 tokens
#: take on two cores
STEP_LATENCY_BOUND_S = 0.5
#: wall time the probes may take in all (seconds; warm-up forwards included):
#: enough to reach a size over the latency bound on a 2-core AVX2 CPU (2 s
#: stopped before 128 tokens there, and the choice moved between starts)
MEASURE_TIME_BUDGET_S = 4.0
#: timed forwards per size (after one untimed warm-up); the fastest counts,
#: as the one least disturbed by other work on the machine
REPEATS = 2


@dataclass
class StepPlan:
    """The token budget of a step and where it came from."""

    max_num_batched_tokens: int
    #: "measured", "explicit" (an integer was given) or "default" (not measured: why in ``reason``)
    source: str
    reason: str
    #: (tokens, seconds of the fastest timed forward) per probed size
    curve: list[tuple[int, float]] = field(default_factory=list)
    #: wall seconds the measurement took (warm-ups included)
    measure_s: float = 0.0

    def describe(self) -> dict[str, Any]:
        return {
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "source": self.source,
            "reason": self.reason,
            "curve": [
                {"tokens": n, "step_ms": round(t * 1e3, 3), "us_per_token": round(t / n * 1e6, 2)}
                for n, t in self.curve
            ],
            "measure_s": round(self.measure_s, 3),
        }

    def log_line(self) -> str:
        points = ", ".join(f"{n}:{t * 1e3:.1f}ms" for n, t in self.curve)
        text = f"step budget {self.max_num_batched_tokens} tokens ({self.source}: {self.reason})"
        if self.curve:
            text += f"; prefill step times {points}; measured in {self.measure_s:.2f} s"
        return text


def choose_budget(
    curve: Sequence[tuple[int, float]],
    *,
    tolerance: float = SATURATION_TOLERANCE,
    latency_bound: float = STEP_LATENCY_BOUND_S,
    decodes: int = 0,
) -> tuple[int, str]:
    """(budget, why) from a measured curve of (tokens, seconds per step):
    a prompt chunk of a probed size plus ``decodes`` tokens for a full
    batch of running streams. A step's time is taken as the chunk's cost
    per token times all its tokens (a decode row costs about a prompt row)."""
    if not curve:
        raise ValueError("no measurements to choose from")
    points = sorted(curve)
    within = [(n, t) for n, t in points if t * (n + decodes) / n <= latency_bound]
    if not within:
        n, t = points[0]
        pick, why = n, f"even {n} tokens take {t * 1e3:.0f} ms, over the {latency_bound * 1e3:.0f} ms step bound"
    else:
        best = min(t / n for n, t in within)
        pick = next(n for n, t in within if t / n <= best * (1 + tolerance))
        largest = within[-1][0]
        if pick < largest or len(within) < len(points):
            why = f"cost per token within {tolerance:.0%} of the best ({best * 1e6:.1f} us)"
            if len(within) < len(points):
                why += f", steps under {latency_bound * 1e3:.0f} ms"
        else:
            why = f"the largest size probed, cost per token {best * 1e6:.1f} us"
    if decodes:
        why = f"a {pick}-token prompt chunk ({why}) plus {decodes} for max_num_seqs decodes"
    return pick + decodes, why


def measure_curve(
    forward: Callable[[int], None],
    sizes: Sequence[int],
    *,
    clock: Callable[[], float] = time.perf_counter,
    repeats: int = REPEATS,
    time_budget: float = MEASURE_TIME_BUDGET_S,
    latency_bound: float = STEP_LATENCY_BOUND_S,
    tolerance: float = SATURATION_TOLERANCE,
) -> tuple[list[tuple[int, float]], float]:
    """Time ``forward(n)`` for each size (one warm-up, then the fastest of
    ``repeats``), smallest first; stop at the first size over
    ``latency_bound``, after two sizes in a row that do not lower the best
    cost per token by more than ``tolerance``, or before a size whose
    predicted cost (linear in tokens from the last one) would pass
    ``time_budget``. A warm-up's time beyond the forward's own (kernels built
    or autotuned at their first call: the triton backend tunes its MoE
    kernels for seconds) is neither a timing nor charged to the budget. A
    warm-up over half the budget is timed once more: a second call as slow
    counts alone (no time for repeats), a fast one was the first call's cost.
    Returns the curve and the seconds spent (first calls included)."""
    start = clock()
    first_calls = 0.0  # warm-up time past the forward's own: compiling, autotuning
    curve: list[tuple[int, float]] = []
    best = float("inf")
    flat = 0

    def timed(n: int) -> float:
        t0 = clock()
        forward(n)
        return clock() - t0

    for n in sorted(sizes):
        if curve:
            last_n, last_t = curve[-1]
            predicted = (1 + repeats) * last_t * n / last_n
            if clock() - start - first_calls + predicted > time_budget:
                break
        warm = timed(n)  # warm-up: first calls at a shape build kernels and caches
        times = []
        if warm > time_budget / 2:
            times.append(timed(n))
            if times[0] > time_budget / 2:  # the forward itself is that slow: no time for repeats
                first_calls += max(0.0, warm - times[0])
                curve.append((n, times[0]))
                break
        times += [timed(n) for _ in range(repeats - len(times))]
        t = min(times)
        first_calls += max(0.0, warm - t)
        curve.append((n, t))
        if t > latency_bound:
            break
        per_token = t / n
        if per_token < best * (1 - tolerance):
            flat = 0
        else:
            flat += 1
        best = min(best, per_token)
        if flat >= 2:
            break
    return curve, clock() - start


def probe_sizes(max_model_len: int, pool_tokens: int, candidates: Sequence[int] = CANDIDATE_TOKENS) -> list[int]:
    """Candidate sizes one sequence can prefill: under the context length
    and what the KV pool holds (the smallest candidate, cut to fit, when
    none fits)."""
    limit = max(1, min(max_model_len - 1, pool_tokens))
    sizes = [n for n in candidates if n <= limit]
    return sizes or [min(min(candidates), limit)]


def prefill_forward(runner: Any, kv: Any) -> Callable[[int], None]:
    """``forward(n)``: the runner's forward of one ``n``-token prompt, in
    pages the KV-cache manager lends and takes back (never hashed into the
    prefix cache: nothing is marked computed)."""
    from plinth.engine.sampling_params import SamplingParams
    from plinth.engine.scheduler import ScheduledBatch
    from plinth.engine.sequence import Request, Sequence

    def forward(n: int) -> None:
        ids = [(7 * i + 1) % 100 for i in range(n)]  # ordinary token ids, inside any vocabulary
        seq = Sequence(Request("step-plan", None, ids, SamplingParams(max_tokens=1)), 0, list(ids))
        if not kv.allocate_slots(seq, n):
            raise RuntimeError(f"the KV pool cannot hold a {n}-token probe")
        try:
            batch = ScheduledBatch(seqs=[seq], num_tokens=[n], block_tables=[kv.block_table(seq)])
            runner.execute(batch, [n - 1]).cpu()  # logits to the host: the forward has finished
        finally:
            kv.free(seq)

    return forward


def decode_forward(runner: Any, kv: Any) -> Callable[[int], None]:
    """``forward(n)``: the runner's forward of ``n`` one-token sequences, a
    decode-only step's shape (the MoE layers take their decode path: DeepEP's
    low-latency kernels, the "padded" layout), in lent pages."""
    from plinth.engine.sampling_params import SamplingParams
    from plinth.engine.scheduler import ScheduledBatch
    from plinth.engine.sequence import Request, Sequence

    def forward(n: int) -> None:
        seqs = [Sequence(Request(f"decode-plan-{i}", None, [1 + i % 97], SamplingParams(max_tokens=1)), 0, [1 + i % 97]) for i in range(n)]
        held = []
        try:
            for seq in seqs:
                if not kv.allocate_slots(seq, 1):
                    raise RuntimeError(f"the KV pool cannot hold a {n}-sequence decode probe")
                held.append(seq)
            batch = ScheduledBatch(seqs=seqs, num_tokens=[1] * n, block_tables=[kv.block_table(s) for s in seqs])
            runner.execute(batch, [0] * n).cpu()
        finally:
            for seq in held:
                kv.free(seq)

    return forward


def plan_step(
    config: EngineConfig,
    *,
    runner: Any = None,
    kv: Any = None,
    max_model_len: int,
    distributed: bool = False,
    forward: Callable[[int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> StepPlan:
    """The step plan of an engine: the explicit budget, or one measured with
    the loaded model (``forward`` overrides the probe, for tests)."""
    given = config.scheduler.max_num_batched_tokens
    if given != AUTO:
        return StepPlan(int(given), "explicit", "--max-num-batched-tokens")
    decodes = config.scheduler.max_num_seqs * (1 + config.speculative.k)
    if distributed:
        budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, decodes)
        return StepPlan(budget, "default", "not measured with more than one rank (every rank would run each probe)")
    pool_tokens = kv.num_pages * kv.page_size - kv.page_size  # a page to spare
    sizes = probe_sizes(max_model_len, pool_tokens)
    curve, spent = measure_curve(forward or prefill_forward(runner, kv), sizes, clock=clock)
    budget, why = choose_budget(curve, decodes=decodes)
    return StepPlan(budget, "measured", why, curve, spent)
