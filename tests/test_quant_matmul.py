"""The packed-weight matmul (cpu_kernels/quant_matmul.py) against a numpy float64 reference
over an independent dequantization, and packed models against their dequantized twins."""

import os
import shutil

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from cpu_kernels import quant_matmul as qm
from models.packed_weight import PackedWeight, pack_model, packed_formats
from native_builds import BUILDS, register

FORMATS = sorted(qm.WEIGHT_FORMATS)
# (format, activations) pairs the kernel has
KINDS = [(f, a) for f in FORMATS for a in qm.ACTIVATIONS if a == "float32" or f in ("q8_0", "q4_1")]
# Relative to the largest sum of |products| of an output: f32 products summed in another
# order than float64's (q4_1's d * (x . q) + m * sum(x) may cancel, so |y| is the wrong scale).
TOLERANCE = 2e-6
_GGML = {"q8_0": "Q8_0", "q4_1": "Q4_1", "bf16": "BF16"}


def _case(fmt, m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    return rng.standard_normal((m, k)).astype(np.float32), qm.pack(w, fmt), w


def _gguf_rows(w, fmt):
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, _GGML[fmt])
    return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(w.shape[0], -1), qtype


def _scale(x, data, fmt, n):
    return (np.abs(x).astype(np.float64) @ np.abs(qm.dequantize_reference(data, fmt, x.shape[1], n)).T).max()


def _check(y, x, data, fmt, n, activations):
    ref = qm.quant_matmul_reference(x, data, fmt, n, activations)
    assert y.shape == ref.shape and y.dtype == np.float32
    assert np.abs(y - ref).max() <= TOLERANCE * _scale(x, data, fmt, n)


_matmul = jax.jit(qm.quant_matmul, static_argnums=(2, 3, 4), static_argnames="native")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, 16, 21])  # less than a tile, one tile, a tile and a part
def test_tiles_hold_the_gguf_rows(fmt, n):
    import gguf

    _, data, w = _case(fmt, 1, 96, n)
    rows, qtype = _gguf_rows(w, fmt)
    assert data.shape == qm.stored_shape(fmt, n, 96) and data.nbytes <= -(-n // 16) * rows.nbytes // n * 16
    np.testing.assert_array_equal(qm.untile_rows(data, fmt, n), rows)
    ours = qm.dequantize_reference(data, fmt, 96, n)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(rows, qtype).reshape(n, 96))
    assert np.abs(ours - w).max() < {"q8_0": 0.05, "q4_1": 0.5, "bf16": 0.02}[fmt]  # it is w, quantized


@pytest.mark.parametrize("fmt", FORMATS)
def test_xla_dequantize_is_exact(fmt):
    _, data, _ = _case(fmt, 1, 64, 23)
    want = qm.dequantize_reference(data, fmt, 64, 23)
    np.testing.assert_array_equal(np.asarray(jax.jit(qm.dequantize, static_argnums=(1, 2, 3))(data, fmt, 64, 23)),
                                  want)
    ids = np.array([[0, 22, 5], [16, 15, 1]], np.int32)  # rows of the first and the last tile
    np.testing.assert_array_equal(np.asarray(jax.jit(qm.dequantize_rows, static_argnums=(1, 2))(data, fmt, 64, ids)),
                                  want[ids])


def test_activation_quantization_is_llama_cpps():
    # Per block of 32: d = max|x| / 127, q = round(x / d) half to even; an all-zero block is 0.
    x = np.zeros((1, 64), np.float32)
    x[0, :32] = np.linspace(-2.54, 1.0, 32)
    q, d = qm.quantize_activations_reference(x)
    assert d[0, 0] == np.float32(2.54) / np.float32(127) and d[0, 1] == 0
    assert q[0, 0] == -127 and np.all(q[0, 32:] == 0)
    np.testing.assert_allclose(q[0, :32] * d[0, 0], x[0, :32], atol=d[0, 0] / 2 + 1e-7)


@pytest.mark.parametrize("fmt,activations", KINDS)
# rows: 1 (decode), 3 and 5 (not multiples of the kernel's 4 rows), 33; outputs: one, fewer
# than a tile, a part tile after whole ones, many tasks' chunks
@pytest.mark.parametrize("m,k,n", [(1, 32, 1), (1, 576, 1536), (3, 1536, 40), (5, 64, 97), (33, 160, 70)])
def test_quant_matmul_matches_reference(fmt, activations, m, k, n):
    x, data, _ = _case(fmt, m, k, n, seed=m * k + n)
    _check(np.asarray(_matmul(x, data, fmt, n, activations)), x, data, fmt, n, activations)


_group = jax.jit(qm.quant_matmul_group, static_argnums=(2, 3, 4), static_argnames="native")


