"""ProcessCore: the engine loop in a process of its own, as vLLM V1's EngineCore.

The server process keeps HTTP, chat templates, detokenization and the requests' streams, and
imports no jax (tests/test_server_imports.py): it gets its tokenizer from the engine process;
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
the server fails the open requests when the message pipe closes (the engine died: the
out-of-memory killer's SIGKILL, a crash in native code), naming the exit code or signal.

On the CPU backend the engine process can leave cores to the HTTP process (vLLM's
VLLM_CPU_NUM_OF_RESERVED_CPU), pinned before jax starts: XLA sizes its CPU thread pool by the
cores the process may use then, and a pool squeezed onto fewer cores later keeps its threads
and runs slower than one sized for them. Whether to leave one depends on the token rate.
XLA spreads every step over all cores, and when the HTTP work that wakes with each step's
tokens preempts one of those threads the whole step waits for it; but a core left to HTTP is
compute the engine lacks. On 2 cores at saturation (scripts/bench_serve.py; the figures are
in docs/BENCHMARKS.md section 11) a host-bound model serving thousands of tokens/s keeps the
HTTP process busy enough that reserving a core wins, and a compute-bound real model loses
more to the missing core than it gains. The default follows real models: one core reserved on machines of 4 or more (what vLLM's CPU
tuning guides recommend), none on smaller ones, where the engine needs every core for its
compute.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable

from paged_jax.server.engine_loop import EngineLoop, Report


def _dumps(message) -> bytes:
    # Connection.send would pickle with multiprocessing's ForkingPickler, which copies the
    # copyreg dispatch table on every call (a third of a report's cost); messages hold
    # plain data, no file descriptors or shared memory, so the stock pickler does.
    return pickle.dumps(message, pickle.HIGHEST_PROTOCOL)


class EngineProcessError(RuntimeError):
    """The engine process failed to start or exited."""


def default_reserved_cpus(num_cpus: int) -> int:
    """Cores the engine process leaves to the HTTP process by default (module docstring)."""
    return 1 if num_cpus >= 4 else 0


def check_reserved_cpus(reserved_cpus: int | None) -> None:
    """ValueError unless reserved_cpus is None or leaves the engine at least one core."""
    if reserved_cpus is None:
        return
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if reserved_cpus < 0 or 0 < allowed <= reserved_cpus:
        raise ValueError(f"reserved_cpus={reserved_cpus}: pass 0 to {allowed - 1} (cores left to the HTTP "
                         f"process; this process may use {allowed}), or None for the default")


def reserve_cpus(reserved_cpus: int | None) -> tuple[tuple[int, ...], int]:
    """Pins this process to all but `reserved_cpus` of its cores (None: the default) before
    jax starts its CPU client; on another backend the engine's compute is on the device and
    it keeps every core. Returns (the cores it may use, the cores it left). Called first thing
    in the engine process, before any thread of its own starts (threads inherit the affinity
    of the thread that starts them)."""
    check_reserved_cpus(reserved_cpus)
    if not hasattr(os, "sched_setaffinity"):  # no per-process affinity on this OS
        return (), 0
    allowed = sorted(os.sched_getaffinity(0))
    reserved = default_reserved_cpus(len(allowed)) if reserved_cpus is None else reserved_cpus
    if reserved:
        os.sched_setaffinity(0, allowed[:-reserved])
    import jax  # starts the backends, and the CPU client's thread pool, on that set

    if reserved and jax.default_backend() != "cpu":
        os.sched_setaffinity(0, allowed)
        reserved = 0
    return tuple(allowed[:len(allowed) - reserved]), reserved


def _engine_main(config, commands, messages, reserved_cpus) -> None:
    """The engine process: build the LLMEngine, say ready, run the loop until commands close."""
    lock = threading.Lock()

    def send(message) -> None:  # the loop thread and the warm-up thread both send
        with lock:
            messages.send_bytes(_dumps(message))

    try:
        cpus, reserved = reserve_cpus(reserved_cpus)
        from paged_jax.engine import LLMEngine

        engine = LLMEngine(config, warm_up_progress=lambda done, total: send(("progress", done, total)))
    except BaseException as error:  # handed to the server, which raises it in its own process
        send(("failed", "ValueError" if isinstance(error, ValueError) else type(error).__name__, str(error)))
        return
    send(("ready", {"max_model_len": engine.max_model_len, "eos_token_ids": engine.eos_token_ids,
                    "tokenizer": engine.tokenizer, "stats": engine.get_stats(), "cpus": cpus, "reserved": reserved}))
    loop = EngineLoop(engine, lambda report: send(("report", report)))

    def read_commands() -> None:
        try:
            while True:
                loop.submit(pickle.loads(commands.recv_bytes()))
        except (EOFError, OSError):  # the server closed the pipe: stop
            loop.stop()

    threading.Thread(target=read_commands, name="paged-jax-commands", daemon=True).start()
    loop.run()
    engine.shutdown()


class ProcessCore:
    """Starts an engine process for an EngineConfig and waits until it is ready.

    Args:
      config: the EngineConfig (its warm_up mode decides how much compiles before ready).
      progress: optional callable(done, total) for the bucket compilation (called here while
        starting, and from the reader thread for buckets compiled in the background).
      reserved_cpus: cores the engine process leaves to this one on the CPU backend (None:
        one on machines of 4 cores or more; the module's docstring says why).
    Raises ValueError for a bad configuration (what LLMEngine raised, in the engine process),
    EngineProcessError if the process failed otherwise or exited.
    Attributes: tokenizer, max_model_len, eos_token_ids, stats (the engine's stats when it was ready; the
      AsyncEngine keeps the latest from each report), cpus (the cores the engine process may
      use), reserved (the cores it left to this process), pid (the engine process's).
    """

    def __init__(self, config, *, progress: Callable[[int, int], None] | None = None,
                 reserved_cpus: int | None = None):
        check_reserved_cpus(reserved_cpus)  # here too, so a bad value fails before a process starts
        context = multiprocessing.get_context("spawn")
        command_reader, self._commands = context.Pipe(duplex=False)
        self._messages, message_writer = context.Pipe(duplex=False)
        self._process = context.Process(target=_engine_main,
                                        args=(config, command_reader, message_writer, reserved_cpus),
                                        name="paged-jax-engine", daemon=True)
        self._process.start()
        self.pid: int = self._process.pid
        command_reader.close()  # the engine process holds the other ends now
        message_writer.close()
        self._progress = progress
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._reader: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._exited = False
        while True:
            try:
                message = pickle.loads(self._messages.recv_bytes())
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
        self.tokenizer = info["tokenizer"]  # the engine's own, pickled (HF tokenizers pickle as JSON)
        self.max_model_len: int = info["max_model_len"]
        self.eos_token_ids: tuple[int, ...] = tuple(info["eos_token_ids"])
        self.stats: dict = info["stats"]
        self.cpus: tuple[int, ...] = tuple(info["cpus"])
        self.reserved: int = info["reserved"]

    def _on_progress(self, done: int, total: int) -> None:
        if self._progress is not None:
            self._progress(done, total)

    def start(self, report: Callable[[Report], None], on_exit: Callable[[], None]) -> None:
        """Starts the threads that send commands and read reports; on_exit runs once the
        engine process is gone (its message pipe closed)."""

        def read() -> None:
            try:
                while True:
                    message = pickle.loads(self._messages.recv_bytes())
                    if message[0] == "report":
                        report(message[1])
                    elif message[0] == "progress":
                        self._on_progress(*message[1:])
            except (EOFError, OSError):
                pass
            finally:
                self._exited = True
                self._process.join(5)  # the pipe closes as it dies: reap it, for describe_exit's code
                on_exit()

        def send() -> None:
            try:
                while (command := self._outbox.get()) is not None:
                    self._commands.send_bytes(_dumps(command))
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

    def describe_exit(self) -> str:
        """How the engine process ended, for the requests it failed and the server's log."""
        code = self._process.exitcode
        if code is None:
            how = "closed its pipe to the server"
        elif code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            how = f"was killed by {name}" + (" (the out-of-memory killer sends it)" if -code == signal.SIGKILL else "")
        else:
            how = f"exited with code {code}"
        return f"the engine process (pid {self.pid}) {how}"

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
