"""Gemma3Config: Gemma 3's text decoder (Gemma3ForCausalLM), presets and the HF config.json reader.

Llama's fields, plus what Gemma 3 adds: every layer is a sliding-window layer (window
`sliding_window`, RoPE base `rope_local_base_freq`) or a full-attention one (RoPE base
`rope_theta`, scaled linearly by `rope_linear_factor`), as `layer_types` says (by default
every sixth layer full, transformers' sliding_window_pattern 6); the softmax scale is
query_pre_attn_scalar ** -0.5. Implied, as in every Gemma 3: QK-norm, four RMSNorms a layer
that scale by (1 + weight), a GELU-tanh gated MLP, embeddings times sqrt(hidden_size), tied
output head (unless tie_word_embeddings is false).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from models.kv_cache_spec import check_sliding_window
from models.llama.config import LlamaConfig

__all__ = ["LAYER_TYPES", "PRESETS", "Gemma3Config"]

LAYER_TYPES = ("sliding_attention", "full_attention")
_SLIDING_WINDOW_PATTERN = 6  # transformers' Gemma3TextConfig default: layers 5, 11, 17, ... are full


def default_layer_types(num_layers: int, pattern: int = _SLIDING_WINDOW_PATTERN) -> tuple[str, ...]:
    """Every pattern-th layer full attention, the others sliding (transformers' rule)."""
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def _rope_factor(params: dict, where: str) -> float:
    """The linear RoPE factor of one layer type's rope parameters (1.0 for "default")."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return 1.0
    if rope_type == "linear" and where == "full_attention":
        return float(params["factor"])
    raise ValueError(f"rope_scaling: rope_type={rope_type!r} for {where} layers is not supported; Gemma 3 uses "
                     "'default' (and 'linear' on full-attention layers)")


@dataclasses.dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    """LlamaConfig's fields (rope_theta: the full-attention layers' base; rope_scaling unused,
    always None) plus Gemma 3's. Raises ValueError naming the field for a window that is not a
    positive int, layer_types of the wrong length or kind, or a scale that is not positive."""

    sliding_window: int = 512
    layer_types: tuple[str, ...] = ()  # () -> default_layer_types(num_layers)
    rope_local_base_freq: float = 10000.0
    rope_linear_factor: float = 1.0
    query_pre_attn_scalar: float = 256.0
    tie_word_embeddings: bool = True

    hf_model_type = "gemma3_text"
    hf_architectures: ClassVar[tuple[str, ...]] = ("Gemma3ForCausalLM",)

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window is None:
            raise ValueError("sliding_window=None: Gemma 3's local layers need a window (a positive int, 512 in "
                             "Gemma 3 270M)")
        check_sliding_window(self.sliding_window)
        object.__setattr__(self, "layer_types", tuple(self.layer_types) or default_layer_types(self.num_layers))
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types={list(self.layer_types)} must give each of the {self.num_layers} layers "
                             f"one of {LAYER_TYPES}")
        if self.rope_scaling is not None:
            raise ValueError("rope_scaling must be None for Gemma 3; its full layers' linear scaling is "
                             "rope_linear_factor")
        for name in ("rope_local_base_freq", "rope_linear_factor", "query_pre_attn_scalar"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's window: sliding_window for a sliding layer, None for a full one."""
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> Gemma3Config:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    @classmethod
    def hf_fields(cls, hf: dict, *, dtype=None, param_dtype=None) -> dict:
        """Gemma3TextConfig's keys, transformers 5.x (rope_parameters per layer type) or 4.x
        (rope_theta, rope_local_base_freq, rope_scaling for the full layers, sliding_window_pattern)."""
        activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation={activation!r} is not supported; Gemma 3 uses 'gelu_pytorch_tanh'")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(key) is not None:
                raise ValueError(f"{key}={hf[key]} is not supported; Gemma 3 has no soft-capping (null)")
        if hf.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=true is not supported; only causal Gemma 3 decoders load")
        rope = dict(hf.get("rope_parameters") or {})
        if "full_attention" in rope or "sliding_attention" in rope:  # 5.x
            full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
        else:  # 4.x, or a flat rope_parameters: the full layers'
            full = {**(hf.get("rope_scaling") or {}), **rope}
            full.setdefault("rope_theta", hf.get("rope_theta", 1000000.0))
            local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
        num_layers = hf.get("num_hidden_layers", 0)
        layer_types = hf.get("layer_types") or default_layer_types(
            num_layers, hf.get("sliding_window_pattern", _SLIDING_WINDOW_PATTERN))
        defaults = {"head_dim": 256, "tie_word_embeddings": True, "max_position_embeddings": 131072,
                    "bos_token_id": 2, "eos_token_id": 1, "rms_norm_eps": 1e-6}
        llama_keys = {**defaults, **{k: v for k, v in hf.items() if v is not None or k not in defaults},
                      "hidden_act": "silu", "rope_parameters": None, "rope_scaling": None,
                      "rope_theta": full.get("rope_theta", 1000000.0)}
        return {**super().hf_fields(llama_keys, dtype=dtype, param_dtype=param_dtype),
                "sliding_window": hf.get("sliding_window", 4096), "layer_types": tuple(layer_types),
                "rope_local_base_freq": float(local.get("rope_theta", 10000.0)),
                "rope_linear_factor": _rope_factor(full, "full_attention") * _rope_factor(local, "sliding_attention"),
                "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256))}

    def to_hf_config(self) -> dict:
        """The config.json of a Gemma3ForCausalLM of these shapes (transformers 5.x keys)."""
        hf = super().to_hf_config()
        for key in ("hidden_act", "rope_theta", "rope_scaling", "mlp_bias"):
            hf.pop(key)
        full = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_linear_factor != 1.0:
            full = {"rope_type": "linear", "rope_theta": self.rope_theta, "factor": self.rope_linear_factor}
        return {**hf, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": self.sliding_window,
                "layer_types": list(self.layer_types),
                "query_pre_attn_scalar": int(scalar) if (scalar := self.query_pre_attn_scalar).is_integer() else scalar,
                "rope_parameters": {"full_attention": full, "sliding_attention": {
                    "rope_type": "default", "rope_theta": self.rope_local_base_freq}},
                "final_logit_softcapping": None, "attn_logit_softcapping": None}


PRESETS: dict[str, Gemma3Config] = {
    # Test size: 6 layers (5 sliding, the last full, as Gemma's pattern), a window of 8 so short
    # prompts slide, one KV head, head_dim 32 != hidden / heads, a softmax scale of its own.
    "tiny-gemma3": Gemma3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=1,
        head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=2048, bos_token_id=2,
        eos_token_ids=(1,), sliding_window=8, query_pre_attn_scalar=24.0),
    # Gemma 3 270M's shapes, as its GGUF's metadata gives them (tests/test_gemma3.py checks it);
    # random weights: the trained model is the named model "gemma-3-270m".
    "gemma3-270m-shapes": Gemma3Config(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18, num_heads=4, num_kv_heads=1,
        head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        bos_token_id=2, eos_token_ids=(1,), sliding_window=512, query_pre_attn_scalar=256.0),
}
