"""`kvsim run`: simulate a workload and write a run folder; mounts `report` and `compare` too."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvsim.sim.cli.common import (
    cannot_write,
    check_output,
    fail,
    open_workload,
    progress_bar,
    staged_file,
)
from kvsim.sim.cli.options import (
    AsyncScheduling,
    BlockSize,
    DisableHybrid,
    Eviction,
    Gpu,
    HybridChunkedLocal,
    KvLeaseDuration,
    KvOffloadingSize,
    KvTransferGbps,
    KvTransferLatency,
    KvTransferRole,
    LongPrefillAdaptive,
    MaxNumActiveSeqs,
    MaxNumScheduledTokens,
    Model,
    NoReserveFullIsl,
    OffloadAll,
    OffloadBlocksPerChunk,
    OffloadEvictionPolicy,
    OffloadFs,
    OffloadFsGbps,
    OffloadFsSize,
    OffloadFsThreads,
    OffloadStoreThreshold,
    PrefillScheduleInterval,
    RetentionInterval,
    Tp,
    admission_changes,
    fs_changes,
    hardware_changes,
    hybrid_changes,
    none_or_number,
    offload_changes,
    retention_changes,
    transfer_changes,
)
from kvsim.sim.cli.report import compare, format_summary, pd_lines, report
from kvsim.workloads.names import FORMATS

if TYPE_CHECKING:
    from kvsim.sim.engine.config import SimConfig

RUNS_DIR = Path("runs")
DEFAULT_WORKLOAD_TEXT = "the embedded default, 150 requests on 4 shared 512-token system prompts and 150 multi-turn chat turns"
POLICY_SPREAD = "lru,s3fifo,arc,lfu,fifo"
# run options whose flag is not `--` + the config field's name with dashes
FLAGS = {"tensor_parallel": "--tp", "enable_prefix_caching": "--no-prefix-caching",
         "enable_chunked_prefill": "--no-chunked-prefill"}


def run_name(workload: str, cfg: SimConfig) -> str:
    """A deterministic folder name: workload, model, GPU, TP, block size and a config digest."""
    from kvsim.sim.engine.config import SCHEDULER_KNOBS

    d = cfg.to_dict()
    default = type(cfg)()
    # fields added after run names were first digested (offloading's below), left out at their
    # defaults: the names runs had before these options came
    for k in ("parallel_sampling", *SCHEDULER_KNOBS):
        if d[k] == getattr(default, k):
            del d[k]
    if d["kv_offloading_size"] is None:  # offloading off: the names of runs from before it existed
        d = {k: v for k, v in d.items() if not k.startswith(("kv_offloading_", "offload_"))}
    elif not d["offload_fs"]:  # no file tier: the names of offloading runs from before it existed
        d = {k: v for k, v in d.items() if not k.startswith("offload_fs")}
    if d["kv_cache_dtype"] == "auto":  # the names runs had before the option came
        del d["kv_cache_dtype"]
    if d["prefix_cache_retention_interval"] == 0:  # likewise
        del d["prefix_cache_retention_interval"]
    for k in ("disable_hybrid_kv_cache_manager", "hybrid_chunked_local",  # likewise
              "replicas", "router", "router_metrics_interval", "kv_events", *ROUTER_OPTIONS,
              "kv_transfer_role", "kv_transfer_gbps", "kv_transfer_latency", "kv_lease_duration",
              "prefill_replicas", "decode_replicas", "pd_decider", "pd_threshold", "prefill_pool", "decode_pool",
              "pd_busy_threshold", "replica_pools"):
        if d[k] == getattr(default, k):
            del d[k]
    digest = hashlib.sha256(json.dumps([workload, d], sort_keys=True).encode()).hexdigest()
    stem = Path(workload).stem if workload != "default" else "default"
    model = cfg.model if not cfg.model.endswith(".json") else (Path(cfg.model).parent.name or Path(cfg.model).stem)
    model = re.sub(r"[^A-Za-z0-9._-]+", "-", model)  # a config's path: its folder's name
    gpu = Path(cfg.gpu).stem if cfg.gpu.endswith(".toml") else cfg.gpu  # a GPU file: its name
    return f"{stem}-{model}-{gpu}-tp{cfg.tensor_parallel}-bs{cfg.block_size}-{digest[:8]}"


def _smallest_drop(result: Any) -> str:
    rq = result.requests
    dropped = rq[rq["reason"].isin(["prompt_exceeds_cache", "context_exceeds_cache"])]
    return f"{int(dropped['prompt_tokens'].min()):,}" if len(dropped) else "?"


def _command(workload: Path | None, read: list[str], changes: dict[str, Any]) -> list[str]:
    """`kvsim run` with the options that produced `changes` (the slow debug switches left out)."""
    words = ["kvsim", "run"] + ([str(workload)] if workload is not None else []) + read
    for key, value in changes.items():
        if key in ("record_ops", "debug_invariants", "kv_events"):
            continue
        flag = FLAGS.get(key, "--" + key.replace("_", "-"))
        words += [flag] if isinstance(value, bool) else [flag, str(value)]
    return words


def _capacities(s: dict[str, Any]) -> str:
    """Cache sizes for a curve around this run: a quarter, half, all and twice the blocks it used."""
    used = s["num_gpu_blocks"] if s["peak_block_usage"] >= 0.9 else s.get("peak_used_blocks", 0)
    hi = max(int(used), 16)
    return ",".join(str(c) for c in (hi // 4, hi // 2, hi, 2 * hi))


def next_steps(workload: Path | None, fmt: str, switches: list[str], changes: dict[str, Any],
               cfg: SimConfig, out_dir: Path, s: dict[str, Any]) -> list[str]:
    """Copy-pasteable commands: this run under another policy side by side (when prefix caching
    is on), and a capacity curve. `switches`: --skip-bad, --no-plots if given."""
    if cfg.enable_prefix_caching and s.get("requests") and not s.get("hit_rate"):
        return ["# nothing hit the prefix cache (no two prompts share a prefix), so every eviction",
                "# policy gives the same result here; a workload with shared prefixes shows them apart:",
                "kvsim workload generate shared-prefix -n 500 -o shared.jsonl && kvsim run shared.jsonl"]
    read = ["--format", fmt] if fmt != "auto" else []
    lines = []
    stem = RUNS_DIR / (Path(workload).stem if workload is not None else "default")
    if cfg.enable_prefix_caching and s.get("evictions"):
        other = "s3fifo" if cfg.eviction != "s3fifo" else "lru"
        other_dir = Path(f"{stem}-{other}")
        rerun = _command(workload, read + switches, {**changes, "eviction": other})
        rerun += ["-o", str(other_dir)]
        compare = ["kvsim", "compare", str(out_dir), str(other_dir)]
        lines += [f"# the same run under {other}, side by side with this one",
                  f"{shlex.join(rerun)} && {shlex.join(compare)}"]
    elif cfg.enable_prefix_caching:  # nothing evicted: every policy ties at this size
        blocks = max(int(s.get("peak_used_blocks", 0)) // 2, 16)
        runs = []
        for policy in ("lru", "s3fifo"):
            cmd = _command(workload, read + switches, {**changes, "num_gpu_blocks": blocks, "eviction": policy})
            runs.append(shlex.join(cmd + ["-o", f"{stem}-{blocks}-{policy}"]))
        compare = ["kvsim", "compare", f"{stem}-{blocks}-lru", f"{stem}-{blocks}-s3fifo"]
        lines += [f"# policies apart: two runs in a {blocks:,}-block cache (half this run's peak use)",
                  " && ".join(runs + [shlex.join(compare)])]
    source = str(workload) if workload is not None else "default.jsonl"
    curve = ["kvsim", "curve", source, *read, "-c", _capacities(s), "-p", POLICY_SPREAD]
    curve += ["-b", str(cfg.block_size)] if cfg.block_size != 16 else []
    make = "kvsim workload generate default -o default.jsonl && " if workload is None else ""
    return lines + ["# prefix hit rate against cache size, one line per policy (cache replay)",
                    make + shlex.join(curve)]


# the routers' options besides the router and its metrics' staleness: the event-fed ones' delay and
# Dynamo's temperature, the scoring ones' weights (llm-d, llm-d-precise), sglang-cache-aware's
# thresholds and tree (config.py's ROUTER_FIELDS, restated: this module loads for `--help`, which
# imports no numpy; tests/sim/cli/test_cli_run.py holds the two equal)
ROUTER_OPTIONS = ("kv_event_delay", "router_temperature", "router_scorers", "router_cache_threshold",
                  "router_balance_abs", "router_balance_rel", "router_tree_size", "router_eviction_interval")
# `kvsim run` options named as their SimConfig field, in the order the summary's commands show them
PLAIN_KNOBS = ("block_size", "kv_cache_dtype", "num_gpu_blocks", "gpu_memory_utilization", "num_cpu_blocks", "eviction", "watermark",
               "preemption", "scheduling", "parallel_sampling", "defrag_threshold", "max_num_seqs",
               "max_num_batched_tokens", "load", "max_model_len", "long_prefill_token_threshold", "vllm_version",
               "step_time", "calibration", "slo_ttft", "slo_tpot", "seed", "replicas", "router",
               "router_metrics_interval", *ROUTER_OPTIONS, "replica_pools", "prefill_replicas", "decode_replicas",
               "pd_decider", "pd_threshold", "prefill_pool", "decode_pool", "async_scheduling")
# switches: option -> (SimConfig field, value when given)
SWITCHES = {"no_prefix_caching": ("enable_prefix_caching", False), "no_chunked_prefill": ("enable_chunked_prefill", False),
            "record_ops": ("record_ops", True),
            "debug_invariants": ("debug_invariants", True)}


def _ranges(layers: tuple[int, ...]) -> str:
    """Layer indices as a reader takes them in: '0-22 every 2nd', '5-59 every 6th', or a list."""
    if len(layers) > 2:
        step = layers[1] - layers[0]
        if all(b - a == step for a, b in zip(layers, layers[1:], strict=False)):
            every = "" if step == 1 else f" every {step}{'nd' if step == 2 else 'rd' if step == 3 else 'th'}"
            return f"{layers[0]}-{layers[-1]}{every}"
    return ", ".join(map(str, layers))


def model_notes(cfg: SimConfig, cost: Any) -> list[str]:
    """What was read from a model's config.json (layer types and counts, parameters), the bytes of a
    block, and how a model that mixes layer types is placed in kvsim's one group of blocks: the
    figures a reader checks against vLLM's log."""
    from kvsim.sim.engine.hf_config import read_from_config
    from kvsim.sim.engine.layers import describe_layers

    m, notes = cost.model, []
    read = read_from_config(cfg.model)
    if read:
        heads = (f"MLA, {m.num_heads} query heads over a cached latent of {m.kv_lora_rank} + {m.qk_rope_head_dim}"
                 if m.mla else f"{m.num_heads} query and {m.num_kv_heads} KV heads of {m.head_dim}")
        notes.append(f"model: read from {cfg.model}'s config: {describe_layers(cost.layers)}; {heads}; "
                     f"{m.num_params / 1e9:.2f}B parameters"
                     + (f" ({m.active_params() / 1e9:.2f}B active: {m.experts_per_token} of {m.num_experts} experts "
                        f"a token on {m.moe_layers} layers)" if m.num_experts else "")
                     + (f", {m.encoder_params / 1e9:.2f}B of them a vision tower" if m.encoder_params else ""))
    layout = cost.layout
    if read or cfg.kv_cache_dtype != "auto" or layout is not None:
        dtype = "the model's 16-bit" if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
        holds = (f"a page of each of a group's {layout.group_size} layers" if layout is not None
                 else "every attention layer")
        notes.append(f"KV cache: {dtype} elements, {cost.kv_bytes_per_block:,} bytes a block of {cost.block_size} "
                     f"tokens ({holds}) "
                     + (f"on each of {cfg.tensor_parallel} GPUs" if cfg.tensor_parallel > 1 else "on the GPU"))
    if layout is not None:
        groups = "; ".join(f"{i}: {g.layer.describe()}, layers {_ranges(g.layers)}" for i, g in enumerate(layout.groups))
        notes.append(f"KV-cache groups (vLLM 0.33's hybrid manager, one pool of {cost.num_gpu_blocks(cfg):,} blocks of "
                     f"{cost.block_size} tokens, {layout.bytes_per_block:,} bytes each): {groups}")
        if layout.block_size is not None and layout.block_size != cfg.block_size:
            notes.append(f"block size: {layout.block_size} tokens, not {cfg.block_size}: vLLM raises the attention block "
                         f"size until a page holds a Mamba state ({layout.mamba_page_bytes:,} bytes, padded to the "
                         "page), and Mamba prefill chunks end on its boundaries (_align_hybrid_block_size)")
    if cost.placement is not None and cost.placement.approximation:
        from kvsim.sim.engine.layers import hybrid_layout

        hybrid = hybrid_layout(cost.layers, m.name)
        fit = int(cost.kv_memory_bytes(cfg) // hybrid.bytes_per_block)
        notes.append(f"approximation: {cost.placement.approximation}. With vLLM 0.33's hybrid manager on, it "
                     f"groups them: {hybrid.describe()}, {fit:,} blocks in this GPU's memory")
    return notes


def knob_changes(o: dict[str, Any]) -> dict[str, Any]:
    """The `SimConfig` fields that `kvsim run`'s knob options set (`o`: option name -> value, the
    options not given None or False); `kvsim capacity` takes the same options."""
    g = o.get
    changes: dict[str, Any] = hardware_changes(g("model"), g("gpu"), g("tp"))
    changes.update((k, str(g(k)) if k == "calibration" else g(k)) for k in PLAIN_KNOBS if g(k) is not None)
    changes.update(offload_changes(g("kv_offloading_size"), g("offload_eviction_policy"), g("offload_store_threshold"),
                                   g("offload_blocks_per_chunk"), bool(g("offload_all"))))
    changes.update(fs_changes(bool(g("offload_fs")), g("offload_fs_size"), g("offload_fs_gbps"), g("offload_fs_threads")))
    changes.update(transfer_changes(g("kv_transfer_role"), g("kv_transfer_gbps"), g("kv_transfer_latency"),
                                    g("kv_lease_duration")))
    changes.update(admission_changes(g("max_num_active_seqs"), bool(g("long_prefill_token_threshold_adaptive")),
                                     bool(g("no_scheduler_reserve_full_isl")), g("prefill_schedule_interval"),
                                     g("max_num_scheduled_tokens")))
    changes.update(retention_changes(g("prefix_cache_retention_interval")))
    changes.update(none_or_number(g("pd_busy_threshold"), "pd_busy_threshold", float, "a number"))
    changes.update(hybrid_changes(g("disable_hybrid_kv_cache_manager"), bool(g("hybrid_chunked_local"))))
    changes.update(SWITCHES[k] for k in SWITCHES if g(k))
    return changes


def run(
    workload: Annotated[Path | None, typer.Argument(help="workload file or RAGPulse folder; default: the embedded workload")] = None,
    format: Annotated[str, typer.Option("--format", "-f", help="|".join(FORMATS))] = "auto",
    skip_bad: Annotated[bool, typer.Option("--skip-bad", help="skip bad trace lines (and count them)")] = False,
    model: Model = None,
    gpu: Gpu = None,
    tp: Tp = None,
    block_size: BlockSize = None,
    kv_cache_dtype: Annotated[str | None, typer.Option("--kv-cache-dtype", help="auto|bfloat16|float16|fp8|fp8_e4m3|fp8_e5m2, as vLLM's: fp8 halves a block's bytes [default: auto]")] = None,
    prefix_cache_retention_interval: RetentionInterval = None,
    disable_hybrid_kv_cache_manager: DisableHybrid = None,
    hybrid_chunked_local: HybridChunkedLocal = False,
    num_gpu_blocks: Annotated[int | None, typer.Option(help="KV blocks (default: derived from GPU memory)")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(help="fraction of GPU memory vLLM may use")] = None,
    num_cpu_blocks: Annotated[int | None, typer.Option(help="CPU swap blocks")] = None,
    eviction: Eviction = None,
    watermark: Annotated[float | None, typer.Option(help="fraction of blocks kept free at admission")] = None,
    no_prefix_caching: Annotated[bool, typer.Option("--no-prefix-caching", help="disable prefix caching")] = False,
    preemption: Annotated[str | None, typer.Option(help="recompute|swap")] = None,
    scheduling: Annotated[str | None, typer.Option(help="fcfs|priority")] = None,
    parallel_sampling: Annotated[str | None, typer.Option("--parallel-sampling", help="n > 1: fanout (vLLM 0.33: n requests) | fork (v0: fork after the prefill)")] = None,
    defrag_threshold: Annotated[int | None, typer.Option(help="run the online defragmenter past this id gap")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="most sequences per step")] = None,
    load: Annotated[float | None, typer.Option(help="arrival-rate multiplier (2: arrivals twice as dense)")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="token budget per step")] = None,
    no_chunked_prefill: Annotated[bool, typer.Option("--no-chunked-prefill", help="a prompt must fit one step")] = False,
    max_model_len: Annotated[int | None, typer.Option(help="tokens per sequence, as vLLM's --max-model-len (default: no limit)")] = None,
    long_prefill_token_threshold: Annotated[int | None, typer.Option(help="most prefill tokens of one request per step (0: no cap)")] = None,
    long_prefill_token_threshold_adaptive: LongPrefillAdaptive = False,
    max_num_active_seqs: MaxNumActiveSeqs = None,
    no_scheduler_reserve_full_isl: NoReserveFullIsl = False,
    prefill_schedule_interval: PrefillScheduleInterval = None,
    max_num_scheduled_tokens: MaxNumScheduledTokens = None,
    vllm_version: Annotated[str | None, typer.Option("--vllm-version", help="vLLM release whose rules to follow, 0.23-0.33 (default 0.33)")] = None,
    step_time: Annotated[float | None, typer.Option("--step-time", help="every step takes exactly this many seconds, on a grid (no cost model)")] = None,
    async_scheduling: AsyncScheduling = None,
    calibration: Annotated[Path | None, typer.Option(help="calibration profile (JSON) from `kvsim calibrate`")] = None,
    slo_ttft: Annotated[float | None, typer.Option(help="TTFT SLO for goodput, seconds")] = None,
    slo_tpot: Annotated[float | None, typer.Option(help="TPOT SLO for goodput, seconds")] = None,
    kv_offloading_size: KvOffloadingSize = None,
    offload_eviction_policy: OffloadEvictionPolicy = None,
    offload_store_threshold: OffloadStoreThreshold = None,
    offload_blocks_per_chunk: OffloadBlocksPerChunk = None,
    offload_all: OffloadAll = False,
    offload_fs: OffloadFs = False,
    offload_fs_size: OffloadFsSize = None,
    offload_fs_gbps: OffloadFsGbps = None,
    offload_fs_threads: OffloadFsThreads = None,
    kv_transfer_role: KvTransferRole = None,
    kv_transfer_gbps: KvTransferGbps = None,
    kv_transfer_latency: KvTransferLatency = None,
    kv_lease_duration: KvLeaseDuration = None,
    record_ops: Annotated[bool, typer.Option("--record-ops", help="write the block-op stream (ops.parquet)")] = False,
    debug_invariants: Annotated[bool, typer.Option("--debug-invariants", help="check the manager every step (slow)")] = False,
    seed: Annotated[int | None, typer.Option(help="seed (of the embedded default workload, and a cluster's router)")] = None,
    replicas: Annotated[int | None, typer.Option(help="a cluster: this many exact replicas of the engine behind --router [default: 1]")] = None,
    replica_pools: Annotated[str | None, typer.Option("--replica-pools", help="a cluster of replicas that differ: 'count:field=value,...;count:...', the counts summing to --replicas, each group's fields (gpu, tensor_parallel, num_gpu_blocks, gpu_memory_utilization, max_num_batched_tokens, max_num_seqs, max_num_scheduled_tokens, long_prefill_token_threshold, calibration) set apart from the rest, e.g. '2:gpu=a100-80g,tensor_parallel=2;2:'")] = None,
    router: Annotated[str | None, typer.Option(help="round-robin|random|least-outstanding|vllm-dp|vllm-dp-legacy|session-affinity|llm-d|llm-d-precise|dynamo|sglang-cache-aware [default: round-robin]")] = None,
    router_metrics_interval: Annotated[float | None, typer.Option("--router-metrics-interval", help="seconds between the engine-metric snapshots the router sees [default: 0.05]")] = None,
    kv_event_delay: Annotated[float | None, typer.Option("--kv-event-delay", help="seconds after its step ends that a replica's KV events reach an event-fed router (llm-d-precise, dynamo) [default: 0.001]")] = None,
    router_temperature: Annotated[float | None, typer.Option("--router-temperature", help="dynamo: softmax temperature of its pick (0: the lowest cost) [default: 0]")] = None,
    router_scorers: Annotated[str | None, typer.Option("--router-scorers", help="llm-d's or llm-d-precise's scorer weights, name:weight,... of prefix, kv-util, queue [default: llm-d queue:2,kv-util:2,prefix:3; llm-d-precise prefix:2,kv-util:1,queue:1]")] = None,
    router_cache_threshold: Annotated[float | None, typer.Option("--router-cache-threshold", help="sglang-cache-aware: prefix-match rate above which it follows the match [default: 0.3]")] = None,
    router_balance_abs: Annotated[int | None, typer.Option("--router-balance-abs", help="sglang-cache-aware: imbalanced when max - min in-flight exceeds this... [default: 64]")] = None,
    router_balance_rel: Annotated[float | None, typer.Option("--router-balance-rel", help="...and max exceeds min times this [default: 1.5]")] = None,
    router_tree_size: Annotated[int | None, typer.Option("--router-tree-size", help="sglang-cache-aware: characters its radix tree keeps per replica [default: 2**26]")] = None,
    router_eviction_interval: Annotated[float | None, typer.Option("--router-eviction-interval", help="sglang-cache-aware: seconds between its tree's evictions [default: 120]")] = None,
    prefill_replicas: Annotated[int | None, typer.Option("--prefill-replicas", help="a P/D cluster: this many prefill replicas (vLLM's NIXL connector), with --decode-replicas, each pool behind --router [default: 0, off]")] = None,
    decode_replicas: Annotated[int | None, typer.Option("--decode-replicas", help="a P/D cluster: this many decode replicas [default: 0, off]")] = None,
    pd_decider: Annotated[str | None, typer.Option("--pd-decider", help="never|always|llm-d (prefix-based-pd-decider)|dynamo (IslBounding)|dynamo-load (PrefillLoad)|dynamo-isl-or-load (IslOrLoad): which prompts go to the prefill pool [default: always]")] = None,
    pd_busy_threshold: Annotated[str | None, typer.Option("--pd-busy-threshold", help="Dynamo's router_queue_threshold for dynamo-load: a prefill replica is busy past this many times its max_num_batched_tokens of active prefill tokens; 'none': no signal [default: 4.0]")] = None,
    pd_threshold: Annotated[int | None, typer.Option("--pd-threshold", help="llm-d's nonCachedTokens: disaggregate when at least this many prompt tokens are not cached on the decode replica [default: 16]")] = None,
    prefill_pool: Annotated[str | None, typer.Option("--prefill-pool", help="what the prefill pool sets apart, 'field=value,...' of gpu, tensor_parallel, num_gpu_blocks, gpu_memory_utilization, max_num_batched_tokens, max_num_seqs, max_num_scheduled_tokens, long_prefill_token_threshold, calibration (e.g. 'tensor_parallel=2,max_num_seqs=64')")] = None,
    decode_pool: Annotated[str | None, typer.Option("--decode-pool", help="what the decode pool sets apart, as --prefill-pool")] = None,
    kv_events: Annotated[Path | None, typer.Option("--kv-events", help="write vLLM's KV events to this file, a JSON line a step (BlockStored, BlockRemoved, AllBlocksCleared; a cluster: every replica's, by time); the same tables as without")] = None,
    workers: Annotated[int, typer.Option("--workers", help="a cluster whose replicas never interact (round-robin, random or session-affinity, arrivals open loop): run its replicas apart in this many processes, with the same results (0: one per CPU, 1: this process)", min=0)] = 0,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="run folder (default: runs/<name from workload and config>)")] = None,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="write PNG plots")] = True,
) -> None:
    """Simulate WORKLOAD through the engine and write a run folder (tables, summary, plots)."""
    changes = knob_changes(locals())
    if kv_events is not None:
        changes["kv_events"] = True
    from kvsim.sim.api import default_cache
    from kvsim.sim.engine.config import ConfigError, SimConfig
    from kvsim.sim.engine.cost_model import CostModel
    from kvsim.sim.engine.run import simulate
    from kvsim.sim.studies.run_folder import run_scratch, write_run
    from kvsim.workloads.errors import WorkloadError

    try:
        cfg = SimConfig().replace(**changes).validate()
        cost = CostModel.from_config(cfg)
        blocks = derived = cost.num_gpu_blocks(cfg)  # also checks that the model fits
        sized = default_cache(cfg, derived, workload is not None, changes)  # the embedded workload's cache
        default_cache_used = sized is not cfg
        if default_cache_used:
            cfg, blocks = sized, sized.num_gpu_blocks
        wl = open_workload(workload, format, skip_bad, cfg.seed)
        bar, progress = progress_bar(wl)
    except (ConfigError, WorkloadError, ValueError) as e:
        raise fail(str(e)) from None
    check_fleet_options(changes, cfg)
    if workers and cfg.replicas <= 1:  # (a P/D cluster's pools interact: one clock)
        what = "a P/D cluster, whose pools interact: leave it out" if cfg.prefill_replicas else \
            "one engine: give --replicas N, or leave it out"
        raise fail(f"--workers {workers}: runs a cluster's replicas apart, and this run is {what}")
    name = str(workload) if workload is not None else "default"
    out_dir = out if out is not None else RUNS_DIR / run_name(name, cfg)
    check_output(out_dir, folder=True)  # before the simulation, not after
    if kv_events is not None:
        check_output(kv_events)
    if cfg.replicas > 1:
        return run_cluster(wl, cfg, cost, out_dir, plots, bar, progress, kv_events, workers)
    if cfg.prefill_replicas:
        return run_pd(wl, cfg, cost, out_dir, plots, bar, progress)
    from kvsim.sim.studies.plot_workers import NAMES, PlotWorkers

    # the plots' helpers load matplotlib while the simulation runs (spawned before it grows)
    shown = {"path": None if workload is None else str(workload), "format": format, "seed": cfg.seed,
             "block_size": cost.block_size}  # for the hit-rate plot's ideal line
    with PlotWorkers(workload=shown) if plots else nullcontext() as workers, run_scratch(out_dir) as scratch, \
            ExitStack() as stack:
        # the steps and op records stream into the scratch folder until write_run, the KV events
        # into a file beside theirs, renamed into place only if the whole run is written
        streams = {"ops_dir": scratch, "steps_file": scratch / "steps.parquet"}
        if kv_events is not None:
            streams["kv_events"] = _events_sink(stack, kv_events)
        result = _simulated(simulate, wl, cfg, cost, bar, progress, **streams)
        s = result.summary
        if s["requests"] and not s["finished"] and s["rejected"] + s["truncated"] == s["requests"]:
            raise fail(
                f"the KV cache ({blocks:,} blocks of {cost.block_size} tokens) is too small for any "
                f"request of {name} (smallest dropped prompt: {_smallest_drop(result)} tokens)"
            )
        if s.get("skipped_lines"):
            typer.echo(f"skipped {s['skipped_lines']} bad lines (first: {wl.skipped_errors[0]})", err=True)
        try:
            write_run(result, out_dir, plots=plots, draw=workers.draw if plots else None)
        except OSError as e:
            raise cannot_write(out_dir, e) from None
    notes = [f"workload: {DEFAULT_WORKLOAD_TEXT}"] if workload is None else []
    if default_cache_used:
        notes.append(f"cache: {blocks:,} blocks, the embedded workload's default, small enough to fill "
                     f"(the {cfg.gpu}'s memory would hold {derived:,} blocks, which this workload "
                     "never fills); --num-gpu-blocks N or --gpu-memory-utilization F sets it")
    notes += model_notes(cfg, cost)
    lines = [format_summary(result, notes), "", f"run folder: {out_dir}"]
    switches = (["--skip-bad"] if skip_bad else []) + ([] if plots else ["--no-plots"])
    if plots:
        lines += [f"{'plots:' if i == 0 else '':<12}{out_dir / p}" for i, p in enumerate(NAMES)]
    lines += ["", "next:"] + ["  " + c for c in next_steps(workload, format, switches, changes, cfg, out_dir, s)]
    typer.echo("\n".join(lines))


