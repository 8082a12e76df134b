"""The Qwen3-MoE family (Qwen3MoeForCausalLM): Qwen3's attention, top-k routed experts.

One place for everything Qwen3-MoE-specific; models/registry.py holds its row.
- config.py: Qwen3MoeConfig (Qwen3's fields plus the experts; which layers route);
- model.py: the router, the experts (run densely), the model, PARAM_PARTITION_RULES;
- hf.py: the HF loader (Llama's tensor map, Qwen3's norms, per-expert or fused experts).
No GGUF map yet, and no packed weights (the experts are plain jnp matmuls).
"""

from models.qwen3_moe.config import PRESETS, Qwen3MoeConfig
from models.qwen3_moe.hf import load_hf_checkpoint, model_from_hf_tensors
from models.qwen3_moe.model import PARAM_PARTITION_RULES, Qwen3MoeForCausalLM, SparseMoeBlock, route

__all__ = ["PARAM_PARTITION_RULES", "PRESETS", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "SparseMoeBlock",
           "load_hf_checkpoint", "model_from_hf_tensors", "route"]
