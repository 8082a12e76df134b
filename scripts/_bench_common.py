"""Helpers the benchmark scripts share: machine facts, tables, JSON, peak RSS, the benchmark model.

Imports neither jax nor torch at module level, so a parent process that only orchestrates
workers stays small, and each worker's peak RSS is its own.

    python scripts/_bench_common.py make-checkpoint DIR   # the random-init HF benchmark model
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The benchmark model (issue 6): a random-init HF LlamaForCausalLM. intermediate_size 1408 is
# Llama's ~8/3 x hidden rounded to a multiple of 128; the head is untied, as in Llama 2/3 8B.
BENCH_MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                   tie_word_embeddings=False, rms_norm_eps=1e-6)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    """The facts a reader needs to compare figures across machines (no jax import)."""
    mem_kib = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "python": sys.version.split()[0],
        "jax": _version("jax"), "jaxlib": _version("jaxlib"),
        "torch": _version("torch"), "transformers": _version("transformers"),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        **_git_state(),
    }


def _git_state() -> dict:
    """The commit measured, and whether library code differed from it (uncommitted edits)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--", "paged_jax", "pallas_kernels", "models")
        return {"git_head": git("rev-parse", "--short", "HEAD"), "library_uncommitted_changes": bool(dirty)}
    except OSError:
        return {}


def command_line() -> str:
    """The command that produced a result, as typed (relative script path, same flags)."""
    return "python " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])


def tree_nbytes(tree) -> int:
    """Bytes of every array leaf of a pytree (a PackedWeight's at its stored size)."""
    import jax

    return sum(int(a.nbytes) for a in jax.tree.leaves(tree))


def median(xs) -> float:
    return float(statistics.median(xs))


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    """A rich table (plain text when rich is missing)."""
    rows = [[str(c) for c in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        for row in [columns] + rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
        return
    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)


def write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh, indent=2)
    os.replace(tmp, path)
    print(f"wrote {path}")


# peak RSS of the calling process (Linux)
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """Resets VmHWM to the current RSS (writing 5 to clear_refs), so the next peak_rss_mib()
    is the peak of what runs in between."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def peak_rss_mib() -> float:
    return _status_kib("VmHWM") / 1024


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def make_checkpoint(path: str, seed: int = 0) -> None:
    """Saves the random-init HF benchmark model with save_pretrained, plus a tokenizer.json.

    paged-jax's LLM(model=DIR) needs a tokenizer.json; the benchmarks pass token ids, so the
    packaged 512-token tokenizer is copied in only to decode output text (ids past 512 decode
    to nothing). Runs torch in a subprocess so the caller's RSS and threads stay clean.
    """
    code = (
        "import sys, torch, transformers\n"
        f"cfg = transformers.LlamaConfig(**{BENCH_MODEL!r})\n"
        f"torch.manual_seed({seed})\n"
        "transformers.LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, path], check=True, stderr=subprocess.DEVNULL)
    shutil.copy(REPO / "paged_jax" / "core" / "assets" / "tokenizer.json", Path(path) / "tokenizer.json")



@contextlib.contextmanager
def bench_model_dir(model: str | None, seed: int = 0):
    """Yields `model` (an HF Llama directory) if given, else a temporary directory holding the
    benchmark model made by make_checkpoint, removed on exit."""
    if model is not None:
        yield model
        return
    with tempfile.TemporaryDirectory(prefix="paged_jax_bench_") as tmp:
        make_checkpoint(tmp, seed=seed)
        yield tmp


def count_params(config: dict) -> dict:
    """Matmul parameter counts of the benchmark model: per layer, all layers, lm_head."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n, k = config["num_attention_heads"], config["num_key_value_heads"]
    h = d // n
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
    return {"per_layer": per_layer, "layers": per_layer * config["num_hidden_layers"], "lm_head": d * v,
            "embedding": d * v, "head_dim": h}


def useful_flops(config: dict, num_tokens: int, sum_context: int, num_sampled: int) -> float:
    """Useful forward FLOPs of one step (what a perfect engine must compute).

    2 * (layer matmul params) * tokens + 2 * hidden * vocab * sampled rows (lm_head) +
    4 * layers * q_heads * head_dim * sum over tokens of visible keys (QK^T and PV, causal).
    Padding, masked keys and logits nobody samples are not counted.
    """
    p = count_params(config)
    attention = 4 * config["num_hidden_layers"] * config["num_attention_heads"] * p["head_dim"] * sum_context
    return 2.0 * p["layers"] * num_tokens + 2.0 * p["lm_head"] * num_sampled + attention


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make-checkpoint":
        make_checkpoint(sys.argv[2])
    else:
        sys.exit(__doc__)


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far two engines' greedy outputs agree, prompt by prompt: the fraction of prompts
    whose tokens are identical, and the fraction of the reference's tokens before each
    prompt's first divergence."""
    same_prefix = []
    for a, b in zip(ours, theirs):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        same_prefix.append(n)
    return {"identical_prompts": sum(a == b for a, b in zip(ours, theirs)) / len(ours),
            "tokens_before_first_divergence": sum(same_prefix) / sum(len(b) for b in theirs)}
