"""Data-parallel serving: several engine replicas of one model behind one front.

``engine serve --data-parallel-size N`` builds N engines, each with its own backend (on the
CPU, its own worker process bound to its own cores), and routes every request to the
least-loaded replica. See docs/distributed.md.
"""

from cadence.data_parallel.replicas import DataParallelAsyncLLM, pick_replica

__all__ = ["DataParallelAsyncLLM", "pick_replica"]
