"""A real trained model end to end: SmolLM2-135M-Instruct (GGUF) on paged-jax vs transformers.

    python scripts/bench_real_model.py [--quick] [--runs 3] [--new-tokens 64] [--prompts 16]

Prompts: chat questions ("Summarize this passage: ...") around passages of Python's own
documentation (pydoc_data.topics), 40-250 words each, rendered with the model's ChatML
template. Both sides read the same GGUF (transformers through gguf_file=..., dequantized to
float32) and decode greedily for --new-tokens tokens with EOS disabled (ours: ignore_eos;
theirs: eos_token_id=None, never min_new_tokens, which masks EOS and changes the argmax).

- tokens/s: paged-jax LLM.generate over all prompts vs transformers' generate on one
  left-padded batch with its attention mask; runs alternate which goes first; medians.
  Compilation is timed apart (warm-up) and the timed runs compile nothing (counter).
- greedy agreement: the fraction of prompts whose tokens are identical, and of tokens up to
  the first divergence.
- cold start: a fresh LLM(model="smollm2-135m-instruct") (background warm-up) in a
  subprocess without the persistent compilation cache, to its first token of one chat question.
Writes results/bench_real_model.json (results/bench_real_model_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time

import numpy as np

from _bench_common import REPO, command_line, greedy_agreement, machine_info, median, print_table, write_json

MODEL = "smollm2-135m-instruct"
COLD_START = """
import time
t0 = time.perf_counter()
from paged_jax import LLM, SamplingParams
llm = LLM("smollm2-135m-instruct", max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=512,
          dtype="float32", compile_cache_dir=None)  # the default background warm-up, nothing cached
t1 = time.perf_counter()
out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
               SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
t2 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t0:.3f} {out.metrics.time_to_first_token:.3f}")
"""


def passages(n: int, seed: int) -> list[str]:
    """n passages of 40-250 words from the standard library's own docs (real English + code)."""
    from pydoc_data.topics import topics

    rng = np.random.default_rng(seed)
    texts = [" ".join(t.split()) for t in topics.values() if len(t.split()) >= 40]
    picked = rng.choice(len(texts), n, replace=False)
    return [" ".join(texts[i].split()[: int(rng.integers(40, 251))]) for i in picked]


@contextlib.contextmanager
def torch_threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cold_start() -> dict:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", COLD_START], capture_output=True, text=True, env=env, check=True)
    load_s, first_token_s, ttft_s = map(float, out.stdout.split())
    return {"llm_constructed_s": load_s, "first_token_s": first_token_s, "request_ttft_s": ttft_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 prompts, 48 tokens, 1 run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.runs = 8, 48, 1

    import torch
    import transformers

    from models.named_models import resolve_named_model
    from paged_jax import LLM, SamplingParams

    path = resolve_named_model(MODEL)
    questions = [[{"role": "user", "content": f"Summarize this passage in two sentences: {p}"}]
                 for p in passages(args.prompts, args.seed)]

    t0 = time.perf_counter()
    llm = LLM(MODEL, max_model_len=1024, max_num_seqs=args.prompts, max_num_batched_tokens=512, dtype="float32",
              warm_up="full")
    warm_s = time.perf_counter() - t0
    prompts = [llm.engine.chat_prompt(q)[0] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    compiled = llm.stats()["num_compilations"]

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    pad = llm.tokenizer.eos_token_id
    width = max(map(len, prompts))
    input_ids = torch.as_tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.as_tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ref.generation_config.eos_token_id = None

    def run_ours():
        llm.reset_prefix_cache()  # runs must not feed each other
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [o.token_ids for o in outs]

    def run_theirs():
        with torch.no_grad(), torch_threads(args.threads):
            start = time.perf_counter()
            out = ref.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=args.new_tokens,
                               eos_token_id=None, pad_token_id=pad)
            return time.perf_counter() - start, out[:, width:].tolist()

    times = {"paged-jax": [], "transformers": []}
    for run in range(args.runs):
        order = [("paged-jax", run_ours), ("transformers", run_theirs)]
        for name, fn in order if run % 2 == 0 else order[::-1]:
            elapsed, tokens = fn()
            times[name].append(elapsed)
            if name == "paged-jax":
                ours = tokens
            else:
                theirs = tokens
    assert llm.stats()["num_compilations"] == compiled, "a timed run compiled a new shape"
    generated = args.prompts * args.new_tokens
    rate = {name: generated / median(ts) for name, ts in times.items()}
    agree = greedy_agreement(ours, theirs)
    cold = cold_start()

    result = {"command": command_line(), "machine": machine_info(), "model": MODEL, "gguf": path.name,
              "prompts": args.prompts, "prompt_tokens": [len(p) for p in prompts], "new_tokens": args.new_tokens,
              "runs": args.runs, "seconds": times, "tokens_per_s": rate,
              "speedup": rate["paged-jax"] / rate["transformers"], "greedy_agreement": agree,
              "paged_jax_warm_up_s": warm_s, "paged_jax_compilations": compiled, "cold_start": cold,
              "sample": {"question": questions[0][0]["content"][:120], "answer": llm.tokenizer.decode(ours[0])}}
    print_table(f"SmolLM2-135M-Instruct (GGUF Q4_1 -> f32), {args.prompts} chat prompts of "
                f"{min(result['prompt_tokens'])}-{max(result['prompt_tokens'])} tokens, {args.new_tokens} new "
                f"tokens, greedy, medians of {args.runs}",
                ["metric", "value"],
                [["transformers tok/s (batched generate)", f"{rate['transformers']:.1f}"],
                 ["paged-jax tok/s (LLM.generate)", f"{rate['paged-jax']:.1f}"],
                 ["speedup", f"{result['speedup']:.2f}x"],
                 ["identical greedy outputs", f"{agree['identical_prompts']:.0%}"],
                 ["tokens before the first divergence", f"{agree['tokens_before_first_divergence']:.1%}"],
                 ["paged-jax warm-up (load + every bucket)", f"{warm_s:.1f} s ({compiled} buckets)"],
                 ["cold LLM(...) ready (background warm-up)", f"{cold['llm_constructed_s']:.1f} s"],
                 ["cold LLM(...) to first token", f"{cold['first_token_s']:.1f} s"]])
    print(f"sample answer: {result['sample']['answer']!r}")
    write_json(os.path.join(REPO, "results", f"bench_real_model{'_quick' if args.quick else ''}.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
