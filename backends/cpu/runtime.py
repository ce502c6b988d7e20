"""Builds the CPU backend's model runner: model, packed GEMMs, KV cache and attention.

Shared by the in-process strategies (sync, thread) and the worker process (process), so the
three run exactly the same kernels. The choices made here are logged once at start-up and
reported in ``env_info`` (and so in every bench JSON).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cadence.config import EngineConfig
from cadence.layers import paged_attention
from cadence.layers.attention import attention_keywords, check_supported
from cadence.layers.linear import Linear
from cadence.model_runner import ModelRunner

logger = logging.getLogger(__name__)

ATTENTION_CHOICES = ("auto", "kernel", "torch")


@dataclass(slots=True)
class CpuRuntime:
    runner: ModelRunner
    num_blocks: int
    attention: str  # "kernel" or "torch"
    # "packed", "tiled", "brgemm", "amx" or "torch"; "none" when every linear is quantized.
    linear: str
    # Gated MLPs run as one GEMM with their activation (gated.py), on this rank.
    fused_mlps: int = 0
    # What lives on transparent huge pages: "off", "weights" or "all" (memory.py).
    huge_pages: str = "off"
    # Linears run from compressed weights (quantized.py), gated MLPs among them counted once.
    quantized: int = 0

    def describe(self) -> dict[str, str]:
        return {"cpu_attention": self.attention, "cpu_linear": self.linear,
                "cpu_fused_mlps": str(self.fused_mlps),
                "cpu_huge_pages": self.huge_pages,
                "cpu_quantized_linears": str(self.quantized),
                "dtype": str(self.runner.dtype).removeprefix("torch."),
                "cpu_threads": str(torch.get_num_threads())}


def _choose_attention(requested: str, head_dim: int, dtype: torch.dtype,
                      features: set[str] | frozenset[str] = frozenset()):
    """(kernel module or None, name) for ``requested`` in ATTENTION_CHOICES; ``features``
    are the attention keywords the model's layers pass (soft caps go to the torch path)."""
    from cadence.backends.cpu.attention import kernel_supports
    from cadence.backends.cpu.kernels import load_kernels

    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"cpu attention must be one of {ATTENTION_CHOICES}, got {requested!r}")
    if requested == "torch":
        return None, "torch"
    reason = kernel_supports(head_dim, dtype, features)
    if reason is not None:
        if requested == "kernel":
            raise ValueError(f"cpu attention 'kernel' cannot run this model: {reason}")
        logger.warning("the compiled CPU attention kernel cannot run this model (%s); using "
                       "the torch attention path", reason)
        return None, "torch"
    kernels = load_kernels()
    if kernels is None:
        if requested == "kernel":
            raise ValueError("cpu attention 'kernel' was requested but the kernel could not be "
                             "built (see the warning above)")
        return None, "torch"
    return kernels, "kernel"


