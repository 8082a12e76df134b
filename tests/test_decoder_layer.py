"""The one-call decoder layer (cpu_kernels/decoder_layer.py) against its jnp reference and, in
the engine, against a dense generate loop; its caches updated in place."""

import os
import shutil

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from cpu_kernels import decoder_layer as dl
from cpu_kernels import quant_matmul as qm
from native_builds import BUILDS, register
from paged_jax.runner import SHORT_QUERY_ROWS

needs_native = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None or jax.default_backend() != "cpu"
    or not dl.native.enabled(), reason="no C++ compiler, or not an x86-64 CPU backend")

NUM_BLOCKS, BLOCK_SIZE, WIDTH = 24, 4, 6  # pages, tokens a page, table entries a row
D, F, HQ, HKV = 64, 96, 4, 2
# Relative to the output's largest magnitude: exact activations differ from XLA's only in
# summation order; int8 activations may round a value of x to the next step where the two
# norms differ in the last bit.
TOLERANCE = {"float32": 2e-5, "int8": 2e-2}


def _weights(formats, head_dim, seed=0):
    """LayerWeights of random values: formats = (q/k/v, o, gate/up, down)."""
    rng = np.random.default_rng(seed)
    f_qkv, f_o, f_gu, f_down = formats
    shapes = {"q": (HQ * head_dim, D, f_qkv), "k": (HKV * head_dim, D, f_qkv), "v": (HKV * head_dim, D, f_qkv),
              "o": (D, HQ * head_dim, f_o), "gate": (F, D, f_gu), "up": (F, D, f_gu), "down": (D, F, f_down)}
    packed = {name: dl.Weight(jnp.asarray(qm.pack((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), fmt)),
                              fmt) for name, (n, k, fmt) in shapes.items()}
    norm = lambda: jnp.asarray(1.0 + 0.1 * rng.standard_normal(D), jnp.float32)  # noqa: E731
    return dl.LayerWeights(norm(), packed["q"], packed["k"], packed["v"], packed["o"], norm(), packed["gate"],
                           packed["up"], packed["down"])


def _step(num_tokens, head_dim, cache_dtype, seed=0, lens=None, num_blocks=NUM_BLOCKS, width=WIDTH):
    """A batch of num_tokens token rows: sequences of lengths 1, 5, 4 (a page exactly) and 13 (past
    three pages) at the front (or `lens`), padding rows (seq_lens 0, slot 0) after; each
    sequence's pages a random choice of the pool; every page no sequence owns holds NaN (the
    null page 0 too)."""
    rng = np.random.default_rng(seed)
    if lens is None:
        lens = [1, 5, 4, 13, 9, 2, 7, 3][:num_tokens]
        num_real = max(1, num_tokens - 1) if num_tokens > 1 else 1  # leave one padding row when there is room
        lens = lens[:num_real] + [0] * (num_tokens - num_real)
    num_real = sum(n > 0 for n in lens)
    pages = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((num_tokens, width), np.int32)
    slots = np.zeros(num_tokens, np.int32)
    owned = []
    for t, n in enumerate(lens):
        if n == 0:
            continue
        used = -(-n // BLOCK_SIZE)
        row_pages, pages = pages[:used], pages[used:]
        tables[t, :used] = row_pages
        owned += list(row_pages)
        slots[t] = row_pages[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE  # this token's position
    shape = (num_blocks, BLOCK_SIZE, HKV, head_dim)
    k_cache = np.full(shape, np.nan, np.float32)
    v_cache = np.full(shape, np.nan, np.float32)
    k_cache[owned] = rng.standard_normal((len(owned), *shape[1:]))
    v_cache[owned] = rng.standard_normal((len(owned), *shape[1:]))
    positions = np.maximum(np.asarray(lens) - 1, 0)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2) / head_dim))
    angles = (positions[:, None] * inv_freq).astype(np.float32)
    x = rng.standard_normal((num_tokens, D)).astype(np.float32)
    rows = (jnp.asarray(tables), jnp.asarray(lens, jnp.int32), jnp.arange(num_tokens + 1, dtype=jnp.int32),
            jnp.int32(num_real))
    return (jnp.asarray(x), jnp.cos(angles), jnp.sin(angles), jnp.asarray(k_cache, cache_dtype),
            jnp.asarray(v_cache, cache_dtype), jnp.asarray(slots), rows)