@pytest.mark.parametrize("fmt,activations", KINDS)
@pytest.mark.parametrize("native", [qm._TARGET, None])
def test_grouped_matmul_is_one_matmul_per_weight(fmt, activations, native):
    # q, k, v-like weights (a part tile in the middle of the group, one of fewer rows than a
    # tile): each output is what its own call gives, bit for bit, and the reference's.
    m, k, ns = 3, 96, (40, 16, 7)
    x = np.random.default_rng(3).standard_normal((m, k)).astype(np.float32)
    datas = [_case(fmt, 1, k, n, seed=10 + n)[1] for n in ns]
    ys = _group(x, datas, fmt, ns, activations, native=native)
    assert len(ys) == len(ns)
    for y, data, n in zip(ys, datas, ns):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(_matmul(x, data, fmt, n, activations, native=native)))
        _check(np.asarray(y), x, data, fmt, n, activations)


def test_int8_activations_lose_little():
    # The quantized matmul is near the exact one (x's rounding, ~1/254 of each block's max).
    x, data, _ = _case("q4_1", 4, 576, 64, seed=1)
    exact = qm.quant_matmul_reference(x, data, "q4_1", 64)
    y = np.asarray(_matmul(x, data, "q4_1", 64, "int8"))
    assert 0 < np.abs(y - exact).max() < 0.02 * np.abs(exact).max()


def test_native_kernel_builds_here():
    # CI's machine has g++ and x86-64: the fast path must be the one the tests exercise there
    # (the GPU image has no compiler and needs none: its matmul is XLA's).
    if shutil.which(os.environ.get("CXX", "g++")) is None or jax.default_backend() != "cpu":
        pytest.skip("no C++ compiler, or not a CPU backend: the XLA path serves")
    assert qm.native_available(), "the native CPU kernel did not build; see the warning logged"


def _built(build: str) -> str:
    """The name prefix of build ("native" or a BUILDS key), built and registered now (pytest.skip
    where it cannot run)."""
    if shutil.which(os.environ.get("CXX", "g++")) is None or jax.default_backend() != "cpu":
        pytest.skip("no C++ compiler, or not a CPU backend")
    if build == "native":
        assert qm.native_available()
        return qm._TARGET
    return register(qm, build, "quant_matmul")


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_kernels_without_avx512_match_reference(build):
    # The loops a CPU without AVX-512 runs, under names of their own.
    prefix = _built(build)
    for fmt, activations in KINDS:
        for rows in (1, 5):  # one pass of r = 1; passes of 4 and 1
            x, data, _ = _case(fmt, rows, 96, 21, seed=7)
            y = np.asarray(_matmul(x, data, fmt, 21, activations, native=prefix))
            _check(y, x, data, fmt, 21, activations)
            y2, y1 = _group(x, [_case(fmt, 1, 96, 40)[1], data], fmt, (40, 21), activations, native=prefix)
            np.testing.assert_array_equal(np.asarray(y1), y)


@pytest.mark.parametrize("build", ["native", *sorted(BUILDS)])  # this machine's own, and native_builds.py's
def test_int8_activations_round_half_to_even(build):
    # A block whose max|x| is 127 has d = 1, so x / d is x itself: halves round to the even
    # neighbour (llama.cpp's nearbyint), not away from zero. The weight's rows pick one input
    # each (q8_0 of 1.0: q = 127, d = f16(1 / 127)), so y[i] is x's q[i] times ~1.
    prefix = _built(build)
    halves = np.arange(31, dtype=np.float32) - 15.5  # -15.5 .. 14.5
    x = np.concatenate([halves, [127.0], -halves, [-127.0]]).astype(np.float32)[None]  # two blocks of 32
    n = x.shape[1]
    y = np.asarray(_matmul(x, qm.pack(np.eye(n, dtype=np.float32), "q8_0"), "q8_0", n, "int8", native=prefix))
    np.testing.assert_allclose(y[0], np.rint(x[0]), rtol=1e-3)  # numpy's rint: half to even
    assert y[0, 0] == pytest.approx(-16, rel=1e-3) and y[0, 16] == pytest.approx(0, abs=1e-6)  # -15.5, 0.5


def _extreme_case(fmt):
    # Every int8 product at its largest: x's blocks are +-1 (q = +-127) with w's signs, so
    # q8_0's q is +-127 (one byte made -128 by hand) and q4_1's q is 15 (each block's one
    # other value its min, 0). A kernel that multiplies q8_0's q + 128 by x in int16 pairs
    # (vpmaddubsw) saturates here; so would q4_1's pairs if summed over two blocks in int16.
    rng = np.random.default_rng(5)
    k, n = 96, 21
    signs = np.where(rng.random((n, k)) < 0.5, -1.0, 1.0).astype(np.float32)
    if fmt == "q8_0":
        w = signs
        data = np.array(qm.pack(w, fmt))
        data[0, 32] = 0x00  # tile 0, block 0, row 0, input 0: q = -128 (stored q ^ 0x80)
        x = signs[:1].copy()
        x[0, 0] = -1.0
    else:
        w = np.ones((n, k), np.float32)
        w[:, ::32] = 0.0
        data = qm.pack(w, fmt)
        x = np.ones((1, k), np.float32)
    return np.concatenate([x, -x, x]), data, n


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("build", ["native", "avx2"])
def test_int8_dots_at_the_extremes_do_not_saturate(fmt, build):
    prefix = _built(build)
    x, data, n = _extreme_case(fmt)
    y = np.asarray(_matmul(x, data, fmt, n, "int8", native=prefix))
    ref = qm.quant_matmul_reference(x, data, fmt, n, "int8")
    assert np.abs(ref).max() > 10  # the sums are large, not cancelled
    _check(y, x, data, fmt, n, "int8")


