"""The engine behind the server: one loop owns the LLMEngine, asyncio code streams from it.

Two parts, as in vLLM V1 (API server + EngineCore):
- EngineLoop owns the LLMEngine (not thread-safe; its step blocks in a jitted call). It
  takes commands (add, abort) from an inbox between steps, so an abort frees the request's
  blocks before the next step, and after each round (the commands, then one step) hands
  one Report (requests accepted or rejected, each request's new tokens, the engine's
  stats) to a callback. It sleeps when there is nothing to run.
- AsyncEngine is the asyncio side: add_request returns the request's delta iterator, and
  each Report is fanned out to the requests' asyncio queues with one event-loop wake-up
  per report, not one per request.

Between them sits a core (where the loop runs): ThreadCore runs it on a thread of this
process (an LLM object handed to the server); ProcessCore (engine_core.py) runs it in a
process of its own, so the engine's Python work and the HTTP work stop taking turns on one
interpreter lock.

No request is lost or answered twice: every added request ends with exactly one final
delta (finished, aborted or failed), and the HTTP layer aborts a request whose response
ended early (a client that disconnected, a stop string); an abort of a finished request is
a no-op. If the core itself ends (the engine process died), the open requests fail with
the core's account of how it ended, and the AsyncEngine's owner decides what follows
(PagedJaxServer stops, or starts a fresh core and hands it to replace_core).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

from paged_jax.core.request import SamplingParams


class Delta(NamedTuple):
    """What one step added to one request.

    A NamedTuple: the engine process builds one per running request per step and pickles
    them to the HTTP process, and a tuple is several times cheaper at both than a dataclass.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: str | None  # "stop", "length", "abort"; None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None  # the engine failed this request (the server keeps serving)
    kv_transfer_params: dict | None = None  # a producer's final delta: where to pull the prompt's KV

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Report(NamedTuple):
    """One round of the engine loop: the adds it applied, then one step's deltas."""

    accepted: tuple[str, ...]  # request ids now in the engine
    rejected: tuple[tuple[str, str], ...]  # (request id, the engine's ValueError message)
    deltas: tuple[tuple[str, Delta], ...]  # new tokens per request; a final delta ends it
    stats: dict  # LLMEngine.get_stats() after the round


class QueueFullError(Exception):
    """More requests are waiting than the server accepts, or no engine runs (HTTP 503)."""


class EngineLoop:
    """Runs an LLMEngine: commands in (submit, from any thread), Reports out (the report
    callback, called on the loop's own thread).

    Commands: ("add", request_id, prompt, SamplingParams) and ("abort", request_id).
    """

    def __init__(self, engine, report: Callable[[Report], None]):
        self.engine = engine
        self._report = report
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._num_sent: dict[str, int] = {}  # tokens reported so far, per live request

    def submit(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        """Until stop(): apply commands, step, report. A failing step fails what runs and the
        loop goes on serving."""
        engine = self.engine
        while not self._stop.is_set():
            accepted, rejected, deltas = self._drain_inbox()
            if not engine.has_unfinished_requests():
                if accepted or rejected or deltas:
                    self._report(Report(tuple(accepted), tuple(rejected), tuple(deltas), engine.get_stats()))
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as error:  # a bug or a device failure: fail what runs, keep serving
                deltas += self._fail_all(f"engine step failed: {type(error).__name__}: {error}")
            else:
                deltas += [self._delta(output) for output in outputs if output.request_id in self._num_sent]
            # One report a round: the adds it applied, then its step's tokens (one get_stats).
            self._report(Report(tuple(accepted), tuple(rejected), tuple(deltas), engine.get_stats()))
        deltas = self._fail_all("the server is shutting down")
        if deltas:
            self._report(Report((), (), tuple(deltas), engine.get_stats()))

    def _drain_inbox(self):
        accepted, rejected, deltas = [], [], []
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return accepted, rejected, deltas
            if command[0] == "add":
                _, request_id, prompt, params = command
                try:
                    self.engine.add_request(request_id, prompt, params)
                except ValueError as error:
                    rejected.append((request_id, str(error)))
                    continue
                self._num_sent[request_id] = 0
                accepted.append(request_id)
            elif self._num_sent.pop(command[1], None) is not None and self.engine.abort_request(command[1]):
                deltas.append((command[1], Delta((), None, "abort", 0, 0)))

    def _delta(self, output) -> tuple[str, Delta]:
        completion = output.outputs[0]
        sent = self._num_sent[output.request_id]
        new_logprobs = None if completion.logprobs is None else tuple(completion.logprobs[sent:])
        delta = Delta(tuple(completion.token_ids[sent:]), new_logprobs, completion.finish_reason,
                      len(output.prompt_token_ids), output.metrics.num_cached_tokens,
                      kv_transfer_params=output.kv_transfer_params)
        if output.finished:
            del self._num_sent[output.request_id]
        else:
            self._num_sent[output.request_id] = len(completion.token_ids)
        return output.request_id, delta

    def _fail_all(self, message: str) -> list[tuple[str, Delta]]:
        deltas = []
        for request_id in list(self._num_sent):
            self.engine.abort_request(request_id)
            deltas.append((request_id, Delta((), None, None, 0, 0, error=message)))
        self._num_sent.clear()
        return deltas


class ThreadCore:
    """The EngineLoop on a thread of this process (for an LLM or LLMEngine object)."""

    def __init__(self, engine):
        self.engine = engine
        self.stats: dict = engine.get_stats()
        self._loop: EngineLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, report: Callable[[Report], None], on_exit: Callable[[], None]) -> None:
        """Starts the loop's thread; on_exit runs when it ends, however it ends."""
        self._loop = EngineLoop(self.engine, report)

        def run() -> None:
            try:
                self._loop.run()
            finally:
                on_exit()

        self._thread = threading.Thread(target=run, name="paged-jax-engine", daemon=True)
        self._thread.start()

    def submit(self, command: tuple) -> None:
        self._loop.submit(command)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def describe_exit(self) -> str:
        return "the engine loop stopped"

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._loop is not None:
            self._loop.stop()
            self._thread.join(timeout)


