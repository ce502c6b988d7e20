"""The built-in CUDA backend plugin, registered through the ``cadence.backends`` entry point
exactly as a third-party backend would be.

Importing this module imports neither torch's CUDA runtime nor triton: the backend class is
imported when the plugin registers it, and triton only when the attention layer is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cadence.hookspecs import hookimpl
from cadence.plugins import check_backend_options, warn_ignored_options

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_CUDA_GRAPH_MAX_BS = 256
# (flag, dest, kwargs): vLLM's names where vLLM has the knob.
_CLI_OPTIONS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("--enforce-eager", "enforce_eager", {
        "action": "store_true", "default": None,
        "help": "cuda: never capture CUDA graphs; run every step eagerly"}),
    ("--gpu-memory-utilization", "gpu_memory_utilization", {
        "type": float, "default": None,
        "help": "cuda: fraction of the GPU's memory this engine may use; the KV cache gets "
                f"what the profiled forward leaves (default {DEFAULT_GPU_MEMORY_UTILIZATION})"}),
    ("--cuda-graph-max-bs", "cuda_graph_max_bs", {
        "type": int, "default": None,
        "help": "cuda: largest decode batch run as a CUDA graph; buckets 1, 2, 4, 8, 16, 24, "
                f"... (default min({DEFAULT_CUDA_GRAPH_MAX_BS}, max_num_seqs))"}),
)


@dataclass(frozen=True, slots=True)
class CudaOptions:
    """The CUDA knobs, read from ``EngineConfig.backend_options`` (validated here)."""

    enforce_eager: bool = False
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    cuda_graph_max_bs: int = DEFAULT_CUDA_GRAPH_MAX_BS
    record_events: bool = False  # keep "launch", "post_sample", ... per step (tests, debug)
    # torch device; None = the current CUDA device. "cpu" runs this backend's code on the
    # CPU with interpreted Triton kernels (TRITON_INTERPRET=1) and graphs simulated: tests only.
    device: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")

    @classmethod
    def from_config(cls, config: Any) -> CudaOptions:
        check_backend_options(config.backend_options, "cuda",
                              (f.name for f in dataclasses.fields(cls)))
        opt = config.backend_option
        max_bs = opt("cuda_graph_max_bs", None)
        if max_bs is None:
            max_bs = min(DEFAULT_CUDA_GRAPH_MAX_BS, config.scheduler_config.max_num_seqs)
        return cls(bool(opt("enforce_eager", False)),
                   float(opt("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION)),
                   int(max_bs), bool(opt("record_events", False)), opt("device", None))


@hookimpl
def cadence_register_backends(register) -> None:
    from cadence.backends.cuda.backend import CudaBackend

    register(CudaBackend)


@hookimpl
def cadence_add_cli_options(parser) -> None:
    for flag, dest, kwargs in _CLI_OPTIONS:
        # --enforce-eager is a knob another graph backend (hpu) may add too: share it.
        if flag not in parser._option_string_actions:
            parser.add_argument(flag, dest=dest, **kwargs)


@hookimpl
def cadence_configure(config) -> None:
    if config.get("backend") != "cuda":
        # --enforce-eager may be another graph backend's knob too (a plugin's): named as
        # ignored only by the built-in backends, which have no such knob.
        warn_ignored_options(config, "cuda", (
            d for _, d, _ in _CLI_OPTIONS
            if d != "enforce_eager" or config.get("backend") in ("cpu", "hpu")))
        return
    if config.get("dtype") == "auto":
        # The core resolves "auto" to float32 (right for CPUs); on a GPU bf16 is the usual
        # serving dtype (vLLM's choice for bf16 checkpoints). Pass dtype= to override.
        config["dtype"] = "bfloat16"
    if config.get("async_scheduling") is None and not config.get("disable_async_output_proc"):
        # Measured faster on an H200 at every batch size tried (1.08-1.23x async output
        # processing alone, docs/backends/cuda.md). Not with async output turned off: that
        # asks for the sync engine.
        config["async_scheduling"] = True
    opts = config.setdefault("backend_options", {})
    for _, dest, _ in _CLI_OPTIONS:
        value = config.get(dest)
        if value is not None and value is not False:
            opts[dest] = value
