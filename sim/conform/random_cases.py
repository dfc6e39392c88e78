"""Random conformance cases: a seeded workload and knobs for `kvsim conform --random`.

Each seed draws one of the synthetic workload kinds and a scheduler configuration (block size,
budget, sequence limit, watermark, long-prefill cap, caching and chunking on or off, FCFS or
priority with random priorities, async scheduling, a sliding window or a model mixing layer kinds in
vLLM's hybrid KV-cache groups, a max_model_len, parallel
sampling, vLLM 0.31+'s admission knobs, 0.33's prefill cadence, the clock: a fixed step grid or
the cost model's step times with closed-loop sessions), with a cache sized from the workload's longest
request so every request fits and memory pressure ranges from preemption storms to none. A
third of the seeds turn on KV offloading (tier size, chunk width, policy, store threshold, link
speed; half of them under async scheduling, as `vllm serve` runs it by default). A third of the
cost-clock cases P/D disaggregation's NIXL connector can take stand alone as its decode or prefill
side (read bandwidth, latency and lease); with `--pd` every seed's case is one side, a third of them
with a hybrid model (its attention and sliding-window groups, or Mamba state), half of them under async
scheduling (since 2026-11-27; before, every `--pd` case ran sync). The same seed always gives the same
case.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from kvsim.sim.engine.config import SimConfig
from kvsim.workloads.build import build_workload
from kvsim.workloads.request import Request

KINDS = ("shared-prefix", "multi-turn", "few-shot", "agent", "unique")


@dataclass(frozen=True)
class Case:
    """One random case: what `check.conform` runs, and a line that says what it is."""

    seed: int
    kind: str
    requests: list[Request]
    cfg: SimConfig
    max_running: int  # the manager mode's concurrency

    def describe(self) -> str:
        c = self.cfg
        tokens, seqs = c.batch_limits()
        knobs = ["cost clock" if c.step_time is None else f"grid {c.step_time:g} s", f"block {c.block_size}", f"{c.num_gpu_blocks} blocks", f"budget {tokens}/{seqs}"]
        knobs += [f"watermark {c.watermark}"] if c.watermark else []
        knobs += [f"long-prefill {c.long_prefill_token_threshold}"] if c.long_prefill_token_threshold else []
        knobs += [] if c.enable_prefix_caching else ["caching off"]
        knobs += [] if c.enable_chunked_prefill else ["chunking off"]
        knobs += ["priority"] if c.scheduling == "priority" else []
        knobs += ["async"] if c.runs_async else []
        knobs += [f"window {c.sliding_window}"] if c.sliding_window is not None else []
        hybrid = c.model in HYBRID_MODELS
        where = f" on {c.gpu}" if c.model in MAMBA_MODELS else ""  # (its block size follows the GPU)
        knobs += [f"{c.model}{where} (hybrid groups)"] if hybrid else []
        retention = c.prefix_cache_retention_interval
        knobs += [f"retention {retention}"] if (c.sliding_window is not None or hybrid) and retention != 0 else []
        knobs += [f"max-model-len {c.max_model_len}"] if c.max_model_len is not None else []
        knobs += [f"{c.max_num_active_seqs} active"] if c.max_num_active_seqs is not None else []
        knobs += ["adaptive"] if c.long_prefill_token_threshold_adaptive else []
        knobs += [] if c.scheduler_reserve_full_isl else ["no full-isl reserve"]
        knobs += [f"prefill every {c.prefill_schedule_interval}"] if c.prefill_schedule_interval > 1 else []
        knobs += [f"{c.max_num_scheduled_tokens} scheduled"] if c.max_num_scheduled_tokens is not None else []
        if c.kv_offloading_size is not None:
            bpc = c.offload_blocks_per_chunk
            knobs += [f"offloading {c.kv_offloading_size:g} GiB ({bpc} block{'s' if bpc > 1 else ''} a chunk, "
                      f"{c.offload_eviction_policy}, threshold {c.offload_store_threshold}"
                      + (", decode chunks too" if not c.offload_prompt_only else "") + ")"]
        if c.kv_transfer_role is not None:
            knobs += [f"P/D {c.kv_transfer_role} side ({c.kv_transfer_gbps:g} GB/s, {c.kv_transfer_latency:g} s latency, "
                      f"lease {c.kv_lease_duration:g} s)"]
        samples = sum(r.n > 1 for r in self.requests)
        knobs += [f"{samples} with n > 1"] if samples else []
        return f"seed {self.seed}: {self.kind}, {len(self.requests)} requests, " + ", ".join(knobs)


def _shape(r: random.Random, kind: str) -> dict[str, object]:
    """Length options for `kind` (None: the generator's own)."""
    if kind == "shared-prefix":
        return {"prefix_len": f"uniform:{r.choice([16, 100, 300])},{r.choice([400, 900])}",
                "user_len": f"uniform:1,{r.choice([50, 300, 1200])}",
                "output_len": f"uniform:1,{r.choice([20, 200])}", "num_prefixes": r.choice([1, 3, 8])}
    if kind == "unique":
        return {"user_len": f"uniform:1,{r.choice([100, 700, 2500])}",
                "output_len": f"uniform:1,{r.choice([10, 300])}"}
    return {}


def random_case(seed: int, pd: bool = False) -> Case:
    """The case of `seed` (see the module docstring); `pd`: the same draws, less the knobs kvsim's NIXL
    connector does not take (async scheduling, offloading, a window of one group, n > 1, the grid),
    standing alone as one side of P/D disaggregation, a third of them with a hybrid model."""
    r = random.Random(seed)
    kind = r.choice(KINDS)
    requests = list(build_workload(kind, r.choice([20, 40, 80]), r.choice([2.0, 10.0, 50.0]), "poisson", 1.0,
                                   seed, _shape(r, kind)))
    bs = r.choice([8, 16, 32])
    longest = max(q.prompt_len + max(q.output_len, 1) for q in requests)
    kw: dict[str, object] = {
        "block_size": bs, "step_time": 0.05, "closed_loop_sessions": False,
        "num_gpu_blocks": int((-(-longest // bs) + 2) * r.choice([1.0, 1.2, 1.6, 3, 10])),
        "max_num_batched_tokens": r.choice([64, 256, 512, 2048]), "max_num_seqs": r.choice([2, 4, 16, 64]),
        "watermark": r.choice([0.0, 0.0, 0.01, 0.05]), "long_prefill_token_threshold": r.choice([0, 0, 32, 200]),
        "enable_prefix_caching": r.random() < 0.85, "enable_chunked_prefill": r.random() < 0.85,
        "scheduling": r.choice(["fcfs", "fcfs", "fcfs", "priority"]), "async_scheduling": r.random() < 0.25 and not pd,
    }
    if not kw["enable_chunked_prefill"]:  # vLLM needs the budget to hold the longest request
        kw["max_num_batched_tokens"] = max(kw["max_num_batched_tokens"], longest)
        kw["long_prefill_token_threshold"] = 0
    if r.random() < 1 / 3 and not pd:
        kw.update(_offloading(r, bs, kw["num_gpu_blocks"], longest))
    max_running = r.choice([1, 1, 4, 16])
    # drawn last, so the knobs above are what they were before windows were drawn
    if "kv_offloading_size" not in kw and not kw["async_scheduling"] and r.random() < 0.3 and not pd:
        kw["sliding_window"] = r.choice(WINDOWS)
    if kw["scheduling"] == "priority":  # the generators give every request priority 0
        requests = [replace(q, priority=r.choice([0, 0, 1, 2])) for q in requests]
    if r.random() < 0.2:  # a max_model_len that cuts answers; longer prompts are left out (vLLM refuses them)
        prompts = sorted(q.prompt_len for q in requests)
        kw["max_model_len"] = r.choice([prompts[len(prompts) // 2], prompts[-1]]) + r.choice([1, 2, 9])
        requests = [q for q in requests if q.prompt_len < kw["max_model_len"]]
        # vLLM's SchedulerConfig refuses a long-prefill cap above max_model_len
        kw["long_prefill_token_threshold"] = min(kw["long_prefill_token_threshold"], kw["max_model_len"])
        if not kw["enable_chunked_prefill"]:
            kw["max_num_batched_tokens"] = max(kw["max_num_batched_tokens"], kw["max_model_len"])
    if r.random() < 0.2 and not pd:  # parallel sampling
        requests = [replace(q, n=r.choice([2, 3])) if r.random() < 0.5 else q for q in requests]
    kw.update(_admission(r, kw))
    kw.update(_cadence(r))
    kw.update(_step_budget(r, kw))
    kw.update(_clock(r, kw, pd))
    if kw.get("sliding_window") is not None:  # drawn last: vLLM's retention interval, its default 0 most often
        kw["prefix_cache_retention_interval"] = _retention(r, bs)
    if not pd:
        kw.update(_hybrid(r, kw, bs))
        kw.update(_async_window(r, kw, bs))
    kw.update(_disaggregation(r, kw, requests, pd))
    if pd:  # drawn after its side, so a P/D case's knobs are what they were before hybrid P/D
        kw.update(_hybrid(r, kw, bs, pd=True))
        # drawn last, likewise: half the sides run async, as `vllm serve` runs a NIXL side (since 2026-11-27)
        kw["async_scheduling"] = r.random() < 0.5
    return Case(seed, kind, requests, SimConfig(**kw).validate(), max_running)


HYBRID_MODELS = {  # a catalog model mixing layer kinds: its tensor-parallel degree, and its other knobs
    "gpt-oss-20b": (1, {}), "gemma-3-27b": (1, {}), "llama-4-scout": (8, {"hybrid_chunked_local": True}),
    "qwen3-next-80b-a3b": (8, {})}
MAMBA_MODELS = ("qwen3-next-80b-a3b",)  # (vLLM runs them with prefix caching and chunked prefill only)


def _hybrid(r: random.Random, kw: dict[str, object], bs: int, pd: bool = False) -> dict[str, object]:
    """A third of the cases vLLM's hybrid KV-cache groups can run (no offloading or window of their
    own) take a catalog model mixing layer kinds, with its windows, its groups' blocks in one pool (as
    many times the blocks as it has groups) and a retention interval (drawn last, so the knobs above
    are what they were); `pd`: a P/D side's, either side with Mamba state. Async cases draw here too
    (they took no model before async ran with groups; no draw after this one changes a sync case)."""
    if "kv_offloading_size" in kw or "sliding_window" in kw or r.random() >= 1 / 3:
        return {}
    from kvsim.sim.engine.cost_model import CostModel

    models = [m for m in sorted(HYBRID_MODELS) if m not in MAMBA_MODELS
              or (kw["enable_prefix_caching"] and kw["enable_chunked_prefill"])]
    model = r.choice(models)
    tp, extra = HYBRID_MODELS[model]
    out = {"model": model, "tensor_parallel": tp, **extra}
    if model in MAMBA_MODELS:  # FlashInfer's checkpoints (H100) or none (A100); its raised block size
        out["gpu"] = r.choice(["h100-sxm", "a100-80g"])
    cost = CostModel.from_config(SimConfig(**{**kw, **out}))
    interval = cost.block_size * r.choice([1, 2, 8, 40])  # vLLM refuses one without a window or Mamba (Llama 4's)
    out["prefix_cache_retention_interval"] = r.choice([0, 0, None, interval if model != "llama-4-scout" else 0])
    blocks = kw["num_gpu_blocks"]
    if cost.block_size != bs:  # as many blocks of the raised size as of the drawn one
        blocks = max(-(-blocks * bs // cost.block_size), 3)
    out["num_gpu_blocks"] = blocks * len(cost.layout.groups)
    return out


WINDOWS = [8, 17, 64, 500]  # one group's sliding windows a case draws


def _retention(r: random.Random, bs: int) -> int | None:
    """vLLM's retention interval for a window case: its default 0 most often, dense (None), or a
    multiple of the block size."""
    return r.choice([0, 0, None, bs * r.choice([1, 2, 8, 40])])


def _async_window(r: random.Random, kw: dict[str, object], bs: int) -> dict[str, object]:
    """Three in ten of the async cases with neither a hybrid model nor offloading take one group's
    sliding window and vLLM's retention interval (drawn after the hybrid draw: async cases took no
    window before async ran with one, so every other case is what it was)."""
    if not kw["async_scheduling"] or "model" in kw or "kv_offloading_size" in kw or r.random() >= 0.3:
        return {}
    return {"sliding_window": r.choice(WINDOWS), "prefix_cache_retention_interval": _retention(r, bs)}


def _disaggregation(r: random.Random, kw: dict[str, object], requests: list[Request], pd: bool) -> dict[str, object]:
    """A third of the cases kvsim's NIXL connector and its conformance take (the cost clock, sync
    scheduling, full attention, one sample a request, no offloading) stand alone as one side of P/D
    disaggregation, with reads of a 2 MiB block taking 0.08 to 8 ms and, at times, a lease shorter
    than a read (drawn last, so the knobs above are what they were); a `pd` case always."""
    if (kw.get("step_time", 0.05) is not None or kw["async_scheduling"] or "kv_offloading_size" in kw
            or kw.get("sliding_window") is not None or "model" in kw or any(q.n > 1 for q in requests)
            or (r.random() >= 1 / 3 and not pd)):
        return {}
    return {"kv_transfer_role": r.choice(["decode", "prefill"]), "kv_transfer_gbps": r.choice([25.0, 2.5, 0.25]),
            "kv_transfer_latency": r.choice([5e-5, 5e-5, 1e-3]), "kv_lease_duration": r.choice([30.0, 30.0, 0.01, 0.1])}


def _admission(r: random.Random, kw: dict[str, object]) -> dict[str, object]:
    """vLLM 0.31+'s admission knobs (drawn last, so the knobs before them are what they were)."""
    out: dict[str, object] = {}
    if r.random() < 0.2:
        out["max_num_active_seqs"] = r.randint(1, kw["max_num_seqs"])
    if kw["long_prefill_token_threshold"] and r.random() < 0.5:
        out["long_prefill_token_threshold_adaptive"] = True
    if r.random() < 0.2:
        out["scheduler_reserve_full_isl"] = False
    return out


def _cadence(r: random.Random) -> dict[str, object]:
    """vLLM 0.33's prefill cadence (drawn after the admission knobs, for the same reason)."""
    return {"prefill_schedule_interval": r.choice([2, 3, 8])} if r.random() < 0.2 else {}


def _step_budget(r: random.Random, kw: dict[str, object]) -> dict[str, object]:
    """max_num_scheduled_tokens up to max_num_batched_tokens, with chunked prefill; at times below
    max_num_seqs, where decodes are cut (drawn last, for the same reason)."""
    seqs, hi = kw["max_num_seqs"], kw["max_num_batched_tokens"]
    if not kw["enable_chunked_prefill"] or r.random() >= 0.2:
        return {}
    return {"max_num_scheduled_tokens": r.choice([r.randint(1, min(seqs, hi)), min(seqs, hi), r.randint(1, hi),
                                                  max(1, hi // 4)])}


def _clock(r: random.Random, kw: dict[str, object], pd: bool = False) -> dict[str, object]:
    """Two cases in three run on the cost model's clock, as a default `kvsim run`: each step as long
    as its batch costs, the speed shortcuts on, closed-loop sessions (drawn last, for the same
    reason; an offloading case's link is then the GPU's, its transfers taking their real time);
    the others on the fixed grid (a `pd` case: always the cost clock)."""
    if r.random() >= 2 / 3 and not pd:
        return {}
    return {"step_time": None, "closed_loop_sessions": True}


def _offloading(r: random.Random, bs: int, blocks: int, longest: int) -> dict[str, object]:
    """Offloading knobs; the tier's link takes a block in 2, 1, 1/2 or 1/4 of a step."""
    from kvsim.sim.engine.cost_model import CostModel

    cost = CostModel.from_config(SimConfig(block_size=bs))
    bpc = r.choice([1, 1, 2, 4])
    return {"kv_offloading_size": r.choice([3, 8, 32, 200]) * cost.kv_bytes_per_block * bpc / (1 << 30),
            "offload_blocks_per_chunk": bpc, "offload_eviction_policy": r.choice(["lru", "arc"]),
            "offload_store_threshold": r.choice([0, 0, 2]), "offload_prompt_only": r.random() < 0.7,
            "step_time": cost.op_cost_s["store"] / r.choice([0.5, 1, 2, 4]), "scheduling": "fcfs",
            "num_gpu_blocks": max(blocks // 2, -(-longest // bs) + 2),
            "async_scheduling": r.random() < 0.5}  # (drawn last: vLLM 0.33 runs offloading async by default)
