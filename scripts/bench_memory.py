"""KV memory: live-slot fraction and concurrency of paged blocks vs a contiguous allocator.

A long-tailed offline workload (every request queued at t=0; prompt and output lengths drawn
from a heavy-tailed distribution, prompt + output <= max_model_len = 4096) runs through the
real Scheduler and KVCacheManager with no model: each step, every request that samples gets
one fake token, and a request stops at its drawn output length (SamplingParams(max_tokens=L,
ignore_eos=True)). One step is one unit of time.

    python scripts/bench_memory.py [--quick] [--dist lognormal|pareto] [--kv-budget-tokens 65536]

Measured per step, after schedule(): allocated slots = blocks held by requests x block_size
(blocks in the free queue, cached or not, are free); live slots = sum of the running
requests' num_computed_tokens (tokens whose K/V sits in a slot after this step). Reported:
slot-time-weighted live fraction sum(live) / sum(allocated), the most requests scheduled in
one step, and the mean while the queue is non-empty (the KV-bound phase).

The contiguous allocator is the same Scheduler and KVCacheManager with block_size =
max_model_len: each request holds one max_model_len slab, which is exactly "reserve
max_model_len per request", under the same token budget and the same FCFS policy.
Targets (issue 6): >= 96% live; >= 3x the contiguous allocator's concurrency. Anchor: the
PagedAttention paper measured 20.4-38.2% of KV memory holding live tokens in prior systems.

MLA vs GQA-8 (issue 16): at one model width (hidden 4096, 32 layers, bf16) the bytes one
token costs per layer, from each model's own kv_cache_specs(): Llama-3.1-8B's GQA-8 (K and V
of 8 heads x 128) vs a DeepSeek-V2-style MLA (latent 512 + rope key 64); then, in a fixed
KV budget (--mla-budget-gib), how many full-length sequences fit and how many of the same
workload's requests the paged scheduler runs at once. Target: the seed's 3-4x smaller cache.

Sliding-window rows (issue 27): Gemma 3 270M's cache (18 layers of 1 KV head x 256 in
bf16, 15 of them with a 512-token window), in a fixed budget (--window-budget-gib), with
its KV-cache groups (five sliding groups that free what slid out of the window, one full
group, sharing the pool's arrays) vs the same layers all full attention: how many sequences
of 4k, 8k and 32k tokens the real KVCacheManager holds at once (each prefilled in chunks of
--max-num-batched-tokens, admitted until an allocation fails), and the KV bytes each token
costs there.

KV-cache dtype rows (issue 14): the same KV byte budget (--kv-budget-tokens tokens of
--kv-model in bfloat16) buys budget // kv_cache_bytes_per_token(config, kv_cache_dtype) slots
for each kv_cache_dtype (scales included), and the paged run is repeated with that many:
how many tokens the pool holds and how many requests run at once.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from _bench_common import command_line, machine_info, print_table, write_json
from paged_jax.core.config import CacheConfig, SchedulerConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, SamplingParams
from paged_jax.core.scheduler import Scheduler

VOCAB = 32000


def draw_lengths(n: int, dist: str, max_model_len: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Heavy-tailed (prompt, output) lengths with prompt + output <= max_model_len.

    lognormal: medians 160 (prompt) and 180 (output), sigma 1.1 each (means ~290 and ~330,
    close to ShareGPT's 161 / 338 means with a longer tail). pareto: 32 * (1 + Pareto(1.2)) for
    both (infinite variance; most requests short, a few near the cap).
    """
    if dist == "lognormal":
        prompt = rng.lognormal(np.log(160), 1.1, n)
        output = rng.lognormal(np.log(180), 1.1, n)
    else:
        prompt = 32 * (1 + rng.pareto(1.2, n))
        output = 32 * (1 + rng.pareto(1.2, n))
    prompt = np.clip(prompt.astype(np.int64), 1, max_model_len - 1)
    output = np.clip(output.astype(np.int64), 1, max_model_len - prompt)
    return prompt, output


