"""DeepseekV2Config: shapes and numerics of a DeepSeek-V2 decoder (MLA + MoE), presets + HF config.json.

Conventions follow transformers' DeepseekV2ForCausalLM (the reference the model is tested
against), where they differ from the original DeepSeek code that is said here:
- YaRN: inverse frequencies and the cos/sin factor (`attention_factor`, from mscale /
  mscale_all_dim) as transformers' `_compute_yarn_parameters`; the softmax scale is
  qk_head_dim**-0.5 * yarn_mscale(factor, mscale_all_dim)**2 (`yarn_apply_mscale`).
- routing: softmax over experts in float32, top-k "greedy" or "group_limited_greedy",
  weights times routed_scaling_factor, never renormalised (transformers ignores
  norm_topk_prob, so a config asking for it is refused rather than served differently).
- layer i is a MoE layer iff i >= first_k_dense_replace (moe_layer_freq is not read).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from models.config import canonical_dtype, check_positive_ints, normalize_token_ids_and_dtypes

TOPK_METHODS = ("greedy", "group_limited_greedy")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN RoPE scaling as DeepSeek configures it (HF rope_type "yarn").

    Dimensions rotating fewer than beta_slow times over original_max_position_embeddings are
    interpolated (divided by factor), more than beta_fast times kept, a linear ramp between.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"rope_scaling factor={self.factor} must be > 0 (DeepSeek-V2 uses 40)")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(f"rope_scaling original_max_position_embeddings={self.original_max_position_embeddings} "
                             "must be > 0 (DeepSeek-V2 uses 4096)")

    @classmethod
    def from_dict(cls, d: dict, max_position_embeddings: int) -> YarnRopeScaling:
        original = d.get("original_max_position_embeddings") or max_position_embeddings
        factor = d.get("factor")
        if factor is None:  # transformers: the ratio of the two lengths
            factor = max_position_embeddings / original
        return cls(float(factor), int(original), float(d.get("beta_fast") or 32), float(d.get("beta_slow") or 1),
                   d.get("mscale"), d.get("mscale_all_dim"), d.get("attention_factor"), bool(d.get("truncate", True)))

    def cos_sin_factor(self) -> float:
        """The factor transformers multiplies cos and sin by (so rotated q and k carry it)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_factor(self) -> float:
        """What the softmax scale is multiplied by: yarn_mscale(factor, mscale_all_dim)**2."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def inv_freq(self, dim: int, rope_theta: float) -> np.ndarray:
        """f32[dim // 2], float32 arithmetic as transformers (torch float32) does it."""
        pos_freqs = np.float32(rope_theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
        extrapolation = np.float32(1.0) / pos_freqs
        interpolation = np.float32(1.0) / (np.float32(self.factor) * pos_freqs)

        def correction_dim(num_rotations):
            return (dim * math.log(self.original_max_position_embeddings / (num_rotations * 2 * math.pi))
                    ) / (2 * math.log(rope_theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers: prevent a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        extrapolation_factor = np.float32(1) - ramp.astype(np.float32)
        return (interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class DeepseekV2Config:
    """Shapes and numerics of a DeepSeek-V2 decoder. Frozen and hashable (it lives in the nnx graphdef).

    MLA: queries are [num_heads, qk_nope_head_dim + qk_rope_head_dim] (through a q_lora_rank
    bottleneck, or one projection when q_lora_rank is None); one token stores a latent c_kv
    of kv_lora_rank and a rope key of qk_rope_head_dim shared by all heads; kv_b_proj turns
    the latent into per-head k_nope [qk_nope_head_dim] and v [v_head_dim].
    MoE layers (i >= first_k_dense_replace): n_routed_experts experts of moe_intermediate_size,
    num_experts_per_tok chosen per token, plus n_shared_experts always-on experts.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    n_shared_experts: int = 0
    moe_intermediate_size: int = 1
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnRopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    param_dtype: str = "float32"
    dtype: str = "float32"

    def __post_init__(self):
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                   "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                   "max_position_embeddings"))
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank={self.q_lora_rank} must be a positive int or None (no query bottleneck)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if not 0 <= self.first_k_dense_replace:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must be >= 0")
        if self.num_moe_layers:
            if self.n_routed_experts <= 0:
                raise ValueError(f"n_routed_experts={self.n_routed_experts} must be > 0 when layers "
                                 f"{self.first_k_dense_replace}..{self.num_layers - 1} are MoE layers "
                                 "(or set first_k_dense_replace=num_layers for an all-dense model)")
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                                 f"1..n_routed_experts={self.n_routed_experts}")
            if self.moe_intermediate_size <= 0 or self.n_shared_experts < 0:
                raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be > 0 and "
                                 f"n_shared_experts={self.n_shared_experts} >= 0")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method={self.topk_method!r} is not implemented; use one of {TOPK_METHODS}")
        if self.topk_method == "group_limited_greedy" and self.num_moe_layers:
            n_group, topk_group = self.n_group or 0, self.topk_group or 0
            if not n_group or self.n_routed_experts % n_group or not 0 < topk_group <= n_group:
                raise ValueError(f"topk_method='group_limited_greedy' needs n_group (got {self.n_group}) dividing "
                                 f"n_routed_experts={self.n_routed_experts} and 0 < topk_group (got "
                                 f"{self.topk_group}) <= n_group")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be > 0")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnRopeScaling):
            raise ValueError(f"rope_scaling={self.rope_scaling!r} must be None or a YarnRopeScaling")
        normalize_token_ids_and_dtypes(self)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return max(0, self.num_layers - self.first_k_dense_replace)

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    @property
    def sm_scale(self) -> float:
        """Softmax scale of MLA: qk_head_dim**-0.5, times YaRN's mscale_all_dim correction."""
        scale = self.qk_head_dim ** -0.5
        return scale * self.rope_scaling.softmax_factor() if self.rope_scaling is not None else scale

    @classmethod
    def from_hf_config(cls, hf: dict, *, dtype=None, param_dtype=None) -> DeepseekV2Config:
        """A HF DeepSeek-V2 config.json dict (transformers 5.x rope_parameters, or the original
        checkpoints' rope_theta + rope_scaling) -> DeepseekV2Config.

        Raises:
          ValueError naming the field this model cannot serve (a rope scaling other than
          yarn, a topk_method not implemented, biases, norm_topk_prob, ...).
        """
        model_type = hf.get("model_type")
        architectures = hf.get("architectures") or []
        if model_type != "deepseek_v2" or any(a != "DeepseekV2ForCausalLM" for a in architectures):
            raise ValueError(f"model_type={model_type!r} architectures={architectures} is not supported here; "
                             "this config reads DeepSeek-V2 checkpoints (model_type 'deepseek_v2')")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported; DeepSeek-V2 uses 'silu'")
        for flag in ("attention_bias", "mlp_bias", "norm_topk_prob"):
            if hf.get(flag):
                raise ValueError(f"{flag}=true is not supported by this model (transformers' DeepseekV2, the "
                                 "reference, has no such path for it); set it to false")
        num_heads = hf.get("num_attention_heads")
        if hf.get("num_key_value_heads") not in (None, num_heads):
            raise ValueError(f"num_key_value_heads={hf['num_key_value_heads']} must equal num_attention_heads="
                             f"{num_heads}: MLA keys and values come per head out of the latent")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if key not in hf:
                raise ValueError(f"config.json has no {key!r}; a DeepSeek-V2 config needs it")
        max_positions = hf.get("max_position_embeddings", 2048)
        rope = dict(hf.get("rope_parameters") or {})
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        if not rope or rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = dict(hf.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            rope_scaling = None
        elif rope_type == "yarn":
            rope_scaling = YarnRopeScaling.from_dict(rope, max_positions)
        else:
            raise ValueError(f"rope_scaling rope_type={rope_type!r} is not supported for DeepSeek-V2; use "
                             "'yarn' (what DeepSeek ships) or no scaling")
        topk_method = hf.get("topk_method") or "greedy"
        if topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method={topk_method!r} is not implemented; use one of {TOPK_METHODS}")
        ckpt_dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        param_dtype = canonical_dtype(param_dtype if param_dtype is not None else ckpt_dtype, "param_dtype")
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"], num_heads=num_heads, kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], q_lora_rank=hf.get("q_lora_rank"),
            n_routed_experts=hf.get("n_routed_experts") or 0, num_experts_per_tok=hf.get("num_experts_per_tok") or 1,
            n_shared_experts=hf.get("n_shared_experts") or 0,
            moe_intermediate_size=hf.get("moe_intermediate_size") or 1,
            first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)), topk_method=topk_method,
            n_group=hf.get("n_group"), topk_group=hf.get("topk_group"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta), rope_scaling=rope_scaling,
            max_position_embeddings=max_positions, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=() if eos is None else (eos,) if isinstance(eos, int) else tuple(eos),
            param_dtype=param_dtype, dtype=dtype if dtype is not None else param_dtype,
        )


PRESETS: dict[str, DeepseekV2Config] = {
    # Test size: one dense layer, one MoE layer, q_lora, vocab 512 (the shipped tiny tokenizer).
    "tiny-mla": DeepseekV2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=48, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
        bos_token_id=1, eos_token_ids=(2,)),
    # deepseek-ai/DeepSeek-V2-Lite (shapes only; benchmarks build random weights of a few layers)
    "deepseek-v2-lite": DeepseekV2Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27, num_heads=16, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=None, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408, first_k_dense_replace=1,
        rope_scaling=YarnRopeScaling(40.0, 4096, 32.0, 1.0, 0.707, 0.707), max_position_embeddings=163840,
        bos_token_id=100000, eos_token_ids=(100001,), param_dtype="bfloat16", dtype="bfloat16"),
}
