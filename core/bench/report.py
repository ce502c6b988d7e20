"""Benchmark output: plain-text tables, the JSON file, the environment and machine records and
the PNG chart.

matplotlib is imported only when a chart is drawn (it is the ``bench`` extra).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str],
                 headers: Sequence[str] | None = None) -> str:
    """A left-aligned text table; floats get 3 significant decimals, missing cells '-'."""
    headers = list(headers or columns)

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> None:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False, default=str)
        f.write("\n")


def git_commit(start: str | os.PathLike | None = None) -> str | None:
    """The checked-out commit, read from .git files (no git process); None if unknown."""
    here = Path(start or Path(__file__).resolve().parent)
    for folder in (here, *here.parents):
        git = folder / ".git"
        if not git.is_dir():
            continue
        try:
            head = (git / "HEAD").read_text().strip()
            if not head.startswith("ref: "):
                return head
            ref = head[5:]
            ref_file = git / ref
            if ref_file.is_file():
                return ref_file.read_text().strip()
            packed = git / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
        except OSError:
            return None
        return None
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def env_info(engine: Any = None) -> dict[str, Any]:
    """Versions and machine facts recorded in every benchmark JSON; torch's from
    ``torch_facts``, so that the engine process is not made to load torch."""
    from cadence.cpuinfo import torch_facts

    facts = torch_facts()
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": facts["version"],
        "torch_num_threads": facts["num_threads"],
        "git_commit": git_commit(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if engine is not None:
        cfg = engine.config
        info["backend"] = cfg.backend
        info["dtype"] = cfg.model_config.dtype
        info["backend_options"] = dict(cfg.backend_options)
        try:
            info["backend_env"] = engine.backend.env_info()
        except Exception as e:  # noqa: BLE001  # env info must never fail a benchmark
            info["backend_env"] = {"error": repr(e)}
    from cadence.plugins import get_registry

    plugins_env: dict[str, str] = {}
    try:
        for part in get_registry().hook.cadence_env_info():
            plugins_env.update(part or {})
    except Exception as e:  # noqa: BLE001
        plugins_env["error"] = repr(e)
    info["plugins_env"] = plugins_env
    return info


def machine_info(engine: Any = None, ns: Any = None) -> dict[str, Any]:
    """The ``machine`` block of every bench JSON (``cadence.cpuinfo.describe``).

    ``threads`` is the engine's model thread count where its backend reports one
    (``cpu_threads`` of the CPU backend's runtime info: the worker's, after placement),
    else torch's default in a fresh process under this environment (``torch_facts``);
    ``dtype`` is the engine's resolved dtype, or, before an engine exists, the one its flags
    ``ns`` resolve to.
    """
    from cadence.cpuinfo import describe, torch_facts

    threads = torch_facts()["num_threads"]
    if engine is not None:
        reported = getattr(engine.backend, "runtime_info", None) or {}
        if str(reported.get("cpu_threads", "")).isdigit():
            threads = int(reported["cpu_threads"])
        dtype = engine.config.model_config.dtype
    elif ns is not None:
        dtype = resolved_dtype(ns)
    else:
        dtype = None
    return describe(threads, dtype)


def resolved_dtype(ns: Any) -> str:
    """The dtype an engine built from the CLI namespace ``ns`` will run in ("auto" resolved
    the way the engine resolves it, plugins included)."""
    from cadence.engine_args import EngineArgs

    args, extra = EngineArgs.from_cli_args(ns)
    return args.create_engine_config(extra).model_config.dtype


def machine_line(m: dict[str, Any]) -> str:
    """One line: CPU model, its vector flags, torch's capability, threads, dtype and the
    kernel's transparent huge page setting."""
    model = m.get("cpu_model") or "unknown CPU"
    if m.get("cpu_family") is not None:
        model += f" (family {m['cpu_family']} model {m.get('cpu_model_id')})"
    flags = " ".join(m.get("cpu_flags") or []) or "no vector flags"
    thp = m.get("transparent_hugepages")
    return (f"machine: {model} | {flags} | torch capability {m.get('torch_cpu_capability')} "
            f"| {m.get('threads') or '?'} threads | dtype {m.get('dtype')}"
            + (f" | THP {thp}" if thp else ""))


def draw_chart(runs: Sequence[dict[str, Any]], path: str | os.PathLike,
               title: str = "cadence throughput") -> None:
    """Output tokens/s against batch size, one line per run name (and host-work setting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    host_works = {r.get("host_work") for r in runs}
    for r in runs:
        if r.get("output_tokens_per_s") is None:
            continue
        label = r["name"] if len(host_works) <= 1 else f"{r['name']} ({r.get('host_work')})"
        series.setdefault(label, []).append((r["batch_size"], r["output_tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in series.items():
        pts.sort()
        style = "--" if label.startswith("floor") else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
    batch_sizes = sorted({r["batch_size"] for r in runs})
    if len(batch_sizes) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(batch_sizes)
    ax.set_xticklabels([str(b) for b in batch_sizes])
    ax.set_xlabel("batch size (max concurrent requests)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
