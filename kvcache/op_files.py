"""The op log's files: `ops.parquet` and `op_tokens.parquet` (schemas, chunks as tables, the writer).

`kvcache.ops` keeps the rows; this module turns a chunk of them into a pyarrow
table of the files' schema (`kvcache.op_writer` streams the tables to the files).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvsim.kvcache.sequence import TokenIds

KINDS = ("write", "copy", "swap_out", "swap_in", "move", "free", "evict", "table", "store", "load", "file_write",
         "file_read")  # append only: a kind's code is its index
OPS_VERSION = 2  # 2: the `group` column (version 1 files, before it, are refused: `check_version`)
META = {"kvsim_ops": str(OPS_VERSION)}  # the version, in both files' metadata
COLUMNS = ("step", "kind", "a", "b", "c", "seq", "hash", "pos", "group")  # `kvcache.ops.Op`'s fields, the file's columns
RUN_INTS = 8  # ints a pending run keeps: step, kind code, rows, mode, p, q, r, group
LATE_INTS = 6  # ints a run of late writes keeps: first step, n, block, first slot, first pos, group

# How a run of rows (one kind, one sequence, one step) gets its b, c and pos; its `a`s are kept a row.
SEG_PLAIN = 0  # b, c, pos all -1 (free, evict)
SEG_TABLE = 1  # b = p + i (the i-th row of the run); c, pos -1
SEG_SPAN = 2  # writes of positions [p, q) in blocks of r slots, a block a row: slots and positions follow
SEG_EXPLICIT = 3  # b, c, pos kept a row
SEG_EDGE = 4  # a decode token's new block: [its eviction (no sequence),] its table entry q, the write of
#              position p (r slots a block): 2 or 3 rows of one block, their kinds by their place
MARK = -1  # the kind code of an empty run marking where a step's schedule begins (`OpLog.set_step`)


class Runs(NamedTuple):
    """Rows in runs, in emission order: `segs` eight ints a run (step, kind code, rows, mode, p, q,
    r, group), flat, its sequence in `seqs`; `a` a row, `bcp` (b, c, pos) a row of the explicit runs,
    `hashes` an evict."""

    segs: Sequence[int]  # a list, or packed (`pack_ints`)
    seqs: list[str]
    a: Sequence[int]
    bcp: list[int]
    hashes: Sequence[int]  # a list, or packed (`pack_hashes`)
    rows: int


class LateRuns(NamedTuple):
    """Runs of late one-slot writes (first step, n, block, first slot, first pos, group) and their sequences."""

    runs: np.ndarray
    seqs: list[str]

    @property
    def rows(self) -> int:
        return int(self.runs[:, 1].sum())


def ops_table(main: Runs, late: LateRuns | None, coded: bool = False):
    """One table of `schema(coded)`: `main`'s rows in emission order, `late`'s among them, each late
    write of step s where step s's schedule's rows end (`merge_keys`). The two are merged as integer
    rows, before any string column is made, so the sort moves numbers only."""
    ints, which, seqs = run_rows(main)
    if late is not None and len(late.runs):
        late_ints, late_which = late_rows(late.runs)
        keys = np.concatenate(merge_keys(main, late_ints[:, 0]))
        ints = np.concatenate([ints, late_ints])
        which = np.concatenate([which, late_which + len(seqs)])
        seqs = [*seqs, *late.seqs]
        order = np.argsort(keys, kind="stable")
        ints, which = ints[order], which[order]
    return rows_table(ints, (_coded_names if coded else _names)(seqs, which), main.hashes, KINDS, coded)


def merge_keys(r: Runs, late_steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort keys, never decreasing along `r`'s rows, and the keys of late writes of `late_steps`,
    by which the late writes merge among the rows.

    Each schedule's ops begin with a mark (`OpLog.set_step`), so the rows fall into stretches, one
    a schedule, of its step s: first the schedule's rows, of step s (with the sync output, then its
    output's too), then, with the async output, the output of an earlier batch, applied after the
    schedule. Stretch j's rows of its own step are keyed 3j and the earlier batch's 3j + 2; a late
    write of step s goes in the stretch of step s's last schedule (key 3j + 1: an empty schedule
    precedes its step's real one), as its write would had it been made in its step. A chunk begins
    at a mark (`OpLog._take`); rows before the first mark form stretch 0."""
    segs = np.asarray(r.segs, np.int64).reshape(-1, RUN_INTS)
    steps, marks = segs[:, 0], segs[:, 1] == MARK
    stretch = np.cumsum(marks)
    mark_steps = steps[marks]
    own = np.concatenate([[np.iinfo(np.int64).min], mark_steps])[stretch]  # each run's stretch's step
    rows = np.repeat(3 * stretch + 2 * (steps < own), segs[:, 2])
    return rows, 3 * np.searchsorted(mark_steps, late_steps, side="right") + 1


