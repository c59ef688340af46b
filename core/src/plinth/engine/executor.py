"""The executor: what runs a scheduled step's forward and samples its rows,
on however many ranks hold the model.

``LLMEngine`` steps over one ``Executor`` and never learns how many ranks
exist (vLLM v1's ``Executor``: ``UniProcExecutor``, ``MultiprocExecutor``):

* ``LocalExecutor``: the model runner of this process;
* ``plinth.engine.multiproc.MultiprocExecutor``: one dp group of a
  torch.distributed world, whose step every rank runs together (rank 0 is
  this process; a dp group's own rank samples its rows).

``execute`` returns the sampled tokens (and logprobs); ``logits`` too where
they stay in this process (speculative verification reads them). A failure
that stops the executor for good (a dead rank) is ``failure``, raised by
``check`` and by every later ``execute``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from plinth.engine.interfaces import CLOSE_TIMEOUT_S
from plinth.engine.model_runner import ModelRunner
from plinth.engine.sampler import SampleJob, Sampler, SampleResult
from plinth.engine.scheduler import ScheduledBatch


@dataclass
class ExecuteOutput:
    """One step's result."""

    sampled: SampleResult
    #: the logits rows the step asked for, where they stay in this process
    #: (None where another rank sampled them: only ids and logprobs came back)
    logits: torch.Tensor | None = None


class Executor(abc.ABC):
    """Runs steps of one scheduler (one dp group) on the ranks that hold the model."""

    @abc.abstractmethod
    def execute(self, batch: ScheduledBatch, logit_rows: Sequence[int], job: SampleJob) -> ExecuteOutput:
        """Forward ``batch``, compute the logits of ``logit_rows`` and run
        ``job`` on them (its rows index into those logits)."""

    @abc.abstractmethod
    def copy_pages(self, src: Sequence[Sequence[int]], dst: Sequence[Sequence[int]]) -> None:
        """Copy whole pages src[g][i] -> dst[g][i] in KV-cache group g's layers
        (before the next forward reads them)."""

    @property
    def failure(self) -> BaseException | None:
        """What stopped this executor for good (``DeadRankError``), or None."""
        return None

    def check(self) -> None:
        """Raise ``failure`` when there is one."""
        if self.failure is not None:
            raise self.failure

    @property
    def last_hidden(self) -> torch.Tensor | None:
        """The hidden states of the last step's logits rows, where they stay
        in this process and were asked for (proposers reading the target's)."""
        return None

    def describe(self) -> dict[str, Any]:
        """What the executor adds to the engine's description (its ranks)."""
        return {}

    def stats(self) -> dict[str, Any]:
        """Counters the executor adds to the engine's."""
        return {}

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:  # noqa: B027 - most hold nothing to release
        """Release what the executor holds (ranks, process groups); idempotent."""


class LocalExecutor(Executor):
    """The model runner of this process, and its sampler."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.sampler = Sampler()

    def execute(self, batch: ScheduledBatch, logit_rows: Sequence[int], job: SampleJob) -> ExecuteOutput:
        logits = self.runner.execute(batch, logit_rows)
        return ExecuteOutput(job.run(logits, self.sampler), logits)

    def copy_pages(self, src: Sequence[Sequence[int]], dst: Sequence[Sequence[int]]) -> None:
        self.runner.copy_pages(src, dst)

    @property
    def last_hidden(self) -> torch.Tensor | None:
        return self.runner.last_hidden
