"""Replay a run's op stream on paged KV storage and verify every computed token exactly.

Ops run in stream order, step by step (`gpu.executor` batches them). `table`
ops keep each sequence's block table (`gpu.tables`). After each checked step,
every sequence that computed tokens in it is read back through its table and
compared with the values its prefix implies (`gpu.checks`). A sequence whose
blocks are freed mid-step is checked just before.

With vLLM's hybrid KV-cache groups (a stream with a `group` column past 0, and
config.json's `kv_cache_groups`), every group shares the one storage indexed by
block id and each (sequence, group) has its own table, named `seq@g<group>`
(group 0: `seq`); its values are the group's (`values.group_keys`). An attention
group's K/V is read back through its table (a window's or chunk's null entries
are not read); a Mamba group's page is one opaque state: a write fills it with
the state's value, and a check reads the state block the request uses now whole.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsim.gpu.backends import backend
from kvsim.gpu.checks import CHECKS, Checks
from kvsim.gpu.executor import ONE_WAY, PAIR_KINDS, SKIPPED, OpExecutor
from kvsim.gpu.predict import predictor
from kvsim.gpu.report import ReplayReport, StepTime
from kvsim.gpu.storage import PagedKVStorage
from kvsim.gpu.tables import BlockTables
from kvsim.gpu.timing import Timer
from kvsim.gpu.values import DeviceValues, group_keys, prefix_keys
from kvsim.kvcache.groups import KINDS as GROUP_KINDS
from kvsim.kvcache.ops import Op, as_rows, read_op_rows, read_ops, read_tokens
from kvsim.sim.engine.config import KV_GROUPS_KEY as GROUPS_KEY
from kvsim.workloads.files import read_json

_RECORD = ("record the op stream with `kvsim run --record-ops` (or KVCacheManager(record_ops=True) "
           "and manager.ops.save(folder))")
RUN_FILES = {
    "ops.parquet": _RECORD,
    "op_tokens.parquet": "the replay needs each sequence's token ids, which OpLog.save(folder) writes next to "
                         "ops.parquet; " + _RECORD,
    "config.json": "write the run's config there (block_size, num_gpu_blocks, num_cpu_blocks)",
}
PROGRESS_S = 5.0  # seconds between progress lines
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # (vLLM's --kv-cache-dtype names for FP8)


class RunFilesError(Exception):
    """A run folder lacks a file the replay needs, or the files disagree; the message names the file."""


def load_run(run_dir: str | Path, *, rows: bool = False) -> tuple[list, dict[str, np.ndarray], dict[str, Any]]:
    """A run folder's ops (`Op` records, or with `rows` the plain tuples the replay loops over:
    far cheaper for millions of ops), each sequence's token ids, and its config."""
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
    for name, read in (("ops.parquet", read_op_rows if rows else read_ops), ("op_tokens.parquet", read_tokens)):
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
    check: str = "full",
    progress: Callable[[str], None] | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    attention_sample: int | None = None,
) -> ReplayReport:
    """Replay `run_dir`'s ops on `device` and verify them (see the module docstring).

    dtype: float16 / bfloat16 / float32, or an FP8 cache, fp8 (e4m3) / fp8_e5m2, whose values are
    stored over `kv_scales` (K, V: powers of two) as vLLM's k_scale and v_scale (default float16 on
    CUDA, float32 on CPU).
    kernels: "triton" or "torch" (`gpu.backends`; default triton on CUDA, torch on CPU).
    strict: raise IntegrityError at the first mismatch; else count them in the report.
    attention_layers: layers whose decode output is checked against dense attention (default: all
    with the triton kernels, whose kernel runs and is timed on every layer either way; none with the
    torch kernels, whose paged attention would only recompute the reference from the same, already
    verified, K/V).
    attention_sample: compare at most this many of a step's decodes, in turn (default: every one).
    The comparison's dense reference spans each decode's whole context, so on long contexts it,
    not the replay, sets the pace; the kernel still runs on every decode and every position an
    op touched is still read back.
    """
    ops, tokens, config = load_run(run_dir, rows=True)
    return replay_ops(ops, tokens, config, device, layers, kv_heads, head_dim, check_every, dtype,
                      q_per_kv=q_per_kv, swap_method=swap_method, strict=strict, run=str(run_dir),
                      attention_layers=attention_layers, kernels=kernels, check=check, progress=progress,
                      kv_scales=kv_scales, attention_sample=attention_sample)


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
    check: str = "full",
    progress: Callable[[str], None] | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    attention_sample: int | None = None,
) -> ReplayReport:
    """`replay_run` on ops, tokens and config already in memory (tests inject faults here)."""
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1, got {check_every}")
    if check not in CHECKS:
        raise ValueError(f"unknown check {check!r}; choose from {', '.join(CHECKS)}")
    if attention_sample is not None and attention_sample < 1:
        raise ValueError(f"attention_sample must be >= 1 (or None for every decode), got {attention_sample}")
    dev = torch.device(device)
    kern = backend(kernels or ("torch" if dev.type == "cpu" else "triton"), dev)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    dtype = dtype or (torch.float16 if dev.type == "cuda" else torch.float32)
    if attention_layers is None:
        attention_layers = layers if kern.measures else 0
    if attention_sample is not None and not attention_layers:
        raise ValueError(f"attention_sample {attention_sample} picks decodes to compare against dense attention, and "
                         f"this replay compares none (attention layers 0; the torch kernels' default): give "
                         f"attention_layers too, or drop it")
    r = _Replayer(as_rows(ops), tokens, config, dev, layers, kv_heads, head_dim, dtype, q_per_kv, swap_method, kern,
                  run=run, attention_layers=attention_layers, strict=strict, check=check, progress=progress,
                  kv_scales=kv_scales, attention_sample=attention_sample)
    # NOTE: a replay issues many small tensor ops; on the CPU, torch's worker threads cost more
    # than they give (5x slower on a busy 2-core machine), so it runs on one.
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        return r.run(check_every)
    finally:
        torch.set_num_threads(threads)


