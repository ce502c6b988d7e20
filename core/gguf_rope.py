"""The RoPE scaling a GGUF file records, as the ``rope_parameters`` of an HF config.

transformers' GGUF loader leaves it out for the llama, qwen2 and qwen3 architectures, so a
converted folder would run a Llama 3.x or a long-context Qwen with plain RoPE: wrong
rotary frequencies at every position, with no error. llama.cpp's converter records it in
two ways:

- Llama 3's scaling as a ``rope_freqs.weight`` tensor: one divisor per rotary frequency,
  computed from (factor, low_freq_factor, high_freq_factor, original context). The four
  numbers are not stored; they are read back from the divisors (only two combinations of
  them shape the curve, so low_freq_factor is taken as 1, as every Llama 3.x has it) and
  checked by recomputing the divisors as transformers computes its frequencies.
- linear and yarn scaling as ``<arch>.rope.scaling.*`` metadata.

Anything else (another scaling type, a yarn setting transformers has no field for,
divisors no Llama 3 scaling gives) is refused by name: a model that runs with the wrong
positions is worse than one that does not load. No torch here.
"""

from __future__ import annotations

import math
from typing import Any

_YARN_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}
# Read elsewhere or describing the file, not the scaling.
_KNOWN_KEYS = {"type", "factor", "original_context_length", "finetuned", *_YARN_KEYS}


