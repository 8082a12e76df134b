"""Scheduler output -> StepInputs: the one place where padding happens.

Everything the jitted step needs travels in one StepInputs of fixed-shape arrays (no hidden
globals between host and device). The builder pads to buckets of token count T and
sequence count S; block tables have the fixed width cdiv(max_model_len, block_size).
Padding always points into the null block (block 0), never -1: in jnp, -1 wraps to the last
element, and inside a Pallas kernel it is out of range.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class StepInputs(NamedTuple):
    """Inputs of one engine step (a NamedTuple, so it is a pytree without importing jax).

    Shapes: T = token bucket, S = sequence bucket, W = max blocks per sequence.
    """

    token_ids: np.ndarray  # i32[T]; padded tokens are 0
    positions: np.ndarray  # i32[T]; padded tokens are 0
    slot_mapping: np.ndarray  # i32[T]; slot = block_id * block_size + offset; padding -> 0 (null block)
    block_tables: np.ndarray  # i32[S, W]; padded entries and padded sequences -> 0 (null block)
    seq_lens: np.ndarray  # i32[S]; context length INCLUDING this step's tokens; 0 for padded seqs
    query_start_loc: np.ndarray  # i32[S + 1]; seq i owns tokens [qsl[i], qsl[i+1]); padded seqs repeat the end
    num_seqs: np.ndarray  # i32[1]; number of real sequences
    logits_indices: np.ndarray  # i32[S]; token row whose logits sample seq i's next token; padding -> 0
    # Per-sequence sampling state (filled by the engine; model-only callers may leave them None).
    temperature: np.ndarray | None = None  # f32[S]; 0 means greedy
    top_k: np.ndarray | None = None  # i32[S]; -1 or 0 disables
    top_p: np.ndarray | None = None  # f32[S]; 1.0 disables
    rng_keys: np.ndarray | None = None  # u32[S, 2]; per-request seed folded with its step count
