"""MistralConfig: Mistral (MistralForCausalLM), which is Llama with an optional sliding window.

A Mistral decoder is Llama's (GQA, SwiGLU, rotate_half RoPE, untied head) plus an optional
sliding window over the keys on every layer (Mistral-7B v0.1: 4096). The window is
LlamaConfig.sliding_window: every layer's attention masks keys older than it and its cache
spec carries it, so the engine keeps one sliding-window KV-cache group that frees the blocks
that slid out. sliding_window null (Mistral-7B v0.2 / v0.3), or a window at least the context
long, never slides: None.
"""

from __future__ import annotations

import dataclasses

from models.llama.config import LlamaConfig

__all__ = ["PRESETS", "MistralConfig"]


@dataclasses.dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    """LlamaConfig's fields: the model is models.llama.LlamaForCausalLM.

    from_hf_config raises ValueError naming the field: another architecture, a window that is
    not a positive int, a RoPE type other than default / llama3, a missing shape.
    """

    hf_model_type = "mistral"
    hf_architectures = ("MistralForCausalLM",)

    @classmethod
    def hf_fields(cls, hf: dict, *, dtype=None, param_dtype=None) -> dict:
        window, max_len = hf.get("sliding_window"), hf.get("max_position_embeddings", 2048)
        fields = super().hf_fields(hf, dtype=dtype, param_dtype=param_dtype)
        # A window as long as the context never slides: full attention, one full group.
        return {**fields, "sliding_window": window if window is not None and window < max_len else None}

    @classmethod
    def from_preset(cls, name: str, **overrides) -> MistralConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def to_hf_config(self) -> dict:
        config = {**super().to_hf_config(), "sliding_window": self.sliding_window}
        del config["attention_bias"], config["mlp_bias"]  # Llama's flags, not Mistral's
        return config


PRESETS: dict[str, MistralConfig] = {
    "tiny-mistral": MistralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=2048,
        bos_token_id=1, eos_token_ids=(2,)),
    # mistralai/Mistral-7B-Instruct-v0.3
    "mistral-7b-v0.3": MistralConfig(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
        bos_token_id=1, eos_token_ids=(2,), param_dtype="bfloat16", dtype="bfloat16"),
}
