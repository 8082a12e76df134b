"""Speculative decoding with prompt lookup (n-gram) against plain decoding: SmolLM2-135M-Instruct.

    python scripts/bench_spec_decode.py [--quick] [--runs 3] [--new-tokens 128] [--k 6] [--lookup-min 2]
        [--lookup-max 6] [--disable-by-batch-size 8] [--weight-dtype auto] [--activation-dtype float32]
        [--batches 1 16] [--workloads repetitive open] [--out PATH]

Two engines over one loaded model (the GGUF, --weight-dtype as LLM's weight_dtype), one with
speculative_config={"method": "ngram", "num_speculative_tokens": k (6), "prompt_lookup_min":
--lookup-min (2), "prompt_lookup_max": --lookup-max (6), "disable_by_batch_size":
--disable-by-batch-size (8; 0 for none)} and one without, run side by side (alternating which
goes first in each run; medians). Greedy, EOS disabled, --new-tokens tokens per request.

Workloads (chat prompts with the model's template, over passages of Python's own docs):
- repetitive: "Rewrite this passage with one change: ..." (the answer copies the passage, so
  prompt lookup finds what comes next);
- open: "Write a short story about ..." / questions whose answers do not repeat the prompt.
Batch 1 (one request at a time, each its own generate) and batch 16 (16 requests at once).

Decode tokens/s: every prompt is run once before the timed runs, so the timed runs find it
in the prefix cache and prefill only its last block; output tokens / wall time then measures
decoding. Both engines must give identical tokens (checked, printed). Writes
results/bench_spec_decode.json (results/bench_spec_decode_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from _bench_common import command_line, machine_info, median, print_table, write_json

MODEL = "smollm2-135m-instruct"
CHANGES = [("the", "a"), ("is", "was"), ("and", "or"), ("a", "the"), ("to", "into"), ("of", "for")]
TOPICS = ["a lighthouse keeper", "a robot learning to paint", "two rival bakers", "a lost umbrella",
          "a city under the sea", "a time-travelling cat", "a chess tournament", "an old violin",
          "a mountain village", "a detective in Venice", "a friendly dragon", "a long train journey",
          "a garden on Mars", "a forgotten library", "a storm at sea", "a clockmaker's apprentice"]


def passages(n: int, seed: int) -> list[str]:
    """n passages of 60-120 words of Python's docs (real English and code)."""
    from pydoc_data.topics import topics

    rng = np.random.default_rng(seed)
    texts = [" ".join(t.split()) for t in topics.values() if len(t.split()) >= 60]
    picked = rng.choice(len(texts), n, replace=False)
    return [" ".join(texts[i].split()[: int(rng.integers(60, 121))]) for i in picked]


def workloads(engine, n: int, seed: int) -> dict[str, list[list[int]]]:
    repetitive, open_ended = [], []
    for i, passage in enumerate(passages(n, seed)):
        old, new = CHANGES[i % len(CHANGES)]
        ask = (f"Rewrite this passage with one change: replace the first '{old}' with '{new}'. Keep every "
               f"other word exactly as it is.\n\n{passage}")
        repetitive.append(engine.chat_prompt([{"role": "user", "content": ask}])[0])
        open_ended.append(engine.chat_prompt([{"role": "user", "content": f"Write a short story about "
                                               f"{TOPICS[i % len(TOPICS)]}."}])[0])
    return {"repetitive": repetitive, "open": open_ended}


