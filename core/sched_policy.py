"""Scheduling policies and the waiting queue they order. No torch here.

A policy is a key function: lower keys are admitted first and preempted last. The scheduler
never branches on the policy; it only compares keys.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cadence.request import Request


class SchedulingPolicy(Protocol):
    """Orders requests: the smallest key is served first, the largest is preempted first."""

    name: str

    def key(self, request: Request) -> tuple[int, ...]: ...


class FCFSPolicy:
    """First come, first served: by the engine-assigned arrival sequence number."""

    name = "fcfs"

    def key(self, request: Request) -> tuple[int, ...]:
        return (request.arrival_seq,)


class PriorityPolicy:
    """By ``priority`` (lower value is more important, as in vLLM), then by arrival."""

    name = "priority"

    def key(self, request: Request) -> tuple[int, ...]:
        return (request.priority, request.arrival_seq)


_POLICIES: dict[str, type[FCFSPolicy | PriorityPolicy]] = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(_POLICIES)}, got {name!r}") from None


class WaitingQueue:
    """Requests waiting for admission, in policy order.

    A heap: push and pop are O(log n), peek O(1), so a long queue costs nothing per step
    beyond the requests the scheduler actually looks at. Removal (abort) is lazy: the entry
    is marked dead and skipped when it reaches the top.
    """

    def __init__(self, policy: SchedulingPolicy):
        self._policy = policy
        # Entries are [key, tie-breaker, request or None]; the unique tie-breaker keeps
        # heapq from ever comparing two requests.
        self._heap: list[list] = []
        self._entries: dict[str, list] = {}
        self._counter = itertools.count()
        self.num_peeks = 0  # how many times the scheduler looked at the head (for tests)

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def push(self, request: Request) -> None:
        entry = [self._policy.key(request), next(self._counter), request]
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def _top(self) -> Request:
        while self._heap[0][2] is None:
            heapq.heappop(self._heap)
        return self._heap[0][2]

    def peek(self) -> Request:
        """The next request to admit; the queue must not be empty."""
        self.num_peeks += 1
        return self._top()

    def pop(self) -> Request:
        request = self._top()
        heapq.heappop(self._heap)
        del self._entries[request.request_id]
        return request

    def requests(self) -> list[Request]:
        """The waiting requests, in no particular order."""
        return [entry[2] for entry in self._entries.values()]

    def remove(self, request_id: str) -> Request | None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        request, entry[2] = entry[2], None
        return request
