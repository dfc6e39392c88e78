"""The host (CPU) tier of offloaded chunks, as vLLM 0.33's `CPUOffloadingManager`
(vllm/v1/kv_offload/cpu/manager.py): slots, ref counts, store admission, eviction.

A chunk is `blocks_per_chunk` GPU blocks, keyed by the block hash of its last
block (vLLM: those hash bytes plus the group index; one group here). Its ref
count is -1 while its store is in flight, 0 when ready and idle (the only
evictable state), and n > 0 while n loads read it.

Positions: every call that offers or loads keys takes their positions, the
chunk's end token, in a parallel list (vLLM reads them from the request's
`ReqContext`, where the scheduler sets them). The tier keeps, per running
request, the keys it saw with their positions, and commits them to the policy
in head-to-tail order when the request finishes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvsim.kvcache.events import HostEventLog, KVEvent
from kvsim.kvcache.offload import make_policy
from kvsim.kvcache.offload.lru import check_keys

MISS, HIT, PENDING = 0, 1, 2  # lookup results; vLLM's LookupResult.HIT_PENDING is PENDING


@dataclass(frozen=True, slots=True)
class StoreOutput:
    """What `prepare_store` decided: keys to store (offer order), their slots, and the victims."""

    keys: list[int]
    slots: list[int]
    evicted: list[int]


@dataclass(slots=True)
class _Access:
    """One running request's accesses, committed to the policy when it finishes (vLLM's
    `_RequestCacheAccess`)."""

    seen: dict[int, int] = field(default_factory=dict)  # key -> position, in first-seen order
    inserted: set[int] = field(default_factory=set)
    reused: set[int] = field(default_factory=set)
    store_misses: set[int] = field(default_factory=set)


class _OfferCounts:
    """How often each key was offered, for `store_threshold`: vLLM's bounded `counts` table
    (`CPUOffloadingManager._record_accesses`), least recently offered first."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.counts: OrderedDict[int, int] = OrderedDict()

    def offer(self, keys: Sequence[int]) -> None:
        counts = self.counts
        known = 0
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                known += 1
        # NOTE: the offer's known keys are now at the end, so popping the oldest
        # entry never drops one of them while `unprotected` is above 0.
        unprotected = len(counts) - known
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_size:
                if unprotected == 0:
                    continue  # no room: the key stays uncounted
                counts.popitem(last=False)
                unprotected -= 1
            counts[key] = 1

    def get(self, key: int) -> int:
        return self.counts.get(key, 0)


