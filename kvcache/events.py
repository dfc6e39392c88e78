"""KV-cache events as vLLM 0.33 publishes them (vllm/distributed/kv_events.py), for a router that
tracks which prefixes each replica holds.

The block manager queues an event where vLLM's `BlockPool` does: one `BlockStored` per caching
call of a group (`cache_full_blocks`: the hashes of the blocks it newly caches, masked and null
blocks left out, the hash of the block before the range as parent, the range's token ids), one
`BlockRemoved` per cached block evicted as it is reused (`_maybe_evict_cached_block`), and
`AllBlocksCleared` on a prefix-cache reset. The engine takes the queue once per step, as vLLM's
scheduler does in `update_from_output`, into an `EventBatch` stamped with the step's time and the
replica.

With KV offloading the host tier queues its own (`HostEventLog`), where vLLM's CPU offloading
manager queues its `OffloadingEvent`s (vllm/v1/kv_offload/cpu/manager.py: the chunks evicted by
`prepare_store`, the chunks made ready by `complete_store`), in the payload its connector turns
them into by default (vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py,
`OffloadingEventsTracker._placeholder_stored`, `_take_removed_event`: "self-describing" payloads are
opt-in): medium "CPU", the chunk's key (the hash of its last block) as the one hash, no parent, no
token ids, block size 0. The engine appends them after the GPU pool's, as vLLM's
`Scheduler.update_from_output` appends `connector.take_events()`.

A hash is kvsim's block key (`kvcache.hashing`), not vLLM's sha256 bytes: equal for equal
prefixes across replicas of one run (the hash needs no seed), different from vLLM's. A hybrid
group's salt (`groups.group_salt`) never reaches an event: it carries the group-free key and
`group_idx`, as vLLM's `ExternalBlockHash` does. Token ids past a request's known tokens are
kvsim's stand-ins for decoded tokens (`Sequence.token_ids`: negative numbers).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvsim.kvcache.block import KVCacheBlock


class TokenSource(Protocol):
    """What a `TokenSpan` reads its ids from (a `kvcache.sequence.Sequence`)."""

    def token_ids(self, start: int, end: int) -> np.ndarray: ...

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class TokenSpan:
    """A sequence's token ids at positions [start, end), read from it only when asked for: a
    prompt's `BlockStored` carries thousands, which a router fed by the events never reads (Dynamo's
    replicas on the Azure trace spent an eighth of their run listing them). Equal to the list of
    those ids, and listed by `ids()`. The positions are computed or decoded when the event is made,
    and a sequence's ids there never change (a fork gives the child a lineage of its own)."""

    __slots__ = ("_seq", "_start", "_end", "_ids")

    def __init__(self, seq: TokenSource, start: int, end: int):
        self._seq: TokenSource | None = seq
        self._start, self._end = start, end
        self._ids: list[int] | None = None

    def ids(self) -> list[int]:
        if self._ids is None:
            self._ids = self._seq.token_ids(self._start, self._end).tolist()
            self._seq = None
        return self._ids

    def __len__(self) -> int:
        return self._end - self._start

    def __getitem__(self, i):
        return self.ids()[i]

    def __iter__(self):
        return iter(self.ids())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenSpan):
            return self.ids() == other.ids()
        return self.ids() == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # (as a list's)

    def __repr__(self) -> str:
        return repr(self.ids())


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly cached by one caching call of a group (vLLM's `BlockStored`); `token_ids` a list
    or a `TokenSpan`, equal either way."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int] | TokenSpan
    block_size: int
    medium: str = MEDIUM_GPU
    group_idx: int = 0

    def as_dict(self) -> dict:
        ids = self.token_ids
        return {"type": "BlockStored", "block_hashes": self.block_hashes, "parent_block_hash": self.parent_block_hash,
                "token_ids": ids if type(ids) is list else ids.ids(), "block_size": self.block_size,
                "medium": self.medium, "group_idx": self.group_idx}


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A cached block evicted as it is reused (vLLM's `BlockRemoved`, one hash an event)."""

    block_hashes: list[int]
    medium: str = MEDIUM_GPU
    group_idx: int = 0

    def as_dict(self) -> dict:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium,
                "group_idx": self.group_idx}


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached prefix forgotten (vLLM's `AllBlocksCleared`, from `reset_prefix_cache`)."""

    def as_dict(self) -> dict:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One step's events of one replica (vLLM's `KVEventBatch`; `ts` is the simulated time the
    step's output was applied, in seconds, and `step` the engine's step number)."""

    ts: float
    replica: int
    step: int
    events: list[KVEvent]

    def as_dict(self) -> dict:
        return {"ts": self.ts, "replica": self.replica, "step": self.step,
                "events": [e.as_dict() for e in self.events]}

    def json_line(self) -> str:
        """The batch as one line of JSON (`kvsim run --kv-events`)."""
        return json.dumps(self.as_dict(), separators=(",", ":")) + "\n"


class HostEventLog:
    """The host tier's events since they were last taken, as vLLM 0.33's `OffloadingConnector`
    publishes its CPU tier's by default (see the module docstring)."""

    def __init__(self, medium: str = MEDIUM_CPU):
        self.queue: list[KVEvent] = []
        self.medium = medium

    def stored(self, keys: Sequence[int]) -> None:
        """Chunks whose stores completed: one `BlockStored` a chunk, in `keys`' order (vLLM's
        `_take_stored_event`, one placeholder a key)."""
        self.queue.extend(BlockStored([key], None, [], 0, self.medium) for key in keys)

    def removed(self, keys: Sequence[int]) -> None:
        """Chunks one `prepare_store` evicted, in eviction order: one `BlockRemoved` carrying them all
        (vLLM's `_take_removed_event`, one event a group)."""
        if keys:
            self.queue.append(BlockRemoved(list(keys), self.medium))

    def take(self) -> list[KVEvent]:
        """The queued events, oldest first; the queue starts again empty."""
        events, self.queue = self.queue, []
        return events


class KVEventLog:
    """The events a block manager queued since they were last taken (vLLM's `kv_event_queue`);
    `salts`: each group's key salt, taken off a removed block's key (`groups.group_salt`)."""

    def __init__(self, salts: Sequence[int] = (0,)):
        self.queue: list[KVEvent] = []
        self.salts = tuple(salts)

    def stored(self, blocks: list[KVCacheBlock], keys: list[int], ranges: list[tuple[int, int]], start: int,
               end: int, token_ids: list[int] | TokenSpan, block_size: int, null: KVCacheBlock,
               group: int = 0) -> None:
        """A caching call over blocks [start, end) that hashed `ranges` of them (vLLM's
        `cache_full_blocks` with its block mask): one event even if it hashed none."""
        hashes = [keys[i] for a, b in ranges for i in range(a, b) if blocks[i] is not null]
        parent = keys[start - 1] if start else None
        self.queue.append(BlockStored(hashes, parent, token_ids, block_size, MEDIUM_GPU, group))

    def removed(self, blocks: list[KVCacheBlock], group_of: list[int] | None) -> None:
        """Cached `blocks` evicted (their keys still set), in order; `group_of`: each block's group
        (None: one group)."""
        self.removed_keys([b.block_id for b in blocks], [b.block_hash for b in blocks], group_of)

    def removed_keys(self, ids: list[int], keys: list[int], group_of: list[int] | None) -> None:
        """`removed` of the blocks `ids`, evicted in this order, whose keys were `keys` (salted)."""
        queue, salts = self.queue, self.salts
        if group_of is None:
            salt = salts[0]
            queue += [BlockRemoved([key ^ salt], MEDIUM_GPU, 0) for key in keys]
            return
        for i, key in zip(ids, keys, strict=True):
            g = group_of[i]
            queue.append(BlockRemoved([key ^ salts[g]], MEDIUM_GPU, g))

    def cleared(self) -> None:
        self.queue.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The queued events, oldest first; the queue starts again empty (vLLM's `take_events`)."""
        events, self.queue = self.queue, []
        return events
