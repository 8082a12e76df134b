"""LlamaConfig: the shapes and numerics of a Llama-family decoder (presets + HF config.json).

The config describes the model only. How attention runs (the XLA path or the Pallas kernel)
is a property of the platform: the runner builds an attention backend and passes it to the
forward, so the same loaded weights run on either path.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from models.config import Llama3RopeScaling, canonical_dtype, check_positive_ints, normalize_token_ids_and_dtypes
from models.kv_cache_spec import check_sliding_window

__all__ = ["PRESETS", "Llama3RopeScaling", "LlamaConfig"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and numerics of a Llama/GQA decoder. Frozen and hashable (it lives in the nnx graphdef).

    param_dtype is how weights are stored; dtype is the compute dtype of activations and the
    default KV-cache dtype. Norms, softmax and logits accumulate in float32 whatever dtype is.
    sliding_window: the tokens (the query's own included) every layer's attention sees, for a
    family whose layers all slide (Mistral); None, every Llama: every earlier token.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None  # a dict is accepted and converted
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    param_dtype: str = "float32"
    dtype: str = "float32"
    sliding_window: int | None = None

    # The config.json model_type and architectures this class reads and writes; a family's
    # subclass names its own (check_architecture refuses every other).
    hf_model_type: ClassVar[str] = "llama"
    hf_architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)

    def __post_init__(self):
        check_sliding_window(self.sliding_window)
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                   "num_kv_heads", "head_dim", "max_position_embeddings"))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                             f"{self.num_kv_heads} (each kv head serves a whole group of query heads)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs of dims)")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} must be > 0 (Llama uses 1e-5)")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be > 0 (Llama-3 uses 500000.0)")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", Llama3RopeScaling.from_dict(self.rope_scaling))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ValueError(f"rope_scaling={self.rope_scaling!r} must be None, a Llama3RopeScaling "
                             "or a llama3 dict")
        normalize_token_ids_and_dtypes(self)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> LlamaConfig:
        """A named shape ("tiny", "smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"); overrides replace fields."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    @classmethod
    def from_hf_config(cls, hf: dict, *, dtype=None, param_dtype=None) -> LlamaConfig:
        """A HF config.json dict (transformers 4.x or 5.x) -> a config of this class.

        4.x writes rope_theta + rope_scaling + torch_dtype; 5.x writes rope_parameters (with
        rope_type, rope_theta and the llama3 factors) + dtype. param_dtype defaults to the
        checkpoint's dtype, dtype (compute) to param_dtype.

        Raises:
          ValueError naming the field: another architecture (check_architecture), or a key
          hf_fields cannot serve.
        """
        cls.check_architecture(hf)
        return cls(**cls.hf_fields(hf, dtype=dtype, param_dtype=param_dtype))

    @classmethod
    def check_architecture(cls, hf: dict) -> None:
        """ValueError unless config.json's model_type is hf_model_type and its architectures hf_architectures'."""
        model_type = hf.get("model_type")
        architectures = hf.get("architectures") or []
        if model_type != cls.hf_model_type or any(a not in cls.hf_architectures for a in architectures):
            raise ValueError(f"model_type={model_type!r} architectures={architectures} is not supported; only "
                             f"{'/'.join(cls.hf_architectures)} checkpoints (model_type {cls.hf_model_type!r}) load")

    @classmethod
    def hf_fields(cls, hf: dict, *, dtype=None, param_dtype=None) -> dict:
        """This class's fields from config.json's Llama keys (shapes, RoPE, dtypes, token ids),
        architecture unchecked: ValueError naming a key Llama's decoder cannot serve.

        A family's subclass extends it: its own refusals first, then its own fields added.
        """
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported; Llama uses 'silu'")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{flag}=true is not supported; Llama projections have no bias")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"config.json has no {key!r}; a Llama config needs it")

        # 5.x: rope_parameters carries theta and scaling; 4.x: top-level rope_theta + rope_scaling.
        rope = dict(hf.get("rope_parameters") or {})
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        if not rope or rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = dict(hf.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            rope_scaling = None
        elif rope_type == "llama3":
            rope_scaling = Llama3RopeScaling.from_dict(rope)
        else:
            raise ValueError(f"rope_type={rope_type!r} is not supported; use 'default' or 'llama3'")

        ckpt_dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        param_dtype = canonical_dtype(param_dtype if param_dtype is not None else ckpt_dtype, "param_dtype")
        eos = hf.get("eos_token_id")
        num_heads = hf["num_attention_heads"]
        return dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=() if eos is None else (eos,) if isinstance(eos, int) else tuple(eos),
            param_dtype=param_dtype,
            dtype=dtype if dtype is not None else param_dtype,
        )

    def to_hf_config(self) -> dict:
        """The config.json a HF checkpoint of these shapes carries (4.x keys, read by 5.x too;
        model_type and architectures this class's)."""
        scaling = None
        if self.rope_scaling is not None:
            scaling = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        eos = list(self.eos_token_ids)
        return {
            "architectures": list(self.hf_architectures), "model_type": self.hf_model_type, "hidden_act": "silu",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "attention_bias": False, "mlp_bias": False, "torch_dtype": self.param_dtype,
        }


_LLAMA3_1_SCALING = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)

PRESETS: dict[str, LlamaConfig] = {
    # Test size with GQA (2 query heads per kv head). vocab 512 so the engine's shipped tiny
    # tokenizer fits.
    "tiny": LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,)),
    # HuggingFaceTB/SmolLM2-135M-Instruct (its GGUF loads by name; this is its shape for random
    # weights, e.g. the GPU check, which cannot carry the 93 MB file)
    "smollm2-135m": LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
        param_dtype="bfloat16", dtype="bfloat16"),
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001,),
        param_dtype="bfloat16", dtype="bfloat16"),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_1_SCALING, max_position_embeddings=131072,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001,),
        param_dtype="bfloat16", dtype="bfloat16"),
}
