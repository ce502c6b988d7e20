"""Workloads, comparisons and the probe subprocess used by the conformance checks.

Importable for your own tests: ``run_workload(llm, "greedy")`` generates the kit's prompts,
``assert_same_tokens`` compares greedy runs allowing only near-ties, ``probe_in_subprocess``
loads one plugin in a fresh interpreter and reports what its import and probe pulled in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from typing import Any

from cadence.sampling_params import SamplingParams
from cadence.testing.tiny_model import sentences

# Prompts of 5 to ~50 tokens (~110 in all, over the kit's 64-token budget, so prefills get
# chunked); the longer ones fill several KV blocks.
PROMPTS = sentences(7, seed=7) + [" ".join(sentences(5, seed=3))]
WORKLOADS = ("greedy", "seeded")
_RESULTS: weakref.WeakKeyDictionary[Any, dict[str, list[Any]]] = weakref.WeakKeyDictionary()
# Modules whose import means a probe went too far (DESIGN: probe never acquires the device).
DEVICE_MODULES = ("habana_frameworks", "torch_xla", "torch_npu", "intel_extension_for_pytorch",
                  "triton", "tensorflow", "jax")


def workload_params(name: str) -> list[SamplingParams]:
    """Per-prompt sampling parameters; different lengths so the batch shrinks step by step."""
    if name == "greedy":
        return [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True,
                               logprobs=3) for i in range(len(PROMPTS))]
    if name == "seeded":
        return [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=100 + i,
                               max_tokens=5 + 2 * i, stop=[" sees", " quick"] if i % 2 else None,
                               logprobs=1) for i in range(len(PROMPTS))]
    raise ValueError(f"unknown workload {name!r}; valid: {WORKLOADS}")


# Greedy, with the top logprobs the near-tie rule reads (``assert_same_tokens``).
LORA_PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)


def lora_workload(adapters: list[Any]) -> tuple[list[str], list[Any]]:
    """The kit's first three prompts under no adapter and under each of ``adapters``, all
    in one batch: (prompts, their LoRA requests)."""
    loras = [None, *adapters]
    return ([p for _ in loras for p in PROMPTS[:3]],
            [lr for lr in loras for _ in PROMPTS[:3]])


def run_workload(llm: Any, name: str, order: list[int] | None = None) -> list[Any]:
    """Generate the workload (optionally a subset/ordering of the prompts), in prompt order."""
    order = list(range(len(PROMPTS))) if order is None else order
    params = workload_params(name)
    outputs = llm.generate([PROMPTS[i] for i in order], [params[i] for i in order],
                           use_tqdm=False)
    assert_all_blocks_free(llm)
    return outputs


def cached_workload(llm: Any, name: str) -> list[Any]:
    """``run_workload(llm, name)``, computed once per LLM: outputs are deterministic, and
    several checks compare against the same full-batch run."""
    cache = _RESULTS.setdefault(llm, {})
    if name not in cache:
        cache[name] = run_workload(llm, name)
    return cache[name]


def assert_all_blocks_free(llm: Any) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.num_blocks, (
        f"{engine.num_blocks - engine.block_manager.num_free_blocks} KV blocks still in use "
        "after every request finished")


def summarize(outputs: list[Any]) -> list[tuple]:
    """Everything observable about a result, for exact comparisons."""
    rows = []
    for out in outputs:
        for c in out.outputs:
            lps = [sorted((t, round(lp.logprob, 4)) for t, lp in d.items())
                   for d in c.logprobs or []]
            rows.append((c.index, tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason,
                         lps))
    return rows


def assert_same_tokens(actual: list[Any], expected: list[Any], atol: float, what: str) -> None:
    """Greedy token ids must match; at the first difference, the two tokens must be a
    near-tie in ``expected``'s logprobs (|gap| <= atol), and the rest of that sequence is
    not compared (it continues from a different prefix)."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        ta, te = a.outputs[0].token_ids, e.outputs[0].token_ids
        n = next((k for k, (x, y) in enumerate(zip(ta, te)) if x != y), None)
        if n is None:
            assert len(ta) == len(te), f"{what}: prompt {i} has {len(ta)} tokens, not {len(te)}"
            continue
        top = e.outputs[0].logprobs[n] if e.outputs[0].logprobs else {}
        head = (f"{what}: prompt {i} ({len(e.prompt_token_ids)} tokens) differs at output "
                f"token {n}: the backend chose token {ta[n]}, the reference {te[n]}")
        tail = f"\n backend   {list(ta)}\n reference {list(te)}"
        assert ta[n] in top, (
            f"{head}, and the backend's token is not among the reference's top logprobs "
            f"there, so the two are not a near-tie: a real difference{tail}")
        gap = abs(top[te[n]].logprob - top[ta[n]].logprob)
        assert gap <= atol, (
            f"{head}; the reference rates them {gap:.4g} apart in logprob, more than the "
            f"{atol:g} a near-tie may differ by (--cadence-logprob-atol){tail}")


_PROBE_SCRIPT = """
import json, sys
from cadence.plugins import PluginRegistry
reg = PluginRegistry().load()
info = reg.backends.get(sys.argv[1])
loaded = set(sys.modules)
probe = info.cls.probe() if info is not None else None
torch = sys.modules.get("torch")
cuda = getattr(torch, "cuda", None)  # reads state only; never initialises a device
print(json.dumps({
    "found": info is not None, "backends": sorted(reg.backends),
    "mismatches": {ep: why for ep, (dist, why) in reg.mismatches().items()},
    "errors": [f"{e.entry_point}: {e.error}" for e in reg.errors],
    "available": getattr(probe, "available", None), "reason": getattr(probe, "reason", None),
    "device_modules": sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2:])),
    "imported_by_probe": sorted({m.split(".")[0] for m in set(sys.modules) - loaded}),
    "cuda_initialized": bool(cuda is not None and cuda.is_initialized()),
    "torch_imported": torch is not None,
}))
"""


def probe_in_subprocess(name: str, allow_list: str | None = None) -> dict[str, Any]:
    """Load only plugin ``name`` (CADENCE_PLUGINS) in a fresh interpreter and probe it."""
    env = {**os.environ, "CADENCE_PLUGINS": allow_list or name}
    env.pop("CADENCE_DISABLE_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT, name, *DEVICE_MODULES],
                          check=False, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, f"probing {name!r} in a fresh process failed:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