def run(engine, prompts: list[list[int]], batch: int, new_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds, tokens per prompt) for the prompts in batches of `batch`, each to completion."""
    from paged_jax import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs = {}
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        for i in range(first, min(first + batch, len(prompts))):
            engine.add_request(f"p{i}-{time.monotonic_ns()}", prompts[i], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    ordered = [outputs[k] for k in sorted(outputs, key=lambda k: int(k.split("-")[0][1:]))]
    return seconds, ordered


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 prompts per batch-1 row, 48 tokens, 1 run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=6, help="num_speculative_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-dtype", default="auto", help="LLM's weight_dtype (auto keeps the GGUF's blocks)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16], choices=[1, 16],
                        help="which batch sizes to run (default both)")
    parser.add_argument("--workloads", nargs="+", default=["repetitive", "open"], choices=["repetitive", "open"],
                        help="which workloads to run (default both)")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=6, help="prompt_lookup_max")
    parser.add_argument("--disable-by-batch-size", type=int, default=8,
                        help="speculative_config's disable_by_batch_size (0: none, always propose)")
    parser.add_argument("--out", default=None, help="JSON path (default results/bench_spec_decode[_quick].json)")
    parser.add_argument("--activation-dtype", default="float32", choices=["float32", "int8"],
                        help="LLM's activation_dtype (int8: llama.cpp's Q8 activations in the packed matmuls)")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.new_tokens = 1, 48
    from paged_jax import LLM
    from paged_jax.engine import LLMEngine
    from paged_jax.engine_config import EngineConfig

    settings = dict(model=MODEL, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512, num_blocks=2048,
                    warm_up="full", weight_dtype=args.weight_dtype,
                    activation_dtype=args.activation_dtype)
    args.disable_by_batch_size = args.disable_by_batch_size or None  # 0: always propose
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max, "disable_by_batch_size": args.disable_by_batch_size}
    base = LLM(**settings).engine
    engines = {"plain": base,
               "ngram": LLMEngine(EngineConfig(**settings, speculative_config=spec), model=base.model,
                                  tokenizer=base.tokenizer)}
    work = workloads(base, 16, args.seed)
    batch_one = 4 if args.quick else 8  # prompts timed one at a time
    cases = [(name, batch, prompts[:batch_one] if batch == 1 else prompts)
             for batch in args.batches for name, prompts in work.items() if name in args.workloads]
    for engine in engines.values():  # prefix-cache every prompt; compile nothing in the timed runs
        for _, batch, prompts in cases:
            run(engine, prompts, batch, 2)
    compiled = {name: e.get_stats()["num_compilations"] for name, e in engines.items()}

    rows, results = [], []
    for workload, batch, prompts in cases:
        seconds = {name: [] for name in engines}
        tokens = {}
        spec_before = engines["ngram"].get_stats()
        for r in range(args.runs):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in order:
                s, out = run(engines[name], prompts, batch, args.new_tokens)
                seconds[name].append(s)
                tokens[name] = out
        spec_after = engines["ngram"].get_stats()
        num_tokens = sum(len(t) for t in tokens["plain"])
        tok_s = {name: num_tokens / median(s) for name, s in seconds.items()}
        proposed = spec_after["spec_num_draft_tokens"] - spec_before["spec_num_draft_tokens"]
        accepted = spec_after["spec_num_accepted_tokens"] - spec_before["spec_num_accepted_tokens"]
        drafts = spec_after["spec_num_drafts"] - spec_before["spec_num_drafts"]
        identical = tokens["plain"] == tokens["ngram"]
        result = {"workload": workload, "batch": batch, "prompts": len(prompts), "tokens": num_tokens,
                  "plain_tok_s": tok_s["plain"], "ngram_tok_s": tok_s["ngram"],
                  "speedup": tok_s["ngram"] / tok_s["plain"], "proposed": proposed, "accepted": accepted,
                  "acceptance_rate": accepted / proposed if proposed else 0.0,
                  "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
                  "identical": identical, "seconds": seconds}
        results.append(result)
        rows.append([workload, batch, len(prompts), f"{tok_s['plain']:.1f}", f"{tok_s['ngram']:.1f}",
                     f"{result['speedup']:.2f}x", f"{result['acceptance_rate']:.2f}",
                     f"{result['mean_accepted_length']:.2f}", "yes" if identical else "NO"])
    for name, engine in engines.items():
        assert engine.get_stats()["num_compilations"] == compiled[name], f"{name}: a timed run compiled"
    info = machine_info()
    print_table(f"prompt-lookup speculative decoding, {MODEL} (weight_dtype {args.weight_dtype}, activation_dtype "
                f"{args.activation_dtype}), k={args.k}, lookup {args.lookup_min}..{args.lookup_max}, "
                f"disable_by_batch_size {args.disable_by_batch_size}, "
                f"{args.new_tokens} tokens, greedy; "
                f"medians of {args.runs} runs; {info['cpu']}",
                ["workload", "batch", "prompts", "plain tok/s", "ngram tok/s", "speedup", "acceptance",
                 "mean accepted length", "identical"], rows)
    write_json(args.out or f"results/bench_spec_decode{'_quick' if args.quick else ''}.json",
               {"command": command_line(), "machine": info, "k": args.k, "new_tokens": args.new_tokens,
                "weight_dtype": args.weight_dtype, "activation_dtype": args.activation_dtype,
                "disable_by_batch_size": args.disable_by_batch_size,
                "runs": args.runs, "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max,
                "results": results})
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
