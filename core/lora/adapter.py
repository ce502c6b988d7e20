"""Reading a PEFT LoRA folder on the engine side: which projections it changes, their ranks
and scales, checked against the model before any request uses it. No torch here: the
safetensors header is JSON, the tensors themselves are loaded where the model lives
(``cadence.lora.weights``).

What is accepted (docs/semantics.md, "LoRA adapters"): ``peft_type`` LORA with ``lora_A`` /
``lora_B`` weights on the decoder layers' q/k/v/o and gate/up/down projections, plain or
rank-stabilized scaling (``use_rslora``), per-module ``rank_pattern`` / ``alpha_pattern``.
Refused, naming the field: DoRA, trained biases, ``modules_to_save``, adapters on the
embeddings or the LM head, ``fan_in_fan_out`` weights, a rank above ``--max-lora-rank``,
shapes that are not the model's.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

#: The families whose decoder layers cadence builds with Llama's projection names (q/k/v/o
#: fused into ``qkv_proj``, gate/up into ``gate_up_proj``) and whose adapters it applies.
LORA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                      "Qwen3ForCausalLM", "LlamaModel", "MistralModel", "Qwen2Model",
                      "Qwen3Model")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODULE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")
_WEIGHT = re.compile(r"^base_model\.model\.(.+)\.(lora_A|lora_B)\.weight$")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass(frozen=True, slots=True)
class ModuleAdapter:
    """One projection's low-rank update: ``scale * B @ A`` with A [rank, in], B [out, rank]."""

    layer: int
    projection: str  # one of PROJECTIONS
    rank: int
    scale: float
    a_name: str  # the tensors' names in the safetensors file
    b_name: str


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A checked adapter folder: its weights file and each projection it changes."""

    path: str
    weights_file: str
    modules: tuple[ModuleAdapter, ...]

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)


def check_lora_architecture(model_dir: str) -> None:
    """Refuse ``--enable-lora`` for a model whose adapters cadence cannot apply."""
    with open(os.path.join(model_dir, "config.json")) as f:
        arch = json.load(f).get("architectures") or []
    if not any(a in LORA_ARCHITECTURES for a in arch):
        raise ValueError(f"LoRA adapters are supported for {', '.join(LORA_ARCHITECTURES)}; "
                         f"this model is {arch} (start without --enable-lora)")


def expected_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of the model ``cfg`` (config.json) describes."""
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    inter = cfg["intermediate_size"]
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden),
            "v_proj": (kv * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


# Bytes per element of the dtypes a safetensors adapter may hold.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def _read_header(path: str) -> dict:
    """The tensors' entries of a safetensors file, each checked to lie whole in the file:
    a file cut short or garbled is refused here, not met by the step that reads it."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100_000_000:
            raise ValueError(f"{path} is not a safetensors file (header of {size} bytes)")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a safetensors file: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(  # noqa: TRY004 (a damaged file is a ValueError: STYLE.md)
            f"{path} is not a safetensors file (its header is not an object)")
    header.pop("__metadata__", None)
    data = os.path.getsize(path) - 8 - size
    for name, meta in header.items():
        _check_entry(path, name, meta, data)
    return header


def _check_entry(path: str, name: str, meta: object, data: int) -> None:
    shape = meta.get("shape") if isinstance(meta, dict) else None
    offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
    dtype = meta.get("dtype") if isinstance(meta, dict) else None
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)):
        raise ValueError(f"{path} is not a valid safetensors file: the entry of {name} is "
                         f"{meta!r:.80}")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"{path}: {name} is {dtype!r}; LoRA weights must be one of "
                         f"{', '.join(_DTYPE_BYTES)}")
    begin, end = offsets
    if not 0 <= begin <= end <= data or end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
        raise ValueError(f"{path} is damaged: {name} should take bytes {begin}..{end} of "
                         f"{data} (cut short, or not a safetensors file)")


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` rule: a key (a regular expression) matches
    a module whose name ends with it at a dot."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter(path: str, model_dir: str, max_rank: int) -> AdapterSpec:
    """The adapter in folder ``path`` checked against the model in ``model_dir``; a
    ValueError naming what is wrong and what is accepted."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter folder {path!r} does not exist")
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter folder {path!r} has no adapter_config.json (a PEFT "
                         "adapter saved with save_pretrained is expected)")
    try:
        with open(config_path) as f:
            acfg = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"LoRA adapter {path!r}: unreadable adapter_config.json: {e}") from e
    if not isinstance(acfg, dict):
        raise ValueError(  # noqa: TRY004 (a bad file is a ValueError: STYLE.md)
            f"LoRA adapter {path!r}: adapter_config.json must hold a JSON object, got "
            f"{type(acfg).__name__}")
    with open(os.path.join(model_dir, "config.json")) as f:
        mcfg = json.load(f)
    _check_config(path, acfg)
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_file):
        found = [n for n in os.listdir(path) if n.startswith("adapter_model")]
        raise ValueError(f"LoRA adapter {path!r} has no adapter_model.safetensors"
                         + (f" (found {found}; save it with safe_serialization=True)"
                            if found else ""))
    header = _read_header(weights_file)
    expected = expected_shapes(mcfg)
    pairs: dict[str, dict[str, tuple[str, list[int]]]] = {}
    for name, meta in header.items():
        m = _WEIGHT.match(name)
        if m is None:
            what = ("a DoRA magnitude vector" if "lora_magnitude_vector" in name else
                    "an adapter on the embeddings" if "lora_embedding" in name else
                    "a trained bias" if name.endswith(".bias") else "an unknown tensor")
            raise ValueError(f"LoRA adapter {path!r}: {name} is {what}; cadence applies "
                             "lora_A/lora_B weights on the q/k/v/o and gate/up/down "
                             "projections only")
        pairs.setdefault(m.group(1), {})[m.group(2)] = (name, meta.get("shape", []))
    modules = []
    num_layers = mcfg["num_hidden_layers"]
    for module, ab in sorted(pairs.items()):
        m = _MODULE.match(module)
        if m is None or m.group(3) not in PROJECTIONS or _PARENT[m.group(3)] != m.group(2):
            raise ValueError(f"LoRA adapter {path!r} changes {module}; cadence applies "
                             f"adapters to the decoder layers' {', '.join(PROJECTIONS)}")
        layer, proj = int(m.group(1)), m.group(3)
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {path!r} changes layer {layer}; the model has "
                             f"{num_layers} layers")
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {path!r}: {module} has {sorted(ab)} but needs "
                             "both lora_A and lora_B")
        (a_name, a_shape), (b_name, b_shape) = ab["lora_A"], ab["lora_B"]
        out_f, in_f = expected[proj]
        rank = a_shape[0] if len(a_shape) == 2 else -1
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != in_f or \
                b_shape != [out_f, rank]:
            raise ValueError(f"LoRA adapter {path!r}: {module} has lora_A {a_shape} and "
                             f"lora_B {b_shape}; this model needs [r, {in_f}] and "
                             f"[{out_f}, r] (an adapter trained for another model?)")
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {path!r} has rank {rank} on {module}, above "
                             f"--max-lora-rank {max_rank}; raise it to serve this adapter")
        r = _pattern_value(acfg.get("rank_pattern"), module, acfg.get("r", rank))
        alpha = _pattern_value(acfg.get("alpha_pattern"), module, acfg.get("lora_alpha", r))
        scale = alpha / math.sqrt(r) if acfg.get("use_rslora") else alpha / r
        modules.append(ModuleAdapter(layer, proj, rank, float(scale), a_name, b_name))
    if not modules:
        raise ValueError(f"LoRA adapter {path!r} holds no lora_A/lora_B weights")
    return AdapterSpec(os.path.abspath(path), weights_file, tuple(modules))


