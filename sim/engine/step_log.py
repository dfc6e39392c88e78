"""The steps log a run fills: rows packed into typed columns in memory, or streamed into a
parquet file as the run goes (so a long run's memory does not grow with its steps), and
that file read back a column at a time (`StepFile`)."""

from __future__ import annotations

import struct
from itertools import starmap
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.sim.engine.metrics import STEP_COLUMNS, STEP_FIELDS

_ROW = struct.Struct(f"{len(STEP_FIELDS)}d")  # one step's row, native float64s


class StepLog:
    """One row per engine step (see STEP_COLUMNS for each field's meaning and unit).

    Rows are kept as tuples and packed, every CHUNK rows, into segments of SEGMENT rows,
    one array a column in its own dtype (exact: these counts pass through float64
    unchanged): appending a tuple is ~50x cheaper than 25 array stores. With a `path`,
    each full segment is written to that parquet file as a row group and dropped, so a
    long run's memory does not grow with its steps (`close` writes the rest). `segment`
    overrides SEGMENT, and packs every quarter of it (at most CHUNK rows): a cluster's replicas
    stream in smaller row groups, so what each holds before writing stays small
    (`sim.cluster.cluster.STEP_SEGMENT`; a row waiting as a tuple takes ~480 bytes, packed 200).
    """

    CHUNK = 4096
    SEGMENT = 16 * CHUNK

    def __init__(self, path: str | Path | None = None, segment: int | None = None) -> None:
        self.path = None if path is None else Path(path)
        self.segment = self.SEGMENT if segment is None else segment
        self.chunk = self.CHUNK if segment is None else min(self.CHUNK, max(segment // 4, 1))
        self._writer = None
        self._rows: list[tuple] = []
        self._full: list[list[np.ndarray]] = [[] for _ in STEP_FIELDS]  # a column's full segments (in memory)
        self._seg = self._segment()
        self._fill = 0  # rows in the current segment
        self._done = 0  # rows in the full segments

    def _segment(self) -> list[np.ndarray]:
        return [np.empty(self.segment, dt) for dt in STEP_COLUMNS.values()]

    def record(self, values: tuple) -> None:
        """Append one step; `values` in STEP_FIELDS order."""
        rows = self._rows
        rows.append(values)
        if len(rows) == self.chunk:
            self._pack()

    def _pack(self) -> None:
        if not self._rows:
            return
        if self._fill + len(self._rows) > len(self._seg[0]):
            self._flush()
        # NOTE: each row packed as float64s by struct, joined, then viewed: ~40% cheaper than
        # np.array over the tuples, the same values (ints convert exactly below 2^53, as numpy's)
        i, n = self._fill, len(self._rows)
        data = np.frombuffer(b"".join(starmap(_ROW.pack, self._rows)), dtype=np.float64).reshape(n, len(STEP_FIELDS))
        for j, col in enumerate(self._seg):
            col[i : i + n] = data[:, j]
        self._fill += n
        self._rows.clear()

    def _flush(self) -> None:
        """Retire the current segment: to the file, or to the in-memory list."""
        cols = [c[: self._fill] for c in self._seg]
        if self.path is not None:
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.table(dict(zip(STEP_FIELDS, cols, strict=True)))
            if self._writer is None:
                self._writer = pq.ParquetWriter(self.path, table.schema)
            self._writer.write_table(table)
        else:
            for full, col in zip(self._full, cols, strict=True):
                full.append(col)
        self._done += self._fill
        self._seg, self._fill = self._segment(), 0

    def __len__(self) -> int:
        return self._done + self._fill + len(self._rows)

    def close(self) -> None:
        """With a `path`: write the remaining rows and close the file (an empty log writes an
        empty table)."""
        if self.path is None:
            return
        self._pack()
        if self._fill or self._writer is None:
            self._flush()
        self._writer.close()

    def frame(self) -> pd.DataFrame:
        """The steps table. In memory it shares the log's columns: each is joined into one
        array in turn (and kept as the log's only segment), so the table is never held twice.
        A streamed log is read back from its file."""
        if self.path is not None:
            self.close()
            return pd.read_parquet(self.path)
        self._pack()
        cols = {}
        for j, (k, full) in enumerate(zip(STEP_FIELDS, self._full, strict=True)):
            if full:
                full.append(self._seg[j][: self._fill])
                self._seg[j] = np.concatenate(full)
                full.clear()
            cols[k] = self._seg[j][: self._done + self._fill]
        self._fill += self._done
        self._done = 0
        return pd.DataFrame(cols, copy=False)


def release_arrow_memory() -> None:
    """Hand back what pyarrow's allocator freed after reading or writing a table (it keeps
    it otherwise, and a long run's tables are large)."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


class StepFile:
    """A streamed run's steps table read a column at a time from its parquet file: as much
    of a DataFrame as `summarize` uses (`len`, `empty`, `steps[name]`), so a long run's
    summary never holds the whole table."""

    def __init__(self, path: str | Path):
        import pyarrow.parquet as pq

        self.path = Path(path)
        self._rows = pq.ParquetFile(self.path).metadata.num_rows

    def __len__(self) -> int:
        return self._rows

    @property
    def empty(self) -> bool:
        return not self._rows

    def column(self, name: str) -> np.ndarray:
        """One column, read a row group at a time into its array (never two copies at once)."""
        import pyarrow.parquet as pq

        f = pq.ParquetFile(self.path)
        out, i = np.empty(self._rows, STEP_COLUMNS[name]), 0
        for g in range(f.num_row_groups):
            part = f.read_row_group(g, columns=[name]).column(0).to_numpy()
            out[i : i + len(part)] = part
            i += len(part)
        release_arrow_memory()
        return out

    def __getitem__(self, name: str) -> pd.Series:
        return pd.Series(self.column(name), name=name, copy=False)

    def frame(self, *names: str, every: int = 1) -> pd.DataFrame:
        """These columns (all if none named) of every `every`-th row, read one at a time."""
        if every == 1:
            return pd.DataFrame({k: self.column(k) for k in names or STEP_FIELDS}, copy=False)
        return pd.DataFrame({k: self.column(k)[::every].copy() for k in names or STEP_FIELDS}, copy=False)
