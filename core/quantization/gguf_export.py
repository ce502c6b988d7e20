"""A GGUF file's quantized tensors, saved beside the model folder converted from it.

The converted folder (cadence.gguf_model) holds the fp32 weights transformers dequantized.
For ``--quantization gguf`` the blocks themselves are kept too: each linear weight stored in a
format ``gguf_blocks`` unpacks is saved, unpacked, under its Hugging Face name in
``<folder>/gguf_blocks/``, once. A tensor is kept only if its unpacked parts give exactly the
folder's fp32 weight (rows reordered as transformers reorders a llama's q/k rows where that is
what matches); anything else (another format, a name the map does not know, a mismatch) stays
in fp32 and is listed in the index with the reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from cadence.quantization.gguf_blocks import FORMATS, Unpacked, unpack

logger = logging.getLogger(__name__)

BLOCKS_DIR = "gguf_blocks"
INDEX_FILE = "index.json"
TENSORS_FILE = "blocks.safetensors"
SOURCE_FILE = "gguf_source.json"  # written by the conversion: which GGUF file made the folder


def blocks_dir(folder: str | Path) -> Path:
    return Path(folder) / BLOCKS_DIR


def _rotary_order(rows: int, heads: int) -> np.ndarray:
    """The row order transformers gives a llama GGUF's q (k) rows: llama.cpp stores each
    head's rotary pairs interleaved, HF's layout has them in two halves."""
    idx = np.arange(rows)
    return idx.reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


def _candidates(rows: int, config: dict) -> list[np.ndarray | None]:
    out: list[np.ndarray | None] = [None]
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = config.get(key)
        if heads and rows % (2 * heads) == 0:
            out.append(_rotary_order(rows, heads))
    return out


def _take(u: Unpacked, order: np.ndarray | None) -> Unpacked:
    if order is None:
        return u
    return Unpacked(u.q[order], u.scale[order], None if u.offset is None else u.offset[order])


def _match(u: Unpacked, dense: np.ndarray, config: dict) -> Unpacked | None:
    for order in _candidates(u.q.shape[0], config):
        cand = _take(u, order)
        if np.array_equal(cand.dequantize().view(np.uint32), dense.view(np.uint32)):
            return cand
    return None


def _arch_and_blocks(reader) -> tuple[str, int]:
    def field(name: str):
        f = reader.fields[name]
        return f.parts[f.data[0]]

    arch = bytes(field("general.architecture")).decode()
    return arch, int(field(f"{arch}.block_count")[0])


def export_blocks(gguf_file: str | Path, folder: str | Path) -> Path:
    """Unpack ``gguf_file``'s linear weights into ``folder``'s ``gguf_blocks/`` (see the module
    docstring) and return that path. Idempotent: an existing export is returned as is."""
    target = blocks_dir(folder)
    if (target / INDEX_FILE).is_file():
        return target
    import gguf
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from cadence.model_loader import safetensors_files

    reader = gguf.GGUFReader(str(gguf_file))
    arch, n_blocks = _arch_and_blocks(reader)
    archs = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in archs:
        raise ValueError(f"{gguf_file}: GGUF architecture {arch!r} is unknown to gguf")
    name_map = gguf.get_tensor_name_map(archs[arch], n_blocks)
    stored = {t.name: t for t in reader.tensors}
    config = json.loads((Path(folder) / "config.json").read_text())
    kept: dict[str, Unpacked] = {}
    formats: dict[str, str] = {}
    dense: dict[str, str] = {}
    for file in safetensors_files(str(folder)):
        with safe_open(str(file), framework="numpy") as f:
            names = f.keys()  # a safetensors handle is not iterable itself
            for name in names:
                if not name.endswith(".weight") or len(f.get_slice(name).get_shape()) != 2:
                    continue
                gguf_name = name_map.get_name(name, try_suffixes=(".weight",))
                t = stored.get(gguf_name) if gguf_name else None
                fmt = t.tensor_type.name if t is not None else None
                if fmt not in FORMATS:
                    dense[name] = f"stored as {fmt}" if t is not None else "not in the file"
                    continue
                rows, k = int(t.shape[1]), int(t.shape[0])
                u = _match(unpack(t.data, fmt, (rows, k)), f.get_tensor(name), config)
                if u is None:
                    dense[name] = f"its {fmt} blocks do not give the converted weight"
                    continue
                kept[name], formats[name] = u, fmt
    # Each tensor keeps its own group (its scales' shape says it); the parts of one fused
    # module are brought to a common one when they are attached (weights.py).
    tensors: dict[str, np.ndarray] = {}
    for name, u in kept.items():
        tensors[f"{name}.q"], tensors[f"{name}.s"] = u.q, u.scale
        if u.offset is not None:
            tensors[f"{name}.o"] = u.offset
    tmp = Path(tempfile.mkdtemp(prefix=f".{BLOCKS_DIR}-", dir=folder))
    try:
        if tensors:
            save_file(tensors, str(tmp / TENSORS_FILE))
        (tmp / INDEX_FILE).write_text(json.dumps(
            {"source": str(gguf_file), "formats": formats, "dense": dense,
             "folder_files": folder_files(folder)}, indent=1))
        try:
            os.rename(tmp, target)  # atomic: a concurrent exporter either wins or finds it done
        except OSError:
            if not (target / INDEX_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # A warning when nothing was kept: --quantization gguf would then run the fp32 weights.
    (logger.info if kept else logger.warning)(
        "kept %d GGUF tensors in their blocks (%s) in %s; %d stay fp32 (%s lists why)",
        len(kept), ", ".join(sorted(set(formats.values()))) or "none", target, len(dense),
        INDEX_FILE)
    return target


def gguf_source(folder: str | Path) -> Path | None:
    """The GGUF file ``folder`` was converted from, None when it was not (or the file is
    gone)."""
    from cadence.default_model import default_gguf_file, is_default_model_folder

    record = Path(folder) / SOURCE_FILE
    if record.is_file():
        path = Path(json.loads(record.read_text())["file"])
        return path if path.is_file() else None
    if is_default_model_folder(str(folder)):
        return default_gguf_file()
    return None


def _recorded_files(index: Path) -> dict | None:
    try:
        return json.loads(index.read_text()).get("folder_files")
    except (OSError, ValueError):
        return None


def folder_files(folder: str | Path) -> dict[str, list[int]]:
    """The folder's safetensors files, each with its size and modification time: what the
    blocks were checked against when they were exported."""
    from cadence.model_loader import safetensors_files

    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns]
            for f in map(Path, safetensors_files(str(folder)))}


def ensure_blocks(folder: str) -> Path:
    """``folder``'s exported blocks, exporting them on first use; ValueError when ``folder``
    was not converted from a GGUF file.

    The blocks stand in for the folder's weights without being read against them again
    (weights.load_with_gguf_blocks), so blocks exported from other weights than the
    folder's own now (its safetensors rewritten in place, or an export recorded before the
    record existed) are exported again."""
    target = blocks_dir(folder)
    index = target / INDEX_FILE
    if index.is_file():
        now, recorded = folder_files(folder), _recorded_files(index)
        if recorded == now:
            return target
        logger.warning("the blocks in %s %s; exporting them again", target,
                       f"were exported from other weights than {folder} holds now"
                       if recorded else "carry no record of the weights they were checked "
                       "against (an older export)")
        stale = Path(tempfile.mkdtemp(prefix=f".{BLOCKS_DIR}-stale-", dir=folder))
        # Looked at again just before: another process may have exported them afresh.
        if _recorded_files(index) != now:
            with contextlib.suppress(OSError):  # or moved them away first
                os.rename(target, stale / BLOCKS_DIR)
        shutil.rmtree(stale, ignore_errors=True)
    source = gguf_source(folder)
    if source is None:
        raise ValueError(f"--quantization gguf runs a GGUF file's weights in their own blocks, "
                         f"and {folder!r} was not converted from a GGUF file (or the file is "
                         "gone); pass --model FILE.gguf, or leave --model out for the default "
                         "model, or drop --quantization")
    logger.warning("keeping the quantized blocks of %s in %s (once; later runs reuse them)",
                   source, target)
    return export_blocks(source, folder)