def _check_config(path: str, acfg: dict) -> None:
    peft_type = acfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type is {peft_type!r}; only LORA "
                         "adapters are served")
    refused = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights",
               "modules_to_save": "modules_to_save (fully trained modules)",
               "lora_bias": "trained LoRA biases"}
    for key, what in refused.items():
        if acfg.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {key} is set; {what} are not "
                             "supported")
    if acfg.get("bias", "none") not in (None, "none"):
        raise ValueError(f"LoRA adapter {path!r}: bias={acfg['bias']!r}; only bias='none' "
                         "adapters are supported (trained biases are not applied)")
    for key in ("r", "lora_alpha"):
        value = acfg.get(key)
        if value is not None and not _positive(value):
            raise ValueError(f"LoRA adapter {path!r}: {key} must be a positive number, got "
                             f"{value!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = acfg.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict) or not all(
                isinstance(k, str) and _positive(v) for k, v in patterns.items()):
            raise ValueError(f"LoRA adapter {path!r}: {key} must map module names to "
                             f"positive numbers, got {patterns!r:.80}")
        for k in patterns:
            try:
                re.compile(k)
            except re.error as e:
                raise ValueError(f"LoRA adapter {path!r}: {key} key {k!r} is not a regular "
                                 f"expression: {e}") from None


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and value > 0
