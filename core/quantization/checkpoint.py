"""What a quantized checkpoint says of itself: ``quantization_config`` in its config.json (or
an older AutoGPTQ folder's ``quantize_config.json``), read before anything loads.

Three methods are read as they are stored (``packed.py`` unpacks them): ``awq`` (AutoAWQ's
GEMM layout, 4 bits), ``gptq`` (AutoGPTQ, GPTQModel and optimum: 2, 4 or 8 bits, the v1 and
v2 zero-point conventions) and ``compressed-tensors`` (llm-compressor's ``pack-quantized``
weight-only schemes, W4A16 and W8A16, by group or by channel). Any other method or scheme is
refused here with the ones that are read, never loaded as if it were a plain checkpoint.

This module imports no torch: configuration checks it at start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKED_METHODS = ("awq", "gptq", "compressed-tensors")
_LABELS = {"awq": "AWQ", "gptq": "GPTQ"}


def method_label(method: str) -> str:
    """How messages name a packed method: AWQ, GPTQ, compressed-tensors."""
    return _LABELS.get(method, method)


@dataclass(frozen=True, slots=True)
class PackedSpec:
    """How a checkpoint's linear weights are packed.

    Each quantized linear stores ``qweight`` (the integers, eight 4-bit values to an int32),
    ``qzeros`` (a zero point per group and output, packed the same way), ``scales`` (fp16,
    per group and output) and, for GPTQ, ``g_idx`` (each input's group); a weight is
    ``scale * (q - zero)``. ``zero_offset`` is what is added to a stored zero point (1 in
    GPTQ's original format, which stores ``zero - 1``)."""

    method: str
    bits: int
    group_size: int  # inputs per group; -1: a row is one group
    zero_offset: int = 0
    desc_act: bool = False  # act-order: groups are not runs of consecutive inputs
    symmetric: bool = True  # compressed-tensors: no zero points stored


def _read(folder: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the model loader names what is wrong with it
    if not isinstance(config, dict):
        return None
    quant = config.get("quantization_config")
    older = folder / "quantize_config.json"
    if quant is None and older.is_file():
        # AutoGPTQ's own file, from before transformers kept it in config.json.
        try:
            quant = {"quant_method": "gptq", **json.loads(older.read_text())}
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{older} does not hold a JSON object: {e}") from None
    if quant is not None and not isinstance(quant, dict):
        raise ValueError(f"quantization_config in {folder / 'config.json'} must be an object, "
                         f"got {type(quant).__name__}")
    return quant


def checkpoint_quantization(model: str) -> PackedSpec | None:
    """The packing of the checkpoint in folder ``model``; None for a plain checkpoint.
    ValueError for a method or variant that is not read, naming the ones that are."""
    folder = Path(model)
    if not (folder / "config.json").is_file():
        return None
    quant = _read(folder)
    if quant is None:
        return None
    where = f"model {model!r} is quantized"
    method = str(quant.get("quant_method", "")).lower()
    if method not in PACKED_METHODS:
        raise ValueError(f"{where} with {method or 'an unnamed method'!r} (quantization_config "
                         f"in its config.json), which cadence does not read; it reads "
                         f"{', '.join(PACKED_METHODS)} checkpoints, and runs any plain "
                         "checkpoint in int8 with --quantization int8")
    if method == "compressed-tensors":
        return _compressed_tensors(quant, where)
    bits = int(quant.get("bits", quant.get("w_bit", 0)))
    group = int(quant.get("group_size", quant.get("q_group_size", -1)))
    if group == 0 or group < -1:
        raise ValueError(f"{where} with {method} at group_size {group}; expected a positive "
                         "group size or -1 (one group a row)")
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where} with AWQ version {version!r}; cadence reads AWQ's "
                             "'gemm' layout (AutoAWQ's default)")
        if bits != 4:
            raise ValueError(f"{where} with AWQ at {bits} bits; AWQ checkpoints are read "
                             "at 4 bits")
        if not quant.get("zero_point", True):
            raise ValueError(f"{where} with AWQ without zero points; cadence reads AWQ "
                             "with zero points (AutoAWQ's default)")
        return PackedSpec("awq", 4, group)
    # Older AutoGPTQ releases said Marlin with a flag of their own.
    fmt = "marlin" if quant.get("is_marlin_format") else \
        str(quant.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where} with GPTQ in the {fmt!r} format; cadence reads the "
                         "'gptq' and 'gptq_v2' formats")
    if bits not in (2, 4, 8):
        raise ValueError(f"{where} with GPTQ at {bits} bits; cadence reads 2, 4 and 8 bits "
                         "(3-bit values straddle the int32 words)")
    return PackedSpec("gptq", bits, group, zero_offset=1 if fmt == "gptq" else 0,
                      desc_act=bool(quant.get("desc_act", False)))


