"""`kvsim conform` on the cost model's clock: the path of a default `kvsim run` beside vLLM 0.33.

Each step of vLLM's lasts what kvsim's cost model gives for vLLM's own batch
(sim/conform/vllm_timed.py), sessions are closed loop on both sides, and kvsim's speed
shortcuts stay on, so quiet runs and lazy decodes (sim/engine/quiet.py, shortcuts.py) are
checked against vLLM, not only against kvsim's plain path. The tests show they fired.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli.app import app
from kvsim.sim.conform.check import run_scheduler, step_seconds
from kvsim.sim.conform.vllm_timed import batch_shape
from kvsim.sim.engine import quiet, shortcuts
from kvsim.sim.engine.config import SimConfig
from kvsim.workloads.default import default_workload
from kvsim.workloads.request import make_request
from kvsim.workloads.traces import load_workload

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "workloads"
needs_vllm = pytest.mark.needs_vllm


def _cfg(**kw) -> SimConfig:
    """The sync scheduler (where the quiet runs and lazy decodes fire) unless a case asks for async."""
    base = {"block_size": 16, "step_time": None, "closed_loop_sessions": True, "async_scheduling": False}
    return SimConfig(**{**base, **kw}).validate()


def _wl(name: str) -> list:
    return list(default_workload(0) if name == "default" else load_workload(GOLDEN / name))


class Fired:
    """Counts what kvsim's shortcuts did in a run: quiet steps taken, sequences gone lazy."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.runs: list[quiet.QuietRuns] = []
        self.lazy = 0
        build, add = quiet.QuietRuns.build.__func__, shortcuts.LazyDecodes.add

        def counting_build(cls, *args, **kwargs):
            q = build(cls, *args, **kwargs)
            if q is not None:
                self.runs.append(q)
            return q

        def counting_add(lazy, *args, **kwargs):
            self.lazy += 1
            return add(lazy, *args, **kwargs)

        monkeypatch.setattr(quiet.QuietRuns, "build", classmethod(counting_build))
        monkeypatch.setattr(shortcuts.LazyDecodes, "add", counting_add)

    @property
    def quiet_steps(self) -> int:
        return sum(q.taken for q in self.runs)


CASES = {
    # the embedded workload in a cache it fills: quiet runs between admissions, evictions
    "default, 300 blocks": ("default", {"num_gpu_blocks": 300}),
    # closed-loop sessions in 59 usable blocks: preemptions, chunked prompts, blocked heads
    "multi-turn, tight": ("multi-turn.jsonl", {"num_gpu_blocks": 60, "max_num_batched_tokens": 256}),
    "shared-prefix, eviction storm": ("shared-prefix.jsonl", {"num_gpu_blocks": 32, "max_num_batched_tokens": 256}),
    "multi-turn, async": ("multi-turn.jsonl", {"num_gpu_blocks": 60, "max_num_batched_tokens": 256,
                                               "async_scheduling": True}),
    # priority breaks ties by when a request reached the engine: a session turn's release (no lazy
    # decodes under priority: sim.engine.shortcuts)
    "multi-turn, priority": ("multi-turn.jsonl", {"num_gpu_blocks": 80, "max_num_batched_tokens": 256,
                                                  "scheduling": "priority"}),
}


@needs_vllm
@pytest.mark.parametrize("name", list(CASES))
def test_cost_clock_matches_vllm(name: str, monkeypatch: pytest.MonkeyPatch):
    workload, kw = CASES[name]
    fired = Fired(monkeypatch)
    d = run_scheduler(_wl(workload), _cfg(**kw))
    assert (d.differing, d.total) == (0, None), d.format()
    if not kw.get("async_scheduling") and kw.get("scheduling") != "priority":  # the shortcuts ran, and were compared
        assert fired.quiet_steps > 0 and fired.lazy > 0, (fired.quiet_steps, fired.lazy)


@needs_vllm
def test_the_shortcuts_fire_on_the_default_case(monkeypatch: pytest.MonkeyPatch):
    fired = Fired(monkeypatch)
    d = run_scheduler(_wl("default"), _cfg(num_gpu_blocks=300))
    assert d.ok
    assert (fired.quiet_steps, fired.lazy) == (9081, 2786)


@needs_vllm
def test_a_wrong_quiet_admission_is_reported(monkeypatch: pytest.MonkeyPatch):
    """Negative control: quiet runs that never let WAITING in while anything runs (a one-rule change
    in the shortcut, not in the plain path) differ from vLLM on the cost clock."""
    monkeypatch.setattr(quiet.QuietRuns, "_admission", lambda self, n: (True, None, False))
    d = run_scheduler(_wl("default"), _cfg(num_gpu_blocks=300))
    assert d.differing > 0, d.format()


