"""GEMMs on weights packed once at load time, chosen per CPU by measurement.

``torch.ops.mkldnn._reorder_linear_weight`` reorders a weight into oneDNN's blocked layout
for this CPU, and ``_linear_pointwise`` runs the GEMM on it: what inductor's weight
prepacking and vLLM's CPU path do. Measured on an AVX-512 EPYC at 64 rows it ran the
SmolLM2 layer GEMMs ~1.5x faster than ``F.linear`` in fp32 and ~1.3x in bf16, and the LM head
2.2x (docs/backends/cpu.md). Whether it wins elsewhere is measured, not assumed:
``choose_linear`` (linear_choice.py) times each candidate on the model's own shapes once per
CPU/torch/dtype and caches the verdict, so later runs on the machine make the same choice.

In fp32, where the compiled kernels build, ``TiledLinear`` (csrc/tiled_linear.cpp) is a
candidate too: a register-tiled micro-kernel over weights packed in column panels, which ran
the default model's decode GEMMs faster than oneDNN on an AVX2-only EPYC (docs/backends/cpu.md).

In bf16, where torch's batch-reduce GEMM micro-kernel runs on this CPU (AMX), a third
candidate joins: ``BrgemmLinear`` (csrc/brgemm_linear.cpp), the same oneDNN arithmetic units
without the ~25 us a call oneDNN's inner product spends building its primitive descriptor
(docs/backends/cpu.md). Where the CPU has AMX tiles, ``AmxLinear`` (csrc/amx_linear.cpp)
runs the same tile arithmetic in a loop of cadence's own that prefetches the weight stream
while it multiplies; it gives brgemm's bits and replaces it as the candidate.

NOTE batch invariance: oneDNN computes a single row with another kernel (measured on an
AMD EPYC: M=1 differs in the last bits from the same row in any larger batch; every M >= 2
agrees). Rows go through ``cadence.layers.linear.row_aligned`` like ``F.linear``'s, so no
GEMM ever runs with one row (except the AMX tile loop's and the fp32 tiled kernel's, whose
rows never read each other at any count: ``row_align``). That padding is not enough
everywhere: on an AMX Xeon, oneDNN's bf16 GEMM and ``F.linear`` in both dtypes give rows of
a batch of 8 other bits than in a batch of 64. So auto checks every candidate on the model's
own shapes at batch sizes from 4 to 128 against a batch of 256
(``linear_choice._rows_independent``) and does not choose one that fails while another
passes.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import torch
from torch import nn

from cadence.cpuinfo import cpu_info
from cadence.distributed import all_reduce
from cadence.layers.linear import Linear, row_aligned

LINEAR_CHOICES = ("auto", "packed", "tiled", "brgemm", "amx", "torch")


def packed_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_reorder_linear_weight")


# oneDNN's bf16 weight reorder refuses a CPU without these (torch's own check): an AVX2-only
# CPU such as Zen 3 has neither, and would fail at load with a message about oneDNN.
_PACKED_BF16_FLAGS = ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"})


def packed_bf16_available() -> bool:
    flags = cpu_info().flags
    return any(need <= flags for need in _PACKED_BF16_FLAGS)


# And its fp16 reorder these (torch's check again): neither Zen 3 nor Zen 4/5 has them.
_PACKED_FP16_FLAGS = ({"avx512_fp16"}, {"avx_ne_convert"})


def packed_fp16_available() -> bool:
    flags = cpu_info().flags
    return any(need <= flags for need in _PACKED_FP16_FLAGS)


def packed_dtype_problem(dtype: torch.dtype) -> str | None:
    """Why oneDNN's packed weights cannot run ``dtype`` on this CPU, or None."""
    if dtype == torch.bfloat16 and not packed_bf16_available():
        return NO_PACKED_BF16
    if dtype == torch.float16 and not packed_fp16_available():
        return NO_PACKED_FP16
    return None


