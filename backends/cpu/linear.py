"""GEMMs on weights packed once at load time, chosen per CPU by measurement.

``torch.ops.mkldnn._reorder_linear_weight`` reorders a weight into oneDNN's blocked layout
for this CPU, and ``_linear_pointwise`` runs the GEMM on it: what inductor's weight
prepacking and vLLM's CPU path do. Measured on an AVX-512 EPYC at 64 rows it ran the
SmolLM2 layer GEMMs ~1.5x faster than ``F.linear`` in fp32 and ~1.3x in bf16, and the LM head
2.2x (docs/backends/cpu.md). Whether it wins elsewhere is measured, not assumed:
``choose_linear`` times each candidate on the model's own shapes once per CPU/torch/dtype and caches
the verdict, so later runs on the machine make the same choice.

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
GEMM ever runs with one row. That padding is not enough everywhere: on an AMX Xeon,
oneDNN's bf16 GEMM and ``F.linear`` in both dtypes give rows of a batch of 8 other bits than
in a batch of 64. So auto checks every candidate on the model's own shapes at batch sizes
from 4 to 128 against a batch of 256 (``_rows_independent``) and does not choose one that
fails while another passes.
"""

from __future__ import annotations

import fcntl
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from cadence.cpuinfo import cpu_info
from cadence.distributed import all_reduce
from cadence.layers.linear import Linear, row_aligned

logger = logging.getLogger(__name__)

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


_NO_PACKED_BF16 = ("cpu linear 'packed' in bfloat16 needs AVX-512 (avx512bw, avx512vl, "
                   "avx512dq) or AVX-NE-CONVERT, which this CPU lacks; use --cpu-linear torch "
                   "or auto, or --dtype float32")


class _PrepackedLinear(nn.Module):
    """A ``Linear`` whose weight was packed once for one GEMM kernel; same maths, same rows."""

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
        out = row_aligned(self._gemm, x)
        return all_reduce(out) if self.reduce_output else out

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PackedLinear(_PrepackedLinear):
    """A ``Linear`` whose weight lives in oneDNN's packed layout; same maths, same rows."""

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        if w.dtype == torch.bfloat16 and not packed_bf16_available():
            raise ValueError(_NO_PACKED_BF16)
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
    unavailable = ("cpu linear 'amx' needs the compiled CPU kernels and a CPU with AMX bf16 "
                   "tiles (amx_tile, amx_bf16); use --cpu-linear auto, packed or torch")

    @staticmethod
    def kernel_ops() -> ModuleType | None:
        return amx_ops()  # looked up per call, as BrgemmLinear's


class TiledLinear(_KernelLinear):
    """An fp32 ``Linear`` on the register-tiled micro-kernel of csrc/tiled_linear.cpp."""

    kind = "tiled"
    runs = torch.float32
    unavailable = ("cpu linear 'tiled' needs the compiled CPU kernels, which are turned off "
                   "(CADENCE_CPU_KERNELS=0) or did not build here (a C++ compiler is needed); "
                   "use --cpu-linear auto, packed or torch")

    @staticmethod
    def kernel_ops() -> ModuleType | None:
        return tiled_ops()  # looked up per call, as BrgemmLinear's


_KINDS = {"packed": PackedLinear, "tiled": TiledLinear, "brgemm": BrgemmLinear,
          "amx": AmxLinear}


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
                setattr(parent, name, _KINDS[kind](child, keep_weight=name in keep_weight_of))
                count += 1
    return count


def _gemm_of(choice: str) -> Callable[[torch.Tensor], nn.Module]:
    """weight [N, K] -> the module the engine would run it as under ``choice`` (its row
    padding included), for timing and for the batch check."""
    def build(w: torch.Tensor) -> nn.Module:
        lin = Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        lin.weight = nn.Parameter(w, requires_grad=False)
        return lin if choice == "torch" else _KINDS[choice](lin)
    return build