@needs_vllm
def test_a_session_turn_counts_from_its_release_under_priority():
    """vllm/v1/request.py `Request.__lt__` orders equal priorities by `arrival_time`, which vLLM's
    front end stamps when it receives the request: a closed-loop turn counts from its release.
    Two slots: a and d run (b-0 took d's slot for one step); b-1 (open-loop arrival 0.001 s) is
    released 2 s after b-0 finishes, at 2.007 s, and c arrives at 1.0 s; both wait for d's slot,
    and c, received first, takes it (by the workload's arrivals b-1 would)."""
    from kvsim.sim.engine.run import simulate

    reqs = [make_request("a", 0.0, list(range(64)), 1000),
            make_request("b-0", 0.0, list(range(100, 132)), 1, session="b"),
            make_request("d", 0.0, list(range(400, 432)), 400),
            make_request("b-1", 0.001, list(range(200, 232)), 1, session="b", think_time=2.0),
            make_request("c", 1.0, list(range(300, 332)), 1)]
    cfg = _cfg(num_gpu_blocks=100, max_num_seqs=2, scheduling="priority")
    rq = simulate(reqs, cfg).requests.set_index("id")
    assert rq["first_scheduled_step"].to_dict() == {"a": 0, "b-0": 0, "d": 1, "c": 401, "b-1": 402}
    assert round(rq.loc["b-1", "arrival"], 6) == 2.007002
    d = run_scheduler(reqs, cfg)
    assert d.ok, d.format()


def test_batch_shape_counts_a_batch_as_kvsim_does():
    """vLLM's scheduled batch in kvsim's terms: a decode is one token past the prompt (a resumed
    request's one-token chunk inside its prompt is prefill); context is each length after the step."""

    class Req:
        def __init__(self, computed: int, prompt: int):
            self.num_computed_tokens, self.num_prompt_tokens = computed, prompt

    class Out:
        num_scheduled_tokens = {"decode": 1, "chunk": 32, "last-prompt-token": 1}

    live = {"decode": (Req(101, 100), []), "chunk": (Req(64, 200), []), "last-prompt-token": (Req(50, 50), [])}
    assert batch_shape(Out(), live) == (33, 1, 101 + 64 + 50, 3, [(32, 32), (49, 1)])


def test_step_seconds_is_the_cost_model_without_charged_ops():
    from kvsim.sim.engine.cost_model import CostModel

    cfg = _cfg()
    cost = CostModel.from_config(cfg)
    assert step_seconds(cfg)(512, 3, 2000, 4, [(1000, 512)]) == cost.step_time(512, 3, 2000, 4, {}, [(1000, 512)])
    assert step_seconds(cfg)(0, 0, 0, 0, []) == cost.overhead_s


@needs_vllm
def test_the_cli_default_is_the_cost_clock():
    r = CliRunner().invoke(app, ["conform", "--mode", "scheduler", "--num-gpu-blocks", "300"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0].endswith("budget 8,192 tokens / 1,024 seqs, the cost model's clock, "
                                             "async scheduling")
    assert r.stdout.splitlines()[1:] == ["scheduler 300 requests, 0 differ", "identical"]


@needs_vllm
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("workload", "kw"), [
    ("multi-turn.jsonl", {"num_gpu_blocks": 40, "max_num_batched_tokens": 256, "chunks": 40}),
    ("shared-prefix.jsonl", {"num_gpu_blocks": 32, "max_num_batched_tokens": 256, "chunks": 8}),
    ("default", {"num_gpu_blocks": 150, "max_num_batched_tokens": 1024, "chunks": 40}),
], ids=["multi-turn", "shared-prefix", "default"])
def test_offloading_on_the_cost_clock_matches_vllm(workload: str, kw: dict, async_scheduling: bool):
    """vLLM's OffloadingConnector with the fake worker on the cost clock (sim/conform/vllm_timed.py): its
    transfers take the GPU link's real time, an empty step waits for the next transfer or arrival as
    kvsim's engine does (`Scheduler.idle_until`), and closed-loop sessions are on."""
    from kvsim.sim.engine.cost_model import CostModel

    kw = dict(kw)
    chunks = kw.pop("chunks")
    per_block = CostModel.from_config(_cfg()).kv_bytes_per_block
    cfg = _cfg(kv_offloading_size=chunks * per_block / (1 << 30), async_scheduling=async_scheduling, **kw)
    reqs = _wl(workload)
    d = run_scheduler(reqs, cfg)
    assert (d.differing, d.total) == (0, None), d.format()
    from kvsim.sim.engine.run import simulate

    s = simulate(reqs, cfg).summary
    assert s["offload_hit_tokens"] > 0 and s["stored_blocks"] > 0
