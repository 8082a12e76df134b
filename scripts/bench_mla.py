"""MLA on CPU: decode absorbed vs decompressing, which form prefill chunks use, and how MoE runs.

Three side-by-side measurements, each variant timed in turn within every repetition
(interleaved, medians reported, ratios of medians), float32 on the CPU:

1. decode: a 2-layer DeepSeek-V2-Lite-shaped model (hidden 2048, 16 heads, kv_lora_rank 512,
   rope 64, nope 128, v 128; dense MLPs; vocab cut to 4096 so the head does not dominate)
   steps a batch of decoding sequences through the paged latent pool, its MLA backend
   attending in latent space (absorbed, the default) or decompressing every context chunk;
   tokens/s = sequences / step time. The attention call alone is timed too.
2. prefill: one 256-token chunk (no cached context, and 768 cached tokens), attention alone,
   absorbed vs decompressed: the measurement behind paged_jax/attention/mla.py's PREFILL_FORM.
3. MoE: 64 experts, top-6, 2 shared (DeepSeek-V2-Lite's routing) at a quarter of its widths
   (hidden 1024, expert 704: the full widths are 2.2 GB of f32 weights) for 16 and 128
   tokens, dense (every expert, weights 0 where unchosen) vs grouped (jax.lax.ragged_dot):
   the measurement behind models/deepseek_v2/model.py's MOE_IMPL.

    python scripts/bench_mla.py [--quick] [--reps 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _bench_common import command_line, machine_info, median, print_table, write_json
from models.deepseek_v2 import DeepseekV2ForCausalLM, MoE
from models.deepseek_v2 import PRESETS, DeepseekV2Config
from models.kv_cache_spec import init_kv_caches
from paged_jax.attention.mla import MlaXlaAttention
from paged_jax.attention.mla_xla import mla_paged_attention_xla
from paged_jax.core.step_inputs import AttentionMetadata, ModelInputs

BLOCK_SIZE = 16


def interleaved(fns: dict, reps: int) -> dict:
    """Median seconds of each no-argument callable, timed in turn each repetition (after one warm-up)."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: median(ts) for name, ts in times.items()}