def _simulated(simulate_fn: Any, wl: Any, cfg: SimConfig, cost: Any, bar: Any, progress: Any, **streams: Any) -> Any:
    """`simulate_fn(wl, cfg, ...)` (one engine, a cluster or a P/D cluster) under the progress bar if
    there is one; a bad config or workload found on the way, or one the engine stalls on, is one line on
    the command line."""
    from kvsim.sim.engine.config import ConfigError
    from kvsim.sim.engine.loop import Stalled
    from kvsim.workloads.errors import WorkloadError

    try:
        if bar is not None:
            with bar:
                return simulate_fn(wl, cfg, progress, cost_model=cost, **streams)
        return simulate_fn(wl, cfg, cost_model=cost, **streams)
    except (ConfigError, WorkloadError, Stalled) as e:
        raise fail(str(e)) from None


def _events_sink(stack: ExitStack, path: Path) -> Any:
    """A sink writing each KV-event batch as a JSON line into a file staged beside `path`, renamed
    into place only if the run is written whole (`stack` closes it)."""
    sink = stack.enter_context(open(stack.enter_context(staged_file(path)), "w"))
    return lambda batch: sink.write(batch.json_line())


def check_fleet_options(changes: dict[str, Any], cfg: Any, search: bool = False, clusters: bool = False) -> None:
    """Fail on an option that would do nothing, silently (`config.idle_field`, the rules the Python API
    keeps too), in the words of the options: a router's given to one engine (no `--replicas`, no P/D
    pools; `--replicas 1` is a cluster of one, and runs), a P/D decider's without P/D pools, a KV
    link's with neither P/D pools nor a P/D side (`--kv-transfer-role`); a host or file tier's are
    refused as the options are read (`options.offload_changes`, `fs_changes`). `search`: `kvsim
    capacity`'s rate search; `clusters`: its search for replicas (`--max-replicas`), whose clusters
    take a router's options."""
    from kvsim.sim.engine.config import NO_STEP_TIME, ROUTER_FIELDS, idle_field

    idle = idle_field([k for k in changes if not (clusters and k in ROUTER_FIELDS)], cfg)
    if idle is None:
        return
    field, needs = idle
    flag, what = f"--{field.replace('_', '-')}", "search" if search else "run"
    pools = "--prefill-replicas P --decode-replicas D"
    more = " or --max-replicas N" if search else ""
    raise fail({
        "replicas": f"{flag}: a router's option, and this {what} has one replica: give --replicas N{more} "
                    f"({'or ' + pools}), or leave it out",
        "prefill_replicas": f"{flag}: a P/D cluster's option, and this {what} has no P/D pools: give {pools}, or "
                            "leave it out",
        "prefill_replicas or kv_transfer_role": f"{flag}: a KV transfer's option, and this {what} moves no KV between "
                                                f"replicas: give {pools} or --kv-transfer-role, or leave it out",
        NO_STEP_TIME: f"{flag}: --step-time fixes every step's time, so the calibration of the cost model changes "
                      "nothing: leave one of the two out",
    }.get(needs, f"{flag} changes nothing without {needs}: set it, or leave it out"))


