"""Scheduler output -> StepInputs: the one place where padding happens.

Everything the jitted step needs travels in one StepInputs of fixed-shape arrays (no hidden
globals between host and device; the records are in step_inputs.py). The builder pads to
the buckets of SchedulerConfig (token count T, sequence count S); block tables have the
fixed width CacheConfig.max_blocks_per_seq. Padding always points into the null block
(block 0), never -1: in jnp, -1 wraps to the last element, and inside a Pallas kernel it is
out of range. Imports no jax.
"""

from __future__ import annotations


import numpy as np

from paged_jax.core.config import CacheConfig, SchedulerConfig
from paged_jax.core.step_inputs import (LogitsProcessingMetadata, ModelInputs, SamplingMetadata, SpecDecodeMetadata,
                                       StepAttentionMetadata, StepInputs)


def _seed_to_u32(seed: int) -> int:
    # splitmix64's finaliser: nearby seeds (0, 1, 2, ...) land on unrelated key words.
    x = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return (x ^ (x >> 32)) & 0xFFFFFFFF


class StepInputsBuilder:
    """Turns SchedulerOutputs into StepInputs, keeping per-request state between steps.

    Each live request owns a row of a persistent block-table array (one table per KV-cache
    group); a step appends only the blocks allocated in it, so a decode costs O(1) Python work and the table itself is
    gathered with one fancy index. Call build() on EVERY SchedulerOutput: it is where rows
    of finished and preempted requests are released.

    Key words per sequence: (u32 of the request's seed, number of output tokens so far).
    Unseeded requests get a random seed once, kept across preemption until they finish.
    """

    def __init__(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig, seed: int | None = None):
        self.block_size = cache_config.block_size
        self.max_blocks_per_seq = cache_config.max_blocks_per_seq
        self.num_groups = cache_config.num_kv_cache_groups
        self.token_buckets = scheduler_config.token_buckets
        self.seq_buckets = scheduler_config.seq_buckets
        self.bucket_for = scheduler_config.bucket_for
        self._rng = np.random.default_rng(seed)
        self._row_of: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._seed_of: dict[str, int] = {}  # outlives the row: a resumed request keeps its stream
        self._grow(64)

    def _grow(self, capacity: int) -> None:
        old = getattr(self, "_tables", None)
        start = 0 if old is None else old.shape[1]
        tables = np.zeros((self.num_groups, capacity, self.max_blocks_per_seq), np.int32)
        num_blocks = np.zeros((self.num_groups, capacity), np.int32)
        fields = {"_num_prompt": np.int32, "_temperature": np.float32,
                  "_top_k": np.int32, "_top_p": np.float32, "_seed": np.uint32}
        for name, dtype in fields.items():
            arr = np.zeros(capacity, dtype)
            if old is not None:
                arr[:start] = getattr(self, name)
            setattr(self, name, arr)
        if old is not None:
            tables[:, :start] = old
            num_blocks[:, :start] = self._num_blocks
        self._tables, self._num_blocks = tables, num_blocks
        self._free_rows.extend(range(capacity - 1, start - 1, -1))

    def _add_row(self, request, block_ids) -> int:
        row = self._row_of.get(request.request_id)
        if row is None:
            if not self._free_rows:
                self._grow(2 * self._tables.shape[1])
            row = self._free_rows.pop()
            self._row_of[request.request_id] = row
        assert len(block_ids) == self.num_groups, f"{len(block_ids)} block tables for {self.num_groups} groups"
        for g, ids in enumerate(block_ids):
            n = len(ids)
            assert n <= self.max_blocks_per_seq, f"{n} blocks exceed the table width {self.max_blocks_per_seq}"
            self._tables[g, row, :n] = ids
            self._tables[g, row, n:] = 0
            self._num_blocks[g, row] = n
        self._num_prompt[row] = request.num_prompt_tokens
        params = request.sampling_params
        self._temperature[row] = params.temperature
        self._top_k[row] = params.top_k
        self._top_p[row] = params.top_p
        seed = self._seed_of.get(request.request_id)
        if seed is None:
            seed = _seed_to_u32(params.seed) if params.seed is not None else int(self._rng.integers(2**32))
            self._seed_of[request.request_id] = seed
        self._seed[row] = seed
        return row

    def _release(self, request_id: str, finished: bool) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
        if finished:
            self._seed_of.pop(request_id, None)

    def build(self, scheduler_output, get_block_ids=None) -> StepInputs:
        """Builds the padded inputs of one step.

        Args:
          scheduler_output: a scheduler.SchedulerOutput; sequence i of the step is its i-th
            scheduled request (tokens [num_computed, num_computed + num_scheduled)).
          get_block_ids: optional request_id -> its block-id list per group (e.g.
            KVCacheManager.get_block_ids); when given, every table is re-read from it
            (slow path, for one-shot use) instead of being appended incrementally.
        Returns:
          StepInputs padded to the smallest token bucket >= the scheduled tokens and the
          smallest sequence bucket >= the scheduled requests.
        """
        out = scheduler_output
        for request_id in out.finished_req_ids:
            self._release(request_id, finished=True)
        for request_id in out.preempted_req_ids:
            self._release(request_id, finished=False)

        rows, token_ids = [], []
        row_of, tables, num_blocks = self._row_of, self._tables, self._num_blocks
        spec_lists = out.spec_token_ids or [()] * len(out.requests)
        for request, c, n, new_ids, is_new, spec in zip(
            out.requests, out.num_computed_tokens, out.num_scheduled_tokens, out.new_block_ids, out.is_new,
            spec_lists,
        ):
            row = row_of.get(request.request_id)
            if get_block_ids is not None:
                row = self._add_row(request, get_block_ids(request.request_id))
            elif is_new or row is None:
                assert is_new, f"request {request.request_id!r} has no block table yet and came without one"
                row = self._add_row(request, new_ids)
            elif new_ids:  # () when the step allocated no block
                for g, ids in enumerate(new_ids):
                    if ids:
                        k, m = int(num_blocks[g, row]), len(ids)
                        assert k + m <= self.max_blocks_per_seq, f"{k + m} blocks exceed the table width"
                        tables[g, row, k : k + m] = ids
                        num_blocks[g, row] = k + m
            rows.append(row)
            if spec:  # the last token, then the proposals
                token_ids.extend(request.all_token_ids[c:])
                token_ids.extend(spec)
                assert request.num_tokens - c + len(spec) == n, "proposals scheduled without their request's token"
            elif n == 1:
                token_ids.append(request.all_token_ids[c])
            else:
                token_ids.extend(request.all_token_ids[c : c + n])
        num_spec = [len(spec) for spec in spec_lists] if out.spec_token_ids else None
        return self._assemble(rows, token_ids, out.num_computed_tokens, out.num_scheduled_tokens, num_spec)

    def spec_metadata(self, scheduler_output, inputs: StepInputs, num_spec_tokens: int) -> SpecDecodeMetadata | None:
        """The verification rows of a step built from scheduler_output (None when no request
        brought proposals): each sequence's proposals and the token rows whose logits score
        them, padded to k = num_spec_tokens per sequence (see SpecDecodeMetadata)."""
        spec_lists = scheduler_output.spec_token_ids
        if not any(spec_lists):
            return None
        s_pad = inputs.attention.seq_lens.shape[0]
        k = num_spec_tokens
        drafts = np.zeros((s_pad, k), np.int32)
        num_drafts = np.zeros(s_pad, np.int32)
        for i, spec in enumerate(spec_lists):
            assert len(spec) <= k, f"{len(spec)} proposals for num_speculative_tokens={k}"
            drafts[i, : len(spec)] = spec
            num_drafts[i] = len(spec)
        # Row j of sequence i scores position j: the last verified token's row, then each proposal's.
        last_token = inputs.model.logits_indices  # i32[S]: each sequence's last scheduled token
        first = last_token - num_drafts
        logits_indices = first[:, None] + np.minimum(np.arange(k + 1, dtype=np.int32)[None, :], num_drafts[:, None])
        return SpecDecodeMetadata(draft_token_ids=drafts, num_draft_tokens=num_drafts,
                                  logits_indices=logits_indices.astype(np.int32))

    def step_slot_mappings(self, inputs: StepInputs, num_steps: int) -> np.ndarray:
        """i32[num_steps, groups, T]: the slot mapping of each of num_steps decode steps from
        a decode-only step's inputs (SchedulerOutput.num_steps): step i writes each
        sequence's KV at its position + i, in the blocks its table holds for them (the
        scheduler reserved them); padding rows write slot 0, in the null block."""
        attention, positions = inputs.attention, inputs.model.positions
        num_seqs = int(attention.num_seqs[0])
        assert np.array_equal(attention.query_start_loc[: num_seqs + 1], np.arange(num_seqs + 1)), \
            "several steps run only a step whose sequences decode one token each"
        steps = positions[:num_seqs][:, None] + np.arange(num_steps, dtype=np.int32)  # [n, K]
        tables = attention.block_tables[:, :num_seqs]  # [G, n, W]
        index = np.broadcast_to((steps // self.block_size)[None], (tables.shape[0], *steps.shape))
        blocks = np.take_along_axis(tables, index, axis=2)  # [G, n, K]
        slots = np.zeros((num_steps, tables.shape[0], positions.shape[0]), np.int32)
        slots[:, :, :num_seqs] = (blocks * self.block_size + steps % self.block_size).transpose(2, 0, 1)
        return slots

    def draft_inputs(self, request_ids, token_lists, starts, scheduler_config: SchedulerConfig) -> StepInputs:
        """Greedy inputs of a draft model's pass over live rows (their block tables as the last
        build() left them): sequence i computes token_lists[i] at positions starts[i] on and
        samples after its last one; padded to scheduler_config's buckets (the draft runner's)."""
        rows = [self._row_of[request_id] for request_id in request_ids]
        token_ids = [t for tokens in token_lists for t in tokens]
        inputs = self._assemble(rows, token_ids, starts, [len(tokens) for tokens in token_lists],
                                scheduler_config=scheduler_config)
        sampling = inputs.sampling
        return inputs._replace(sampling=sampling._replace(temperature=np.zeros_like(sampling.temperature)))

    def _assemble(self, rows, token_ids, num_computed, num_scheduled, num_spec=None,
                  scheduler_config: SchedulerConfig | None = None) -> StepInputs:
        num_seqs, num_tokens = len(rows), len(token_ids)
        token_buckets, seq_buckets, bucket_for = self.token_buckets, self.seq_buckets, self.bucket_for
        if scheduler_config is not None:  # another runner's buckets (a draft model's)
            token_buckets, seq_buckets = scheduler_config.token_buckets, scheduler_config.seq_buckets
            bucket_for = scheduler_config.bucket_for
        # The padded shape is a function of the batch alone (never of what has been compiled):
        # the same requests give the same inputs in every run and every process.
        assert num_tokens <= token_buckets[-1] and num_seqs <= seq_buckets[-1], \
            f"{num_tokens} tokens / {num_seqs} sequences exceed the largest bucket: scheduler limits and buckets disagree"
        t_pad, s_pad = bucket_for(num_tokens, num_seqs)
        bs = self.block_size
        rows = np.asarray(rows, np.intp)
        computed = np.asarray(num_computed, np.int32)
        scheduled = np.asarray(num_scheduled, np.int32)

        seq_lens = np.zeros(s_pad, np.int32)
        seq_lens[:num_seqs] = computed + scheduled
        query_start_loc = np.empty(s_pad + 1, np.int32)
        query_start_loc[0] = 0
        np.cumsum(scheduled, out=query_start_loc[1 : num_seqs + 1])
        query_start_loc[num_seqs + 1 :] = query_start_loc[num_seqs]
        block_tables = np.zeros((self.num_groups, s_pad, self.max_blocks_per_seq), np.int32)
        block_tables[:, :num_seqs] = self._tables[:, rows]

        if num_tokens == num_seqs:  # decode-only step: one token per sequence
            seq_of_token, real_positions = np.arange(num_seqs), computed
        else:
            seq_of_token = np.repeat(np.arange(num_seqs), scheduled)
            offsets = np.arange(num_tokens, dtype=np.int32) - query_start_loc[:num_seqs][seq_of_token]
            real_positions = computed[seq_of_token] + offsets
        block_index = real_positions // bs
        assert num_tokens == 0 or np.all(block_index < self._num_blocks[:, rows][:, seq_of_token]), (
            "a scheduled token has no block: allocate_slots must cover every scheduled token"
        )
        positions = np.zeros(t_pad, np.int32)
        positions[:num_tokens] = real_positions
        slot_mapping = np.zeros((self.num_groups, t_pad), np.int32)  # padding writes slot 0, in the null block
        slot_mapping[:, :num_tokens] = block_tables[:, seq_of_token, block_index] * bs + real_positions % bs
        tokens = np.zeros(t_pad, np.int32)
        tokens[:num_tokens] = token_ids

        logits_indices = np.zeros(s_pad, np.int32)
        logits_indices[:num_seqs] = query_start_loc[1 : num_seqs + 1] - 1
        temperature = np.zeros(s_pad, np.float32)  # padded rows are greedy: no sort, no draw
        temperature[:num_seqs] = self._temperature[rows]
        top_k = np.full(s_pad, -1, np.int32)
        top_k[:num_seqs] = self._top_k[rows]
        top_p = np.ones(s_pad, np.float32)
        top_p[:num_seqs] = self._top_p[rows]
        rng_keys = np.zeros((s_pad, 2), np.uint32)
        rng_keys[:num_seqs, 0] = self._seed[rows]
        # The token sampled from this step is output number seq_len - num_prompt (0-based); a
        # sequence's proposals are not output yet: its first scored position is that number.
        verified = seq_lens[:num_seqs] if num_spec is None else seq_lens[:num_seqs] - np.asarray(num_spec, np.int32)
        rng_keys[:num_seqs, 1] = np.maximum(verified - self._num_prompt[rows], 0)
        return StepInputs(
            ModelInputs(token_ids=tokens, positions=positions, logits_indices=logits_indices),
            StepAttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens,
                                  query_start_loc=query_start_loc, num_seqs=np.array([num_seqs], np.int32)),
            SamplingMetadata(temperature=temperature, top_k=top_k, top_p=top_p, rng_keys=rng_keys),
        )


def needs_logits_processing(request) -> bool:
    """Whether a request's sampling reads a LogitsProcessingMetadata (a grammar or penalties)."""
    params = request.sampling_params
    return params.guided_decoding is not None or params.has_penalties


def build_logits_processing(scheduler_output, num_seqs: int, num_positions: int, vocab_size: int,
                            history_width: int, fill_bitmask) -> LogitsProcessingMetadata | None:
    """The grammar masks and penalties of one step (None when no scheduled request that
    samples uses either: the step runs the plain head).

    Args:
      scheduler_output: the step's SchedulerOutput (sequence i: its i-th request).
      num_seqs: the step's sequence bucket S.
      num_positions: scored positions per sequence: 1, or 1 + k in a verification step.
      vocab_size: the logits width V; history_width: H (ModelRunner.history_width).
      fill_bitmask: (bitmask, [(request_id, row, proposals)]) -> None, writing the guided
        rows (StructuredOutputManager.fill_bitmask).
    """
    out = scheduler_output
    spec_lists = out.spec_token_ids or [()] * len(out.requests)
    chosen = [i for i, (request, samples) in enumerate(zip(out.requests, out.samples))
              if samples and needs_logits_processing(request)]
    if not chosen:
        return None
    bitmask = np.full((num_seqs * num_positions, -(-vocab_size // 32)), -1, np.int32)
    penalties = np.tile(np.array([0.0, 0.0, 1.0], np.float32), (num_seqs, 1))
    history_ids = np.full((num_seqs, history_width), vocab_size, np.int32)
    output_counts = np.zeros((num_seqs, history_width), np.float32)
    guided = []
    for i in chosen:
        request = out.requests[i]
        params = request.sampling_params
        if params.guided_decoding is not None:
            guided.append((request.request_id, i * num_positions, spec_lists[i]))
        if params.has_penalties:
            penalties[i] = params.presence_penalty, params.frequency_penalty, params.repetition_penalty
            ids = np.unique(np.asarray(request.all_token_ids, np.int32))
            history_ids[i, : ids.size] = ids
            outputs = np.asarray(request.output_token_ids, np.int32)
            if outputs.size:
                counted, counts = np.unique(outputs, return_counts=True)
                output_counts[i, np.searchsorted(ids, counted)] = counts
    if guided:
        fill_bitmask(bitmask, guided)
    return LogitsProcessingMetadata(bitmask=bitmask, penalties=penalties, history_ids=history_ids,
                                    output_counts=output_counts)


def pad_step_inputs(inputs: StepInputs, num_tokens: int, num_seqs: int) -> StepInputs:
    """inputs padded further, to num_tokens tokens and num_seqs sequences, as the builder pads
    (tokens write the null block; sequences are empty, greedy and read the null block): the
    same step in a larger bucket, giving the same outputs for its real rows."""
    t, s = inputs.model.token_ids.shape[0], inputs.attention.seq_lens.shape[0]
    assert num_tokens >= t and num_seqs >= s, f"cannot pad a ({t}, {s}) step down to ({num_tokens}, {num_seqs})"

    def pad(a, n, value=0, axis=0):
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, n - a.shape[axis])
        return np.pad(a, widths, constant_values=value)

    m, md, sp = inputs
    query_start_loc = pad(md.query_start_loc, num_seqs + 1, md.query_start_loc[-1])
    return StepInputs(
        ModelInputs(pad(m.token_ids, num_tokens), pad(m.positions, num_tokens), pad(m.logits_indices, num_seqs)),
        StepAttentionMetadata(pad(md.slot_mapping, num_tokens, axis=1), pad(md.block_tables, num_seqs, axis=1),
                              pad(md.seq_lens, num_seqs), query_start_loc, md.num_seqs),
        SamplingMetadata(pad(sp.temperature, num_seqs), pad(sp.top_k, num_seqs, -1), pad(sp.top_p, num_seqs, 1.0),
                         pad(sp.rng_keys, num_seqs)),
    )


def build_step_inputs(scheduler_output, get_block_ids, cache_config: CacheConfig,
                      scheduler_config: SchedulerConfig, seed=None) -> StepInputs:
    """One-shot build (no state kept between steps): every table is read via get_block_ids.

    Engines use a StepInputsBuilder instead, which appends blocks incrementally.
    """
    return StepInputsBuilder(cache_config, scheduler_config, seed).build(scheduler_output, get_block_ids)
