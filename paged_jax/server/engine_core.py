"""ProcessCore: the engine loop in a process of its own, as vLLM V1's EngineCore.

The server process keeps HTTP, chat templates, detokenization and the requests' streams;
the engine process owns the model, the KV pool, the block manager and the scheduler, and
runs the same EngineLoop (engine_loop.py) a ThreadCore runs in-process. In one process the
engine's Python work (scheduling, batch building, dispatch) and the HTTP work take turns on
one interpreter lock, so every streamed chunk delays the next step; here they run at once.

Two one-way pipes connect them (multiprocessing, "spawn": the engine process imports jax
afresh and never inherits the server's threads):
- commands, server -> engine: ("add", request_id, prompt, SamplingParams), ("abort", request_id);
  a sender thread writes them, so an event loop never blocks on a full pipe;
- messages, engine -> server: ("progress", done, total) while buckets compile,
  ("ready", info) or ("failed", kind, message) once, then ("report", Report) per round.
The engine process stops when its command pipe closes (the server shut down or died), and
the server fails the open requests when the message pipe closes (the engine died).
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
from collections.abc import Callable

from paged_jax.server.engine_loop import EngineLoop, Report


class EngineProcessError(RuntimeError):
    """The engine process failed to start or exited."""


def _engine_main(config, commands, messages) -> None:
    """The engine process: build the LLMEngine, say ready, run the loop until commands close."""
    lock = threading.Lock()

    def send(message) -> None:  # the loop thread and the warm-up thread both send
        with lock:
            messages.send(message)

    try:
        from paged_jax.engine import LLMEngine

        engine = LLMEngine(config, warm_up_progress=lambda done, total: send(("progress", done, total)))
    except BaseException as error:  # handed to the server, which raises it in its own process
        send(("failed", "ValueError" if isinstance(error, ValueError) else type(error).__name__, str(error)))
        return
    send(("ready", {"max_model_len": engine.cache_config.max_model_len, "eos_token_ids": engine.eos_token_ids,
                    "stats": engine.get_stats()}))
    loop = EngineLoop(engine, lambda report: send(("report", report)))

    def read_commands() -> None:
        try:
            while True:
                loop.submit(commands.recv())
        except (EOFError, OSError):  # the server closed the pipe: stop
            loop.stop()

    threading.Thread(target=read_commands, name="paged-jax-commands", daemon=True).start()
    loop.run()
    engine.runner.stop_warm_up()


class ProcessCore:
    """Starts an engine process for an EngineConfig and waits until it is ready.

    Args:
      config: the EngineConfig (its warm_up mode decides how much compiles before ready).
      progress: optional callable(done, total) for the bucket compilation (called here while
        starting, and from the reader thread for buckets compiled in the background).
    Raises ValueError for a bad configuration (what LLMEngine raised, in the engine process),
    EngineProcessError if the process failed otherwise or exited.
    Attributes: max_model_len, eos_token_ids, stats (the engine's stats when it was ready; the
      AsyncEngine keeps the latest from each report).
    """

    def __init__(self, config, *, progress: Callable[[int, int], None] | None = None):
        context = multiprocessing.get_context("spawn")
        command_reader, self._commands = context.Pipe(duplex=False)
        self._messages, message_writer = context.Pipe(duplex=False)
        self._process = context.Process(target=_engine_main, args=(config, command_reader, message_writer),
                                        name="paged-jax-engine", daemon=True)
        self._process.start()
        command_reader.close()  # the engine process holds the other ends now
        message_writer.close()
        self._progress = progress
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._reader: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._exited = False
        while True:
            try:
                message = self._messages.recv()
            except EOFError:
                self._process.join(10)
                raise EngineProcessError(f"the engine process exited (code {self._process.exitcode}) "
                                         "before it was ready; its output above says why") from None
            if message[0] == "progress":
                self._on_progress(*message[1:])
            elif message[0] == "failed":
                self._process.join(10)
                _, kind, text = message
                raise (ValueError(text) if kind == "ValueError" else EngineProcessError(f"{kind}: {text}"))
            else:
                info = message[1]
                break
        self.max_model_len: int = info["max_model_len"]
        self.eos_token_ids: tuple[int, ...] = tuple(info["eos_token_ids"])
        self.stats: dict = info["stats"]

    def _on_progress(self, done: int, total: int) -> None:
        if self._progress is not None:
            self._progress(done, total)

    def start(self, report: Callable[[Report], None], on_exit: Callable[[], None]) -> None:
        """Starts the threads that send commands and read reports; on_exit runs once the
        engine process is gone (its message pipe closed)."""

        def read() -> None:
            try:
                while True:
                    message = self._messages.recv()
                    if message[0] == "report":
                        report(message[1])
                    elif message[0] == "progress":
                        self._on_progress(*message[1:])
            except (EOFError, OSError):
                pass
            finally:
                self._exited = True
                on_exit()

        def send() -> None:
            try:
                while (command := self._outbox.get()) is not None:
                    self._commands.send(command)
            except OSError:  # the engine process is gone; the reader fails the requests
                pass
            finally:
                self._commands.close()  # the engine process stops at end of file

        self._reader = threading.Thread(target=read, name="paged-jax-engine-reports", daemon=True)
        self._sender = threading.Thread(target=send, name="paged-jax-engine-commands", daemon=True)
        self._reader.start()
        self._sender.start()

    def submit(self, command: tuple) -> None:
        self._outbox.put(command)

    def is_alive(self) -> bool:
        return not self._exited and self._process.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Closes the command pipe (the engine fails what runs, reports it, and exits), waits
        for the process, and terminates it past the timeout."""
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join(timeout)
        else:
            self._commands.close()
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        self._messages.close()
