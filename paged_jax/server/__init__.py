"""The OpenAI-compatible server: `python -m paged_jax serve` (FastAPI + uvicorn).

make_server(llm_or_config, ...) wires an engine to the HTTP app: the engine loop runs on a
thread of this process for an LLM / LLMEngine object, or in a process of its own for an
EngineConfig (engine_core.py; what `serve` does); AsyncEngine (engine_loop.py) streams its
tokens to the requests, app.py turns requests into engine requests and tokens into text,
metrics.py keeps the Prometheus metrics.
"""

from __future__ import annotations

import functools
import socket

import uvicorn

from paged_jax.server.app import build_app
from paged_jax.server.engine_loop import AsyncEngine, ThreadCore
from paged_jax.server.metrics import ServerMetrics


class PagedJaxServer:
    """A uvicorn server over an engine; run() blocks until stop() (or a signal in the main thread).

    Args:
      llm: an LLM or an EngineClient (LLMEngine, DataParallelEngine: its loop runs on a thread
        here, and the engine stays its owner's to shut down), or an EngineConfig (the engine is
        built and run in a process of its own, this one importing no jax; construction returns
        once it is ready, `progress(done, total)` following its bucket compilation).
      reserved_cpus: with an EngineConfig, the cores its process leaves to this one on the CPU
        backend (None: 1 on machines of 4 cores or more; server/engine_core.py says why).
    Attributes:
      app: the FastAPI app; engine: the AsyncEngine; metrics: the ServerMetrics.
    """

    def __init__(self, llm, *, host: str = "127.0.0.1", port: int = 8000, model_name: str = "tiny",
                 api_key: str | None = None, max_waiting_requests: int = 256, chat_template: str | None = None,
                 log_level: str = "warning", progress=None, reserved_cpus: int | None = None):
        from paged_jax.chat import chat_prompt
        from paged_jax.engine_client import EngineClient
        from paged_jax.engine_config import EngineConfig

        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests={max_waiting_requests} must be >= 0")
        if isinstance(llm, EngineConfig):
            from paged_jax.server.engine_core import ProcessCore

            # The engine process sends its tokenizer: this process loads no model code (no jax).
            core = ProcessCore(llm, progress=progress, reserved_cpus=reserved_cpus)
            tokenizer, max_model_len, eos_token_ids = core.tokenizer, core.max_model_len, core.eos_token_ids
        else:
            if reserved_cpus is not None:
                raise ValueError("reserved_cpus applies to an engine process of its own: pass an EngineConfig, "
                                 "not an LLM object (whose engine shares this process)")
            engine = llm if isinstance(llm, EngineClient) else llm.engine  # an engine, or an LLM
            core = ThreadCore(engine)
            tokenizer, max_model_len, eos_token_ids = engine.tokenizer, engine.max_model_len, engine.eos_token_ids
        self.metrics = ServerMetrics(model_name)
        self.metrics.reserved_cpus.set_function(lambda: getattr(core, "reserved", 0))
        self.engine = AsyncEngine(core, max_waiting_requests=max_waiting_requests, metrics=self.metrics)
        render = functools.partial(chat_prompt, tokenizer, eos_token_ids, chat_template=chat_template)

        def chat(messages, add_generation_prompt, params, tools=None):
            return render(messages, add_generation_prompt=add_generation_prompt, sampling_params=params, tools=tools)

        self.app = build_app(self.engine, tokenizer, model_name=model_name, max_model_len=max_model_len,
                             chat_prompt=chat, api_key=api_key, metrics=self.metrics)
        self.host, self.port = host, port
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                                     lifespan="off"))

    @property
    def started(self) -> bool:
        return self._server.started

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """Serves until stop(); the engine runs exactly as long."""
        self.engine.start()
        try:
            self._server.run(sockets=sockets)
        finally:
            self.engine.shutdown()

    def stop(self) -> None:
        self._server.should_exit = True


def make_server(llm, **kwargs) -> PagedJaxServer:
    """A PagedJaxServer for `llm` (see PagedJaxServer for the options)."""
    return PagedJaxServer(llm, **kwargs)


__all__ = ["PagedJaxServer", "make_server"]
