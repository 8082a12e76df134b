"""HF model directories (config.json + safetensors), read for any family's loader.

Tensors are streamed one at a time with safetensors' safe_open(framework="flax"): numpy has
no bfloat16, so framework="np" cannot read bf16 checkpoints. A family's loader
(models/<family>/hf.py) builds its model skeleton with nnx.eval_shape (no random init, no
memory) and fills each parameter with set_param as its tensor is read.
"""

from __future__ import annotations

import contextlib
import json
import os

from safetensors import safe_open

__all__ = ["SINGLE_FILE", "hf_tensor_reader", "read_hf_config", "set_param", "tensor_files"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def tensor_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file holding it (single file or sharded index)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as fh:
            weight_map = json.load(fh).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map'; it is not a safetensors shard index")
        return {name: os.path.join(path, shard) for name, shard in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.exists(single):
        raise ValueError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}; "
                         "save the checkpoint with safe_serialization=True")
    with safe_open(single, framework="flax") as fh:
        return {name: single for name in fh.keys()}


def read_hf_config(path: str) -> dict:
    """config.json of a HF model directory; ValueError naming the directory when it has none."""
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{path} has no config.json; point load_hf_checkpoint at a HF model directory")
    with open(config_path) as fh:
        return json.load(fh)


@contextlib.contextmanager
def hf_tensor_reader(files: dict[str, str]):
    """get_tensor(name) over the safetensors files of tensor_files (tensor name -> file),
    each file open for the with-block (tensors are read one at a time, never all at once)."""
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, framework="flax")) for file in set(files.values())}
        yield lambda name: handles[files[name]].get_tensor(name)


def set_param(param, value) -> None:
    """Fill a parameter of an nnx.eval_shape skeleton with value (same shape and dtype).

    A fresh Variable from eval_shape holds a ShapeDtypeStruct, so it is replaced whole
    (set_value since flax 0.12; the .value setter before it).
    """
    if hasattr(param, "set_value"):
        param.set_value(value)
    else:
        param.value = value
