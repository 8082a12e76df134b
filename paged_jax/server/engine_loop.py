"""AsyncEngine: the LLMEngine stepping on one background thread, requests streamed to asyncio.

The engine is not thread-safe and its step blocks (a jitted call), so exactly one thread
owns it. HTTP handlers talk to that thread through an inbox (add / abort), and each request
gets its deltas back on its own asyncio.Queue (loop.call_soon_threadsafe). The thread
drains the inbox between steps, so an abort frees the request's blocks before the next
step, and sleeps when there is nothing to run.

No request is lost or answered twice: every added request ends with exactly one final
delta (finished, aborted or failed), and the HTTP layer aborts a request whose response
ended early (a client that disconnected, a stop string); an abort of a finished request is
a no-op.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import AsyncIterator

from paged_jax.core.request import SamplingParams


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one step added to one request."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: str | None  # "stop", "length", "abort"; None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None  # the engine failed this request (the server keeps serving)


class QueueFullError(Exception):
    """More requests are waiting than the server accepts (HTTP 503)."""


class _Stream:
    __slots__ = ("loop", "queue", "num_sent", "arrival", "last_token_time")

    def __init__(self, loop: asyncio.AbstractEventLoop, arrival: float):
        self.loop = loop
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.num_sent = 0
        self.arrival = arrival
        self.last_token_time: float | None = None



class AsyncEngine:
    """Serves an LLMEngine to asyncio code.

    Args:
      engine: the LLMEngine, owned by this object's thread from start() on.
      max_waiting_requests: requests queued beyond the running ones before new ones get
        QueueFullError (HTTP 503) instead of unbounded memory.
      metrics: optional object with on_step(stats), on_tokens(num_tokens, seconds, first) and
        on_finished(reason, num_tokens) (server/metrics.py).
    """

    def __init__(self, engine, *, max_waiting_requests: int = 256, metrics=None):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # the engine thread's only
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # this step's deltas, per loop
        self._num_pending = 0  # added and not finished; guarded by _lock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paged-jax-engine", daemon=True)
        self.stats: dict = engine.get_stats()

    # lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def num_unfinished(self) -> int:
        return self._num_pending

    # the handlers' side
    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[Delta]:
        """Adds a request; returns the iterator of its deltas, up to and including the final one.

        Raises ValueError (bad prompt or parameters, from the engine's own checks) or
        QueueFullError; once it returns, the request is in the engine. Closing the iterator
        early does not abort the request: call abort() (the HTTP layer does when its
        response ends).
        """
        with self._lock:
            # Added and unfinished, minus those in the running batch (len() of the engine
            # thread's list is an atomic read): the requests that wait, queued or in the inbox.
            num_waiting = self._num_pending - len(self.engine.scheduler.running)
            if num_waiting >= self.max_waiting_requests:
                raise QueueFullError(f"{num_waiting} requests are already waiting "
                                     f"(--max-waiting-requests {self.max_waiting_requests}); retry later")
            self._num_pending += 1
        stream = _Stream(asyncio.get_running_loop(), time.perf_counter())
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("add", request_id, prompt, params, stream, added))
        self._wake.set()
        try:
            await asyncio.wrap_future(added)  # ValueError from add_request surfaces here
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so it finds the request if it was added
            raise
        return self._deltas(stream)

    @staticmethod
    async def _deltas(stream: _Stream) -> AsyncIterator[Delta]:
        queue_ = stream.queue
        while True:
            delta = await queue_.get()
            # Under load the HTTP side falls behind the engine: what has piled up goes out as
            # one delta (one SSE chunk), so the per-chunk cost is paid once per catch-up.
            while not queue_.empty() and delta.finish_reason is None and delta.error is None:
                delta = _merge(delta, queue_.get_nowait())
            yield delta
            if delta.finish_reason is not None or delta.error is not None:
                return

    def abort(self, request_id: str) -> None:
        """Asks the engine thread to abort a request (a no-op if it already finished)."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # the engine thread
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            if self._drain_inbox():
                self._flush()
                self._publish_stats()  # aborts free blocks without a step
            if not engine.has_unfinished_requests():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as error:  # a bug or a device failure: fail what runs, keep serving
                self._fail_all(f"engine step failed: {type(error).__name__}: {error}")
                self._flush()
                continue
            now = time.perf_counter()
            for output in outputs:
                self._deliver(output, now)
            self._flush()
            self._publish_stats()
        self._fail_all("the server is shutting down")
        self._flush()

    def _put(self, stream: _Stream, delta: Delta) -> None:
        self._outbox.setdefault(stream.loop, []).append((stream.queue, delta))

    def _flush(self) -> None:
        """Hands this step's deltas to their event loops: one wake-up per loop per step, not one
        per request (each wake-up is a write to the loop's self-pipe)."""
        for loop, items in self._outbox.items():
            loop.call_soon_threadsafe(_put_all, items)
        self._outbox = {}

    def _publish_stats(self) -> None:
        self.stats = self.engine.get_stats()
        if self.metrics is not None:
            self.metrics.on_step(self.stats)

    def _drain_inbox(self) -> bool:
        """Applies queued adds and aborts; True if there were any."""
        any_item = False
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return any_item
            any_item = True
            if item[0] == "add":
                _, request_id, prompt, params, stream, added = item
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as error:
                    with self._lock:
                        self._num_pending -= 1
                    added.set_exception(error)
                    continue
                self._streams[request_id] = stream
                added.set_result(None)
            else:
                stream = self._streams.pop(item[1], None)
                if stream is not None and self.engine.abort_request(item[1]):
                    self._finish(stream, item[1], Delta((), None, "abort", 0, 0))

    def _deliver(self, output, now: float) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        completion = output.outputs[0]
        new_ids = tuple(completion.token_ids[stream.num_sent:])
        new_logprobs = None if completion.logprobs is None else tuple(completion.logprobs[stream.num_sent:])
        if new_ids:
            if self.metrics is not None:
                first = stream.last_token_time is None
                self.metrics.on_tokens(len(new_ids), now - (stream.arrival if first else stream.last_token_time), first)
            stream.last_token_time = now
        stream.num_sent = len(completion.token_ids)
        delta = Delta(new_ids, new_logprobs, completion.finish_reason, len(output.prompt_token_ids),
                      output.metrics.num_cached_tokens)
        if output.finished:
            self._finish(stream, output.request_id, delta)
        else:
            self._put(stream, delta)

    def _finish(self, stream: _Stream, request_id: str, delta: Delta) -> None:
        self._streams.pop(request_id, None)
        with self._lock:
            self._num_pending -= 1
        if self.metrics is not None:
            self.metrics.on_finished(delta.finish_reason or "error", stream.num_sent)
        self._put(stream, delta)

    def _fail_all(self, message: str) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            self._finish(stream, request_id, Delta((), None, None, 0, 0, error=message))


def _put_all(items) -> None:
    for queue_, delta in items:
        queue_.put_nowait(delta)


def _merge(a: Delta, b: Delta) -> Delta:
    """Two consecutive deltas of one request as one."""
    logprobs = None if a.logprobs is None or b.logprobs is None else a.logprobs + b.logprobs
    return dataclasses.replace(b, token_ids=a.token_ids + b.token_ids, logprobs=logprobs)