def _run(fn, weights, step, head_dim, **kw):
    x, cos, sin, k_cache, v_cache, slots, rows = step
    return fn(x, weights, cos, sin, k_cache, v_cache, slots, rows, eps=1e-5, sm_scale=head_dim ** -0.5,
              num_heads=HQ, intermediate_size=F, **kw)


def _check(weights, step, head_dim, activations="float32", sliding_window=None, prefix=dl._PREFIX):
    out, k_out, v_out = jax.jit(lambda *a: _run(dl.decoder_layer, weights, a, head_dim, activations=activations,
                                                sliding_window=sliding_window, prefix=prefix))(*step)
    ref, k_ref, v_ref = _run(dl.decoder_layer_reference, weights, step, head_dim, activations=activations,
                             sliding_window=sliding_window)
    real = np.asarray(step[-1][1]) > 0  # padding rows' outputs are not defined
    out, ref = np.asarray(out)[real], np.asarray(ref)[real]
    assert np.isfinite(out).all(), "a NaN page (unowned, or the null page) reached a real row"
    np.testing.assert_allclose(out, ref, atol=TOLERANCE[activations] * np.abs(ref).max(), rtol=0)
    # the caches: this step's rows written where the reference writes them, every other page as it was
    for got, want in ((k_out, k_ref), (v_out, v_ref)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, atol=TOLERANCE[activations] * np.nanmax(np.abs(want)), rtol=0)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


FORMAT_SETS = [("q4_1", "q4_1", "q4_1", "q4_1"), ("q8_0", "q8_0", "q8_0", "q8_0"), ("q4_1", "q8_0", "q8_0", "q4_1"),
               ("bf16", "bf16", "bf16", "bf16"), ("q8_0", "bf16", "q4_1", "bf16")]


# (formats, activations): bf16 weights multiply f32 activations only, so int8 needs a tiled one
CASES = [(f, a) for f in FORMAT_SETS for a in ("float32", "int8") if a == "float32" or set(f) != {"bf16"}]


@needs_native
@pytest.mark.parametrize("formats,activations", CASES, ids=lambda c: "-".join(c) if isinstance(c, tuple) else c)
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_layer_matches_reference(formats, activations, num_tokens):
    _check(_weights(formats, 64), _step(num_tokens, 64, jnp.float32), 64, activations)


@needs_native
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", [64, 32], ids=["avx512-loops", "generic-loops"])
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_caches_head_dims_and_windows(cache_dtype, head_dim, sliding_window):
    _check(_weights(FORMAT_SETS[0], head_dim, seed=1), _step(8, head_dim, cache_dtype, seed=2), head_dim,
           sliding_window=sliding_window)


@needs_native
@pytest.mark.parametrize("lens", [[300], [517, 0], [260, 129], [517, 3]],
                         ids=["one-row", "one-row-padded", "two-rows", "short-row"])
@pytest.mark.parametrize("sliding_window", [None, 200])
@pytest.mark.parametrize("head_dim,cache_dtype", [(64, jnp.float32), (64, jnp.bfloat16), (32, jnp.float32)],
                         ids=["avx512-loops", "avx512-loops-bf16", "generic-loops"])
def test_long_contexts_split_over_the_threads(lens, sliding_window, head_dim, cache_dtype):
    """Few (row, KV head) tasks over hundreds of keys: the kernel splits each one's keys in
    ranges (merged as flash-decoding does); the window moves the ranges' start; a row shorter
    than the split count leaves ranges empty."""
    step = _step(len(lens), head_dim, cache_dtype, seed=5, lens=lens, num_blocks=300, width=140)
    _check(_weights(FORMAT_SETS[1], head_dim, seed=6), step, head_dim, sliding_window=sliding_window)


