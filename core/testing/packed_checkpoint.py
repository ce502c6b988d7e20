"""AWQ, GPTQ and compressed-tensors checkpoints of a model folder, written as AutoAWQ,
AutoGPTQ and llm-compressor write them (round to nearest, not their searches for scales),
with the fp32 folder of their exactly dequantized weights beside each: for the tests, the
conformance kit and the benchmark of packed weights (scripts/packed_checkpoint_bench.py).

The packing follows the published layouts, written here independently of the reader
(core/quantization/packed.py): AutoAWQ's GEMM packs eight 4-bit values of consecutive
outputs into an int32 in the column order 0, 2, 4, 6, 1, 3, 5, 7; AutoGPTQ packs
``32 / bits`` consecutive inputs into an int32, lowest bits first, and its zero points
along the outputs the same way, stored minus one in its original format; compressed-tensors'
``pack-quantized`` packs a row's inputs as AutoGPTQ does but keeps the weight [N, K / 8],
stores signed values plus ``2^(bits - 1)``, and packs zero points along the outputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack(values: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Pack the last axis of ``values`` (ints in 0..2^bits - 1), ``32 / bits`` to an int32:
    value ``i`` of a word at bits ``i * bits`` (word slot ``i`` taking the value at
    ``order[i]`` of its run when given)."""
    per = 32 // bits
    runs = values.astype(np.uint64).reshape(*values.shape[:-1], -1, per)
    if order is not None:
        runs = runs[..., list(order)]
    words = np.zeros(runs.shape[:-1], dtype=np.uint64)
    for i in range(per):
        words |= runs[..., i] << np.uint64(i * bits)
    return words.astype(np.uint32).view(np.int32)


def _quantize(w: np.ndarray, groups: np.ndarray, n_groups: int, bits: int, sym: bool,
              min_zero: int = 0):
    """Round-to-nearest per (output, group): (q [N, K], zero [N, G], fp16 scale [N, G]).
    ``min_zero`` 1 keeps every zero point storable as GPTQ's original format stores it
    (minus one)."""
    maxq = (1 << bits) - 1
    n = w.shape[0]
    scale = np.zeros((n, n_groups), dtype=np.float16)
    zero = np.zeros((n, n_groups), dtype=np.int64)
    for g in range(n_groups):
        cols = w[:, groups == g]
        lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
        if sym:
            amax = np.maximum(-lo, hi)
            s = (2 * amax / maxq).astype(np.float16)
            z = np.full(n, (maxq + 1) // 2)
        else:
            s = ((hi - lo) / maxq).astype(np.float16)
            z = np.clip(np.round(-lo / np.maximum(s.astype(np.float64), 1e-8)), min_zero, maxq)
        scale[:, g] = np.where(s > 0, s, np.float16(1e-3))
        zero[:, g] = z
    s64 = scale.astype(np.float64)[:, groups]
    q = np.clip(np.round(w / s64) + zero[:, groups], 0, maxq).astype(np.int64)
    return q, zero, scale


def write_packed(source: str, out: Path, method: str, bits: int = 4, group: int = 32,
                 fmt: str = "gptq", act_order: bool = False, seed: int = 0,
                 sym: bool = False, zero_biases: bool = False) -> tuple[str, str]:
    """(the packed checkpoint's folder, the folder of its dequantized fp32 weights), both
    copies of ``source`` whose decoder linears are quantized. ``zero_biases``: an all-zero
    bias beside every quantized linear that has none, as AutoGPTQ saves them. The source
    may hold any dtype (a bf16 model's other tensors stay bf16)."""
    import torch
    from safetensors.torch import load_file, save_file

    def torch_tensors(arrays: dict) -> dict:
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                for k, v in arrays.items()}

    rng = np.random.default_rng(seed)
    packed_dir, plain_dir = out / f"{method}-packed", out / f"{method}-dequantized"
    shutil.copytree(source, packed_dir)
    shutil.copytree(source, plain_dir)
    tensors = load_file(str(Path(source) / "model.safetensors"))
    packed, plain = {}, {}
    for name, t in tensors.items():
        if not (t.ndim == 2 and name.endswith("proj.weight")):
            packed[name] = plain[name] = t
            continue
        w = t.double().numpy()
        k = w.shape[1]
        n_groups = 1 if group == -1 else k // group  # -1: one group a row (by channel)
        groups = np.arange(k) // (k // n_groups)
        if act_order:
            groups = groups[rng.permutation(k)]
        q, zero, scale = _quantize(w, groups, n_groups, bits, sym,
                                   min_zero=1 if method == "gptq" and fmt == "gptq" else 0)
        deq = (scale.astype(np.float64)[:, groups] * (q - zero[:, groups])).astype(np.float32)
        plain[name] = deq
        prefix = name[: -len(".weight")]
        if method == "compressed-tensors":
            # Signed values plus 2^(bits - 1) are q, and likewise the zero points.
            packed[f"{prefix}.weight_packed"] = _pack(q, bits)
            packed[f"{prefix}.weight_scale"] = scale
            packed[f"{prefix}.weight_shape"] = np.array(w.shape, dtype=np.int32)
            if not sym:
                packed[f"{prefix}.weight_zero_point"] = np.ascontiguousarray(
                    _pack(zero.T, bits).T)
            if act_order:
                packed[f"{prefix}.weight_g_idx"] = groups.astype(np.int32)
            continue
        if method == "awq":
            # [K, N / 8] and [G, N / 8]: along the outputs.
            packed[f"{prefix}.qweight"] = _pack(q.T, bits, AWQ_ORDER)
            packed[f"{prefix}.qzeros"] = _pack(zero.T, bits, AWQ_ORDER)
        else:
            # [K * bits / 32, N]: along the inputs; the zero points [G, N * bits / 32].
            packed[f"{prefix}.qweight"] = np.ascontiguousarray(_pack(q, bits).T)
            stored = zero - (1 if fmt == "gptq" else 0)
            packed[f"{prefix}.qzeros"] = _pack(stored.T, bits)
            packed[f"{prefix}.g_idx"] = groups.astype(np.int32)
        packed[f"{prefix}.scales"] = np.ascontiguousarray(scale.T)
        if zero_biases and f"{prefix}.bias" not in tensors:
            packed[f"{prefix}.bias"] = np.zeros(w.shape[0], dtype=np.float16)
    save_file(torch_tensors(packed), str(packed_dir / "model.safetensors"),
              metadata={"format": "pt"})
    save_file(torch_tensors(plain), str(plain_dir / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((packed_dir / "config.json").read_text())
    if method == "compressed-tensors":
        weights = {"num_bits": bits, "type": "int", "symmetric": sym,
                   "strategy": "channel" if group == -1 else "group",
                   "group_size": None if group == -1 else group,
                   "actorder": "group" if act_order else None}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}},
            "ignore": ["lm_head"], "quantization_status": "compressed"}
    elif method == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": bits,
                                         "group_size": group, "zero_point": True,
                                         "version": "gemm"}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits,
                                         "group_size": group, "desc_act": act_order,
                                         "sym": sym, "checkpoint_format": fmt}
    (packed_dir / "config.json").write_text(json.dumps(config, indent=2))
    return str(packed_dir), str(plain_dir)
