"""``engine bench compare --peer vllm``: another engine on the same prompts, in its own
virtualenv, alternating with cadence's async run.

The peer runs as a subprocess of ``--peer-python`` executing a standalone script of this
package (``peer_vllm.py``, which imports only the standard library and vLLM) by path. The
workload (prompt token ids, output lengths, sampling settings, a warm-up prompt) goes to it
in a JSON file; it answers with a JSON file of its figures. Rounds alternate: cadence, then
each peer config, N times, so that drift of the machine (heat, neighbours) hits both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cadence.bench.report import format_table
from cadence.bench.throughput import WARMUP_TOKENS, warmup_prompt

PEERS = ("vllm",)
PEER_CONFIGS = ("eager", "default")
SCRIPTS = {"vllm": Path(__file__).resolve().with_name("peer_vllm.py")}
TAIL_LINES = 25


class PeerError(RuntimeError):
    """A peer run failed: the message names the peer python and ends with its last output."""


@dataclass(frozen=True, slots=True)
class PeerOptions:
    name: str
    python: str
    rounds: int
    configs: tuple[str, ...]


def peer_options(ns: argparse.Namespace) -> PeerOptions | None:
    """The validated ``--peer*`` flags, or None without ``--peer``."""
    name = getattr(ns, "peer", None)
    if name is None:
        if getattr(ns, "peer_python", None):
            raise ValueError(f"--peer-python is only used with --peer (choices: {PEERS})")
        return None
    if name not in PEERS:
        raise ValueError(f"--peer must be one of {PEERS}, got {name!r}")
    if not ns.peer_python:
        raise ValueError(f"--peer {name} needs --peer-python PATH: the python executable of "
                         f"the virtualenv the peer is installed in (docs/benchmarks.md)")
    if ns.peer_rounds < 1:
        raise ValueError(f"--peer-rounds must be >= 1, got {ns.peer_rounds}")
    configs = tuple(dict.fromkeys(c.strip() for c in ns.peer_configs.split(",") if c.strip()))
    bad = [c for c in configs if c not in PEER_CONFIGS]
    if bad or not configs:
        raise ValueError(f"--peer-configs must be a comma list of {PEER_CONFIGS}, "
                         f"got {ns.peer_configs!r}")
    return PeerOptions(name, ns.peer_python, ns.peer_rounds, configs)


def peer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The peer's environment: vLLM's CPU engine on every core (OpenMP threads bound to
    cores 0..n-1, none reserved) with a 4 GiB KV cache, unless the user set these."""
    env = dict(os.environ if base is None else base)
    n = os.cpu_count() or 1
    for key, value in (("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}"),
                       ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"), ("OMP_NUM_THREADS", str(n)),
                       ("VLLM_CPU_KVCACHE_SPACE", "4")):
        env.setdefault(key, value)
    return env


PEER_ENV_KEYS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS",
                 "VLLM_CPU_KVCACHE_SPACE")


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").rstrip()
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _call(opts: PeerOptions, args: list[str], workdir: Path, tag: str,
          result: Path | None = None) -> Path:
    """Run the peer script with ``args``; its stdout and stderr go to files in ``workdir``.
    Returns the stdout file; raises PeerError when it cannot start or exits non-zero,
    unless it wrote ``result`` first (see below)."""
    cmd = [opts.python, str(SCRIPTS[opts.name]), *args]
    out, err = workdir / f"{tag}.stdout", workdir / f"{tag}.stderr"
    with open(out, "w") as fo, open(err, "w") as fe:
        try:
            rc = subprocess.run(cmd, stdout=fo, stderr=fe, env=peer_env(),
                                check=False).returncode
        except OSError as e:
            raise PeerError(f"cannot run the peer python {opts.python!r} (--peer-python): "
                            f"{e}") from None
    if rc != 0 and result is not None and result.is_file() and result.stat().st_size:
        # vLLM's CPU build at times aborts in interpreter teardown after the measured work
        # is done and written ("terminate called without an active exception", -6).
        print(f"peer: the {opts.name} run ({tag}) exited with {rc} after writing its result; "
              "the result is used", file=sys.stderr, flush=True)
        return out
    if rc != 0:
        tail = _tail(err) or _tail(out)
        raise PeerError(f"the {opts.name} peer run ({tag}) with {opts.python} exited with "
                        f"{rc}; its output is in {workdir}; last lines of its stderr:\n{tail}")
    return out


