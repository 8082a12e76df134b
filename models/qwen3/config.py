"""Qwen3Config: Qwen3 (Qwen3ForCausalLM), a Llama decoder with a per-head RMSNorm on q and k
before RoPE and a head_dim of its own (not hidden / heads); presets and the HF reader."""

from __future__ import annotations

import dataclasses

from models.llama.config import LlamaConfig
from models.qwen2.config import check_architecture, check_full_attention, llama_fields

__all__ = ["PRESETS", "Qwen3Config"]

# transformers' Qwen3Config.head_dim when config.json has none (Qwen3Attention always reads it).
DEFAULT_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """LlamaConfig's fields; q_norm and k_norm (RMSNorm over head_dim, eps rms_norm_eps) are implied."""

    @classmethod
    def from_hf_config(cls, hf: dict, *, dtype=None, param_dtype=None) -> Qwen3Config:
        """A Qwen3 config.json (transformers 4.x or 5.x keys) -> Qwen3Config.

        Raises:
          ValueError naming the field: another architecture, attention_bias, a sliding window,
          a RoPE type other than default / llama3, a missing shape.
        """
        check_architecture(hf, "qwen3", "Qwen3ForCausalLM")
        return cls(**qwen3_fields(hf, dtype=dtype, param_dtype=param_dtype))

    @classmethod
    def from_preset(cls, name: str, **overrides) -> Qwen3Config:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def to_hf_config(self) -> dict:
        return {**super().to_hf_config(), "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}


def qwen3_fields(hf: dict, *, dtype=None, param_dtype=None, head_dim_default: int | None = DEFAULT_HEAD_DIM) -> dict:
    """The LlamaConfig fields of a Qwen3-style config.json (Qwen3, Qwen3-MoE's attention).

    head_dim_default: what a config.json without head_dim means (transformers: Qwen3 128,
    Qwen3-MoE None, i.e. hidden_size / num_attention_heads).
    """
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported; Qwen3's projections have no bias")
    check_full_attention(hf)
    if hf.get("head_dim") is None and head_dim_default is not None:
        hf = {**hf, "head_dim": head_dim_default}
    return llama_fields(hf, dtype=dtype, param_dtype=param_dtype)


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