def simulate(prompts: list[list[int]], outputs: np.ndarray, *, block_size: int, budget_tokens: int,
             max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    """Runs the workload to completion; returns per-run aggregates."""
    num_blocks = budget_tokens // block_size + 1  # + the null block, which holds no tokens
    kv = KVCacheManager(CacheConfig(block_size, num_blocks, max_model_len))
    sched = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len), kv)
    for i, (prompt, out_len) in enumerate(zip(prompts, outputs)):
        params = SamplingParams(max_tokens=int(out_len), temperature=0.0, ignore_eos=True)
        sched.add_request(Request(f"r{i}", prompt, params))
    usable = num_blocks - 1
    # Each request must compute its prompt and all outputs but the last (never fed back).
    needed_tokens = sum(len(p) + int(o) - 1 for p, o in zip(prompts, outputs))
    live_sum = alloc_sum = 0
    live_sum_bound = alloc_sum_bound = 0
    concurrency, concurrency_bound = [], []
    steps = scheduled_tokens = 0
    t0 = time.perf_counter()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        allocated = (usable - kv.get_num_free_blocks()) * block_size
        live = sum(r.num_computed_tokens for r in sched.running)
        assert live <= allocated, "more live tokens than allocated slots: the accounting is wrong"
        live_sum += live
        alloc_sum += allocated
        concurrency.append(out.num_seqs)
        if sched.waiting:  # requests are queued, so memory (or max_num_seqs) is what limits the batch
            live_sum_bound += live
            alloc_sum_bound += allocated
            concurrency_bound.append(out.num_seqs)
        sched.update_from_output(out, [1] * out.num_seqs)
        scheduled_tokens += out.total_num_scheduled_tokens
        steps += 1
    wall = time.perf_counter() - t0
    stats = kv.prefix_cache_stats
    assert stats.hits == 0, "random prompts shared a cached block: live tokens would be double counted"
    assert kv.get_num_free_blocks() == usable, "blocks leaked"
    return {
        "num_blocks": num_blocks, "block_size": block_size, "steps": steps, "sim_wall_s": wall,
        "live_fraction": live_sum / alloc_sum,
        "live_fraction_kv_bound": live_sum_bound / alloc_sum_bound if alloc_sum_bound else None,
        "max_concurrent": max(concurrency),
        "mean_concurrent_kv_bound": float(np.mean(concurrency_bound)) if concurrency_bound else None,
        "kv_bound_steps": len(concurrency_bound),
        "num_preemptions": sched.num_preemptions,
        "recomputed_token_fraction": scheduled_tokens / needed_tokens - 1,
        "max_num_seqs_reached": max(concurrency) >= max_num_seqs,
    }


