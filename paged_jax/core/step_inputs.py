"""The records that cross from the host to the jitted step, one per concern.

StepInputs bundles three NamedTuples (pytrees without importing jax) of fixed-shape numpy
arrays, built only by batch.StepInputsBuilder:
- ModelInputs: what the model's forward reads (tokens, positions, which rows to sample);
- StepAttentionMetadata: what the attention backends read (where to write K/V, which pages
  each sequence owns, the ragged layout of the batch), with one slot mapping and one block
  table per KV-cache group; `for_group(g)` is the AttentionMetadata the layers of group g
  hand their backend;
- SamplingMetadata: what the sampler reads, per sequence.

Shapes: T = token bucket, S = sequence bucket, W = CacheConfig.max_blocks_per_seq, G =
CacheConfig.num_kv_cache_groups (1 for a model whose layers share one cache spec). Padding
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
    """One KV-cache group's view of the step: what an attention backend reads."""

    slot_mapping: np.ndarray  # i32[T]; slot = block_id * block_size + offset; padding -> 0 (null block)
    block_tables: np.ndarray  # i32[S, W]; padded entries and padded sequences -> 0 (null block)
    seq_lens: np.ndarray  # i32[S]; context length INCLUDING this step's tokens; 0 for padded seqs
    query_start_loc: np.ndarray  # i32[S + 1]; seq i owns tokens [qsl[i], qsl[i+1]); padded seqs repeat the end
    num_seqs: np.ndarray  # i32[1]; number of real sequences


class StepAttentionMetadata(NamedTuple):
    """AttentionMetadata of every KV-cache group at once: the group's own fields (where its
    layers write, which of its pages each sequence owns) gain a leading group axis; the
    batch's ragged layout is shared."""

    slot_mapping: np.ndarray  # i32[G, T]; group g's slots, as AttentionMetadata.slot_mapping
    block_tables: np.ndarray  # i32[G, S, W]; group g's tables, as AttentionMetadata.block_tables
    seq_lens: np.ndarray  # i32[S]
    query_start_loc: np.ndarray  # i32[S + 1]
    num_seqs: np.ndarray  # i32[1]

    def for_group(self, kv_cache_group_id: int) -> AttentionMetadata:
        """What the layers of one group hand their backend (a static index: one slice)."""
        return AttentionMetadata(self.slot_mapping[kv_cache_group_id], self.block_tables[kv_cache_group_id],
                                 self.seq_lens, self.query_start_loc, self.num_seqs)


class SamplingMetadata(NamedTuple):
    temperature: np.ndarray  # f32[S]; 0 means greedy (padded rows are greedy)
    top_k: np.ndarray  # i32[S]; -1 or 0 disables
    top_p: np.ndarray  # f32[S]; 1.0 disables
    rng_keys: np.ndarray  # u32[S, 2]; (request seed, output index): the same draw in any batch


class SpecDecodeMetadata(NamedTuple):
    """A verification step's proposals (speculative decoding), per sequence, k =
    num_speculative_tokens: what the rejection sampler reads beside SamplingMetadata.

    Built only for steps where some sequence brought proposals, and passed to the program
    that samples apart from StepInputs (the layers never read it)."""

    draft_token_ids: np.ndarray  # i32[S, k]; sequence i's proposals, then padding 0
    num_draft_tokens: np.ndarray  # i32[S]; 0 for sequences without (and padded ones)
    logits_indices: np.ndarray  # i32[S, k + 1]; token rows scoring positions 0..k (the last real one repeated)


class LogitsProcessingMetadata(NamedTuple):
    """What the sampler applies to a step's logits when some sequence follows a grammar
    (structured outputs) or penalizes repeats; built only for such steps and passed to the
    program that samples apart from StepInputs, like SpecDecodeMetadata.

    Rows that need neither carry an all-ones mask and penalties (0, 0, 1), under which their
    logits pass through bit for bit. H = the runner's history_width (min(max_model_len, V)):
    a sequence holds at most that many distinct ids. R = S, or S * (k + 1) in a verification
    step (row i * (k + 1) + j: sequence i's scored position j)."""

    bitmask: np.ndarray  # i32[R, ceil(V / 32)]; bit v % 32 of word v // 32 set: token v allowed
    penalties: np.ndarray  # f32[S, 3]; presence, frequency, repetition; (0, 0, 1) for none
    history_ids: np.ndarray  # i32[S, H]; the sequence's distinct prompt + output ids, padding V
    output_counts: np.ndarray  # f32[S, H]; occurrences of history_ids[i, h] in the output


class StepInputs(NamedTuple):
    """Everything one jitted step needs, and nothing else."""

    model: ModelInputs
    attention: StepAttentionMetadata
    sampling: SamplingMetadata

    @property
    def num_seqs(self) -> int:
        return int(self.attention.num_seqs[0])