class _Stream:
    __slots__ = ("loop", "queue", "added", "arrival", "num_sent", "last_token_time")

    def __init__(self, loop: asyncio.AbstractEventLoop, arrival: float):
        self.loop = loop
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.added: concurrent.futures.Future = concurrent.futures.Future()
        self.arrival = arrival
        self.num_sent = 0
        self.last_token_time: float | None = None


class AsyncEngine:
    """Serves an engine core to asyncio code.

    Args:
      core: a ThreadCore or a ProcessCore (start, submit, is_alive, describe_exit, shutdown, stats).
      max_waiting_requests: requests queued beyond the running ones before new ones get
        QueueFullError (HTTP 503) instead of unbounded memory.
      metrics: optional object with on_step(stats), on_tokens(num_tokens, seconds, first) and
        on_finished(reason, num_tokens) (server/metrics.py).
      on_core_exit: optional callable(core, message), called on the core's thread once its open
        requests have failed, when the core ended without shutdown() (the engine process died).
        While no core is alive, new requests get QueueFullError (503) and is_alive() is False.

    self.core is the core serving now; replace_core swaps in a fresh one after a death. A
    core's exit only ever fails the requests of that core: they are the ones in _streams,
    because a dead core takes no new ones and the next core starts with none.
    """

    def __init__(self, core, *, max_waiting_requests: int = 256, metrics=None,
                 on_core_exit: Callable[[object, str], None] | None = None):
        self.core = core
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.stats: dict = core.stats
        self._on_core_exit = on_core_exit
        self._closing = False  # shutdown() began: a core ending now is no death
        self._streams: dict[str, _Stream] = {}  # added and not finished; guarded by _lock
        self._lock = threading.Lock()

    # lifecycle
    def start(self) -> None:
        self._start_core(self.core)

    def replace_core(self, core) -> bool:
        """Serves from `core` (a fresh one, not started, after the last one died). False, and
        `core` shut down, if this engine is shutting down meanwhile."""
        with self._lock:
            assert not self.core.is_alive(), "replace_core is for a dead core: two would serve"
            if not self._closing:
                self.core, self.stats = core, core.stats
        if self.core is not core:
            core.shutdown()
            return False
        self._start_core(core)
        return True

    def _start_core(self, core) -> None:
        def exited() -> None:
            message = core.describe_exit()
            self._fail_all(message)
            if not self._closing and self._on_core_exit is not None:
                self._on_core_exit(core, message)

        core.start(self._on_report, exited)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:  # after this, replace_core swaps in no new core
            self._closing = True
            core = self.core
        core.shutdown(timeout)
        self._fail_all("the server is shutting down")  # what the core could not report any more

    def is_alive(self) -> bool:
        return self.core.is_alive()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    # the handlers' side
    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[Delta]:
        """Adds a request; returns the iterator of its deltas, up to and including the final one.

        Raises ValueError (bad prompt or parameters, from the engine's own checks) or
        QueueFullError; once it returns, the request is in the engine. Closing the iterator
        early does not abort the request: call abort() (the HTTP layer does when its
        response ends).
        """
        stream = _Stream(asyncio.get_running_loop(), time.perf_counter())
        with self._lock:
            core = self.core
            if not core.is_alive():
                raise QueueFullError("the engine is not running")
            # Added and unfinished, minus the running batch of the last report: the requests
            # that wait, queued in the engine or still on their way to it.
            num_waiting = len(self._streams) - self.stats.get("num_running_reqs", 0)
            if num_waiting >= self.max_waiting_requests:
                raise QueueFullError(f"{num_waiting} requests are already waiting "
                                     f"(--max-waiting-requests {self.max_waiting_requests}); retry later")
            self._streams[request_id] = stream
        core.submit(("add", request_id, prompt, params))
        try:
            await asyncio.wrap_future(stream.added)  # ValueError from the engine's checks surfaces here
        except asyncio.CancelledError:
            self.abort(request_id)  # submitted after the add, so it finds the request if it was added
            raise
        return self._deltas(stream)

    @staticmethod
    async def _deltas(stream: _Stream) -> AsyncIterator[Delta]:
        queue_ = stream.queue
        while True:
            delta = await queue_.get()
            # Under load the HTTP side falls behind the engine: what has piled up goes out as
            # one delta (one SSE chunk), so the per-chunk cost is paid once per catch-up.
            while not queue_.empty() and not delta.final:
                delta = _merge(delta, queue_.get_nowait())
            yield delta
            if delta.final:
                return

    def abort(self, request_id: str) -> None:
        """Asks the engine to abort a request (a no-op if it already finished).

        Every response aborts its request when it ends; one whose final delta has arrived is
        skipped here, so a finished request costs the engine no command. One that finished in
        the engine with its final delta still on the way gets an abort the engine ignores."""
        with self._lock:
            if request_id not in self._streams:
                return
        self.core.submit(("abort", request_id))

    # the core's side (its loop thread, or the thread reading the engine process)
    def _on_report(self, report: Report) -> None:
        now = time.perf_counter()
        outbox: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for request_id in report.accepted:
                self._streams[request_id].added.set_result(None)
            for request_id, message in report.rejected:
                self._streams.pop(request_id).added.set_exception(ValueError(message))
            for request_id, delta in report.deltas:
                stream = self._streams.get(request_id)
                if stream is not None:
                    self._account(stream, request_id, delta, now)
                    outbox.setdefault(stream.loop, []).append((stream.queue, delta))
            self.stats = report.stats
        # One wake-up per event loop per report, not one per request (each is a write to
        # the loop's self-pipe).
        for loop, items in outbox.items():
            loop.call_soon_threadsafe(_put_all, items)
        if self.metrics is not None:
            self.metrics.on_step(report.stats)

    def _account(self, stream: _Stream, request_id: str, delta: Delta, now: float) -> None:
        """Metrics of one delta; a final one ends the request (called under _lock)."""
        if delta.token_ids:
            if self.metrics is not None:
                first = stream.last_token_time is None
                since = now - (stream.arrival if first else stream.last_token_time)
                self.metrics.on_tokens(len(delta.token_ids), since, first)
            stream.last_token_time = now
            stream.num_sent += len(delta.token_ids)
        if delta.final:
            del self._streams[request_id]
            if self.metrics is not None:
                self.metrics.on_finished(delta.finish_reason or "error", stream.num_sent)

    def _fail_all(self, message: str) -> None:
        """Ends every request still open (the core is gone): their handlers see the error."""
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            if not stream.added.done():
                stream.added.set_exception(QueueFullError(message))
                continue
            try:
                stream.loop.call_soon_threadsafe(_put_all, [(stream.queue, Delta((), None, None, 0, 0, error=message))])
            except RuntimeError:  # its event loop has closed: nobody is listening
                pass


def _put_all(items) -> None:
    for queue_, delta in items:
        queue_.put_nowait(delta)


def _merge(a: Delta, b: Delta) -> Delta:
    """Two consecutive deltas of one request as one."""
    logprobs = None if a.logprobs is None or b.logprobs is None else a.logprobs + b.logprobs
    return b._replace(token_ids=a.token_ids + b.token_ids, logprobs=logprobs)
