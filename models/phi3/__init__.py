"""The Phi-3 family (Phi3ForCausalLM: Phi-3, Phi-3.5-mini, Phi-4-mini): Llama's decoder with Phi-3's RoPE.

One place for everything Phi-3-specific; models/registry.py holds its row.
- config.py: Phi3Config (partial rotary dims, LongRoPE with its factors fixed per load;
  presets, HF config.json reader);
- model.py: the rotation, the attention, the decoder layer and model, PARAM_PARTITION_RULES
  (Llama's);
- hf.py: the HF loader (fused qkv_proj / gate_up_proj split into Llama's tensor map).
No GGUF map yet.
"""

from models.phi3.config import PRESETS, ROPE_TYPES, LongRopeScaling, Phi3Config
from models.phi3.hf import load_hf_checkpoint, model_from_hf_tensors
from models.phi3.model import PARAM_PARTITION_RULES, Phi3Attention, Phi3ForCausalLM

__all__ = ["PARAM_PARTITION_RULES", "PRESETS", "ROPE_TYPES", "LongRopeScaling", "Phi3Attention", "Phi3Config",
           "Phi3ForCausalLM", "load_hf_checkpoint", "model_from_hf_tensors"]
