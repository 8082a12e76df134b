"""Gemma 3 decoder (Flax NNX): Qwen3's q/k-normed GQA attention with a window, a RoPE base and a
softmax scale of each layer's own, in a block with four norms (a norm after attention and after
the MLP, before their residual adds), a GELU-tanh gated MLP and scaled embeddings.

    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

Every norm is Gemma3RMSNorm: x / rms(x) * (1 + weight), in float32, then cast (transformers'
Gemma3RMSNorm); the parameter is HF's weight (zero-centred), the GGUF loader subtracts the 1
llama.cpp's converter adds. A sliding layer's attention sees its latest sliding_window keys
(its own included); its kv_cache_specs entry carries that window to the paged backends, and
the dense reference masks the same way. Tensor-parallel rules are Llama's (the norms replicated,
no lm_head: the head is the embedding).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.gemma3.config import Gemma3Config
from models.layers import MLP, RMSNorm, apply_rope, rope_inv_freq
from models.llama.model import PARAM_PARTITION_RULES as LLAMA_RULES
from models.llama.model import LlamaForCausalLM
from models.qwen3.model import Qwen3Attention

__all__ = ["PARAM_PARTITION_RULES", "Gemma3Attention", "Gemma3DecoderLayer", "Gemma3ForCausalLM", "Gemma3RMSNorm"]

# Llama's, but for lm_head: Gemma 3 ties its output head to the (vocab-split) embedding; the
# head of a checkpoint that unties it stays whole.
PARAM_PARTITION_RULES: Mapping[str, P] = MappingProxyType({k: v for k, v in LLAMA_RULES.items() if k != "lm_head"})


class Gemma3RMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), multiplied in float32 and then cast; weight starts at 0."""

    def __init__(self, dim: int, eps: float, *, param_dtype: str, dtype: str):
        super().__init__(dim, eps, param_dtype=param_dtype, dtype=dtype)
        self.weight = nnx.Param(jnp.zeros((dim,), param_dtype))  # [D]

    def __call__(self, x):
        return (self._normalized(x) * (1.0 + self.weight[...].astype(jnp.float32))).astype(self.dtype)


class Gemma3Attention(Qwen3Attention):
    """Qwen3's attention with Gemma's norms; layer layer_id's window and RoPE (sliding: window
    sliding_window, base rope_local_base_freq; full: no window, base rope_theta, linear factor),
    scale query_pre_attn_scalar ** -0.5."""

    norm_class = Gemma3RMSNorm

    def __init__(self, config: Gemma3Config, layer_id: int, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        self.sliding_window = config.layer_windows[layer_id]

    @property
    def sm_scale(self) -> float:
        return self.config.query_pre_attn_scalar ** -0.5

    def _rotate(self, q, k, positions):
        c = self.config
        if self.sliding_window is not None:
            inv_freq = rope_inv_freq(c.head_dim, c.rope_local_base_freq, None)
        else:
            inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, None) / np.float32(c.rope_linear_factor)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)


class Gemma3DecoderLayer(nnx.Module):
    """Gemma 3's block (module docstring), called as every family's layer is."""

    def __init__(self, config: Gemma3Config, layer_id: int, *, rngs: nnx.Rngs):
        c = config

        def norm():
            return Gemma3RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)

        self.input_layernorm = norm()
        self.self_attn = Gemma3Attention(c, layer_id, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = MLP(c.hidden_size, c.intermediate_size, param_dtype=c.param_dtype, dtype=c.dtype, rngs=rngs,
                       activation="gelu_pytorch_tanh")
        self.post_feedforward_layernorm = norm()

    def _mlp(self, x):
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def __call__(self, x, positions, kv_cache, attn_metadata, attention):
        attn, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, attn_metadata, attention)
        return self._mlp(x + self.post_attention_layernorm(attn)), kv_cache

    def dense(self, x, positions):
        return self._mlp(x + self.post_attention_layernorm(self.self_attn.dense(self.input_layernorm(x), positions)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's stages and KV-cache specs (one per layer, with its window) over Gemma 3's
    layers; embeddings scaled by sqrt(hidden_size) in the embedding's dtype, a Gemma final norm."""

    param_partition_rules = PARAM_PARTITION_RULES
    layer_class = Gemma3DecoderLayer

    def __init__(self, config: Gemma3Config, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        self.norm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=config.param_dtype,
                                  dtype=config.dtype)

    @classmethod
    def make_layer(cls, config: Gemma3Config, layer_id: int, *, rngs: nnx.Rngs) -> Gemma3DecoderLayer:
        return cls.layer_class(config, layer_id, rngs=rngs)

    def _embed(self, token_ids):
        c = self.config
        # transformers: embedding(ids) * tensor(sqrt(hidden)).to(weight dtype).
        normalizer = jnp.asarray(math.sqrt(c.hidden_size), jnp.float32).astype(c.param_dtype)
        x = super()._embed(token_ids)
        return x * normalizer.astype(x.dtype)
