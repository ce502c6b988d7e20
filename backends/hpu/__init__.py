"""The built-in Habana Gaudi (HPU) backend plugin, registered through the ``cadence.backends``
entry point exactly as a third-party backend would be.

Importing this module imports neither torch nor habana_frameworks (``engine backends`` and
backend selection load every plugin). It does apply the HPU environment defaults, because
the bridge reads them when it is imported, which may be any time after this: each default
is set only where the user has not set the variable.
"""

from __future__ import annotations

import os

from cadence.hookspecs import hookimpl
from cadence.plugins import warn_ignored_options

# Variable -> default. PT_HPU_LAZY_MODE=1: the overlap strategy is built around lazy mode
# (the device starts at mark_step); users choose eager / torch.compile with 0.
HPU_ENV_DEFAULTS = {"PT_HPU_LAZY_MODE": "1"}


def apply_env_defaults(environ: dict[str, str] | os._Environ = os.environ) -> None:
    for name, value in HPU_ENV_DEFAULTS.items():
        environ.setdefault(name, value)


apply_env_defaults()

# CLI flag (dest) -> backend_options key.
_RANGE_FLAGS = {
    "hpu_prompt_bs": "prompt_bs",
    "hpu_prompt_seq": "prompt_seq",
    "hpu_decode_bs": "decode_bs",
    "hpu_decode_blocks": "decode_blocks",
}


@hookimpl
def cadence_register_backends(register) -> None:
    from cadence.backends.hpu.backend import HpuBackend

    register(HpuBackend)


@hookimpl
def cadence_add_cli_options(parser) -> None:
    parser.add_argument("--hpu-bucketing", choices=("exponential", "linear"), default=None,
                        help="HPU shape-bucket spacing (default exponential)")
    for dest, what in (("hpu_prompt_bs", "prefill batch size"),
                       ("hpu_prompt_seq", "prefill query length in tokens"),
                       ("hpu_decode_bs", "decode batch size"),
                       ("hpu_decode_blocks", "KV blocks read per sequence")):
        parser.add_argument("--" + dest.replace("_", "-"), dest=dest, default=None,
                            metavar="MIN:STEP:MAX",
                            help=f"HPU buckets for the {what} (default: covers the limits)")
    parser.add_argument("--hpu-kv-cache-gb", type=float, default=None,
                        help="device memory for the KV cache in GiB")
    parser.add_argument("--hpu-skip-warmup", action="store_true", default=None,
                        help="skip compiling every bucket at start-up (graphs then compile "
                             "while serving)")
    parser.add_argument("--hpu-warmup-hidden", action="store_true", default=None,
                        help="also compile, at start-up, the graphs that return hidden "
                             "states (embeddings, prompt logprobs), which otherwise compile "
                             "at the first such request of each shape")


@hookimpl
def cadence_configure(config) -> None:
    if config.get("backend") != "hpu":
        warn_ignored_options(config, "hpu", (*_RANGE_FLAGS, "hpu_bucketing", "hpu_kv_cache_gb",
                                             "hpu_skip_warmup", "hpu_warmup_hidden"))
        return
    opts = config.setdefault("backend_options", {})
    if config.get("hpu_bucketing"):
        opts["bucketing"] = config["hpu_bucketing"]
    for dest, key in _RANGE_FLAGS.items():
        if config.get(dest):
            opts[key] = config[dest]
    if config.get("hpu_kv_cache_gb"):
        opts["kv_cache_gb"] = config["hpu_kv_cache_gb"]
    if config.get("hpu_skip_warmup"):
        opts["skip_warmup"] = True
    if config.get("hpu_warmup_hidden"):
        opts["warmup_hidden"] = True
    # Gaudi computes in bf16; emulation keeps the CPU default so it can match the CPU backend.
    from cadence.backends.hpu.backend import emulation_requested

    if config.get("dtype") == "auto" and not emulation_requested():
        config["dtype"] = "bfloat16"
