"""Replay a run's op stream on paged KV storage and verify every computed token exactly.

Ops run in stream order, step by step (`gpu.executor` batches them). `table`
ops keep each sequence's block table (`gpu.tables`). After each checked step,
every sequence that computed tokens in it is read back through its table,
position 0 up to its newest token, and compared bit-exactly with the values
its prefix implies (`gpu.values`); decode sequences (one new token) also run
the paged decode-attention kernel against dense attention over the expected
K/V. A sequence whose blocks are freed mid-step is checked just before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu.backends import backend
from gpu.executor import ONE_WAY, PAIR_KINDS, SKIPPED, OpExecutor
from gpu.expected import ExpectedKV
from gpu.predict import predictor
from gpu.report import ReplayReport, StepTime
from gpu.storage import PagedKVStorage
from gpu.tables import BlockTables
from gpu.timing import Timer
from gpu.values import DeviceValues, device_keys, prefix_keys
from gpu.verify import (
    IntegrityError,
    Mismatch,
    attention_errors,
    compare_kv,
    dense_decode,
    first_bad,
)
from kvcache.ops import Op, read_ops, read_tokens
from workloads.files import read_json

MAX_ERRORS = 10
MAX_FOUND = 10_000
_RECORD = ("record the op stream with `kvsim run --record-ops` (or KVCacheManager(record_ops=True) "
           "and manager.ops.save(folder))")
RUN_FILES = {
    "ops.parquet": _RECORD,
    "op_tokens.parquet": "the replay needs each sequence's token ids, which OpLog.save(folder) writes next to "
                         "ops.parquet; " + _RECORD,
    "config.json": "write the run's config there (block_size, num_gpu_blocks, num_cpu_blocks)",
}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class RunFilesError(Exception):
    """A run folder lacks a file the replay needs, or the files disagree; the message names the file."""


def load_run(run_dir: str | Path) -> tuple[list[Op], dict[str, np.ndarray], dict[str, Any]]:
    """A run folder's ops, each sequence's token ids, and its config."""
    d = Path(run_dir)
    if not d.is_dir():
        raise RunFilesError(f"{d}: no such run folder")
    for name, how in RUN_FILES.items():
        if not (d / name).is_file():
            raise RunFilesError(f"{d / name}: missing; {how}")
    try:
        config = read_json(d / "config.json")
    except ValueError as e:
        raise RunFilesError(str(e)) from None
    if not isinstance(config, dict) or not isinstance(config.get("block_size"), int):
        raise RunFilesError(f"{d / 'config.json'}: needs an integer 'block_size'")
    tables = []
    for name, read in (("ops.parquet", read_ops), ("op_tokens.parquet", read_tokens)):
        try:
            tables.append(read(d / name))
        except (ValueError, KeyError):  # pyarrow's ArrowInvalid, or a column missing
            raise RunFilesError(f"{d / name}: not an op table (corrupt, or another format)") from None
    return tables[0], tables[1], config


def replay_run(
    run_dir: str | Path,
    device: str = "cpu",
    layers: int = 2,
    kv_heads: int = 2,
    head_dim: int = 16,
    check_every: int = 1,
    dtype: str | torch.dtype | None = None,
    *,
    q_per_kv: int = 2,
    swap_method: str = "kernel",
    strict: bool = True,
    attention_layers: int | None = None,
    kernels: str | None = None,
) -> ReplayReport:
    """Replay `run_dir`'s ops on `device` and verify them (see the module docstring).

    dtype: float16 / bfloat16 / float32 (default float16 on CUDA, float32 on CPU).
    kernels: "triton" or "torch" (`gpu.backends`; default triton on CUDA, torch on CPU).
    strict: raise IntegrityError at the first mismatch; else count them in the report.
    attention_layers: layers whose decode output is checked against dense attention (default: all
    with the triton kernels, whose kernel runs and is timed on every layer either way; none with the
    torch kernels, whose paged attention would only recompute the reference from the same, already
    verified, K/V).
    """
    ops, tokens, config = load_run(run_dir)
    return replay_ops(ops, tokens, config, device, layers, kv_heads, head_dim, check_every, dtype,
                      q_per_kv=q_per_kv, swap_method=swap_method, strict=strict, run=str(run_dir),
                      attention_layers=attention_layers, kernels=kernels)


def replay_ops(
    ops: Sequence[Op] | Sequence[tuple],
    tokens: Mapping[str, np.ndarray],
    config: Mapping[str, Any],
    device: str = "cpu",
    layers: int = 2,
    kv_heads: int = 2,
    head_dim: int = 16,
    check_every: int = 1,
    dtype: str | torch.dtype | None = None,
    *,
    q_per_kv: int = 2,
    swap_method: str = "kernel",
    strict: bool = True,
    run: str = "<ops>",
    attention_layers: int | None = None,
    kernels: str | None = None,
) -> ReplayReport:
    """`replay_run` on ops, tokens and config already in memory (tests inject faults here)."""
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1, got {check_every}")
    dev = torch.device(device)
    kern = backend(kernels or ("torch" if dev.type == "cpu" else "triton"), dev)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    dtype = dtype or (torch.float16 if dev.type == "cuda" else torch.float32)
    r = _Replayer(as_rows(ops), tokens, config, dev, layers, kv_heads, head_dim, dtype, q_per_kv, swap_method, strict, kern)
    if attention_layers is None:
        attention_layers = layers if kern.measures else 0
    r.attention_layers = r.report.attention_layers = attention_layers
    r.report.run, r.report.kernels = run, kern.name
    # NOTE: a replay issues many small tensor ops; on the CPU, torch's worker threads cost more
    # than they give (5x slower on a busy 2-core machine), so it runs on one.
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        return r.run(check_every)
    finally:
        torch.set_num_threads(threads)


def as_rows(ops: Sequence[Op] | Sequence[tuple]) -> list[tuple]:
    """Ops as plain tuples in `Op`'s field order, the replay loop's form (far cheaper than records
    to build for millions of ops); tuples pass through."""
    if ops and isinstance(ops[0], Op):
        return [(o.step, o.kind, o.a, o.b, o.c, o.seq, o.hash, o.pos) for o in ops]
    return list(ops)


def _sizes(rows: Sequence[tuple], config: Mapping[str, Any]) -> tuple[int, int]:
    """GPU and CPU blocks the storage needs: the highest ids the ops use, within the config's counts."""
    gpu, cpu = [1], [0]
    for _, k, a, b, *_ in rows:
        if k in ("write", "copy", "swap_out", "move", "table", "free", "evict"):
            gpu.append(a)
        if k in ("copy", "swap_in", "move"):
            gpu.append(b)
        if k == "swap_out":
            cpu.append(b)
        elif k == "swap_in":
            cpu.append(a)
    n_gpu, n_cpu = max(gpu) + 1, max(cpu) + (1 if len(cpu) > 1 else 0)
    for key, n in (("num_gpu_blocks", n_gpu), ("num_cpu_blocks", n_cpu)):
        limit = config.get(key)
        if isinstance(limit, int) and n > limit:
            raise RunFilesError(f"config.json: {key} is {limit}, but the ops use block {n - 1}")
    return n_gpu, n_cpu