class HostTier:
    """The offloaded chunks in host memory, their slots, and the policy that picks victims."""

    def __init__(self, num_chunks: int, policy: str = "lru", *, store_threshold: int = 0,
                 max_tracker_size: int = 64_000, kv_events: bool = False) -> None:
        if num_chunks < 0:
            raise ValueError(f"num_chunks must be at least 0, got {num_chunks}")
        self.num_chunks = num_chunks
        self.policy = make_policy(policy, num_chunks)
        self.store_threshold = store_threshold  # below 2: every offered chunk is admitted
        self._counts = _OfferCounts(max_tracker_size) if store_threshold >= 2 else None
        self._ref: dict[int, int] = {}
        self._slot: dict[int, int] = {}
        self._num_fresh = 0  # slots 0 .. _num_fresh - 1 have been handed out
        self._free: list[int] = []  # freed slots, reused last freed first
        self._num_evictable = 0
        self._num_pending = 0
        self._requests: dict[str, _Access] = {}
        self.num_stores = 0  # chunks given a slot
        self.num_evictions = 0  # chunks evicted to make room
        self.num_skipped = 0  # store candidates below the threshold (vLLM's stores_skipped)
        self.num_alloc_failures = 0  # prepare_store calls that returned None
        # vLLM's KV events of this tier (its `enable_events`: `--kv-events-config` on), or None
        self.events = HostEventLog() if kv_events else None

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_chunks - self._num_fresh

    @property
    def num_resident(self) -> int:
        return len(self._ref)

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    @property
    def num_pending(self) -> int:
        return self._num_pending

    def resident(self) -> dict[int, int]:
        """Every chunk in the tier, pending or ready: key -> slot."""
        return dict(self._slot)

    def lookup(self, key: int) -> int:
        """MISS, PENDING (store in flight) or HIT; changes nothing."""
        ref = self._ref.get(key)
        if ref is None:
            return MISS
        return PENDING if ref < 0 else HIT

    def lookup_chunks(self, req: str, keys: Sequence[int], first: int, tokens_per_chunk: int) -> tuple[int, bool]:  # noqa: ARG002
        """`lookup` of `keys` in order up to the first MISS: (hits, whether any is PENDING)."""
        ref, hits, defer = self._ref, 0, False
        for key in keys:
            r = ref.get(key)
            if r is None:
                break
            hits += 1
            defer |= r < 0
        return hits, defer

    def _access(self, req: str) -> _Access:
        acc = self._requests.get(req)
        if acc is None:
            acc = self._requests[req] = _Access()
        return acc

    def _record(self, req: str, acc: _Access, keys: Sequence[int], positions: Sequence[int],
                reused: Sequence[int]) -> None:
        """Note keys the request saw (first sightings go to the policy) and its ready reuses."""
        new_keys: list[int] = []
        new_positions: list[int] = []
        for key, position in zip(keys, positions, strict=True):
            if key not in acc.seen:
                acc.seen[key] = position
                new_keys.append(key)
                new_positions.append(position)
        if new_keys:
            self.policy.on_request_access(req, new_keys, new_positions)
        # re-reading a chunk this request stored is not a reuse
        acc.reused.update(key for key in reused if key not in acc.inserted)

    def prepare_store(self, req: str, keys: Sequence[int], positions: Sequence[int]) -> StoreOutput | None:
        """Slots for the offered keys not in the tier, evicting if needed; None if it cannot make room.

        Keys (distinct) already present are skipped: ready ones count as the request's
        reuse, pending ones are not recorded. With a threshold, a new key is stored only
        once offered that often. Eviction is all or nothing and spares the offered keys.
        """
        if len(keys) != len(positions):
            raise ValueError(f"{len(keys)} keys but {len(positions)} positions")
        check_keys(keys)  # (before the counts, the record and the maps change)
        if self._counts is not None:
            self._counts.offer(keys)
        new: list[int] = []
        ready: list[int] = []
        ref = self._ref.get
        for key in keys:
            r = ref(key)
            if r is None:
                new.append(key)
            elif r >= 0:
                ready.append(key)
        if self._counts is not None:
            admitted = [key for key in new if self._counts.get(key) >= self.store_threshold]
            self.num_skipped += len(new) - len(admitted)
            new = admitted
        acc = self._access(req)
        if self.policy.hooks_store_misses:  # before insert drops ghosts (ARC), once per key and request
            misses = [key for key in new if key not in acc.store_misses]
            if misses:
                self.policy.on_store_miss(misses)
                acc.store_misses.update(misses)
        all_new = len(new) == len(keys)  # (then `new` is `keys`: recorded, and inserted, as given)
        # NOTE: recorded even when this call then returns None, as vLLM does.
        if all_new:
            self._record(req, acc, keys, positions, ready)
        else:
            recorded = set(new).union(ready)
            seen = [(key, pos) for key, pos in zip(keys, positions, strict=True) if key in recorded]
            self._record(req, acc, [k for k, _ in seen], [p for _, p in seen], ready)
        if not new:
            return StoreOutput([], [], [])

        evicted: list[int] = []
        short = len(new) - self.num_free
        if short > 0:
            victims = self.policy.evict(short, set(keys)) if short <= self._num_evictable else None
            if victims is None:
                self.num_alloc_failures += 1
                return None
            evicted = victims
            self._num_evictable -= len(evicted)
            self.num_evictions += len(evicted)
            refs, slot_of, free = self._ref, self._slot, self._free
            for key in evicted:
                del refs[key]
                free.append(slot_of.pop(key))
            if self.events is not None:
                self.events.removed(evicted)

        slots = self._allocate(len(new))
        refs, slot_of = self._ref, self._slot
        for key, slot in zip(new, slots, strict=True):
            refs[key] = -1
            slot_of[key] = slot
        if all_new:
            self.policy.insert(new, req, positions)
        else:
            position_of = dict(zip(keys, positions, strict=True))
            self.policy.insert(new, req, [position_of[key] for key in new])
        self._num_pending += len(new)
        self.num_stores += len(new)
        acc.inserted.update(new)
        return StoreOutput(new, slots, evicted)

    def _allocate(self, n: int) -> list[int]:
        """Never-used slots in order first, then freed ones, last freed first."""
        fresh = min(n, self.num_chunks - self._num_fresh)
        slots = list(range(self._num_fresh, self._num_fresh + fresh))
        self._num_fresh += fresh
        slots.extend(self._free.pop() for _ in range(n - fresh))
        return slots

    def complete_store(self, keys: Sequence[int], success: bool = True) -> None:
        """The stores of `keys` finished: still-pending chunks become ready, or on failure leave
        the tier and free their slots. Keys not pending are ignored. The chunks made ready are a
        stored event (a failure publishes nothing: vLLM's event for it is `metadata_only`)."""
        ready: list[int] = []
        refs = self._ref
        for key in keys:
            if refs.get(key, 0) >= 0:
                continue
            self._num_pending -= 1
            if success:
                refs[key] = 0
                ready.append(key)
            else:
                del refs[key]
                self.policy.remove(key)
                self._free.append(self._slot.pop(key))
        if ready:
            self._num_evictable += len(ready)
            self.policy.mark_evictable(ready)
            if self.events is not None:
                self.events.stored(ready)

    def prepare_load(self, req: str, keys: Sequence[int], positions: Sequence[int]) -> list[int]:
        """Pin ready chunks for a load to the GPU and return their slots; the request reused them."""
        if len(keys) != len(positions):
            raise ValueError(f"{len(keys)} keys but {len(positions)} positions")
        slots = self._pin(keys, "loaded")
        self._record(req, self._access(req), keys, positions, keys)
        return slots

    def _pin(self, keys: Sequence[int], what: str) -> list[int]:
        """One more reader each for ready chunks (none evictable while read); their slots."""
        for key in keys:
            if self._ref.get(key, -1) < 0:
                raise ValueError(f"chunk {key} is not ready in the host tier; it cannot be {what}")
        for key in keys:
            if self._ref[key] == 0:
                self.policy.mark_non_evictable(key)
                self._num_evictable -= 1
            self._ref[key] += 1
        return [self._slot[key] for key in keys]

    def complete_load(self, keys: Sequence[int]) -> None:
        """The loads of `keys` finished: unpin; a chunk read by no load is evictable again."""
        idle: list[int] = []
        for key in keys:
            ref = self._ref.get(key, 0)
            if ref <= 0:
                raise ValueError(f"chunk {key} has no load in flight")
            self._ref[key] = ref - 1
            if ref == 1:
                idle.append(key)
        if idle:
            self._num_evictable += len(idle)
            self.policy.mark_evictable(idle)

    def request_finished(self, req: str) -> None:
        """Commit the request's accesses to the policy, head to tail (vLLM's `on_request_finished`).

        Call it once, after the request's last offer or load; its stores and loads may
        still complete afterwards.
        """
        acc = self._requests.pop(req, None)
        if acc is None:
            return
        order = sorted(acc.seen, key=acc.seen.__getitem__)
        self.policy.on_request_finished(req, order, acc.inserted - acc.reused, acc.reused)

    def take_events(self) -> list[KVEvent]:
        """The KV events queued since the last take (vLLM's `CPUOffloadingManager.take_events`);
        none when events are off."""
        return self.events.take() if self.events is not None else []

    def reset(self) -> None:
        """Drop every chunk, pinned or pending, and every request's accesses (vLLM's `reset_cache`).
        The offer counts and the counters stay."""
        self.policy.clear()
        self._ref.clear()
        self._slot.clear()
        self._free.clear()
        self._num_fresh = 0
        self._num_evictable = 0
        self._num_pending = 0
        self._requests.clear()