def run_cluster(wl: Any, cfg: SimConfig, cost: Any, out_dir: Path, plots: bool, bar: Any, progress: Any,
                kv_events: Path | None = None, workers: int = 0) -> None:
    """`kvsim run --replicas N`: simulate the cluster, write its folder, print its table; with
    `kv_events`, every replica's KV-event batches into that file, in the order (ts, replica, step);
    replicas that never interact run apart in `workers` processes (0: one per CPU)."""
    from kvsim.sim.cli.report import cluster_head, cluster_table
    from kvsim.sim.cluster.run import simulate_cluster
    from kvsim.sim.studies.cluster_folder import PLOT, write_cluster
    from kvsim.sim.studies.run_folder import run_scratch

    # each replica's steps stream into the scratch folder (flat memory), copied in whole; the KV
    # events into a file beside theirs, renamed into place only if the whole run is written
    with run_scratch(out_dir) as scratch, ExitStack() as stack:
        streams: dict[str, Any] = {"steps_dir": scratch, "keep_requests": False, "workers": workers}
        if cfg.record_ops:  # each replica's op stream, moved into its folder by write_run
            streams["ops_dir"] = scratch
        if kv_events is not None:
            streams["kv_events"] = _events_sink(stack, kv_events)
        result = _simulated(simulate_cluster, wl, cfg, cost, bar, progress, **streams)
        try:
            write_cluster(result, out_dir, plots=plots)
        except OSError as e:
            raise cannot_write(out_dir, e) from None
    section = result.summary["cluster"]
    head = cluster_head(result, cost.block_size)
    lines = [head, cluster_table(section),
             "", f"run folder: {out_dir} (replica-<i>/: each replica's run folder; received.parquet: the requests "
             "each replica received)"]
    if plots:
        lines.append(f"plot:       {out_dir / PLOT}")
    typer.echo("\n".join(lines))


