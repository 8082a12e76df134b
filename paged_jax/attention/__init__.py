"""How a model's attention runs on the paged pool (device side).

The runner builds one backend for the model's cache spec (`make_attention_backend`) and
hands it to the model's forward; the model calls it and never names an implementation.
registry.py holds the table (cache spec type, implementation) -> backend class and the
implementation names ("xla", "triton"; "pallas" is an alias of "triton"); backend.py holds the
GQA backends, mla.py the MLA ones, xla.py and mla_xla.py the gather-based paths (the fast ones
on CPU); the Pallas kernels live in pallas_kernels/, each with its reference.
"""

# backend and mla register their classes in the table on import.
from paged_jax.attention.backend import (QuantizedTritonAttention, QuantizedXlaAttention, TritonAttention,
                                         XlaAttention, bind_layer)
from paged_jax.attention.mla import MlaTritonAttention, MlaXlaAttention
from paged_jax.attention.registry import (ATTENTION_BACKENDS, ATTENTION_IMPL_ALIASES, ATTENTION_IMPLS,
                                          CANONICAL_ATTENTION_IMPLS, canonical_attention_impl,
                                          default_attention_impl, get_backend_class, make_attention_backend,
                                          register_backend)

__all__ = ["ATTENTION_BACKENDS", "ATTENTION_IMPLS", "ATTENTION_IMPL_ALIASES", "CANONICAL_ATTENTION_IMPLS",
           "MlaTritonAttention", "MlaXlaAttention", "QuantizedTritonAttention", "QuantizedXlaAttention",
           "TritonAttention", "XlaAttention", "bind_layer", "canonical_attention_impl", "default_attention_impl",
           "get_backend_class", "make_attention_backend", "register_backend"]