def check_peer(opts: PeerOptions, workdir: Path) -> str:
    """Fail early (before any measured run) when the peer cannot import; returns its version."""
    out = _call(opts, ["--check"], workdir, "check")
    try:
        return json.loads(out.read_text().strip().splitlines()[-1])["vllm_version"]
    except (IndexError, KeyError, ValueError):
        raise PeerError(f"the peer python {opts.python} answered --check with "
                        f"{_tail(out)!r}, not the version JSON") from None


def write_peer_input(path: Path, workload: Any, prompts: list[list[int]], out_lens: list[int],
                     batch_size: int, tokenizer: str | None) -> None:
    """The workload file the peer script reads: the same token ids and lengths as cadence's."""
    from cadence.bench.throughput import HEAVY_LOGPROBS, HEAVY_STOP

    heavy = workload.host_work == "heavy"
    data = {"prompts": prompts, "max_tokens": out_lens, "temperature": workload.temperature,
            "top_p": 1.0, "stop": HEAVY_STOP if heavy else None,
            "logprobs": HEAVY_LOGPROBS if heavy else None, "detokenize": workload.detokenize,
            "seed": 0, "max_num_seqs": batch_size, "tokenizer": tokenizer,
            "warmup_prompt": warmup_prompt(prompts[0]), "warmup_tokens": WARMUP_TOKENS}
    path.write_text(json.dumps(data))


def run_peer(opts: PeerOptions, config: str, round_: int, input_path: Path, model: str,
             dtype: str, workdir: Path, task: str = "generate") -> dict[str, Any]:
    tag = f"{opts.name}-{task}-{config}-round{round_}"
    result = workdir / f"{tag}.json"
    print(f"peer: {opts.name} {config}, round {round_} of {opts.rounds}", file=sys.stderr,
          flush=True)
    _call(opts, ["--input", str(input_path), "--output", str(result), "--config", config,
                 "--dtype", dtype, "--model", model, "--task", task], workdir, tag, result)
    try:
        return json.loads(result.read_text())
    except (OSError, ValueError) as e:
        raise PeerError(f"the {opts.name} peer run ({tag}) with {opts.python} wrote no "
                        f"readable result ({e})") from None


def compare_with_peer(opts: PeerOptions, version: str, cadence_run: Callable[[int], dict],
                      workload: Any, prompts: list[list[int]], batch_size: int, model: str,
                      tokenizer: str | None, workdir: Path) -> dict[str, Any]:
    """``opts.rounds`` rounds of: ``cadence_run(round)`` (a run record with ``dtype``), then
    each peer config on the same workload in cadence's dtype. Returns the ``peer`` section."""
    out_lens = workload.output_lens()
    input_path = workdir / "workload.json"
    write_peer_input(input_path, workload, prompts, out_lens, batch_size, tokenizer)
    expected = sum(out_lens)
    runs: list[dict[str, Any]] = []
    for rnd in range(1, opts.rounds + 1):
        rec = cadence_run(rnd)
        runs.append({"order": len(runs) + 1, "round": rnd, "engine": "cadence",
                     "config": "async", "output_tokens": rec["num_output_tokens"],
                     "elapsed_s": rec["elapsed_s"],
                     "output_tokens_per_s": rec["output_tokens_per_s"], "dtype": rec["dtype"]})
        for config in opts.configs:
            res = run_peer(opts, config, rnd, input_path, model, rec["dtype"], workdir)
            if res.get("output_tokens") != expected:
                raise PeerError(f"the {opts.name} {config} run generated "
                                f"{res.get('output_tokens')} tokens, expected {expected}")
            runs.append({"order": len(runs) + 1, "round": rnd, "engine": opts.name,
                         "config": config, "output_tokens": res["output_tokens"],
                         "elapsed_s": res["elapsed_s"],
                         "output_tokens_per_s": res["output_tokens_per_s"],
                         "dtype": res.get("dtype"), "version": res.get("vllm_version")})
    section = summarize(runs, opts.configs)
    return {"name": opts.name, "python": opts.python, "version": version,
            "rounds": opts.rounds, "configs": list(opts.configs), "batch_size": batch_size,
            "host_work": workload.host_work,
            "env": {k: peer_env()[k] for k in PEER_ENV_KEYS}, **section}