def build_runtime(config: EngineConfig, kv_cache_bytes: int) -> CpuRuntime:
    from cadence.backends.cpu.linear import pack_linears
    from cadence.backends.cpu.linear_choice import choose_linear
    from cadence.backends.cpu.memory import (
        move_weights_to_huge_pages,
        prefault_kv_cache,
        resolve_huge_pages,
        trim_heap,
        tune_allocator,
    )

    huge_pages = resolve_huge_pages(str(config.backend_option("huge_pages", "off")))
    tune_allocator()
    runner = ModelRunner(config, "cpu")
    runner.load_model()
    spec = runner.kv_cache_spec()
    kernels, attention = _choose_attention(str(config.backend_option("attention", "auto")),
                                           spec.head_dim, runner.dtype,
                                           attention_keywords(runner.model))
    quantized = 0
    if config.model_config.quantization is not None:
        from cadence.backends.cpu.kernels import load_kernels
        from cadence.backends.cpu.quantized import run_quantized
        from cadence.quantization.checkpoint import PACKED_METHODS, method_label

        ops = load_kernels()
        method = config.model_config.quantization
        if ops is None and method in PACKED_METHODS:
            # The checkpoint cannot run unquantized otherwise: its exact fp32 weights do.
            from cadence.quantization.weights import materialize

            materialize(runner.model)
            logger.warning("the %s checkpoint's linears run their dequantized fp32 weights: "
                           "the compiled CPU kernels that run packed weights did not build "
                           "here or are turned off (CADENCE_CPU_KERNELS=0)",
                           method_label(method))
        elif ops is None:
            raise ValueError(f"quantization {config.model_config.quantization!r} runs on the "
                             "compiled CPU kernels, which did not build here (see the warning "
                             "above) or are turned off (CADENCE_CPU_KERNELS=0)")
        else:
            # Gated MLPs fused as the fp32 tiled GEMM fuses them: beside the attention kernel.
            quantized = run_quantized(runner.model, ops, fuse_gated=kernels is not None)
            # The fp32 weights the quantized ones replace were freed into the heap, which
            # keeps them resident unless trimmed (tune_allocator): most of the model's size.
            trim_heap()
    # The linears left in the checkpoint's dtype (all of them without quantization). Beside
    # quantized ones, auto takes the tiled GEMM, whose bits the quantized kernel shares: the
    # model's outputs are then those of its fp32 weights with --cpu-linear tiled.
    requested = str(config.backend_option("linear", "auto"))
    if quantized and requested == "auto":
        requested = "tiled"
    if any(isinstance(m, Linear) for m in runner.model.modules()):
        linear = choose_linear(requested, runner.model, runner.dtype)
    else:
        linear = "none"
    fused_mlps = 0
    if linear not in ("torch", "none"):
        if linear in ("tiled", "amx") and kernels is not None:
            from cadence.backends.cpu.gated import fuse_gated_mlps

            # Only beside the other kernels: with the torch attention path the activation
            # stays torch's (the reference path keeps its bits). First: it packs the plain
            # gate/up weights itself.
            fused_mlps = fuse_gated_mlps(runner.model, linear)
        # A low-precision head's tied maxima are recomputed from its plain rows.
        keep = ("lm_head",) if runner.dtype != torch.float32 else ()
        pack_linears(runner.model, keep_weight_of=keep, kind=linear)
        trim_heap()  # the plain weights' pages, as above
    # Adapters' updates on the same kernel as the layers, so a row's update does not depend
    # on the batch either (async on == off with adapters). Where every linear is quantized,
    # that is the tiled GEMM, whose bits the quantized kernel shares.
    update_gemm = "tiled" if quantized and linear == "none" else linear
    if runner.lora is not None and update_gemm not in ("torch", "none"):
        from cadence.backends.cpu.linear import row_independent_gemm

        runner.lora.make_gemm = row_independent_gemm(update_gemm) or runner.lora.make_gemm
    if huge_pages != "off":
        move_weights_to_huge_pages(runner.model)
    num_blocks = runner.num_blocks_for_bytes(kv_cache_bytes)
    kv_huge = huge_pages == "all"
    k, v = runner.allocate_kv_cache(num_blocks, kv_huge)
    if kv_huge:
        prefault_kv_cache(k + v)
    scale = spec.head_dim ** -0.5
    if kernels is not None:
        from cadence.backends.cpu.attention import CpuPagedAttention, build_metadata
        from cadence.backends.cpu.fused import KernelDraw, install_fused_ops

        runner.attn = CpuPagedAttention(kernels, k, v, spec.block_size, scale)
        runner.metadata_builder = build_metadata
        install_fused_ops(runner.model, kernels)
        runner.draw = KernelDraw(kernels)
        if runner.lora is not None:
            from cadence.backends.cpu.lora import lora_kernels

            # LoRA's expand added in place into the base layer's output (lora.py).
            runner.lora.kernels = lora_kernels(kernels, runner.dtype)
    else:
        runner.attn = paged_attention.TorchPagedAttention(k, v, scale)
    check_supported(runner.attn, runner.model)
    rt = CpuRuntime(runner, num_blocks, attention, linear, fused_mlps, huge_pages, quantized)
    logger.info("CPU backend: %s", ", ".join(f"{k}={v}" for k, v in rt.describe().items()))
    return rt
