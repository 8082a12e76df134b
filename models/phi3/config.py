"""Phi3Config: Phi-3 / Phi-3.5 / Phi-4-mini (Phi3ForCausalLM), presets and the HF config.json reader.

The decoder is Llama's but for RoPE: its rotary part may be a fraction of each head
(partial_rotary_factor, rotate_half over the first rotary_dim dims, the rest passed through),
and its scaling may be LongRoPE (rope_type "longrope", formerly "su"): per-frequency divisors
short_factor / long_factor and cos / sin multiplied by attention_factor (default
sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), factor = max_position_embeddings /
original_max_position_embeddings), as transformers' _compute_longrope_parameters reads them.

transformers picks short_factor while a sequence is at most original_max_position_embeddings
long and long_factor for the whole sequence past that. A paged cache cannot follow that switch
(the cached keys were rotated with the factors of their time), so the factors are fixed per
load (as vLLM fixes them per max_model_len): by default short_factor with
max_position_embeddings cut to original_max_position_embeddings (exactly transformers within
that length); `long_context=True` serves the checkpoint's max_position_embeddings with
long_factor (exactly transformers for sequences longer than original_max_position_embeddings).

Sliding windows (Phi-3-mini-4k's 2047) are not served yet: refused when shorter than the context.
"""

from __future__ import annotations

import dataclasses
import math

from models.llama.config import LlamaConfig

__all__ = ["PRESETS", "ROPE_TYPES", "LongRopeScaling", "Phi3Config"]

# "su" and "yarn": older names transformers' Phi3Config reads as "longrope".
ROPE_TYPES = ("default", "longrope", "su", "yarn")
# transformers' Phi3Config.original_max_position_embeddings when config.json has none.
DEFAULT_ORIGINAL_MAX_POSITION_EMBEDDINGS = 4096


@dataclasses.dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE with the factors this load uses (module docstring: which, and why fixed).

    Attributes:
      rescale_factors: one divisor per rotary frequency (rotary_dim / 2 of them): short_factor
        or long_factor.
      attention_factor: what cos and sin are multiplied by.
      original_max_position_embeddings: the pre-training context the short factors serve.
    """

    rescale_factors: tuple[float, ...]
    attention_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        object.__setattr__(self, "rescale_factors", tuple(float(f) for f in self.rescale_factors))
        if not all(f > 0 for f in self.rescale_factors):
            raise ValueError(f"rope_scaling factors {self.rescale_factors} must all be > 0")
        if not self.attention_factor > 0:
            raise ValueError(f"rope_scaling attention_factor={self.attention_factor} must be > 0")


@dataclasses.dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    """LlamaConfig's fields (rope_scaling always None) plus Phi-3's RoPE.

    rotary_dim = int(head_dim * partial_rotary_factor) dims of each head rotate; long_rope,
    when set, divides their frequencies and scales cos / sin.
    """

    hf_model_type = "phi3"
    hf_architectures = ("Phi3ForCausalLM",)

    partial_rotary_factor: float = 1.0
    long_rope: LongRopeScaling | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.rope_scaling is not None:
            raise ValueError("Phi3Config takes its RoPE scaling as long_rope (a LongRopeScaling), not rope_scaling")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"head_dim={self.head_dim} * partial_rotary_factor={self.partial_rotary_factor} gives "
                             f"{self.rotary_dim} rotary dims; RoPE needs a positive even number")
        if self.long_rope is not None and len(self.long_rope.rescale_factors) != self.rotary_dim // 2:
            raise ValueError(f"rope_scaling has {len(self.long_rope.rescale_factors)} factors; rotary_dim="
                             f"{self.rotary_dim} needs {self.rotary_dim // 2}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_config(cls, hf: dict, *, dtype=None, param_dtype=None, long_context: bool = False) -> Phi3Config:
        """A Phi-3 config.json (transformers 4.x rope_scaling / rope_theta or 5.x rope_parameters) -> Phi3Config.

        Args:
          long_context: serve the checkpoint's max_position_embeddings with long_factor
            (module docstring); False serves up to original_max_position_embeddings with
            short_factor. Only a longrope config has the choice.
        Raises:
          ValueError naming the field: another architecture, a window that is not a positive
          int, a rope type not in ROPE_TYPES, factors of the wrong length.
        """
        cls.check_architecture(hf)
        max_len = hf.get("max_position_embeddings", 4096)
        window = hf.get("sliding_window")
        rope = dict(hf.get("rope_parameters") or {})
        if rope.get("rope_type", rope.get("type", "default")) == "default" and hf.get("rope_scaling"):
            rope = {**rope, **hf["rope_scaling"]}  # 4.x: the scaling beside a top-level rope_theta
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        fields = cls.hf_fields({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                                "rope_scaling": None}, dtype=dtype, param_dtype=param_dtype)
        long_rope = None
        if rope_type != "default":
            # transformers (standardize_rope_params) takes Phi-3's top-level value over the rope dict's.
            original = int(hf.get("original_max_position_embeddings", DEFAULT_ORIGINAL_MAX_POSITION_EMBEDDINGS))
            missing = [k for k in ("short_factor", "long_factor") if not rope.get(k)]
            if missing:
                raise ValueError(f"rope_type={rope_type!r} needs {missing} in rope_scaling / rope_parameters")
            factor = rope.get("factor") or max_len / original
            attention_factor = rope.get("attention_factor")
            if attention_factor is None:
                attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
            long_rope = LongRopeScaling(rope["long_factor" if long_context else "short_factor"],
                                        float(attention_factor), original)
            if not long_context:
                fields["max_position_embeddings"] = min(max_len, original)
        elif long_context:
            raise ValueError("long_context=True: this config has no longrope scaling; load it without long_context")
        # Every layer's window (Phi-3-mini-4k: 2047); one as long as the context never slides.
        if window is not None and window < fields["max_position_embeddings"]:
            fields["sliding_window"] = window
        return cls(**fields, partial_rotary_factor=partial, long_rope=long_rope)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> Phi3Config:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def to_hf_config(self) -> dict:
        """The config.json of a Phi-3 checkpoint of these shapes (ValueError with LongRoPE: one
        factor set is kept, and config.json needs both)."""
        if self.long_rope is not None:
            raise ValueError("to_hf_config: a Phi3Config keeps one set of LongRoPE factors and config.json needs "
                             "short_factor and long_factor; keep the checkpoint's own config.json")
        config = {**super().to_hf_config(), "partial_rotary_factor": self.partial_rotary_factor,
                  "sliding_window": self.sliding_window}
        del config["attention_bias"], config["mlp_bias"]  # Llama's flags, not Phi-3's
        return config


PRESETS: dict[str, Phi3Config] = {
    # Test size: half of each head rotates, with LongRoPE short factors over its 4 frequencies.
    "tiny-phi3": Phi3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
        bos_token_id=1, eos_token_ids=(2,), partial_rotary_factor=0.5,
        long_rope=LongRopeScaling((1.0, 1.2, 1.5, 2.0), 1.1, 512)),
    # microsoft/Phi-3-mini-4k-instruct's shapes (random weights), its 2047-token window included.
    "phi-3-mini": Phi3Config(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_layers=32, num_heads=32, num_kv_heads=32,
        head_dim=96, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        bos_token_id=1, eos_token_ids=(32000,), param_dtype="bfloat16", dtype="bfloat16", sliding_window=2047),
}
