"""Fault injection: corrupt an op stream in ways a replay must report as mismatches.

`inject_faults` picks ops to corrupt, round robin over the fault kinds, and keeps a
fault only if the replay must catch it: a shadow replay (`_Shadow`: `gpu.replay`'s
block tables and check points over prefix keys instead of K/V values, no device)
runs the corrupted stream and predicts every mismatch, with the fault that made each
wrong slot wrong. `attribute` matches a real replay's mismatches to the faults
(predictions assume `check_every=1`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import groupby

import numpy as np

from kvsim.gpu.checks import MAX_FOUND
from kvsim.gpu.executor import ONE_WAY, SKIPPED
from kvsim.gpu.tables import BlockTables
from kvsim.gpu.values import prefix_keys
from kvsim.kvcache.ops import Op

FAULT_KINDS = ("copy_dropped", "move_reversed", "move_dropped", "swap_in_wrong", "write_misplaced",
               "reused_while_referenced")
_NO_MOVES = "no move ops: run with --defrag-threshold"
NONE_HINTS = {  # why a stream has no candidate of a kind, and what run would have one
    "copy_dropped": "no copy ops: copy-on-write needs forked sequences (parallel sampling, requests with n > 1)",
    "move_reversed": _NO_MOVES, "move_dropped": _NO_MOVES, "write_misplaced": "no write ops",
    "swap_in_wrong": "no swap_in op after a second CPU block was used: run with --preemption swap and "
                     "--num-cpu-blocks on a cache small enough to preempt",
    "reused_while_referenced": "no block newly given to a sequence alone while another holds blocks",
}
_UNKNOWN = -1  # cause of a wrong slot no injected fault explains
_KEPT = MAX_FOUND * 9 // 10  # mismatches a report surely keeps (`ReplayReport.found`), with a margin
_EVERY_OP = {"copy": ("copy_dropped",), "move": ("move_reversed", "move_dropped"), "write": ("write_misplaced",)}


@dataclass(frozen=True)
class Fault:
    """One injected fault: the op (index into the stream) it corrupts, its step, the step whose check
    first reads the corrupted data back, and the physical blocks it is read from there."""

    kind: str
    index: int
    step: int
    until: int  # the replay must report a mismatch naming one of `blocks` in steps step..until
    blocks: tuple[int, ...]
    what: str


@dataclass(frozen=True)
class _Seen:
    """A predicted mismatch (one sequence's check in one step): its wrong blocks, and by cause (fault op index)."""

    step: int
    causes: dict[int, frozenset[int]]
    blocks: frozenset[int]


class _Shadow:
    """The replayer without data: block tables, a prefix key per slot (0: never written) and the
    fault (its op index) that made the slot wrong (-1: none); each fault is made as its op comes up."""

    def __init__(self, ops: Sequence[Op], tokens: Mapping[str, np.ndarray], block_size: int,
                 uses: Mapping[int, list[int]]):
        self.ops, self.tokens, self.bs, self.uses = list(ops), tokens, block_size, uses
        n_gpu = max(uses, default=0) + 1
        n_cpu = max((op.b if op.kind == "swap_out" else op.a for op in ops
                     if op.kind in ("swap_out", "swap_in")), default=0) + 1
        self.glab, self.gsrc = np.zeros(n_gpu * block_size, np.uint64), np.full(n_gpu * block_size, -1)
        self.clab, self.csrc = np.zeros(n_cpu * block_size, np.uint64), np.full(n_cpu * block_size, -1)
        self.tables = BlockTables()
        self.keys: dict[str, np.ndarray] = {}
        self.dirty: set[int] = set()  # GPU blocks holding a slot some fault made wrong
        self.taint_at: dict[int, np.ndarray] = {}  # fault op index -> the GPU slots it makes wrong
        self.hot: dict[int, tuple[int, int]] = {}  # block -> (fault, last op index): writes there are wrong
        self.cpu_used: set[int] = set()
        self.seen: list[_Seen] = []
        self.made: dict[int, str] = {}  # fault op index -> description
        self.horizon = len(ops)  # ops past the mismatches a report keeps

    def run(self, plans: Mapping[int, tuple[str, int]]) -> None:
        """Replay, making fault (kind, seed) at each planned op index (if it can be made there); checks
        start at the first fault (a stream is right before it), only of sequences holding a dirty block."""
        first = min(plans, default=len(self.ops))
        for step, group in groupby(range(len(self.ops)), key=lambda i: self.ops[i].step):
            written: dict[str, int] = {}  # seq -> its newest position written in the step
            for i in group:
                if i in plans and (what := _MAKE[plans[i][0]](self, i, np.random.default_rng([plans[i][1], i]))):
                    self.made[i] = what
                self._op(i, step, written, i >= first)
            if written and i >= first:
                self._check(step, written)
            if len(self.seen) >= _KEPT:  # what comes after, the replay's report would not keep
                self.horizon = i + 1
                return

    def _op(self, i: int, step: int, written: dict[str, int], check: bool) -> None:
        op, bs = self.ops[i], self.bs
        k = op.kind
        if k == "write":
            n = op.c - op.b
            slots = op.a * bs + np.arange(op.b, op.c)
            self.glab[slots] = self._keys(op.seq)[op.pos : op.pos + n]
            hot = self.hot.get(op.a)
            self.gsrc[slots] = hot[0] if hot and i <= hot[1] else -1
            self._mark(op.a)
            written[op.seq] = max(written.get(op.seq, -1), op.pos + n - 1)
        elif k == "table":
            self.tables.set(op.seq, op.b, op.a)
        elif k == "free":
            due = sorted(s for s in self.tables.holders.get(op.a, ()) if s in written)
            if due and check:
                self._check(step, {s: written[s] for s in due})
            for s in due:
                del written[s]
            self.tables.free(op.a)
        elif k in ("copy", "swap_out", "swap_in", "move"):
            if k == "move":
                self.tables.exchange(op.a, op.b)
            if op.c != SKIPPED:
                self._pair(k, op.a, op.b, op.c == ONE_WAY)
        if i in self.taint_at:
            self.gsrc[self.taint_at[i]] = i
            self.dirty.update((self.taint_at[i] // bs).tolist())

    def _pair(self, kind: str, a: int, b: int, one_way: bool) -> None:
        ga, gb = self._span(a), self._span(b)
        if kind == "copy" or one_way:
            src, dst = (gb, ga) if one_way else (ga, gb)
            self.glab[dst], self.gsrc[dst] = self.glab[src], self.gsrc[src]
            self._mark(b if kind == "copy" else a)
        elif kind == "swap_out":
            self.clab[gb], self.csrc[gb] = self.glab[ga], self.gsrc[ga]
            self.cpu_used.add(b)
        elif kind == "swap_in":
            self.glab[gb], self.gsrc[gb] = self.clab[ga], self.csrc[ga]
            self._mark(b)
        else:  # move: an exchange
            for arr in (self.glab, self.gsrc):
                arr[ga], arr[gb] = arr[gb].copy(), arr[ga].copy()
            self._mark(a), self._mark(b)

    def _mark(self, block: int) -> None:  # keep `dirty` right for `block` after its slots changed
        (self.dirty.add if (self.gsrc[self._span(block)] >= 0).any() else self.dirty.discard)(block)

    def _span(self, block: int) -> slice:
        return slice(block * self.bs, (block + 1) * self.bs)

    def _keys(self, seq: str) -> np.ndarray:
        if (keys := self.keys.get(seq)) is None:
            if seq not in self.tokens:
                raise ValueError(f"op_tokens.parquet: no tokens for sequence {seq!r}")
            keys = self.keys[seq] = prefix_keys(self.tokens[seq])
        return keys

    def _check(self, step: int, written: Mapping[str, int]) -> None:
        """What `gpu.replay._verify` reports for the written sequences that hold a dirty block."""
        bs = self.bs
        for seq, newest in written.items():
            if self.dirty.isdisjoint(self.tables.rows.get(seq, ())):
                continue
            pos, blocks, missing = self.tables.slots(seq, newest + 1, bs)
            if missing >= 0:  # a "table" mismatch, naming no block
                self.seen.append(_Seen(step, {_UNKNOWN: frozenset()}, frozenset()))
                continue
            slots = blocks * bs + pos % bs
            wrong = np.flatnonzero(self.glab[slots] != self._keys(seq)[pos])
            if wrong.size:
                causes: dict[int, set[int]] = {}
                for b, c in zip(blocks[wrong].tolist(), self.gsrc[slots[wrong]].tolist(), strict=True):
                    causes.setdefault(c, set()).add(b)
                self.seen.append(_Seen(step, {c: frozenset(b) for c, b in causes.items()}, frozenset().union(*causes.values())))

    def whole(self, *blocks: int) -> np.ndarray:  # every slot of `blocks`
        return np.concatenate([np.arange(b * self.bs, (b + 1) * self.bs) for b in blocks])


def _marked(mark: int, what: str):
    """A fault that sets a pair op's fault marker (`gpu.executor`): its data op skipped or one way."""

    def make(sh: _Shadow, i: int, rng: np.random.Generator) -> str:
        op = sh.ops[i]
        sh.ops[i] = replace(op, c=mark)
        sh.taint_at[i] = sh.whole(op.a, op.b) if op.kind == "move" else sh.whole(op.b)
        return what.format(a=op.a, b=op.b)

    return make


def _swap_in_wrong(sh: _Shadow, i: int, rng: np.random.Generator) -> str | None:
    """Read another CPU block, one that holds different data now."""
    op = sh.ops[i]
    other = [c for c in sorted(sh.cpu_used - {op.a}) if (sh.clab[sh._span(c)] != sh.clab[sh._span(op.a)]).any()]
    if not other:
        return None
    c = int(rng.choice(other))
    sh.ops[i] = replace(op, a=c)
    sh.taint_at[i] = sh.whole(op.b)
    return f"swap-in to GPU block {op.b} read CPU block {c} instead of {op.a}"


def _write_misplaced(sh: _Shadow, i: int, rng: np.random.Generator) -> str:
    """Shift the slots within the block, or write the same slots of a block another sequence holds."""
    op, bs = sh.ops[i], sh.bs
    shifts = [d for d in range(-op.b, bs - op.c + 1) if d]
    held = sorted(b for b, s in sh.tables.holders.items() if s and b != op.a)
    if shifts and (not held or rng.random() < 0.5):
        a, d = op.a, int(rng.choice(shifts))
    else:
        a, d = int(rng.choice(held or [b for b in range(1, len(sh.glab) // bs) if b != op.a])), 0
    sh.ops[i] = replace(op, a=a, b=op.b + d, c=op.c + d)
    sh.taint_at[i] = np.concatenate([op.a * bs + np.arange(op.b, op.c), a * bs + np.arange(op.b + d, op.c + d)])
    return (f"write of {op.seq!r} positions {op.pos}..{op.pos + op.c - op.b - 1} to block {a} slots "
            f"{op.b + d}..{op.c + d - 1} instead of block {op.a} slots {op.b}..{op.c - 1}")


def _reused(sh: _Shadow, i: int, rng: np.random.Generator) -> str | None:
    """Sequence Z's new block W becomes X, a block another live sequence Y holds, in Z's table op
    and in all Z's ops on W up to W's free; X must stay held (no free, no move) as long."""
    op, ops = sh.ops[i], sh.ops
    z, w = op.seq, op.a
    end = _lifetime(ops, sh.uses, i)
    options = [x for x, seqs in sorted(sh.tables.holders.items()) if seqs and x != w and z not in seqs
               and not any(ops[j].kind in ("free", "move") for j in _between(sh.uses.get(x, []), i, end))]
    if not options:
        return None
    x = int(rng.choice(options))
    for j in _between(sh.uses[w], i, end):
        if ops[j].kind in ("table", "write") and ops[j].a == w:
            ops[j] = replace(ops[j], a=x)
    sh.hot[x] = (i, end)
    return (f"{z!r} given block {x}, still held by {min(sh.tables.holders[x])!r}, instead of new block {w} "
            f"(and its ops on {w} to step {ops[end].step})")


_MAKE = {"copy_dropped": _marked(SKIPPED, "copy-on-write copy of block {a} to block {b} not run"),
         "move_reversed": _marked(ONE_WAY, "defrag move {a} <-> {b} done one way: {b} copied onto {a}"),
         "move_dropped": _marked(SKIPPED, "defrag move {a} <-> {b} not run"),
         "swap_in_wrong": _swap_in_wrong, "write_misplaced": _write_misplaced, "reused_while_referenced": _reused}


def _lifetime(ops: Sequence[Op], uses: Mapping[int, list[int]], i: int) -> int:
    """Index of the free of op i's block after i (the last op if none)."""
    return next((j for j in _between(uses[ops[i].a], i + 1, len(ops)) if ops[j].kind == "free"), len(ops) - 1)


def _between(indices: list[int], first: int, last: int) -> list[int]:  # sorted `indices` in [first, last]
    return indices[bisect_left(indices, first) : bisect_right(indices, last)]


def _candidates(ops: Sequence[Op], uses: Mapping[int, list[int]]) -> dict[str, list[int]]:
    """Op indices each kind could corrupt (the shadow replay then says whether it is caught)."""
    found: dict[str, list[int]] = {k: [] for k in FAULT_KINDS}
    tables, cpu = BlockTables(), set()
    for i, op in enumerate(ops):
        k = op.kind
        for kind in _EVERY_OP.get(k, ()):
            found[kind].append(i)
        if k == "move":
            tables.exchange(op.a, op.b)
        elif k == "swap_out":
            cpu.add(op.b)
        elif k == "swap_in" and cpu - {op.a}:
            found["swap_in_wrong"].append(i)
        elif k == "free":
            tables.free(op.a)
        elif k == "table":
            if op.a > 0 and not tables.holders.get(op.a) and any(s != op.seq for s in tables.rows) \
                    and _alone(ops, uses, i):
                found["reused_while_referenced"].append(i)
            tables.set(op.seq, op.b, op.a)
    return found


def _alone(ops: Sequence[Op], uses: Mapping[int, list[int]], i: int) -> bool:
    """Whether op i's sequence alone names its block, only in table and write ops, until the block's free."""
    seq, end = ops[i].seq, _lifetime(ops, uses, i)
    return all(ops[j].kind in ("table", "write") and ops[j].seq == seq for j in _between(uses[ops[i].a], i, end - 1))


def _uses(ops: Sequence[Op]) -> dict[int, list[int]]:
    """GPU block -> indices of the ops naming it (as `gpu.replay._sizes` reads them), in order."""
    uses: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        k = op.kind
        for b in {op.a, op.b} if k in ("copy", "move") else {op.b} if k == "swap_in" else {op.a} - {0}:
            uses.setdefault(b, []).append(i)
    return uses


def inject_faults(ops: Sequence[Op], n: int, seed: int, kinds: Sequence[str] = FAULT_KINDS, *,
                  tokens: Mapping[str, np.ndarray], block_size: int) -> tuple[list[Op], list[Fault]]:
    """Corrupt `n` ops of `ops` (a new list of `Op`; `ops` is kept); the faults in stream order.

    Kinds take turns (the one with fewest faults so far), each fault a random candidate (seeded)
    on a step no other fault has. The shadow replay of all faults together drops any not caught
    (no mismatch names a block it made wrong) or ambiguous (its blocks overlap another's, or a
    mismatch naming them in its steps step..until is not its own); others take their places.
    `tokens` and `block_size` are the run's (`gpu.replay.load_run`): what the replay compares with."""
    unknown = [k for k in kinds if k not in FAULT_KINDS] or ([] if kinds else [""])
    if unknown:
        raise ValueError(f"unknown fault kind {unknown[0]!r}; choose from {', '.join(FAULT_KINDS)}")
    if n < 1:
        raise ValueError(f"the number of faults must be >= 1, got {n}")
    ops = [op if isinstance(op, Op) else Op(*op) for op in ops]  # records, or tuples in their field order
    found = _candidates(ops, uses := _uses(ops))
    rng = np.random.default_rng(seed)
    queues = {k: [int(i) for i in rng.permutation(found[k])] for k in kinds}
    plans: dict[int, tuple[str, int]] = {}  # op index -> (kind, seed)
    horizon = len(ops)
    while True:
        _refill(plans, queues, n, ops, seed, horizon)
        sh, faults, bad, groups = _judge(ops, tokens, block_size, uses, plans)
        horizon = sh.horizon
        for group in groups:  # drop the one whose kind has the most candidates left
            if not group & bad:
                bad.add(max(group, key=lambda i: (len(queues[plans[i][0]]), i)))
        if not bad:
            break
        for i in bad:
            del plans[i]
    if len(faults) < n:
        raise ValueError(_shortfall(n, kinds, found, list(faults.values())))
    return sh.ops, list(faults.values())


def _refill(plans: dict[int, tuple[str, int]], queues: Mapping[str, list[int]], n: int, ops: Sequence[Op],
            seed: int, horizon: int) -> None:
    """Add candidates up to `n`: of the kind with fewest planned (then fewest left), the next one
    before `horizon` on a step no planned fault has (the others wait their turn)."""
    steps = {ops[i].step for i in plans}
    while len(plans) < n:
        free = {k: [j for j, i in enumerate(q) if i < horizon and ops[i].step not in steps] for k, q in queues.items()}
        if not (open_ := [k for k in queues if free[k]]):
            return
        kind = min(open_, key=lambda k: (sum(p[0] == k for p in plans.values()), len(queues[k])))
        i = queues[kind].pop(free[kind][-1])
        plans[i] = (kind, seed)
        steps.add(ops[i].step)


def _judge(ops: Sequence[Op], tokens: Mapping[str, np.ndarray], block_size: int, uses: Mapping[int, list[int]],
           plans: Mapping[int, tuple[str, int]]) -> tuple[_Shadow, dict[int, Fault], set[int], list[set[int]]]:
    """Replay all planned faults in the shadow: the faults made and caught, the planned ones to drop,
    and groups of faults of which one must go (ambiguous together)."""
    sh = _Shadow(ops, tokens, block_size, uses)
    sh.run(plans)
    first: dict[int, int] = {}  # fault -> its first mismatch (index into sh.seen)
    for k, m in enumerate(sh.seen):
        for i in m.causes:
            first.setdefault(i, k)
    bad = {i for i in plans if first.get(i, _KEPT) >= _KEPT}  # not made, or not caught in what a report keeps
    faults = {}
    for i in sorted(set(first) - bad - {_UNKNOWN}):
        until = sh.seen[first[i]].step
        blocks = frozenset().union(*(m.causes.get(i, ()) for m in sh.seen if m.step == until))
        faults[i] = Fault(plans[i][0], i, ops[i].step, until, tuple(sorted(blocks)), sh.made[i])
    groups = [{i, j} for i in faults for j in faults if i < j and set(faults[i].blocks) & set(faults[j].blocks)]
    for m in sh.seen:
        if _UNKNOWN in m.causes:  # wrong, but by no fault: blame the latest one before
            bad |= {max((i for i in sh.made if ops[i].step <= m.step), default=_UNKNOWN)} - {_UNKNOWN}
        for i, f in faults.items():
            if f.step <= m.step <= f.until and m.blocks.intersection(f.blocks) and i not in m.causes:
                groups.append({i, *m.causes} - {_UNKNOWN})  # another fault's mismatch would be credited to i
    return sh, faults, bad, groups


def _shortfall(n: int, kinds: Sequence[str], found: Mapping[str, list[int]], faults: Sequence[Fault]) -> str:
    """Why fewer than `n` faults could be injected: how many could, and which kinds had no candidate."""
    made = [f.kind for f in faults]
    have = ", ".join(f"{k} {made.count(k)}" for k in kinds if made.count(k))
    why = f"cannot inject {n} fault{'s' if n > 1 else ''}: " + (
        f"only {len(made)} caught and unambiguous in this stream ({have})" if made
        else "no fault of the kinds asked for would be caught in this stream")
    return why + "".join(f"; {k}: {NONE_HINTS[k]}" for k in kinds if not found[k])


def attribute(faults: Sequence[Fault], report) -> list[bool]:
    """Per fault, whether the replay caught it: a mismatch (`report.found`, gpu.verify.Mismatch) in
    the fault's steps step..until naming one of its blocks. Sound for faults from `inject_faults`,
    which keeps only faults no other fault's mismatch could be credited to."""
    found = [(m.step, set(m.blocks)) for m in report.found]
    return [any(f.step <= step <= f.until and blocks.intersection(f.blocks) for step, blocks in found)
            for f in faults]


def format_faults(faults: Sequence[Fault], caught: Sequence[bool] | None = None) -> str:
    """The injected faults as a table, one line each, with caught/MISSED when known."""
    lines = [f"{'#':>3} {'kind':<24} {'op':>8} {'steps':>13}  {'blocks':<16} {'':<7} what"]
    for k, f in enumerate(faults):
        mark = "" if caught is None else ("caught" if caught[k] else "MISSED")
        lines.append(f"{k + 1:>3} {f.kind:<24} {f.index:>8} {f'{f.step}..{f.until}':>13}  "
                     f"{','.join(map(str, f.blocks)):<16} {mark:<7} {f.what}")
    if caught is not None:
        lines.append(f"caught {sum(caught)} of {len(faults)} injected faults")
    return "\n".join(lines)
