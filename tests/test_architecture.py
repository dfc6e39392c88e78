"""The house rules of ARCHITECTURE.md, checked on the code itself.

Imports are read with `ast` (those inside functions too, since a lazy import is still a
dependency): layers go one way, no two files import each other in a circle, no module is
over 700 lines (a guard against a file that grew past one concept, not a place to cut), and one request passes through at most four core files.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvcache", "workloads", "sim", "gpu", "kvsim")
MAX_LINES = 700

# What each layer may import of ours, by module prefix (its own package always allowed).
ALLOWED = {
    "sim": (),
    "kvcache": (),
    "workloads": (),
    "sim.engine": ("kvcache", "workloads"),
    "sim.studies": ("sim.engine", "kvcache", "workloads"),
    "sim.conform": ("sim.engine", "kvcache", "workloads"),
    "sim.cluster": ("sim.engine", "kvcache", "workloads"),
    # gpu reads the catalog (with the models kept as config files), cost model and config, and run
    # folders; never the engine loop
    "gpu": ("sim.engine.catalog", "sim.engine.hf_config", "sim.engine.cost_model", "sim.engine.config",
            "sim.studies.run_folder", "kvcache", "workloads"),
    "sim.cli": ("sim", "gpu", "kvcache", "workloads"),
    "sim.api": ("sim", "kvcache", "workloads"),  # the public Python API over the library
    "kvsim": ("sim.api",),  # `import kvsim`: the API's names, nothing else
    "kvsim.__main__": ("sim.cli",),  # `python -m kvsim`: the command line
}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    _module(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
}


def _ours(name: str) -> str:
    """An imported name as our module name: the source folders install as `kvsim.<folder>`."""
    return name[len("kvsim."):] if name.startswith("kvsim.") else name


def _annotation_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes under `if TYPE_CHECKING:` (names for annotations, not run)."""
    return {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
            and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
            for stmt in block.body for n in ast.walk(stmt)}


