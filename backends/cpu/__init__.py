"""The built-in CPU backend plugin, registered through the ``cadence.backends`` entry point
exactly as a third-party backend would be."""

from __future__ import annotations

from cadence.hookspecs import hookimpl
from cadence.plugins import warn_ignored_options

CPU_MAX_NUM_BATCHED_TOKENS = 2048


@hookimpl
def cadence_register_backends(register) -> None:
    from cadence.backends.cpu.backend import CpuBackend

    register(CpuBackend)


# The options cadence_add_cli_options adds (their argparse destinations).
_OPTION_DESTS = ("cpu_overlap", "cpu_kv_cache_gb", "cpu_attention", "cpu_linear",
                 "cpu_huge_pages", "cpu_bind", "cpu_reserved_cores")


@hookimpl
def cadence_add_cli_options(parser) -> None:
    from cadence.backends.cpu.backend import OVERLAP_STRATEGIES

    parser.add_argument(
        "--cpu-overlap", choices=OVERLAP_STRATEGIES, default=None,
        help="CPU overlap strategy: 'process' (default: the forward runs in a worker process "
             "while the engine runs post_sample; fastest measured), 'sync' (no overlap, the "
             "reference) or 'thread' (a worker thread; slower on few cores)")
    parser.add_argument("--cpu-kv-cache-gb", type=float, default=None,
                        help="host memory for the KV cache in GiB (default 2)")
    parser.add_argument("--cpu-attention", choices=("auto", "kernel", "torch"), default=None,
                        help="decode attention: 'kernel' (compiled once per CPU, reads the paged "
                             "cache in place), 'torch' (the reference path), or 'auto' "
                             "(default: the kernel where it builds, else torch with a warning)")
    parser.add_argument("--cpu-linear",
                        choices=("auto", "packed", "tiled", "brgemm", "amx", "torch"),
                        default=None,
                        help="GEMMs: 'packed' (oneDNN weights packed at load), 'tiled' (fp32 "
                             "on a compiled register-tiled kernel, weights packed at load), "
                             "'brgemm' (bf16 on torch's AMX micro-kernel, weights packed at "
                             "load), 'amx' (bf16 on a compiled AMX tile loop that prefetches "
                             "the weights, packed at load), 'torch' (F.linear), or 'auto' "
                             "(default: whichever measured fastest on this CPU, measured once "
                             "and cached)")
    parser.add_argument("--cpu-huge-pages", choices=("off", "weights", "all"), default=None,
                        help="transparent huge pages (2 MiB) for what every step streams: "
                             "'off' (default: 4 KiB pages, as torch allocates), 'weights' (the "
                             "model's tensors, moved at start-up) or 'all' (the weights and the "
                             "KV cache, for long-running servers; the cache's first pages are "
                             "touched at start-up). Needs THP 'always' or 'madvise'")
    parser.add_argument("--cpu-bind", choices=("cores", "none"), default=None,
                        help="ranks and data-parallel replicas: 'cores' (default: each binds "
                             "to its own share of the cores) or 'none' (no binding; each "
                             "sizes its threads to an equal share, so more ranks than cores "
                             "can run, slower)")
    parser.add_argument("--cpu-reserved-cores", type=int, default=None, metavar="N",
                        help="keep the model's threads off the first N cores, for the engine "
                             "process's own work (scheduling, output processing), so it "
                             "overlaps the forward; for machines with cores to spare "
                             "(default 0)")


@hookimpl
def cadence_configure(config) -> None:
    if config.get("backend") != "cpu":
        warn_ignored_options(config, "cpu", _OPTION_DESTS)
        return
    if config.get("max_num_batched_tokens") is None and config.get("enable_chunked_prefill",
                                                                   True):
        # Prefill in chunks of 2048 tokens: the activations of a chunk stay under glibc's
        # 32 MiB mmap threshold and in cache, and oneDNN's GEMMs run ~10 % faster at that
        # size than at 8192 rows (measured: docs/backends/cpu.md).
        config["max_num_batched_tokens"] = CPU_MAX_NUM_BATCHED_TOKENS
    if config.get("dtype") == "auto":
        from cadence.backends.cpu.dtype import resolve_auto_dtype

        # Quantized weights run with fp32 activations (quantized.py).
        config["dtype"] = "float32" if config.get("quantization") else \
            resolve_auto_dtype(config["model"])
    if config.get("quantization"):
        from cadence.backends.cpu.quantized import check_dtype

        check_dtype(config["quantization"], config["dtype"])
    opts = config.setdefault("backend_options", {})
    if config.get("cpu_overlap"):
        opts["overlap"] = config["cpu_overlap"]
    if config.get("cpu_kv_cache_gb") is not None:
        gb = config["cpu_kv_cache_gb"]
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not 0 < gb <= 1 << 20:
            raise ValueError(f"--cpu-kv-cache-gb must be a number of GiB > 0, got {gb!r}")
        opts["kv_cache_gb"] = gb
    for flag, key in (("cpu_attention", "attention"), ("cpu_linear", "linear"),
                      ("cpu_huge_pages", "huge_pages"),
                      ("cpu_bind", "bind"), ("cpu_reserved_cores", "reserved_cores")):
        if config.get(flag):
            opts[key] = config[flag]


@hookimpl
def cadence_env_info() -> dict[str, str]:
    import os

    return {"cpu_count": str(os.cpu_count()),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "")}
