"""jax's persistent compilation cache, turned on by the engine (EngineConfig.compile_cache_dir).

A second process that asks for the same buckets of the same model loads their executables
from disk instead of compiling them (scripts/bench_startup.py measures cold and warm).
EngineConfig.compile_cache_dir is one of:
- "auto" (the default): a cache the user already configured (JAX_COMPILATION_CACHE_DIR, or
  jax.config's jax_compilation_cache_dir) is used as they configured it; else the engine
  turns one on in default_compile_cache_dir();
- a directory: that one, explicitly. The setting is process-wide in jax, so a directory
  that differs from the one this process already caches in is a ValueError rather than
  silently sharing the other;
- None: jax's own setting is left alone (off unless the user turned it on).
Imports jax only when enabling.
"""

from __future__ import annotations

import os

# How the engine compiles its buckets (EngineConfig.warm_up): "background" compiles the
# smallest bucket before the engine is ready and the others on a thread while it serves (the
# serving thread never compiles); "full" every bucket before it is ready (servers that want
# no padded-up steps); "none" each bucket on the first step that needs it.
WARM_UP_MODES = ("background", "full", "none")

# Overrides the default directory (a shared or faster disk, a CI cache), without code.
COMPILE_CACHE_ENV = "PAGED_JAX_COMPILE_CACHE_DIR"

# EngineConfig.compile_cache_dir's default: defer to the user's cache, else ours (docstring).
# A directory really named "auto" is given as "./auto".
AUTO_COMPILE_CACHE = "auto"


def default_compile_cache_dir() -> str:
    """$PAGED_JAX_COMPILE_CACHE_DIR, else $XDG_CACHE_HOME/paged-jax/xla (~/.cache/paged-jax/xla)."""
    if os.environ.get(COMPILE_CACHE_ENV):
        return os.environ[COMPILE_CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "paged-jax", "xla")


def check_compile_cache_dir(path) -> None:
    """ValueError naming the fix unless path is None, "auto" or a usable directory name."""
    if path is None or path == AUTO_COMPILE_CACHE:
        return
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"compile_cache_dir={path!r} must be a directory path, or None to leave jax's "
                         "compilation cache off")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"compile_cache_dir={os.fspath(path)!r} is a file; give a directory (it is created "
                         "if missing), or None to turn the cache off")


# The persistent cache's size cap (least recently used programs go first).
COMPILE_CACHE_MAX_BYTES = 8 << 30


def enable_compile_cache(path, num_processes: int = 1) -> str | None:
    """Points jax's persistent compilation cache at `path` (see the module docstring for
    "auto" and None). Returns the directory compilations are cached in (None: off).

    A run of num_processes > 1 (jax.distributed) caches in a subdirectory of its own: jax's
    cache key does not tell a program compiled for a multi-process mesh from the same HLO
    compiled in one process, and a single-process run that read such an entry crashed while
    deserializing it."""
    if path is None:
        return None
    import jax

    if jax.config.jax_compilation_cache_max_size == -1:
        # With no size cap jax writes cache files in place and reads them unlocked: a program
        # read while the warm-up thread (or another process) is still writing the same key is
        # read truncated, and deserializing it crashed the process. A cap turns on jax's LRU
        # eviction and with it a file lock around every read and write.
        jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_MAX_BYTES)
    current = jax.config.jax_compilation_cache_dir
    if path == AUTO_COMPILE_CACHE:
        if current:
            return current  # the user's (or an earlier engine's) cache, with its thresholds
        path = default_compile_cache_dir()
    path = os.path.abspath(os.fspath(path))
    if num_processes > 1:
        path = os.path.join(path, f"{num_processes}-processes")
    if current and os.path.abspath(current) != path:
        raise ValueError(f"compile_cache_dir={path!r}, but this process already caches compilations in "
                         f"{current!r} (jax's setting is process-wide); pass that directory, 'auto' (the default: use "
                         "it) or None")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Every bucket, even a tiny model's sub-second one, is worth keeping.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