@needs_native
@pytest.mark.parametrize("build", sorted(BUILDS))
def test_layer_without_avx512_matches_reference(build):
    prefix = register(dl, build, "layer")
    for activations in ("float32", "int8"):
        _check(_weights(FORMAT_SETS[2], 64, seed=3), _step(5, 64, jnp.float32, seed=4), 64, activations, prefix=prefix)
    # A lone long sequence beside a short one: each task's keys split in ranges, which run these
    # loops' range attention (attend_keys on AVX2); the window moves the ranges' start.
    long_step = _step(2, 64, jnp.float32, seed=5, lens=[517, 3], num_blocks=300, width=140)
    for window in (None, 200):
        _check(_weights(FORMAT_SETS[1], 64, seed=6), long_step, 64, sliding_window=window, prefix=prefix)


@needs_native
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_next_weights_only_fetch_ahead(activations):
    """A stack of three layers, each given the next one's weights to fetch ahead (in another
    format, as a GGUF's layers may be): the same bits as without them, and the reference's
    values. The threads take the matmuls' chunks from both ends, so this also checks that every
    output is written once."""
    stack = [_weights(FORMAT_SETS[0], 64, seed=7), _weights(FORMAT_SETS[2], 64, seed=8),
             _weights(FORMAT_SETS[1], 64, seed=9)]
    step = _step(5, 64, jnp.float32, seed=10)
    assert all(dl.can_fetch_ahead(weights, D, HQ, HKV, 64) for weights in stack)

    def run(fn, ahead, x, cos, sin, k_cache, v_cache, slots, rows):
        for i, weights in enumerate(stack):
            extra = {"next_weights": stack[i + 1] if ahead and i + 1 < len(stack) else None}
            x, k_cache, v_cache = _run(fn, weights, (x, cos, sin, k_cache, v_cache, slots, rows), 64,
                                       activations=activations, **extra)
        return x, k_cache, v_cache

    with_next = jax.jit(lambda *a: run(dl.decoder_layer, True, *a))(*step)
    without = jax.jit(lambda *a: run(dl.decoder_layer, False, *a))(*step)
    ref = run(dl.decoder_layer_reference, True, *step)
    real = np.asarray(step[-1][1]) > 0
    for got, plain in zip(with_next, without):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
    out, want = np.asarray(with_next[0])[real], np.asarray(ref[0])[real]
    np.testing.assert_allclose(out, want, atol=3 * TOLERANCE[activations] * np.abs(want).max(), rtol=0)


def test_bad_arguments_raise_value_errors():
    weights = _weights(FORMAT_SETS[1], 64)
    step = _step(2, 64, jnp.float32)
    wrong = weights._replace(gate=weights.down)
    with pytest.raises(ValueError, match="weights.gate"):
        _run(dl.decoder_layer, wrong, step, 64)
    with pytest.raises(ValueError, match="activations"):
        _run(dl.decoder_layer, weights, step, 64, activations="int4")
    with pytest.raises(ValueError, match="sliding_window"):
        _run(dl.decoder_layer, weights, step, 64, sliding_window=0)
    x, cos, sin, *rest = step
    with pytest.raises(ValueError, match="cos and sin"):
        _run(dl.decoder_layer, weights, (x, cos[:, :8], sin[:, :8], *rest), 64)
    assert not dl.can_fetch_ahead(weights._replace(q=weights.o), D, HQ, HKV, 64)
    with pytest.raises(ValueError, match="next_weights: its q / k / v"):
        _run(dl.decoder_layer, weights, step, 64, next_weights=weights._replace(q=weights.o))
    with pytest.raises(ValueError, match="share one format"):
        mixed = _weights(("q4_1", "q8_0", "q8_0", "q4_1"), 64)._replace(k=weights.k)
        _run(dl.decoder_layer, weights, step, 64, next_weights=mixed)


