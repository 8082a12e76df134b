"""The DeepSeek-V2 family (DeepseekV2ForCausalLM: multi-head latent attention, dense and MoE MLPs).

One place for everything DeepSeek-V2-specific; models/registry.py holds its row.
- config.py: DeepseekV2Config and YaRN RoPE scaling (presets, HF config.json reader);
- model.py: MLA, the router and experts, the decoder layer and model, and
  PARAM_PARTITION_RULES (empty: no tensor parallelism yet, model.py says why);
- hf.py: the HF tensor map and directory loader (per-expert or fused expert tensors).
No GGUF map yet.
"""

from models.deepseek_v2.config import PRESETS, DeepseekV2Config, YarnRopeScaling
from models.deepseek_v2.hf import load_hf_checkpoint, model_from_hf_tensors
from models.deepseek_v2.model import PARAM_PARTITION_RULES, DeepseekV2ForCausalLM, MoE

__all__ = ["PARAM_PARTITION_RULES", "PRESETS", "DeepseekV2Config", "DeepseekV2ForCausalLM", "MoE", "YarnRopeScaling",
           "load_hf_checkpoint", "model_from_hf_tensors"]
