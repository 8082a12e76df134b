"""KV-cache quantization (fp8_e4m3, fp8_e5m2, int8) and bf16 pages against the f32 cache: quality and speed.

    python scripts/bench_kv_quant.py --quality [--passages 32 --tokens 256 --prompts 32 --new-tokens 64]
    python scripts/bench_kv_quant.py --speed [--context 2048 --seqs 16 --steps 8]
    python scripts/bench_kv_quant.py --key-study [--passages 32 --tokens 256]

--quality (SmolLM2-135M-Instruct, the real GGUF, float32 compute):
- teacher-forced perplexity on --passages passages of Python's documentation
  (pydoc_data.topics, --tokens tokens each), one prefill per passage through a paged cache of
  each format (K/V quantized on write, read through the XLA attention path; bfloat16: pages
  of bf16, kv_cache_dtype="bfloat16" under the f32 model), and next-token
  top-1 agreement with the unquantized cache over every position;
- the seed's warning (softmax is most sensitive to key error): each format with K alone and
  V alone quantized (quantize-dequantize of the one tensor, the other unquantized);
- key offsets (kv_key_offsets: each layer's mean key, subtracted before the keys are stored)
  zeros and calibrated (paged_jax/kv_calibration.py) on 4 other passages;
- per-tensor static scales: 1.0, and calibrated together with the key offsets;
- greedy agreement: --prompts chat questions x --new-tokens tokens through LLM.generate with
  kv_cache_dtype=... (and calibrated key offsets) against kv_cache_dtype="auto" (identical
  prompts; tokens before the first divergence).
--speed: decode steps of the benchmark-shaped model at --context tokens of context for --seqs
  sequences (pool pages filled with random values, block tables random), the formats
  interleaved run by run; decode tokens/s (median) and the K/V bytes each step reads; and a
  prefill step of --prefill-tokens tokens (what quantize-on-write costs).
--key-study: what each of the pool's three defences against key error buys fp8_e4m3 with
  per-token scales (teacher-forced, as --quality), each alone and together, with K and V
  quantized and dequantized on write here over the unquantized backend: the per-token scale
  searched among 8 (amax / 448 x 2^(j/8), the one with the least squared error of the row: 3
  mantissa bits put the grid differently for each); the Hadamard rotation of q and k per head
  (q.k is unchanged; the rotated key spreads its outlier channels over all of them); the
  per-layer, per-channel key mean calibrated on 4 other passages and subtracted before
  quantizing (softmax is blind to one offset shared by every key of a query). The pool does
  the first two always and the third with kv_key_offsets. --calibration-text FILE adds the
  pool with offsets calibrated on the first 4 x --tokens tokens of FILE instead (another
  domain than the evaluation's: does the calibration carry over?).
Writes results/bench_kv_quant_<mode>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np

from _bench_common import command_line, greedy_agreement, machine_info, median, print_table, write_json

MODEL = "smollm2-135m-instruct"
FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8")


def eval_passages(tokenizer, num: int, num_tokens: int, skip: int = 0) -> list[list[int]]:
    """The first num_tokens tokens of documentation topics long enough, in name order, after `skip`."""
    from paged_jax.kv_calibration import documentation_passages

    out = documentation_passages(tokenizer, num_tokens)
    if len(out) < num + skip:
        raise SystemExit(f"only {len(out)} topics have {num_tokens} tokens; lower --tokens")
    return out[skip : skip + num]


CHAT_QUESTIONS = [
    "What is the capital of France?", "Explain recursion to a child.", "Write a haiku about the sea.",
    "How do vaccines work?", "Give three tips for learning a new language.", "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.", "What is a prime number?", "How does a bicycle stay upright?",
    "Write a short poem about autumn leaves.", "What is the difference between weather and climate?",
    "Explain what a database index is.", "Why is the sky blue?", "Describe how to make a cup of tea.",
    "What are the planets in the solar system?", "Explain photosynthesis in simple terms.",
    "What is machine learning?", "Give me a recipe idea for dinner with rice and beans.",
    "How do airplanes fly?", "What is the Pythagorean theorem?", "Tell me a fun fact about octopuses.",
    "How can I improve my sleep?", "What does a CPU do?", "Explain the water cycle.",
    "What is the meaning of the word 'ephemeral'?", "Write a limerick about a cat.",
    "Why do we have leap years?", "How does compound interest work?", "What is an API?",
    "Describe the city of Tokyo in two sentences.", "What is gravity?", "How do I sort a list in Python?",
]


@dataclasses.dataclass(frozen=True)
class FakeQuantAttention:
    """The unquantized backend with K alone or V alone quantized and dequantized on write (per
    token; keys rotated by key_rotation first and back after, as the pool stores them), for the
    K-vs-V sensitivity rows: the same values a quantized page of that tensor stands for, the
    other tensor exact."""

    base: object
    kv_cache_dtype: str
    tensor: str  # "k" or "v"

    @property
    def spec(self):
        return self.base.spec

    def __call__(self, q, k, v, kv_cache, attn_metadata, *, sm_scale):
        import jax.numpy as jnp

        from paged_jax.core.kv_quant import FORMATS as QUANT_FORMATS, key_rotation

        fmt = QUANT_FORMATS[self.kv_cache_dtype]
        if self.tensor == "k":
            rotation = jnp.asarray(key_rotation(k.shape[-1]), k.dtype)
            k = fake_quantize(k @ rotation, fmt) @ rotation.T
        else:
            v = fake_quantize(v, fmt)
        return self.base(q, k, v, kv_cache, attn_metadata, sm_scale=sm_scale)


def fake_quantize(x, fmt, search: bool = True):
    """x quantized to fmt per row and dequantized, in x's dtype: the value a page of the pool
    stands for (search=False: the plain amax / max_value scale, without the fp8 scale search)."""
    import jax.numpy as jnp

    from paged_jax.core.kv_quant import MIN_SCALE
    from pallas_kernels.kv_cache_write import dequantize_pages, quantize_rows

    scale = None if search else jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1) / fmt.max_value,
                                            MIN_SCALE)
    stored, row_scale = quantize_rows(x, fmt, scale)
    return dequantize_pages(stored, row_scale).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class KeyStudyAttention:
    """The unquantized backend with K and V quantized and dequantized on write in fp8_e4m3,
    per token, after the --key-study transforms (scale search, rotation, key mean)."""

    base: object
    search_scale: bool = False
    rotate: bool = False
    key_mean: object = None  # this layer's f32[K, H], bound per layer (paged_prefill's key_offsets)

    @property
    def spec(self):
        return self.base.spec

    def bind(self, key_offset):
        return dataclasses.replace(self, key_mean=key_offset)

    def __call__(self, q, k, v, kv_cache, attn_metadata, *, sm_scale):
        import jax.numpy as jnp

        from paged_jax.core.kv_quant import FORMATS as QUANT_FORMATS, key_rotation

        fmt = QUANT_FORMATS["fp8_e4m3"]
        if self.key_mean is not None:
            k = k - self.key_mean.astype(k.dtype)
        if self.rotate:
            h = jnp.asarray(key_rotation(q.shape[-1]), q.dtype)
            q, k = q @ h, k @ h
        k, v = fake_quantize(k, fmt, self.search_scale), fake_quantize(v, fmt, self.search_scale)
        return self.base(q, k, v, kv_cache, attn_metadata, sm_scale=sm_scale)


def key_study(args) -> dict:
    from models.registry import load_model, load_tokenizer
    from paged_jax.attention import make_attention_backend
    from paged_jax.kv_calibration import calibrate_key_offsets, text_passages

    model = load_model(MODEL, dtype="float32")
    tokenizer = load_tokenizer(MODEL)
    passages = eval_passages(tokenizer, args.passages, args.tokens)
    means = calibrate_key_offsets(model, eval_passages(tokenizer, 4, args.tokens, skip=args.passages))  # held out
    auto_spec = model.kv_cache_specs("float32")[0]
    base = make_attention_backend(auto_spec, "xla")
    variants = [
        ("unquantized", "-", dict()),
        ("none (amax / 448 per token)", "-", dict(attention=KeyStudyAttention(base))),
        ("scale searched among 8", "-", dict(attention=KeyStudyAttention(base, True))),
        ("q, k rotated (Hadamard)", "-", dict(attention=KeyStudyAttention(base, False, True))),
        ("rotated, scale searched", "-", dict(attention=KeyStudyAttention(base, True, True))),
        ("key mean subtracted", "4 passages", dict(attention=KeyStudyAttention(base), key_offsets=means)),
        ("key mean subtracted, rotated, scale searched", "4 passages",
         dict(attention=KeyStudyAttention(base, True, True), key_offsets=means)),
        ("the pool's fp8_e4m3 (searched, rotated)", "-", dict(spec=model.kv_cache_specs(None, "fp8_e4m3")[0])),
        ("the pool's fp8_e4m3 with kv_key_offsets", "4 passages",
         dict(spec=model.kv_cache_specs(None, "fp8_e4m3")[0], key_offsets=means)),
    ]
    if args.calibration_text:
        with open(args.calibration_text, encoding="utf-8") as f:
            ids = tokenizer.encode(f.read())
        if len(ids) < 4 * args.tokens:
            raise SystemExit(f"--calibration-text holds {len(ids)} tokens, fewer than 4 x --tokens")
        other = calibrate_key_offsets(model, text_passages(ids, 4, args.tokens))
        variants.append(("the pool's fp8_e4m3 with kv_key_offsets", os.path.basename(args.calibration_text),
                         dict(spec=model.kv_cache_specs(None, "fp8_e4m3")[0], key_offsets=other)))
    rows, results, ref = [], [], None
    for name, calibration, kwargs in variants:
        kwargs.setdefault("spec", auto_spec)
        nll, count, argmax = teacher_forced(model, passages, **kwargs)
        ppl = float(np.exp(nll / count))
        ref = ref or (argmax, ppl)
        top1 = float(np.mean(argmax == ref[0]))
        results.append(dict(variant=name, calibration=calibration, perplexity=ppl, ppl_ratio=ppl / ref[1],
                            top1_agreement=top1, positions=count))
        rows.append([name, calibration, f"{ppl:.4f}", f"{100 * (ppl / ref[1] - 1):+.2f}%", f"{100 * top1:.2f}%"])
        print(rows[-1], flush=True)
    print_table(f"fp8_e4m3 K and V, per-token scales: what lowers the key error ({MODEL}, {len(passages)} passages x "
                f"{args.tokens} tokens, teacher-forced, float32 compute)",
                ["variant", "calibration", "perplexity", "vs unquantized", "top-1 agreement"], rows)
    return dict(variants=results, passages=len(passages), tokens=args.tokens)


def teacher_forced(model, passages, spec, *, kv_scales=None, key_offsets=None, attention=None):
    """(sum of NLL, number of predicted tokens, argmax per position) over the passages."""
    import jax
    import jax.numpy as jnp

    from paged_jax.kv_calibration import paged_prefill

    nll, count, argmax = 0.0, 0, []
    for ids in passages:
        logits, _ = paged_prefill(model, ids, spec, kv_scales=kv_scales, key_offsets=key_offsets, attention=attention)
        logp = jax.nn.log_softmax(logits[:-1], axis=-1)
        targets = jnp.asarray(ids[1:])
        nll -= float(jnp.sum(jnp.take_along_axis(logp, targets[:, None], axis=1)))
        count += len(ids) - 1
        argmax.append(np.asarray(jnp.argmax(logits[:-1], axis=-1)))
    return nll, count, np.concatenate(argmax)


def quality(args) -> dict:
    from models.registry import load_model, load_tokenizer
    from paged_jax import LLM, SamplingParams
    from paged_jax.attention import make_attention_backend
    from paged_jax.kv_calibration import calibrate_key_offsets, calibrate_kv_scales

    model = load_model(MODEL, dtype="float32")
    tokenizer = load_tokenizer(MODEL)
    passages = eval_passages(tokenizer, args.passages, args.tokens)
    calibration = eval_passages(tokenizer, 4, args.tokens, skip=args.passages)  # held out
    auto_spec = model.kv_cache_specs("float32")[0]
    offsets = calibrate_key_offsets(model, calibration)

    variants = [("auto", "-", dict(spec=auto_spec)),
                ("bfloat16", "-", dict(spec=model.kv_cache_specs("float32", "bfloat16")[0]))]
    for name in FORMATS:
        variants.append((name, "per_token", dict(spec=model.kv_cache_specs(None, name)[0])))
        variants.append((name, "per_token, key offsets calibrated",
                         dict(spec=model.kv_cache_specs(None, name)[0], key_offsets=offsets)))
    for name in FORMATS:
        for tensor in ("k", "v"):
            variants.append((f"{name} {tensor.upper()} only", "per_token", dict(
                spec=auto_spec, attention=FakeQuantAttention(make_attention_backend(auto_spec, "xla"), name, tensor))))
    for name in ("fp8_e4m3", "int8"):
        spec = model.kv_cache_specs(None, name, "per_tensor")[0]
        variants.append((name, "per_tensor 1.0", dict(spec=spec)))
        scales = calibrate_kv_scales(model, calibration, name, key_offsets=offsets)
        variants.append((name, "per_tensor, scales and key offsets calibrated",
                         dict(spec=spec, kv_scales=scales, key_offsets=offsets)))

    rows, results = [], []
    ref_argmax = ref_ppl = None
    for name, scaling, kwargs in variants:
        start = time.perf_counter()
        nll, count, argmax = teacher_forced(model, passages, **kwargs)
        ppl = float(np.exp(nll / count))
        if ref_argmax is None:
            ref_argmax, ref_ppl = argmax, ppl
        top1 = float(np.mean(argmax == ref_argmax))
        results.append(dict(kv_cache_dtype=name, scaling=scaling, perplexity=ppl, ppl_ratio=ppl / ref_ppl,
                            top1_agreement=top1, positions=count, seconds=time.perf_counter() - start))
        rows.append([name, scaling, f"{ppl:.4f}", f"{100 * (ppl / ref_ppl - 1):+.2f}%", f"{100 * top1:.2f}%"])
        print(rows[-1], flush=True)
    print_table(f"Teacher-forced perplexity, {MODEL}, {len(passages)} passages x {args.tokens} tokens "
                f"(pydoc_data.topics), float32 compute", ["kv_cache_dtype", "scales", "perplexity", "vs auto",
                                                          "top-1 agreement"], rows)

    # greedy chat generations through the engine
    questions = CHAT_QUESTIONS[: args.prompts]
    greedy_rows, greedy = [], {}
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    outputs = {}
    runs = [("auto", "auto", None), ("bfloat16", "bfloat16", None)] + [(name, name, None) for name in FORMATS] + [
        (f"{name}, key offsets calibrated", name, offsets) for name in FORMATS]
    for label, name, key_offsets in runs:
        llm = LLM(MODEL, dtype="float32", kv_cache_dtype=name, kv_key_offsets=key_offsets, max_model_len=512,
                  max_num_seqs=len(questions), max_num_batched_tokens=512, warm_up="full")
        prompts = [llm.engine.chat_prompt([{"role": "user", "content": q}])[0] for q in questions]
        outputs[label] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    for label, _, _ in runs[1:]:
        greedy[label] = agree = greedy_agreement(outputs[label], outputs["auto"])
        greedy_rows.append([label, f"{100 * agree['identical_prompts']:.1f}%",
                            f"{100 * agree['tokens_before_first_divergence']:.1f}%"])
    print_table(f"Greedy agreement with kv_cache_dtype='auto', {len(questions)} chat prompts x {args.new_tokens} "
                "tokens (LLM.generate)", ["kv_cache_dtype", "identical prompts", "tokens before first divergence"],
                greedy_rows)
    return dict(teacher_forced=results, greedy=greedy, passages=len(passages), tokens=args.tokens,
                prompts=len(questions), new_tokens=args.new_tokens)


def speed(args) -> dict:
    """Decode steps at long context, formats interleaved, on this machine's default backend."""
    import jax

    from _bench_common import BENCH_MODEL
    from models.llama import LlamaConfig, LlamaForCausalLM
    from paged_jax.core.config import CacheConfig, SchedulerConfig
    from paged_jax.core.step_inputs import ModelInputs, SamplingMetadata, StepAttentionMetadata, StepInputs
    from paged_jax.engine_config import EngineConfig, ResolvedConfig
    from paged_jax.runner import ModelRunner
    from flax import nnx

    b = BENCH_MODEL
    config = LlamaConfig(vocab_size=b["vocab_size"], hidden_size=b["hidden_size"],
                         intermediate_size=b["intermediate_size"], num_layers=b["num_hidden_layers"],
                         num_heads=b["num_attention_heads"], num_kv_heads=b["num_key_value_heads"],
                         head_dim=b["hidden_size"] // b["num_attention_heads"], max_position_embeddings=8192,
                         dtype=args.dtype, param_dtype=args.dtype)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    block_size, s, ctx = 16, args.seqs, args.context
    pages_per_seq = -(-(ctx + 1) // block_size)
    num_blocks = s * pages_per_seq + 1
    max_model_len = pages_per_seq * block_size
    rng = np.random.default_rng(0)
    tables = (1 + rng.permutation(s * pages_per_seq)).reshape(s, pages_per_seq).astype(np.int32)
    inputs = StepInputs(
        ModelInputs(token_ids=rng.integers(0, config.vocab_size, s).astype(np.int32),
                    positions=np.full(s, ctx, np.int32), logits_indices=np.arange(s, dtype=np.int32)),
        StepAttentionMetadata(  # one KV-cache group
            slot_mapping=(tables[:, ctx // block_size] * block_size + ctx % block_size).astype(np.int32)[None],
            block_tables=tables[None], seq_lens=np.full(s, ctx + 1, np.int32),
            query_start_loc=np.arange(s + 1, dtype=np.int32), num_seqs=np.array([s], np.int32)),
        SamplingMetadata(temperature=np.zeros(s, np.float32), top_k=np.zeros(s, np.int32),
                         top_p=np.ones(s, np.float32), rng_keys=np.zeros((s, 2), np.uint32)))
    # a prefill step: --prefill-tokens tokens of one more sequence into pages of its own (the
    # write path quantizes every one of them: the fp8 scale search and the key rotation)
    p = args.prefill_tokens
    prefill_table = np.zeros((s, pages_per_seq), np.int32)
    prefill_table[0, : -(-p // block_size)] = tables[0, : -(-p // block_size)]
    prefill = StepInputs(
        ModelInputs(token_ids=rng.integers(0, config.vocab_size, p).astype(np.int32),
                    positions=np.arange(p, dtype=np.int32), logits_indices=np.full(s, p - 1, np.int32)),
        StepAttentionMetadata(slot_mapping=(prefill_table[0, np.arange(p) // block_size] * block_size
                                            + np.arange(p) % block_size).astype(np.int32)[None],
                              block_tables=prefill_table[None], seq_lens=np.array([p] + [0] * (s - 1), np.int32),
                              query_start_loc=np.array([0] + [p] * s, np.int32), num_seqs=np.array([1], np.int32)),
        inputs.sampling)
    runners = {}
    for name in ("auto", *FORMATS):
        runner = ModelRunner(model, ResolvedConfig(EngineConfig(kv_cache_dtype=name, attention_impl=args.impl),
                                                   CacheConfig(block_size, num_blocks, max_model_len),
                                                   SchedulerConfig(s, max(s, p), max_model_len)))
        keys = jax.random.split(jax.random.key(1), 4 * len(runner.kv_caches))
        caches = []
        for i, cache in enumerate(runner.kv_caches):  # random pages (and positive scales) everywhere
            caches.append(tuple(
                (jax.random.uniform(keys[4 * i + j], a.shape, minval=0.001, maxval=0.02) if j >= 2 else
                 (jax.random.normal(keys[4 * i + j], a.shape) * (1 if name == "auto" else 40))).astype(a.dtype)
                for j, a in enumerate(cache)))
        runner.kv_caches = caches
        runner.execute(inputs)  # compile
        runner.execute(prefill)
        kv_bytes = sum(a.nbytes for c in caches for a in c) * (s * (ctx + 1)) / (num_blocks * block_size)
        runners[name] = (runner, kv_bytes)
    times = {name: [] for name in runners}
    prefill_times = {name: [] for name in runners}
    for _ in range(args.steps):
        for name, (runner, _) in runners.items():  # interleaved: drift hits every format alike
            start = time.perf_counter()
            runner.execute(inputs)
            times[name].append(time.perf_counter() - start)
            start = time.perf_counter()
            runner.execute(prefill)
            prefill_times[name].append(time.perf_counter() - start)
    base, prefill_base = median(times["auto"]), median(prefill_times["auto"])
    rows, out = [], {}
    for name, (runner, kv_bytes) in runners.items():
        t, tp = median(times[name]), median(prefill_times[name])
        out[name] = dict(step_ms=1e3 * t, decode_tok_s=s / t, kv_bytes_read_per_step=kv_bytes,
                         speedup_vs_auto=base / t, prefill_step_ms=1e3 * tp, prefill_vs_auto=prefill_base / tp)
        rows.append([name, f"{1e3 * t:.1f}", f"{s / t:.1f}", f"{kv_bytes / 2**20:.1f}", f"{base / t:.2f}x",
                     f"{1e3 * tp:.1f}", f"{prefill_base / tp:.2f}x"])
    print_table(f"Decode, {s} sequences x {ctx} tokens of context, and a prefill of {p} tokens, {config.num_layers} "
                f"layers, {config.num_kv_heads} KV heads x {config.head_dim}, {args.dtype} compute, "
                f"attention={runners['auto'][0].attention_impl}, "
                f"{jax.default_backend()}; median of {args.steps} interleaved steps",
                ["kv_cache_dtype", "decode step ms", "decode tok/s", "K/V MiB read / step", "vs auto",
                 "prefill step ms", "vs auto"], rows)
    return dict(formats=out, seqs=s, context=ctx, prefill_tokens=p, dtype=args.dtype, impl=args.impl,
                steps=args.steps, backend=jax.default_backend())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quality", action="store_true")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--key-study", action="store_true")
    parser.add_argument("--passages", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--calibration-text", default=None, help="--key-study: also calibrate on this text file")
    parser.add_argument("--prefill-tokens", type=int, default=512, help="tokens of the speed run's prefill step")
    parser.add_argument("--dtype", default="float32", help="compute dtype of the speed model")
    parser.add_argument("--impl", default=None, help="attention impl of the speed run (default: the platform's)")
    parser.add_argument("--out", default=None, help="results file (default: results/bench_kv_quant_<mode>.json)")
    args = parser.parse_args(argv)
    modes = [name for name in ("quality", "speed", "key_study") if getattr(args, name)]
    if len(modes) != 1:
        parser.error("pass exactly one of --quality, --speed and --key-study")
    mode = modes[0]
    result = {"quality": quality, "speed": speed, "key_study": key_study}[mode](args)
    write_json(args.out or os.path.join("results", f"bench_kv_quant_{mode}.json"),
               dict(command=command_line(), machine=machine_info(), **result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
