"""Block operations: the contract between the block manager and the hardware.

Every physical effect of a manager decision is one typed record, in order:

| kind       | a          | b          | c      | d    | meaning                                 |
| ---------- | ---------- | ---------- | ------ | ---- | --------------------------------------- |
| `write`    | block      | first slot | end    | seq  | new K/V for slots [first, end) of block; `pos` = position of slot `first` |
| `copy`     | src block  | dst block  |        |      | copy-on-write of a shared partial block |
| `swap_out` | gpu block  | cpu block  |        |      | preemption by swapping, GPU -> CPU      |
| `swap_in`  | cpu block  | gpu block  |        |      | resume a swapped request, CPU -> GPU    |
| `move`     | src block  | dst block  |        |      | defrag: contents of src and dst exchanged |
| `free`     | block      |            |        |      | ref count reached 0 (no data movement)  |
| `evict`    | block      |            |        |      | cached block reused; `hash` is its key  |
| `table`    | block      | index      |        | seq  | seq's block-table entry `index` is now `block` (0: null) |

`table` ops carry no data: they let a replayer keep every request's block
table (prefix hits, forks and swap-ins change tables without a write).
`step` is the engine step (or replay iteration) the op belongs to. GPU block
ids are physical: with the online defragmenter on, the manager's ids are
mapped through its forward table, and a `move` exchanges the contents of two
physical blocks (the mapping is updated on the manager side at the same time).
Counters per kind are always kept; full records only when `enabled`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

OPS_VERSION = 1
KINDS = ("write", "copy", "swap_out", "swap_in", "move", "free", "evict", "table")
CHARGED_KINDS = ("copy", "swap_out", "swap_in", "move")  # the kinds a step's time is charged for (data movement)
_COLUMNS = ("step", "kind", "a", "b", "c", "seq", "hash", "pos")
_GPU_A = frozenset(("write", "copy", "swap_out", "free", "evict", "table"))  # kinds whose `a` is a GPU block
_GPU_B = frozenset(("copy", "swap_in"))


@dataclass(frozen=True, slots=True)
class Op:
    """One block operation; unused fields are -1 (ints) or "" / None."""

    step: int
    kind: str
    a: int
    b: int = -1
    c: int = -1
    seq: str = ""
    hash: int | None = None
    pos: int = -1


class OpLog:
    """Collects ops as they are decided; cheap counters always, records on demand."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.resolve = None  # allocator id -> physical id, set when a defragmenter runs
        self.step = 0
        self.counts: Counter[str] = Counter()
        self._rows: list[tuple] = []
        self.tokens: dict[str, np.ndarray] = {}  # seq -> its token ids when last released

    def emit(self, kind: str, a: int, b: int = -1, c: int = -1, seq: str = "", h: int | None = None,
             pos: int = -1) -> None:
        """Record one op; GPU block ids are given as allocator ids and stored physical."""
        self.counts[kind] += 1
        if self.enabled:
            if self.resolve is not None:
                if kind in _GPU_A:
                    a = int(self.resolve(a))
                if kind in _GPU_B:
                    b = int(self.resolve(b))
            self._rows.append((self.step, kind, a, b, c, seq, h, pos))

    def emit_many(self, kind: str, pairs: list[tuple[int, int]]) -> None:
        self.counts[kind] += len(pairs)
        if self.enabled:
            step = self.step
            self._rows.extend((step, kind, a, b, -1, "", None, -1) for a, b in pairs)

    def emit_table(self, seq: str, blocks: list, start: int = 0, end: int | None = None) -> None:
        """Record `seq`'s block-table entries [start, end) as `table` ops (call only when `enabled`)."""
        for i in range(start, len(blocks) if end is None else end):
            self.emit("table", blocks[i].block_id, i, seq=seq)

    def records(self) -> list[Op]:
        return [Op(*row) for row in self._rows]

    def clear(self) -> None:
        self._rows.clear()

    def __len__(self) -> int:
        return len(self._rows)

    def to_jsonl(self, path: str | Path) -> None:
        """One header line `{"kvsim_ops": VERSION}`, then one op per line."""
        with open(path, "w") as f:
            f.write(json.dumps({"kvsim_ops": OPS_VERSION, "columns": list(_COLUMNS)}) + "\n")
            for op in self.records():
                f.write(json.dumps(asdict(op)) + "\n")

    def to_parquet(self, path: str | Path) -> None:
        """Columnar form; the version is stored in the file's metadata."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        cols = list(zip(*self._rows, strict=True)) if self._rows else [[] for _ in _COLUMNS]
        table = pa.table(
            {
                "step": pa.array(cols[0], pa.int64()),
                "kind": pa.array(cols[1], pa.string()),
                "a": pa.array(cols[2], pa.int64()),
                "b": pa.array(cols[3], pa.int64()),
                "c": pa.array(cols[4], pa.int64()),
                "seq": pa.array(cols[5], pa.string()),
                "hash": pa.array(cols[6], pa.uint64()),
                "pos": pa.array(cols[7], pa.int64()),
            }
        ).replace_schema_metadata({"kvsim_ops": str(OPS_VERSION)})
        pq.write_table(table, path)


    def save(self, folder: str | Path) -> None:
        """`ops.parquet` plus `op_tokens.parquet` (each sequence's token ids), what a replayer reads."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        folder = Path(folder)
        self.to_parquet(folder / "ops.parquet")
        seqs = list(self.tokens)
        table = pa.table({
            "seq": pa.array(seqs, pa.string()),
            "tokens": pa.array([self.tokens[s].tolist() for s in seqs], pa.list_(pa.int64())),
        }).replace_schema_metadata({"kvsim_ops": str(OPS_VERSION)})
        pq.write_table(table, folder / "op_tokens.parquet")


def read_tokens(path: str | Path) -> dict[str, np.ndarray]:
    """Token ids per sequence, written by `OpLog.save`."""
    import pyarrow.parquet as pq

    d = pq.read_table(path).to_pydict()
    return {s: np.asarray(t, dtype=np.int64) for s, t in zip(d["seq"], d["tokens"], strict=True)}


def read_ops(path: str | Path) -> list[Op]:
    """Read an op stream written by `OpLog.to_jsonl` or `OpLog.to_parquet`."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        version = int((table.schema.metadata or {}).get(b"kvsim_ops", b"0"))
        _check_version(path, version)
        d = table.to_pydict()
        return [Op(*row) for row in zip(*(d[c] for c in _COLUMNS), strict=True)]
    with open(path) as f:
        header = json.loads(f.readline() or "{}")
        _check_version(path, header.get("kvsim_ops", 0))
        return [Op(**json.loads(line)) for line in f if line.strip()]


def _check_version(path: Path, version: int) -> None:
    if version != OPS_VERSION:
        raise ValueError(f"{path}: op stream version {version}, this kvsim reads version {OPS_VERSION}")
