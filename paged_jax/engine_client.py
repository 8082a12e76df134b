"""EngineClient: what the LLM facade, the CLI and the server ask of an engine.

LLMEngine (one engine) and DataParallelEngine (replicas behind a prefix-aware router) both
implement it, so a caller never asks which one it holds (no `getattr(engine, "replicas")`)
and never reaches into an engine's runner or block manager: stopping background work and
dropping the prefix cache are the engine's own verbs. Imports no jax.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from paged_jax.core.request import SamplingParams
from paged_jax.core.tokenizer import Tokenizer
from paged_jax.outputs import RequestOutput


@runtime_checkable
class EngineClient(Protocol):
    """add_request / step / abort_request, and what serving around them needs."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer prompts are encoded and outputs decoded with."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids generation stops at (the tokenizer's, else the model config's)."""

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output a request may reach."""

    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    *, cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Queues one request; ValueError naming the fix for bad input (nothing is queued then)."""

    def step(self) -> list[RequestOutput]:
        """One schedule -> run -> update; the outputs of the requests that got tokens."""

    def abort_request(self, request_id: str) -> bool:
        """Stops a request and frees its blocks; False if it is unknown or already done."""

    def has_unfinished_requests(self) -> bool:
        """Whether a step would have work."""

    def get_stats(self) -> dict:
        """KV usage, prefix-cache hits, preemptions, compilations (a read: changes nothing)."""

    def chat_prompt(self, messages, *, add_generation_prompt: bool = True, chat_template: str | None = None,
                    sampling_params: SamplingParams | None = None) -> tuple[list[int], SamplingParams]:
        """A conversation as prompt ids, and sampling params that also stop at the end of the turn."""

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (benchmark runs that must not feed each other); False,
        changing nothing, while a request still holds blocks."""

    def shutdown(self) -> None:
        """Stops background work (bucket compilation, disk writes: what is queued is written
        first). Idempotent; the engine takes no new requests afterwards, get_stats still reads."""


__all__ = ["EngineClient"]
