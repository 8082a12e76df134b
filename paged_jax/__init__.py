"""paged-jax: vLLM's paged KV-cache system rebuilt for JAX.

The host-side modules (block manager, scheduler, batch building) import no jax, so
`import paged_jax.core.kv_cache_manager` stays light. The engine API is loaded lazily.
"""

__all__ = ["EngineConfig", "LLM", "LLMEngine", "SamplingParams", "GuidedDecodingParams", "RequestOutput"]


def __getattr__(name):
    if name == "LLM":
        from paged_jax.llm import LLM

        return LLM
    if name == "LLMEngine":
        from paged_jax.engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from paged_jax.engine_config import EngineConfig

        return EngineConfig
    if name == "RequestOutput":
        from paged_jax.outputs import RequestOutput

        return RequestOutput
    if name == "SamplingParams":
        from paged_jax.core.request import SamplingParams

        return SamplingParams
    if name == "GuidedDecodingParams":
        from paged_jax.core.request import GuidedDecodingParams

        return GuidedDecodingParams
    raise AttributeError(f"module 'paged_jax' has no attribute {name!r}")