NO_PACKED_BF16 = ("cpu linear 'packed' in bfloat16 needs AVX-512 (avx512bw, avx512vl, "
                   "avx512dq) or AVX-NE-CONVERT, which this CPU lacks; use --cpu-linear torch "
                   "or auto, or --dtype float32")
NO_PACKED_FP16 = ("cpu linear 'packed' in float16 needs AVX512-FP16 or AVX-NE-CONVERT, which "
                  "this CPU lacks; use --cpu-linear torch or auto, or --dtype float32")


class _PrepackedLinear(nn.Module):
    """A ``Linear`` whose weight was packed once for one GEMM kernel; same maths, same rows."""

    # Whether inputs go through ``row_aligned`` (module NOTE). A kernel whose rows never read
    # each other, whatever their count, says False and saves the padded copy.
    row_align = True

    def __init__(self, linear: nn.Linear, keep_weight: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach()
        self.weight_dtype = w.dtype
        self.packed = self._pack(w.contiguous())
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        # A row-parallel layer's partial outputs are summed over the tensor-parallel ranks.
        self.reduce_output = bool(getattr(linear, "reduce_output", False))
        if keep_weight:
            # The plain rows stay readable for whoever recomputes a few outputs exactly (the
            # LM head's tied maxima, core/layers/logits.py); free when tied to the embeddings.
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = row_aligned(self._gemm, x) if self.row_align else self._gemm(x)
        return all_reduce(out) if self.reduce_output else out

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PackedLinear(_PrepackedLinear):
    """A ``Linear`` whose weight lives in oneDNN's packed layout; same maths, same rows."""

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        problem = packed_dtype_problem(w.dtype)
        if problem is not None:
            raise ValueError(problem)
        return torch.ops.mkldnn._reorder_linear_weight(w)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class _KernelLinear(_PrepackedLinear):
    """A ``Linear`` on one of the compiled kernels' GEMMs (``<kind>_pack`` once at load,
    ``<kind>_linear`` per call). A subclass names the kernel, the weight dtype it runs and
    what is missing where the kernels cannot run it; ``choose_linear`` refuses a request for
    it with the same words as its constructor."""

    kind: str
    runs: torch.dtype
    unavailable: str
    # Appended to the kernel's names: "_gated" picks <kind>_pack_gated / <kind>_linear_gated
    # (gated.py), the same call with another layout and epilogue.
    variant = ""

    @staticmethod
    def kernel_ops() -> ModuleType | None:
        """The compiled kernels where they can run this GEMM, else None."""
        raise NotImplementedError

    @classmethod
    def kernels_for(cls, dtype: torch.dtype) -> ModuleType:
        """The compiled kernels for weights of ``dtype``, or a ValueError naming the dtype it
        runs or what is missing, and the choices left."""
        if dtype != cls.runs:
            name = str(cls.runs).removeprefix("torch.")
            raise ValueError(f"cpu linear {cls.kind!r} runs {name} weights, got {dtype}; use "
                             f"--dtype {name}, or --cpu-linear auto, packed or torch")
        ops = cls.kernel_ops()
        if ops is None:
            raise ValueError(cls.unavailable)
        return ops

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        self.ops = self.kernels_for(w.dtype)
        self._run = getattr(self.ops, f"{self.kind}_linear{self.variant}")
        return getattr(self.ops, f"{self.kind}_pack{self.variant}")(w)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, self.packed, self.out_features, self.bias)


def brgemm_ops() -> ModuleType | None:
    """The compiled kernels where they can run bf16 GEMMs on this CPU, else None."""
    from cadence.backends.cpu.kernels import load_kernels

    ops = load_kernels()
    return ops if ops is not None and ops.brgemm_available() else None


def amx_ops() -> ModuleType | None:
    """The compiled kernels where their own AMX tile loop runs on this CPU, else None (also
    where ATEN_CPU_CAPABILITY caps the instruction set below AMX)."""
    from cadence.backends.cpu.kernels import load_kernels

    if "amx_bf16" not in cpu_info().flags:
        return None
    ops = load_kernels()
    return ops if ops is not None and ops.amx_available() else None


