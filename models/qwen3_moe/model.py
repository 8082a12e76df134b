"""Qwen3-MoE decoder (Flax NNX): Qwen3's attention, then a dense MLP or top-k routed experts.

Routing as transformers' Qwen3MoeTopKRouter: logits x @ gate in the compute dtype, softmax in
float32 over every expert, the top num_experts_per_tok kept (renormalized to sum 1 when
norm_topk_prob), cast back to the compute dtype. The experts run densely (as DeepSeek-V2's
default, models/deepseek_v2/model.py): every expert on every token as flat [D, E * F]
matmuls, each expert's output weighted by its routing weight (exactly 0 when unchosen).

Einsum legend: T tokens, D hidden, E experts, F expert MLP hidden.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.layers import MLP, PreNormBlock, normal_param
from models.qwen3.model import PARAM_PARTITION_RULES as QWEN3_RULES
from models.qwen3.model import Qwen3ForCausalLM
from models.qwen3_moe.config import Qwen3MoeConfig
from paged_jax.sharding import TP_AXIS

__all__ = ["PARAM_PARTITION_RULES", "Qwen3MoeForCausalLM", "SparseMoeBlock", "route"]

# Qwen3's layout; each expert's MLP splits on its hidden dim like the dense MLP (gate / up
# column-parallel, down row-parallel); the router is replicated.
PARAM_PARTITION_RULES: Mapping[str, P] = MappingProxyType({
    **QWEN3_RULES,
    "experts_gate": P(None, None, TP_AXIS),  # [D, E, F]
    "experts_up": P(None, None, TP_AXIS),  # [D, E, F]
    "experts_down": P(None, TP_AXIS, None),  # [E, F, D]
})


def route(config: Qwen3MoeConfig, x, gate):
    """Top-k experts of each token: (i32[T, k] expert ids, [T, k] weights in x's dtype).

    x: [T, D]; gate: [D, E].
    """
    logits = jnp.einsum("TD,DE->TE", x, gate.astype(x.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, config.num_experts_per_tok)
    if config.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return experts, weights.astype(x.dtype)


class SparseMoeBlock(nnx.Module):
    """num_experts SwiGLU experts of moe_intermediate_size; each token's output is its top-k experts' weighted sum."""

    def __init__(self, config: Qwen3MoeConfig, *, rngs: nnx.Rngs):
        c = config
        d, e, f, pd = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.param_dtype
        self.config = c
        self.gate = normal_param(rngs, (d, e), d, pd)  # [D, E]: the router
        self.experts_gate = normal_param(rngs, (d, e, f), d, pd)  # [D, E, F]
        self.experts_up = normal_param(rngs, (d, e, f), d, pd)  # [D, E, F]
        self.experts_down = normal_param(rngs, (e, f, d), f, pd)  # [E, F, D]

    def __call__(self, x):
        dt = self.config.dtype
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, D]
        experts, weights = route(self.config, x, self.gate[...])
        d, e, f = self.experts_gate.shape
        combine = jnp.zeros((x.shape[0], e), dt).at[jnp.arange(x.shape[0])[:, None], experts].set(weights)  # [T, E]
        gate = x @ self.experts_gate[...].astype(dt).reshape(d, e * f)
        up = x @ self.experts_up[...].astype(dt).reshape(d, e * f)
        h = (jax.nn.silu(gate) * up).reshape(-1, e, f) * combine[:, :, None]  # [T, E, F]
        out = h.reshape(-1, e * f) @ self.experts_down[...].astype(dt).reshape(e * f, d)
        return out.reshape(shape)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3ForCausalLM whose MoE layers (config.is_moe_layer) route to experts."""

    param_partition_rules = PARAM_PARTITION_RULES

    @classmethod
    def make_layer(cls, config: Qwen3MoeConfig, layer_id: int, *, rngs: nnx.Rngs) -> PreNormBlock:
        c = config
        # The MLP is drawn from rngs before the attention, dense layers' too (the seeded weights).
        mlp = (SparseMoeBlock(c, rngs=rngs) if c.is_moe_layer(layer_id)
               else MLP(c.hidden_size, c.intermediate_size, param_dtype=c.param_dtype, dtype=c.dtype, rngs=rngs))
        return cls.layer_class(c, rngs=rngs, mlp=mlp)