# Weights the measurement streams through per pass: each shape gets enough distinct copies
# (up to _MAX_COPIES) that together they are far larger than the caches near a core, as a
# decode step's layers are. Timed on one weight per shape instead, every candidate ran from
# cache, and on an AMX Xeon that ranked first a kernel that streams the real model's weights
# 1.15x slower. Candidates alternate pass by pass, so a drift in the machine's speed does not
# favour whichever ran first. _STREAM_BYTES bounds the copies of all candidates together;
# where one pass of a model's shapes alone exceeds a candidate's share, its weights stream
# anyway, and the candidates are timed one after another, each freed before the next.
_STREAM_BYTES = 256 << 20
_MAX_COPIES = 32
_PASSES = 7


def _measure(shapes: list[tuple[int, int]], dtype: torch.dtype, rows: int = 64,
             choices: tuple[str, ...] = ("torch", "packed")) -> dict:
    """Seconds per pass over ``shapes`` for each of ``choices`` (best of ``_PASSES``), on
    weights that stream from memory (``_STREAM_BYTES``)."""
    g = torch.Generator().manual_seed(0)
    pass_bytes = sum(n * k for n, k in shapes) * torch.empty((), dtype=dtype).element_size()
    copies = min(_MAX_COPIES, _STREAM_BYTES // len(choices) // max(pass_bytes, 1))
    # Copy by copy, every shape in turn, as a step runs layer after layer.
    weights = [torch.randn(n, k, generator=g).to(dtype)
               for _ in range(max(copies, 1)) for n, k in shapes]
    xs = {k: torch.randn(rows, k, generator=g).to(dtype) for _, k in shapes}

    def timed_pass(gemms: list) -> float:
        t = time.perf_counter()
        for gemm, x in gemms:
            gemm(x)
        return time.perf_counter() - t

    def build(c: str) -> list:
        gemms = [(_gemm_of(c)(w), xs[w.shape[1]]) for w in weights]
        for gemm, x in gemms[:len(shapes)]:  # a first call builds what a kernel caches
            gemm(x)
        return gemms

    best = dict.fromkeys(choices, float("inf"))
    with torch.no_grad():
        if copies >= 1:
            gemms = {c: build(c) for c in choices}
            for _ in range(_PASSES):
                for c in choices:
                    best[c] = min(best[c], timed_pass(gemms[c]))
        else:
            for c in choices:
                one = build(c)
                best[c] = min(timed_pass(one) for _ in range(_PASSES))
                del one
    return {f"{c}_s": best[c] / max(copies, 1) for c in choices}


_CHECK_ROWS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
_CHECK_BATCH = 256
_CHECK_MAX_N = 8192  # a wider weight (an LM head) is checked on its first 8192 rows


def _rows_independent(gemm: Callable[[torch.Tensor], Callable],
                      shapes: list[tuple[int, int]], dtype: torch.dtype) -> bool:
    """Whether ``gemm`` (weight -> x -> x @ weight.T, ``_gemm_of``) gives the first rows of a
    batch of 256 the same bits in batches of 4 to 128 rows, on every shape. On an AMX Xeon,
    oneDNN's bf16 GEMM and F.linear in both dtypes were measured to fail this (rows of a batch
    of 8 differ from the same rows in a batch of 64); the module NOTE says what auto does."""
    g = torch.Generator().manual_seed(1)
    for n, k in shapes:
        w = (torch.randn(min(n, _CHECK_MAX_N), k, generator=g) * k ** -0.5).to(dtype)
        x = torch.randn(_CHECK_BATCH, k, generator=g).to(dtype)
        run = gemm(w)
        with torch.no_grad():
            full = run(x)
            if not all(torch.equal(run(x[:m]), full[:m]) for m in _CHECK_ROWS):
                return False
    return True


_LABELS = {"torch": "F.linear", "packed": "packed oneDNN", "tiled": "tiled fp32 micro-kernel",
           "brgemm": "brgemm micro-kernel", "amx": "AMX tile loop"}


def _verdict_file() -> Path:
    from cadence.cache_dir import cache_dir

    return cache_dir("tuning", "linear.json")


def choose_linear(requested: str, model: nn.Module, dtype: torch.dtype) -> str:
    """``packed``, ``tiled``, ``brgemm``, ``amx`` or ``torch`` for ``requested`` in
    LINEAR_CHOICES (auto measures, once per CPU, torch, dtype, thread count and set of
    shapes)."""
    if requested not in LINEAR_CHOICES:
        raise ValueError(f"cpu linear must be one of {LINEAR_CHOICES}, got {requested!r}")
    if requested == "torch":
        return "torch"
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear)})
    if requested in ("brgemm", "amx", "tiled"):
        _KINDS[requested].kernels_for(dtype)
        odd = [k for _, k in shapes if k % 2]
        if requested == "brgemm" and odd:
            raise ValueError(f"cpu linear 'brgemm' needs even input widths (bf16 pairs), the "
                             f"model has {odd[:3]}; use --cpu-linear auto, packed or torch")
        return requested
    if requested == "packed":
        if not packed_available():
            raise ValueError("cpu linear 'packed' needs torch built with oneDNN (mkldnn)")
        if dtype == torch.bfloat16 and not packed_bf16_available():
            raise ValueError(_NO_PACKED_BF16)
        return "packed"
    if dtype == torch.bfloat16 and not cpu_info().has_native_bf16:
        return "torch"  # oneDNN has no fast bf16 path without AVX-512 BF16/AMX
    brgemm = brgemm_ops() if dtype == torch.bfloat16 else None
    if brgemm is not None and any(k % 2 for _, k in shapes):
        brgemm = None  # its VNNI layout pairs the input features
    amx = dtype == torch.bfloat16 and amx_ops() is not None
    if amx:
        # The same tile arithmetic (same bits) plus prefetching: on the AMX Xeon measured,
        # within 3 % in cache and 1.15x faster on the default model's streamed weights, so
        # the micro-kernel is not timed where the tile loop runs (the two are close enough
        # for noise to pick either); it stays choosable by name.
        brgemm = None
    info = cpu_info()
    tiled = dtype == torch.float32 and tiled_ops() is not None
    candidates = ["torch"] + (["packed"] if packed_available() else []) + \
        (["tiled"] if tiled else []) + (["brgemm"] if brgemm is not None else []) + \
        (["amx"] if amx else [])
    if candidates == ["torch"]:
        return "torch"
    # "rows checked", "streamed in layer order": verdicts from before the batch-independence
    # check, or timed on cached weights, are measured again.
    key = json.dumps([info.model, info.relevant_flags, torch.__version__, str(dtype),
                      torch.get_num_threads(), shapes, candidates, "rows checked",
                      "streamed in layer order"])
    path = _verdict_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    # One process measures; others wait on the lock and read its verdict, so two engines
    # started together on one machine never run different GEMMs.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            verdicts = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            verdicts = {}  # unreadable or half-written by a killed process: measure again
        if key not in verdicts:
            small = [s for s in shapes if s[0] <= 8192]
            times = _measure(small, dtype, choices=tuple(candidates))
            # Ties go to the earlier of packed, tiled, amx, brgemm, torch; a kernel whose rows
            # depend on the batch is out (async == sync exactness needs them independent).
            order = [c for c in ("packed", "tiled", "amx", "brgemm", "torch")
                     if f"{c}_s" in times]
            dependent = [c for c in order
                         if not _rows_independent(_gemm_of(c), shapes, dtype)]
            choice = min([c for c in order if c not in dependent] or order,
                         key=lambda c: times[f"{c}_s"])
            if choice in dependent:
                logger.warning("no GEMM on this CPU (%s) gives a row the same bits in every "
                               "batch; taking the fastest, %s: outputs may then differ with "
                               "batch composition, and async on and off may differ",
                               str(dtype), _LABELS[choice])
            verdicts[key] = {"choice": choice, **times, "rows_depend_on_batch": dependent}
            path.write_text(json.dumps(verdicts, indent=1))
            logger.info("measured GEMMs on this CPU (%s): %s per layer%s -> %s (cached in %s)",
                        str(dtype), ", ".join(f"{_LABELS[c]} {times[f'{c}_s'] * 1e3:.2f} ms"
                                              for c in order),
                        "".join(f"; {_LABELS[c]} left out: its rows depend on the batch"
                                for c in dependent), choice, path)
    return verdicts[key]["choice"]
