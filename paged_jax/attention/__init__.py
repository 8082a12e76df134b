"""How a model's attention runs on the paged pool (device side).

The runner builds one backend for the model's cache spec (`make_attention_backend`) and
hands it to the model's forward; the model calls it and never names an implementation.
xla.py is the gather-based path (the fast one on CPU); the Pallas kernels live in
pallas_kernels/, each with its reference.
"""

from paged_jax.attention.backend import (ATTENTION_IMPLS, AttentionBackend, PallasAttention, XlaAttention,
                                         bind_layer, default_attention_impl, make_attention_backend)

__all__ = ["ATTENTION_IMPLS", "AttentionBackend", "PallasAttention", "XlaAttention", "bind_layer",
           "default_attention_impl", "make_attention_backend"]
