"""Parameter sweeps: a grid of simulation points, run in parallel and resumable.

A sweep file is TOML with two tables:

    [base]                       # SimConfig fields, plus the workload
    workload = "trace.jsonl"     # relative to the sweep file; omit for the default workload
    format = "auto"
    num_gpu_blocks = 4000

    [grid]                       # lists; every combination is one point
    eviction = ["lru", "s3fifo"]
    block_size = [16, 32]

Each finished point is written atomically to `points/<point id>.json`; the id
is a readable slug of the grid values plus a hash of all the point's
parameters, so a rerun skips finished points (a killed sweep resumes) and a
changed base reruns them all. `sweep.parquet` gathers every point at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.workloads import files
from kvsim.workloads.request import Request, Workload

SWEEP_VERSION = 1
WORKLOAD_KEYS = ("workload", "format")
_TYPES = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
    "None": (type(None),),
}


@dataclass(frozen=True)
class WorkloadSpec:
    """How a study names its workload: a file (and format), a generator, or the default."""

    path: str | None = None
    format: str = "auto"
    generator: tuple[tuple[str, Any], ...] = ()  # `kvsim workload generate` options
    requests: tuple[Request, ...] = ()  # or the requests themselves (the Python API's lists)
    label: str = ""  # their name

    @property
    def name(self) -> str:
        if self.path:
            return Path(self.path).name
        if self.requests:
            return self.label or "requests"
        return dict(self.generator).get("kind", "default") if self.generator else "default"

    def open(self) -> Workload:
        """The workload, streamed from its file or generated (seeded, so identical each time)."""
        if self.requests:
            return Workload.from_list(list(self.requests), self.name)
        if self.path:
            from kvsim.workloads.traces import load_workload

            return load_workload(self.path, self.format)
        if self.generator:
            return generate(dict(self.generator))
        from kvsim.workloads.default import default_workload

        return default_workload()


def generate(options: dict[str, Any]) -> Workload:
    """A synthetic workload from `kvsim workload generate` options (kind, num_requests, ...)."""
    from kvsim.workloads.build import KINDS, build_workload

    opts = dict(options)
    kind = opts.pop("kind", None)
    if kind not in KINDS:
        raise ConfigError(f"generator kind must be one of {', '.join(KINDS)}, got {kind!r}")
    common = {"num_requests": 200, "rate": 1.0, "arrival": "poisson", "cv": 1.0, "seed": 0}
    args = {k: opts.pop(k, v) for k, v in common.items()}
    try:
        return build_workload(kind, options=opts, **args)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"generator {kind}: {e}") from None


@dataclass(frozen=True)
class Point:
    """One grid point: its stable id and parameters (workload path as written)."""

    id: str
    params: dict[str, Any]


@dataclass
class Sweep:
    """A parsed sweep file: base parameters, grid, and the folder paths are relative to."""

    source: str
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    root: Path

    def points(self) -> list[Point]:
        """Every combination of grid values, in file order (last key varies fastest)."""
        keys = list(self.grid)
        out = []
        for values in itertools.product(*(self.grid[k] for k in keys)):
            params = {**self.base, **dict(zip(keys, values, strict=True))}
            out.append(Point(point_id(params, keys), params))
        return out

    def workload(self, params: dict[str, Any]) -> WorkloadSpec:
        path = params.get("workload")
        if path is not None and not Path(path).is_absolute():
            path = str(self.root / path)
        return WorkloadSpec(path, params.get("format", "auto"))


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's contents; an unreadable or invalid file raises ConfigError naming it."""
    try:
        return files.read_toml(path)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def load_sweep(path: str | Path) -> Sweep:
    """Parse and check a sweep file; every point's config is validated before anything runs."""
    p = Path(path)
    data = read_toml(p)
    unknown = sorted(set(data) - {"base", "grid"})
    if unknown:
        raise ConfigError(f"{p}: unknown table or key {unknown[0]!r}; expected [base] and [grid]")
    base, grid = data.get("base", {}), data.get("grid", {})
    for name, table in (("base", base), ("grid", grid)):
        if not isinstance(table, dict):
            raise ConfigError(f"{p}: {name} must be a table ([{name}])")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{p} [grid]: {key} must be a non-empty list, got {values!r}")
    sweep = Sweep(str(p), base, grid, p.resolve().parent)
    check_params(base, f"{p} [base]")
    for i in range(max(map(len, grid.values()), default=0)):
        check_params({k: v[i] for k, v in grid.items() if i < len(v)}, f"{p} [grid]")
    for point in sweep.points():
        config_of(point.params, f"{p} point {point.id}")
    return sweep


