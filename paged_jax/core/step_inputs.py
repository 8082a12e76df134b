"""The records that cross from the host to the jitted step, one per concern.

StepInputs bundles three NamedTuples (pytrees without importing jax) of fixed-shape numpy
arrays, built only by batch.StepInputsBuilder:
- ModelInputs: what the model's forward reads (tokens, positions, which rows to sample);
- AttentionMetadata: what the attention backend reads (where to write K/V, which pages
  each sequence owns, the ragged layout of the batch);
- SamplingMetadata: what the sampler reads, per sequence.

Shapes: T = token bucket, S = sequence bucket, W = CacheConfig.max_blocks_per_seq. Padding
is 0 everywhere, so padded tokens write into and padded tables point at the null block 0.
Imports no jax.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class ModelInputs(NamedTuple):
    token_ids: np.ndarray  # i32[T]; all scheduled tokens back to back; padding 0
    positions: np.ndarray  # i32[T]; padding 0
    logits_indices: np.ndarray  # i32[S]; token row whose logits sample seq i's next token; padding 0


class AttentionMetadata(NamedTuple):
    slot_mapping: np.ndarray  # i32[T]; slot = block_id * block_size + offset; padding -> 0 (null block)
    block_tables: np.ndarray  # i32[S, W]; padded entries and padded sequences -> 0 (null block)
    seq_lens: np.ndarray  # i32[S]; context length INCLUDING this step's tokens; 0 for padded seqs
    query_start_loc: np.ndarray  # i32[S + 1]; seq i owns tokens [qsl[i], qsl[i+1]); padded seqs repeat the end
    num_seqs: np.ndarray  # i32[1]; number of real sequences


class SamplingMetadata(NamedTuple):
    temperature: np.ndarray  # f32[S]; 0 means greedy (padded rows are greedy)
    top_k: np.ndarray  # i32[S]; -1 or 0 disables
    top_p: np.ndarray  # f32[S]; 1.0 disables
    rng_keys: np.ndarray  # u32[S, 2]; (request seed, output index): the same draw in any batch


class StepInputs(NamedTuple):
    """Everything one jitted step needs, and nothing else."""

    model: ModelInputs
    attention: AttentionMetadata
    sampling: SamplingMetadata

    @property
    def num_seqs(self) -> int:
        return int(self.attention.num_seqs[0])