def run_rows(r: Runs) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The rows of `r` as integers (step, kind code, a, b, c, pos, group; -1: none), each row's index
    in the sequence names, and those names."""
    segs, n = np.asarray(r.segs, np.int64).reshape(-1, RUN_INTS), r.rows
    counts = segs[:, 2]
    which = np.repeat(np.arange(len(segs)), counts)  # row -> its run
    off = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)  # row -> its index in its run
    mode = np.repeat(segs[:, 3], counts)
    p, q, bs = (np.repeat(segs[:, j], counts) for j in (4, 5, 6))
    ints = np.full((n, 7), -1, np.int64)  # step, kind code, a, b, c, pos, group
    ints[:, 0] = np.repeat(segs[:, 0], counts)
    ints[:, 1] = np.repeat(segs[:, 1], counts)
    ints[:, 6] = np.repeat(segs[:, 7], counts)
    ints[:, 2] = r.a if isinstance(r.a, np.ndarray) else np.fromiter(r.a, np.int64, n)
    t = mode == SEG_TABLE
    ints[t, 3] = p[t] + off[t]
    w = np.flatnonzero(mode == SEG_SPAN)
    if len(w):
        b = bs[w]
        block = p[w] // b + off[w]
        lo = np.maximum(p[w], block * b)
        ints[w, 3] = lo % b
        ints[w, 4] = np.minimum(q[w] - block * b, b)
        ints[w, 5] = lo
    e = mode == SEG_EXPLICIT
    if r.bcp:
        ints[e, 3:6] = np.array(r.bcp, np.int64).reshape(-1, 3)
    g = np.flatnonzero(mode == SEG_EDGE)
    seqs = r.seqs
    if len(g):
        role = off[g] + 3 - np.repeat(counts, counts)[g]  # 0: the eviction, 1: the entry, 2: the write
        ints[g, 1] = np.array([KINDS.index("evict"), KINDS.index("table"), KINDS.index("write")])[role]
        entry, write, evict = g[role == 1], g[role == 2], g[role == 0]
        ints[entry, 3] = q[entry]
        ints[write, 3] = p[write] % bs[write]
        ints[write, 4] = ints[write, 3] + 1
        ints[write, 5] = p[write]
        if len(evict):  # an eviction belongs to no sequence
            seqs = [*seqs, ""]
            which[evict] = len(seqs) - 1
    return ints, which, seqs


def late_rows(runs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of late one-slot writes (first step, n, block, first slot, first pos, group) as integer
    rows, one a write (as `run_rows`), and each row's run."""
    step0, n, block, slot0, pos0, group = runs.T
    which = np.repeat(np.arange(len(runs)), n)
    off = np.arange(which.size) - np.repeat(np.cumsum(n) - n, n)
    ints = np.empty((which.size, 7), np.int64)
    ints[:, 0] = step0[which] + off
    ints[:, 1] = KINDS.index("write")
    ints[:, 2] = block[which]
    ints[:, 3] = slot0[which] + off
    ints[:, 4] = ints[:, 3] + 1
    ints[:, 5] = pos0[which] + off
    ints[:, 6] = group[which]
    return ints, which


def _names(seqs: list[str], which: np.ndarray):
    import pyarrow as pa

    return pa.array(seqs, pa.string()).take(pa.array(which))


def _coded_names(seqs: list[str], which: np.ndarray):
    """`_names` as a dictionary: each distinct name once, a row its index."""
    import pyarrow as pa

    ids: dict[str, int] = {}
    code = np.fromiter((ids.setdefault(s, len(ids)) for s in seqs), np.int32, len(seqs))
    return pa.DictionaryArray.from_arrays(pa.array(code[which]), pa.array(list(ids), pa.string()))


def schema(coded: bool = False):
    """The columns of `ops.parquet` (`COLUMNS`); `coded`: `kind` and `seq` as dictionaries, as the
    streamed file's writer takes them (the file holds plain strings either way)."""
    import pyarrow as pa

    kind, seq = (pa.dictionary(pa.int8(), pa.string()), pa.dictionary(pa.int32(), pa.string())) if coded \
        else (pa.string(), pa.string())
    return pa.schema([("step", pa.int64()), ("kind", kind), ("a", pa.int64()), ("b", pa.int64()),
                      ("c", pa.int64()), ("seq", seq), ("hash", pa.uint64()), ("pos", pa.int64()),
                      ("group", pa.int64())],
                     metadata=META)


