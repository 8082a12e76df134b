"""StepInputs built by hand for the model tests, independently of paged_jax.core.batch.

Shared by test_llama.py and test_hf_parity.py (a plain module, not a test file, so neither
test imports the other).
"""

import numpy as np

from paged_jax.core.step_inputs import ModelInputs, SamplingMetadata, StepAttentionMetadata, StepInputs


def hand_step_inputs(chunks, block_size, width, token_bucket, seq_bucket):
    """StepInputs for one step, padded as paged_jax.core.batch pads (padding -> null block 0),
    for a model of one KV-cache group (`inputs.attention.for_group(0)` is what its layers read).

    chunks: list of (tokens, block_ids, start, end): the sequence's tokens [start, end) run
    this step, with tokens [0, start) already in the cache.
    """
    token_ids, positions, slots, qsl, seq_lens, logits_indices = [], [], [], [0], [], []
    for tokens, block_ids, start, end in chunks:
        for pos in range(start, end):
            token_ids.append(tokens[pos])
            positions.append(pos)
            slots.append(block_ids[pos // block_size] * block_size + pos % block_size)
        qsl.append(len(token_ids))
        seq_lens.append(end)
        logits_indices.append(len(token_ids) - 1)
    num_tokens, num_seqs = len(token_ids), len(chunks)
    assert num_tokens <= token_bucket and num_seqs <= seq_bucket, "test schedule exceeds its buckets"
    block_tables = np.zeros((seq_bucket, width), np.int32)
    for i, (_, block_ids, _, _) in enumerate(chunks):
        block_tables[i, :len(block_ids)] = block_ids

    def pad(xs, n, fill=0):
        return np.array(xs + [fill] * (n - len(xs)), np.int32)

    return StepInputs(
        ModelInputs(token_ids=pad(token_ids, token_bucket), positions=pad(positions, token_bucket),
                    logits_indices=pad(logits_indices, seq_bucket)),
        StepAttentionMetadata(slot_mapping=pad(slots, token_bucket)[None], block_tables=block_tables[None],
                              seq_lens=pad(seq_lens, seq_bucket),
                              query_start_loc=pad(qsl, seq_bucket + 1, fill=num_tokens),
                              num_seqs=np.array([num_seqs], np.int32)),
        SamplingMetadata(temperature=np.zeros(seq_bucket, np.float32), top_k=np.full(seq_bucket, -1, np.int32),
                         top_p=np.ones(seq_bucket, np.float32), rng_keys=np.zeros((seq_bucket, 2), np.uint32)))