class _Replayer:
    def __init__(self, rows, tokens, config, device, layers, kv_heads, head_dim, dtype, q_per_kv,
                 swap_method, strict, kernels):
        self.rows, self.tokens, self.strict = rows, tokens, strict
        self.bs = bs = int(config["block_size"])
        n_gpu, n_cpu = _sizes(rows, config)
        self.st = PagedKVStorage(layers, n_gpu, bs, kv_heads, head_dim, num_cpu_blocks=n_cpu,
                                 dtype=dtype, device=device)
        self.num_heads = kv_heads * q_per_kv
        self.timer = Timer(device)
        self.values = DeviceValues(layers, kv_heads, self.num_heads, head_dim, self.st.device, dtype)
        self.kernels = kernels
        self.ex = OpExecutor(self.st, self.timer, self.values, kernels, swap_method)
        self.tables = BlockTables()
        self.pred = predictor(config)
        self.window = self.pred.sliding_window
        self._keys: dict[str, np.ndarray] = {}
        self.expected = ExpectedKV(self.values, self._keys.__getitem__, self.st.device)
        self._step_units: list[tuple[int, str, int]] = []
        geometry = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "heads": self.num_heads,
                    "block_size": bs, "gpu_blocks": n_gpu, "cpu_blocks": n_cpu}
        self.report = ReplayReport("", str(device), str(dtype).removeprefix("torch."), geometry,
                                   scale=self.st.block_bytes / self.pred.block_bytes,
                                   model=self.pred.model, gpu=self.pred.gpu)

    # ---------------------------------------------------------------- stream
    def run(self, check_every: int) -> ReplayReport:
        rep = self.report
        for ordinal, (step, group) in enumerate(groupby(self.rows, key=itemgetter(0))):
            self._step(step, list(group), ordinal % check_every == 0)
        rep.launches = self.ex.launches
        totals = self.timer.totals()
        per_step: dict[int, float] = {}
        for (step, kind), s in totals.items():
            rep.measured_s[kind] = rep.measured_s.get(kind, 0.0) + s
            per_step[step] = per_step.get(step, 0.0) + s
        rep.predicted_s = {k: self.pred(k, n) for k, n in rep.units.items()}
        for t in rep.step_times:
            t.measured_s = per_step.get(t.step, 0.0)
        rep.step_kinds = [[step, kind, units, self.timer.calls.get((step, kind), 0), totals.get((step, kind), 0.0)]
                          for step, kind, units in self._step_units]
        return rep

    def _step(self, step: int, rows: list[tuple], check: bool) -> None:
        rep, ex, tables, bs = self.report, self.ex, self.tables, self.bs
        ex.step = step
        rep.steps += 1
        rep.steps_checked += check
        before = Counter(rep.units)
        written: dict[str, list[int]] = {}  # seq -> [tokens this step, newest position]
        for _, kind, a, b, c, seq, _, pos in rows:
            rep.ops[kind] += 1
            if kind == "write":
                n = c - b
                keys = self._seq_keys(seq, pos + n, step)[pos : pos + n]
                ex.write(a * bs + np.arange(b, c, dtype=np.int64), keys)
                w = written.setdefault(seq, [0, -1])
                w[0] += n
                w[1] = max(w[1], pos + n - 1)
                rep.units["write"] += n
            elif kind in PAIR_KINDS:
                if kind == "move":
                    tables.exchange(a, b)
                if c == ONE_WAY:
                    ex.pair("copy", b, a)
                elif c != SKIPPED:
                    ex.pair(kind, a, b)
                rep.units[kind] += 1
            elif kind == "table":
                tables.set(seq, b, a)
            elif kind == "free":
                due = [s for s in tables.holders.get(a, ()) if s in written]
                if due and check:
                    ex.flush()
                    self._verify(step, {s: written[s] for s in sorted(due)})
                for s in due:
                    del written[s]
                for s in tables.free(a):
                    self.expected.drop(s)
            elif kind != "evict":
                raise RunFilesError(f"ops.parquet: unknown op kind {kind!r} at step {step}")
        ex.flush()
        if check and written:
            self._verify(step, written)
        done = {k: n - before[k] for k, n in rep.units.items() if n > before[k]}
        self._step_units.extend((step, k, n) for k, n in done.items())
        rep.step_times.append(StepTime(step, 0.0, sum(self.pred(k, n) for k, n in done.items())))

    def _seq_keys(self, seq: str, upto: int, step: int) -> np.ndarray:
        keys = self._keys.get(seq)
        if keys is None:
            if seq not in self.tokens:
                raise RunFilesError(f"op_tokens.parquet: no tokens for sequence {seq!r} (written at step {step})")
            keys = self._keys[seq] = prefix_keys(self.tokens[seq])
        if upto > len(keys):
            raise RunFilesError(f"op_tokens.parquet: sequence {seq!r} has {len(keys)} tokens, "
                                f"step {step} writes position {upto - 1}")
        return keys

    # ---------------------------------------------------------------- checks
    def _verify(self, step: int, written: Mapping[str, list[int]]) -> None:
        """Check each written sequence's K/V (all of them in one pass, one device sync), then
        decode attention for the one-token ones."""
        rep, bs, st = self.report, self.bs, self.st
        checks = []  # (seq, tokens this step, extent, positions, blocks)
        for seq, (n_new, newest) in written.items():
            extent = newest + 1
            pos, blocks, missing = self.tables.slots(seq, extent, bs)
            rep.sequence_checks += 1
            if missing >= 0:
                self._mismatch(1, Mismatch(step, seq, missing, "table", entry=missing // bs))
            else:
                checks.append((seq, n_new, extent, pos, blocks))
        if not checks:
            return
        pos = np.concatenate([c[3] for c in checks])
        slots = torch.from_numpy(np.concatenate([c[4] for c in checks]) * bs + pos % bs).to(st.device)
        rep.tokens_verified += len(pos)
        if self.kernels.derives_expected:  # the fused kernel derives each value from its key
            planes = st.gpu.view(st.num_layers * 2, -1, st.num_kv_heads * st.head_dim)
            keys = np.concatenate([self._keys[c[0]][c[3]] for c in checks])
            wrong = self.kernels.any_wrong(planes, slots, device_keys(keys, st.device), self.values.kv_salts)
        else:
            expected = torch.cat([self.expected.at(c[0], c[3], c[2]) for c in checks], dim=2)
            wrong = not torch.equal(st.slots().index_select(2, slots), expected)
        bad = set()
        if wrong:
            for seq, _, extent, p, b in checks:
                expected = self.expected.at(seq, p, extent).permute(2, 0, 1, 3, 4)
                n_bad, first = compare_kv(st, p, b, expected, step=step, seq=seq)
                if first is not None:
                    bad.add(seq)
                    self._mismatch(n_bad, first)
        decodes = [(c[0], c[2], c[3], c[4]) for c in checks if c[1] == 1 and c[0] not in bad]
        if decodes:
            self._check_decodes(step, decodes)

    def _check_decodes(self, step: int, decodes: list[tuple[str, int, np.ndarray, np.ndarray]]) -> None:
        """Paged decode attention on every layer; on the first `attention_layers` layers, its output
        against dense attention over the expected K/V (never read from the storage), all decodes
        in one batch."""
        st, rep, bs = self.st, self.report, self.bs
        # each sequence's attended positions (right-aligned in a padded [B, span] grid below)
        spans = [pos[pos >= n - self.window] if self.window else pos for _, n, pos, _ in decodes]
        rep.units["attention"] += sum(len(x) for x in spans)
        n_layers = min(self.attention_layers, st.num_layers)
        if not (n_layers or self.kernels.measures):
            return
        seqs = [d[0] for d in decodes]
        ctx = [d[1] for d in decodes]
        pages = max(-(-n // bs) for n in ctx)
        tables = torch.zeros((len(decodes), pages), dtype=torch.int32)
        for i, (seq, n, _, _) in enumerate(decodes):
            row = [max(b, 0) for b in self.tables.rows[seq][: -(-n // bs)]]
            tables[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        tables = tables.to(st.device)
        ctx_t = torch.tensor(ctx, dtype=torch.int32, device=st.device)
        last = np.array([self._keys[s][n - 1] for s, n in zip(seqs, ctx, strict=True)], dtype=np.uint64)
        q = self.values.query(device_keys(last, st.device))  # [B, layers, heads, dim]
        with self.timer(step, "attention"):
            out = self.kernels.decode(q, st, tables, ctx_t, self.window, max(ctx), n_layers)
        self.ex.launches += self.kernels.decode_launches(st, n_layers)
        if not n_layers:
            return
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
        first = first_bad(errs.view(b, layers, -1).transpose(0, 1), st.dtype, step=step, seqs=seqs,
                          positions=[n - 1 for n in ctx])
        if first is not None:
            self._mismatch(*first)
        rep.decode_checks += len(decodes)

    def _mismatch(self, n: int, first: Mismatch) -> None:
        if self.strict:
            raise IntegrityError(first.message())
        self.report.mismatches += n
        if len(self.report.found) < MAX_FOUND:
            self.report.found.append(first)
        if len(self.report.errors) < MAX_ERRORS:
            self.report.errors.append(first.message())
