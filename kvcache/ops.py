"""Block operations: the contract between the block manager and the hardware.

Every physical effect of a manager decision is one typed record, in order:

| kind       | a          | b          | c      | seq  | meaning                                 |
| ---------- | ---------- | ---------- | ------ | ---- | --------------------------------------- |
| `write`    | block      | first slot | end    | seq  | new K/V for slots [first, end) of block; `pos` = position of slot `first` |
| `copy`     | src block  | dst block  |        |      | copy-on-write of a shared partial block |
| `swap_out` | gpu block  | cpu block  |        |      | preemption by swapping, GPU -> CPU      |
| `swap_in`  | cpu block  | gpu block  |        |      | resume a swapped request, CPU -> GPU    |
| `move`     | src block  | dst block  |        |      | defrag: contents of src and dst exchanged |
| `free`     | block      |            |        |      | ref count reached 0 (no data movement)  |
| `evict`    | block      |            |        |      | cached block reused; `hash` is its key  |
| `table`    | block      | index      |        | seq  | seq's block-table entry `index` is now `block` (0: null) |
| `store`    | gpu block  | host block |        | seq  | KV offloading: a computed block copied to the host tier |
| `load`     | host block | gpu block  |        | seq  | KV offloading: a block loaded back from the host tier |
| `file_write` | host block | file block |      | seq  | the file tier: a host block copied to its chunk's file |
| `file_read`  | file block | host block |      | seq  | the file tier: a file block promoted into the host tier |

`table` ops carry no data: they let a replayer keep every request's block
table (prefix hits, forks and swap-ins change tables without a write).
Every op also carries its `group`, the KV-cache group whose table or pages it
concerns: 0 for the one-group manager (and for KV offloading's transfers); with
vLLM's hybrid groups (`kvcache.hybrid`) each group keeps its own table per
sequence over the one pool, a `free` or `evict` carries the group that last held
the block, and a write in a Mamba group stands for the state after token
`pos + c - b - 1` (the page is one opaque state, not slots).
`step` is the engine step (or replay iteration) the op belongs to. GPU block
ids are physical: with the online defragmenter on, the manager's ids are
mapped through its forward table, and a `move` exchanges the contents of two
physical blocks (the mapping is updated on the manager side at the same time).
Counters per kind are always kept; full records only when `enabled`.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np

from kvsim.kvcache.op_files import (  # noqa: F401 (Op and the readers are re-exported)
    COLUMNS,
    KINDS,
    LATE_INTS,
    MARK,
    META,
    OPS_VERSION,
    OPS_WRITE,
    RUN_INTS,
    SEG_EDGE,
    SEG_EXPLICIT,
    SEG_PLAIN,
    SEG_SPAN,
    SEG_TABLE,
    TOKENS_WRITE,
    LateRuns,
    Op,
    Runs,
    as_rows,
    ops_table,
    pack_hashes,
    pack_ints,
    read_op_rows,
    read_ops,
    read_tokens,
    table_rows,
    token_ids,
    tokens_dict,
    tokens_table,
)
from kvsim.kvcache.op_writer import Sink

CHARGED_KINDS = ("copy", "swap_out", "swap_in", "move")  # the kinds a step's time is charged for (data movement)
_GPU_A = frozenset(("write", "copy", "swap_out", "free", "evict", "table", "store"))  # kinds whose `a` is a GPU block
_GPU_B = frozenset(("copy", "swap_in", "load"))
_CODE = {k: i for i, k in enumerate(KINDS)}  # kind -> its code in a pending row
_WRITE, _FREE, _EVICT, _TABLE = (_CODE[k] for k in ("write", "free", "evict", "table"))
CHUNK_ROWS = 1 << 18  # rows of a chunk of the op log
TOKEN_CHUNK = 1 << 22  # token ids kept before they are written out


def _split(items: list, i: int) -> tuple[list, list]:
    """`items[:i]` and `items[i:]`, the first being `items` itself (its tail cut off), so that only
    the tail is copied."""
    tail = items[i:]
    del items[i:]
    return items, tail


class OpLog:
    """Collects ops as they are decided; cheap counters always, records on demand.

    Records are kept in chunks of about `chunk_rows` rows, as compact columns, or
    streamed to `ops.parquet` and `op_tokens.parquet` in a folder (`stream_to`).
    A chunk is cut when the step advances (`step` is set) past `chunk_rows` rows.
    Late writes (`late_writes`: the lazy decodes of sim.engine.shortcuts) carry a
    step up to `lag` steps before the current one; rows keep their emission order, a
    late write of step s merged in where step s's schedule's rows end (with the sync
    output, after its output's too), so rows are final only once they are `lag`
    steps old.
    """

    def __init__(self, enabled: bool = False, chunk_rows: int | None = None):
        self.enabled = enabled
        self.resolve = None  # allocator id -> physical id, set when a defragmenter runs
        self.group_of: list[int] | None = None  # allocator id -> its KV-cache group (hybrid groups; None: all 0)
        self.counts: Counter[str] = Counter()
        self.chunk_rows = CHUNK_ROWS if chunk_rows is None else chunk_rows
        self.token_chunk = TOKEN_CHUNK  # token ids kept before they go to the file (`stream_to`)
        self.lag = 0  # steps a late write may lag the current step (0: none come)
        self.step = 0  # the step the ops that follow belong to (`set_step` may also cut a chunk)
        # NOTE: pending rows come in runs of one kind, sequence and group (`op_files.SEG_*`): eight ints a run
        # in `_segs`, the run's sequence in `_seqs`, one `a` a row in `_a`; only what no formula
        # gives is kept per row (`_bcp`: b, c, pos of the explicit rows; `_hashes`: of evicts)
        self._segs: list[int] = []  # step, kind code, rows, mode, p, q, r, group; run after run in emission order
        self._seqs: list[str] = []
        self._a: list[int] = []
        self._bcp: list[int] = []
        self._hashes: list[int | None] = []  # of the pending `evict` rows only
        self._rows = 0  # pending rows in runs
        self._late: list[int] = []  # runs of late writes: first step, n, block, first slot, first pos, group
        self._late_seqs: list[str] = []
        self._chunks: list = []  # final rows as pyarrow tables, when not streaming
        self._tokens: list[tuple] = []  # (seq, its Sequence, tokens) when released, pending
        self._token_chunks: list = []
        self._pending_tokens = 0
        self._sink: Sink | None = None
        self._start = (-1, 0, 0, 0)  # step, and where its rows begin in _segs, _a and _bcp (`emit_transfers`)
        self._done = 0  # rows in chunks or streamed

    def set_step(self, step: int, output: bool = False) -> None:
        """Stamp the ops that follow with `step`; cut a chunk if enough rows are pending. `output`:
        the ops of a step's output follow, not of a schedule. With late writes to come, a schedule
        leaves a mark, an empty run where its ops begin, by which `ops_table` and the cuts place the
        late writes (`merge_keys`)."""
        self.step = step
        if self._rows + 8 * len(self._late_seqs) >= self.chunk_rows:
            self._flush(step - self.lag if self.lag else None)
        if self.lag and not output:
            self._segs.extend((step, MARK, 0, SEG_TABLE, 0, 0, 0, 0))
            self._seqs.append("")

    def emit_transfers(self, kind: str, pairs: list[tuple[int, int]], seq: str, at_start: bool = False) -> None:
        """Record `store` or `load` ops of (a, b) pairs for `seq`; `at_start`: ahead of every op this
        step has recorded so far (a transfer the hardware runs before the step's forward)."""
        self.counts[kind] += len(pairs)
        if not self.enabled or not pairs:
            return
        if self.resolve is not None:
            r = self.resolve
            pairs = [(int(r(a)), b) if kind == "store" else (a, int(r(b))) for a, b in pairs]
        segs = [x for _ in pairs for x in (self.step, _CODE[kind], 1, SEG_EXPLICIT, 0, 0, 0, 0)]
        a, bcp = [p[0] for p in pairs], [x for p in pairs for x in (p[1], -1, -1)]
        self._rows += len(pairs)
        if not at_start:
            self._segs += segs
            self._seqs += [seq] * len(pairs)
            self._a += a
            self._bcp += bcp
            return
        s, r, e = self._step_start()
        self._segs[s:s] = segs
        self._seqs[s // RUN_INTS:s // RUN_INTS] = [seq] * len(pairs)
        self._a[r:r] = a
        self._bcp[e:e] = bcp
        self._start = (self.step, s + len(segs), r + len(a), e + len(bcp))

    def _step_start(self) -> tuple[int, int, int]:
        """Where this step's rows begin in _segs, _a and _bcp, after the transfers put there before
        (`_start`): found from the end, the step's runs being the last ones."""
        if self._start[0] == self.step:
            return self._start[1:]
        segs, k, r, e = self._segs, len(self._segs) // RUN_INTS, len(self._a), len(self._bcp)
        while k and segs[RUN_INTS * (k - 1)] >= self.step:
            k -= 1
            n, mode = segs[RUN_INTS * k + 2], segs[RUN_INTS * k + 3]
            r -= n
            e -= 3 * n if mode == SEG_EXPLICIT else 0
        return RUN_INTS * k, r, e

    def emit(self, kind: str, a: int, b: int = -1, c: int = -1, seq: str = "", h: int | None = None,
             pos: int = -1, group: int = 0) -> None:
        """Record one op; GPU block ids are given as allocator ids and stored physical. A `free` or
        `evict` carries its block's group (`group_of`)."""
        self.counts[kind] += 1
        if self.enabled:
            if self.group_of is not None and (kind == "free" or kind == "evict"):
                group = self.group_of[a]
            if self.resolve is not None:
                if kind in _GPU_A:
                    a = int(self.resolve(a))
                if kind in _GPU_B:
                    b = int(self.resolve(b))
            self._segs.extend((self.step, _CODE[kind], 1, SEG_EXPLICIT, 0, 0, 0, group))
            self._seqs.append(seq)
            self._a.append(a)
            self._bcp.extend((b, c, pos))
            self._rows += 1
            if kind == "evict":
                self._hashes.append(h)

    def emit_many(self, kind: str, pairs: list[tuple[int, int]]) -> None:
        if self.enabled:
            for a, b in pairs:
                self.emit(kind, a, b)
        else:
            self.counts[kind] += len(pairs)

    def emit_table(self, seq: str, blocks: list, start: int = 0, end: int | None = None, group: int = 0) -> None:
        """Record `seq`'s block-table entries [start, end) (of its table in `group`) as `table` ops
        (call only when `enabled`)."""
        end = len(blocks) if end is None else end
        if end > start:
            self.counts["table"] += end - start
            self._run(_TABLE, SEG_TABLE, seq, [blocks[i].block_id for i in range(start, end)], start, group=group)

    def emit_entry(self, seq: str, block: int, index: int, group: int = 0) -> None:
        """Record the one `table` op of `seq`'s entry `index`, now allocator block `block` (call only
        when `enabled`): `emit_table` for one new block, the common case, without building a list."""
        self.counts["table"] += 1
        if self.resolve is not None:
            block = int(self.resolve(block))
        self._segs.extend((self.step, _TABLE, 1, SEG_TABLE, index, 0, 0, group))
        self._seqs.append(seq)
        self._a.append(block)
        self._rows += 1

    def emit_free(self, ids: list[int]) -> None:
        """Record `free` ops of allocator blocks `ids`, in order, each with its block's group."""
        self.counts["free"] += len(ids)
        if self.enabled:
            self._plain(_FREE, ids)

    def emit_evicts(self, ids: list[int], hashes: list[int]) -> None:
        """Record `evict` ops of allocator blocks `ids` with their keys, in order, each with the group
        that last held its block."""
        self.counts["evict"] += len(ids)
        if self.enabled:
            self._plain(_EVICT, ids)
            self._hashes.extend(hashes)

    def _plain(self, code: int, ids: list[int]) -> None:
        """Runs of `free` or `evict` rows of `ids`, one a stretch of blocks of one group."""
        go = self.group_of
        if go is None:
            self._run(code, SEG_PLAIN, "", ids)
            return
        start = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or go[ids[i]] != go[ids[start]]:
                self._run(code, SEG_PLAIN, "", ids[start:i], group=go[ids[start]])
                start = i

    def emit_span(self, seq: str, ids: list[int], start: int, end: int, bs: int, group: int = 0) -> None:
        """Record `write` ops of `seq`'s positions [start, end) into allocator blocks `ids`, one a
        block of `bs` slots (ids[0] holds position `start`): the slots each block gets follow."""
        self.counts["write"] += len(ids)
        if self.enabled:
            self._run(_WRITE, SEG_SPAN, seq, ids, start, end, bs, group)

    def emit_write(self, seq: str, block: int, pos: int, bs: int, group: int = 0) -> None:
        """Record the one-slot `write` of `seq`'s position `pos` into allocator block `block` (call
        only when `enabled`)."""
        self.counts["write"] += 1
        # NOTE: `_run` inlined: this is the hot path, one call per decode token
        if self.resolve is not None:
            block = int(self.resolve(block))
        self._segs.extend((self.step, _WRITE, 1, SEG_SPAN, pos, pos + 1, bs, group))
        self._seqs.append(seq)
        self._a.append(block)
        self._rows += 1

    def record_edge(self, seq: str, block: int, index: int, pos: int, bs: int, key: int | None) -> None:
        """Record a decoding sequence's new block, one group's (call only when `enabled`; not counted:
        the caller counts a table entry and a write, and the eviction if any): its eviction if it
        held key `key`, `seq`'s table entry `index`, and the one-slot write of position `pos`; the
        rows `emit_evicts`, `emit_entry` and `emit_write` give, in one run (`SEG_EDGE`)."""
        if self.resolve is not None:
            block = int(self.resolve(block))
        if key is None:
            self._segs.extend((self.step, _TABLE, 2, SEG_EDGE, pos, index, bs, 0))
            self._a.extend((block, block))
            self._rows += 2
        else:
            self._segs.extend((self.step, _EVICT, 3, SEG_EDGE, pos, index, bs, 0))
            self._a.extend((block, block, block))
            self._hashes.append(key)
            self._rows += 3
        self._seqs.append(seq)

    def _run(self, code: int, mode: int, seq: str, ids: list[int], p: int = 0, q: int = 0, r: int = 0,
             group: int = 0) -> None:
        """One pending run: rows of kind `code`, `seq` and `group` at this step, a row per allocator
        block of `ids`; b, c and pos follow from (mode, p, q, r) (`kvcache.op_files`)."""
        self._segs.extend((self.step, code, len(ids), mode, p, q, r, group))
        self._seqs.append(seq)
        self._a.extend(self._physical(ids))
        self._rows += len(ids)

    def _physical(self, ids: list[int]) -> list[int]:
        return ids if self.resolve is None else self.resolve(np.asarray(ids, dtype=np.int64)).tolist()

    def late_writes(self, seq: str, block: int, step: int, n: int, slot: int, pos: int, group: int = 0) -> None:
        """Record `n` one-slot writes of `seq` into allocator block `block` (of `group`), the i-th at
        step `step + i`, slot `slot + i`, position `pos + i` (not counted: the caller counts them)."""
        if self.resolve is not None:
            block = int(self.resolve(block))
        self._late.extend((step, n, block, slot, pos, group))
        self._late_seqs.append(seq)

    def keep_tokens(self, seq: str, tokens) -> None:
        """`seq`'s token ids as it is released (the last release of a sequence wins): an array, or
        a `Sequence` whose first `n` token ids they are (made later, off the hot path)."""
        self._keep(seq, tokens, len(tokens))

    def keep_sequence(self, seq) -> None:
        """`seq`'s (a `Sequence`) token ids as it is released; read from it when written out (a
        sequence's first `num_tokens` ids never change)."""
        self._keep(seq.seq_id, seq, seq.num_tokens)

    def _keep(self, sid: str, tokens, n: int) -> None:
        self._tokens.append((sid, tokens, n))
        self._pending_tokens += n
        if self._pending_tokens >= self.token_chunk:
            self._flush_tokens()

    @property
    def tokens(self) -> dict[str, np.ndarray]:
        """Each released sequence's token ids (in memory only; see `read_tokens` for a stream)."""
        self._in_memory("tokens")
        out: dict[str, np.ndarray] = {}
        for t in self._token_chunks:
            out.update(tokens_dict(t))
        out.update((s, token_ids(t, n)) for s, t, n in self._tokens)
        return out

    # ---------------------------------------------------------------- chunks
    def stream_to(self, folder: str | Path, process: bool = False, share: int = 1) -> None:
        """Write the records into `folder`'s `ops.parquet` and `op_tokens.parquet` as they become
        final, encoded on a thread or (`process`: for long runs) in a child process (`op_writer.Sink`).
        `share`: the logs streaming from this process at once (a cluster's replicas), each keeping
        chunks that many times smaller (at least 1/8 of the usual: smaller ones cost more time than
        they save memory; Mooncake's first 2,000 on 4 replicas: 742 MB peak whole, 478 MB a quarter)."""
        if share > 1:
            cut = min(share, 8)
            self.chunk_rows = min(self.chunk_rows, CHUNK_ROWS // cut)
            self.token_chunk = TOKEN_CHUNK // cut
        self._sink = Sink(Path(folder), process)
        for t in self._chunks:
            self._sink.write("ops", t)
        for t in self._token_chunks:
            self._sink.write("tokens", t)
        self._chunks, self._token_chunks = [], []

    def finish(self) -> None:
        """No op follows: a streamed log hands its pending rows and token ids to the writer now."""
        if self._sink is not None:
            self._flush(None)
            self._flush_tokens()

    def _flush(self, cut: int | None) -> None:
        """Move the rows of steps before `cut` (None: all) out of the pending lists."""
        main, late = self._take(cut, consume=True)
        self._start = (-1, 0, 0, 0)  # (the lists' indices moved)
        n = main.rows + (late.rows if late is not None else 0)
        if n:
            self._done += n
            if self._sink is not None:
                self._sink.write("ops", main, late)  # made and merged by the writer
            else:
                self._chunks.append(ops_table(main, late))

    def _take(self, cut: int | None, consume: bool):
        """The pending rows of steps before `cut` (None: all): the runs emitted in order (`Runs`), and
        the late writes' runs (an array, or None), for `ops_table` to make one table of."""
        segs = self._segs
        k = len(segs) // RUN_INTS  # runs before the cut: found from the end (rows after it are few)
        rows, nb, evicts = self._rows, len(self._bcp) // 3, len(self._hashes)  # less the tail's, below
        marks = self.lag > 0  # (late writes to come: the cut falls at the last mark of a step <= cut)
        while cut is not None and k and (marks or segs[RUN_INTS * (k - 1)] >= cut):
            k -= 1
            step, code, n, mode = segs[RUN_INTS * k:RUN_INTS * k + 4]
            rows -= n
            nb -= n if mode == SEG_EXPLICIT else 0
            evicts -= (1 if mode == SEG_EDGE else n) if code == _EVICT else 0
            if code == MARK and step <= cut:
                cut = step  # late writes of steps before it, with the rows before it
                break
        else:
            if marks and cut is not None:
                cut = -1  # no mark: nothing is final yet
        late = np.array(self._late, dtype=np.int64).reshape(-1, LATE_INTS)
        if consume:  # the lists themselves go, less their tail (rows of the last `lag` steps: few)
            parts = [_split(x, i) for x, i in ((segs, RUN_INTS * k), (self._seqs, k), (self._a, rows),
                                                 (self._bcp, 3 * nb), (self._hashes, evicts))]
            (segs, self._segs), (seqs, self._seqs), (a, self._a), (bcp, self._bcp), (hashes, self._hashes) = parts
            self._rows -= rows
            main = Runs(pack_ints(segs), seqs, pack_ints(a), bcp, pack_hashes(hashes), rows)
        else:
            main = Runs(segs[:RUN_INTS * k], self._seqs[:k], self._a[:rows], self._bcp[:3 * nb], self._hashes[:evicts],
                        rows)
        seqs = self._late_seqs
        if cut is None:
            ready, ready_seqs = late, seqs
        else:
            first, n = late[:, 0], late[:, 1]
            now = first < cut  # runs with rows before the cut: those rows now, the rest later
            ready, ready_seqs = late[now].copy(), [x for x, y in zip(seqs, now.tolist(), strict=True) if y]
            ready[:, 1] = np.minimum(n[now], cut - first[now])
            later = first + n > cut
            rest = late[later].copy()
            d = np.maximum(cut - rest[:, 0], 0)
            rest[:, 0] += d
            rest[:, 1] -= d
            rest[:, 3:5] += d[:, None]  # (first slot, first pos)
        if consume:
            if cut is None:
                self._late, self._late_seqs = [], []
            else:
                self._late = rest.ravel().tolist()
                self._late_seqs = [x for x, y in zip(seqs, later.tolist(), strict=True) if y]
        return main, (LateRuns(ready, ready_seqs) if len(ready) else None)

    def _flush_tokens(self) -> None:
        if self._tokens:
            if self._sink is not None:
                self._sink.write("tokens", self._tokens)  # made a table by the writer
            else:
                self._token_chunks.append(tokens_table(self._tokens))
            self._tokens, self._pending_tokens = [], 0

    def _in_memory(self, what: str) -> None:
        if self._sink is not None:
            raise ValueError(f"the op log streams to {self._sink.folder}: read its {what} there (read_ops, read_tokens)")

    def _all(self):
        import pyarrow as pa

        self._in_memory("ops")
        return pa.concat_tables([*self._chunks, ops_table(*self._take(None, consume=False))])

    def records(self) -> list[Op]:
        return [Op(*row) for row in table_rows(self._all())]

    def clear(self) -> None:
        self._segs, self._seqs, self._a, self._bcp, self._hashes = [], [], [], [], []
        self._rows = 0
        self._start = (-1, 0, 0, 0)
        self._late, self._late_seqs = [], []
        self._chunks.clear()
        self._done = 0

    def __len__(self) -> int:
        return self._done + self._rows + sum(self._late[1::LATE_INTS])

    def to_jsonl(self, path: str | Path) -> None:
        """One header line `{"kvsim_ops": VERSION}`, then one op per line."""
        with open(path, "w") as f:
            f.write(json.dumps({"kvsim_ops": OPS_VERSION, "columns": list(COLUMNS)}) + "\n")
            for op in self.records():
                f.write(json.dumps(asdict(op)) + "\n")

    def to_parquet(self, path: str | Path) -> None:
        """Columnar form; the version is stored in the file's metadata."""
        import pyarrow.parquet as pq

        pq.write_table(self._all().replace_schema_metadata(META), path, **OPS_WRITE)

    def save(self, folder: str | Path) -> None:
        """`ops.parquet` plus `op_tokens.parquet` (each sequence's token ids), what a replayer reads.
        A streamed log is finished and its two files moved into `folder`."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        folder = Path(folder)
        if self._sink is None:
            self.to_parquet(folder / "ops.parquet")
            self._flush_tokens()
            tokens = pa.concat_tables([*self._token_chunks, tokens_table([])])
            pq.write_table(tokens.replace_schema_metadata(META), folder / "op_tokens.parquet", **TOKENS_WRITE)
            return
        self._flush(None)
        self._flush_tokens()
        self._sink.close()
        for name in ("ops.parquet", "op_tokens.parquet"):
            if (self._sink.folder / name).resolve() != (folder / name).resolve():
                shutil.move(self._sink.folder / name, folder / name)
