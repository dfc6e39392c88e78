"""One KV-cache group's rules: what its cache hit is, which of its blocks a request still reads,
how many blocks an allocation takes, and which of its full blocks are hashed.

vLLM 0.33's hybrid KV-cache manager gives every group of layers that share a spec its own block
table per request, all drawing on one block pool; the rules of a group depend only on its kind
(vllm/v1/core/single_type_kv_cache_manager.py, one manager class a kind):

- `full`: every token is read; a hit is the longest run of cached blocks from the start
  (`FullAttentionManager.find_longest_cache_hit`);
- `sliding_window` (window W): a token reads the W before it, so blocks wholly before
  `num_computed - W + 1` go back to the pool; a hit needs only the `cdiv(W - 1, block)` blocks
  before its end (`SlidingWindowManager`); under `prefix_cache_retention_interval` only those
  tails are hashed (`sliding_window.retained_ranges`);
- `chunked_local` (chunk C): a token reads its own C-token chunk, so every block before the
  chunk holding the next token is skipped, and a hit scans the last chunk only
  (`ChunkedLocalAttentionManager`); it hashes densely (retention is for sliding windows and Mamba);
- `mamba` (a state-space or gated-delta-net layer's state, vLLM's "align" cache mode): block i holds
  the state after (i + 1) x block tokens, so only the last computed token's block is read, a hit is
  the rightmost cached block (nulls before it, `MambaManager.find_longest_cache_hit`), and under
  sparse retention only the blocks ending at the replay boundary and the junction are hashed
  (`MambaManager.reachable_block_mask`). How its blocks are taken and let go is `kvcache.mamba`'s.

`kvcache.hybrid` composes these over one pool; `kvcache.manager` is the one-group manager, whose
window rules are `kvcache.sliding_window`'s, shared with the `sliding_window` kind here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsim.kvcache import sliding_window as sw
from kvsim.kvcache.block import KVCacheBlock

KINDS = ("full", "sliding_window", "chunked_local", "mamba")

_MASK = (1 << 64) - 1


def group_salt(group_id: int) -> int:
    """What a group's cache keys are XORed with: 0 for group 0 (so a one-group cache keys its blocks
    as the one-group manager does), a distinct 64-bit constant for every other group. vLLM keys its
    prefix-cache map by (block hash, group id) (`make_block_hash_with_group_id`); XOR with a per-group
    constant keeps one flat map of ints, and two groups' keys collide only with the chance of a
    64-bit hash collision."""
    if group_id == 0:
        return 0
    x = (group_id * 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) | 1


@dataclass(frozen=True)
class GroupSpec:
    """A KV-cache group: its kind, block size and window (the sliding window, or the attention
    chunk; None for full attention). Equal specs are looked up together (vLLM's `SpecGroup`)."""

    kind: str
    block_size: int
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"group kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.block_size <= 0:
            raise ValueError(f"group block_size must be positive, got {self.block_size}")
        if (self.kind in ("full", "mamba")) != (self.window is None) or (self.window is not None and self.window <= 0):
            raise ValueError(f"group {self.kind}: window {self.window!r} (a positive window for sliding_window "
                             "and chunked_local, none for full and mamba)")

    def describe(self) -> str:
        if self.kind in ("full", "mamba"):
            return "full attention" if self.kind == "full" else "Mamba state"
        return f"{'sliding window' if self.kind == 'sliding_window' else 'chunked local'} {self.window:,}"

    def skipped_tokens(self, num_computed: int) -> int:
        """Tokens the next token's attention no longer reads (`get_num_skipped_tokens`)."""
        if self.kind == "sliding_window":
            return max(0, num_computed - self.window + 1)
        if self.kind == "chunked_local":
            return num_computed // self.window * self.window
        if self.kind == "mamba":  # only the last computed token's state is read
            return max(0, num_computed - 1)
        return 0

    def admission_cap(self, in_flight_tokens: int, max_model_len: int | None) -> int | None:
        """Blocks a request can hold at most while it runs, which the whole-sequence admission gate
        counts instead of all its tokens' (vllm/v1/kv_cache_interface.py
        `SlidingWindowSpec.max_admission_blocks_per_request`: the window and the in-flight tokens,
        plus one block for a window that starts mid-block; the chunked-local twin: a chunk and the
        in-flight tokens); None for full attention and Mamba state."""
        if self.kind in ("full", "mamba"):
            return None
        span = self.window - 1 + in_flight_tokens if self.kind == "sliding_window" else self.window + in_flight_tokens
        if max_model_len is not None:
            span = min(span, max_model_len)
        return -(-span // self.block_size) + (self.kind == "sliding_window")

    @property
    def sparse(self) -> bool:
        """Whether `prefix_cache_retention_interval` thins which of its blocks are hashed."""
        return self.kind in ("sliding_window", "mamba")


Lookup = Callable[[int], "list[KVCacheBlock] | None"]  # block index -> one cached block per group, or None


def group_lookup(get: Callable[[int], KVCacheBlock | None], keys: Sequence[int], salts: Sequence[int]) -> Lookup:
    """The `Lookup` of the groups salted by `salts` looked up together: block i's cached block in
    each (`get` of its chained key `keys[i]` under the group's salt), or None when any misses it
    (vllm/v1/core/block_pool.py `get_cached_block`, which asks every group of a spec)."""
    if len(salts) == 1:
        salt = salts[0]

        def one(i: int) -> list[KVCacheBlock] | None:
            b = get(keys[i] ^ salt)
            return None if b is None else [b]
        return one

    def many(i: int) -> list[KVCacheBlock] | None:
        out = []
        for salt in salts:
            b = get(keys[i] ^ salt)
            if b is None:
                return None
            out.append(b)
        return out
    return many


def find_longest_cache_hit(spec: GroupSpec, max_length: int, lookup: Lookup, num_groups: int,
                           null: KVCacheBlock) -> tuple[list[list[KVCacheBlock]], int]:
    """The longest hit of at most `max_length` tokens for `num_groups` groups of `spec` looked up
    together: each group's hit blocks (null where the group no longer reads) and the hit's tokens.
    `lookup(i)` gives block i's cached block in every group, or None when any group misses it.

    vllm/v1/core/single_type_kv_cache_manager.py, `find_longest_cache_hit` of
    `FullAttentionManager`, `SlidingWindowManager`, `ChunkedLocalAttentionManager` and
    `MambaManager` (no EAGLE, hits aligned to the block size, which is the hash block size)."""
    bs = spec.block_size
    max_blocks = max_length // bs
    if spec.kind == "mamba":  # the rightmost cached state, nulls before it
        for i in range(max_blocks - 1, -1, -1):
            row = lookup(i)
            if row is not None:
                return [[null] * i + [b] for b in row], (i + 1) * bs
        return [[] for _ in range(num_groups)], 0
    if spec.kind == "sliding_window":
        return _window_hit(max_blocks, sw.contiguous_blocks_needed(spec.window, bs), bs, lookup, num_groups, null)
    # chunked local: blocks before the chunk that holds the next token are out of reach (null)
    start = 0 if spec.kind == "full" or max_length <= 0 else max_length // spec.window * spec.window // bs
    out = _run_from(start, max_blocks, lookup, num_groups, null)
    return out, len(out[0]) * bs


def _run_from(start: int, stop: int, lookup: Lookup, num_groups: int,
              null: KVCacheBlock) -> list[list[KVCacheBlock]]:
    """Each group's table: null blocks before `start`, then the cached blocks from `start` up to the
    first miss (or `stop`)."""
    out: list[list[KVCacheBlock]] = [[null] * start for _ in range(num_groups)]
    for i in range(start, stop):
        hit = lookup(i)
        if hit is None:
            break
        for table, block in zip(out, hit, strict=True):
            table.append(block)
    return out


def _window_hit(max_blocks: int, need: int, bs: int, lookup: Lookup, num_groups: int,
                null: KVCacheBlock) -> tuple[list[list[KVCacheBlock]], int]:
    """A sliding window's hit: the rightmost run of `need` cached blocks ending by `max_blocks`, null
    before it; without one, the run of cached blocks from block 0. vLLM scans every block from the
    right; a run ending at e covers block e - need + 1, so that block is looked up first and a miss
    there rules out every run ending in [e - need + 1, e] at once (the TODO in vLLM's
    `SlidingWindowManager.find_longest_cache_hit`): the same run, with about 1/need of the lookups
    where the window's blocks are sparse (sparse retention)."""
    end = max_blocks - 1  # the last block a run may end at
    while end - need + 1 >= 0:
        first = end - need + 1
        rows = [lookup(first)]
        if rows[0] is None:
            end = first - 1
            continue
        i = end
        while i > first:  # the rest of the run, from its right end
            row = lookup(i)
            if row is None:
                break
            rows.append(row)
            i -= 1
        if i > first:  # a miss at i: a run must end before it
            end = i - 1
            continue
        out = [[null] * first for _ in range(num_groups)]
        for row in (rows[0], *reversed(rows[1:])):
            for table, block in zip(out, row, strict=True):
                table.append(block)
        return out, (end + 1) * bs
    out = _run_from(0, min(need - 1, max_blocks), lookup, num_groups, null)  # no run: the blocks from block 0
    return out, len(out[0]) * bs


def blocks_to_allocate(spec: GroupSpec, held: Sequence[KVCacheBlock], running: bool, num_tokens: int,
                       hits: Sequence[KVCacheBlock], num_computed: int, cap: int | None,
                       free_hits: Callable[[Sequence[KVCacheBlock]], int]) -> int:
    """Free blocks one group of a request takes to give it `num_tokens` slots: new blocks, plus
    its cache hits that sit in the free queue (taking them consumes it). `held`: its table now;
    `running`: it has cached blocks counted (vLLM's fast path: no new hits); `num_computed`: its
    computed tokens, hits included; `cap`: the admission cap in blocks (`GroupSpec.admission_cap`,
    whole-sequence gate only). vllm/v1/core/single_type_kv_cache_manager.py
    `SingleTypeKVCacheManager.get_num_blocks_to_allocate`."""
    bs = spec.block_size
    need = -(-num_tokens // bs)
    if cap is not None and need > cap:
        need = cap
    if running:
        return max(need - len(held), 0)
    skipped = spec.skipped_tokens(num_computed) // bs
    new = max(need - max(skipped, len(hits) + len(held)), 0)
    return new + free_hits(hits[max(0, skipped - len(held)):])


def null_skipped(spec: GroupSpec, blocks: list[KVCacheBlock], num_computed: int,
                 null: KVCacheBlock) -> list[KVCacheBlock]:
    """Put the null block in place of the blocks the group no longer reads, from the last of them
    back to the first one already null; returns the blocks taken out, last first
    (`SingleTypeKVCacheManager.remove_skipped_blocks` / `_remove_blocks_in_range`)."""
    lo, end = skipped_span(blocks, (spec.skipped_tokens(num_computed) // spec.block_size), null)
    return take_span(blocks, lo, end, null)


def skipped_span(blocks: list[KVCacheBlock], skipped_blocks: int, null: KVCacheBlock) -> tuple[int, int]:
    """[lo, end): the blocks of a window's or chunk's table not null yet among its first
    `skipped_blocks` (those it no longer reads). Such a table holds its null blocks first (its hit's
    skipped blocks, then those let go), so the first one not null is found by bisection, or at once
    where a decode lets go of the last one only. Groups of one spec hold their nulls alike, so one
    span serves them all (`HybridKVCacheManager.remove_skipped_blocks`)."""
    end = min(skipped_blocks, len(blocks))
    if end <= 0 or blocks[end - 1] is null:
        return end, end
    if end >= 2 and blocks[end - 2] is null:
        return end - 1, end
    return leading_nulls(blocks, end, null), end


def take_span(blocks: list[KVCacheBlock], lo: int, end: int, null: KVCacheBlock) -> list[KVCacheBlock]:
    """Null `blocks[lo:end]` in one slice; returns the blocks taken out, last first."""
    removed = blocks[lo:end]
    removed.reverse()
    blocks[lo:end] = [null] * (end - lo)
    return removed


def leading_nulls(blocks: list[KVCacheBlock], end: int, null: KVCacheBlock) -> int:
    """How many of `blocks[:end]` are the null block, where a table holds its nulls first (a window's
    or a chunk's: its hit's skipped blocks, then those let go): found by bisection."""
    lo, hi = 0, end
    while lo < hi:
        mid = (lo + hi) // 2
        if blocks[mid] is null:
            lo = mid + 1
        else:
            hi = mid
    return lo


def cached_ranges(spec: GroupSpec, start: int, end: int, boundaries: Sequence[int],
                  retention_interval: int | None) -> list[tuple[int, int]]:
    """Which of blocks [start, end) just filled the group hashes, as [a, b) ranges: all of them but
    for a sliding window under sparse retention (`sliding_window.retained_ranges`), whose
    `boundaries` are the token positions a later request can resume at."""
    if start >= end:
        return []
    if not spec.sparse:
        return [(start, end)]
    if spec.kind == "mamba":
        return _state_ranges(start, end, boundaries, spec.block_size, retention_interval)
    if retention_interval == 0 and start >= max(boundaries) // spec.block_size:
        return []  # past every boundary's tail (a decode's block): nothing (sliding_window.retained_ranges)
    return sw.retained_ranges(start, end, boundaries, spec.window, spec.block_size, retention_interval)


def _state_ranges(start: int, end: int, boundaries: Sequence[int], bs: int,
                  retention_interval: int | None) -> list[tuple[int, int]]:
    """A Mamba group's hashed blocks among [start, end) (`MambaManager.reachable_block_mask`):
    every one when dense (None); else the block ending at each boundary floored to the block
    size, plus with a positive interval the block ending each interval-sized segment."""
    if retention_interval is None or (retention_interval and retention_interval // bs <= 1):
        return [(start, end)]
    keep = {b // bs - 1 for b in boundaries}
    if retention_interval:
        per = retention_interval // bs
        keep.update(range((start + per) // per * per - 1, end, per))
    return [(i, i + 1) for i in sorted(keep) if start <= i < end]
