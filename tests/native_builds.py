"""The native kernels' builds the tests run beside this machine's own (-march=native): the
loops a CPU without AVX-512 runs, AVX2's where it has them, else the portable ones, built with
the rest turned off and registered under names of their own. One table for every kernel's
tests (quant_matmul, row_stats, cpu_attention, decoder_layer), so a new build is added once."""

from __future__ import annotations

import pytest

BUILDS = {"avx2": ("-mno-avx512f",), "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}


def register(kernel, build: str, name: str) -> str:
    """kernel (a cpu_kernels module with build_and_register) built as BUILDS[build] and
    registered now; returns its name prefix (pj_test_<build>_<name>). pytest.skip where this
    CPU cannot run the build (the AVX2 one without AVX2; the portable loops run anywhere)."""
    if build == "avx2" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    prefix = f"pj_test_{build}_{name}"
    assert kernel.build_and_register(BUILDS[build], prefix=prefix)
    return prefix
