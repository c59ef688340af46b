"""The offline Python API: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Sequence, cast

from plinth.engine.config import AUTO, DEFAULT_DETERMINISTIC, EngineConfig
from plinth.engine.factory import build_engine
from plinth.engine.interfaces import CLOSE_TIMEOUT_S, EngineCore
from plinth.engine.outputs import RequestOutput
from plinth.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Load a model once, then generate for batches of prompts.

    ``model=None`` means the default model (SmolLM2-135M-Instruct, GGUF).
    Every prompt of a ``generate`` call is submitted at once, so they run
    with continuous batching. ``max_num_batched_tokens="auto"`` (the default)
    times the model at start-up to choose the step's token budget
    (``self.engine.components.step_plan``); an integer skips that.
    ``LLM`` is a context manager: leaving it calls ``close()``.
    ``deterministic=True``: batch-invariant ops, so each prompt's tokens do
    not depend on what else runs with it (docs/serving.md); None (the
    default): on where the chosen backend measured the mode within 5% of
    its default ops on this kind of machine (the start-up log says which).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        device: str = "auto",
        backend: str = "auto",
        dtype: str = "auto",
        dequantize: bool = False,
        page_size: int = 16,
        num_pages: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | str = AUTO,
        enable_prefix_caching: bool = True,
        tp: int = 1,
        ep: int = 1,
        a2a: str = "auto",
        dp: int | None = None,
        dist_timeout: float = 10.0,
        nnodes: int = 1,
        node_rank: int = 0,
        master_addr: str | None = None,
        master_port: int | None = None,
        kv_connector: str | None = None,
        kv_connector_config: Mapping[str, Any] | None = None,
        kv_events_config: Mapping[str, Any] | None = None,
        max_model_len: int | None = None,
        kv_cache_memory: float | None = None,
        gpu_memory_utilization: float = 0.9,
        plugin_options: Mapping[str, Any] | None = None,
        seed: int = 0,
        registry: Any = None,
        load_progress: bool = True,
        speculative_method: str | None = None,
        num_speculative_tokens: int | None = None,
        speculative_model: str | None = None,
        deterministic: bool | None = DEFAULT_DETERMINISTIC,
    ) -> None:
        self.config = EngineConfig(
            model=model,
            device=device,
            backend=backend,
            dtype=dtype,
            dequantize=dequantize,
            page_size=page_size,
            num_pages=num_pages,
            kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            tp=tp,
            ep=ep,
            a2a=a2a,
            dp=dp,
            dist_timeout=dist_timeout,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            kv_connector=kv_connector,
            kv_connector_config=kv_connector_config,
            kv_events_config=kv_events_config,
            plugin_options=dict(plugin_options or {}),
            seed=seed,
            load_progress=load_progress,
            speculative_method=speculative_method,
            num_speculative_tokens=num_speculative_tokens,
            speculative_model=speculative_model,
            deterministic=deterministic,
        )
        #: the ``EngineCore`` (``LLMEngine``, or ``DistributedEngine`` with more than one rank)
        self.engine: EngineCore = build_engine(self.config, registry)
        self._ids = itertools.count()

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
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
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
