"""Weights kept in a compressed form in memory and expanded inside the GEMM
(docs/quantization.md).

``gguf``: a GGUF file's linear weights run from their own blocks (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, Q4_K, Q5_K, Q6_K) instead of the fp32 weights transformers dequantizes them to. The
blocks give exactly those fp32 values, so the outputs are those of the fp32 model on the
same GEMM, bit for bit, from a fifth to a third of the weight bytes.

``int8``: any model's linear weights (the LM head's included) rounded at load to int8 with one
fp32 scale per group of 32 inputs; close to the checkpoint's outputs, not equal to them.

``awq``, ``gptq``: a checkpoint quantized by AutoAWQ or GPTQ runs from its own packed values
(``checkpoint.py``, ``packed.py``), with the outputs of its exactly dequantized fp32 weights;
taken without ``--quantization`` from the checkpoint's ``quantization_config``.

A backend declares what it runs (``Backend.supports_quantization``); the CPU backend runs
all four.

This module imports no torch: configuration checks it at start.
"""

from __future__ import annotations

QUANTIZATIONS = ("gguf", "int8", "awq", "gptq", "compressed-tensors")
# Inputs per int8 scale: llama.cpp's Q8_0 block, whose error on trained weights is known to
# be negligible; a row whose width is not a multiple of it has one scale for the whole row.
INT8_GROUP = 32


def check_quantization(name: str | None) -> str | None:
    """``name`` when it is a known method (or None), else a ValueError listing them."""
    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} (or unset), got "
                         f"{name!r}")
    return name


__all__ = ["QUANTIZATIONS", "check_quantization"]


def check_int8_split(subject: str, inputs: int, size: int) -> None:
    """Refuse ``int8`` where ``size`` tensor-parallel ranks would each round a share of a
    row-parallel layer's ``inputs`` that is not whole groups: they would round other groups
    than one process does, and the weights must not depend on the number of ranks (vLLM
    refuses such splits of GPTQ/AWQ groups). ``subject`` starts the message ("down_proj
    has")."""
    share = inputs // size
    if inputs % INT8_GROUP or share % INT8_GROUP:
        raise ValueError(
            f"--quantization int8 with --tensor-parallel-size {size}: {subject} {inputs} "
            f"inputs, {share} on each rank, not whole groups of {INT8_GROUP}, so the ranks "
            "would round other groups than one process does; choose a tensor-parallel size "
            "that splits them so, or run without quantization")