def check_params(params: dict[str, Any], source: str) -> None:
    """Unknown keys (with close-match hints) and wrongly typed values raise ConfigError."""
    fields = {f.name: f for f in dataclasses.fields(SimConfig)}
    SimConfig.from_dict({k: v for k, v in params.items() if k not in WORKLOAD_KEYS}, source=source)
    for key, value in params.items():
        if key in WORKLOAD_KEYS:
            if not isinstance(value, str):
                raise ConfigError(f"{source}: {key} must be a string, got {value!r}")
            continue
        allowed = _allowed_types(str(fields[key].type))
        ok = allowed is None or (
            isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        )
        if not ok:
            raise ConfigError(f"{source}: {key} must be {fields[key].type}, got {value!r}")


def _allowed_types(annotation: str) -> tuple[type, ...] | None:
    parts = [a.strip() for a in annotation.split("|")]
    if any(a not in _TYPES for a in parts):
        return None  # a container field (extra): not checked here
    return tuple(t for a in parts for t in _TYPES[a])


def config_of(params: dict[str, Any], source: str) -> SimConfig:
    """The validated SimConfig of a point (workload keys dropped); checks that the model fits."""
    from kvsim.sim.engine.cost_model import CostModel

    cfg = SimConfig.from_dict(
        {k: v for k, v in params.items() if k not in WORKLOAD_KEYS}, source=source
    )
    try:
        cfg.validate()
        CostModel.from_config(cfg).num_gpu_blocks(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg


def point_id(params: dict[str, Any], keys: Iterable[str]) -> str:
    """`key=value,...` of the grid values, then a hash of every parameter (stable across runs)."""
    canon = json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(canon.encode()).hexdigest()[:10]
    slug = ",".join(f"{k}={Path(str(params[k])).name}" for k in keys)
    slug = re.sub(r"[^A-Za-z0-9=,._+-]+", "-", slug)[:80]
    return f"{slug}_{digest}" if slug else digest


def write_json_atomic(path: Path, obj: Any, sort_keys: bool = True) -> None:
    """Write JSON to a temporary file beside `path`, then rename: never a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=sort_keys)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_parallel(
    fn: Callable[..., Any],
    items: list[tuple],
    workers: int = 1,
    on_result: Callable[[tuple, Any], None] | None = None,
) -> list[Any]:
    """`fn(*item)` for every item on up to `workers` local processes; results in item order.

    `on_result(item, result)` runs in this process as each finishes (completion order).
    """
    results: dict[int, Any] = {}

    def done(i: int, res: Any) -> None:
        results[i] = res
        if on_result is not None:
            on_result(items[i], res)

    if workers <= 1 or len(items) <= 1:
        for i, item in enumerate(items):
            done(i, fn(*item))
    else:
        with ProcessPoolExecutor(min(workers, len(items)), initializer=_worker_signals) as ex:
            pending = {ex.submit(fn, *item): i for i, item in enumerate(items)}
            try:
                while pending:
                    finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        done(pending.pop(fut), fut.result())
            except BaseException:  # (an interrupt): stop the points running now, not after them
                for proc in list((getattr(ex, "_processes", None) or {}).values()):
                    proc.terminate()
                ex.shutdown(wait=False, cancel_futures=True)
                raise
    return [results[i] for i in range(len(items))]


def _worker_signals() -> None:
    """A worker leaves interrupts to the process that started it, which stops it (a Ctrl-C reaches
    the whole process group: without this, every worker would print its own traceback)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_ray(
    fn: Callable[..., Any],
    items: list[tuple],
    on_result: Callable[[tuple, Any], None] | None = None,
) -> list[Any]:
    """Like `run_parallel`, on Ray: the cluster at RAY_ADDRESS, or a local Ray instance.

    A task's error is raised here as itself (Ray's remote traceback chained to it), and on any
    error or interrupt the tasks still pending are cancelled.
    """
    ray = connect_ray()
    remote = ray.remote(fn)
    pending = {remote.remote(*item): i for i, item in enumerate(items)}
    results: dict[int, Any] = {}
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(ready[0])
            try:
                results[i] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:
                if e.cause is None:
                    raise
                raise e.cause from e
            if on_result is not None:
                on_result(items[i], results[i])
    except BaseException:
        for ref in pending:
            ray.cancel(ref)
        raise
    return [results[i] for i in range(len(items))]


def connect_ray() -> Any:
    """The `ray` module, initialised (unless it already is) by Ray's own `ray.init()` rules.

    That is: RAY_ADDRESS (`auto`, `host:6379` or `ray://host:10001`), else a cluster started
    on this machine by `ray start`, else a new local instance. A missing Ray or an unreachable cluster is a ConfigError, one line on the command line.
    """
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--ray needs Ray, which is not installed: pip install 'kvsim[ray]'"
        ) from None
    if not ray.is_initialized():
        try:
            ray.init(log_to_driver=False)
        except (ConnectionError, RuntimeError) as e:
            where = os.environ.get("RAY_ADDRESS") or "this machine"
            why = (str(e).strip() or type(e).__name__).splitlines()[0]
            raise ConfigError(
                f"--ray: cannot connect to the Ray cluster at {where}: {why}"
            ) from None
    return ray


