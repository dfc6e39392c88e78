"""What an event-fed router knows of each replica's prefix cache: an index built from the replicas'
KV events (`kvcache.events`), each batch seen only `delay` seconds after the step that produced it.

`PrefixIndex` is the index llm-d's precise scorer and Dynamo's KV router both keep: block hash ->
the replicas holding it, with the medium each holds it on. kvsim's block hashes are equal across
replicas for equal prefixes, so the engine's hash is the index key (llm-d maps engine keys to its
own request keys, Dynamo its external hashes to local ones: one to one here). Not modelled: both
drop a `BlockStored` whose parent hash they do not know (kvsim's replicas never publish one: a
block is cached only while its request holds its parent), and llm-d's LRU caps (1e8 keys, 10 pod
entries a key).

`DelayedEvents` holds each batch until `ts + delay`, `ts` being the time the step that produced it
ended (`EventBatch.ts`), and applies it to the router's index once it is due: by the time the router
picks, every batch due by then is applied, in due order, which is what a timed delivery would show it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from kvsim.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch


class PrefixIndex:
    """Block hash -> {replica: mediums holding it}, from KV events, kept a replica at a time (`at[i]`:
    hash -> the mediums replica i holds it on: each event touches one replica's, with one lookup a
    hash); `sizes[i]` counts the hashes replica i holds (Dynamo's radix-tree size a worker)."""

    def __init__(self, num_replicas: int):
        self.at: list[dict[int, set[str]]] = [{} for _ in range(num_replicas)]

    @property
    def sizes(self) -> list[int]:
        return [len(held) for held in self.at]

    @property
    def holders(self) -> dict[int, dict[int, set[str]]]:
        """The index hash first: hash -> {replica: mediums} (a view built on each call)."""
        out: dict[int, dict[int, set[str]]] = {}
        for i, held in enumerate(self.at):
            for h, mediums in held.items():
                out.setdefault(h, {})[i] = mediums
        return out

    def apply(self, batch: EventBatch) -> None:
        """One replica's batch, in order (llm-d-kv-cache `Pool.processEventBatch`: a stored block
        adds the pod's entry of the event's medium, lower-cased; a removed one drops it; a clear
        drops every entry of the pod)."""
        held = self.at[batch.replica]
        for event in batch.events:
            kind = type(event)
            if kind is BlockStored:
                medium = event.medium.lower()
                for h in event.block_hashes:
                    mediums = held.get(h)
                    if mediums is None:
                        held[h] = {medium}
                    else:
                        mediums.add(medium)
            elif kind is BlockRemoved:
                medium = event.medium.lower()
                for h in event.block_hashes:
                    mediums = held.get(h)
                    if mediums is not None:
                        mediums.discard(medium)
                        if not mediums:
                            del held[h]
            elif kind is AllBlocksCleared:
                held.clear()

    def weighted_prefix(self, keys: Sequence[int], weights: dict[str, float]) -> dict[int, float]:
        """Each replica's longest run of `keys` from the first, each block counted at the largest
        weight of the mediums holding it there (a medium not in `weights`: 1.0): llm-d-kv-cache's
        `LongestPrefixScorer.Score` (pkg/kvcache/kvblock_scorer.go, commit 7be76e1). Replicas
        holding none of the first block are absent (the rest in replica order)."""
        scores: dict[int, float] = {}
        for i, held in enumerate(self.at):
            score, run = 0.0, 0
            for h in keys:
                mediums = held.get(h)
                if mediums is None:
                    break
                score += max(weights.get(m, 1.0) for m in mediums)
                run += 1
            if run:
                scores[i] = score
        return scores

    def overlaps(self, keys: Sequence[int]) -> list[int]:
        """Each replica's count of `keys` it holds consecutively from the first (Dynamo's
        `RadixTree::find_matches` scores, any medium)."""
        counts = []
        for held in self.at:
            n = 0
            for h in keys:
                if h not in held:
                    break
                n += 1
            counts.append(n)
        return counts


class DelayedEvents:
    """KV-event batches in flight to a router's `index`: each becomes visible `delay` seconds after
    its step ended (`ts + delay`), in the order they become due (ties: the order they were sent).

    Each send applies to the index every batch already due by the simulated clock (`clock`), and
    each pick first applies the rest due by then (`apply_due`). Applying them as they come due
    rather than all at the next pick changes nothing the router sees. Engines send a step's batch
    no earlier than the clock (`sim.cluster.event_stream`), so a batch sent at time T is due after
    T. Every batch applied early therefore comes before it in due order, and all of them were due
    by any later pick. It does bound what is held: with picks far apart, for example once the last
    request has arrived, a run held every batch since the last pick, token ids included (gemma-3-27b
    on 4 replicas and 1,000 Mooncake requests: 9,909 batches, 49.5M token ids, 2.3 GB)."""

    def __init__(self, delay: float, index: PrefixIndex, clock: Callable[[], float]):
        self.delay = delay
        self.index = index
        self.clock = clock
        self._heap: list[tuple[float, int, EventBatch]] = []
        self._sent = 0
        self._applied = -math.inf  # the due time of the last batch applied

    def send(self, batch: EventBatch) -> None:
        due = batch.ts + self.delay
        if due < self._applied:  # (never from an engine: it sends no batch behind the clock)
            raise RuntimeError(f"KV events out of order: replica {batch.replica}'s step {batch.step} is due at "
                               f"t={due!r}s, after a batch due at t={self._applied!r}s was applied")
        heapq.heappush(self._heap, (due, self._sent, batch))
        self._sent += 1
        self.apply_due(self.clock())

    def apply_due(self, now: float) -> None:
        """Apply to the index, oldest due first, every batch due at or before `now`; each once."""
        heap, index = self._heap, self.index
        while heap and heap[0][0] <= now:
            self._applied, _, batch = heapq.heappop(heap)
            index.apply(batch)

    def __len__(self) -> int:
        return len(self._heap)