@needs_native
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_engine_runs_small_buckets_as_one_call_per_layer_in_place(kv_cache_dtype, monkeypatch):
    """LLM(weight_dtype="int8") on the CPU: the decode bucket's layer program is one native call
    per layer whose caches are the program's (donated, aliased: no cache-sized temporary); a
    bucket past SHORT_QUERY_ROWS tokens has XLA layers too, which run the steps with a longer
    chunk (the 20-token prompt's prefill) and no others. Greedy tokens of several sequences
    decoding at once equal a dense loop over the same model; with a bf16 pool, a dense loop that
    rounds q, k, v and the attention output to bf16 as the pool does."""
    from models.llama import Attention
    from paged_jax import LLM, SamplingParams

    llm = LLM("tiny", weight_dtype="int8", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              warm_up="none", block_size=16, layers_per_program=1, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.runner
    assert runner._native_layers
    prompts = [[5, 9, 2, 7, 7, 1], [3, 4], [8] * 20]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    longest = []  # each step's longest query
    ran_long = set()  # the steps that called an XLA layer program of a bucket with native ones
    execute, programs_for = runner.execute, runner._programs_for

    def noting_execute(inputs, *args, **kwargs):
        qsl = inputs.attention.query_start_loc
        longest.append(int(np.max(qsl[1:] - qsl[:-1])))
        return execute(inputs, *args, **kwargs)

    def spying_programs_for(shape):
        programs = programs_for(shape)
        if programs.long_layers is None:
            return programs
        step = len(longest) - 1
        return programs._replace(long_layers=tuple((lambda p: lambda *a: ran_long.add(step) or p(*a))(p)
                                                   for p in programs.long_layers))

    monkeypatch.setattr(runner, "execute", noting_execute)
    monkeypatch.setattr(runner, "_programs_for", spying_programs_for)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert ran_long == {i for i, n in enumerate(longest) if n > SHORT_QUERY_ROWS} != set(), (ran_long, longest)
    num_layers = len(runner.layer_params)
    assert runner.layers_per_program < num_layers, "the test needs runs of layers in the large buckets"
    layers = runner._programs_for((1, 1))[1]
    assert len(layers) == 1 and runner.layer_groups(1).size == num_layers, "every layer in one program"
    suffix = "bf16" if kv_cache_dtype == "bfloat16" else "f32"  # the cache's
    assert layers[0].as_text().count(f"pj_decoder_layer_{suffix}") == num_layers
    memory = runner.compiled_memory(1, 1)["layer"]
    cache_bytes = sum(a.nbytes for cache in runner.kv_caches for a in cache)
    assert memory.alias_size_in_bytes >= cache_bytes and memory.temp_size_in_bytes < cache_bytes / num_layers
    big = max(shape for shape in runner.bucket_shapes() if shape[0] > SHORT_QUERY_ROWS)
    assert big[0] <= dl.MAX_TOKENS, "the test needs a bucket with both layer sets"
    long_layers = programs_for(big).long_layers  # the programs themselves, not the spies
    assert runner.layer_groups(big[0]).size == num_layers
    assert runner._programs_for(big)[1][0].as_text().count("pj_decoder_layer") == num_layers
    assert runner.layer_groups(big[0], SHORT_QUERY_ROWS + 1).size == runner.layers_per_program
    assert "pj_decoder_layer" not in long_layers[0].as_text()
    assert runner._programs_for((1, 1)).long_layers is None, "a bucket of short queries only has no XLA layers"
    model = llm.engine.model
    if kv_cache_dtype == "bfloat16":
        assert runner.kv_caches[0][0].dtype == jnp.bfloat16
        qkv, out_proj = Attention._qkv, Attention._out

        def bf16(x):
            return x.astype(jnp.bfloat16).astype(x.dtype)

        monkeypatch.setattr(Attention, "_qkv", lambda self, x, positions: tuple(map(bf16, qkv(self, x, positions))))
        monkeypatch.setattr(Attention, "_out", lambda self, attn: out_proj(self, bf16(attn)))
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        for _ in range(8):
            logits = model.dense_forward(jnp.asarray([ids + [0] * (32 - len(ids))], jnp.int32))
            ids.append(int(np.asarray(logits)[0, len(ids) - 1].argmax()))
        assert list(out.outputs[0].token_ids) == ids[len(prompt):]
