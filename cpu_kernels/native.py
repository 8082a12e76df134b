"""Building the native CPU kernels (XLA FFI custom calls) and registering them with XLA.

The kernels (SOURCES, C++ files in this package) are compiled into one shared library with the
machine's compiler on first use (`-O3 -march=native`), so they share one team of helper
threads (thread_team.h), and cached under ~/.cache/paged-jax/native (PAGED_JAX_CACHE moves it),
keyed by the sources and the headers they include, the compiler and flags, jax's version and
the CPU's flags, so a cache shared by machines never mixes their builds. Each kernel's module
registers its own handlers from it. PAGED_JAX_NATIVE_KERNELS=0 turns every native kernel off
(the XLA paths serve).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import subprocess
import tempfile

import jax

__all__ = ["SOURCES", "build", "build_and_register", "enabled", "register"]

logger = logging.getLogger(__name__)
_DISABLE_ENV = "PAGED_JAX_NATIVE_KERNELS"
# One library: the kernels share thread_team.h's helpers (two teams would spin against each other).
SOURCES = ("quant_matmul.cc", "paged_attention.cc", "decoder_layer.cc", "row_stats.cc")


def enabled() -> bool:
    """Whether native kernels may be used here (x86-64, not turned off by the environment)."""
    return os.environ.get(_DISABLE_ENV, "1") != "0" and platform.machine() in ("x86_64", "AMD64")


def _flags(extra) -> list[str]:
    return ["-O3", "-march=native", "-fopenmp-simd", *extra, "-std=c++17", "-shared", "-fPIC", "-w",
            f"-I{jax.ffi.include_dir()}"]


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def build(extra_flags=()) -> str | None:
    """Path of the shared library of every SOURCES file, built with extra_flags now (or found in
    the cache); None, with a warning, when it cannot be built."""
    cxx = os.environ.get("CXX", "g++")
    here = os.path.dirname(os.path.abspath(__file__))
    sources = [os.path.join(here, name) for name in SOURCES]
    text = b""
    for source in sources:
        with open(source, "rb") as fh:
            text += fh.read()
    # The headers beside them that they include ("name.h"): a change to one is a change to them.
    for header in sorted(set(re.findall(rb'#include "([\w.]+\.h)"', text))):
        with open(os.path.join(here, header.decode()), "rb") as fh:
            text += fh.read()
    key = hashlib.sha256(b"\0".join([text, " ".join([cxx, *_flags(extra_flags)]).encode(), jax.__version__.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    cache_dir = os.path.join(os.path.expanduser(os.environ.get("PAGED_JAX_CACHE", "~/.cache/paged-jax")), "native")
    path = os.path.join(cache_dir, f"paged_jax_kernels-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        subprocess.run([cxx, *_flags(extra_flags), *sources, "-o", tmp], check=True, capture_output=True, timeout=600)
        os.replace(tmp, path)  # atomic: processes building at once each install a whole file
    except (OSError, subprocess.SubprocessError) as error:
        os.unlink(tmp)
        detail = getattr(error, "stderr", b"") or b""
        logger.warning("native CPU kernels not built (%s %s); their XLA paths serve, slower", error,
                       detail.decode(errors="replace")[-500:])
        return None
    return path


def build_and_register(extra_flags, targets: dict[str, str]) -> bool:
    """build(extra_flags), then register its handlers {target: symbol}; False (with build's
    warning) when the library cannot be built. Each kernel module names its own targets."""
    path = build(extra_flags)
    if path is None:
        return False
    register(path, targets)
    return True


def register(path: str, targets: dict[str, str]) -> None:
    """Registers the library's handler symbols as XLA CPU custom-call targets {target: symbol}."""
    library = ctypes.cdll.LoadLibrary(path)
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
