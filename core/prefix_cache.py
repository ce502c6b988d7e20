"""The prefix cache: which full KV blocks hold which prefix. No torch here.

A full, computed block is registered under a chained hash of (parent hash, its token ids), so a
later request with the same prefix (an ``n > 1`` sibling, a shared system prompt, a preempted
request coming back) takes a reference on it instead of computing it again. The block manager
(core/block_manager.py) owns the blocks, their references and the free pool; this module only
names them.

NOTE collision safety: a hit compares the block's token ids *and* the generation of its
parent. Each registration gets a unique generation number, so a child block is only reachable
through the exact parent it was computed after; a hash collision anywhere in the chain can
cost a cache miss but never hands out KV computed over a different prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT_GEN = 0  # the "parent generation" of a request's first block


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The chained hash of one full block; it covers the whole prefix through ``parent_hash``."""
    return hash((parent_hash, token_ids))


@dataclass(slots=True)
class KVBlock:
    """One physical KV-cache block and, while it is registered, its prefix-cache identity."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    cache_gen: int = -1
    parent_gen: int = -1


@dataclass(slots=True)
class Chain:
    """How far a request's table is hashed, and the chain state to continue from."""

    num_blocks: int = 0
    last_hash: int | None = None
    last_gen: int = ROOT_GEN
    is_broken: bool = False  # a true hash collision: stop registering this request's blocks

    def advance(self, block_hash: int, gen: int) -> None:
        self.num_blocks, self.last_hash, self.last_gen = self.num_blocks + 1, block_hash, gen


class PrefixCache:
    """Registered blocks by chained hash, and the generations that make a hit exact."""

    def __init__(self) -> None:
        self._cached: dict[int, KVBlock] = {}
        self._next_gen = ROOT_GEN + 1
        # Per cache namespace (a LoRA adapter's blocks are its own), the generation its
        # chains start from: a block is reachable only from the root it was computed under.
        self._roots: dict[object, int] = {}

    def __len__(self) -> int:
        return len(self._cached)

    def new_chain(self, namespace: object) -> Chain:
        """An empty chain in a cache namespace (``Request.cache_namespace``; 0: the
        shared one)."""
        if not namespace:
            return Chain()
        gen = self._roots.get(namespace)
        if gen is None:
            gen = self._roots[namespace] = self._next_gen
            self._next_gen += 1
        return Chain(last_hash=hash(("namespace", namespace)), last_gen=gen)

    def hit(self, chain: Chain, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The cached block holding ``token_ids`` right after the chain's last block, with
        the chain advanced past it; None (the chain left as it was) on a miss."""
        block_hash = hash_block_tokens(chain.last_hash, token_ids)
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent_gen != chain.last_gen:
            return None
        chain.advance(block_hash, block.cache_gen)
        return block

    def register(self, chain: Chain, block: KVBlock, token_ids: tuple[int, ...]
                 ) -> KVBlock | None:
        """Register ``block`` (just computed, holding ``token_ids``) as the chain's next
        block and advance the chain; returns a block this displaced from the cache, whose
        place in the free pool the caller fixes. A true collision breaks the chain."""
        block_hash = hash_block_tokens(chain.last_hash, token_ids)
        existing = self._cached.get(block_hash)
        displaced = None
        if existing is not None and existing.token_ids == token_ids:
            if existing.parent_gen == chain.last_gen:
                # The same prefix was computed twice (e.g. by two requests in one step): our
                # copy stays unregistered, and our chain continues through the cached one.
                chain.advance(block_hash, existing.cache_gen)
                return None
            # The same tokens after another copy of the same prefix: registered by a
            # request whose chain went through a twin of our parent (two requests computed
            # that prefix in one step), and that twin may be evicted by now, leaving it
            # unreachable. Ours takes the slot, so the chain goes on being cached and found.
            self.forget(existing)
            displaced = existing
        elif existing is not None:
            chain.is_broken = True
            return None
        block.block_hash, block.token_ids = block_hash, token_ids
        block.parent_gen, block.cache_gen = chain.last_gen, self._next_gen
        self._next_gen += 1
        self._cached[block_hash] = block
        chain.advance(block_hash, block.cache_gen)
        return displaced

    def forget(self, block: KVBlock) -> None:
        """Take a registered block out of the cache (evicted, or displaced)."""
        del self._cached[block.block_hash]
        block.block_hash, block.token_ids = None, ()
        block.cache_gen = block.parent_gen = -1

    def check_invariants(self) -> None:
        """Assert every entry is the block registered under its hash (for tests)."""
        assert all(b.block_hash == h for h, b in self._cached.items())

    def holds(self, block: KVBlock) -> bool:
        return block.block_hash is not None and self._cached.get(block.block_hash) is block