def _compressed_tensors(quant: dict[str, Any], where: str) -> PackedSpec:
    """llm-compressor's weight-only integer schemes in its ``pack-quantized`` format."""
    if quant.get("kv_cache_scheme"):
        raise ValueError(f"{where} with compressed-tensors that quantizes the KV cache "
                         "(kv_cache_scheme); cadence reads weight-only schemes (W4A16, W8A16)")
    sparsity = quant.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(f"{where} with compressed-tensors sparsity ({sparsity['format']!r}); "
                         "cadence reads dense pack-quantized weights")
    groups = quant.get("config_groups") or {}
    schemes = [g for g in groups.values() if isinstance(g, dict)]
    if not schemes:
        raise ValueError(f"{where} with compressed-tensors without config_groups")
    weights = [s.get("weights") or {} for s in schemes]
    if any(w != weights[0] for w in weights):
        raise ValueError(f"{where} with compressed-tensors schemes that differ between "
                         "layers; cadence reads one weight scheme for every quantized layer")
    for scheme in schemes:
        fmt = scheme.get("format") or quant.get("format")
        if fmt != "pack-quantized":
            raise ValueError(f"{where} with compressed-tensors in the {fmt!r} format; cadence "
                             "reads 'pack-quantized' (llm-compressor's W4A16 and W8A16)")
        if scheme.get("input_activations") or scheme.get("output_activations"):
            raise ValueError(f"{where} with compressed-tensors that quantizes activations "
                             "too; cadence reads weight-only schemes (W4A16, W8A16)")
    w = weights[0]
    bits, kind = int(w.get("num_bits", 0)), str(w.get("type", "int"))
    strategy = str(w.get("strategy", "group"))
    if kind != "int" or bits not in (4, 8):
        raise ValueError(f"{where} with compressed-tensors {kind} weights of {bits} bits; "
                         "cadence reads int weights of 4 or 8 bits")
    if strategy not in ("group", "channel"):
        raise ValueError(f"{where} with compressed-tensors by {strategy!r}; cadence reads "
                         "the 'group' and 'channel' strategies")
    group = int(w.get("group_size") or -1) if strategy == "group" else -1
    return PackedSpec("compressed-tensors", bits, group,
                      desc_act=w.get("actorder") in ("group", "dynamic"),
                      symmetric=bool(w.get("symmetric", True)))


def resolve_packed(requested: str | None, model: str) -> str | None:
    """The quantization a model runs with: a packed checkpoint's own method when none is
    asked for (as vLLM does), the one asked for otherwise; ValueError where they
    disagree."""
    spec = checkpoint_quantization(model)
    if spec is None:
        if requested in PACKED_METHODS:
            raise ValueError(f"--quantization {requested} reads a checkpoint quantized with "
                             f"{method_label(requested)}, and the config.json of {model!r} has no "
                             "quantization_config naming it")
        return requested
    if requested is not None and requested != spec.method:
        raise ValueError(f"model {model!r} is already quantized with {spec.method} "
                         f"(quantization_config in its config.json); it runs from its own "
                         f"packed weights: leave --quantization unset or pass "
                         f"--quantization {spec.method}")
    return spec.method
