"""Models as users name them -> a local model folder.

``--model`` accepts, in this order: nothing (the built-in default model), a local folder, a
GGUF file or a folder holding exactly one GGUF (converted once, see ``cadence.gguf_model``),
and a Hugging Face Hub id ``org/name`` that is not a local path (the Hub cache first, then a
download). huggingface_hub and the GGUF reader are imported only when such a name is given, so
``import cadence`` stays light.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# What a Hub download fetches: the config, safetensors weights and tokenizer files cadence
# reads. Repos often carry the same weights again as *.bin / *.gguf / original/, which would
# multiply the download for nothing.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "vocab.json", "spiece.model", "vocab.txt")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub repo id rather than a local path."""
    return bool(HUB_ID.match(name)) and not os.path.exists(name)


def resolve_model_source(model: str | None, revision: str | None = None) -> str:
    """The local folder of the model ``model`` names (see the module docstring)."""
    if revision is not None and (model is None or not is_hub_id(model)):
        raise ValueError(f"revision={revision!r} applies to Hub ids (org/name) only, "
                         f"not to model {model!r}")
    if model is None:
        from cadence.default_model import default_model_path

        return default_model_path()
    if is_hub_id(model):
        model = hub_snapshot(model, revision)
    from cadence.gguf_model import find_gguf, gguf_model_path

    gguf_file = find_gguf(model)
    return gguf_model_path(gguf_file) if gguf_file is not None else model


def hub_snapshot(repo_id: str, revision: str | None = None) -> str:
    """The snapshot folder of ``repo_id`` at ``revision``: from the Hugging Face cache when it
    is there, else downloaded (unless offline mode forbids it)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = f"{repo_id!r} (revision {revision or 'main'!r})"
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS,
                                 local_files_only=True)
    # Not cached, or cached but incomplete (a subclass in recent huggingface_hub): both mean
    # "download it".
    except LocalEntryNotFoundError as e:
        # The plain "not found" text speaks of local_files_only, which the user never set.
        detail = "" if type(e) is LocalEntryNotFoundError else f" ({type(e).__name__}: {e})"
    cache = constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"model {where} is not in the Hugging Face cache {cache}{detail}, "
                         "and HF_HUB_OFFLINE=1 forbids a download")
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS)
    except Exception as e:
        # huggingface_hub reports a network failure as "not found locally" and keeps the
        # network error as the cause; the cause is what the user can act on.
        reason = e.__cause__ or e
        raise ValueError(f"model {where} is not in the Hugging Face cache {cache}, and the "
                         f"download failed: {type(reason).__name__}: {reason}") from e


def check_tokenizer_folder(path: str) -> None:
    """Fail at start, not at the first request, when ``path`` holds no tokenizer."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"tokenizer path {path!r} does not exist or is not a directory")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer in {path!r}: looked for {', '.join(TOKENIZER_FILES)}; "
                         "add the tokenizer files or pass --tokenizer FOLDER")
