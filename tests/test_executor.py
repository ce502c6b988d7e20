"""The executors (core/executor/): a rank that cannot start says which and why. TP=2 on
``mp`` against one process, and a rank lost mid-run: tests/test_tensor_parallel.py, on its
shared engines (each start of a group costs seconds)."""

from __future__ import annotations

import pytest
from engine_helpers import make_llm


def test_a_rank_that_cannot_start_says_which_and_why(tiny_model_dir):
    with pytest.raises(ValueError, match=r"rank \d of 2: cpu linear must be one of"):
        make_llm(tiny_model_dir("llama"), tensor_parallel_size=2,
                 backend_options={"overlap": "sync", "linear": "bogus"})


def test_a_rank_that_cannot_join_the_group_says_which_and_why():
    """Nobody listens at the rendezvous address: the rank gives up after its timeout."""
    from cadence import distributed
    from cadence.executor.multiproc import _free_port

    address = f"tcp://127.0.0.1:{_free_port()}"
    with pytest.raises(RuntimeError, match=rf"rank 1 of 2 could not join the gloo group at "
                                           rf"{address}: \w+"):
        distributed.init_torch_distributed("gloo", 1, 2, address, timeout_s=0.5)
    assert distributed.tp_size() == 1  # nothing half-installed
