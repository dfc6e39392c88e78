"""llm-d's approximate prefix-cache index: what the router believes each pod has cached, learnt
only from where it routed each prompt.

Follows llm-d-inference-scheduler (module llm-d-router) at commit 520af47,
pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/: `hashPrompt` (hashing.go)
cuts the prompt text into blocks of block-size x 4 characters, chained; `matchLongestPrefix`
(plugin.go) counts, block by block, the pods that hold each hash; `indexer.Add` (indexer.go) puts a
routed prompt's hashes into the chosen pod's LRU, sized (`makeserver`, autoTune) to the pod's GPU
blocks. The text is kvsim's four characters a token (`sim.cluster.text`). The hash is BLAKE2b-64
where llm-d uses xxhash64: the same chain, other values (only a collision could tell them apart).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from kvsim.sim.cluster.text import CHARS_PER_TOKEN

MAX_PREFIX_BLOCKS = 256  # types.go defaultMaxPrefixBlocks
DEFAULT_LRU_CAPACITY = 31250  # types.go defaultLRUCapacityPerServer: a pod that reports no block count


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class ApproxPrefixIndex:
    """Block hashes of routed prompts, per pod: `hashes` (a prompt's chain), `match` (blocks each
    pod holds, block by block), `add` (a routed prompt into its pod's LRU)."""

    def __init__(self, block_size: int = 16, lru_capacity: int = DEFAULT_LRU_CAPACITY, model: str = "",
                 max_blocks: int = MAX_PREFIX_BLOCKS):
        self.block_chars = block_size * CHARS_PER_TOKEN  # hashPrompt: blockSizeTokens * averageCharactersPerToken
        self.max_blocks = max_blocks
        self.lru_capacity = lru_capacity if lru_capacity > 0 else DEFAULT_LRU_CAPACITY
        self.root_hash = _hash(model.encode())  # the chain starts from the model's name (no cache salt)
        self.hash_to_pods: dict[int, set[int]] = {}  # indexer.hashToPods
        self.pod_lru: dict[int, OrderedDict[int, None]] = {}  # indexer.podToLRU, least recent first

    def hashes(self, text: bytes) -> list[int]:
        """`hashPrompt`: none below one block; the text cut to `max_blocks` blocks; each block's hash
        is hash(block, previous hash as 8 little-endian bytes), a partial last block included."""
        size = self.block_chars
        if len(text) < size:
            return []
        text = text[:self.max_blocks * size]
        out, prev, blake = [], self.root_hash.to_bytes(8, "little"), hashlib.blake2b
        for start in range(0, len(text), size):  # (`_hash`, inline: the chain kept as its bytes)
            prev = blake(text[start:start + size] + prev, digest_size=8).digest()
            out.append(int.from_bytes(prev, "little"))
        return out

    def match(self, hashes: list[int]) -> dict[int, int]:
        """`matchLongestPrefix`: for each hash in order until one no pod holds, one block to every
        pod that holds it (a pod missing an earlier block still counts a later one, as there)."""
        counts: dict[int, int] = {}
        for h in hashes:
            pods = self.hash_to_pods.get(h)
            if not pods:
                break
            for pod in pods:
                counts[pod] = counts.get(pod, 0) + 1
        return counts

    def add(self, hashes: list[int], pod: int) -> None:
        """`indexer.Add`: each hash to the front of the pod's LRU (evicting its least recent beyond
        capacity, which drops the pod from that hash's pods: `makeEvictionFn`, a hash no pod holds
        leaving the map), then the pod to every hash's pods."""
        lru = self.pod_lru.setdefault(pod, OrderedDict())
        capacity, hash_to_pods = self.lru_capacity, self.hash_to_pods
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            if len(lru) > capacity:  # (the eviction callback, inline: a pod's LRU is full once warm)
                old = lru.popitem(last=False)[0]
                pods = hash_to_pods.get(old)
                if pods is not None:
                    pods.discard(pod)
                    if not pods:
                        del hash_to_pods[old]
        for h in hashes:
            pods = hash_to_pods.get(h)
            if pods is None:
                hash_to_pods[h] = {pod}
            else:
                pods.add(pod)

