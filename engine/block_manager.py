"""The engine's block manager (pure: no torch, no I/O, no clock): a fixed pool of KV-cache
blocks, reference counts, prefix caching keyed by the store's chained keys (kvstore.keys),
LRU reuse of unreferenced cached blocks, and copy-on-write for shared blocks (forks for n > 1).

Keys are the caller's: a sequence's chained block keys are computed once per block, when its
tokens are known (`extend_keys`), and carried with it; `find_prefix` and `cache_full_blocks`
take them, and nothing here hashes a block a second time.

How a sequence's progress is tracked: each sequence records `num_tokens`, the largest
`num_tokens` an `allocate` for it succeeded with (at least its prefix hit). The runner writes
the tokens between the previous and the new value in the forward pass that follows the call,
so the next write of a sequence always lands at token index `num_tokens`. Separately, the
keys of the blocks `cache_full_blocks` registered are what `keys_of` returns.

Copy-on-write: only a partially filled last block can be shared and written (full blocks shared
by a prefix hit are never written, writes go past them), and it is shared only through `fork`.
When an `allocate` will write into it (num_tokens > the recorded num_tokens, which is not a
multiple of block_size) and other tables hold it too, the sequence gets a fresh block and the
(src, dst) copy is queued. The source stays pinned -- never handed out, never evicted -- until
`take_copies` hands the pair to the runner, so a preemption in the same scheduling step cannot
recycle it before it is read. The pin is not a table reference: the sibling that still holds
the source sees refcount 1 and writes in place.

Sliding window: built with `window` (the model's, when every layer has that same window) and
`sinks`, the manager releases a sequence's blocks that no later token can attend to as the
sequence grows. A write at token index t attends to t - window + 1 .. t, so when an
`allocate` sets the next write at index n (its recorded num_tokens), every block wholly
before n - window + 1 is released, except the first ceil(sinks / block_size) blocks (the
attention sinks). Its table entry becomes FREED (-1), which no kernel reads (the kernels read
only the blocks a step attends to), and positions keep their table index. A released block is
released as `free` releases one: a keyed block stays in the prefix cache as
cached-unreferenced (another sequence with the same prefix may still take it as a hit; a
later allocation may evict it), an unkeyed one returns to the free pool. So a long sequence
holds at most ceil(sinks / block_size) + ceil((window - 1 + new) / block_size) + 1 blocks,
`new` being the tokens of its step (1 for a decode): `max_blocks_held`. The release comes
before the room for the step's new blocks is counted, so a pool of that many blocks suffices
(counted after, a prefill chunk would transiently need the blocks it is about to release).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvstore.keys import BlockKey, chain_key, namespace_root

from .errors import EngineError


class BlockManagerError(EngineError):
    """Base of the block manager's misuse errors; the message names the argument."""


class UnknownSequenceError(BlockManagerError, KeyError):
    """A seq_id (or parent_id) the manager holds no block table for."""

    def __str__(self) -> str:
        # KeyError quotes its argument; the message reads better without.
        return str(self.args[0]) if self.args else ""


class BlockRequestError(BlockManagerError, ValueError):
    """An argument out of range or inconsistent with the manager's state."""


class StaleHitError(BlockRequestError):
    """A PrefixHit whose blocks no longer hold its keys (evicted since find_prefix), or whose
    counts do not add up. That its keys are the caller's sequence's is the caller's to keep:
    nothing here hashes tokens to check it."""


@dataclass
class PrefixHit:
    """The longest cached prefix of a token list: its block ids, in order, how many tokens
    they hold (a multiple of block_size), and their keys. Taking no references: `allocate`
    takes them. With a window, a block id is FREED where the hit does not need the block
    (out of the window of the first token computed after it)."""

    block_ids: list[int]
    num_tokens: int
    keys: list[BlockKey] = field(default_factory=list)


@dataclass
class _SeqState:
    table: list[int]
    keys: list[BlockKey] = field(default_factory=list)
    num_tokens: int = 0  # tokens the table covers; the next write lands at this index
    slid: int = 0  # table entries below this index (past the sinks) are FREED