def ragged_step(q_lens, contexts, max_blocks_per_seq, rng):
    """AttentionMetadata and positions for sequences of contexts[i] cached tokens running q_lens[i] new ones."""
    num_seqs = len(q_lens)
    tables = np.zeros((num_seqs, max_blocks_per_seq), np.int32)
    pages = rng.permutation(np.arange(1, num_seqs * max_blocks_per_seq + 1)).reshape(num_seqs, -1).astype(np.int32)
    slots, positions, qsl, seq_lens = [], [], [0], []
    for i, (q_len, context) in enumerate(zip(q_lens, contexts)):
        tables[i] = pages[i]
        for pos in range(context, context + q_len):
            slots.append(tables[i, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            positions.append(pos)
        qsl.append(len(slots))
        seq_lens.append(context + q_len)
    md = AttentionMetadata(slot_mapping=np.asarray(slots, np.int32), block_tables=tables,
                           seq_lens=np.asarray(seq_lens, np.int32), query_start_loc=np.asarray(qsl, np.int32),
                           num_seqs=np.asarray([num_seqs], np.int32))
    return jax.device_put(md), np.asarray(positions, np.int32), num_seqs * max_blocks_per_seq + 1


def bench_decode(num_seqs: int, context: int, reps: int, rng) -> dict:
    config = dataclasses.replace(PRESETS["deepseek-v2-lite"], vocab_size=4096, num_layers=2, first_k_dense_replace=2,
                                 bos_token_id=None, eos_token_ids=(),
                                 param_dtype="float32", dtype="float32")
    model = DeepseekV2ForCausalLM(config, rngs=nnx.Rngs(0))
    md, positions, num_blocks = ragged_step([1] * num_seqs, [context] * num_seqs, -(-(context + 1) // BLOCK_SIZE),
                                            rng)
    specs = model.kv_cache_specs()
    caches = [tuple(jnp.asarray(rng.standard_normal(a.shape) * 0.5, a.dtype) for a in layer)
              for layer in init_kv_caches(specs, num_blocks, BLOCK_SIZE)]
    inputs = ModelInputs(token_ids=jnp.asarray(rng.integers(0, 4096, num_seqs), jnp.int32),
                         positions=jnp.asarray(positions), logits_indices=jnp.arange(num_seqs, dtype=jnp.int32))
    graphdef, state = nnx.split(model)
    steps, state_of = {}, {}
    for form in ("absorbed", "decompressed"):
        backend = MlaXlaAttention(specs[0], decode_form=form)
        # Each form keeps its own cache copy; the step donates and returns it.
        step = jax.jit(lambda state, kv, backend=backend: nnx.merge(graphdef, state)(inputs, kv, md, backend),
                       donate_argnums=(1,))
        state_of[form] = [tuple(jnp.copy(a) for a in layer) for layer in caches]

        def run(step=step, form=form):
            logits, state_of[form] = step(state, state_of[form])
            return logits

        steps[form] = run
    step_s = interleaved(steps, reps)

    # the attention call alone (one layer)
    attn = model.layers[0].self_attn
    w_uk, w_uv = jnp.split(attn.kv_b_proj[...], [config.qk_nope_head_dim], axis=-1)
    q_nope = jnp.asarray(rng.standard_normal((num_seqs, config.num_heads, config.qk_nope_head_dim)), jnp.float32)
    q_rope = jnp.asarray(rng.standard_normal((num_seqs, config.num_heads, config.qk_rope_head_dim)), jnp.float32)
    args = (q_nope, q_rope, *caches[0], w_uk, w_uv, md.block_tables, md.seq_lens, md.query_start_loc, md.num_seqs)
    attn_s = interleaved({form: lambda form=form: mla_paged_attention_xla(*args, sm_scale=config.sm_scale,
                                                                          decode_form=form)
                          for form in ("absorbed", "decompressed")}, reps)
    return {"num_seqs": num_seqs, "context": context, "step_s": step_s, "attention_s": attn_s,
            "tokens_per_s": {form: num_seqs / s for form, s in step_s.items()}}


def bench_prefill(chunk: int, context: int, reps: int, rng) -> dict:
    c = PRESETS["deepseek-v2-lite"]
    md, _, num_blocks = ragged_step([chunk], [context], -(-(context + chunk) // BLOCK_SIZE), rng)
    n, latent, rope, nope, v = c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-1]), jnp.float32)  # noqa: E731
    args = (arr(chunk, n, nope), arr(chunk, n, rope), arr(num_blocks, BLOCK_SIZE, latent),
            arr(num_blocks, BLOCK_SIZE, rope), arr(latent, n, nope), arr(latent, n, v), md.block_tables, md.seq_lens,
            md.query_start_loc, md.num_seqs)
    attn_s = interleaved({form: lambda form=form: mla_paged_attention_xla(*args, sm_scale=c.sm_scale,
                                                                          prefill_form=form)
                          for form in ("absorbed", "decompressed")}, reps)
    return {"chunk": chunk, "context": context, "attention_s": attn_s}


def bench_moe(num_tokens: int, reps: int, rng) -> dict:
    config = DeepseekV2Config(vocab_size=32, hidden_size=1024, intermediate_size=8, num_layers=1, num_heads=16,
                              kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                              n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=704)
    graphdef, state = nnx.split(MoE(config, rngs=nnx.Rngs(0)))
    x = jnp.asarray(rng.standard_normal((num_tokens, config.hidden_size)), jnp.float32)
    fns = {impl: jax.jit(lambda state, x, impl=impl: nnx.merge(graphdef, state)(x, impl=impl))
           for impl in ("dense", "grouped")}
    out = {impl: np.asarray(fn(state, x)) for impl, fn in fns.items()}
    assert np.allclose(out["dense"], out["grouped"], atol=1e-3, rtol=1e-3), "the two MoE paths disagree"
    return {"num_tokens": num_tokens, "moe_s": interleaved({impl: lambda fn=fn: fn(state, x)
                                                             for impl, fn in fns.items()}, reps)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one decode shape, 3 repetitions")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=None, help="default: results/bench_mla[_quick].json")
    args = parser.parse_args(argv)
    reps = 3 if args.quick else args.reps
    args.out = args.out or f"results/bench_mla{'_quick' if args.quick else ''}.json"
    rng = np.random.default_rng(0)
    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731

    decode = [bench_decode(16, context, reps, rng) for context in ([256] if args.quick else [256, 1024])]
    rows = [[f"{d['num_seqs']} x {d['context']}", f"{d['tokens_per_s']['absorbed']:.0f}",
             f"{d['tokens_per_s']['decompressed']:.0f}",
             f"{d['step_s']['decompressed'] / d['step_s']['absorbed']:.2f}x", ms(d["attention_s"]["absorbed"]),
             ms(d["attention_s"]["decompressed"]),
             f"{d['attention_s']['decompressed'] / d['attention_s']['absorbed']:.2f}x"] for d in decode]
    print_table("MLA decode on CPU, 2-layer DeepSeek-V2-Lite shapes, f32 (medians, interleaved)",
                ["seqs x context", "tok/s absorbed", "tok/s decompressed", "step speed-up", "attn ms absorbed",
                 "attn ms decompressed", "attn speed-up"], rows)

    prefill = [bench_prefill(256, context, reps, rng) for context in (0, 768)]
    rows = [[f"{p['chunk']} new + {p['context']} cached", ms(p["attention_s"]["absorbed"]),
             ms(p["attention_s"]["decompressed"]),
             f"{p['attention_s']['absorbed'] / p['attention_s']['decompressed']:.2f}x"] for p in prefill]
    print_table("MLA prefill chunk attention on CPU (one layer, medians)",
                ["chunk", "ms absorbed", "ms decompressed", "decompressed speed-up"], rows)

    moe = [bench_moe(t, reps, rng) for t in (16, 128)]
    rows = [[m["num_tokens"], ms(m["moe_s"]["dense"]), ms(m["moe_s"]["grouped"]),
             f"{m['moe_s']['grouped'] / m['moe_s']['dense']:.2f}x"] for m in moe]
    print_table("MoE layer on CPU, 64 experts top-6 + 2 shared, hidden 1024, expert 704 (medians)",
                ["tokens", "ms dense", "ms grouped (ragged_dot)", "dense speed-up"], rows)

    write_json(args.out, {"decode": decode, "prefill": prefill, "moe": moe, "reps": reps,
                          "machine": machine_info(), "command": command_line()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