def async_rounds_with_peer(ns: argparse.Namespace, opts: PeerOptions, version: str,
                           workload: Any, bs: int, prompts: list[list[int]], model: str,
                           on_engine: Callable[[Any], None]
                           ) -> tuple[list[dict], dict[str, Any]]:
    """cadence's async run in ``opts.rounds`` rounds alternating with the peer's configs.
    Each round builds a fresh engine (``on_engine`` sees it first), warms it up as the peer
    is warmed up (one prompt, a few tokens), runs it and releases it, so that the peer has
    the machine to itself. Returns the async run records and the ``peer`` section."""
    from cadence.bench.throughput import build_engine, release_engine, run_engine, warm_up

    records: list[dict] = []

    def cadence_run(rnd: int) -> dict:
        engine = build_engine(ns, max_num_seqs=bs)
        try:
            on_engine(engine)
            warm_up(engine, workload, prompts, 1)
            rec = run_engine(engine, workload, prompts, workload.output_lens(), ns.breakdown,
                             not ns.disable_tqdm, "async")
            rec.update(round=rnd, dtype=engine.config.model_config.dtype)
        finally:
            release_engine(engine)
        records.append(rec)
        return rec

    with PeerWorkdir() as workdir:
        section = compare_with_peer(opts, version, cadence_run, workload, prompts, bs, model,
                                    ns.tokenizer, workdir)
    return records, section


def summarize(runs: list[dict[str, Any]], configs: tuple[str, ...]) -> dict[str, Any]:
    """Medians per side, the faster peer config and cadence's ratio to it."""
    def median(engine_is_cadence: bool, config: str | None = None) -> float:
        return statistics.median(r["output_tokens_per_s"] for r in runs
                                 if (r["engine"] == "cadence") == engine_is_cadence
                                 and (config is None or r["config"] == config))

    cadence = median(True)
    peers = {c: median(False, c) for c in configs}
    best = max(peers, key=peers.__getitem__)
    return {"runs": runs, "cadence_median_tokens_per_s": cadence,
            "peer_median_tokens_per_s": peers, "best_peer_config": best,
            "best_peer_median_tokens_per_s": peers[best],
            "ratio_vs_best_peer": cadence / peers[best]}


def print_peer(section: dict[str, Any]) -> None:
    name, configs = section["name"], section["configs"]
    cols = ["cadence async", *(f"{name} {c}" for c in configs)]
    rows: list[dict[str, Any]] = []
    for r in section["runs"]:
        if r["round"] > len(rows):
            rows.append({"round": r["round"]})
        key = "cadence async" if r["engine"] == "cadence" else f"{name} {r['config']}"
        rows[r["round"] - 1][key] = r["output_tokens_per_s"]
    rows.append({"round": "median", "cadence async": section["cadence_median_tokens_per_s"],
                 **{f"{name} {c}": v for c, v in section["peer_median_tokens_per_s"].items()}})
    print(f"\noutput tok/s, cadence against {name} {section['version']} "
          f"(batch {section['batch_size']}, {section['host_work']} host work, "
          f"runs in table order):")
    print(format_table(rows, ["round", *cols]))
    best = section["best_peer_config"]
    print(f"cadence async / {name} {best}: {section['ratio_vs_best_peer']:.3f}x "
          f"(medians {section['cadence_median_tokens_per_s']:.1f} vs "
          f"{section['best_peer_median_tokens_per_s']:.1f} output tok/s)")
    peers = section["peer_median_tokens_per_s"]
    if len(peers) > 1:
        slower = ", ".join(f"{name} {c} ({v:.1f})" for c, v in peers.items() if c != best)
        print(f"faster peer config: {name} {best} ({peers[best]:.1f} output tok/s) "
              f"over {slower}")


class PeerWorkdir:
    """A temporary folder for the workload and the peer's output: removed after success,
    kept (its path is in the error) when a peer run fails."""

    def __init__(self, parent: str | os.PathLike | None = None) -> None:
        self.parent = parent

    def __enter__(self) -> Path:
        self.path = Path(tempfile.mkdtemp(prefix="cadence-peer-", dir=self.parent))
        return self.path

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None or not issubclass(exc_type, PeerError):
            shutil.rmtree(self.path, ignore_errors=True)
