"""Cold start on the built-in default model, in fresh processes (docs/performance.md).

    python scripts/cold_start.py cli [--runs 5]   # wall time of a one-shot
                                                  # `engine generate --prompt hi --max-tokens 8`
    python scripts/cold_start.py overlapped       # Python API: LLM() built, first 8-token answer
    python scripts/cold_start.py sequential       # the same, the worker waited for before the
                                                  # tokenizer loads (as cadence once started)

To compare two checkouts, run the same mode in each, alternately, several times, on an idle
machine, and compare the minimum and the range; the CLI mode runs whichever cadence
``python -c "import cadence"`` finds (set PYTHONPATH to choose).
"""

import resource
import subprocess
import sys
import time

CLI = ["generate", "--prompt", "hi", "--max-tokens", "8"]
USAGE = "usage: python scripts/cold_start.py cli [--runs N] | overlapped | sequential"


def _children_cpu_s() -> float:
    # Waited-for children and theirs: the engine process and its CPU worker.
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_cli(runs: int) -> None:
    walls, cpus = [], []
    for i in range(runs):
        t0, c0 = time.perf_counter(), _children_cpu_s()
        # `python -m cadence.cli.main` is what the `engine` script runs.
        done = subprocess.run([sys.executable, "-m", "cadence.cli.main", *CLI],
                              capture_output=True, text=True, check=False)
        walls.append(time.perf_counter() - t0)
        cpus.append(_children_cpu_s() - c0)
        if done.returncode != 0:
            sys.exit(f"engine {' '.join(CLI)} failed:\n{done.stderr}")
        print(f"run {i + 1}: wall {walls[-1]:.2f} s, cpu {cpus[-1]:.2f} s, output "
              f"{done.stdout.splitlines()[-1]!r}", flush=True)
    # CPU time (user + sys) moves much less than wall time when the machine is shared.
    print(f"RESULT cli wall min {min(walls):.2f} max {max(walls):.2f} "
          f"cpu min {min(cpus):.2f} max {max(cpus):.2f}")


def run_api(mode: str) -> None:
    t0 = time.perf_counter()
    # Imported after the clock starts: importing cadence is part of a cold start.
    from cadence import LLM, SamplingParams

    if mode == "sequential":
        from cadence.backends.cpu import backend as B
        lm = B.CpuBackend.load_model

        def waiting(self):
            lm(self)
            if self._worker is not None:
                self._worker.wait_ready()
        B.CpuBackend.load_model = waiting
    llm = LLM()
    t1 = time.perf_counter()
    llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    t2 = time.perf_counter()
    llm.shutdown()
    t3 = time.perf_counter()
    print(f"RESULT {mode} start {t1-t0:.2f} first {t2-t1:.2f} shutdown {t3-t2:.2f} "
          f"total {t3-t0:.2f}")


def main(argv: list[str]) -> None:
    if argv[:1] == ["cli"] and len(argv) in (1, 3):
        if len(argv) == 3 and (argv[1] != "--runs" or not argv[2].isdigit()
                               or int(argv[2]) < 1):
            sys.exit(USAGE)
        run_cli(int(argv[2]) if len(argv) == 3 else 5)
    elif argv in (["overlapped"], ["sequential"]):
        run_api(argv[0])
    else:
        sys.exit(USAGE)


if __name__ == "__main__":
    main(sys.argv[1:])
