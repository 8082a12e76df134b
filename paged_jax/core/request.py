"""Request, RequestStatus and SamplingParams: the host-side record of one generation.

Names follow vLLM v1. A Request owns its token ids and the chain hashes of its full blocks
(`block_hashes`). It can be built without a hasher: the KVCacheManager attaches its own the
first time it sees the request, and from then on `append_output_token_ids` hashes each block
as it becomes full (never the whole sequence again). Imports no jax.
"""

from __future__ import annotations

import enum
import json
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from paged_jax.core.hashing import BlockHasher


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # blocks allocated, its external KV still arriving (kv_connector.py)
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        """"stop" / "length" / "abort" for finished statuses (OpenAI's words), else None."""
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def _is_int(x) -> bool:
    # bool is an int subclass, but `top_k=True` is a mistake, not a value.
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class GuidedDecodingParams:
    """A grammar the output must follow (vLLM's structured outputs); set exactly one field.

    Attributes:
      json: a JSON schema (a dict or its JSON text): the output is one JSON value valid under it.
      regex: the output matches this regular expression (Rust `regex` syntax), whole.
      choice: the output is exactly one of these strings.
      grammar: a context-free grammar in Lark syntax or llama.cpp's GBNF.
      json_object: the output is any JSON object (OpenAI's response_format json_object).
      whitespace_flexible: allow any JSON whitespace between tokens (vLLM's default); False
        (the default here) writes compact JSON, no whitespace between tokens, so a small model
        cannot fill its budget with newlines.
    `json` is kept as its JSON text (properties in the order given: the output follows it),
    so equal schemas compare (and cache) equal.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_flexible: bool = False

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"guided_decoding sets {given or 'nothing'}: set exactly one of json, regex, "
                             f"choice, grammar, json_object")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"guided_decoding json is not valid JSON ({e}); give a JSON schema") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"guided_decoding json must be a JSON schema object, got {type(schema).__name__}")
            object.__setattr__(self, "json", json.dumps(schema))
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not hasattr(self.choice, "__iter__"):
                raise ValueError(f"guided_decoding choice={self.choice!r} must be a list of strings")
            choice = tuple(self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"guided_decoding choice={choice!r} must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"guided_decoding {name}={value!r} must be a non-empty string")
        for name in ("json_object", "whitespace_flexible"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"guided_decoding {name}={getattr(self, name)!r} must be True or False")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
      max_tokens: output tokens to generate at most (>= 1).
      temperature: >= 0; 0 means greedy.
      top_k: keep the k most likely tokens; -1 or 0 disable it.
      top_p: nucleus mass in (0, 1]; 1.0 disables it.
      seed: per-request seed for reproducible sampling, or None.
      stop_token_ids: extra token ids that end the request (the stop token is kept).
      ignore_eos: keep generating past the model's EOS token.
      logprobs: also return the log-probability of each sampled token.
      presence_penalty: in [-2, 2]; subtracted once from the logit of every token already in
        the output (OpenAI's definition; > 0 discourages repeats).
      frequency_penalty: in [-2, 2]; subtracted from each token's logit once per time it
        appears in the output.
      repetition_penalty: > 0 (1 disables it); divides the positive logits and multiplies the
        negative ones of every token in the prompt or the output (the CTRL / HF rule).
      guided_decoding: a GuidedDecodingParams: every sampled token must keep the output
        inside its grammar (structured outputs), or None.
      kv_transfer_params: prefill/decode disaggregation (core/kv_connector.py), a JSON object:
        {"do_remote_decode": true} asks a producer engine to keep the prompt's KV for a
        consumer to pull; what the producer returns (its RequestOutput.kv_transfer_params,
        with "do_remote_prefill": true) asks a consumer to pull it instead of prefilling.
        Kept as its JSON text (the params stay hashable); read it with `transfer_params`.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    guided_decoding: GuidedDecodingParams | None = None
    kv_transfer_params: dict | str | None = None

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an int >= 1; ask for at least one token")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature={self.temperature!r} must be a number >= 0 (0 means greedy)")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature={self.temperature!r} must be >= 0; use 0 for greedy decoding")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 1, or -1 / 0 to disable top-k")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]; use 1.0 to disable nucleus sampling")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} must be an int or None")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be a sequence of ints, e.g. (2,)")
        stop = tuple(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"stop_token_ids={stop!r} must hold non-negative int token ids")
        object.__setattr__(self, "stop_token_ids", stop)
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise ValueError(f"{name}={value!r} must be a number in [-2, 2]; use 0 to disable it")
        value = self.repetition_penalty
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"repetition_penalty={value!r} must be a number > 0; use 1.0 to disable it")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise ValueError(f"guided_decoding must be a GuidedDecodingParams or None, "
                             f"got {type(self.guided_decoding).__name__}")
        if self.kv_transfer_params is not None:
            params = self.kv_transfer_params
            if isinstance(params, str):
                try:
                    params = json.loads(params)
                except json.JSONDecodeError:
                    params = None
            if not isinstance(params, dict):
                raise ValueError(f"kv_transfer_params={self.kv_transfer_params!r} must be a JSON object (a dict), "
                                 "e.g. {\"do_remote_decode\": true}, or None")
            try:
                object.__setattr__(self, "kv_transfer_params", json.dumps(params, sort_keys=True))
            except TypeError as e:
                raise ValueError(f"kv_transfer_params must hold JSON values only ({e})") from None

    @property
    def transfer_params(self) -> dict | None:
        """kv_transfer_params as a dict (None when not set)."""
        return None if self.kv_transfer_params is None else json.loads(self.kv_transfer_params)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class MultiModalFeature(NamedTuple):
    """One multimodal input: its content hash and where its placeholder tokens sit."""

    identifier: str  # content hash of the image/audio, stable across requests
    offset: int  # index of its first placeholder token in the prompt
    length: int  # number of placeholder tokens


_DEFAULT_SAMPLING_PARAMS = SamplingParams()
_NEVER = sys.maxsize  # no hasher attached: append never triggers hashing


class Request:
    """One generation request: prompt, outputs, progress and block hashes.

    `num_computed_tokens` counts tokens whose K/V is in the cache (set by the scheduler);
    `num_cached_tokens` is the prefix-cache hit of its first schedule (-1 until known);
    `spec_token_ids` are tokens proposed for its next step (speculative decoding,
    core/spec_decode.py): not part of its tokens until the target accepts them;
    `remote_kv` the kv_transfer_params of KV still to pull from a producer.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "cache_salt",
        "lora_name",
        "mm_features",
        "eos_token_id",
        "arrival_time",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "spec_token_ids",
        "remote_kv",
        "block_hashes",
        "block_hasher",
        "_output_token_ids",
        "_all_token_ids",
        "_next_hash_at",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids,
        sampling_params: SamplingParams | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        *,
        mm_features=None,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        block_hasher: BlockHasher | None = None,
    ):
        tokens = prompt_token_ids.tolist() if hasattr(prompt_token_ids, "tolist") else list(prompt_token_ids)
        if not tokens:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty; give at least one token")
        if sampling_params is None:
            sampling_params = _DEFAULT_SAMPLING_PARAMS
        elif not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        self.request_id = request_id
        self.prompt_token_ids = tokens
        self.sampling_params = sampling_params
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.mm_features = tuple(MultiModalFeature(*f) for f in mm_features) if mm_features else ()
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []
        # kv_transfer_params of a remote prefill still to pull (core/kv_connector.py); None
        # once pulled or failed: a preempted request recomputes, it never pulls twice.
        self.remote_kv: dict | None = None
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(tokens)
        self.block_hashes: list[bytes] = []
        self.block_hasher = None
        self._next_hash_at = _NEVER
        if block_hasher is not None:
            self.set_block_hasher(block_hasher)

    # token views (do not mutate the returned lists; use append_output_token_ids)
    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> str | None:
        return _FINISHED_REASONS.get(self.status)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append sampled tokens; hashes every block they complete (and only those)."""
        if not isinstance(token_ids, int) and hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()  # numpy scalar or array from the sampler
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            token_ids = list(token_ids)
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
        if len(self._all_token_ids) >= self._next_hash_at:
            self._hash_new_full_blocks()

    def set_block_hasher(self, block_hasher: BlockHasher | None) -> None:
        """Attach the hasher that fills `block_hashes` and bring the hashes up to date.

        Hashes already computed are kept: the caller (KVCacheManager) only swaps in a hasher
        with the same block size, hash function and chain root, or one for a request that has
        no hashes yet.
        """
        self.block_hasher = block_hasher
        if block_hasher is None or not block_hasher.enabled:
            self._next_hash_at = _NEVER
            return
        self._hash_new_full_blocks()

    def _hash_new_full_blocks(self) -> None:
        hasher = self.block_hasher
        self.block_hashes.extend(hasher(self))
        self._next_hash_at = (len(self.block_hashes) + 1) * hasher.block_size

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
