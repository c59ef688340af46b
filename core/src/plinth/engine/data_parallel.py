"""The dp front end: one ``LLMEngine`` (scheduler, KV pages) per dp group,
new requests to the least loaded, every group's step at once.

Each group's engine steps over its own ``MultiprocExecutor``; their steps
run on threads of their own and meet in the world's rounds
(``multiproc.StepRounds``), so one step of the world carries every group
that has work. The front end knows the groups, never the ranks.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from plinth.engine.engine import LLMEngine
from plinth.engine.interfaces import CLOSE_TIMEOUT_S, EngineCore
from plinth.engine.multiproc import RankWorld


class DataParallelEngine(EngineCore):
    """Rank 0's engine over dp groups: requests to the least loaded group,
    every group stepped at once."""

    def __init__(self, engines: list[LLMEngine], world: RankWorld) -> None:
        if world.rounds is None:
            raise ValueError("a data-parallel engine needs a world of more than one dp group")
        self.engines = engines
        self.world = world
        first = engines[0]
        self.tokenizer = first.tokenizer
        self.model_config = first.model_config
        self.max_model_len = first.max_model_len
        self.components = first.components
        self.owner: dict[str, int] = {}
        self._closed = False
        self._pool = ThreadPoolExecutor(len(engines), thread_name_prefix="plinth-dp")

    @property
    def requests(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for e in self.engines:
            out.update(e.requests)
        return out

    def validate(self, prompt_token_ids: Sequence[int], params: Any) -> None:
        self.engines[0].validate(prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: Any, *, prompt: str | None = None) -> Any:
        self.check()
        if request_id in self.owner:
            return self.engines[self.owner[request_id]].add_request(request_id, prompt_token_ids, params, prompt=prompt)
        d = min(range(len(self.engines)), key=lambda i: (len(self.engines[i].requests), i))
        req = self.engines[d].add_request(request_id, prompt_token_ids, params, prompt=prompt)
        self.owner[request_id] = d
        return req

    def abort_request(self, request_id: str) -> Any:
        d = self.owner.pop(request_id, None)
        return None if d is None else self.engines[d].abort_request(request_id)

    def has_unfinished(self) -> bool:
        # a failure is reported by the next step, even with nothing in flight
        return self.world.failure is not None or any(e.has_unfinished() for e in self.engines)

    def unfinished_request_ids(self) -> list[str]:
        return [rid for e in self.engines for rid in e.unfinished_request_ids()]

    def num_waiting(self) -> int:
        return sum(e.num_waiting() for e in self.engines)

    def describe(self) -> dict[str, Any]:
        return self.engines[0].describe()

    def kv_transfer(self) -> Any:
        return None  # launch.check_supported refuses a KV connector with more than one rank

    def stats(self) -> dict[str, Any]:
        total: dict[str, Any] = {}
        for e in self.engines:
            for k, v in e.stats().items():
                total[k] = total.get(k, 0) + v if isinstance(v, (int, float)) else v
        total["world"] = self.world.layout.world  # one world, not one per group
        return total

    def pages_held(self) -> int:
        return sum(e.pages_held() for e in self.engines)

    def check(self) -> None:
        if self.world.failure is not None:
            raise self.world.failure

    def step(self) -> list[Any]:
        """Each group's engine steps on its own thread; their forwards meet
        in the world's rounds, where groups with nothing to run do dummy forwards."""
        self.check()
        assert self.world.rounds is not None
        futures = [self._pool.submit(e.step) for e in self.engines]
        self.world.rounds.drive(futures)
        outputs: list[Any] = []
        errors = []
        for f in futures:
            try:
                outputs.extend(f.result())
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        if errors:
            raise self.world.failure or errors[0]
        for out in outputs:
            if out.finished:
                self.owner.pop(out.request_id, None)
        return outputs

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Take no new request, stop every rank, the watchdog and the dp threads."""
        if self._closed:
            return
        self._closed = True
        bound = time.monotonic() + timeout
        for e in self.engines:
            e.close(max(0.0, bound - time.monotonic()))
        self.world.close(max(0.0, bound - time.monotonic()))
        # its threads are idle unless a step hangs: joined up to the bound
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in threading.enumerate():
            if t.name.startswith("plinth-dp_"):
                t.join(max(0.0, bound - time.monotonic()))
