"""Cold start of the Python API on the built-in default model: time to build ``LLM()`` and
to answer a first 8-token request, in a fresh interpreter.

    python scripts/cold_start.py overlapped   # as cadence starts: tokenizer beside the worker
    python scripts/cold_start.py sequential   # the worker waited for first, as before

Run the two alternately, several times each, and compare (docs/performance.md).
"""

import sys
import time

if sys.argv[1:] not in (["overlapped"], ["sequential"]):
    sys.exit("usage: python scripts/cold_start.py overlapped|sequential")
t0 = time.perf_counter()
# Imported after the clock starts: importing cadence is part of a cold start.
from cadence import LLM, SamplingParams  # noqa: E402

if sys.argv[1] == "sequential":
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
print(f"RESULT {sys.argv[1]} start {t1-t0:.2f} first {t2-t1:.2f} total {t2-t0:.2f}")
