"""DeepSeek-V2 decoder (Flax NNX): multi-head latent attention on the paged latent pool, dense and MoE MLPs.

The model interface is the Llama family's (docs/ARCHITECTURE.md "The model interface"):
`kv_cache_specs`, `embed`, `layers`, `compute_logits`, `__call__` (the engine's step over a
ragged batch) and `dense_forward` (full causal attention with decompressed keys and values,
no cache: the reference the paged path is tested against, next to transformers).

MLA (per layer): the query is [N, P + R] (nope and rope parts), from x directly or through a
q_lora_rank bottleneck; kv_a_proj_with_mqa gives the latent c_kv [L] (RMS-normed) and a rope
key [R] shared by all heads. The cache stores exactly those two per token
(MLAAttentionSpec); kv_b_proj [L, N, P + V] is W_uk | W_uv, handed to the attention backend,
which attends in latent space for decodes (absorbed) and may decompress for prefill chunks.
RoPE is the interleaved (complex-pair) layout transformers' DeepseekV2 uses, and YaRN's cos/sin
factor multiplies rotated q and k as it does there.

MoE layers (i >= first_k_dense_replace): softmax router in float32, top-k experts per token
(greedy or group-limited greedy), weights times routed_scaling_factor, plus shared experts.
Routed experts run densely by default (MOE_IMPL): every expert on every token, the
unchosen ones weighted exactly 0, as three flat matmuls over [D, E * F]. The grouped
alternative (tokens sorted by expert, jax.lax.ragged_dot) computes only the chosen experts
but measured several times slower on CPU with DeepSeek-V2-Lite's 64 experts / top-6
(scripts/bench_mla.py); it is kept, tested equal, for accelerators where ragged_dot is a
grouped GEMM (not measured here).

Einsum legend: T tokens, D hidden, N heads, P qk_nope_head_dim, R qk_rope_head_dim,
H P + R, L kv_lora_rank, Q q_lora_rank, V v_head_dim, E experts, F MLP hidden, S keys.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.deepseek_v2.config import DeepseekV2Config
from models.kv_cache_spec import MLAAttentionSpec
from models.layers import MASK_VALUE, MLP, CausalLM, PreNormBlock, RMSNorm, normal_param

__all__ = ["MOE_IMPL", "PARAM_PARTITION_RULES", "DecoderLayer", "DeepseekV2ForCausalLM", "MLAttention", "MoE", "route"]

# Tensor parallelism: none yet. The MLA latent pool has no sharded cache spec
# (paged_jax/sharding.py SHARDED_CACHE_SPECS), so the runner refuses a mesh for this family and
# models.registry.load_model refuses to place its checkpoints; every weight stays whole. When MLA
# is sharded, its head-split weights (q_proj / q_b_proj, kv_b_proj, o_proj) and the experts are
# named here, and only here: Llama's rules never apply to these parameters.
PARAM_PARTITION_RULES: Mapping[str, P] = MappingProxyType({})
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps
MOE_IMPL = "dense"  # "dense" (every expert, every token) or "grouped" (ragged_dot over tokens sorted by expert)


@functools.lru_cache(maxsize=None)
def rope_tables(config: DeepseekV2Config) -> tuple[np.ndarray, float]:
    """(f32[R // 2] inverse frequencies, cos/sin factor) of the config's rope (YaRN or plain)."""
    c = config
    if c.rope_scaling is None:
        exponents = np.arange(0, c.qk_rope_head_dim, 2).astype(np.float32) / np.float32(c.qk_rope_head_dim)
        return (np.float32(1.0) / np.float32(c.rope_theta) ** exponents).astype(np.float32), 1.0
    return c.rope_scaling.inv_freq(c.qk_rope_head_dim, c.rope_theta), c.rope_scaling.cos_sin_factor()


def apply_rope_interleaved(x, positions, inv_freq, factor: float):
    """Rotate x[..., T, heads, R] by positions[..., T], dims (2i, 2i+1) as one complex pair.

    transformers' DeepseekV2 rotates this way (view_as_complex), and scales cos and sin by
    YaRN's attention factor.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, R/2]
    cos = (jnp.cos(angles) * factor)[..., None, :]  # [..., T, 1, R/2]
    sin = (jnp.sin(angles) * factor)[..., None, :]
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([real * cos - imag * sin, real * sin + imag * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


class MLAttention(nnx.Module):
    """Multi-head latent attention; the cache holds the normed latent and the rotated rope key."""

    def __init__(self, config: DeepseekV2Config, *, rngs: nnx.Rngs):
        c = config
        d, n, h, pd = c.hidden_size, c.num_heads, c.qk_head_dim, c.param_dtype
        self.config = c
        if c.q_lora_rank is None:
            self.q_proj = normal_param(rngs, (d, n, h), d, pd)  # [D, N, H]
        else:
            self.q_a_proj = normal_param(rngs, (d, c.q_lora_rank), d, pd)  # [D, Q]
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, param_dtype=pd, dtype=c.dtype)
            self.q_b_proj = normal_param(rngs, (c.q_lora_rank, n, h), c.q_lora_rank, pd)  # [Q, N, H]
        self.kv_a_proj_with_mqa = normal_param(rngs, (d, c.kv_lora_rank + c.qk_rope_head_dim), d, pd)  # [D, L + R]
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS, param_dtype=pd, dtype=c.dtype)
        self.kv_b_proj = normal_param(rngs, (c.kv_lora_rank, n, c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank,
                                 pd)  # [L, N, P + V]
        self.o_proj = normal_param(rngs, (n, c.v_head_dim, d), n * c.v_head_dim, pd)  # [N, V, D]

    def _project(self, x, positions):
        """q_nope [..., T, N, P], q_rope [..., T, N, R], c_kv [..., T, L], k_rope [..., T, R] (rotated)."""
        c, dt = self.config, self.config.dtype
        if c.q_lora_rank is None:
            q = jnp.einsum("...D,DNH->...NH", x, self.q_proj[...].astype(dt))
        else:
            q_a = self.q_a_layernorm(jnp.einsum("...D,DQ->...Q", x, self.q_a_proj[...].astype(dt)))
            q = jnp.einsum("...Q,QNH->...NH", q_a, self.q_b_proj[...].astype(dt))
        q_nope, q_rope = jnp.split(q, [c.qk_nope_head_dim], axis=-1)
        kv_a = jnp.einsum("...D,DK->...K", x, self.kv_a_proj_with_mqa[...].astype(dt))
        c_kv, k_rope = jnp.split(kv_a, [c.kv_lora_rank], axis=-1)
        inv_freq, factor = rope_tables(c)
        q_rope = apply_rope_interleaved(q_rope, positions, inv_freq, factor)
        k_rope = apply_rope_interleaved(k_rope[..., None, :], positions, inv_freq, factor)[..., 0, :]
        return q_nope, q_rope, self.kv_a_layernorm(c_kv), k_rope

    def _out(self, attn):
        n, v, d = self.o_proj.shape
        return attn.reshape(*attn.shape[:-2], n * v) @ self.o_proj[...].astype(self.config.dtype).reshape(n * v, d)

    def __call__(self, x, positions, kv_cache, attn_metadata, attention):
        """Paged MLA over a ragged batch: x [T, D], positions i32[T], kv_cache (c_kv_cache, k_rope_cache)
        -> ([T, D], kv_cache with this step's latents written)."""
        c = self.config
        q_nope, q_rope, c_kv, k_rope = self._project(x, positions)
        w_uk, w_uv = jnp.split(self.kv_b_proj[...], [c.qk_nope_head_dim], axis=-1)  # [L, N, P], [L, N, V]
        attn, kv_cache = attention(q_nope, q_rope, c_kv, k_rope, kv_cache, attn_metadata, w_uk=w_uk, w_uv=w_uv,
                                   sm_scale=c.sm_scale)
        return self._out(attn.astype(c.dtype)), kv_cache

    def dense(self, x, positions):
        """Full causal attention with decompressed keys and values: x [B, T, D] -> [B, T, D]."""
        c, dt = self.config, self.config.dtype
        q_nope, q_rope, c_kv, k_rope = self._project(x, positions)
        kv = jnp.einsum("BSL,LNK->BSNK", c_kv, self.kv_b_proj[...].astype(dt))
        k_nope, v = jnp.split(kv, [c.qk_nope_head_dim], axis=-1)  # [B, S, N, P], [B, S, N, V]
        scores = (jnp.einsum("BTNP,BSNP->BNTS", q_nope, k_nope, preferred_element_type=jnp.float32)
                  + jnp.einsum("BTNR,BSR->BNTS", q_rope, k_rope, preferred_element_type=jnp.float32))
        t = x.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores * c.sm_scale, MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return self._out(jnp.einsum("BNTS,BSNV->BTNV", probs, v))


def route(config: DeepseekV2Config, x, router):
    """Top-k experts of each token: (i32[T, k] expert ids, f32[T, k] weights incl. routed_scaling_factor).

    x: [T, D]; router: f32[D, E]. Logits and softmax in float32 (transformers keeps the gate in f32).
    """
    c = config
    scores = jax.nn.softmax(jnp.einsum("TD,DE->TE", x.astype(jnp.float32), router.astype(jnp.float32)), axis=-1)
    if c.topk_method == "group_limited_greedy":
        # Keep the experts of the topk_group groups with the best single expert, zero the rest.
        groups = scores.reshape(scores.shape[0], c.n_group, -1)  # [T, groups, E / groups]
        _, best_groups = jax.lax.top_k(groups.max(axis=-1), c.topk_group)
        keep = jnp.zeros(groups.shape[:2], bool).at[jnp.arange(scores.shape[0])[:, None], best_groups].set(True)
        scores = jnp.where(keep[..., None], groups, 0.0).reshape(scores.shape)
    weights, experts = jax.lax.top_k(scores, c.num_experts_per_tok)
    return experts, weights * c.routed_scaling_factor


class MoE(nnx.Module):
    """Routed experts (top-k per token) plus shared experts; the output is their sum."""

    def __init__(self, config: DeepseekV2Config, *, rngs: nnx.Rngs):
        c = config
        d, f, e, pd = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.param_dtype
        self.config = c
        self.gate = nnx.Param(jax.random.normal(rngs.params(), (d, e), jnp.float32))  # [D, E], float32 always
        # Gate and up are [D, E, F], so the dense path is one [T, D] x [D, E * F] matmul each
        # (a batched 'TD,EDF' einsum measured slower on CPU); down is [E, F, D].
        self.experts_gate = normal_param(rngs, (d, e, f), d, pd)  # [D, E, F]
        self.experts_up = normal_param(rngs, (d, e, f), d, pd)  # [D, E, F]
        self.experts_down = normal_param(rngs, (e, f, d), f, pd)  # [E, F, D]
        self.shared_experts = (MLP(d, f * c.n_shared_experts, param_dtype=pd, dtype=c.dtype, rngs=rngs)
                               if c.n_shared_experts else None)

    def _experts_dense(self, x, experts, weights):
        """Every expert on every token, the unchosen ones weighted 0 (exactly 0): [T, D]."""
        dt = self.config.dtype
        d, e, f = self.experts_gate.shape
        combine = jnp.zeros((x.shape[0], e), jnp.float32)
        combine = combine.at[jnp.arange(x.shape[0])[:, None], experts].set(weights)  # [T, E]
        gate = x @ self.experts_gate[...].astype(dt).reshape(d, e * f)
        up = x @ self.experts_up[...].astype(dt).reshape(d, e * f)
        h = (jax.nn.silu(gate) * up).reshape(-1, e, f) * combine[:, :, None].astype(dt)  # [T, E, F]
        return h.reshape(-1, e * f) @ self.experts_down[...].astype(dt).reshape(e * f, d)

    def _experts_grouped(self, x, experts, weights):
        """(token, expert) pairs sorted by expert, one ragged matmul per projection: [T, D]."""
        dt = self.config.dtype
        num_tokens, k = experts.shape
        flat_experts = experts.reshape(-1)  # [T * k]
        order = jnp.argsort(flat_experts)
        token_of = order // k
        group_sizes = jnp.bincount(flat_experts, length=self.gate.shape[1]).astype(jnp.int32)
        xs = x[token_of]  # [T * k, D], grouped by expert
        gate = jax.lax.ragged_dot(xs, jnp.moveaxis(self.experts_gate[...].astype(dt), 1, 0), group_sizes)
        up = jax.lax.ragged_dot(xs, jnp.moveaxis(self.experts_up[...].astype(dt), 1, 0), group_sizes)
        y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, self.experts_down[...].astype(dt), group_sizes)
        y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        return jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[token_of].add(y).astype(dt)

    def __call__(self, x, impl: str | None = None):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, weights = route(self.config, x, self.gate[...])
        run = self._experts_dense if (impl or MOE_IMPL) == "dense" else self._experts_grouped
        out = run(x, experts, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape)


class DecoderLayer(PreNormBlock):
    """DeepSeek-V2's block: MLA, then a dense MLP or MoE (PreNormBlock's residual wiring)."""

    def __init__(self, config: DeepseekV2Config, layer_id: int, *, rngs: nnx.Rngs):
        c = config
        norm = functools.partial(RMSNorm, c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)
        self.input_layernorm = norm()
        self.self_attn = MLAttention(c, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.mlp = (MoE(c, rngs=rngs) if c.is_moe_layer(layer_id)
                    else MLP(c.hidden_size, c.intermediate_size, param_dtype=c.param_dtype, dtype=c.dtype,
                              rngs=rngs))


class DeepseekV2ForCausalLM(CausalLM):
    """Embedding -> num_layers decoder layers -> final RMSNorm -> lm_head (or the tied embedding)."""

    param_partition_rules = PARAM_PARTITION_RULES

    def __init__(self, config: DeepseekV2Config, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.embed_tokens = nnx.Param(  # [V, D]
            jax.random.normal(rngs.params(), (c.vocab_size, c.hidden_size), jnp.float32).astype(c.param_dtype))
        self.layers = nnx.List([DecoderLayer(c, i, rngs=rngs) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)
        self.lm_head = None if c.tie_word_embeddings else normal_param(rngs, (c.vocab_size, c.hidden_size), c.hidden_size,
                                                                 c.param_dtype)  # [V, D]

    def kv_cache_specs(self, dtype=None, kv_cache_dtype: str = "auto",
                       kv_cache_scaling: str = "per_token") -> tuple[MLAAttentionSpec, ...]:
        """One spec per layer: the latent and the rope key (dtype defaults to the compute dtype).

        The latent pool is not quantized: kv_cache_dtype must be "auto" (ValueError otherwise)."""
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: the MLA latent cache (DeepSeek-V2) is stored in the "
                             "model's dtype only; use kv_cache_dtype='auto'")
        c = self.config
        return (MLAAttentionSpec(c.kv_lora_rank, c.qk_rope_head_dim, str(jnp.dtype(dtype or c.dtype))),) * c.num_layers
