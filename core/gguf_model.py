"""llama.cpp's GGUF format, converted once into a model folder cadence loads.

transformers can read (and dequantize) a GGUF file but refuses to ``save_pretrained`` a
GGUF-loaded model, so we copy the dequantized weights into a plain model of the same class and
save that as safetensors, next to the tokenizer rebuilt from the GGUF metadata. The converted
folder is cached under the cadence cache, keyed by the file's path, size and mtime, so a GGUF
that changes on disk is converted again and an unchanged one never is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cadence.gguf_rope import gguf_rope_parameters

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
# Part of a converted folder's cache key: raised when conversion changes what it writes, so
# folders written before are converted again (2: the file's RoPE scaling, core/gguf_rope.py).
_CONVERSION = 2


def cache_root() -> Path:
    """Where converted models live: ``models/`` under cadence's cache (core/cache_dir.py)."""
    from cadence.cache_dir import cache_dir

    return cache_dir("models")


def find_gguf(path: str) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the only ``*.gguf`` of a folder that
    has no config.json. None when ``path`` is not a GGUF model; ValueError when a folder holds
    several, since picking one (often a quantization level) is the user's choice."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == GGUF_SUFFIX else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    files = sorted(f for f in p.iterdir() if f.suffix.lower() == GGUF_SUFFIX and f.is_file())
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ValueError(f"model folder {path!r} holds {len(files)} GGUF files ({names}); "
                         "pass the one to load as --model FOLDER/FILE.gguf")
    return files[0] if files else None


def gguf_model_path(gguf_file: Path) -> str:
    """The converted folder of ``gguf_file``, converting it on first use."""
    st = gguf_file.stat()
    key = f"{_CONVERSION}|{gguf_file.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{gguf_file.stem}-{digest}"
    if not (target / "config.json").is_file():
        # A warning so that it shows without any logging set up: the first run of a large GGUF
        # takes minutes and fills disk, and the user should see why and where.
        logger.warning("converting %s from GGUF into %s (once; later runs reuse it)",
                       gguf_file, target)
    folder = convert_once(target, lambda out: convert_gguf(gguf_file, out))
    record_source(gguf_file, Path(folder))
    return folder


def record_source(gguf_file: Path, folder: Path) -> None:
    """Note in ``folder`` which GGUF file it was converted from (``--quantization gguf`` reads
    the blocks from there), also in a folder converted before the note existed."""
    from cadence.quantization.gguf_export import SOURCE_FILE

    record = folder / SOURCE_FILE
    if not record.is_file():
        record.write_text(json.dumps({"file": str(gguf_file.resolve())}))


def convert_once(target: Path, convert: Callable[[Path], None]) -> str:
    """Run ``convert(tmp_folder)`` and move the result to ``target`` unless it exists already."""
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert(tmp)
        try:
            # Atomic on one filesystem: a concurrent converter either wins or finds it done.
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def convert_gguf(gguf_file: Path, out: Path, eos_token: str | None = None) -> None:
    """Write the model and tokenizer of ``gguf_file`` to ``out`` as an fp32 HF folder.

    ``eos_token`` overrides the GGUF's end-of-sequence token when the vocabulary has it (chat
    models whose turns end with another token than the metadata names).
    """
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"reading {gguf_file} needs the gguf package: pip install gguf "
                         "(or cadence's default-model extra)")
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:  # a cheap read of its header and tensor table (memory-mapped) before transformers
        reader = gguf.GGUFReader(str(gguf_file))
    except Exception as e:  # noqa: BLE001  # truncated or damaged: struct, index, value errors
        raise ValueError(f"{gguf_file} is not a readable GGUF file (truncated or damaged?): "
                         f"{type(e).__name__}: {e}") from None
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                      dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    _add_rope_scaling(config_dict, reader, gguf_file)
    config = type(gguf_model.config).from_dict(config_dict)
    if eos_token is not None:
        eos_id = tokenizer.convert_tokens_to_ids(eos_token)
        if isinstance(eos_id, int) and eos_id != tokenizer.unk_token_id:
            tokenizer.eos_token = eos_token
            config.eos_token_id = eos_id
    config.dtype = torch.float32
    config.architectures = [type(gguf_model).__name__]
    model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    record_source(gguf_file, out)


def _add_rope_scaling(config: dict, reader: Any, gguf_file: Path) -> None:
    """The file's RoPE scaling into ``config`` where transformers left it out
    (core/gguf_rope.py)."""
    key = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
    current = dict(config.get(key) or {})
    if current.get("rope_type", current.get("type", "default")) not in ("default", None):
        return  # transformers read it
    theta = current.get("rope_theta", config.get("rope_theta"))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    try:
        params = gguf_rope_parameters(reader, float(theta), int(head_dim))
    except ValueError as e:
        raise ValueError(f"{gguf_file}: {e}") from None
    if params is not None:
        config[key] = {**current, **params}