def tiled_ops() -> ModuleType | None:
    """The compiled kernels (they carry the fp32 tiled GEMM), else None."""
    from cadence.backends.cpu.kernels import load_kernels

    return load_kernels()


class BrgemmLinear(_KernelLinear):
    """A bf16 ``Linear`` on torch's batch-reduce GEMM micro-kernel (csrc/brgemm_linear.cpp)."""

    kind = "brgemm"
    runs = torch.bfloat16
    unavailable = ("cpu linear 'brgemm' needs the compiled CPU kernels and a CPU where torch's "
                   "bf16 micro-kernel runs (AMX); use --cpu-linear auto, packed or torch")

    @staticmethod
    def kernel_ops() -> ModuleType | None:
        return brgemm_ops()  # looked up per call: tests replace the module's function


class AmxLinear(_KernelLinear):
    """A bf16 ``Linear`` on csrc/amx_linear.cpp's AMX tile loop, which prefetches the weight
    stream ahead of the tiles; the same bits as ``BrgemmLinear`` on the CPUs measured."""

    kind = "amx"
    runs = torch.bfloat16
    # The tile loop pads to whole 16-row tiles itself, and a tile row's dot products read no
    # other row (csrc/amx_linear.cpp NOTE): a multiple of four buys nothing but the copy.
    row_align = False
    unavailable = ("cpu linear 'amx' needs the compiled CPU kernels and a CPU with AMX bf16 "
                   "tiles (amx_tile, amx_bf16); use --cpu-linear auto, packed or torch")

    @staticmethod
    def kernel_ops() -> ModuleType | None:
        return amx_ops()  # looked up per call, as BrgemmLinear's


class TiledLinear(_KernelLinear):
    """An fp32 ``Linear`` on the register-tiled micro-kernel of csrc/tiled_linear.cpp."""

    kind = "tiled"
    runs = torch.float32
    # Every output element is one FMA chain whatever the row count, one row included
    # (csrc/tiled_linear.cpp NOTE): padding to four rows would buy nothing but the copy,
    # which at decode batches that are not a multiple of four was 0.27 s of 19.5.
    row_align = False
    unavailable = ("cpu linear 'tiled' needs the compiled CPU kernels, which are turned off "
                   "(CADENCE_CPU_KERNELS=0) or did not build here (a C++ compiler is needed); "
                   "use --cpu-linear auto, packed or torch")

    @staticmethod
    def kernel_ops() -> ModuleType | None:
        return tiled_ops()  # looked up per call, as BrgemmLinear's


KINDS = {"packed": PackedLinear, "tiled": TiledLinear, "brgemm": BrgemmLinear,
          "amx": AmxLinear}


def row_independent_gemm(kind: str):
    """A factory of GEMMs on weights packed for ``kind``'s kernel, for LoRA's updates
    (cadence.lora.runtime), where that kernel's rows never read each other at any count
    (the fp32 tiled GEMM, the AMX tile loop); None elsewhere (the updates then take torch's
    GEMM)."""
    cls = KINDS.get(kind)
    if cls is None or cls.row_align:
        return None

    def make(weight: torch.Tensor):
        shell = SimpleNamespace(in_features=weight.shape[1], out_features=weight.shape[0],
                                weight=weight, bias=None)
        return cls(shell)

    return make


def pack_linears(model: nn.Module, keep_weight_of: tuple[str, ...] = (),
                 kind: str = "packed") -> int:
    """Replace every ``cadence.layers.linear.Linear`` in ``model`` by a ``PackedLinear``
    (``kind`` "packed"), a ``TiledLinear`` ("tiled"), a ``BrgemmLinear`` ("brgemm") or an
    ``AmxLinear`` ("amx").

    A weight shared with another module (the LM head tied to the embeddings) is packed as a
    copy; the other module keeps the plain tensor. Modules named in ``keep_weight_of`` keep
    their plain weight too (an untied one then costs its size twice).
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, KINDS[kind](child, keep_weight=name in keep_weight_of))
                count += 1
    return count
