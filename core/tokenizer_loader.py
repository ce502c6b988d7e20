"""A model folder's tokenizer, loaded without importing torch where that gives the same object.

``transformers.AutoTokenizer`` chooses a tokenizer class from the tokenizer's and the model's
configs, and importing it imports transformers' config machinery, which imports torch:
measured on the default model, 3-4 s of the engine process's start-up against ~1.2 s for
the tokenizer itself. Where the folder names transformers' generic class (``TokenizersBackend``,
or its alias ``PreTrainedTokenizerFast``), has no custom code, and its model type is one
for which AutoTokenizer keeps that class (``_GENERIC_MODEL_TYPES``; others, such as qwen2,
get a family class instead), AutoTokenizer ends in ``TokenizersBackend.from_pretrained``
itself, so cadence calls that directly. Every other folder goes through AutoTokenizer.
tests/test_tokenizer_loader.py checks, for each tiny model family and the default model, that
both ways give the same class, token ids, decoded text, special tokens and chat prompts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# Model types whose registered tokenizer class AutoTokenizer does not force over a generic
# class named by the folder (transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS and
# the Mistral tokenizer's own format are the cases it does).
_GENERIC_MODEL_TYPES = frozenset({"llama"})


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def uses_generic_tokenizer(path: str) -> bool:
    """Whether AutoTokenizer would load the folder at ``path`` as the generic
    ``TokenizersBackend`` (module docstring), judged from its JSON files alone."""
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        return False
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    if "auto_map" in tokenizer_config:
        return False
    model_type = _read_json(folder / "config.json").get("model_type")
    return (tokenizer_config.get("tokenizer_class") in _GENERIC_CLASSES
            and model_type in _GENERIC_MODEL_TYPES)


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the local model folder at ``path``, as ``AutoTokenizer`` loads it.

    Local files only: a typo in a path never turns into a hub download.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"model path {path!r} does not exist or is not a directory")
    try:
        if uses_generic_tokenizer(path):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # the tokenizers library raises plain Exception for a bad file
        # transformers' own message names a file and a parser position, not which folder
        # the engine was reading as a tokenizer or what to do about it.
        raise ValueError(
            f"the tokenizer in {path!r} could not be loaded ({type(e).__name__}: {e}); pass "
            "--tokenizer with a folder holding tokenizer.json or the files of the model's "
            "tokenizer class") from e


__all__ = ["load_tokenizer", "uses_generic_tokenizer"]
