"""Which GEMM the CPU backend runs (``--cpu-linear``): by name, or ``auto``, measured once
per CPU and cached.

``auto`` times every candidate of linear.py that runs here (F.linear, packed oneDNN, the
tiled fp32 micro-kernel, the brgemm micro-kernel, the AMX tile loop) on the model's own
shapes at one row and at 64 (``_ROWS``), with the weights streamed from memory as a decode
step streams them, takes the one with the least relative cost over the two, and leaves out
any whose rows depend on the batch (linear.py's NOTE: the engine's exactness rests on rows
that do not). The verdict is kept in the cache folder under a key of the CPU, torch, dtype,
threads, shapes and candidates, so every later engine on the machine runs the same GEMM.

The availability checks are looked up on linear.py at call time (``kinds.amx_ops()``, ...),
so they stay the one place that says what runs here.
"""

from __future__ import annotations

import fcntl
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from cadence.backends.cpu import linear as kinds
from cadence.backends.cpu.linear import LINEAR_CHOICES
from cadence.cpuinfo import cpu_info
from cadence.layers.linear import Linear

logger = logging.getLogger(__name__)


def _gemm_of(choice: str) -> Callable[[torch.Tensor], nn.Module]:
    """weight [N, K] -> the module the engine would run it as under ``choice`` (its row
    padding included), for timing and for the batch check."""
    def build(w: torch.Tensor) -> nn.Module:
        lin = Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        lin.weight = nn.Parameter(w, requires_grad=False)
        return lin if choice == "torch" else kinds.KINDS[choice](lin)
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


# The batches a verdict is timed at: one row, where a decode step streams its weights (memory
# bound), and 64, where it computes (the headline's batch). Timed at 64 rows alone, auto took
# packed oneDNN on an AVX2 EPYC (Zen 3), 2-5 % ahead of the tiled kernel there, while the tiled
# kernel ran a one-request decode 1.38x faster end to end (docs/performance.md).
_ROWS = (1, 64)


def _relative_cost(by_rows: dict[int, dict], choices: list[str]) -> dict[str, float]:
    """Each choice's geometric mean, over the timed batches, of its time over the fastest
    one's at that batch: 1.0 for a choice that is fastest everywhere. A kernel 1.4x slower at
    one row does not win on being 2 % faster at 64."""
    cost = dict.fromkeys(choices, 1.0)
    for times in by_rows.values():
        best = min(times[f"{c}_s"] for c in choices)
        for c in choices:
            cost[c] *= times[f"{c}_s"] / best
    return {c: v ** (1 / len(by_rows)) for c, v in cost.items()}


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
        kinds.KINDS[requested].kernels_for(dtype)
        odd = [k for _, k in shapes if k % 2]
        if requested == "brgemm" and odd:
            raise ValueError(f"cpu linear 'brgemm' needs even input widths (bf16 pairs), the "
                             f"model has {odd[:3]}; use --cpu-linear auto, packed or torch")
        return requested
    if requested == "packed":
        if not kinds.packed_available():
            raise ValueError("cpu linear 'packed' needs torch built with oneDNN (mkldnn)")
        problem = kinds.packed_dtype_problem(dtype)
        if problem is not None:
            raise ValueError(problem)
        return "packed"
    if dtype == torch.bfloat16 and not cpu_info().has_native_bf16:
        return "torch"  # oneDNN has no fast bf16 path without AVX-512 BF16/AMX
    brgemm = kinds.brgemm_ops() if dtype == torch.bfloat16 else None
    if brgemm is not None and any(k % 2 for _, k in shapes):
        brgemm = None  # its VNNI layout pairs the input features
    amx = dtype == torch.bfloat16 and kinds.amx_ops() is not None
    if amx:
        # The same tile arithmetic (same bits) plus prefetching: on the AMX Xeon measured,
        # within 3 % in cache and 1.15x faster on the default model's streamed weights, so
        # the micro-kernel is not timed where the tile loop runs (the two are close enough
        # for noise to pick either); it stays choosable by name.
        brgemm = None
    info = cpu_info()
    tiled = dtype == torch.float32 and kinds.tiled_ops() is not None
    packed = kinds.packed_available() and kinds.packed_dtype_problem(dtype) is None
    candidates = ["torch"] + (["packed"] if packed else []) + \
        (["tiled"] if tiled else []) + (["brgemm"] if brgemm is not None else []) + \
        (["amx"] if amx else [])
    if candidates == ["torch"]:
        return "torch"
    # "rows checked", "streamed in layer order", "rows (1, 64)": verdicts from before the
    # batch-independence check, timed on cached weights or at 64 rows only are measured again.
    key = json.dumps([info.model, info.relevant_flags, torch.__version__, str(dtype),
                      torch.get_num_threads(), shapes, candidates, "rows checked",
                      "streamed in layer order", f"rows {_ROWS}"])
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
            by_rows = {rows: _measure(small, dtype, rows=rows, choices=tuple(candidates))
                       for rows in _ROWS}
            # Ties go to the earlier of packed, tiled, amx, brgemm, torch; a kernel whose rows
            # depend on the batch is out (async == sync exactness needs them independent).
            order = [c for c in ("packed", "tiled", "amx", "brgemm", "torch")
                     if f"{c}_s" in by_rows[_ROWS[0]]]
            dependent = [c for c in order
                         if not _rows_independent(_gemm_of(c), shapes, dtype)]
            score = _relative_cost(by_rows, order)
            choice = min([c for c in order if c not in dependent] or order, key=score.get)
            times = {f"{c}_s": by_rows[_ROWS[-1]][f"{c}_s"] for c in order}
            if choice in dependent:
                logger.warning("no GEMM on this CPU (%s) gives a row the same bits in every "
                               "batch; taking the cheapest over the timed batches, %s: "
                               "outputs may then differ with batch composition, and async "
                               "on and off may differ",
                               str(dtype), _LABELS[choice])
            verdicts[key] = {"choice": choice, **times, "rows_depend_on_batch": dependent,
                             "by_rows": by_rows, "relative_cost": score}
            path.write_text(json.dumps(verdicts, indent=1))
            logger.info("measured GEMMs on this CPU (%s), per layer at %s rows: %s%s -> %s "
                        "(cached in %s)", str(dtype), " and ".join(map(str, _ROWS)),
                        ", ".join(_LABELS[c] + " " + " / ".join(
                            f"{by_rows[r][f'{c}_s'] * 1e3:.2f}" for r in _ROWS) + " ms"
                            for c in order),
                        "".join(f"; {_LABELS[c]} left out: its rows depend on the batch"
                                for c in dependent), choice, path)
    return verdicts[key]["choice"]
