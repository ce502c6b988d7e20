"""The types and ranges of ``EngineArgs``' fields, checked before anything is resolved.

The configuration dataclasses (core/config.py) check what their values mean; this checks
what the Python API lets through that the command line's ``type=int`` would not: a float
where a count goes (NaN compares false with everything, and an engine built on
``max_num_seqs=nan`` schedules nothing, forever), a bool or a string where a number goes,
a string where a bool goes. Each refusal is a ValueError naming the field and what it
takes, as ``SamplingParams`` does.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

# (field, smallest value, None allowed)
_INTS = (("max_model_len", 1, True), ("block_size", 1, False), ("num_kv_blocks", 1, True),
         ("max_num_seqs", 1, False), ("max_num_samples", 1, False),
         ("max_num_batched_tokens", 1, True), ("tensor_parallel_size", 1, False),
         ("pipeline_parallel_size", 1, False), ("max_worker_restarts", 0, False),
         ("max_loras", 1, False), ("max_lora_rank", 1, False), ("max_cpu_loras", 1, True))
# Seconds; inf: no limit.
_TIMES = ("step_timeout", "startup_timeout")
# (field, None allowed)
_BOOLS = (("enable_prefix_caching", False), ("enable_chunked_prefill", False),
          ("disable_async_output_proc", False), ("async_scheduling", True),
          ("enable_expert_parallel", False), ("pooling_normalize", True),
          ("enable_lora", False))
# torch.manual_seed takes any 64-bit value, signed or not.
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
# Past this a timeout is no limit in practice, and select() and friends refuse it.
MAX_TIMEOUT_S = 1e7


def _integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_engine_args(args: dict[str, Any]) -> None:
    """Refuse a field of the wrong type or out of range (module docstring)."""
    for name, low, optional in _INTS:
        value = args[name]
        if value is None and optional:
            continue
        if not _integer(value) or value < low:
            none = " or None" if optional else ""
            raise ValueError(f"{name} must be an integer >= {low}{none}, got {value!r}")
    for name in _TIMES:
        value = args[name]
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
                math.isnan(value) or value <= 0 or \
                (value > MAX_TIMEOUT_S and not math.isinf(value)):
            raise ValueError(f"{name} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                             f"or inf for no limit, got {value!r}")
    for name, optional in _BOOLS:
        value = args[name]
        # numpy's bool_ too (it is no Python bool, nor an integer).
        is_bool = isinstance(value, bool) or type(value).__name__ == "bool_"
        if not is_bool and not (value is None and optional):
            raise ValueError(f"{name} must be True or False{' or None' if optional else ''}"
                             f", got {value!r}")
    seed = args["seed"]
    if seed is not None and (not _integer(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1] or None (a random "
                         f"one), got {seed!r}")
    for name in ("model", "tokenizer"):
        if args[name] is not None and (not isinstance(args[name], str) or not args[name]):
            raise ValueError(f"{name} must be a non-empty path or Hub id, or None, got "
                             f"{args[name]!r}")
    if not isinstance(args["backend_options"], dict):
        # ValueError, as for every bad argument of the API (TRY004 would have TypeError).
        raise ValueError(f"backend_options must be a dict, got "  # noqa: TRY004
                         f"{type(args['backend_options']).__name__}")