def tokens_schema():
    import pyarrow as pa

    return pa.schema([("seq", pa.string()), ("tokens", pa.list_(pa.int64()))], metadata=META)


# `op_tokens.parquet`'s token ids delta-encoded (a standard Parquet encoding every reader decodes):
# a synthetic prompt's ids run in steps of one, so the Azure trace's 121 MB of them take about 4 MB;
# ids drawn at random from a vocabulary take about what the default dictionary gives (measured: 6%
# more at 32,000 ids, half at 150,000, where the dictionary overflows to plain)
TOKENS_WRITE = {"use_dictionary": ["seq"], "column_encoding": {"tokens.list.element": "DELTA_BINARY_PACKED"}}
# `ops.parquet`: the few-valued columns in a dictionary, the numbers delta-encoded (steps and
# positions climb, blocks and slots repeat) and the hashes plain, where a dictionary only fills and
# overflows: on the Azure trace's first 2,000 requests 12% less CPU to write, 15% fewer bytes and
# a third less to read than the default dictionary on every column. Statistics (a row group's
# minimum and maximum) on `step` only, what a reader can skip row groups by: on every column they
# cost a fifth of the encoding (the Azure record run: 4 ms of 21 a 300k-row chunk)
OPS_WRITE = {"use_dictionary": ["kind", "seq", "group"],
             "column_encoding": dict.fromkeys(("step", "a", "b", "c", "pos"), "DELTA_BINARY_PACKED"),
             "write_statistics": ["step"]}


def pack_ints(ints: list[int]) -> np.ndarray:
    """A chunk's run or block ints as one array (int32 where they fit), which pickles as its bytes:
    about what pickling the list costs here, and the writer then neither unpickles nor converts an
    int at a time (the Azure record run's 12M: 0.4 s of the writer's CPU)."""
    try:
        return np.fromiter(ints, np.int32, len(ints))
    except OverflowError:
        return np.fromiter(ints, np.int64, len(ints))


def pack_hashes(hashes: list[int]) -> Sequence[int]:
    """Block keys (64-bit, unsigned) as one packed array, which pickles as its bytes: a list of them
    pickles and unpickles an int at a time (the Azure record run's 1.7M: 0.1 s and 0.15 s)."""
    try:
        return array("Q", hashes)
    except (OverflowError, TypeError):  # a key outside 64 bits: kept as it is
        return hashes


def rows_table(ints: np.ndarray, seqs, hashes: Sequence[int], kinds: tuple[str, ...], coded: bool = False):
    """Rows (columns step, kind code, a, b, c, pos, group of `ints`; a kind code indexes `kinds`) as
    a table of `schema(coded)`; `hashes` are those of its `evict` rows, in order."""
    import pyarrow as pa

    codes = ints[:, 1]
    evict = codes == kinds.index("evict")
    which = np.cumsum(evict) - 1  # row -> its index in `hashes` (evict rows only)
    keys = np.frombuffer(hashes, np.uint64) if isinstance(hashes, array) else hashes
    keys = pa.array(keys, pa.uint64()).take(pa.array(which, mask=~evict))
    if coded:
        names = pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int8)), pa.array(kinds, pa.string()))
    else:
        names = pa.array(kinds, pa.string()).take(pa.array(codes))
    seqs = seqs if isinstance(seqs, pa.Array) else pa.array(seqs, pa.string())
    cols = [ints[:, 0], names, ints[:, 2], ints[:, 3], ints[:, 4], seqs, keys, ints[:, 5], ints[:, 6]]
    return pa.table([pa.array(np.ascontiguousarray(c)) if isinstance(c, np.ndarray) else c for c in cols],
                    schema=schema(coded))


def token_ids(tokens, n: int) -> np.ndarray:
    """`tokens` (an array of token ids, a `Sequence` or its `TokenIds`) as its first `n` token ids."""
    if isinstance(tokens, np.ndarray):
        return tokens
    if isinstance(tokens, TokenIds):
        out = np.empty(n, np.int64)
        tokens.fill(out)
        return out
    return tokens.token_ids(0, n)