def _imports(module: str, run_time: bool = False) -> set[str]:
    """Our modules that `module` imports (`from a import b` counts as a.b when b is a module);
    `run_time`: not those imported only for annotations (under `if TYPE_CHECKING:`)."""
    path = MODULES[module]
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    skip = _annotation_only(tree) if run_time else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [_ours(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = _ours(node.module)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out |= {n for n in names if n.split(".")[0] in PACKAGES and n != module}
    return out


GRAPH = {m: _imports(m) for m in MODULES}
RUN_TIME = {m: _imports(m, run_time=True) for m in MODULES}  # the circles are of run-time imports


def _layer(module: str) -> str:
    return max((k for k in ALLOWED if module == k or module.startswith(k + ".")), key=len)


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_layers_go_one_way():
    bad = [
        f"{m} imports {d}"
        for m, deps in GRAPH.items()
        for d in deps
        if not _within(d, (_layer(m),) + ALLOWED[_layer(m)])
    ]
    assert bad == []


def test_no_library_module_imports_the_command_line_or_typer():
    bad = []
    for m, path in MODULES.items():
        if _layer(m) == "sim.cli":
            continue
        text = path.read_text()
        if "import typer" in text or "from typer" in text:
            bad.append(m)
    assert bad == []


def test_no_import_circle_between_files():
    """Tarjan's strongly connected components over the file graph: every one is a single file."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in RUN_TIME[v] & MODULES.keys():
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(MODULES)))
    for v in MODULES:
        if v not in index:
            visit(v)
    assert circles == []


# The block manager's insides: outside kvcache/ no code reaches them (ARCHITECTURE.md, "The map").
MANAGER_INSIDES = {"pool", "policy", "ops", "req_blocks", "num_cached_block", "tracker", "queue"}
MANAGER_NAMES = {"m", "manager", "mgr"}  # what code outside kvcache/ calls a KVCacheManager


def _reaches_in(node: ast.Attribute) -> bool:
    """`node` is `<manager>.<inside>`, `<manager>.<_private>`, or `.pool` / `.policy` of anything."""
    attr, base = node.attr, node.value
    if attr in ("pool", "policy"):
        return True
    name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
    private = attr.startswith("_") and not attr.startswith("__")
    return name in MANAGER_NAMES and (attr in MANAGER_INSIDES or private)


def test_only_the_managers_public_api_is_used_outside_kvcache():
    """The scheduler, the shortcuts and every other package use the block manager (and its pool)
    only through its public methods and properties."""
    found = []
    for module, path in MODULES.items():
        if module.startswith(("kvcache", "sim.conform.vllm_")):  # (the drivers' managers are vLLM's)
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and _reaches_in(node):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert found == []


def test_the_api_check_sees_a_reach_into_the_manager():
    bad = ["m.pool.num_free_blocks", "self.m.req_blocks", "manager.ops.lag", "sched.m._needs_cow", "x.policy"]
    ok = ["m.block_tables", "self.m.num_free_blocks", "self.ops", "rep.ops", "m.__class__"]
    found = [any(isinstance(n, ast.Attribute) and _reaches_in(n) for n in ast.walk(ast.parse(e))) for e in bad + ok]
    assert found == [True] * len(bad) + [False] * len(ok)


def test_no_module_over_700_lines():
    files = [p for d in (*PACKAGES, "benchmarks", "notebooks", "tests") for p in (ROOT / d).rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


# Every file whose code runs while one request goes from arrival to free, and its role.
# Four are core: they decide the request's fate. The rest are leaves (records, queues,
# hashes), the eviction policy, the speed shortcut, the step-time model or the logs.
# A new file on the path must be placed here, with its role: that is the point.
REQUEST_PATH = {
    "sim/engine/loop.py": "core: the step loop, completion",
    "sim/engine/frontend.py": "leaf: the arrivals process (and closed-loop sessions)",
    "sim/engine/scheduler.py": "core: queues, admission, preemption, retirement",
    "kvcache/manager.py": "core: prefix lookup, slot allocation, caching, free",
    "kvcache/block_pool.py": "core: blocks, the prefix-cache map, eviction calls",
    "sim/engine/prefill.py": "the scheduler's prefill rules (an object it holds): the long-prefill cap, the cadence",
    "sim/engine/output.py": "the scheduler's output mode (an object it holds): sync or async",
    "sim/engine/batch.py": "leaf: the live request and batch records",
    "sim/engine/wait_queue.py": "leaf: the waiting queue (FCFS or priority)",
    "kvcache/sequence.py": "leaf: the request's tokens and block hashes",
    "kvcache/hashing.py": "leaf: the block-hash chain",
    "kvcache/free_queue.py": "leaf: LRU's free queue (its front stack, fresh blocks below it, the linked part)",
    "kvcache/block.py": "leaf: the block record, made when the free queue first hands a block out (exact LRU)",
    "kvcache/id_span.py": "leaf: the block-id span behind id-space fragmentation",
    "kvcache/pool_view.py": "leaf: the pool's and op log's state as a manager shows it",
    "sim/engine/shortcuts.py": "shortcut: decodes that need no new block, counted in bulk",
    "sim/engine/quiet.py": "shortcut: steps that only decode, taken in a loop of their own",
    "sim/engine/async_quiet.py": "shortcut: async steps of lazy decodes alone, taken in a loop of their own",
    "sim/engine/cost_model.py": "cost: the step time",
    "sim/engine/metrics.py": "log: per-request and per-step rows",
    "sim/engine/step_log.py": "log: per-step rows, packed or streamed to a file",
    "workloads/request.py": "leaf: the request record",
}
POLICY_FILES = {  # and the eviction policy's own files
    "lru": {"kvcache/eviction/lru.py"},
    "s3fifo": {"kvcache/eviction/base.py", "kvcache/eviction/s3fifo.py"},
    "arc": {"kvcache/eviction/base.py", "kvcache/eviction/arc.py"},
}


def request_path(**config) -> dict[str, set[str]]:
    """Files of ours whose functions run while one default-workload request is simulated
    (the engine's set-up excluded), with the names of the functions that ran."""
    import simpy

    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.engine.loop import Engine
    from kvsim.sim.engine.run import make_manager
    from kvsim.workloads.default import default_workload

    cfg = SimConfig(num_gpu_blocks=64, **config)
    cost = CostModel.from_config(cfg)
    manager = make_manager(cfg, cost)
    env = simpy.Environment()
    engine = Engine(env, list(default_workload())[:1], cfg, cost, manager)
    seen: dict[str, set[str]] = {}

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(str(ROOT)):
            seen.setdefault(str(Path(name).relative_to(ROOT)), set()).add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        env.run()
    finally:
        sys.setprofile(None)
    assert len(engine.requests.frame()) == 1
    return seen


@pytest.mark.parametrize("eviction", sorted(POLICY_FILES))
def test_one_request_passes_through_four_core_files(eviction):
    files = set(request_path(eviction=eviction))
    assert POLICY_FILES[eviction] <= files
    assert files - POLICY_FILES[eviction] <= set(REQUEST_PATH)
    core = {f for f in files if REQUEST_PATH.get(f, "").startswith("core")}
    assert len(core) == 4