@pytest.mark.parametrize("fmt,activations", KINDS)
def test_xla_path_matches_reference(fmt, activations):
    # The path a GPU (or a machine without a compiler) takes.
    x, data, _ = _case(fmt, 2, 96, 33)
    _check(np.asarray(_matmul(x, data, fmt, 33, activations, native=None)), x, data, fmt, 33, activations)


def test_bad_arguments_raise_value_errors():
    x, data, _ = _case("q8_0", 2, 64, 3)
    with pytest.raises(ValueError, match="is not a q4_1 weight of 3 rows"):
        qm.quant_matmul(x, data, "q4_1", 3)
    with pytest.raises(ValueError, match="is not a q8_0 weight of 40 rows"):
        qm.quant_matmul(x, data, "q8_0", 40)
    with pytest.raises(ValueError, match="multiples of 32"):
        qm.row_bytes("q8_0", 48)
    with pytest.raises(ValueError, match="weight format"):
        qm.row_bytes("q5_k", 64)
    with pytest.raises(ValueError, match="int8 activations need q8_0 or q4_1 weights"):
        qm.quant_matmul(x, qm.pack(np.ones((3, 64)), "bf16"), "bf16", 3, "int8")
    with pytest.raises(ValueError, match="activations='fp8'"):
        qm.quant_matmul(x, data, "q8_0", 3, "fp8")
    with pytest.raises(ValueError, match="1 to 4 weights and one n each"):
        qm.quant_matmul_group(x, [data] * 5, "q8_0", [3] * 5)
    with pytest.raises(ValueError, match="1 to 4 weights and one n each"):
        qm.quant_matmul_group(x, [data, data], "q8_0", [3])


@pytest.mark.parametrize("weight_dtype,fmt", [("int8", "q8_0"), ("bfloat16", "bf16")])
def test_packed_model_matches_its_dequantized_twin(weight_dtype, fmt):
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
    text = _matmul.trace(x, data, fmt, 8, "float32").lower(lowering_platforms=("cuda",)).as_text()
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
    with pytest.raises(ValueError, match="activation_dtype='int8' quantizes the activations of q8_0 / q4_1 weights"):
        EngineConfig(model="tiny", weight_dtype="float32", activation_dtype="int8")
    with pytest.raises(ValueError, match="loaded none with weight_dtype='auto'"):
        load_model("tiny", activation_dtype="int8")  # the preset is float32: nothing to quantize for
    with pytest.raises(ValueError, match="activation_dtype"):
        EngineConfig(model="tiny", activation_dtype="int4")


def test_weight_dtypes_agree():
    from models.packed_weight import WEIGHT_DTYPES
    from paged_jax import engine_config

    assert engine_config.WEIGHT_DTYPES == WEIGHT_DTYPES  # repeated there to keep it jax-free


@pytest.mark.parametrize("activation_dtype", ["float32", "int8"])
def test_engine_on_packed_weights_matches_dense_generate(activation_dtype):
    """LLM(weight_dtype="int8") greedy tokens equal a dense loop over the same packed model."""
    from paged_jax import LLM, SamplingParams

    llm = LLM("tiny", weight_dtype="int8", activation_dtype=activation_dtype, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32, warm_up="none", block_size=16)
    model = llm.engine.model
    assert packed_formats(model) and "q8_0" in packed_formats(model)
    acts = {p.get_value().activations for _, p in nnx.iter_graph(model)
            if isinstance(p, nnx.Param) and isinstance(p.get_value(), PackedWeight)}
    assert acts == {activation_dtype}
    prompts = [[5, 9, 2, 7, 7, 1], [3, 4]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        for _ in range(6):  # the dense reference: full causal forward over the whole sequence each token,
            # padded to one length (causal: the padding changes no earlier position), so its ops
            # compile once, not once per length (minutes on a GPU)
            logits = model.dense_forward(jnp.asarray([ids + [0] * (16 - len(ids))], jnp.int32))
            ids.append(int(np.asarray(logits)[0, len(ids) - 1].argmax()))
        assert list(out.outputs[0].token_ids) == ids[len(prompt):]


def test_a_packed_model_saves_as_its_dequantized_weights(tmp_path):
    from models.llama import load_hf_checkpoint, save_hf_checkpoint
    from models.registry import build_preset

    packed = pack_model(build_preset("tiny", seed=5), "int8")
    save_hf_checkpoint(packed, str(tmp_path))
    loaded = load_hf_checkpoint(str(tmp_path), dtype="float32")
    assert not packed_formats(loaded)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, packed.config.vocab_size, (1, 9)))
    np.testing.assert_allclose(np.asarray(loaded.dense_forward(tokens)), np.asarray(packed.dense_forward(tokens)),
                               rtol=1e-4, atol=1e-4)