def kv_groups(rows: Sequence[tuple], config: Mapping[str, Any]) -> list[tuple[str, int | None]] | None:
    """A hybrid run's groups from config.json, (kind, window) each, or None for one group; a stream
    whose ops name a group config.json does not describe is refused."""
    groups, used = config.get(GROUPS_KEY), max((r[8] for r in rows), default=0)
    if groups is None:
        if used:
            raise RunFilesError(f"config.json: the op stream has KV-cache groups 0 to {used} but no {GROUPS_KEY!r} "
                                "(each group's kind, window and block_size); record the run again with `kvsim run "
                                "--record-ops`, which writes them")
        return None
    if not isinstance(groups, list) or not groups:
        raise RunFilesError(f"config.json: {GROUPS_KEY} must be a list of groups, got {groups!r}")
    out = []
    for i, g in enumerate(groups):
        kind = g.get("kind") if isinstance(g, dict) else None
        window = g.get("window") if isinstance(g, dict) else None
        if kind not in GROUP_KINDS or not isinstance(g.get("block_size"), int) \
                or (window is not None and not isinstance(window, int)):
            raise RunFilesError(f"config.json: {GROUPS_KEY}[{i}] is {g!r}; expected kind (one of "
                                f"{', '.join(GROUP_KINDS)}), window (an integer or null) and an integer block_size")
        out.append((kind, window))
    if used >= len(out):
        raise RunFilesError(f"config.json: {GROUPS_KEY} names {len(out)} groups, but the op stream has group {used}")
    return out


def _sizes(rows: Sequence[tuple], config: Mapping[str, Any]) -> tuple[int, int, int]:
    """GPU, CPU (swap) and host-tier blocks the storage needs: the highest ids the ops use, the first
    two within the config's counts."""
    gpu, cpu, host = [1], [-1], [-1]
    for _, k, a, b, *_ in rows:
        if k in ("write", "copy", "swap_out", "move", "table", "free", "evict", "store"):
            gpu.append(a)
        if k in ("copy", "swap_in", "move", "load"):
            gpu.append(b)
        if k == "swap_out" or k == "swap_in":
            cpu.append(b if k == "swap_out" else a)
        elif k == "store" or k == "load":
            host.append(b if k == "store" else a)
        elif k == "file_write" or k == "file_read":
            host.append(a if k == "file_write" else b)
    n_gpu, n_cpu, n_host = max(gpu) + 1, max(cpu) + 1, max(host) + 1
    for key, n in (("num_gpu_blocks", n_gpu), ("num_cpu_blocks", n_cpu)):
        limit = config.get(key)
        if isinstance(limit, int) and n > limit:
            raise RunFilesError(f"config.json: {key} is {limit}, but the ops use block {n - 1}")
    return n_gpu, n_cpu, n_host


