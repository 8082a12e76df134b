"""The native argmax + log-sum-exp (cpu_kernels/row_stats.cc) against XLA's reductions
(argmax_logsumexp_reference), on its AVX-512, AVX2 and portable loops."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import row_stats
from native_builds import BUILDS, register


@pytest.fixture(scope="module", autouse=True)
def _native_built():
    if shutil.which(os.environ.get("CXX", "g++")) is None or jax.default_backend() != "cpu":
        pytest.skip("no C++ compiler, or not a CPU backend: XLA's reductions serve")
    assert row_stats.native_available(), "the native CPU kernels did not build; see the warning logged"

LSE_TOL = 1e-5  # relative: the kernel's exp is a polynomial (rel. error < 2e-7) and its sum in another order


def _both(x, prefix="pj_argmax_logsumexp"):
    native = jax.jit(lambda a: row_stats.argmax_logsumexp(a, native=prefix))(x)
    reference = jax.jit(row_stats.argmax_logsumexp_reference)(x)
    return [np.asarray(a) for a in native], [np.asarray(a) for a in reference]


@pytest.fixture(scope="module", params=["native", *BUILDS])
def prefix(request):
    # native: this machine's loops (AVX-512 where it has them); avx2: the AVX2 machines' build;
    # portable: the scalar loops alone
    if request.param == "native":
        return "pj_argmax_logsumexp"
    return register(row_stats, request.param, "row_stats")


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (5, 1000), (3, 17), (2, 1), (64, 256)])
def test_random_rows_match_xla(prefix, rows, vocab):
    x = np.random.default_rng(vocab).standard_normal((rows, vocab)).astype(np.float32) * 8
    (argmax, lse), (ref_argmax, ref_lse) = _both(jnp.asarray(x), prefix)
    np.testing.assert_array_equal(argmax, ref_argmax)
    np.testing.assert_allclose(lse, ref_lse, rtol=LSE_TOL)


def test_ties_take_the_first_index_and_extremes_match(prefix):
    vocab = 100
    x = np.random.default_rng(0).standard_normal((6, vocab)).astype(np.float32)
    x[0, [7, 40, 99]] = 50.0       # a three-way tie: the first
    x[1, :] = -np.inf              # nothing finite: index 0, lse NaN (XLA's -inf - -inf)
    x[1, 3] = -np.inf
    x[2, 11] = np.nan              # a NaN: the last id, lse NaN
    x[3, :50] = -np.inf            # masked half (a grammar's): the max of the rest
    x[4, 20] = np.inf              # +inf: its index, lse NaN
    x[5, 33] = 1e30                # a huge logit: lse = itself
    (argmax, lse), (ref_argmax, ref_lse) = _both(jnp.asarray(x), prefix)
    np.testing.assert_array_equal(argmax, ref_argmax)
    assert list(argmax[:3]) == [7, 0, vocab - 1]
    np.testing.assert_allclose(lse, ref_lse, rtol=LSE_TOL)  # NaNs where XLA has them
    assert np.isnan(lse[[1, 2, 4]]).all() and np.isfinite(lse[[0, 3, 5]]).all()


def test_leading_axes_are_rows():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 300)).astype(np.float32))
    argmax, lse = row_stats.argmax_logsumexp(x)
    ref_argmax, ref_lse = row_stats.argmax_logsumexp_reference(x)
    assert argmax.shape == lse.shape == (2, 3)
    np.testing.assert_array_equal(argmax, ref_argmax)
    np.testing.assert_allclose(lse, ref_lse, rtol=LSE_TOL)


def test_the_check_can_fail():
    # The comparison tells a wrong index apart: shifting one row's maximum moves its argmax.
    x = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
    (argmax, _), _ = _both(jnp.asarray(x))
    x[0, (argmax[0] + 1) % 64] = x[0].max() + 1
    (moved, _), _ = _both(jnp.asarray(x))
    assert moved[0] != argmax[0]
