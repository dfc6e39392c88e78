"""Property-based tests: the manager against a naive reference model, and its invariants.

`RefLRU` re-implements vLLM 0.33's allocation semantics with plain lists (O(n)
everywhere): the free list is the LRU order, a finished request's blocks are
freed tail first, cached ones appended and uncached ones put at the front
(vllm/v1/core/block_pool.py `BlockPool.free_blocks`, since 0.24), a hit on a
free block removes it, reusing a cached block evicts its key. The manager must
agree on every block id, hit and queue order.
"""

import os

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvsim.kvcache.invariants import check
from kvsim.kvcache.manager import KVCacheManager
from kvsim.kvcache.sequence import Sequence

BS = 4
N = 12
PREFIXES = [np.arange(k * 100, k * 100 + 12, dtype=np.int32) for k in range(3)]


def new_seq(uid: int, prefix: int, cut: int, tail: int) -> Sequence:
    """A prompt: the first `cut` tokens of a shared prefix, then `tail` unique tokens."""
    toks = np.concatenate([PREFIXES[prefix][:cut], np.arange(tail, dtype=np.int32) + 5000 + 10 * uid])
    return Sequence(f"s{uid}", toks.astype(np.int32), uid=uid)


class RefLRU:
    def __init__(self, n):
        self.free = list(range(1, n))
        self.ref = [0] * n
        self.key = [None] * n
        self.map: dict[int, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.ncached: dict[str, int] = {}

    def lookup(self, keys, max_blocks):
        out = []
        for k in keys[:max_blocks]:
            if not self.map.get(k):
                break
            out.append(self.map[k][0])
        return out

    def allocate(self, sid, keys, num_tokens_total, hits, num_cacheable):
        table = self.tables.setdefault(sid, [])
        need = -(-num_tokens_total // BS) - len(table) - len(hits)
        need_free = need + sum(1 for b in hits if self.ref[b] == 0)
        if need_free > len(self.free):
            return None
        for b in hits:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        table.extend(hits)
        self.ncached.setdefault(sid, len(hits))
        new = self.free[:need]
        del self.free[:need]
        for b in new:
            if self.key[b] is not None:
                self.map[self.key[b]].remove(b)
                self.key[b] = None
            self.ref[b] = 1
        table.extend(new)
        for i in range(self.ncached[sid], num_cacheable // BS):
            self.key[table[i]] = keys[i]
            self.map.setdefault(keys[i], []).append(table[i])
        self.ncached[sid] = max(self.ncached[sid], num_cacheable // BS)
        return new

    def release(self, sid):
        freed = []
        for b in reversed(self.tables.pop(sid)):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                freed.append(b)
        self.ncached.pop(sid)
        self.free[:0] = [b for b in freed if self.key[b] is None]
        self.free.extend(b for b in freed if self.key[b] is not None)


class LRUAgainstReference(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(N, BS)
        self.ref = RefLRU(N)
        self.live: dict[str, Sequence] = {}
        self.uid = 0

    @rule(prefix=st.integers(0, 2), cut=st.integers(1, 12), tail=st.integers(0, 6))
    def admit(self, prefix, cut, tail):
        self.uid += 1
        s = new_seq(self.uid, prefix, cut, tail)
        blocks, hit = self.m.get_computed_blocks(s)
        keys = s.hashes_upto(s.num_tokens, BS)
        ref_hits = self.ref.lookup(keys, (s.num_tokens - 1) // BS)
        assert [b.block_id for b in blocks] == ref_hits
        new = self.m.allocate_slots(s, s.num_tokens - hit, hit, blocks)
        ref_new = self.ref.allocate(s.seq_id, keys, s.num_tokens, ref_hits, s.num_tokens)
        assert (None if new is None else [b.block_id for b in new]) == ref_new
        if new is not None:
            s.num_computed_tokens = s.num_tokens
            s.append_tokens(1)
            self.live[s.seq_id] = s

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode(self, data):
        sid = data.draw(st.sampled_from(sorted(self.live)))
        s = self.live[sid]
        new = self.m.allocate_slots(s, 1)
        keys = s.hashes_upto(s.num_tokens, BS)
        ref_new = self.ref.allocate(sid, keys, s.num_computed_tokens + 1, [], min(s.num_computed_tokens + 1, s.num_tokens))
        assert (None if new is None else [b.block_id for b in new]) == ref_new
        if new is not None:
            s.num_computed_tokens += 1
            s.append_tokens(1)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.live)))
        self.m.free(self.live.pop(sid))
        self.ref.release(sid)

    @invariant()
    def same_state(self):
        assert self.m.pool.policy.queue.block_ids() == self.ref.free
        check(self.m)


class AllFeatures(RuleBasedStateMachine):
    """Every operation, every policy: the invariants hold throughout."""

    def __init__(self):
        super().__init__()
        self.m = None
        self.live: dict[str, Sequence] = {}
        self.swapped: dict[str, Sequence] = {}
        self.uid = 0

    @precondition(lambda self: self.m is None)
    @rule(policy=st.sampled_from(["lru", "lfu", "fifo", "s3fifo", "cost", "pinned", "arc"]),
          window=st.sampled_from([None, 6]), defrag=st.sampled_from([None, 2]))
    def setup(self, policy, window, defrag):
        self.m = KVCacheManager(N, BS, num_cpu_blocks=8, eviction=policy, sliding_window=window,
                                defrag_threshold=defrag, record_ops=True)

    @precondition(lambda self: self.m is not None)
    @rule(prefix=st.integers(0, 2), cut=st.integers(1, 12), tail=st.integers(0, 6), look=st.integers(0, 3))
    def admit(self, prefix, cut, tail, look):
        self.uid += 1
        s = new_seq(self.uid, prefix, cut, tail)
        blocks, hit = self.m.get_computed_blocks(s)
        assert hit <= s.num_tokens - 1 and hit % BS == 0
        if self.m.allocate_slots(s, s.num_tokens - hit, hit, blocks, look) is not None:
            s.num_computed_tokens = s.num_tokens
            s.append_tokens(1)
            self.live[s.seq_id] = s

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode(self, data):
        s = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if self.m.allocate_slots(s, 1) is not None:
            s.num_computed_tokens += 1
            s.append_tokens(1)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        s = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self.uid += 1
        child = self.m.fork(s, f"s{self.uid}", self.uid)
        self.live[child.seq_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        self.m.free(self.live.pop(data.draw(st.sampled_from(sorted(self.live)))))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        sid = data.draw(st.sampled_from(sorted(self.live)))
        s = self.live[sid]
        if self.m.can_swap_out([s]):
            self.m.swap_out([s])
            self.swapped[sid] = self.live.pop(sid)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        sid = data.draw(st.sampled_from(sorted(self.swapped)))
        s = self.swapped[sid]
        if self.m.can_swap_in([s]).value == "ok":
            self.m.swap_in([s])
            self.live[sid] = self.swapped.pop(sid)

    @precondition(lambda self: self.m is not None)
    @rule()
    def defragment(self):
        self.m.defragment()

    @invariant()
    def consistent(self):
        if self.m is not None:
            check(self.m)
            for s in self.live.values():
                assert len(self.m.req_blocks[s.seq_id]) * BS >= s.num_computed_tokens


# 400 sequences of 25 rules a class each run (4x hypothesis's default; KVSIM_EXAMPLES=20000 runs more on demand).
EXAMPLES = int(os.environ.get("KVSIM_EXAMPLES", "400"))
TestLRUAgainstReference = LRUAgainstReference.TestCase
TestLRUAgainstReference.settings = settings(max_examples=EXAMPLES, stateful_step_count=25, deadline=None)
TestAllFeatures = AllFeatures.TestCase
TestAllFeatures.settings = settings(max_examples=EXAMPLES, stateful_step_count=25, deadline=None)
