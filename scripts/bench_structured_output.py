"""Constrained decoding's cost per step on SmolLM2-135M-Instruct: free vs guided vs penalized.

    python scripts/bench_structured_output.py [--quick] [--runs 3] [--batch 32] [--new-tokens 64]

One engine (LLM.generate, the GGUF), the same chat prompts in every row, EOS ignored so that
every row decodes exactly --new-tokens tokens per request; rows alternate order between runs
(medians). Rows:
- free: plain sampling (the plain head program);
- regex `[a-z ,.]+` (a grammar that never closes: every step computes every row's mask);
- a JSON schema (an open array of objects with a string, an enum and a bounded integer;
  after the array closes the grammar allows only EOS, still masked each step);
- penalties (repetition 1.2, presence 0.3, frequency 0.3: the processed head, no mask);
- mixed: half the requests regex-guided, half free (the batch vLLM serves).
Each row reports tok/s, ms per decode step, and the host time the llguidance matchers take
(fill_bitmask, timed around the engine's call) per step. Every prompt is prefix-cached before
the timed runs and nothing compiles during them (checked). Writes
results/bench_structured_output.json (_quick with --quick).
"""

from __future__ import annotations

import argparse
import os
import time

from _bench_common import REPO, command_line, machine_info, median, print_table, write_json

MODEL = "smollm2-135m-instruct"
TOPICS = ["a lighthouse keeper", "a robot learning to paint", "two rival bakers", "a lost umbrella",
          "a city under the sea", "a time-travelling cat", "a chess tournament", "an old violin"]
SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "kind": {"enum": ["person", "place", "thing"]},
    "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
    "required": ["name", "kind", "year"], "additionalProperties": False}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 run, 32 tokens")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.new_tokens = 1, 32
    from paged_jax import LLM, GuidedDecodingParams, SamplingParams

    llm = LLM(model=MODEL, max_model_len=1024, max_num_seqs=args.batch, max_num_batched_tokens=512,
              warm_up="full")
    engine = llm.engine
    prompts = [engine.chat_prompt([{"role": "user", "content": f"List things in a story about {TOPICS[i % 8]}, "
                                    f"as JSON ({i})."}])[0] for i in range(args.batch)]
    base = dict(max_tokens=args.new_tokens, temperature=0.8, ignore_eos=True)
    regex = GuidedDecodingParams(regex=r"[a-z ,.]+")
    rows = {
        "free": [SamplingParams(seed=i, **base) for i in range(args.batch)],
        "regex": [SamplingParams(seed=i, guided_decoding=regex, **base) for i in range(args.batch)],
        "json schema": [SamplingParams(seed=i, guided_decoding=GuidedDecodingParams(json=SCHEMA), **base)
                        for i in range(args.batch)],
        "penalties": [SamplingParams(seed=i, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.3,
                                     **base) for i in range(args.batch)],
        "mixed (half regex)": [SamplingParams(seed=i, guided_decoding=regex if i % 2 else None, **base)
                               for i in range(args.batch)],
    }
    manager = engine.structured_output
    fill = manager.fill_bitmask
    fill_seconds = []

    def timed_fill(bitmask, rows_):
        start = time.perf_counter()
        fill(bitmask, rows_)
        fill_seconds.append(time.perf_counter() - start)

    manager.fill_bitmask = timed_fill  # the engine looks the method up at each step
    step = engine.step
    num_steps = [0]

    def counted_step():
        num_steps[0] += 1
        return step()

    engine.step = counted_step  # LLM.generate calls engine.step() per step
    for params in rows.values():  # prefix-cache the prompts, compile the processed heads
        llm.generate(prompts, params, use_tqdm=False)
    compiled = engine.get_stats()["num_compilations"]

    seconds = {name: [] for name in rows}
    fills = {name: [] for name in rows}
    steps = {name: [] for name in rows}
    for r in range(args.runs):
        for name in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
            fill_seconds.clear()
            before = num_steps[0]
            start = time.perf_counter()
            outputs = llm.generate(prompts, rows[name], use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
            assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outputs)
            fills[name].append(sum(fill_seconds))
            steps[name].append(num_steps[0] - before)
    assert engine.get_stats()["num_compilations"] == compiled, "a timed run compiled"
    num_tokens = args.batch * args.new_tokens
    free_s = median(seconds["free"])
    table, results = [], []
    for name in rows:
        s, n_steps = median(seconds[name]), median(steps[name])
        fill_ms = 1e3 * median(fills[name]) / n_steps
        results.append({"row": name, "tok_s": num_tokens / s, "seconds": seconds[name], "steps": n_steps,
                        "ms_per_step": 1e3 * s / n_steps, "fill_ms_per_step": fill_ms})
        table.append([name, f"{num_tokens / s:.1f}", f"{free_s / s:.0%}", f"{1e3 * s / n_steps:.1f}",
                      f"{1e3 * (s - free_s) / n_steps:+.1f}", f"{fill_ms:.2f}"])
    info = machine_info()
    print_table(f"constrained decoding, {args.batch} requests x {args.new_tokens} tokens, SmolLM2 GGUF, medians of "
                f"{args.runs} runs ({info.get('cpu', '')})",
                ["row", "tok/s", "vs free", "ms / step", "vs free ms", "mask fill ms / step"], table)
    suffix = "_quick" if args.quick else ""
    write_json(os.path.join(REPO, "results", f"bench_structured_output{suffix}.json"),
               {"command": command_line(), "machine": info, "batch": args.batch, "new_tokens": args.new_tokens,
                "rows": results})
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
