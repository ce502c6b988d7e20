"""The executors (core/executor/): a rank that cannot start says which and why. TP=2 on
``mp`` against one process, and a rank lost mid-run: tests/test_tensor_parallel.py, on its
shared engines (each start of a group costs seconds)."""

from __future__ import annotations

import pytest
from engine_helpers import make_llm


def test_a_rank_that_cannot_start_says_which_and_why(tiny_model_dir):
    with pytest.raises(ValueError, match=r"rank \d of 2: cpu attention must be one of"):
        make_llm(tiny_model_dir("llama"), tensor_parallel_size=2,
                 backend_options={"overlap": "sync", "attention": "bogus"})
