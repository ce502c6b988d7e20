"""Load a Hugging Face model folder (config.json + safetensors) into a cadence model.

Local folders only: every transformers call gets ``local_files_only=True`` so a typo in a path
never turns into a hub download.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import Any

import torch

from cadence.config import ModelConfig
from cadence.distributed import ep_size, pp_size
from cadence.models import get_model_class
from cadence.quantization.checkpoint import PACKED_METHODS
from cadence.tokenizer_loader import load_tokenizer  # re-exported; it imports no torch itself

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INDEX_FILE = "model.safetensors.index.json"


def _check_folder(path: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"model path {path!r} does not exist or is not a directory")
    return folder


def load_hf_config(path: str) -> Any:
    """The transformers config of the model folder at ``path``."""
    folder = _check_folder(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"no config.json in model folder {path!r}")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def safetensors_files(path: str) -> list[Path]:
    """The weight files: those named by the shard index if there is one, else all *.safetensors."""
    folder = _check_folder(path)
    index = folder / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{_INDEX_FILE} in {path!r} names missing shards: {missing[:5]}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in (*folder.glob("*.bin"), *folder.glob("*.pt"),
                                          *folder.glob("*.pth")))
        if pickled:
            # Unpickling a checkpoint runs whatever code it carries; safetensors cannot.
            raise ValueError(
                f"{path!r} holds only pickle checkpoints ({', '.join(pickled[:3])}); cadence "
                "loads safetensors only, since loading a pickle can run arbitrary code. "
                "Convert once with transformers: AutoModelForCausalLM.from_pretrained(path)"
                ".save_pretrained(out) writes model.safetensors")
        raise ValueError(f"no safetensors weights (*.safetensors) found in {path!r}")
    return files


def iterate_weights(path: str, skip: Callable[[str], bool] | None = None,
                    shape_only: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the folder's safetensors files, one at a time;
    a tensor whose name ``skip`` rejects is never read, and one named in ``shape_only`` is
    not read either: its shape comes as a stride-0 view (``CausalLM.load_weights``)."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = f.keys()  # a safetensors handle is not iterable itself
            for name in names:
                if skip is not None and skip(name):
                    continue
                if name in shape_only:
                    shape = f.get_slice(name).get_shape()
                    yield name, torch.zeros((), dtype=torch.float32).expand(shape)
                else:
                    yield name, f.get_tensor(name)


def load_model(model_config: ModelConfig) -> tuple[torch.nn.Module, Any]:
    """Build the model at ``model_config.model`` and load its weights -> (model, hf_config)."""
    hf_config = load_hf_config(model_config.model)
    model_cls = get_model_class(getattr(hf_config, "architectures", None),
                                getattr(hf_config, "model_type", None))
    safetensors_files(model_config.model)  # fail before the (slower) model build
    dtype = torch_dtype(model_config.dtype)
    model = model_cls(hf_config, dtype, max_model_len=model_config.max_model_len)
    skip = None
    if pp_size() > 1 or ep_size() > 1:
        # A pipeline stage reads its own tensors only: another stage's layers are neither
        # read from disk nor converted (a 4-stage split reads a quarter of the checkpoint);
        # an expert-parallel rank, the same for the experts of the other ranks.
        def skip(name: str) -> bool:
            return model.stage_weight_name(model.body_weight_name(name)) is None
    weights = iterate_weights(model_config.model, skip)
    packed = None
    if model_config.quantization in PACKED_METHODS:
        from cadence.quantization.checkpoint import checkpoint_quantization, method_label
        from cadence.quantization.packed import PackedReader

        lean = model.takes_tensors_as_they_are  # see PackedReader
        packed = PackedReader(checkpoint_quantization(model_config.model), lean=lean)
        weights = packed.read(weights)
    if packed is not None:
        from cadence.quantization.weights import attach_blocks

        model.load_weights(weights, optional=packed.zero_biases, shape_only=packed.shape_only)
        packed.report()
        attached = attach_blocks(model, packed.blocks, method_label(model_config.quantization),
                                 verify=not lean)
        packed.fill_unattached(model, attached)
        return model.eval(), hf_config
    if model_config.quantization == "gguf":
        from cadence.quantization.weights import load_with_gguf_blocks

        load_with_gguf_blocks(model, model_config.model, skip)
        return model.eval(), hf_config
    model.load_weights(weights)
    if model_config.quantization == "int8":
        from cadence.quantization.weights import attach_int8

        attach_int8(model)
    return model.eval(), hf_config


def torch_dtype(name: str) -> torch.dtype:
    """``ModelConfig.dtype`` string -> torch dtype."""
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


__all__ = [
    "iterate_weights",
    "load_hf_config",
    "load_model",
    "load_tokenizer",
    "safetensors_files",
    "torch_dtype",
]