def simulate_point(params: dict[str, Any], workload: WorkloadSpec) -> dict[str, Any]:
    """Run one point's full simulation; returns its summary (runs in a worker process)."""
    from kvsim.sim.engine.run import simulate

    cfg = config_of(params, "point")
    return simulate(workload.open(), cfg).summary


def run_sweep(
    sweep: Sweep,
    out_dir: str | Path,
    workers: int = 1,
    use_ray: bool = False,
    on_point: Callable[[Point, dict[str, Any], bool], None] | None = None,
    point_fn: Callable[[dict[str, Any], WorkloadSpec], dict[str, Any]] = simulate_point,
) -> pd.DataFrame:
    """Run every point not already finished in `out_dir`; returns (and writes) the table.

    `on_point(point, record, skipped)` reports each point as it finishes or is skipped.
    """
    out = Path(out_dir)
    points = sweep.points()
    keys: dict[WorkloadSpec, str] = {}  # each workload's content, read (and checked) before anything is written
    for pt in points:
        spec = sweep.workload(pt.params)
        if spec not in keys:
            keys[spec] = workload_key(spec)
    made = not out.exists()
    (out / "points").mkdir(parents=True, exist_ok=True)
    if Path(sweep.source).resolve() != (out / "sweep.toml").resolve():
        shutil.copyfile(sweep.source, out / "sweep.toml")
    try:
        return _run_points(sweep, out, points, keys, workers, use_ray, on_point, point_fn)
    except BaseException:
        if made and not any((out / "points").iterdir()):  # nothing finished: leave nothing behind
            shutil.rmtree(out, ignore_errors=True)
        raise


def workload_key(spec: WorkloadSpec) -> str:
    """What a finished point's result depends on besides its parameters: kvsim's version and the
    workload's content (a file's bytes, hashed as they stream; a generator's options), so a
    changed file or a new kvsim reruns the point. Opens the workload: a missing file fails here."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("kvsim")
    except PackageNotFoundError:
        ours = "unknown"
    h = hashlib.sha256(ours.encode())
    if spec.path:
        spec.open()  # a missing file or a bad format: its WorkloadError, before any output
        files = sorted(Path(spec.path).rglob("*")) if Path(spec.path).is_dir() else [Path(spec.path)]
        for f in (x for x in files if x.is_file()):
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                    h.update(chunk)
    else:
        h.update(json.dumps([spec.generator, [r.id for r in spec.requests]], default=str).encode())
    return h.hexdigest()[:16]


def _run_points(sweep: Sweep, out: Path, points: list[Point], keys: dict[WorkloadSpec, str], workers: int,
                use_ray: bool, on_point: Callable[[Point, dict[str, Any], bool], None] | None,
                point_fn: Callable[[dict[str, Any], WorkloadSpec], dict[str, Any]]) -> pd.DataFrame:
    records: dict[str, dict[str, Any]] = {}
    todo: list[Point] = []
    for pt in points:
        rec = _finished(out / "points" / f"{pt.id}.json", pt, keys[sweep.workload(pt.params)])
        if rec is None:
            todo.append(pt)
        else:
            records[pt.id] = rec
            if on_point is not None:
                on_point(pt, rec, True)
    by_id = {pt.id: pt for pt in todo}

    def save(item: tuple, summary: dict[str, Any]) -> None:
        params = item[0]
        pt = by_id[point_id(params, sweep.grid)]
        rec = {"kvsim_sweep": SWEEP_VERSION, "id": pt.id, "params": pt.params,
               "workload_key": keys[sweep.workload(pt.params)], "summary": summary}
        write_json_atomic(out / "points" / f"{pt.id}.json", rec)
        records[pt.id] = rec
        if on_point is not None:
            on_point(pt, rec, False)

    items = [(pt.params, sweep.workload(pt.params)) for pt in todo]
    if use_ray:
        run_ray(point_fn, items, save)
    else:
        run_parallel(point_fn, items, workers, save)
    table = sweep_table([records[pt.id] for pt in points], list(sweep.grid))
    table.to_parquet(out / "sweep.parquet", index=False)
    return table


def _finished(path: Path, pt: Point, key: str) -> dict[str, Any] | None:
    """The saved record of a finished point, if it exists with the same parameters, workload
    content and kvsim version (`key`, `workload_key`)."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    same = rec.get("kvsim_sweep") == SWEEP_VERSION and rec.get("params") == pt.params \
        and rec.get("workload_key") == key
    return rec if same and isinstance(rec.get("summary"), dict) else None


def sweep_table(records: list[dict[str, Any]], grid_keys: list[str]) -> pd.DataFrame:
    """One row per point: id, grid values, then the summary's fields."""
    rows = []
    for rec in records:
        grid = {k: rec["params"].get(k) for k in grid_keys}
        rows.append(
            {
                "point": rec["id"],
                **grid,
                **{k: v for k, v in rec["summary"].items() if k not in grid},
            }
        )
    return pd.DataFrame(rows)