class _Replayer:
    def __init__(self, rows, tokens, config, device, layers, kv_heads, head_dim, dtype, q_per_kv,
                 swap_method, kernels, *, run, attention_layers, strict, check, progress, kv_scales=(1.0, 1.0),
                 attention_sample=None):
        self.rows, self.tokens = rows, tokens
        self.groups = kv_groups(rows, config)
        self.mamba = {g for g, (kind, _) in enumerate(self.groups or ()) if kind == "mamba"}
        # a hybrid run's block size is its groups' (vLLM raises it for Mamba pages)
        self.bs = bs = int(config[GROUPS_KEY][0]["block_size"] if self.groups else config["block_size"])
        self._page = np.arange(bs, dtype=np.int64)  # a Mamba state page: every slot of its block
        self._names: dict[tuple[str, int], str] = {}
        self._base: dict[str, tuple[str, int]] = {}  # table name -> (sequence, group)
        n_gpu, n_cpu, n_host = _sizes(rows, config)
        self.st = PagedKVStorage(layers, n_gpu, bs, kv_heads, head_dim, num_cpu_blocks=n_cpu,
                                 num_host_blocks=n_host, dtype=dtype, device=device, scales=kv_scales)
        self.num_heads = kv_heads * q_per_kv
        self.timer = Timer(device)
        self.values = DeviceValues(layers, kv_heads, self.num_heads, head_dim, self.st.device, self.st.compute_dtype)
        self.ex = OpExecutor(self.st, self.timer, self.values, kernels, swap_method)
        self.tables = BlockTables()
        self.pred = predictor(config)
        self._keys: dict[str, np.ndarray] = {}
        self.progress = progress
        self._step_units: list[tuple[int, str, int]] = []
        geometry = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "heads": self.num_heads,
                    "block_size": bs, "gpu_blocks": n_gpu, "cpu_blocks": n_cpu, "host_blocks": n_host}
        self.report = ReplayReport(run, str(device), str(dtype).removeprefix("torch."), geometry,
                                   scale=self.st.block_bytes / self.pred.block_bytes,
                                   model=self.pred.model, gpu=self.pred.gpu,
                                   kernels=kernels.name, attention_layers=attention_layers,
                                   attention_sample=attention_sample, check=check,
                                   config=dict(config))
        self.checks = Checks(self.st, self.tables, self.values, self._keys, self.ex, self.timer, self.report,
                             window=self.pred.sliding_window, num_heads=self.num_heads,
                             attention_layers=attention_layers, strict=strict, touched=check == "touched",
                             attention_sample=attention_sample)

    # ---------------------------------------------------------------- stream
    def run(self, check_every: int) -> ReplayReport:
        rep = self.report
        last, t0, shown = (self.rows[-1][0] if self.rows else 0), time.perf_counter(), 0.0
        first = self.rows[0][0] if self.rows else 0
        for ordinal, (step, group) in enumerate(groupby(self.rows, key=itemgetter(0))):
            self._step(step, list(group), ordinal % check_every == 0)
            if self.progress is not None and time.perf_counter() - t0 - shown >= PROGRESS_S:
                shown = time.perf_counter() - t0
                left = shown * (last - step) / (step - first + 1)  # (steps so far at the pace so far)
                self.progress(f"step {step:,} of {last:,}: {rep.tokens_verified:,} tokens verified, "
                              f"{rep.mismatches:,} mismatches, {shown:.0f} s, about {left:.0f} s left")
        rep.launches = self.ex.launches
        totals = self.timer.totals()
        per_step: dict[int, float] = {}
        for (step, kind), s in totals.items():
            rep.measured_s[kind] = rep.measured_s.get(kind, 0.0) + s
            per_step[step] = per_step.get(step, 0.0) + s
        by_kind: Counter = Counter()
        for (_, kind), n in self.timer.launches.items():
            by_kind[kind] += n
        rep.predicted_s = {k: self.pred(k, n) for k, n in rep.units.items()}
        rep.launch_predicted_s = {k: self.pred.launches(k, by_kind[k]) for k in rep.units}
        for t in rep.step_times:
            t.measured_s = per_step.get(t.step, 0.0)
        calls, launches = self.timer.calls, self.timer.launches
        rep.step_kinds = [[step, kind, units, calls.get((step, kind), 0), totals.get((step, kind), 0.0),
                           launches.get((step, kind), 0)] for step, kind, units in self._step_units]
        return rep

    def _step(self, step: int, rows: list[tuple], check: bool) -> None:
        rep, ex, tables, bs, checks = self.report, self.ex, self.tables, self.bs, self.checks
        ex.step = step
        rep.steps += 1
        rep.steps_checked += check
        before = Counter(rep.units)
        written: dict[str, list[int]] = {}  # seq -> [tokens this step, newest position]
        mamba = self.mamba
        for _, kind, a, b, c, seq, _, pos, group in rows:
            rep.ops[kind] += 1
            if group and seq:
                seq = self._name(seq, group)
            if kind == "write":
                n = c - b
                if group in mamba:  # the state after pos + n tokens, in every slot of the page
                    keys = self._seq_keys(seq, pos + n, step)
                    ex.write(a * bs + self._page, np.full(bs, keys[pos + n - 1], dtype=np.uint64))
                else:
                    keys = self._seq_keys(seq, pos + n, step)[pos : pos + n]
                    ex.write(a * bs + np.arange(b, c, dtype=np.int64), keys)
                checks.touch(a)
                w = written.setdefault(seq, [0, -1])
                w[0] += n
                w[1] = max(w[1], pos + n - 1)
                rep.units["write"] += n
            elif kind in PAIR_KINDS:
                if kind == "move":
                    tables.exchange(a, b)
                if c == ONE_WAY and kind == "move":
                    ex.pair("copy", b, a)
                elif c != SKIPPED:
                    ex.pair(kind, a, b)
                if kind in ("copy", "swap_in", "move", "load"):  # the others write the host or files
                    checks.touch(b)
                    if kind == "move":
                        checks.touch(a)
                rep.units[kind] += 1
            elif kind == "table":
                tables.set(seq, b, a)
                checks.retable(seq, b)
            elif kind == "free":
                due = [s for s in tables.holders.get(a, ()) if s in written]
                if due and check:
                    ex.flush()
                    checks.verify(step, self._with_states(step, {s: written[s] for s in sorted(due)}))
                for s in due:
                    del written[s]
                for s in tables.free(a):
                    checks.drop(s)
            elif kind != "evict":
                raise RunFilesError(f"ops.parquet: unknown op kind {kind!r} at step {step}")
        ex.flush()
        if check and written:
            checks.verify(step, self._with_states(step, written))
        done = {k: n - before[k] for k, n in rep.units.items() if n > before[k]}
        self._step_units.extend((step, k, n) for k, n in done.items())
        launches, scale = self.timer.launches, rep.scale
        rep.step_times.append(StepTime(step, 0.0, sum(self.pred.replay_s(k, n, launches.get((step, k), 0), scale)
                                                      for k, n in done.items())))

    def _with_states(self, step: int, written: dict[str, list[int]]) -> dict[str, list[int]]:
        """`written` plus every Mamba table of its sequences, each at its sequence's newest position:
        the state a request uses must stand for every token it computed (a state write lost or
        standing for another position is caught)."""
        if not self.mamba:
            return written
        newest: dict[str, int] = {}
        for name, (_, last) in written.items():
            seq = self._base.get(name, (name, 0))[0]
            newest[seq] = max(newest.get(seq, -1), last)
        out = dict(written)
        for seq, last in newest.items():
            for g in self.mamba:
                name = self._name(seq, g)
                if name in out or name in self.tables.rows:
                    self._seq_keys(name, last + 1, step)
                    out[name] = [out.get(name, (0,))[0], last]
        return out

    def _name(self, seq: str, group: int) -> str:
        """The table name of `seq`'s table in KV-cache group `group` (> 0)."""
        name = self._names.get((seq, group))
        if name is None:
            name = self._names[seq, group] = f"{seq}@g{group}"
            self._base[name] = (seq, group)
        return name

    def _seq_keys(self, name: str, upto: int, step: int) -> np.ndarray:
        """The value keys of table `name`'s positions (its sequence's, as its group holds them); on
        first use its group's kind and window are told to the checks."""
        keys = self._keys.get(name)
        if keys is None:
            seq, group = self._base.get(name, (name, 0))
            if seq not in self.tokens:
                raise RunFilesError(f"op_tokens.parquet: no tokens for sequence {seq!r} (written at step {step})")
            keys = self._keys[name] = group_keys(prefix_keys(self.tokens[seq]), group)
            if self.groups is not None:
                self.checks.kind(name, *self.groups[group])
        if upto > len(keys):
            seq = self._base.get(name, (name, 0))[0]
            raise RunFilesError(f"op_tokens.parquet: sequence {seq!r} has {len(keys)} tokens, "
                                f"step {step} writes position {upto - 1}")
        return keys
