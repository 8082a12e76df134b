"""Speculative decoding on the host: the config, the n-gram proposer and the counters.

A decoding request with k proposed tokens is scheduled for 1 + k tokens (its last sampled
token, then the proposals), within the step's token budget; its slots come from
allocate_slots(num_lookahead_tokens=k), which never caches them. The step scores every
position and the rejection sampler (paged_jax/rejection_sampler.py) keeps the longest run of
proposals the target accepts plus one token of its own; the scheduler rolls
num_computed_tokens back past the rejected ones, whose slots are overwritten by later steps
and never read before that (a step reads only positions below its own tokens' ends).

The n-gram proposer is vLLM's prompt lookup (`method: "ngram"`): find the latest earlier
occurrence of the request's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min, longest first) and propose the tokens that followed it. Nothing matches:
nothing is proposed, and the request decodes as it would without speculation.

The draft-model proposer (`method: "draft_model"`, paged_jax/draft_proposer.py) runs a
smaller model of the same vocabulary whose layers live in the target's KV pool: its layers are
layers of the pool (a KV-cache group of their own, or the target's group when their specs are
equal, as vLLM groups them), so its pages share the target's block tables and blocks. The
scheduler reserves num_lookahead_tokens = k slots past every request's scheduled tokens for
the draft's own proposals (SchedulerConfig.num_lookahead_tokens). Its proposals are its
greedy tokens: a point-mass draft, which the rejection sampler keeps exact.
Imports no jax.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from paged_jax.core.config import check_int

SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config, validated.

    Attributes:
      method: "ngram" (prompt lookup) or "draft_model" (a smaller model proposes).
      num_speculative_tokens: k, the most tokens proposed per step (>= 1).
      prompt_lookup_min: the shortest suffix n-gram matched (>= 1).
      prompt_lookup_max: the longest (>= prompt_lookup_min).
      model: the draft model (method "draft_model" only, and required there): any `model=`
        the engine takes ("tiny", a named model, a .gguf file, a HF directory), with the
        target's vocabulary (the engine checks its vocab_size when it loads it).
      disable_by_batch_size: propose nothing in a step that follows one with at least this
        many running requests (vLLM's key; None: always propose). Verifying 1 + k tokens per
        request costs little more than one token only while a step is bound by reading the
        weights; a large batch already is compute-bound, and there speculation only slows
        (docs/BENCHMARKS.md section 20). A draft model still runs its first pass then, so its
        KV stays level with the target's.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is unknown; use one of {SPEC_METHODS}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"speculative_config model={self.model!r}: method='draft_model' needs the draft "
                                 "model's name or path (a smaller model with the target's tokenizer)")
        elif self.model is not None:
            raise ValueError(f"speculative_config model={self.model!r} is for method='draft_model'; prompt lookup "
                             f"(method='ngram') needs no model")
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1, "propose at least one token per step")
        check_int("prompt_lookup_min", self.prompt_lookup_min, 1, "match suffixes of at least one token")
        check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min,
                  f"at least prompt_lookup_min={self.prompt_lookup_min}")
        if self.disable_by_batch_size is not None:
            check_int("disable_by_batch_size", self.disable_by_batch_size, 1,
                      "or None to propose at every batch size")

    def enabled_for(self, num_running: int) -> bool:
        """Whether to propose for a batch of num_running requests (disable_by_batch_size)."""
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A SpeculativeConfig from what a caller passes: None, one already built, a dict of
        vLLM's keys, or that dict as JSON (the command line's --speculative-config)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config={value!r} is not JSON ({error}); pass e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config={value!r} must be a dict (or its JSON), e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                 "disable_by_batch_size"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; the keys are {sorted(known)}")
        if "method" not in value:
            raise ValueError("speculative_config needs a 'method' (one of " f"{SPEC_METHODS})")
        return cls(**value)


def proposal_budget(request, k: int, max_model_len: int) -> int:
    """How many tokens to propose for a decoding request: at most k, and no more than its
    max_tokens and max_model_len leave room for (the target's own token follows the accepted
    ones, so a request one token from its end gets none)."""
    return max(0, min(k, max_model_len - request.num_tokens, request.max_tokens - request.num_output_tokens - 1))


def propose_ngram(token_ids, k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the up to k tokens that followed the latest earlier occurrence of the
    last n tokens, for the longest n in [min_n, max_n] that occurs earlier; [] if none does.

    Args:
      token_ids: the request's tokens so far (prompt and output), a sequence of ints.
      k: the most tokens to propose (<= 0: none).
      min_n, max_n: the suffix lengths considered; the longest that occurs earlier wins.
    """
    tokens = np.asarray(token_ids, np.int64)
    num = tokens.shape[0]
    if k <= 0 or num < min_n + 1:
        return []
    # Ends of the earlier occurrences of the last n tokens, n = 1, 2, ...: each longer suffix
    # keeps the ends whose token n - 1 places back matches too (one pass over the sequence,
    # then a few over the surviving ends, instead of a pass over every window per n).
    ends = np.flatnonzero(tokens[: num - 1] == tokens[num - 1])  # occurrences end before the last token
    best = None
    for n in range(1, min(max_n, num - 1) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[num - n]]
        if not ends.size:
            break
        if n >= min_n:
            best = ends
    if best is None:
        return []
    follow = int(best[-1]) + 1  # the latest occurrence of the longest suffix; what followed it
    return tokens[follow : follow + k].tolist()


@dataclass
class SpecDecodeStats:
    """Cumulative counters (vLLM's spec-decode metrics).

    num_drafts counts verification rows (requests with >= 1 proposal in a step);
    accepted_per_position[j] how often the j-th proposal of a row was accepted;
    num_disabled_steps the steps after which nothing was proposed because the batch was
    disable_by_batch_size or more.
    """

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_disabled_steps: int = 0

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_spec_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def as_dict(self) -> dict:
        """The counters and what they mean: acceptance rate (accepted / proposed), mean accepted
        length (tokens a verification row emits: its accepted proposals plus the target's own),
        acceptance rate per position (accepted at j / verification rows)."""
        drafts = self.num_drafts
        return {
            "spec_num_drafts": drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "spec_mean_accepted_length": 1.0 + self.num_accepted_tokens / drafts if drafts else 0.0,
            "spec_acceptance_rate_per_position": [a / drafts if drafts else 0.0 for a in self.accepted_per_position],
            "spec_num_disabled_steps": self.num_disabled_steps,
        }
