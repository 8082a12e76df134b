"""DraftModelProposer: speculative decoding's draft-model method (vLLM's `draft_model`).

A smaller model of the target's vocabulary proposes k tokens per decoding request after each
step. Its layers are layers of the target's KV pool (EngineConfig.kv_cache_specs puts them
after the target's), so its pages live in the target's blocks and read the target's block
tables: one block manager, one allocation, one prefix cache, one preemption, and the offload
tiers copy its pages with the target's.

After the target's step the draft runs k programs (a draft ModelRunner sharing the pool):

1. A pass over what the target kept this step, for every request the step scheduled: tokens
   [num_computed before the step, num_computed after it) plus the token just sampled when
   there is one (the draft then holds KV wherever the target does, so a block the prefix cache
   hands out holds the draft's pages too, and a preempted request's recompute restores both);
   its last logits give the first proposal. A prompt chunk's pass just writes KV.
2. k - 1 passes of one token per proposing request: proposal j at position num_tokens - 1 + j
   gives proposal j + 1. These write KV past the scheduled tokens, into the lookahead slots
   the scheduler reserved (SchedulerConfig.num_lookahead_tokens = k); a rejected proposal's
   slot is overwritten by the next pass 1, which starts at the target's num_computed.

Proposals are the draft's greedy tokens: a point-mass draft, which the rejection sampler
verifies exactly (the output distribution stays the target's at any temperature). A pass 1
holds at most max_num_batched_tokens + max_num_seqs tokens (each sampled token adds one), so
the draft runner's buckets go that far; sequences pad to at least T // (k + 2) (a decoding
sequence brings up to k + 2 tokens: its last token, k accepted proposals and the new token).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.core.batch import StepInputsBuilder
from paged_jax.core.request import RequestStatus
from paged_jax.core.spec_decode import proposal_budget
from paged_jax.engine_config import ResolvedConfig
from paged_jax.kv_pool import KVPool
from paged_jax.runner import ModelRunner


def check_draft_model(draft_model, model, name: str) -> None:
    """ValueError unless draft_model can propose for model: the same vocabulary size (token ids
    mean the same in both only with the same tokenizer)."""
    draft_vocab, vocab = draft_model.config.vocab_size, model.config.vocab_size
    if draft_vocab != vocab:
        raise ValueError(f"speculative_config model={name!r} has vocab_size={draft_vocab}, the target {vocab}: a "
                         "draft proposes the target's token ids, so it needs the target's tokenizer; use a draft "
                         "of the same model family and tokenizer")


class DraftModelProposer:
    """The draft model's runner and its k passes after each target step (module docstring).

    Args:
      draft_model: the draft (a registered model).
      config: the target engine's ResolvedConfig (its spec_config names k).
      pool: the target runner's KVPool, which holds the draft's layers from first_layer on.
      first_layer: the pool layer of the draft's layer 0 (the target's layer count).
      builder: the target's StepInputsBuilder, whose block-table rows the passes read.
      mesh: the target runner's mesh (None: the default device).
    """

    def __init__(self, draft_model, config: ResolvedConfig, pool: KVPool, first_layer: int,
                 builder: StepInputsBuilder, mesh=None):
        self.num_speculative_tokens = k = config.engine.spec_config.num_speculative_tokens
        sched = config.scheduler
        self.max_model_len = sched.max_model_len
        self.scheduler_config = dataclasses.replace(
            sched, max_num_batched_tokens=sched.max_num_batched_tokens + sched.max_num_seqs, num_spec_tokens=k + 1,
            num_lookahead_tokens=0)
        engine = dataclasses.replace(config.engine, speculative_config=None, layers_per_program=None)
        self.runner = ModelRunner(draft_model, ResolvedConfig(engine, config.cache, self.scheduler_config),
                                  mesh=mesh, pool=pool, first_layer=first_layer, logits_processing=False)
        self.builder = builder
        self.num_passes = 0

    def propose(self, scheduler_output, enabled: bool = True) -> None:
        """Runs the draft after the target's step of scheduler_output (its update applied) and
        sets each decoding request's spec_token_ids (at most proposal_budget of them). Not
        `enabled` (SpeculativeConfig.disable_by_batch_size): only the pass that writes the
        draft's KV of this step's tokens, and no proposals."""
        out = scheduler_output
        ids, token_lists, starts, budgets, requests = [], [], [], [], []
        for request, start in zip(out.requests, out.num_computed_tokens):
            end = min(request.num_tokens, request.num_computed_tokens + 1)
            if end <= start:
                continue
            ids.append(request.request_id)
            token_lists.append(request.all_token_ids[start:end])
            starts.append(start)
            decoding = (request.status == RequestStatus.RUNNING and end == request.num_tokens
                        and request.num_tokens - request.num_computed_tokens == 1)
            budgets.append(proposal_budget(request, self.num_speculative_tokens, self.max_model_len)
                           if decoding and enabled else 0)
            requests.append(request)
        if not ids:
            return
        first = self._run(ids, token_lists, starts)  # KV where the target has it, and proposal 1
        proposers = [i for i, budget in enumerate(budgets) if budget > 0]
        proposals = {i: [int(first[i])] for i in proposers}
        for j in range(1, max(budgets)):
            active = [i for i in proposers if budgets[i] > j]
            tokens = self._run([ids[i] for i in active], [[proposals[i][-1]] for i in active],
                               [requests[i].num_tokens - 1 + j for i in active])
            for row, i in enumerate(active):
                proposals[i].append(int(tokens[row]))
        for i in proposers:
            requests[i].spec_token_ids = proposals[i]

    def _run(self, ids, token_lists, starts) -> np.ndarray:
        """One greedy draft pass; the token after each sequence's last."""
        inputs = self.builder.draft_inputs(ids, token_lists, starts, self.scheduler_config)
        token_ids, _ = self.runner.execute(inputs)
        self.num_passes += 1
        return token_ids