def gguf_rope_parameters(reader: Any, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The ``rope_parameters`` the file's scaling needs (with ``rope_theta``), or None for
    plain RoPE; a ValueError for a scaling cadence cannot reproduce."""
    arch = _field(reader, "general.architecture")
    prefix = f"{arch}.rope.scaling."
    meta = {k[len(prefix):]: _field(reader, k) for k in reader.fields if k.startswith(prefix)}
    kind = meta.get("type", "none")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        if kind not in ("none", "llama3"):
            raise ValueError(f"the GGUF has both rope_freqs and {kind!r} RoPE scaling")
        divisors = [float(x) for x in freqs.data.reshape(-1)]
        return _llama3(divisors, theta, head_dim, meta.get("original_context_length"))
    if kind == "none":
        return None
    unknown = sorted(set(meta) - _KNOWN_KEYS)
    if kind not in ("linear", "yarn") or unknown:
        what = f"RoPE scaling {kind!r}" if kind not in ("linear", "yarn") else \
            f"the {kind} RoPE settings {', '.join(prefix + k for k in unknown)}"
        raise ValueError(f"the GGUF records {what}, which cadence does not convert (it reads "
                         "linear and yarn scaling, and Llama 3's rope_freqs); running it "
                         "with plain RoPE would put every position wrong")
    factor = meta.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"the GGUF's {kind} RoPE scaling has no valid "
                         f"{prefix}factor ({factor!r})")
    params: dict[str, Any] = {"rope_type": kind, "rope_theta": theta, "factor": float(factor)}
    if kind == "yarn":
        orig = meta.get("original_context_length")
        if orig:
            params["original_max_position_embeddings"] = int(orig)
        params.update({hf: float(meta[k]) for k, hf in _YARN_KEYS.items() if k in meta})
    return params


def _field(reader: Any, key: str) -> Any:
    f = reader.fields[key]
    if hasattr(f, "contents"):
        value = f.contents()
    else:  # gguf before ``contents()`` (0.10 has none): a scalar or a string, last part
        part = f.parts[f.data[0]]
        value = bytes(part) if f.types and f.types[0].name == "STRING" else part[0].item()
    return value.decode() if isinstance(value, bytes) else value


def llama3_divisors(theta: float, head_dim: int, factor: float, low: float, high: float,
                    orig: float) -> list[float]:
    """Each rotary frequency's divisor under Llama 3's scaling, as transformers computes
    the frequencies (and llama.cpp's converter the ``rope_freqs`` tensor)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


def _llama3(divisors: list[float], theta: float, head_dim: int, orig_hint: Any
            ) -> dict[str, Any] | None:
    if len(divisors) != head_dim // 2:
        raise ValueError(f"the GGUF's rope_freqs has {len(divisors)} values, not one per "
                         f"rotary frequency ({head_dim // 2})")
    factor = _snap(max(divisors), 4)
    if all(abs(d - 1.0) < 1e-6 for d in divisors):
        return None
    wavelens = [2 * math.pi * theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    for orig, high in _llama3_candidates(divisors, wavelens, factor, orig_hint):
        want = llama3_divisors(theta, head_dim, factor, 1.0, high, orig)
        if all(abs(w - d) <= 1e-4 * d for w, d in zip(want, divisors, strict=True)):
            return {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                    "low_freq_factor": 1.0, "high_freq_factor": high,
                    "original_max_position_embeddings": int(orig)
                    if float(orig).is_integer() else orig}
    raise ValueError("the GGUF's rope_freqs tensor is not Llama 3's RoPE scaling (no "
                     "factor, frequency bounds and original context give its values); "
                     "cadence cannot run it with the positions it was trained with")


def _snap(x: float, digits: int) -> float:
    """``x`` rounded to ``digits`` decimals where that moves it by less than 1e-5 of
    itself: the numbers a config names (8, 4.0, 8192) out of float32 divisors."""
    r = round(x, digits)
    return float(r) if abs(r - x) < 1e-5 * abs(x) else x


def _llama3_candidates(divisors: list[float], wavelens: list[float], factor: float,
                       orig_hint: Any) -> list[tuple[float, float]]:
    """(original context, high_freq_factor) pairs to try, low_freq_factor being 1.

    Between the two bounds the divisor's inverse is linear in 1 / wavelength: with
    s = (1/d - 1/factor) / (1 - 1/factor), s = orig / ((high - 1) * wavelen) - 1 / (high - 1),
    so two frequencies there fix both numbers. With fewer, the bounds only bracket the
    original context: Llama 3's high_freq_factor 4 and any context inside them (the
    file's own, where it records one) give the same divisors."""
    smooth = [(1.0 / w, (1.0 / d - 1.0 / factor) / (1.0 - 1.0 / factor))
              for w, d in zip(wavelens, divisors, strict=True)
              if 1.0 + 1e-6 < d < factor * (1.0 - 1e-6)]
    out: list[tuple[float, float]] = []
    if len(smooth) >= 2:
        n = len(smooth)
        mx = sum(x for x, _ in smooth) / n
        my = sum(y for _, y in smooth) / n
        var = sum((x - mx) ** 2 for x, _ in smooth)
        slope = sum((x - mx) * (y - my) for x, y in smooth) / var if var else 0.0
        intercept = my - slope * mx
        if intercept < 0 and slope > 0:
            span = -1.0 / intercept  # high - low
            orig = slope * span
            out.append((_snap(orig, 0), _snap(1.0 + span, 3)))
    if len(smooth) == 1:
        (inv_wl, s), = smooth
        out.append(((3.0 * s + 1.0) / inv_wl, 4.0))
    ones = [w for w, d in zip(wavelens, divisors, strict=True) if abs(d - 1.0) < 1e-6]
    full = [w for w, d in zip(wavelens, divisors, strict=True) if abs(d - factor) < 1e-6 * factor]
    low_bound = 4.0 * max(ones, default=0.0)
    high_bound = min(full, default=math.inf)
    if isinstance(orig_hint, (int, float)) and orig_hint > 0:
        out.append((float(orig_hint), 4.0))
    if low_bound < high_bound:
        for orig in (8192.0, *(2.0 ** k for k in range(8, 21))):
            if low_bound < orig < high_bound:
                out.append((orig, 4.0))
                break
        else:
            mid = math.sqrt(max(low_bound, 1.0) * high_bound) if high_bound < math.inf \
                else 2 * low_bound
            out.append((mid, 4.0))
    return out
