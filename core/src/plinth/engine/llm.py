"""The offline Python API: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import inspect
import itertools
from typing import Any, Mapping, Sequence, cast

from plinth.api import ResolvedConfig
from plinth.engine.config import EngineConfig, default_of, iter_settings
from plinth.engine.factory import build_engine
from plinth.engine.interfaces import CLOSE_TIMEOUT_S, EngineCore
from plinth.engine.outputs import RequestOutput
from plinth.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Load a model once, then generate for batches of prompts.

    ``LLM(model=None, *, registry=None, **settings)``: ``model=None`` means
    the default model (SmolLM2-135M-Instruct, GGUF); ``settings`` are the
    engine's settings by name (``page_size=32, tp=2``: every field of
    ``plinth.engine.config``'s sections, the flags of ``platform serve``;
    ``inspect.signature(LLM)`` lists them with their defaults), and
    ``plugin_options`` (a dict) for plugins. A wrong name is a TypeError.
    Every prompt of a ``generate`` call is submitted at once, so they run
    with continuous batching. ``max_num_batched_tokens="auto"`` (the default)
    times the model at start-up to choose the step's token budget
    (``self.resolved.max_num_batched_tokens``); an integer skips that.
    ``deterministic=True``: batch-invariant ops, so each prompt's tokens do
    not depend on what else runs with it (docs/serving.md); unset: the
    chosen backend's word (the start-up log says which).
    ``LLM`` is a context manager: leaving it calls ``close()``; dropping
    the last reference to it frees what ``close()`` frees (worker ranks too).
    """

    def __init__(self, model: str | None = None, *, registry: Any = None, **settings: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **settings)
        #: the ``EngineCore`` (``LLMEngine``, or ``DataParallelEngine`` with more than one dp group)
        self.engine: EngineCore = build_engine(self.config, registry)
        self._ids = itertools.count()

    @property
    def resolved(self) -> ResolvedConfig:
        """What start-up settled: backend, dtype, deterministic mode, page
        size and pages, the step's token budget, the a2a plugin, the layout."""
        return self.engine.components.resolved

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Flush KV saves, stop the engine's threads and worker ranks (also
        done at exit for ranks). ``with LLM(...) as llm:`` calls it."""
        self.engine.close(timeout)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. Strings are tokenized with the
        model's tokenizer (BOS added as the model expects); lists of ints are
        used as they are."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch: list[Prompt] = [cast(Prompt, prompts)]  # one prompt
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(plist) != len(batch):
            raise ValueError("give one SamplingParams, or one per prompt")
        tok = self.engine.tokenizer
        ids = []
        for prompt, p in zip(batch, plist):
            rid = f"offline-{next(self._ids)}"
            if isinstance(prompt, str):
                self.engine.add_request(rid, tok.encode(prompt), p, prompt=prompt)
            else:
                self.engine.add_request(rid, list(prompt), p, prompt=None)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the model's chat
        template makes each a prompt."""
        convs = cast(
            "list[Sequence[Mapping[str, Any]]]", [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        )
        tok = self.engine.tokenizer
        prompts = []
        for conv in convs:
            text = tok.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt)
            prompts.append(tok.encode(text, add_special_tokens=False))
        outs = self.generate(prompts, params, use_tqdm=use_tqdm)
        for out, p in zip(outs, prompts):
            out.prompt = tok.decode(p, skip_special_tokens=False)
        return outs

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="generate", unit="req")
        wanted = set(request_ids)
        idle_steps = 0
        while len(done) < len(wanted):
            outputs = self.engine.step()
            # steps without output happen (chunks of a long prompt), but not this many
            idle_steps = 0 if outputs else idle_steps + 1
            if idle_steps > 1000:
                raise RuntimeError(f"the engine stopped making progress: {self.engine.stats()}")
            for out in outputs:
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[r] for r in request_ids]


def _signature() -> inspect.Signature:
    """``LLM(model=None, *, registry=None, <every setting>=<its default>, plugin_options=None)``,
    made from the settings' declarations."""
    params = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation="str | None"),
        inspect.Parameter("registry", inspect.Parameter.KEYWORD_ONLY, default=None),
    ]
    for _, f in iter_settings():
        if f.name != "model":
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default_of(f), annotation=f.type))
    params.append(inspect.Parameter("plugin_options", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Mapping[str, Any] | None"))
    return inspect.Signature(params, return_annotation=None)


LLM.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
