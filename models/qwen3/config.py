"""Qwen3Config: Qwen3 (Qwen3ForCausalLM), a Llama decoder with a per-head RMSNorm on q and k
before RoPE and a head_dim of its own (not hidden / heads); presets and the HF reader."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from models.llama.config import LlamaConfig
from models.qwen2.config import check_full_attention

__all__ = ["PRESETS", "Qwen3Config"]


@dataclasses.dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """LlamaConfig's fields; q_norm and k_norm (RMSNorm over head_dim, eps rms_norm_eps) are implied.

    from_hf_config raises ValueError naming the field: another architecture, attention_bias,
    a sliding window, a RoPE type other than default / llama3, a missing shape.
    """

    hf_model_type = "qwen3"
    hf_architectures = ("Qwen3ForCausalLM",)
    # What a config.json without head_dim means: transformers' Qwen3Config says 128 (Qwen3Attention
    # always reads it); None is hidden_size / num_attention_heads (Qwen3-MoE's).
    default_head_dim: ClassVar[int | None] = 128

    @classmethod
    def hf_fields(cls, hf: dict, *, dtype=None, param_dtype=None) -> dict:
        if hf.get("attention_bias"):
            raise ValueError("attention_bias=true is not supported; Qwen3's projections have no bias")
        check_full_attention(hf)
        if hf.get("head_dim") is None and cls.default_head_dim is not None:
            hf = {**hf, "head_dim": cls.default_head_dim}
        return super().hf_fields(hf, dtype=dtype, param_dtype=param_dtype)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> Qwen3Config:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS: dict[str, Qwen3Config] = {
    # Test size: head_dim 24 != hidden / heads (16), as in Qwen3's larger models.
    "tiny-qwen3": Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=24, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=2048, eos_token_ids=(2,)),
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
        head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_ids=(151645,), param_dtype="bfloat16",
        dtype="bfloat16"),
}
