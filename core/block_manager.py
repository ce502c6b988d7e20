"""Paged KV-cache blocks with ref counts and prefix caching. No torch here.

A request's KV cache lives in fixed-size physical blocks listed by its block table. Full,
computed blocks are named in the prefix cache (core/prefix_cache.py), so a later request with
the same prefix takes a reference on them instead of computing them again; a freed block keeps
its name in the free pool until it is handed out again.

NOTE sliding windows: when every layer attends to a window of at most W tokens, a query at
position p never reads keys before p - W + 1, so once a request has computed c tokens the
blocks wholly before c - W + 1 are dead for it. ``free_out_of_window`` gives them back and
leaves ``FREED_BLOCK`` in their table entries, so a position still maps to its entry. It runs
inside ``cache_full_blocks``, after a step's results are in: the step that read those blocks
has finished, and every later step of the request (one may be in flight under async
scheduling) queries later positions, so it reads from later keys. A freed block handed to
another request is written by a later step, never alongside one that could read it. A freed
block keeps its prefix-cache identity in the free pool until it is handed out again, as any
freed block does; a later request can hit it only through the whole chain
of blocks before it (vLLM can serve a hit whose blocks before the window were evicted; cadence
recomputes from the first evicted block). With some layers full, nothing is freed: the cache
is shared by all layers.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

from cadence.prefix_cache import Chain, KVBlock, PrefixCache

if TYPE_CHECKING:
    from cadence.request import Request

# Table entry of a block freed behind a sliding window: a valid id, so a kernel that gathers
# whole tables and masks stays in bounds; the request no longer holds that block.
FREED_BLOCK = 0


class BlockManager:
    """Owns the physical KV blocks: block tables per request, ref counts, the prefix cache.

    Free blocks sit in one eviction-ordered pool: blocks holding nothing reusable come first,
    then cached blocks, least recently freed first. A cached block in the pool stays findable
    until it is handed out again, which evicts it. Predicates (``can_allocate``) are kept apart
    from mutators (``allocate``) so the scheduler can decide before it changes anything.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Every layer's window (the largest), or None: see the module NOTE.
        self.sliding_window = sliding_window
        # Prefix-cache metrics, in tokens (vLLM's hit rate is hits / queries); they count
        # over the engine's life, across resets.
        self.num_cached_hits = 0
        self.num_cached_queries = 0
        self.reset(num_blocks)

    def reset(self, num_blocks: int) -> None:
        """Start over with ``num_blocks`` empty blocks: no tables, nothing cached.

        For a KV cache whose contents are gone (a restarted worker); the caller has freed
        every request first, since a table that survived would name blocks that hold nothing.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # Blocks come into being when first handed out: ids from ``_fresh`` on were never
        # used, hold nothing and are free. A cache of small blocks for a small model has
        # millions of them, and building them all up front took seconds of every start.
        self._blocks: dict[int, KVBlock] = {}
        self._fresh = 0
        # Blocks used before and free now, eviction-ordered: empty ones first, then cached
        # ones, least recently freed first. The never-used ones come between the two.
        self._free: OrderedDict[int, None] = OrderedDict()
        self._cache = PrefixCache()
        self._tables: dict[str, list[int]] = {}
        self._chains: dict[str, Chain] = {}
        # Leading table entries freed behind the window, per request (FREED_BLOCK entries).
        self._num_freed: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, evictable cached blocks included."""
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cache)

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's block table (the live list: read it, do not mutate it). Entries of
        blocks freed behind a sliding window read ``FREED_BLOCK``."""
        return self._tables.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks the request holds while computing ``num_new_tokens`` more."""
        total = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        return total - self._num_dead(request.num_computed_tokens)

    def holds(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the table already covers ``num_new_tokens`` more tokens (nothing to
        allocate): the per-step check of a running decode, kept to one lookup."""
        table = self._tables.get(request.request_id)
        return table is not None and \
            request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size

    def _num_missing(self, request: Request, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(self._tables.get(request.request_id, ())))

    def can_allocate(self, request: Request, num_new_tokens: int, num_also_free: int = 0
                     ) -> bool:
        """Whether the table can grow by ``num_new_tokens``, with ``num_also_free`` more
        blocks than the pool holds now (blocks about to be freed)."""
        return self._num_missing(request, num_new_tokens) <= self.num_free_blocks + num_also_free

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow the table to hold ``num_computed_tokens + num_new_tokens`` tokens."""
        missing = self._num_missing(request, num_new_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(
                f"allocate({request.request_id!r}) needs {missing} blocks, "
                f"{self.num_free_blocks} free; call can_allocate first"
            )
        table = self._tables.setdefault(request.request_id, [])
        for _ in range(missing):
            table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        head = next(iter(self._free), None)
        if self._fresh < self.num_blocks and (
                head is None or self._blocks[head].block_hash is not None):
            # Before any cached block: a never-used one.
            block_id, self._fresh = self._fresh, self._fresh + 1
            self._blocks[block_id] = KVBlock(block_id, ref_count=1)
            return block_id
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.block_hash is not None:
            self._cache.forget(block)  # evicted: the block is about to hold other tokens
        block.ref_count = 1
        return block_id

    def get_computed_blocks(self, request: Request) -> int:
        """Share the longest cached prefix of full blocks; return the number of cached tokens.

        At least one token is always left to compute, so the step that finishes the prompt
        produces logits to sample from. A request that still needs its prompt logprobs takes
        no hits: a cached token has no logits; nor does one whose pooling reads every row.
        """
        assert not self._tables.get(request.request_id), "lookup on a request holding blocks"
        if not self.enable_prefix_caching or request.skips_prefix_cache:
            return 0
        bs = self.block_size
        num_tokens = request.num_tokens
        chain = self._new_chain(request)
        hits: list[KVBlock] = []
        for i in range((num_tokens - 1) // bs):
            block = self._cache.hit(chain, tuple(request.token_slice(i * bs, (i + 1) * bs)))
            if block is None:
                break
            hits.append(block)
        table = self._tables.setdefault(request.request_id, [])
        # Hits wholly behind the window of the first token to compute are not taken.
        num_dead = min(self._num_dead(len(hits) * bs), len(hits))
        table.extend([FREED_BLOCK] * num_dead)
        if num_dead:
            self._num_freed[request.request_id] = num_dead
        for block in hits[num_dead:]:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1
            table.append(block.block_id)
        self._chains[request.request_id] = chain
        self.num_cached_queries += num_tokens
        self.num_cached_hits += len(hits) * bs
        return len(hits) * bs

    def cache_full_blocks(self, request: Request, num_done: int | None = None) -> None:
        """Register the request's blocks that became full and computed since the last call,
        then free those that fell behind a sliding window (``free_out_of_window``).

        Call once the step that computed ``request.num_computed_tokens`` has finished and
        before a later step is counted in it, as every engine loop does after a commit.
        ``num_done``: the tokens actually computed when ``num_computed_tokens`` already
        counts later chunks still in flight (pipeline parallel): blocks those write are
        neither registered nor freed yet.
        """
        done = request.num_computed_tokens if num_done is None else num_done
        self._register_full_blocks(request, done)
        self.free_out_of_window(request, done)

    def _register_full_blocks(self, request: Request, num_done: int) -> None:
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if not table:
            return
        chain = self._chains.get(request.request_id)
        if chain is None:
            chain = self._chains[request.request_id] = self._new_chain(request)
        if chain.is_broken:
            return
        bs = self.block_size
        num_full = min(num_done // bs, len(table))
        for i in range(chain.num_blocks, num_full):
            token_ids = tuple(request.token_slice(i * bs, (i + 1) * bs))
            displaced = self._cache.register(chain, self._blocks[table[i]], token_ids)
            if chain.is_broken:
                return
            if displaced is not None and displaced.ref_count == 0:
                # Holds nothing reusable now: handed out before any cached block.
                self._free.move_to_end(displaced.block_id, last=False)

    def _new_chain(self, request: Request) -> Chain:
        return self._cache.new_chain(getattr(request, "cache_namespace", 0))

    def _num_dead(self, num_computed_tokens: int) -> int:
        """Blocks wholly before the first key a query at ``num_computed_tokens`` sees."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens + 1 - self.sliding_window) // self.block_size

    def free_out_of_window(self, request: Request, num_done: int | None = None) -> None:
        """Free the request's blocks that fell behind every layer's window (module NOTE);
        ``cache_full_blocks`` calls it once the blocks are registered."""
        table = self._tables.get(request.request_id)
        if self.sliding_window is None or not table:
            return
        done = self._num_freed.get(request.request_id, 0)
        computed = request.num_computed_tokens if num_done is None else num_done
        num_dead = min(self._num_dead(computed), len(table))
        if num_dead <= done:
            return
        for i in range(done, num_dead):
            self._release(table[i])
            table[i] = FREED_BLOCK
        self._num_freed[request.request_id] = num_dead

    def num_freeable_behind_window(self, requests: list[Request]) -> int:
        """Blocks that ``free_out_of_window`` would return to the pool now for ``requests``:
        those behind each one's window at its ``num_computed_tokens`` that it still holds,
        counting a shared block only when every reference to it goes."""
        if self.sliding_window is None:
            return 0
        dying: Counter[int] = Counter()
        for request in requests:
            table = self._tables.get(request.request_id)
            if not table:
                continue
            done = self._num_freed.get(request.request_id, 0)
            dying.update(table[done:min(self._num_dead(request.num_computed_tokens), len(table))])
        return sum(1 for b, n in dying.items() if self._blocks[b].ref_count == n)

    def free(self, request: Request) -> None:
        """Drop the request's references; idempotent."""
        self._chains.pop(request.request_id, None)
        num_freed = self._num_freed.pop(request.request_id, 0)
        table = self._tables.pop(request.request_id, None)
        if not table:
            return
        # Reverse order: a request's tail blocks are the least likely to be shared, so they
        # are freed (and later evicted) first.
        for block_id in reversed(table[num_freed:]):
            self._release(block_id)

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                # Holds nothing reusable: hand it out before any cached block.
                self._free.move_to_end(block_id, last=False)

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (for tests; O(num_blocks))."""
        refs: Counter[int] = Counter()
        for request_id, full_table in self._tables.items():
            num_freed = self._num_freed.get(request_id, 0)
            assert all(b == FREED_BLOCK for b in full_table[:num_freed]), full_table
            table = full_table[num_freed:]
            assert len(set(table)) == len(table), f"block repeated in a table: {table}"
            refs.update(table)
        num_used = 0
        assert set(self._blocks) == set(range(self._fresh)), "a block id skipped or reused"
        assert set(refs) <= set(self._blocks), "a table names a block never handed out"
        for block in self._blocks.values():
            assert block.ref_count == refs.get(block.block_id, 0), block
            assert (block.block_id in self._free) == (block.ref_count == 0), block
            num_used += block.ref_count > 0
            if block.block_hash is not None:
                assert self._cache.holds(block), block
        self._cache.check_invariants()
        assert len(self._cache) == sum(b.block_hash is not None for b in self._blocks.values())
        assert num_used + self.num_free_blocks == self.num_blocks
        assert set(self._chains) <= set(self._tables)
        assert set(self._num_freed) <= set(self._tables)
