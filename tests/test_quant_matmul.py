"""The packed-weight matmul (cpu_kernels/quant_matmul.py) against a numpy float64 reference
over an independent dequantization, and packed models against their dequantized twins."""

import os
import shutil

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from cpu_kernels import quant_matmul as qm
from models.packed_weight import PackedWeight, pack_model, packed_formats

FORMATS = sorted(qm.WEIGHT_FORMATS)
# Relative to the largest |output|: f32 products summed in another order than float64's.
TOLERANCE = 2e-6


def _case(fmt, m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    return rng.standard_normal((m, k)).astype(np.float32), qm.pack(w, fmt), w


def test_dequantize_reference_matches_gguf():
    import gguf

    for fmt, qtype in [("q8_0", gguf.GGMLQuantizationType.Q8_0), ("q4_1", gguf.GGMLQuantizationType.Q4_1),
                       ("bf16", gguf.GGMLQuantizationType.BF16)]:
        _, data, w = _case(fmt, 1, 96, 5)
        ours = qm.dequantize_reference(data, fmt, 96)
        np.testing.assert_array_equal(ours, gguf.quants.dequantize(data, qtype).reshape(5, 96))
        assert np.abs(ours - w).max() < {"q8_0": 0.05, "q4_1": 0.5, "bf16": 0.02}[fmt]  # it is w, quantized


@pytest.mark.parametrize("fmt", FORMATS)
def test_xla_dequantize_is_exact(fmt):
    _, data, _ = _case(fmt, 1, 64, 7)
    np.testing.assert_array_equal(np.asarray(jax.jit(qm.dequantize, static_argnums=(1, 2))(data, fmt, 64)),
                                  qm.dequantize_reference(data, fmt, 64))


@pytest.mark.parametrize("fmt", FORMATS)
# rows: 1 (decode), 3 and 5 (not multiples of the kernel's 4-row tile), 33; outputs: fewer than
# one task's chunk, not a multiple of it, and many chunks
@pytest.mark.parametrize("m,k,n", [(1, 32, 1), (1, 576, 1536), (3, 1536, 40), (5, 64, 97), (33, 160, 70)])
def test_quant_matmul_matches_reference(fmt, m, k, n):
    x, data, _ = _case(fmt, m, k, n, seed=m * k + n)
    ref = qm.quant_matmul_reference(x, data, fmt)
    y = np.asarray(jax.jit(qm.quant_matmul, static_argnums=2)(x, data, fmt))
    assert y.shape == (m, n) and y.dtype == np.float32
    assert np.abs(y - ref).max() <= TOLERANCE * np.abs(ref).max()


def test_native_kernel_builds_here():
    # CI's machine has g++ and x86-64: the fast path must be the one the tests exercise there
    # (the GPU image has no compiler and needs none: its matmul is XLA's).
    if shutil.which(os.environ.get("CXX", "g++")) is None or jax.default_backend() != "cpu":
        pytest.skip("no C++ compiler, or not a CPU backend: the XLA path serves")
    assert qm.native_available(), "the native CPU kernel did not build; see the warning logged"


@pytest.mark.parametrize("fmt", FORMATS)
def test_xla_path_matches_reference(fmt, monkeypatch):
    # The path a GPU (or a machine without a compiler) takes.
    monkeypatch.setattr(qm, "native_available", lambda: False)
    x, data, _ = _case(fmt, 2, 96, 33)
    y = np.asarray(jax.jit(qm.quant_matmul, static_argnums=2)(x, data, fmt))
    ref = qm.quant_matmul_reference(x, data, fmt)
    assert np.abs(y - ref).max() <= TOLERANCE * np.abs(ref).max()


def test_bad_shapes_raise_value_errors():
    x, data, _ = _case("q8_0", 2, 64, 3)
    with pytest.raises(ValueError, match="not q4_1 rows"):
        qm.quant_matmul(x, data, "q4_1")
    with pytest.raises(ValueError, match="multiples of 32"):
        qm.row_bytes("q8_0", 48)
    with pytest.raises(ValueError, match="weight format"):
        qm.row_bytes("q5_k", 64)


@pytest.mark.parametrize("weight_dtype,fmt", [("int8", "q8_0"), ("bfloat16", "bf16")])
def test_packed_model_matches_its_dequantized_twin(weight_dtype, fmt):
    from flax import nnx

    from models.registry import build_preset

    packed = pack_model(build_preset("tiny", seed=3), weight_dtype)
    sizes = packed_formats(packed)
    assert set(sizes) == {fmt}
    # The twin: every packed weight replaced by its dequantized float array in einsum layout.
    twin = build_preset("tiny", seed=3)
    for (path, p), (_, t) in zip(nnx.iter_graph(packed), nnx.iter_graph(twin)):
        if isinstance(p, nnx.Param) and isinstance(p.get_value(), PackedWeight):
            t.set_value(p.get_value().dense())
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, packed.config.vocab_size, (2, 11)))
    got = np.asarray(packed.dense_forward(tokens))
    want = np.asarray(twin.dense_forward(tokens))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert np.abs(got - np.asarray(build_preset("tiny", seed=3).dense_forward(tokens))).max() > 0  # it did quantize


@pytest.mark.parametrize("fmt", FORMATS)
def test_lowers_for_cuda(fmt):
    # On a GPU the packed matmul is XLA's dequantize + dot (the native kernel is CPU-only).
    x, data, _ = _case(fmt, 1, 64, 8)
    text = jax.jit(qm.quant_matmul, static_argnums=2).trace(x, data, fmt).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "pj_quant_matmul" not in text


def test_weight_dtype_errors_name_the_fix():
    from models.registry import FAMILIES, _check_packed, load_model
    from paged_jax.engine_config import EngineConfig

    deepseek = next(f for f in FAMILIES if f.name == "deepseek_v2")
    with pytest.raises(ValueError, match="take float weights only; use weight_dtype='float32'"):
        _check_packed(deepseek, "int8", None)  # DeepSeek-V2's MLA layers call no packed matmul
    _check_packed(deepseek, "auto", None)  # auto asks nothing a family cannot do
    with pytest.raises(ValueError, match="tensor-parallel mesh splits float weights only"):
        load_model("tiny", weight_dtype="bfloat16", place=lambda rules: None)
    with pytest.raises(ValueError, match="weight_dtype"):
        EngineConfig(model="tiny", weight_dtype="int4")


def test_weight_dtypes_agree():
    from models.packed_weight import WEIGHT_DTYPES
    from paged_jax import engine_config

    assert engine_config.WEIGHT_DTYPES == WEIGHT_DTYPES  # repeated there to keep it jax-free


def test_engine_on_packed_weights_matches_dense_generate():
    """LLM(weight_dtype="int8") greedy tokens equal a dense loop over the same packed model."""
    from paged_jax import LLM, SamplingParams

    llm = LLM("tiny", weight_dtype="int8", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              warm_up="none", block_size=16)
    model = llm.engine.model
    assert packed_formats(model) and "q8_0" in packed_formats(model)
    prompts = [[5, 9, 2, 7, 7, 1], [3, 4]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        for _ in range(6):  # the dense reference: full causal forward over the whole sequence each token
            ids.append(int(np.asarray(model.dense_forward(jnp.asarray([ids], jnp.int32)))[0, -1].argmax()))
        assert list(out.outputs[0].token_ids) == ids[len(prompt):]
