"""The replay's checks: after a step, each written sequence read back through its block table.

Every position of the sequence, 0 up to its newest token, is compared bit-exactly
with the values its prefix implies (`gpu.values`); decode sequences (one new
token) also run paged decode attention against dense attention over the expected
K/V. With `touched`, only the table entries a data or table op changed since the
sequence's last check are read (plus its newest, partial one): exact as long as
nothing but the replayed ops writes the storage, where the full read trusts nothing.

With hybrid KV-cache groups each table is one (sequence, group) (`gpu.replay`):
a sliding window's decode attention runs over its window, a chunked local
group's is not checked (the kernels know no chunks; its K/V is), and a Mamba
group's table is checked by its current state page, read whole (`_verify_states`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import numpy as np
import torch

from kvsim.gpu.executor import OpExecutor
from kvsim.gpu.expected import ExpectedKV
from kvsim.gpu.report import ReplayReport
from kvsim.gpu.storage import PagedKVStorage
from kvsim.gpu.tables import BlockTables
from kvsim.gpu.timing import Timer
from kvsim.gpu.values import DeviceValues, device_keys
from kvsim.gpu.verify import (
    IntegrityError,
    Mismatch,
    attention_errors,
    compare_kv,
    dense_decode,
    first_bad,
)

MAX_ERRORS = 10
MAX_FOUND = 10_000
CHECKS = ("full", "touched")


class Checks:
    """What a replay verifies, and how: the storage, the tables and the expected values it reads."""

    def __init__(self, st: PagedKVStorage, tables: BlockTables, values: DeviceValues, keys: Mapping[str, np.ndarray],
                 ex: OpExecutor, timer: Timer, report: ReplayReport, *, window: int | None, num_heads: int,
                 attention_layers: int, strict: bool, touched: bool, attention_sample: int | None = None):
        self.st, self.tables, self.values, self._keys, self.ex, self.timer = st, tables, values, keys, ex, timer
        self.kernels = ex.kernels
        self.report, self.window, self.num_heads, self.strict = report, window, num_heads, strict
        self.attention_layers = attention_layers
        # at most this many of a step's decodes compared against dense attention, taken in turn
        # (None: all); the kernel still runs on every decode, and their K/V is checked either way
        self.attention_sample = attention_sample
        self._turn = 0  # comparisons taken so far
        self._last: dict[str, int] = {}  # a sequence's latest comparison (its turn)
        self._budget = (-1, 0)  # (step, comparisons it has left): a step may verify in several calls
        self.bs = st.block_size
        self.expected = ExpectedKV(values, keys.__getitem__, st.device)
        self.dirty: defaultdict[str, set[int]] | None = defaultdict(set) if touched else None
        self.windows: dict[str, int | None] = {}  # a table's attention window, where not `window` (hybrid groups)
        self.local: set[str] = set()  # tables of chunked local groups (no decode attention check)
        self.states: set[str] = set()  # tables of Mamba groups (pages checked whole)

    def kind(self, table: str, kind: str, window: int | None) -> None:
        """Table `table` belongs to a KV-cache group of `kind` with `window` (`kvcache.groups`)."""
        if kind == "mamba":
            self.states.add(table)
        elif kind == "chunked_local":
            self.local.add(table)
        else:
            self.windows[table] = window if kind == "sliding_window" else None

    # ------------------------------------------------------ touched entries
    def touch(self, block: int) -> None:
        """`block`'s slots changed: every entry holding it is re-read at its sequence's next check."""
        if self.dirty is not None:
            for seq, entries in self.tables.entries(block):
                self.dirty[seq].update(entries)

    def retable(self, seq: str, entry: int) -> None:
        """`seq`'s entry now names another block."""
        if self.dirty is not None:
            self.dirty[seq].add(entry)

    def drop(self, seq: str) -> None:
        """`seq`'s blocks were freed: forget it."""
        self.expected.drop(seq)
        self._last.pop(seq, None)
        if self.dirty is not None:
            self.dirty.pop(seq, None)

    def _touched(self, seq: str, extent: int) -> tuple[np.ndarray, np.ndarray]:
        """The positions below `extent` of `seq`'s touched entries, and their blocks; entries wholly
        below `extent` are clean after."""
        dirty = self.dirty.get(seq)
        bs, pages = self.bs, -(-extent // self.bs)
        pos, blocks = [], []
        if dirty:
            row = self.tables.rows[seq]
            for e in sorted(dirty):
                if e < pages and row[e] > 0:
                    lo, hi = e * bs, min(extent, e * bs + bs)
                    pos.append(np.arange(lo, hi, dtype=np.int64))
                    blocks.append(np.full(hi - lo, row[e], dtype=np.int64))
            self.dirty[seq] = {e for e in dirty if e >= pages - 1}
        if not pos:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(pos), np.concatenate(blocks)

    # -------------------------------------------------------------- checks
    def verify(self, step: int, written: Mapping[str, list[int]]) -> None:
        """Check each written sequence's K/V (all of them in one pass, one device sync), then
        decode attention for the one-token ones."""
        rep, bs, st = self.report, self.bs, self.st
        if self.states and not self.states.isdisjoint(written):
            self._verify_states(step, {s: w for s, w in written.items() if s in self.states})
            written = {s: w for s, w in written.items() if s not in self.states}
        checks = []  # (seq, tokens this step, extent, positions read, their blocks)
        decodes = []  # (seq, extent, every position, its blocks; None where attention is not compared)
        compared = self._compared(step, written)
        for seq, (n_new, newest) in written.items():
            extent = newest + 1
            rep.sequence_checks += 1
            # every position is read for a full check, and for a decode whose attention output is
            # compared (its span); the decode kernel alone needs only the table
            if self.dirty is None or seq in compared:
                pos, blocks, missing = self.tables.slots(seq, extent, bs)
            else:
                pos = blocks = None
                missing = self.tables.first_unset(seq, extent, bs)
            if missing >= 0:
                self.mismatch(1, Mismatch(step, seq, missing, "table", entry=missing // bs))
                continue
            if n_new == 1:
                decodes.append((seq, extent, pos, blocks))
            if self.dirty is not None:
                pos, blocks = self._touched(seq, extent)
            checks.append((seq, n_new, extent, pos, blocks))
        if not checks:
            return
        pos = np.concatenate([c[3] for c in checks])
        slots = torch.from_numpy(np.concatenate([c[4] for c in checks]) * bs + pos % bs).to(st.device)
        rep.tokens_verified += len(pos)
        if self.kernels.derives_expected:  # the fused kernel derives each value from its key
            planes = st.gpu.view(st.num_layers * 2, -1, st.num_kv_heads * st.head_dim)
            keys = np.concatenate([self._keys[c[0]][c[3]] for c in checks])
            wrong = self.kernels.any_wrong(planes, slots, device_keys(keys, st.device), self.values.kv_salts, st.scales)
        else:
            expected = torch.cat([self.expected.at(c[0], c[3], c[2]) for c in checks], dim=2)
            wrong = not torch.equal(st.gather(slots), expected)
        bad = set()
        if wrong:
            for seq, _, extent, p, b in checks:
                expected = self.expected.at(seq, p, extent).permute(2, 0, 1, 3, 4)
                n_bad, first = compare_kv(st, p, b, expected, step=step, seq=seq)
                if first is not None:
                    bad.add(seq)
                    self.mismatch(n_bad, first)
                    if self.dirty is not None:  # a wrong entry stays under watch, as a full read would
                        self.dirty[seq].update(np.unique(p // bs).tolist())
        decodes = [d for d in decodes if d[0] not in bad and d[0] not in self.local]
        if not self.windows:
            if decodes:
                self._check_decodes(step, decodes, self.window, compared)
            return
        by_window: dict[int | None, list] = {}
        for d in decodes:
            by_window.setdefault(self.windows.get(d[0], self.window), []).append(d)
        for window, group in by_window.items():
            self._check_decodes(step, group, window, compared)

    def _compared(self, step: int, written: Mapping[str, list[int]]) -> set[str]:
        """The decodes (one new token) whose attention output this check compares: every one, or
        while the step has `attention_sample` comparisons left, that many, those compared longest
        ago first (never before, first of all; ties in written order). A step may check in several
        calls: a sequence before its blocks are freed, then the rest."""
        if not self.attention_layers:
            return set()
        ones = [s for s, (n_new, _) in written.items() if n_new == 1 and s not in self.local]
        if self.attention_sample is None:
            return set(ones)
        at, left = self._budget if self._budget[0] == step else (step, self.attention_sample)
        k = min(left, len(ones))
        self._budget = (at, left - k)
        if k < len(ones):
            ones = sorted(ones, key=lambda s: self._last.get(s, -1))[:k]
        for s in ones:
            self._last[s], self._turn = self._turn, self._turn + 1
        return set(ones)

    def _verify_states(self, step: int, written: Mapping[str, list[int]]) -> None:
        """Each written Mamba table's current state page (the entry of its newest position), read
        whole: every slot must hold the value of the state it stands for (`gpu.values`)."""
        bs, st = self.bs, self.st
        for table, (_, newest) in written.items():
            self.report.sequence_checks += 1
            entry = newest // bs
            row = self.tables.rows.get(table, ())
            block = row[entry] if entry < len(row) else -1
            if block <= 0:
                self.mismatch(1, Mismatch(step, table, newest, "table", entry=entry))
                continue
            state = np.full(bs, self._keys[table][newest], dtype=np.uint64)
            expected = self.values.kv(device_keys(state, st.device))
            n_bad, first = compare_kv(st, entry * bs + np.arange(bs, dtype=np.int64), np.full(bs, block, np.int64),
                                      expected, step=step, seq=table)
            self.report.tokens_verified += bs
            if first is not None:
                self.mismatch(n_bad, first)

    def _check_decodes(self, step: int, decodes: list[tuple[str, int, np.ndarray, np.ndarray]],
                       window: int | None, compared: set[str]) -> None:
        """Paged decode attention on every layer, all decodes in one batch; on the first
        `attention_layers` layers, the output of those `compared` against dense attention over the
        expected K/V (never read from the storage)."""
        st, rep, bs = self.st, self.report, self.bs
        # positions attended: the window's, all non-null (only blocks wholly outside it are dropped)
        rep.units["attention"] += sum(min(n, window or n) for _, n, _, _ in decodes)
        n_layers = min(self.attention_layers, st.num_layers)
        if not self.kernels.measures:  # a kernel run only to be compared: only where it is
            decodes = [d for d in decodes if d[0] in compared] if n_layers else []
        if not decodes:
            return
        seqs = [d[0] for d in decodes]
        ctx = [d[1] for d in decodes]
        pages = max(-(-n // bs) for n in ctx)
        # each row's pages (a never-set -1 read as the null block 0); numpy takes a long row's list
        # several times faster than a Python loop over it, at every decode step of a long context
        rows = np.zeros((len(decodes), pages), dtype=np.int32)
        for i, (seq, n, _, _) in enumerate(decodes):
            row = np.asarray(self.tables.rows[seq][: -(-n // bs)], dtype=np.int32)
            np.maximum(row, 0, out=rows[i, : len(row)])
        tables = torch.from_numpy(rows).to(st.device)
        ctx_t = torch.tensor(ctx, dtype=torch.int32, device=st.device)
        last = np.array([self._keys[s][n - 1] for s, n in zip(seqs, ctx, strict=True)], dtype=np.uint64)
        q = self.values.query(device_keys(last, st.device))  # [B, layers, heads, dim]
        with self.timer(step, "attention"):
            out = self.kernels.decode(q, st, tables, ctx_t, window, max(ctx), n_layers)
        self.ex.launches += self.timer.launched(step, "attention", self.kernels.decode_launches(st, n_layers))
        if not n_layers:
            return
        picked = [i for i, d in enumerate(decodes) if d[0] in compared]
        if not picked:
            return
        if len(picked) < len(decodes):
            out, q = out[picked], q[picked]
            decodes, seqs, ctx = [decodes[i] for i in picked], [seqs[i] for i in picked], [ctx[i] for i in picked]
        # each sequence's attended positions (right-aligned in a padded [B, span] grid below)
        spans = [pos[pos >= n - window] if window else pos for _, n, pos, _ in decodes]
        span = max(len(x) for x in spans)
        b, layers = len(decodes), n_layers
        kv = torch.zeros((b, layers, 2, span, st.num_kv_heads, st.head_dim), dtype=torch.float32, device=st.device)
        valid = torch.zeros((b, span), dtype=torch.bool, device=st.device)
        for i, ((seq, n, _, _), x) in enumerate(zip(decodes, spans, strict=True)):
            kv[i, :, :, span - len(x):] = self.expected.at(seq, x, n)[:layers]
            valid[i, span - len(x):] = True
        fold = kv.view(b * layers, 2, span, st.num_kv_heads, st.head_dim)
        ref = dense_decode(q[:, :layers].reshape(b * layers, self.num_heads, st.head_dim).float(),
                           fold[:, 0], fold[:, 1], valid.repeat_interleave(layers, 0))
        errs = attention_errors(out[:, :layers].reshape(b * layers, self.num_heads, -1), ref)
        first = first_bad(errs.view(b, layers, -1).transpose(0, 1), st.compute_dtype, step=step, seqs=seqs,
                          positions=[n - 1 for n in ctx])
        if first is not None:
            self.mismatch(*first)
        rep.decode_checks += len(decodes)

    def mismatch(self, n: int, first: Mismatch) -> None:
        """Count `n` wrong positions (or heads) whose first is `first`; raise it when strict."""
        if self.strict:
            raise IntegrityError(first.message())
        self.report.mismatches += n
        if len(self.report.found) < MAX_FOUND:
            self.report.found.append(first)
        if len(self.report.errors) < MAX_ERRORS:
            self.report.errors.append(first.message())
