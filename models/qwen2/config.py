"""Qwen2Config: Qwen2 / Qwen2.5 (Qwen2ForCausalLM), a Llama decoder whose q, k and v
projections carry a bias; presets and the HF config.json reader.

Everything but the bias is Llama's, so the config is LlamaConfig's fields, read by
LlamaConfig.from_hf_config (shapes, RoPE, dtypes, token ids). Sliding-window attention is
not served yet: a config that turns it on for any layer is refused (check_full_attention,
shared with Qwen3).
"""

from __future__ import annotations

import dataclasses

from models.llama.config import LlamaConfig

__all__ = ["PRESETS", "Qwen2Config", "check_full_attention"]


def check_full_attention(hf: dict) -> None:
    """ValueError when config.json gives any layer a sliding window shorter than the context.

    As transformers reads Qwen2 / Qwen3: the window applies only with use_sliding_window, to the
    layers layer_types marks "sliding_attention" (or, without layer_types, layers from
    max_window_layers on). A window at least max_position_embeddings long never slides.
    """
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    num_layers = hf.get("num_hidden_layers", 0)
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(num_layers)]
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer_types has {unknown}; only 'full_attention' layers are served")
    max_len = hf.get("max_position_embeddings", 2048)
    if window is not None and window < max_len and "sliding_attention" in layer_types:
        raise ValueError(f"sliding_window={window} (use_sliding_window=true, shorter than max_position_embeddings="
                         f"{max_len}): sliding-window attention is not supported yet; use a checkpoint with "
                         "use_sliding_window false")


@dataclasses.dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    """LlamaConfig's fields; every Qwen2 q_proj / k_proj / v_proj has a bias (o_proj none).

    from_hf_config raises ValueError naming the field: another architecture, a sliding window,
    a RoPE type other than default / llama3, a missing shape.
    """

    hf_model_type = "qwen2"
    hf_architectures = ("Qwen2ForCausalLM",)

    @classmethod
    def hf_fields(cls, hf: dict, *, dtype=None, param_dtype=None) -> dict:
        check_full_attention(hf)
        return super().hf_fields(hf, dtype=dtype, param_dtype=param_dtype)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> Qwen2Config:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def to_hf_config(self) -> dict:
        config = super().to_hf_config()
        del config["attention_bias"], config["mlp_bias"]  # Llama's flags; Qwen2's biases are implied
        return config


PRESETS: dict[str, Qwen2Config] = {
    # Test size with GQA; vocab 512 like Llama's "tiny" (the engine's shipped tokenizer fits).
    "tiny-qwen2": Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=2048, eos_token_ids=(2,)),
    # Qwen/Qwen2.5-0.5B-Instruct
    "qwen2.5-0.5b": Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
        head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_ids=(151645,), param_dtype="bfloat16",
        dtype="bfloat16"),
}