def token_parts(tokens, n: int):
    """What goes to the op log's writer for `tokens` (as `token_ids` takes it): an array as it is,
    a `Sequence` as its `TokenIds` (its known ids in their own dtype, not yet widened and filled)."""
    return tokens if isinstance(tokens, np.ndarray | TokenIds) else tokens.token_parts(n)


def tokens_table(items: list[tuple]):
    """(seq, token ids, `Sequence` or `TokenIds`, n) triples as a table of `tokens_schema()`, each
    sequence's ids written straight into the one flat column."""
    import pyarrow as pa

    lengths = np.fromiter((n for _, _, n in items), np.int64, len(items))
    offsets = np.zeros(len(items) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), np.int64)
    for (_, t, n), lo in zip(items, offsets.tolist(), strict=False):
        part = token_parts(t, n)
        if isinstance(part, TokenIds):
            part.fill(flat[lo : lo + n])
        else:
            flat[lo : lo + n] = part
    lists = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))
    return pa.table([pa.array([s for s, _, _ in items], pa.string()), lists], schema=tokens_schema())


def tokens_dict(table) -> dict[str, np.ndarray]:
    """Token ids per sequence; a sequence released twice keeps its last."""
    seqs = table.column("seq").to_pylist()
    lists = table.column("tokens").combine_chunks()
    flat = lists.values.to_numpy(zero_copy_only=False)
    off = lists.offsets.to_numpy()
    return {s: flat[off[i]:off[i + 1]].astype(np.int64) for i, s in enumerate(seqs)}


def check_version(path: Path, version: int) -> None:
    """Refuse a stream of another version (a version 1 stream, before the `group` column, too: its
    ops would read as group 0 silently, so it is recorded again instead)."""
    if version != OPS_VERSION:
        again = "; record it again with this kvsim" if version < OPS_VERSION else ""
        raise ValueError(f"{path}: op stream version {version}, this kvsim reads version {OPS_VERSION}{again}")


def read_ops_table(path: Path):
    """`ops.parquet` as a pyarrow table, its version checked."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    check_version(path, int((table.schema.metadata or {}).get(b"kvsim_ops", b"0")))
    return table


def table_rows(table) -> list[tuple]:
    """An ops table's rows as plain tuples in `COLUMNS` order, each kind and sequence name one string."""
    import pyarrow.compute as pc

    cols = []
    for c in COLUMNS:
        col = table.column(c)
        if c in ("kind", "seq"):
            codes = pc.dictionary_encode(col).combine_chunks()
            cols.append(list(map(codes.dictionary.to_pylist().__getitem__, codes.indices.to_pylist())))
        else:
            cols.append(col.to_pylist())
    return list(zip(*cols, strict=True))


@dataclass(frozen=True, slots=True)
class Op:
    """One block operation; unused fields are -1 (ints) or "" / None. `group`: the KV-cache group
    whose block table or pages it concerns (0 for the one-group manager and KV offloading)."""

    step: int
    kind: str
    a: int
    b: int = -1
    c: int = -1
    seq: str = ""
    hash: int | None = None
    pos: int = -1
    group: int = 0


def read_tokens(path: str | Path) -> dict[str, np.ndarray]:
    """Token ids per sequence, written by `OpLog.save` (a sequence released twice: its last)."""
    import pyarrow.parquet as pq

    return tokens_dict(pq.read_table(path))


def read_ops(path: str | Path) -> list[Op]:
    """Read an op stream written by `OpLog.to_jsonl` or `OpLog.to_parquet`."""
    path = Path(path)
    if path.suffix == ".parquet":
        return [Op(*row) for row in table_rows(read_ops_table(path))]
    with open(path) as f:
        header = json.loads(f.readline() or "{}")
        check_version(path, header.get("kvsim_ops", 0))
        return [Op(**json.loads(line)) for line in f if line.strip()]


def read_op_rows(path: str | Path) -> list[tuple]:
    """`read_ops` as plain tuples in `Op`'s field order, each kind and sequence name one shared
    string: for millions of ops, several times faster and smaller than `Op` records."""
    path = Path(path)
    if path.suffix == ".parquet":
        return table_rows(read_ops_table(path))
    return as_rows(read_ops(path))


def as_rows(ops: Sequence[Op] | Sequence[tuple]) -> list[tuple]:
    """Ops as plain tuples in `Op`'s field order (`COLUMNS`); tuples pass through."""
    if ops and isinstance(ops[0], Op):
        return [(o.step, o.kind, o.a, o.b, o.c, o.seq, o.hash, o.pos, o.group) for o in ops]
    return list(ops)
