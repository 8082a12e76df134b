"""The Llama family (LlamaForCausalLM: GQA attention, SwiGLU MLP, rotate_half RoPE).

One place for everything Llama-specific; models/registry.py holds its row.
- config.py: LlamaConfig (presets, HF config.json reader and writer);
- model.py: the attention, decoder layer and model, and PARAM_PARTITION_RULES (how each
  weight splits over a tensor-parallel mesh);
- hf.py: the HF tensor map (`hf_layout`) and the HF directory loader / saver;
- gguf.py: the GGUF metadata -> LlamaConfig reader, the GGUF tensor-name map and the q/k
  row un-permutation llama.cpp's converter calls for.
The families on Llama's decoder (Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi-3) subclass these at
their seams: the config's hf_model_type / hf_architectures / hf_fields, the attention's
_project / _rotate, the layer's attention_class, the model's layer_class / make_layer, and
hf_layout + model_from_hf_tensors(model_class=, layout=).
"""

from models.llama.config import PRESETS, Llama3RopeScaling, LlamaConfig
from models.llama.gguf import GGUF_ARCHITECTURES, load_gguf_checkpoint, read_gguf_config
from models.llama.hf import load_hf_checkpoint, model_from_hf_tensors, save_hf_checkpoint
from models.llama.model import PARAM_PARTITION_RULES, Attention, DecoderLayer, LlamaForCausalLM

__all__ = ["GGUF_ARCHITECTURES", "PARAM_PARTITION_RULES", "PRESETS", "Attention", "DecoderLayer", "Llama3RopeScaling",
           "LlamaConfig", "LlamaForCausalLM", "load_gguf_checkpoint", "load_hf_checkpoint", "model_from_hf_tensors",
           "read_gguf_config", "save_hf_checkpoint"]
