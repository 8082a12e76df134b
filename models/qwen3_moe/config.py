"""Qwen3MoeConfig: Qwen3-MoE (Qwen3MoeForCausalLM), Qwen3's attention with top-k routed experts.

Read as transformers' Qwen3MoeConfig and Qwen3MoeDecoderLayer read config.json:
- layer i is a MoE layer iff i is not in mlp_only_layers, num_experts > 0 and
  (i + 1) % decoder_sparse_step == 0; the others are dense MLPs of intermediate_size;
- config.json spells num_experts "num_local_experts" (transformers' attribute map) or "num_experts";
- head_dim defaults to hidden_size / num_attention_heads (unlike Qwen3's 128);
- the router: softmax in float32 over all experts, the top num_experts_per_tok kept, divided
  by their sum when norm_topk_prob; no shared experts.
"""

from __future__ import annotations

import dataclasses

from models.config import check_positive_ints
from models.qwen3.config import Qwen3Config

__all__ = ["PRESETS", "Qwen3MoeConfig"]


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3Config's fields plus the experts (module docstring: which layers route, and how)."""

    hf_model_type = "qwen3_moe"
    hf_architectures = ("Qwen3MoeForCausalLM",)
    default_head_dim = None  # hidden_size / num_attention_heads, as transformers' Qwen3MoeConfig

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        check_positive_ints(self, ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                   "decoder_sparse_step"))
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be at most num_experts="
                             f"{self.num_experts}")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0

    @classmethod
    def hf_fields(cls, hf: dict, *, dtype=None, param_dtype=None) -> dict:
        """Qwen3's fields plus the experts'; ValueError naming the field for num_experts 0 (a
        dense model: load it as Qwen3) and what Qwen3's reader refuses."""
        if hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
            # Qwen3-MoE has no layer_types: every layer slides.
            hf = {**hf, "layer_types": ["sliding_attention"] * hf.get("num_hidden_layers", 0),
                  "max_window_layers": 0}
        num_experts = hf.get("num_local_experts", hf.get("num_experts", 128))
        if not num_experts:
            raise ValueError("num_experts=0: a Qwen3-MoE config without experts is a dense model; this family "
                             "needs num_experts > 0")
        return dict(super().hf_fields(hf, dtype=dtype, param_dtype=param_dtype),
                    num_experts=int(num_experts), num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
                    moe_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                    mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))

    @classmethod
    def from_preset(cls, name: str, **overrides) -> Qwen3MoeConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def to_hf_config(self) -> dict:
        return {**super().to_hf_config(), "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok, "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob, "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers)}


PRESETS: dict[str, Qwen3MoeConfig] = {
    # Test size: 4 experts, 2 per token; layer 1 dense (mlp_only_layers), so two kinds of layer.
    "tiny-qwen3-moe": Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=2048, eos_token_ids=(2,),
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=(1,)),
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        bos_token_id=151643, eos_token_ids=(151645,), param_dtype="bfloat16", dtype="bfloat16",
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
}
