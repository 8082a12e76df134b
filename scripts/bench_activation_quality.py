"""What int8 activations cost in quality (LLM(activation_dtype="int8"), issue 26).

    python scripts/bench_activation_quality.py [--passages 32 --tokens 256]

SmolLM2-135M-Instruct, the real GGUF (its Q4_1 / Q8_0 blocks kept packed), float32 compute:
teacher-forced perplexity on --passages passages of Python's documentation (pydoc_data.topics,
--tokens tokens each, as scripts/bench_kv_quant.py's quality table) with the packed matmuls'
activations exact (float32) and quantized per block of 32 (int8), and next-token top-1
agreement of each with the exact one over every position. A third row, the same GGUF
dequantized to float32 weights (XLA's dot), shows what the exact packed kernel's summation
order alone changes. Each passage is one model.dense_forward (full causal attention, no
cache). Writes results/bench_activation_quality.json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _bench_common import command_line, machine_info, print_table, write_json  # noqa: E402
from bench_kv_quant import eval_passages  # noqa: E402

MODEL = "smollm2-135m-instruct"


def teacher_forced(model, passages):
    """(sum of NLL, predicted tokens, argmax per position) of model over the passages."""
    forward = jax.jit(lambda ids: jax.nn.log_softmax(model.dense_forward(ids)[0], axis=-1))
    nll, count, argmax = 0.0, 0, []
    for ids in passages:
        logp = np.asarray(forward(jnp.asarray([ids], jnp.int32)))  # [L, V]
        targets = np.asarray(ids[1:])
        nll -= float(logp[np.arange(len(targets)), targets].sum())
        count += len(targets)
        argmax.append(logp[:-1].argmax(axis=-1))
    return nll, count, np.concatenate(argmax)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", default="results/bench_activation_quality.json")
    args = parser.parse_args(argv)

    from models.registry import load_model, load_tokenizer

    tokenizer = load_tokenizer(MODEL)
    passages = eval_passages(tokenizer, args.passages, args.tokens)
    variants = [("packed, float32 activations (exact)", dict(activation_dtype="float32")),
                ("packed, int8 activations", dict(activation_dtype="int8")),
                ("float32 weights (dequantized, XLA dot)", dict(weight_dtype="float32"))]
    results, rows, reference = [], [], None
    for name, kwargs in variants:
        nll, count, argmax = teacher_forced(load_model(MODEL, **kwargs), passages)
        ppl = math.exp(nll / count)
        if reference is None:
            reference = (ppl, argmax)
        agree = float((argmax == reference[1]).mean())
        results.append(dict(variant=name, perplexity=ppl, ppl_ratio=ppl / reference[0], top1_agreement=agree))
        rows.append([name, f"{ppl:.4f}", f"{ppl / reference[0]:.5f}x", f"{agree:.2%}"])
    print_table(f"Teacher-forced perplexity, {MODEL} (GGUF), {len(passages)} passages x {args.tokens} tokens "
                "(pydoc_data.topics)", ["matmuls", "perplexity", "vs exact", "top-1 agreement with exact"], rows)
    write_json(args.out, {"machine": machine_info(), "command": command_line(), "passages": len(passages),
                          "tokens": args.tokens, "variants": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
