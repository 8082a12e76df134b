"""What the engine hands back per request: vLLM's RequestOutput, CompletionOutput and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prefix-cache hit tokens at the first schedule
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None  # "stop", "length", "abort"; None while running
    stop_reason: int | None = None


@dataclass
class RequestOutput:
    """vLLM's RequestOutput: one per prompt; `text`, `token_ids` and `finish_reason` are
    shortcuts to its single completion."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)
    # A producer's finished request (disaggregation): where a consumer pulls its prompt's KV.
    kv_transfer_params: dict | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

