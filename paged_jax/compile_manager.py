"""CompileManager: the compiled programs of every shape bucket, compiled ahead of time.

A bucket (token count T, sequence count S) is compiled once, smallest first: every bucket
before serving (warm_up), or the smallest now and the rest on a background thread while
steps run (start_warm_up). The serving thread never compiles while the thread runs: a step
whose bucket is not compiled yet runs in the smallest compiled bucket that fits
(choose_shape), or waits for its own, which the thread compiles next. At most one set of
programs per bucket is ever compiled, which num_compilations counts so a test can prove it.
jax's persistent compilation cache (paged_jax/compile_cache.py) makes a second process load
instead of compile.

Objects with background threads (this warm-up, the KV pool's zeroing) register with
track_background_work; at exit each finishes what is inside XLA and drops what has not
started, so the interpreter never stops under a running computation (which aborts it).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable

import jax

_BACKGROUND: weakref.WeakSet = weakref.WeakSet()

# Background warm-up compiles this one-sequence bucket in the foreground too, beside the
# smallest (a single decode's): a first prompt of up to 16 tokens then runs at once, padded
# up into it, instead of waiting ~2 s for its own bucket (scripts/bench_startup.py's
# "1st token after ready").
FIRST_PROMPT_TOKENS = 16


def track_background_work(obj) -> None:
    """Register an object whose stop() ends its background threads (called at exit)."""
    _BACKGROUND.add(obj)


@atexit.register
def stop_background_work() -> None:
    """Every tracked object stops its background work (the pool's zeroing, the bucket being
    compiled; buckets not started are dropped). Runs at exit; tests that count compilations
    call it first, so no other engine's thread compiles during theirs."""
    for obj in list(_BACKGROUND):
        obj.stop()


class CompileManager:
    """The programs of each bucket, compiled by `compile_fn` at most once.

    Args:
      shapes: every (T, S) a step can land in, smallest first (the warm-up order).
      compile_fn: (T, S) -> the bucket's programs (from shapes only: it runs on the warm-up
        thread and must not touch live, donated arrays).
      bucket_for: (num_tokens, num_seqs) -> the step's own (T, S)
        (paged_jax.core.config.SchedulerConfig.bucket_for).
    """

    def __init__(self, shapes: list[tuple[int, int]], compile_fn: Callable,
                 bucket_for: Callable[[int, int], tuple[int, int]]):
        self.shapes = list(shapes)
        self.bucket_for = bucket_for
        self._compile_fn = compile_fn
        self.num_compilations = 0  # buckets compiled
        self._programs: dict[tuple[int, int], object] = {}
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int]] = []  # shapes the warm-up thread compiles next, in order
        self._thread: threading.Thread | None = None
        self._warming_up = False  # the warm-up thread takes shapes from _queue (set under _cond)
        self._error: BaseException | None = None
        track_background_work(self)

    @property
    def num_compiled_shapes(self) -> int:
        return len(self._programs)

    def programs_for(self, shape: tuple[int, int]):
        """The compiled programs of a shape: ready, compiled by the warm-up thread next (this
        thread waits), or, with no warm-up thread running, compiled here."""
        with self._cond:
            if shape not in self._programs and self._warming_up:
                if shape in self._queue:
                    self._queue.remove(shape)
                self._queue.insert(0, shape)
                self._cond.notify_all()
                while shape not in self._programs and self._error is None and self._warming_up:
                    self._cond.wait()
                if self._error is not None:
                    raise RuntimeError("compiling a bucket on the warm-up thread failed") from self._error
            programs = self._programs.get(shape)
        if programs is None:
            programs = self._add(shape)
        return programs

    def _add(self, shape: tuple[int, int]):
        programs = self._compile_fn(*shape)
        with self._cond:
            if shape not in self._programs:
                self._programs[shape] = programs
                self.num_compilations += 1
            self._cond.notify_all()
            return self._programs[shape]

    def choose_shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The bucket (T, S) that runs a step of num_tokens tokens over num_seqs sequences: its
        own, the smallest that fits, once compiled; while the warm-up thread has yet to compile
        it, the smallest compiled bucket that fits (fewest tokens, then fewest sequences), else
        its own (the step waits for it). With no warm-up thread running (warm_up="none", or the
        thread is done) a step never pads up: its own bucket compiles on first use, or a
        decode would run in a prefill bucket forever. Always its own in a multi-process run:
        every process must run the same program."""
        t, s = self.bucket_for(num_tokens, num_seqs)
        with self._cond:
            if (t, s) in self._programs or not self._warming_up or jax.process_count() > 1:
                return t, s
            fitting = [shape for shape in self._programs if shape[0] >= num_tokens and shape[1] >= num_seqs]
        return min(fitting) if fitting else (t, s)

    def warm_up(self, progress=None) -> int:
        """Compiles every bucket now, smallest first (waiting for a running warm-up thread).

        Returns the number of shapes. `progress`, if given, is called after each.
        """
        for shape in self.shapes:
            self.programs_for(shape)
            if progress is not None:
                progress()
        return len(self.shapes)

    def start_warm_up(self, num_first: int = 1, progress=None) -> None:
        """Compiles the smallest num_first buckets now, and the bucket of a one-sequence step
        of FIRST_PROMPT_TOKENS tokens (a short prompt runs padded up into it while its own
        compiles, instead of waiting), and the others on a background thread, smallest
        first, while steps run. `progress`, if given, is called after each bucket, from
        either thread. wait_warm_up() joins the thread."""
        prompt_bucket = self.bucket_for(min(FIRST_PROMPT_TOKENS, self.shapes[-1][0]), 1)
        for shape in dict.fromkeys([*self.shapes[:num_first], prompt_bucket]):
            self.programs_for(shape)
            if progress is not None:
                progress()
        with self._cond:
            self._queue = [shape for shape in self.shapes if shape not in self._programs]
            if not self._queue or self._warming_up:
                return
            self._warming_up = True
            self._thread = threading.Thread(target=self._warm_up_thread, args=(progress,),
                                            name="paged-jax-warm-up", daemon=True)
            self._thread.start()

    def _warm_up_thread(self, progress) -> None:
        try:
            while True:
                with self._cond:
                    if not self._queue:
                        return
                    shape = self._queue.pop(0)
                    if shape in self._programs:
                        continue
                self._add(shape)
                if progress is not None:
                    progress()
        except BaseException as error:  # handed to the step waiting for a bucket
            with self._cond:
                self._error = error
            raise
        finally:
            # Cleared under the lock before waking waiters, so none waits on a finished thread.
            with self._cond:
                self._warming_up = False
                self._cond.notify_all()

    def wait_warm_up(self) -> None:
        """Returns once the warm-up thread (if any) has compiled every bucket."""
        thread = self._thread
        if thread is not None:
            thread.join()
        if self._error is not None:
            raise RuntimeError("compiling a bucket on the warm-up thread failed") from self._error

    def stop(self) -> None:
        """Drops the buckets not compiled yet and waits for the one being compiled."""
        with self._cond:
            self._queue.clear()
        thread = self._thread
        if thread is not None:
            thread.join()
