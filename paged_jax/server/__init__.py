"""The OpenAI-compatible server: `python -m paged_jax serve` (FastAPI + uvicorn).

make_server(llm_or_config, ...) wires an engine to the HTTP app: the engine loop runs on a
thread of this process for an LLM / LLMEngine object, or in a process of its own for an
EngineConfig (engine_core.py; what `serve` does); AsyncEngine (engine_loop.py) streams its
tokens to the requests, app.py turns requests into engine requests and tokens into text,
metrics.py keeps the Prometheus metrics.

A server never sits broken: when its engine dies (an engine process killed by the
out-of-memory killer), every open request fails with the reason, and the server either
stops (run() raises EngineProcessError: a supervisor such as systemd or Kubernetes restarts
the whole server) or, with restart_engine, starts a fresh engine process and serves again.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading

import uvicorn

from paged_jax.server.app import build_app
from paged_jax.server.engine_core import EngineProcessError, ProcessCore
from paged_jax.server.engine_loop import AsyncEngine, ThreadCore
from paged_jax.server.metrics import ServerMetrics
from paged_jax.server.middleware import MAX_BODY_BYTES

log = logging.getLogger(__name__)

# Seconds the server answers 503 after its engine died before it closes its port: the open
# responses end with their error, and a load balancer's health check sees the failure,
# rather than connections refused mid-request.
DRAIN_SECONDS = 3.0


class PagedJaxServer:
    """A uvicorn server over an engine; run() blocks until stop() (or a signal in the main thread).

    Args:
      llm: an LLM or an EngineClient (LLMEngine, DataParallelEngine: its loop runs on a thread
        here, and the engine stays its owner's to shut down), or an EngineConfig (the engine is
        built and run in a process of its own, this one importing no jax; construction returns
        once it is ready, `progress(done, total)` following its bucket compilation).
      reserved_cpus: with an EngineConfig, the cores its process leaves to this one on the CPU
        backend (None: 1 on machines of 4 cores or more; server/engine_core.py says why).
      restart_engine: with an EngineConfig, when the engine process dies, fail its requests
        and start a new one (503 and /health 503 while it warms up) instead of stopping.
      max_body_bytes: request bodies larger than this get HTTP 413 (app.py).
    Attributes:
      app: the FastAPI app; engine: the AsyncEngine; metrics: the ServerMetrics.
    """

    def __init__(self, llm, *, host: str = "127.0.0.1", port: int = 8000, model_name: str = "tiny",
                 api_key: str | None = None, max_waiting_requests: int = 256, chat_template: str | None = None,
                 log_level: str = "warning", progress=None, reserved_cpus: int | None = None,
                 restart_engine: bool = False, max_body_bytes: int = MAX_BODY_BYTES):
        from paged_jax.chat import chat_prompt
        from paged_jax.engine_client import EngineClient
        from paged_jax.engine_config import EngineConfig

        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests={max_waiting_requests} must be >= 0")
        if isinstance(llm, EngineConfig):
            # The engine process sends its tokenizer: this process loads no model code (no jax).
            self._new_core = functools.partial(ProcessCore, llm, progress=progress, reserved_cpus=reserved_cpus)
            core = self._new_core()
            tokenizer, max_model_len, eos_token_ids = core.tokenizer, core.max_model_len, core.eos_token_ids
        else:
            for name, value, default in (("reserved_cpus", reserved_cpus, None),
                                         ("restart_engine", restart_engine, False)):
                if value != default:
                    raise ValueError(f"{name} applies to an engine process of its own: pass an EngineConfig, "
                                     "not an LLM object (whose engine shares this process)")
            engine = llm if isinstance(llm, EngineClient) else llm.engine  # an engine, or an LLM
            self._new_core = None
            core = ThreadCore(engine)
            tokenizer, max_model_len, eos_token_ids = engine.tokenizer, engine.max_model_len, engine.eos_token_ids
        self.restart_engine = restart_engine
        self._exit_error: EngineProcessError | None = None  # why run() stopped serving, if not stop()
        self.metrics = ServerMetrics(model_name)
        self.metrics.reserved_cpus.set_function(lambda: getattr(self.engine.core, "reserved", 0))
        self.engine = AsyncEngine(core, max_waiting_requests=max_waiting_requests, metrics=self.metrics,
                                  on_core_exit=self._on_engine_exit)
        render = functools.partial(chat_prompt, tokenizer, eos_token_ids, chat_template=chat_template)

        def chat(messages, add_generation_prompt, params, tools=None):
            return render(messages, add_generation_prompt=add_generation_prompt, sampling_params=params, tools=tools)

        self.app = build_app(self.engine, tokenizer, model_name=model_name, max_model_len=max_model_len,
                             chat_prompt=chat, api_key=api_key, metrics=self.metrics, max_body_bytes=max_body_bytes)
        self.host, self.port = host, port
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                                     lifespan="off"))

    @property
    def started(self) -> bool:
        return self._server.started

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """Serves until stop(); the engine runs exactly as long.

        Raises EngineProcessError when serving stopped because the engine died (without
        restart_engine), or a new engine process failed to start."""
        self.engine.start()
        try:
            self._server.run(sockets=sockets)
        finally:
            self.engine.shutdown()
        if self._exit_error is not None:
            raise self._exit_error

    def stop(self) -> None:
        self._server.should_exit = True

    # the engine died (called on the core's thread, its requests already failed)
    def _on_engine_exit(self, core, message: str) -> None:
        if not self.restart_engine:
            hint = "" if self._new_core is None else " (serve --restart-engine starts a new engine process instead)"
            self._exit_error = EngineProcessError(f"{message}; the server stopped{hint}")
            drained = threading.Timer(DRAIN_SECONDS, self.stop)
            drained.daemon = True  # a server stopped meanwhile exits without waiting for it
            drained.start()
            return
        log.warning("paged-jax: %s; starting a new engine process (--restart-engine)", message)
        threading.Thread(target=self._restart, name="paged-jax-engine-restart", daemon=True).start()

    def _restart(self) -> None:
        try:
            core = self._new_core()  # warms up from the compile cache the first one filled
        except Exception as error:  # what ProcessCore raises, or no process at all (OSError): stop, not sit broken
            self._exit_error = EngineProcessError(f"the engine process died and a new one failed to start: "
                                                  f"{type(error).__name__}: {error}")
            self.stop()
            return
        if self.engine.replace_core(core):  # False: the server stopped meanwhile
            self.metrics.engine_restarts.inc()
            log.warning("paged-jax: a new engine process (pid %d) serves", core.pid)


def make_server(llm, **kwargs) -> PagedJaxServer:
    """A PagedJaxServer for `llm` (see PagedJaxServer for the options)."""
    return PagedJaxServer(llm, **kwargs)


__all__ = ["EngineProcessError", "PagedJaxServer", "make_server"]
