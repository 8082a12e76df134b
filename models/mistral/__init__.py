"""The Mistral family (MistralForCausalLM): Llama's model with every layer's sliding window, Mistral's config reader.

One place for everything Mistral-specific; models/registry.py holds its row.
- config.py: MistralConfig (LlamaConfig's fields, sliding_window among them; presets, the
  config.json reader);
- hf.py: the HF loader (Llama's tensor map, into models.llama.LlamaForCausalLM).
The model, its tensor-parallel rules and the GGUF map (llama.cpp writes Mistral as "llama")
are the Llama family's.
"""

from models.llama.model import PARAM_PARTITION_RULES, LlamaForCausalLM
from models.mistral.config import PRESETS, MistralConfig
from models.mistral.hf import load_hf_checkpoint

__all__ = ["PARAM_PARTITION_RULES", "PRESETS", "LlamaForCausalLM", "MistralConfig", "load_hf_checkpoint"]