def mla_vs_gqa8(prompts, outputs, args) -> tuple[dict, list[list]]:
    """Bytes per token per layer and sequences in a fixed budget: MLA vs GQA-8 at hidden 4096."""
    from flax import nnx

    from models.llama import PRESETS as LLAMA_PRESETS
    from models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
    from models.kv_cache_spec import kv_cache_bytes_per_token
    from models.llama import LlamaForCausalLM

    llama = LLAMA_PRESETS["llama-3.1-8b"]  # GQA-8, head_dim 128, bf16
    # DeepSeek-V2's attention (q_lora 1536, latent 512, rope 64, nope 128, v 128) at Llama's width and depth.
    mla = DeepseekV2Config(vocab_size=llama.vocab_size, hidden_size=llama.hidden_size,
                           intermediate_size=llama.intermediate_size, num_layers=llama.num_layers,
                           num_heads=llama.num_heads, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                           v_head_dim=128, q_lora_rank=1536, first_k_dense_replace=llama.num_layers,
                           param_dtype="bfloat16", dtype="bfloat16")
    models = {"GQA-8": nnx.eval_shape(lambda: LlamaForCausalLM(llama, rngs=nnx.Rngs(0))),
              "MLA": nnx.eval_shape(lambda: DeepseekV2ForCausalLM(mla, rngs=nnx.Rngs(0)))}
    budget = int(args.mla_budget_gib * 2**30)
    result = {"budget_bytes": budget, "hidden_size": llama.hidden_size, "num_layers": llama.num_layers}
    for name, model in models.items():
        specs = model.kv_cache_specs()
        per_token = kv_cache_bytes_per_token(specs)
        budget_tokens = budget // per_token
        sim = simulate(prompts, outputs, block_size=args.block_size, budget_tokens=budget_tokens,
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens)
        result[name] = {"spec": repr(specs[0]), "bytes_per_token_per_layer": specs[0].bytes_per_token,
                        "bytes_per_token": per_token, "budget_tokens": budget_tokens,
                        "full_length_seqs": budget_tokens // args.max_model_len,
                        "max_concurrent": sim["max_concurrent"],
                        "mean_concurrent_kv_bound": sim["mean_concurrent_kv_bound"],
                        "steps": sim["steps"]}
    gqa, lat = result["GQA-8"], result["MLA"]
    ratio = gqa["bytes_per_token_per_layer"] / lat["bytes_per_token_per_layer"]
    result["ratio"] = ratio
    result["target"] = [3.0, 4.0]
    result["met"] = 3.0 <= ratio <= 4.0
    def mean(r):
        return "-" if r["mean_concurrent_kv_bound"] is None else f"{r['mean_concurrent_kv_bound']:.1f}"

    rows = [
        ["bytes / token / layer", gqa["bytes_per_token_per_layer"], lat["bytes_per_token_per_layer"],
         f"{ratio:.2f}x ({'met' if result['met'] else 'MISSED'}: seed 3-4x)"],
        [f"KiB / token ({llama.num_layers} layers)", gqa["bytes_per_token"] / 1024, lat["bytes_per_token"] / 1024, ""],
        [f"tokens in {args.mla_budget_gib:g} GiB", gqa["budget_tokens"], lat["budget_tokens"],
         f"{lat['budget_tokens'] / gqa['budget_tokens']:.2f}x"],
        [f"{args.max_model_len}-token sequences that fit", gqa["full_length_seqs"], lat["full_length_seqs"],
         f"{lat['full_length_seqs'] / max(gqa['full_length_seqs'], 1):.2f}x"],
        ["max requests at once (workload above)", gqa["max_concurrent"], lat["max_concurrent"],
         f"{lat['max_concurrent'] / gqa['max_concurrent']:.2f}x"],
        ["mean requests at once, while queued", mean(gqa), mean(lat),
         f"{lat['mean_concurrent_kv_bound'] / gqa['mean_concurrent_kv_bound']:.2f}x"
         if lat["mean_concurrent_kv_bound"] and gqa["mean_concurrent_kv_bound"] else ""],
        ["steps to drain the workload", gqa["steps"], lat["steps"], ""],
    ]
    return result, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 requests instead of 2000")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--dist", default="lognormal", choices=["lognormal", "pareto"])
    parser.add_argument("--kv-budget-tokens", type=int, default=65536, help="KV slots for both allocators")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=1024, help="high, so the KV budget is the limit")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mla-budget-gib", type=float, default=8.0, help="KV budget of the MLA vs GQA-8 rows")
    parser.add_argument("--window-budget-gib", type=float, default=4.0, help="KV budget of the sliding-window rows")
    parser.add_argument("--kv-model", default="llama-3.1-8b", help="preset whose bytes per token size the "
                        "kv_cache_dtype rows")
    parser.add_argument("--out", default=None, help="default: results/bench_memory[_quick].json")
    args = parser.parse_args(argv)
    args.out = args.out or f"results/bench_memory{'_quick' if args.quick else ''}.json"
    n = args.num_requests or (300 if args.quick else 2000)

    rng = np.random.default_rng(args.seed)
    prompt_lens, output_lens = draw_lengths(n, args.dist, args.max_model_len, rng)
    prompts = [rng.integers(0, VOCAB, int(p)).tolist() for p in prompt_lens]
    common = dict(budget_tokens=args.kv_budget_tokens, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    paged = simulate(prompts, output_lens, block_size=args.block_size, **common)
    contiguous = simulate(prompts, output_lens, block_size=args.max_model_len, **common)

    ratio_max = paged["max_concurrent"] / contiguous["max_concurrent"]
    ratio_mean = paged["mean_concurrent_kv_bound"] / contiguous["mean_concurrent_kv_bound"]
    lengths = {}
    for name, arr in (("prompt", prompt_lens), ("output", output_lens), ("total", prompt_lens + output_lens)):
        lengths[name] = {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
                         "p99": float(np.percentile(arr, 99)), "max": int(arr.max())}
    result = {
        "paged": paged, "contiguous": contiguous,
        "concurrency_ratio_max": ratio_max, "concurrency_ratio_mean_kv_bound": ratio_mean,
        "targets": {"live_fraction": 0.96, "concurrency_ratio": 3.0},
        "paper_anchor_live_fraction_prior_systems": [0.204, 0.382],
        "workload": {"num_requests": n, "dist": args.dist, "seed": args.seed, "lengths": lengths,
                     "kv_budget_tokens": args.kv_budget_tokens, "max_model_len": args.max_model_len,
                     "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
        "machine": machine_info(),
        "command": command_line(),
    }
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    rows = [
        ["live slots / allocated (time avg)", pct(paged["live_fraction"]), pct(contiguous["live_fraction"]),
         ">= 96% (paper: prior 20.4-38.2%)"],
        ["  same, while requests queue", pct(paged["live_fraction_kv_bound"]), pct(contiguous["live_fraction_kv_bound"]), ""],
        ["max requests at once", paged["max_concurrent"], contiguous["max_concurrent"],
         f">= 3x: {ratio_max:.1f}x"],
        ["mean requests at once, while queued", f"{paged['mean_concurrent_kv_bound']:.1f}",
         f"{contiguous['mean_concurrent_kv_bound']:.1f}", f"{ratio_mean:.1f}x"],
        ["steps to drain the workload", paged["steps"], contiguous["steps"], ""],
        ["preemptions (recompute)", paged["num_preemptions"], contiguous["num_preemptions"], ""],
        ["tokens computed again after preemption", pct(paged["recomputed_token_fraction"]),
         pct(contiguous["recomputed_token_fraction"]), ""],
    ]
    print_table(f"KV memory: {n} {args.dist} requests (mean prompt {lengths['prompt']['mean']:.0f}, "
                f"output {lengths['output']['mean']:.0f}, p99 total {lengths['total']['p99']:.0f}), "
                f"budget {args.kv_budget_tokens} tokens, max_model_len {args.max_model_len}",
                ["metric", f"paged (block {args.block_size})", f"contiguous ({args.max_model_len}/req)", "target"],
                rows)
    result["mla_vs_gqa8"], rows = mla_vs_gqa8(prompts, output_lens, args)
    print_table(f"KV per token: MLA (latent 512 + rope 64) vs GQA-8 (8 x 128 K and V), hidden "
                f"{result['mla_vs_gqa8']['hidden_size']}, bf16, paged block {args.block_size}",
                ["metric", "GQA-8 (Llama-3.1-8B)", "MLA (DeepSeek-V2 attention)", "MLA / GQA-8"], rows)
    result["kv_cache_dtypes"] = kv_dtype_rows(prompts, output_lens, args, common)
    result["sliding_window"] = sliding_window_rows(args)
    write_json(args.out, result)
    return 0


def sequences_that_fit(specs, budget_bytes: int, context: int, *, block_size: int, chunk: int) -> dict:
    """Decoding sequences of `context` tokens a pool of budget_bytes holds at once: each
    prefilled in chunks through the KVCacheManager (a sliding group frees its old blocks as it
    goes) and then decoding, admitted until one allocation fails."""
    from models.kv_cache_spec import kv_cache_bytes_per_block, kv_cache_group_specs

    groups = kv_cache_group_specs(specs)
    per_block = kv_cache_bytes_per_block(specs, groups, block_size)
    num_blocks = budget_bytes // per_block + 1
    kv = KVCacheManager(CacheConfig(block_size, num_blocks, context + 1, enable_prefix_caching=False,
                                    kv_cache_groups=groups))
    tokens = list(range(context))
    num_seqs = 0
    while True:
        request = Request(f"r{num_seqs}", tokens, SamplingParams(max_tokens=2))
        # The prompt in chunks, then one decode step: a decoding sequence holds its window
        # (the step frees what the last chunk left behind it).
        while request.num_computed_tokens <= context:
            step = min(chunk, context - request.num_computed_tokens) or 1
            if kv.allocate_slots(request, step) is None:
                kv.free(request)
                used = num_blocks - 1 - kv.get_num_free_blocks()
                kv.check_invariants()
                return {"num_groups": len(groups), "bytes_per_block": per_block, "num_blocks": num_blocks,
                        "num_seqs": num_seqs, "blocks_per_seq": used / max(num_seqs, 1),
                        "kv_bytes_per_token": used * per_block / max(num_seqs * context, 1)}
            request.num_computed_tokens += step
        num_seqs += 1


def sliding_window_rows(args) -> dict:
    """Gemma 3 270M's KV cache with sliding-window groups vs every layer full, per context."""
    import dataclasses

    from models.gemma3 import Gemma3Config
    from models.kv_cache_spec import attention_spec

    c = Gemma3Config.from_preset("gemma3-270m-shapes")
    hybrid = [attention_spec(c.num_kv_heads, c.head_dim, "bfloat16", sliding_window=w) for w in c.layer_windows]
    full = [dataclasses.replace(spec, sliding_window=None) for spec in hybrid]
    budget = int(args.window_budget_gib * 2**30)
    result, rows = {"budget_bytes": budget, "contexts": {}}, []
    for context in (4096, 8192, 32768):
        common = dict(block_size=args.block_size, chunk=args.max_num_batched_tokens)
        h, f = sequences_that_fit(hybrid, budget, context, **common), sequences_that_fit(full, budget, context, **common)
        result["contexts"][context] = {"sliding_groups": h, "all_full": f, "ratio": h["num_seqs"] / max(f["num_seqs"], 1)}
        rows.append([f"{context // 1024}k", f"{h['kv_bytes_per_token']:.0f}", f"{f['kv_bytes_per_token']:.0f}",
                     h["num_seqs"], f["num_seqs"], f"{h['num_seqs'] / max(f['num_seqs'], 1):.1f}x"])
    print_table(f"Gemma 3 270M KV cache (bf16, block {args.block_size}) in {args.window_budget_gib:g} GiB: "
                f"{result['contexts'][4096]['sliding_groups']['num_groups']} KV-cache groups vs every layer full",
                ["context", "bytes/token (groups)", "bytes/token (all full)", "sequences (groups)",
                 "sequences (all full)", "groups / full"], rows)
    return result


def kv_dtype_rows(prompts, output_lens, args, common) -> dict:
    """The paged run at one KV byte budget for each kv_cache_dtype (see the module docstring)."""
    from models.llama import LlamaConfig
    from models.kv_cache_spec import kv_cache_bytes_per_token

    config = LlamaConfig.from_preset(args.kv_model, dtype="bfloat16")
    budget_bytes = args.kv_budget_tokens * kv_cache_bytes_per_token(config, "auto")
    variants = [("float32", "auto", "-"), ("bfloat16", "auto", "-"), ("bfloat16", "fp8", "per_token"),
                ("bfloat16", "int8", "per_token"), ("bfloat16", "fp8", "per_tensor")]
    out, rows = {}, []
    base = None
    for dtype, kv, scaling in variants:
        per_token = kv_cache_bytes_per_token(LlamaConfig.from_preset(args.kv_model, dtype=dtype), kv,
                                             "per_token" if scaling == "-" else scaling)
        tokens = budget_bytes // per_token // args.block_size * args.block_size
        run = simulate(prompts, output_lens, block_size=args.block_size, **{**common, "budget_tokens": tokens})
        name = f"{dtype} / {kv}" + ("" if scaling == "-" else f" / {scaling}")
        out[name] = dict(bytes_per_token=per_token, tokens=tokens, max_concurrent=run["max_concurrent"],
                         mean_concurrent_kv_bound=run["mean_concurrent_kv_bound"], steps=run["steps"],
                         num_preemptions=run["num_preemptions"])
        if (dtype, kv) == ("bfloat16", "auto"):
            base = out[name]
    for name, r in out.items():
        rows.append([name, f"{r['bytes_per_token'] / 1024:.1f}", r["tokens"], f"{r['tokens'] / base['tokens']:.2f}x",
                     r["max_concurrent"], f"{r['mean_concurrent_kv_bound']:.1f}",
                     f"{r['mean_concurrent_kv_bound'] / base['mean_concurrent_kv_bound']:.2f}x", r["steps"]])
    print_table(f"Same KV budget ({budget_bytes / 2**30:.2f} GiB = {args.kv_budget_tokens} bf16 tokens of "
                f"{args.kv_model}), paged block {args.block_size}, per kv_cache_dtype",
                ["dtype / kv_cache_dtype", "KiB / token", "tokens held", "vs bf16", "max requests at once",
                 "mean at once, queued", "vs bf16", "steps to drain"], rows)
    return dict(kv_model=args.kv_model, budget_bytes=budget_bytes, rows=out)


if __name__ == "__main__":
    sys.exit(main())
