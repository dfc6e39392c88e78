"""The writer of a streamed op log: chunks of rows encoded into `ops.parquet` and `op_tokens.parquet`
beside the simulation, on a thread or in a child process (`python -m kvcache.op_writer FOLDER`).

In a child process the encoding (numpy, arrow, parquet: much of it holding the GIL) costs the
simulation only the packing and pickling of each chunk (its ints go as arrays, `op_files.pack_ints`),
and up to `IN_FLIGHT` chunks wait there, read off the pipe by a thread of the child's own, so the
simulation does not wait for each encoding; a thread is cheaper to start (small logs, tests).
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from kvsim.kvcache.op_files import (
    META,
    OPS_WRITE,
    TOKENS_WRITE,
    Runs,
    ops_table,
    schema,
    token_parts,
    tokens_schema,
    tokens_table,
)

# NOTE: the child builds and drops arrays of a chunk's size (megabytes) chunk after chunk; glibc
# would map each afresh and hand it back on free, a page fault per 4 KiB touched (the Azure record
# run: 190k faults, 0.8 s of system time). Kept in the heap and not trimmed, the pages are reused.
# Other C libraries ignore the two variables.
_CHILD_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


class Files:
    """The two parquet writers; `write` takes a chunk as `kvcache.ops.OpLog` hands it over."""

    def __init__(self, folder: Path):
        import pyarrow.parquet as pq

        # NOTE: `kind` and `seq` come as dictionaries, which the writer writes as they are (the
        # strings hashed once a chunk's distinct name, not once a row: a fifth of the encoding);
        # with no Arrow schema stored the file reads back as plain strings, `schema()`, as an
        # in-memory log writes it, and the version goes in the footer's metadata
        self._coded = schema(coded=True)
        self.ops = pq.ParquetWriter(folder / "ops.parquet", self._coded, store_schema=False, **OPS_WRITE)
        self.ops.add_key_value_metadata(META)
        self.tokens = pq.ParquetWriter(folder / "op_tokens.parquet", tokens_schema(), **TOKENS_WRITE)

    def write(self, name: str, chunk, late=None) -> None:
        """`name` "ops": a table, or `Runs` merged with `late` (`ops_table`); "tokens": (seq, token
        ids or Sequence, n) triples, or a table."""
        if name == "tokens":
            self.tokens.write_table(tokens_table(chunk) if isinstance(chunk, list) else chunk)
        else:
            table = ops_table(chunk, late, coded=True) if isinstance(chunk, Runs) else chunk.cast(self._coded)
            self.ops.write_table(table)

    def close(self) -> None:
        self.ops.close()
        self.tokens.close()


IN_FLIGHT = 4  # chunks a child may hold unwritten before the simulation waits for it


class Sink:
    """Where a streamed op log's chunks go: encoded and written while the next ones are made (on a
    thread: one in flight; in a child: up to `IN_FLIGHT`, so a burst of chunks does not stall the
    simulation on each one's encoding)."""

    def __init__(self, folder: Path, process: bool = False):
        self.folder = folder
        self._last: Future | None = None  # the thread's chunk in flight
        self._child: subprocess.Popen | None = None
        self._awaiting = 0  # chunks sent to the child whose reply is not read yet
        if process:
            # SIGINT ignored from its first instruction (an ignored signal stays ignored across exec):
            # a Ctrl-C to the group while it still imports would otherwise print its own KeyboardInterrupt
            # SIGINT is held back in this process while it forks: a preexec_fn makes Python run its
            # at-fork hooks, and a Ctrl-C landing in one (logging's `_releaseLock`) is printed as an
            # ignored exception instead of interrupting; held back, it interrupts right after
            held = hasattr(signal, "pthread_sigmask")
            if held:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                self._child = subprocess.Popen([sys.executable, "-m", "kvsim.kvcache.op_writer", str(folder)],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               env={**os.environ, **_CHILD_MALLOC},
                                               preexec_fn=_ignore_sigint if os.name == "posix" else None)
            finally:
                if held:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        else:
            self._files = Files(folder)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvsim-ops")

    def write(self, name: str, chunk, late=None) -> None:
        """Queue a chunk for `Files.write`, in order (on a thread: once the one before is written)."""
        if self._child is None:
            self.wait()
            self._last = self._pool.submit(self._files.write, name, chunk, late)
            return
        while self._awaiting >= IN_FLIGHT:
            self._reply()
        if name == "tokens" and isinstance(chunk, list):  # a Sequence stays here: its ids' parts go
            chunk = [(s, token_parts(t, n), n) for s, t, n in chunk]
        self._send((name, chunk, late))

    def wait(self) -> None:
        """Block until every chunk in flight is written; re-raise the writer's error here."""
        while self._awaiting:
            self._reply()
        if self._last is not None:
            last, self._last = self._last, None
            last.result()

    def close(self) -> None:
        if self._child is None:
            try:
                self.wait()
            finally:
                self._pool.shutdown()
                self._files.close()
            return
        try:
            self.wait()
            self._send(None)
            self.wait()
        finally:
            self._child.stdin.close()
            self._child.wait()

    def _send(self, message) -> None:
        # NOTE: pickled here, then written whole: the pipe holds only 64 KiB, and the child reading
        # it as it unpickled would keep the simulation waiting on every frame
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._child.stdin.write(len(data).to_bytes(8, "little"))
            self._child.stdin.write(data)
            self._child.stdin.flush()
        except BrokenPipeError:
            while True:
                self._reply()  # the replies before its error, then the error: says why it stopped
        self._awaiting += 1

    def _reply(self) -> None:
        """Read the reply to the oldest chunk in flight (blocking); raise the writer's error."""
        self._awaiting = max(self._awaiting - 1, 0)
        try:
            error = pickle.load(self._child.stdout)
        except EOFError:
            error = f"exited with status {self._child.wait()}"
        if error is not None:
            self._awaiting = 0
            raise RuntimeError(f"the op log writer for {self.folder} failed: {error}")