def _chained_keys(
    parent: BlockKey, token_ids: Sequence[int], block_size: int, first: int, stop: int
) -> Iterator[BlockKey]:
    """Keys of blocks first..stop-1 of token_ids, given the key of block first-1 (the namespace
    root when first == 0); lazy, so a caller that stops at a miss hashes no further."""
    for i in range(first, stop):
        parent = chain_key(parent, token_ids[i * block_size : (i + 1) * block_size])
        yield parent


#: A block table entry whose block was released (slid out of the window): never read.
FREED = -1


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise BlockRequestError(f"{name} must be >= 0, got {value}")


class BlockManager:
    """Blocks are ints in [0, num_blocks). A block is in exactly one of: free (never cached or
    evicted), cached-unreferenced (full, keyed, reusable by a prefix hit, evictable LRU), or
    referenced (refcount >= 1, owned by one or more sequences, or pinned as the source of a
    queued copy)."""

    def __init__(
        self, num_blocks: int, block_size: int, namespace: str, enable_prefix_caching: bool = True,
        *, window: int | None = None, sinks: int = 0,
    ) -> None:
        if num_blocks <= 0:
            raise BlockRequestError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise BlockRequestError(f"block_size must be positive, got {block_size}")
        if window is not None and (isinstance(window, bool) or window < 1):
            raise BlockRequestError(f"window must be a positive int or None, got {window!r}")
        if sinks < 0:
            raise BlockRequestError(f"sinks must be >= 0, got {sinks}")
        self._window = window
        self._sink_blocks = -(-sinks // block_size)
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._root = namespace_root(namespace)  # raises InvalidKeyError naming the namespace
        self._caching = enable_prefix_caching
        self._refcounts = [0] * num_blocks  # references from block tables
        self._pins = [0] * num_blocks  # queued copies reading the block
        self._block_keys: list[BlockKey | None] = [None] * num_blocks
        self._key_to_block: dict[BlockKey, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._seqs: dict[int, _SeqState] = {}
        self._copies: list[tuple[int, int]] = []
        self._evictions = 0
        self._prefix_queries = 0
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0

    # -- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free + cached-unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached-unreferenced blocks: a prefix hit can revive them, an allocation evict them."""
        return len(self._evictable)

    @property
    def num_referenced_blocks(self) -> int:
        """Blocks held by a block table or pinned by a queued copy."""
        return self._num_blocks - self.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    def max_blocks_held(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks a sequence of up to num_tokens tokens holds at once, when a step
        computes at most step_tokens of its tokens: all of them without a window; with one,
        the sink blocks plus those spanning the window before a step and the step itself."""
        every = self._blocks_for(num_tokens)
        if self._window is None:
            return every
        span = self._window - 1 + max(1, step_tokens)
        return min(every, self._sink_blocks + self._blocks_for(span) + 1)

    # -- prefix caching -------------------------------------------------------------------
    def extend_keys(self, keys: list[BlockKey], token_ids: Sequence[int]) -> list[BlockKey]:
        """Append to `keys` (the chained keys of token_ids' first len(keys) full blocks) the
        keys of its further full blocks, and return it: called as a sequence's tokens become
        known, so each block is hashed once in the sequence's life."""
        parent = keys[-1] if keys else self._root
        keys.extend(_chained_keys(parent, token_ids, self._block_size, len(keys),
                                  len(token_ids) // self._block_size))
        return keys

    def find_prefix(self, keys: Sequence[BlockKey], num_tokens: int) -> PrefixHit:
        """Longest run of leading full blocks of a token list of num_tokens tokens, whose
        chained keys (`keys`, from extend_keys) are cached. Never covers the whole list: at
        least one token is left to compute (its logits are needed), so at most
        (num_tokens - 1) // block_size blocks. Empty when prefix caching is off. Counts a query
        and the hit tokens in `stats` (queries are counted with caching off too, so the hit
        rate reads 0 rather than undefined).

        With a window, a hit needs only the blocks its first computed token attends to: the
        cut may be at any block boundary c * block_size whose window's blocks (those from
        c * block_size - window + 1 on) and sink blocks are cached, whatever became of the
        blocks between (evicted, or never cached); the longest such cut is the hit, and its
        block_ids hold FREED for the blocks it does not need (as vLLM's sliding-window
        prefix cache decides a hit)."""
        _check_count("num_tokens", num_tokens)
        self._prefix_queries += 1
        self._prefix_query_tokens += num_tokens
        if not self._caching:
            return PrefixHit([], 0)
        max_blocks = max(0, (num_tokens - 1) // self._block_size)
        block_ids: list[int] = []
        if self._window is not None:
            block_ids = self._windowed_prefix(keys[:max_blocks])
        else:
            for key in keys[:max_blocks]:
                block_id = self._key_to_block.get(key)
                if block_id is None:
                    break
                block_ids.append(block_id)
        num_tokens = len(block_ids) * self._block_size
        self._prefix_hit_tokens += num_tokens
        return PrefixHit(block_ids, num_tokens, list(keys[: len(block_ids)]))

    def allocate(
        self, seq_id: int, num_tokens: int, hit: PrefixHit | None = None
    ) -> list[int] | None:
        """Make seq_id's block table cover its first `num_tokens` tokens. On the first call for
        seq_id,
        `hit` (from find_prefix) gives blocks to share: they get a reference and lead the table.
        New blocks come from the free pool, then by evicting the least recently used
        cached-unreferenced block (its key is dropped). If the sequence's last block is shared
        (refcount > 1) and will be written (num_tokens reaches into it), it is replaced by a
        fresh copy: the (src, dst) pair is queued for `take_copies`. Returns the whole block
        table (a copy), or None when there are not enough blocks -- then nothing changed but
        the release of blocks that slid out of the window (which no later write reads; it
        comes first, so that their room counts). A hit's blocks that are already out of the
        window are not taken at all (FREED in the table from the start).

        A num_tokens the table already covers is a no-op. Raises BlockRequestError for a
        negative num_tokens or a hit on a later call; StaleHitError for a hit whose blocks no
        longer hold its keys, or one that covers more than num_tokens."""
        _check_count("num_tokens", num_tokens)
        seq = self._seqs.get(seq_id)
        if seq is None:
            return self._allocate_first(seq_id, num_tokens, hit)
        if hit is not None:
            raise BlockRequestError(
                f"hit given for seq_id {seq_id}, which already has a block table; "
                "a prefix hit is only taken on a sequence's first allocate"
            )
        if num_tokens <= seq.num_tokens:
            return list(seq.table)
        self._slide(seq)
        cow = seq.num_tokens % self._block_size != 0 and self._refcounts[seq.table[-1]] > 1
        num_new = self._blocks_for(num_tokens) - len(seq.table) + int(cow)
        if num_new > self.num_free_blocks:
            return None
        if cow:
            self._copy_last_block(seq)
        self._grow(seq, num_new - int(cow))
        seq.num_tokens = num_tokens
        return list(seq.table)

    def cache_full_blocks(self, seq_id: int, keys: Sequence[BlockKey], num_tokens: int) -> None:
        """After the model wrote (or a load filled) the first num_tokens tokens of seq_id:
        register every block that is now full under its key (keys: the sequence's chained
        keys, from extend_keys). A key already held by another block keeps that block (the
        duplicate stays private to this sequence). No-op when prefix caching is off (keys_of
        then stays empty). num_tokens at or below what earlier calls cached is a no-op; above
        what the table covers, or past the keys given, it is a BlockRequestError."""
        seq = self._seq(seq_id)
        _check_count("num_tokens", num_tokens)
        if num_tokens // self._block_size > len(keys):
            raise BlockRequestError(
                f"num_tokens ({num_tokens}) fills {num_tokens // self._block_size} blocks; "
                f"keys has {len(keys)}"
            )
        if num_tokens > seq.num_tokens:
            raise BlockRequestError(
                f"num_tokens ({num_tokens}) exceeds the {seq.num_tokens} tokens allocated "
                f"to seq_id {seq_id}"
            )
        if not self._caching:
            return
        first = len(seq.keys)
        new = list(enumerate(keys[first : num_tokens // self._block_size], start=first))
        for i, key in new:  # check them all first: a refused call changes nothing
            if seq.table[i] == FREED:
                continue
            current = self._block_keys[seq.table[i]]
            if current is not None and current != key:
                raise BlockRequestError(
                    f"keys[{i}] disagrees with the key block {seq.table[i]} is cached under"
                )
        for i, key in new:
            seq.keys.append(key)
            # A FREED entry is one a windowed store load skipped (a block is keyed before
            # it slides out otherwise): the key is the sequence's, no block holds it.
            if seq.table[i] != FREED:
                self._register(seq.table[i], key)

    def fork(self, parent_id: int, child_id: int) -> None:
        """child shares every block of parent (refcount +1 each), and its computed keys and
        allocated tokens: the shared partial last block is copied by whichever of the two
        writes into it first."""
        parent = self._seq(parent_id, "parent_id")
        if child_id in self._seqs:
            raise BlockRequestError(f"child_id {child_id} already has a block table")
        for block_id in parent.table:
            if block_id != FREED:
                self._refcounts[block_id] += 1
        self._seqs[child_id] = _SeqState(list(parent.table), list(parent.keys), parent.num_tokens,
                                         parent.slid)

    def free(self, seq_id: int) -> None:
        """Drop seq_id's references. A block reaching refcount 0 becomes cached-unreferenced
        if keyed (most recently used; a sequence's blocks are released tail first, so its last
        blocks are evicted before its first), else free. A queued copy into a released block
        is dropped. Unknown seq_id: no-op."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        for block_id in reversed(seq.table):
            if block_id != FREED:
                self._refcounts[block_id] -= 1
                self._release_if_unused(block_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached-unreferenced block (it returns to the free pool); blocks that
        sequences hold keep their keys. Returns how many were forgotten."""
        dropped = list(self._evictable)
        self._evictable.clear()
        for block_id in dropped:
            key = self._block_keys[block_id]
            if key is not None:
                del self._key_to_block[key]
            self._block_keys[block_id] = None
            self._free.append(block_id)
        return len(dropped)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) pairs queued since the last call, in the order they
        must be applied; the runner copies them before the next forward pass. Unpins the
        sources (one no table holds any more returns to the pool)."""
        copies, self._copies = self._copies, []
        for src, _ in copies:
            self._pins[src] -= 1
            self._release_if_unused(src)
        return copies

    # -- inspection -----------------------------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]:
        """seq_id's block table (a copy; FREED where a block slid out of the window);
        UnknownSequenceError if it has none."""
        return list(self._seq(seq_id).table)

    @property
    def sink_blocks(self) -> int:
        """Leading blocks of a sequence kept for its attention sinks (0 without sinks)."""
        return self._sink_blocks

    def window_start(self, next_write: int) -> int:
        """The first block (past the sink blocks) that a write at token index next_write,
        and every later one, attends to: 0 without a window."""
        if self._window is None:
            return 0
        return max(0, next_write - self._window + 1) // self._block_size

    def release_out_of_window(self, seq_id: int) -> list[int]:
        """Release now the blocks of seq_id that a write at the end of its table (where its
        next write lands) cannot attend to, as the next allocate would, and return the
        table: for a store load that fills only the window before its cut."""
        seq = self._seq(seq_id)
        self._slide(seq)
        return list(seq.table)

    def num_blocks_held(self, seq_id: int) -> int:
        """How many blocks seq_id's table holds (FREED entries not counted)."""
        return sum(1 for b in self._seq(seq_id).table if b != FREED)

    def refcount(self, block_id: int) -> int:
        """How many block tables hold block_id (queued copies' pins not included)."""
        return self._refcounts[self._check_block(block_id)]

    def block_key(self, block_id: int) -> BlockKey | None:
        """The chained key a cached block is registered under (the store uses the same)."""
        return self._block_keys[self._check_block(block_id)]

    def keys_of(self, seq_id: int, start: int = 0) -> list[BlockKey]:
        """Chained keys of seq_id's full, computed blocks from block `start` on, in order
        (its hit, then what cache_full_blocks saw full), whether or not its block holds the
        key mapping."""
        return self._seq(seq_id).keys[start:]

    def num_keys(self, seq_id: int) -> int:
        """len(keys_of(seq_id)), without the copy."""
        return len(self._seq(seq_id).keys)

    @property
    def stats(self) -> BlockManagerStats:
        """A snapshot; free_blocks is num_free_blocks (free + cached-unreferenced)."""
        return BlockManagerStats(
            num_blocks=self._num_blocks,
            free_blocks=self.num_free_blocks,
            cached_blocks=len(self._key_to_block),
            evictions=self._evictions,
            prefix_queries=self._prefix_queries,
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
        )

    # -- internals ------------------------------------------------------------------------
    def _seq(self, seq_id: int, name: str = "seq_id") -> _SeqState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"{name} {seq_id} has no block table")
        return seq

    def _check_block(self, block_id: int) -> int:
        if not 0 <= block_id < self._num_blocks:
            raise BlockRequestError(f"block_id {block_id} is outside [0, {self._num_blocks})")
        return block_id

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def _allocate_first(
        self, seq_id: int, num_tokens: int, hit: PrefixHit | None
    ) -> list[int] | None:
        hit_blocks = [] if hit is None else list(hit.block_ids)
        hit_keys = [] if hit is None else self._check_hit(num_tokens, hit)
        hit_tokens = len(hit_blocks) * self._block_size
        # The hit's blocks before the window of its first write (at hit_tokens), sinks
        # aside, are never read: they are not taken.
        first = self.window_start(hit_tokens)
        table = [FREED if self._sink_blocks <= i < first else b
                 for i, b in enumerate(hit_blocks)]
        kept = [b for b in table if b != FREED]
        # Reviving a cached-unreferenced hit block takes it out of the pool the new blocks
        # come from, so it counts against the room left (vLLM's num_evictable_computed_blocks).
        revived = sum(1 for b in kept if b in self._evictable)
        num_new = max(0, self._blocks_for(num_tokens) - len(hit_blocks))
        if num_new > self.num_free_blocks - revived:
            return None
        for block_id in kept:
            self._evictable.pop(block_id, None)
            self._refcounts[block_id] += 1
        seq = _SeqState(table, hit_keys, hit_tokens, first)
        self._grow(seq, num_new)
        seq.num_tokens = max(seq.num_tokens, num_tokens)
        self._seqs[seq_id] = seq
        return list(seq.table)

    def _check_hit(self, num_tokens: int, hit: PrefixHit) -> list[BlockKey]:
        """The hit's keys, after checking that each block still holds its key (another
        allocation may have evicted it since find_prefix). No hashing: the keys came with it."""
        num_blocks = len(hit.block_ids)
        if hit.num_tokens != num_blocks * self._block_size or len(hit.keys) != num_blocks:
            raise StaleHitError(
                f"hit.num_tokens ({hit.num_tokens}) and hit.keys ({len(hit.keys)}) are not "
                f"{num_blocks} blocks of {self._block_size} tokens"
            )
        if hit.num_tokens > num_tokens:
            raise StaleHitError(
                f"hit covers {hit.num_tokens} tokens, more than the {num_tokens} allocated"
            )
        unread = range(self._sink_blocks, self.window_start(hit.num_tokens))
        for i, (block_id, key) in enumerate(zip(hit.block_ids, hit.keys, strict=True)):
            if block_id == FREED and i in unread:
                continue  # out of the window: not needed, not taken
            self._check_block(block_id)
            if self._key_to_block.get(key) != block_id:
                raise StaleHitError(
                    f"hit.block_ids[{i}] (block {block_id}) no longer holds its key: "
                    "call find_prefix again"
                )
        return list(hit.keys)

    def _windowed_prefix(self, keys: Sequence[BlockKey]) -> list[int]:
        """find_prefix's block ids under a window (see there): the longest cut whose window
        and sink blocks are all cached, FREED for the blocks between."""
        found = [self._key_to_block.get(key) for key in keys]
        lead = next((i for i, b in enumerate(found) if b is None), len(found))
        best, run_start = 0, 0  # run_start: where the run of cached blocks up to c - 1 began
        for c in range(1, len(found) + 1):
            if found[c - 1] is None:
                run_start = c
                continue
            start = self.window_start(c * self._block_size)
            if run_start <= start and lead >= min(self._sink_blocks, start):
                best = c
        start = self.window_start(best * self._block_size)
        ids = [FREED if self._sink_blocks <= i < start else found[i] for i in range(best)]
        return [FREED if b is None else b for b in ids]  # (None never remains: typing)

    def _slide(self, seq: _SeqState) -> None:
        """Release seq's blocks that its next write (at index seq.num_tokens, the previous
        allocate's end) and every later one cannot attend to: those wholly before
        seq.num_tokens - window + 1, sink blocks kept (see the module docstring)."""
        first = min(self.window_start(seq.num_tokens), len(seq.table))
        for i in range(max(self._sink_blocks, seq.slid), first):
            block_id = seq.table[i]
            seq.table[i] = FREED
            self._refcounts[block_id] -= 1
            self._release_if_unused(block_id)
        seq.slid = max(seq.slid, first)

    def _grow(self, seq: _SeqState, num_new: int) -> None:
        for _ in range(num_new):
            block_id = self._take_block()
            self._refcounts[block_id] = 1
            seq.table.append(block_id)

    def _copy_last_block(self, seq: _SeqState) -> None:
        src = seq.table[-1]
        dst = self._take_block()
        seq.table[-1] = dst
        self._refcounts[src] -= 1  # still > 0: the sibling that shares it keeps it
        self._refcounts[dst] = 1
        self._pins[src] += 1
        self._copies.append((src, dst))

    def _take_block(self) -> int:
        """A block for writing: a free one, else the least recently used cached-unreferenced
        one, whose key is dropped. Callers have checked num_free_blocks first."""
        if self._free:
            return self._free.popleft()
        block_id, _ = self._evictable.popitem(last=False)
        key = self._block_keys[block_id]
        assert key is not None
        del self._key_to_block[key]
        self._block_keys[block_id] = None
        self._evictions += 1
        return block_id

    def _register(self, block_id: int, key: BlockKey) -> None:
        if self._block_keys[block_id] is not None:
            return  # a hit block, or one a fork sibling registered first (same key: checked)
        if key in self._key_to_block:
            return  # another block holds these tokens already: this one stays private
        self._block_keys[block_id] = key
        self._key_to_block[key] = block_id

    def _drop_copies_into(self, block_id: int) -> None:
        """Nothing holds block_id any more: a queued copy into it would fill a free block.
        Dropping one unpins its source, which may release that in turn."""
        dropped = [src for src, dst in self._copies if dst == block_id]
        if not dropped:
            return
        # Settle the queue before releasing sources: releasing one drops copies into it.
        self._copies = [(src, dst) for src, dst in self._copies if dst != block_id]
        for src in dropped:
            self._pins[src] -= 1
            self._release_if_unused(src)

    def _release_if_unused(self, block_id: int) -> None:
        """Return block_id to the pool once no table holds it and no queued copy reads it
        (a copy into it is still needed while a later copy reads it: (a, b) then (b, c))."""
        if self._refcounts[block_id] or self._pins[block_id]:
            return
        self._drop_copies_into(block_id)
        if self._block_keys[block_id] is not None:
            self._evictable[block_id] = None  # appended: most recently used
        else:
            self._free.append(block_id)


@dataclass
class BlockManagerStats:
    num_blocks: int
    free_blocks: int  # num_free_blocks: free + cached-unreferenced
    cached_blocks: int  # keyed blocks (referenced or not)
    evictions: int
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