def run_pd(wl: Any, cfg: SimConfig, cost: Any, out_dir: Path, plots: bool, bar: Any, progress: Any) -> None:
    """`kvsim run --prefill-replicas P --decode-replicas D`: simulate the P/D cluster, write its
    folder, print its figures."""
    from kvsim.sim.cluster.pd import simulate_pd
    from kvsim.sim.studies.pd_folder import PLOT, write_pd
    from kvsim.sim.studies.run_folder import run_scratch

    # with op records, each replica's stream goes into the scratch folder until write_pd moves it
    with run_scratch(out_dir) as scratch:
        result = _simulated(simulate_pd, wl, cfg, cost, bar, progress, ops_dir=scratch if cfg.record_ops else None)
        try:
            write_pd(result, out_dir, plots=plots)
        except OSError as e:
            raise cannot_write(out_dir, e) from None
    lines = pd_lines(result.summary)
    lines += ["", f"run folder: {out_dir} (replica-<i>/: each replica's run folder, prefill first; paths.parquet: "
              "each request's way through the pools)"]
    if plots:
        lines.append(f"plot:       {out_dir / PLOT}")
    typer.echo("\n".join(lines))


def register(app: typer.Typer) -> None:
    """Mount `run`, `report` and `compare` on the root `kvsim` app."""
    app.command("run")(run)
    app.command("report")(report)
    app.command("compare")(compare)