def _ignore_sigint() -> None:
    """Run in the op writer's child before it execs (POSIX): SIGINT ignored, then no longer held back
    (a Ctrl-C that came while it was held is dropped, being ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _read(inbox, messages: queue.SimpleQueue) -> None:
    """The child's reader thread: each message's bytes from `inbox` (unbuffered: no lock a daemon
    thread could hold at exit) as they come, so the simulation's writes never wait for an encoding;
    then None at the end of `inbox`."""
    while True:
        size = _exactly(inbox, 8)
        data = _exactly(inbox, int.from_bytes(size, "little")) if size is not None else None
        messages.put(data)
        if data is None:
            return


def _exactly(inbox, n: int) -> bytearray | None:
    """`n` bytes read from the raw file `inbox`; None if it ends first."""
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = inbox.readinto(view[got:])
        if not k:
            return None
        got += k
    return out


def serve(folder: Path, inbox, outbox) -> None:
    """The child's loop: write each chunk read from `inbox` (a raw file: a pickle after its length, 8
    bytes), reply None (or the error) to `outbox`; stop at None (files closed) or at the end of `inbox`."""
    files = Files(folder)
    messages: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read, args=(inbox, messages), daemon=True).start()
    while True:
        data = messages.get()
        if data is None:
            return  # the simulation is gone: nothing to finish
        message = pickle.loads(data)
        del data
        try:
            if message is None:
                files.close()
            else:
                files.write(*message)
            error = None
        except Exception:  # noqa: BLE001 - any failure goes back to the parent, which raises it
            error = traceback.format_exc()
        pickle.dump(error, outbox)
        outbox.flush()
        if message is None or error is not None:
            return


if __name__ == "__main__":
    # A Ctrl-C reaches the whole process group: the simulation stops this child (by closing its
    # pipe), so the child itself neither stops nor prints a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies, sys.stdout = sys.stdout.buffer, sys.stderr  # nothing else may write to the replies
    try:
        serve(Path(sys.argv[1]), open(sys.stdin.fileno(), "rb", buffering=0, closefd=False), replies)
    except OSError:  # the simulation is gone (interrupted) and its folder with it: nothing to tell
        sys.exit(1)
