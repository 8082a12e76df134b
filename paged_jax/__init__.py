"""paged-jax: vLLM's paged KV-cache system rebuilt for JAX.

The host-side modules (block manager, scheduler, batch building) import no jax, so
`import paged_jax.core.kv_cache_manager` stays light. The engine API is loaded lazily.
"""

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput"]


def __getattr__(name):
    if name in ("LLM", "LLMEngine", "RequestOutput"):
        from paged_jax import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from paged_jax.core.request import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'paged_jax' has no attribute {name!r}")
