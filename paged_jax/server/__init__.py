"""The OpenAI-compatible server: `python -m paged_jax serve` (FastAPI + uvicorn).

make_server(llm, ...) wires an LLM's engine to the HTTP app: the AsyncEngine steps the engine
on its own thread, app.py turns requests into engine requests and streams their tokens back,
metrics.py keeps the Prometheus metrics.
"""

from __future__ import annotations

import socket

import uvicorn

from paged_jax.server.app import build_app
from paged_jax.server.engine_loop import AsyncEngine
from paged_jax.server.metrics import ServerMetrics


class PagedJaxServer:
    """A uvicorn server over an LLM; run() blocks until stop() (or a signal in the main thread).

    Attributes:
      app: the FastAPI app; engine: the AsyncEngine; metrics: the ServerMetrics.
    """

    def __init__(self, llm, *, host: str = "127.0.0.1", port: int = 8000, model_name: str = "tiny",
                 api_key: str | None = None, max_waiting_requests: int = 256, chat_template: str | None = None,
                 log_level: str = "warning"):
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests={max_waiting_requests} must be >= 0")
        engine = getattr(llm, "engine", llm)  # an LLM or an LLMEngine
        self.metrics = ServerMetrics(model_name)
        self.engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests, metrics=self.metrics)

        def chat_prompt(messages, add_generation_prompt, params):
            return engine.chat_prompt(messages, add_generation_prompt=add_generation_prompt,
                                      chat_template=chat_template, sampling_params=params)

        self.app = build_app(self.engine, engine.tokenizer, model_name=model_name,
                             max_model_len=engine.cache_config.max_model_len, chat_prompt=chat_prompt,
                             api_key=api_key, metrics=self.metrics)
        self.host, self.port = host, port
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                                     lifespan="off"))

    @property
    def started(self) -> bool:
        return self._server.started

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """Serves until stop(); the engine thread runs exactly as long."""
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
