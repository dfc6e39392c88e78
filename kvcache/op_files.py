"""The op log's files: `ops.parquet` and `op_tokens.parquet` (schemas, chunks as tables, the writer).

`kvcache.ops` keeps the rows; this module turns a chunk of them into a pyarrow
table of the files' schema, and streams tables to the two files (`Sink`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

OPS_VERSION = 1
META = {"kvsim_ops": str(OPS_VERSION)}  # the version, in both files' metadata


class Sink:
    """The two parquet writers of a streamed op log; a chunk is encoded on a thread (which
    runs beside the simulation: parquet encoding releases the GIL) while the next is made."""

    def __init__(self, folder: Path):
        import pyarrow.parquet as pq

        self.folder = folder
        self.ops = pq.ParquetWriter(folder / "ops.parquet", schema())
        self.tokens = pq.ParquetWriter(folder / "op_tokens.parquet", tokens_schema())
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvsim-ops")
        self._last: Future | None = None

    def write(self, writer, table, late=None) -> None:
        """Queue `table` (merged with `late`, see `by_step`; or (seq, token ids) pairs) for
        `writer`, after the chunk before it is written (one in flight)."""
        self.wait()
        self._last = self._pool.submit(_write, writer, table, late)

    def wait(self) -> None:
        if self._last is not None:
            self._last.result()  # re-raises the writer's error here
            self._last = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown()
            self.ops.close()
            self.tokens.close()


def _write(writer, table, late) -> None:
    if isinstance(table, list):  # (seq, token ids) pairs
        table = tokens_table(table)
    writer.write_table(table if late is None else by_step(table, late))


def by_step(table, late):
    """`table`'s rows (in step order) and `late`'s (or None), stably ordered by step: a late row
    after every row of `table` of its step."""
    if late is None:
        return table
    import pyarrow as pa

    both = pa.concat_tables([table, late])
    return both.take(np.argsort(both.column("step").to_numpy(), kind="stable"))


def schema():
    import pyarrow as pa

    return pa.schema([("step", pa.int64()), ("kind", pa.string()), ("a", pa.int64()), ("b", pa.int64()),
                      ("c", pa.int64()), ("seq", pa.string()), ("hash", pa.uint64()), ("pos", pa.int64())],
                     metadata=META)


def tokens_schema():
    import pyarrow as pa

    return pa.schema([("seq", pa.string()), ("tokens", pa.list_(pa.int64()))], metadata=META)


def rows_table(ints: np.ndarray, seqs: list[str], hashes: list[int | None], kinds: tuple[str, ...]):
    """Rows (columns step, kind code, a, b, c, pos of `ints`; a kind code indexes `kinds`) as a
    table of `schema()`; `hashes` are those of its `evict` rows, in order."""
    import pyarrow as pa

    codes = ints[:, 1]
    evict = codes == kinds.index("evict")
    which = np.cumsum(evict) - 1  # row -> its index in `hashes` (evict rows only)
    keys = pa.array(hashes, pa.uint64()).take(pa.array(which, mask=~evict))
    names = pa.array(kinds, pa.string()).take(pa.array(codes))
    cols = [ints[:, 0], names, ints[:, 2], ints[:, 3], ints[:, 4], pa.array(seqs, pa.string()), keys, ints[:, 5]]
    return pa.table([pa.array(np.ascontiguousarray(c)) if isinstance(c, np.ndarray) else c for c in cols],
                    schema=schema())


def late_table(runs: np.ndarray, seqs: list[str], kinds: tuple[str, ...]):
    """Runs of late one-slot writes (first step, n, block, first slot, first pos), one row a write."""
    import pyarrow as pa

    step0, n, block, slot0, pos0 = runs.T
    which = np.repeat(np.arange(len(runs)), n)
    off = np.arange(which.size) - np.repeat(np.cumsum(n) - n, n)
    slot = slot0[which] + off
    total = which.size
    cols = [step0[which] + off, pa.array(kinds, pa.string()).take(pa.array(np.full(total, kinds.index("write")))),
            block[which], slot, slot + 1, pa.array(seqs, pa.string()).take(pa.array(which)),
            pa.nulls(total, pa.uint64()), pos0[which] + off]
    return pa.table([pa.array(c) if isinstance(c, np.ndarray) else c for c in cols], schema=schema())


def tokens_table(items: list[tuple[str, np.ndarray]]):
    import pyarrow as pa

    lengths = np.fromiter((len(t) for _, t in items), np.int64, len(items))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = np.concatenate([t for _, t in items]).astype(np.int64) if items else np.zeros(0, np.int64)
    lists = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    return pa.table([pa.array([s for s, _ in items], pa.string()), lists], schema=tokens_schema())


def tokens_dict(table) -> dict[str, np.ndarray]:
    """Token ids per sequence; a sequence released twice keeps its last."""
    seqs = table.column("seq").to_pylist()
    lists = table.column("tokens").combine_chunks()
    flat = lists.values.to_numpy(zero_copy_only=False)
    off = lists.offsets.to_numpy()
    return {s: flat[off[i]:off[i + 1]].astype(np.int64) for i, s in enumerate(seqs)}
