"""One simulation's configuration: engine limits, cache policy, model, GPU."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from kvsim.kvcache.block_pool import check_memory
from kvsim.kvcache.eviction import check_policy
from kvsim.kvcache.profiles import profile
from kvsim.sim.engine.catalog import ConfigError, get_gpu, vllm_batch_defaults

__all__ = ["FILE_TIER_FIELDS", "HOST_TIER_FIELDS", "KV_CACHE_DTYPES", "LINK_FIELDS", "PD_FIELDS", "POOL_FIELDS",
           "ROUTER_FIELDS", "ROUTER_NAMES", "ROUTER_SCORERS", "SCHEDULER_KNOBS", "ConfigError",
           "SimConfig", "check_block_size", "parse_pool", "parse_router_scorers"]

# vLLM SchedulerConfig fields that SimConfig takes under the same names and defaults (0.24+ and
# 0.31+ options); `kvsim conform` hands vLLM those not at their defaults
SCHEDULER_KNOBS = ("long_prefill_token_threshold_adaptive", "max_num_active_seqs", "scheduler_reserve_full_isl",
                   "prefill_schedule_interval", "max_num_scheduled_tokens")


# vLLM 0.33's --kv-cache-dtype values kvsim models, and the bytes of one element of each
KV_CACHE_DTYPES = {"auto": None, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def check_block_size(block_size: int) -> None:
    """Raise ConfigError unless `block_size` is a positive power of two (as vLLM's sizes are)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ConfigError(f"block_size must be an integer, got {block_size!r}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ConfigError(f"block_size must be a positive power of two, got {block_size}")


# the routers a cluster of replicas may run behind (`sim.cluster.routers.ROUTERS` implements each)
ROUTER_NAMES = ("round-robin", "random", "least-outstanding", "vllm-dp", "vllm-dp-legacy", "session-affinity",
                "llm-d-precise", "dynamo", "llm-d", "sglang-cache-aware")
# a P/D cluster's deciders (`sim.cluster.deciders.decide` implements each)
PD_DECIDERS = ("never", "always", "llm-d", "dynamo", "dynamo-load", "dynamo-isl-or-load")
# the routers fed by the replicas' KV events (sim.cluster.kv_routers)
EVENT_ROUTERS = ("llm-d-precise", "dynamo")
# the fields that set up a P/D cluster's decider, a KV transfer (a P/D cluster's link, or a lone P/D
# side's), the host tier below the GPU pool and the file tier below that: nothing without those
PD_FIELDS = ("pd_decider", "pd_threshold", "pd_busy_threshold")
LINK_FIELDS = ("kv_transfer_gbps", "kv_transfer_latency", "kv_lease_duration")
HOST_TIER_FIELDS = ("offload_eviction_policy", "offload_store_threshold", "offload_blocks_per_chunk",
                    "offload_prompt_only")
FILE_TIER_FIELDS = ("offload_fs_size", "offload_fs_gbps", "offload_fs_threads")
# the fields that set up a cluster's router (nothing to one engine run alone): which router, how stale
# its metrics, the event-fed ones' delay and Dynamo's temperature, the scoring ones' weights (llm-d,
# llm-d-precise), sglang-cache-aware's thresholds and tree
ROUTER_FIELDS = ("router", "router_metrics_interval", "kv_event_delay", "router_temperature", "router_scorers",
                 "router_cache_threshold", "router_balance_abs", "router_balance_rel", "router_tree_size",
                 "router_eviction_interval")

# The default transport delay of a KV-event batch, seconds after its step ended: vLLM's
# ZmqEventPublisher sends each step's batch from its publisher thread at once (no batching
# interval: vllm/distributed/kv_events.py), and the router's subscriber applies it to its
# in-memory index through a worker queue (llm-d-kv-cache pkg/kvevents/pool.go `AddTask`,
# `processEventBatch`; Dynamo's indexer task over NATS): one hop inside a cluster plus a queue,
# about a millisecond.
KV_EVENT_DELAY = 0.001

# the scorers a scoring router weighs, with its default weights in the order it sums them:
# llm-d, its chart's default scheduling profile (llm-d-inference-scheduler
# config/charts/epplib/templates/_config.yaml); llm-d-precise, its precise profile
# (deploy/config/epp-precise-prefix-cache-config.yaml, commit 98debc4)
ROUTER_SCORERS = {"llm-d": {"queue": 2.0, "kv-util": 2.0, "prefix": 3.0},
                  "llm-d-precise": {"prefix": 2.0, "kv-util": 1.0, "queue": 1.0}}


NO_STEP_TIME = "no step_time"  # what `idle_field` says a calibration needs: the cost model, not a fixed step


def idle_field(given: Collection[str], cfg: SimConfig) -> tuple[str, str] | None:
    """The first of the fields `given` (set by a caller, by name) that `cfg` would leave idle, with the
    field it needs; None if every one takes effect. A P/D decider's needs P/D pools; a KV transfer's,
    P/D pools or a P/D side; a host tier's, `kv_offloading_size`; a file tier's, `offload_fs`; a
    router's, `replicas` given (one of 1 is a cluster of one) or P/D pools; a calibration's, the cost
    model it tunes, which a fixed `step_time` replaces (`NO_STEP_TIME`)."""
    pools = cfg.prefill_replicas > 0
    for fields, idle, needs in (
            (("calibration",), cfg.step_time is not None, NO_STEP_TIME),
            (PD_FIELDS, not pools, "prefill_replicas"),
            (LINK_FIELDS, not pools and cfg.kv_transfer_role is None, "prefill_replicas or kv_transfer_role"),
            (HOST_TIER_FIELDS, cfg.kv_offloading_size is None, "kv_offloading_size"),
            (FILE_TIER_FIELDS, not cfg.offload_fs, "offload_fs"),
            (ROUTER_FIELDS, not pools and "replicas" not in given, "replicas")):
        hit = [f for f in fields if f in given]
        if hit and idle:
            return hit[0], needs
    return None


def parse_router_scorers(text: str | None, router: str = "llm-d-precise") -> dict[str, float]:
    """`name:weight,...` (`SimConfig.router_scorers`) for `router` (ROUTER_SCORERS) as {scorer:
    weight} in the order given; None: the router's default weights. A ConfigError names the bad
    entry."""
    known = ROUTER_SCORERS[router]
    if text is None:
        return dict(known)
    out: dict[str, float] = {}
    for entry in text.split(","):
        name, sep, weight = entry.strip().partition(":")
        if name not in known or not sep:
            raise ConfigError(f"router_scorers: expected name:weight with name one of {', '.join(known)}, "
                              f"got {entry.strip()!r}")
        if name in out:
            raise ConfigError(f"router_scorers: {name} given twice")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"router_scorers: {name}'s weight must be a number >= 0, got {weight!r}")
        out[name] = value
    return out

# what one pool of a P/D cluster may set apart from the other (`SimConfig.prefill_pool`, `decode_pool`):
# its hardware and its engine's limits, each a SimConfig field of the same name (the model, the block
# size and the cache's dtype stay the cluster's: vLLM's NIXL connector reads blocks as they are laid out)
POOL_FIELDS = ("gpu", "tensor_parallel", "num_gpu_blocks", "gpu_memory_utilization", "max_num_batched_tokens",
               "max_num_seqs", "max_num_scheduled_tokens", "long_prefill_token_threshold", "calibration")


def parse_replica_pools(text: str) -> list[tuple[int, dict[str, Any]]]:
    """`count:field=value,...;...` (`SimConfig.replica_pools`) as [(count, {field: value})], each group's
    fields as `parse_pool` reads them; a ConfigError names the bad group."""
    out = []
    for k, group in enumerate(text.split(";")):
        count, sep, fields = group.strip().partition(":")
        try:
            n = int(count)
        except ValueError:
            n = 0
        if not sep or n < 1:
            raise ConfigError(f"replica_pools: group {k + 1} {group.strip()!r}: expected count:field=value,... "
                              "with a count >= 1 (e.g. '2:gpu=a100-80g,tensor_parallel=2;2:')")
        out.append((n, parse_pool(fields, f"replica_pools group {k + 1}")))
    return out


def parse_pool(text: str | None, name: str = "prefill_pool") -> dict[str, Any]:
    """`field=value,...` (`SimConfig.prefill_pool` / `decode_pool`) as {field: value}, each value of its
    SimConfig field's type (`none` for an optional field's None); None or '': no changes. A ConfigError
    names the bad entry."""
    out: dict[str, Any] = {}
    if not text:
        return out
    types = {f.name: f.type for f in dataclasses.fields(SimConfig)}
    for entry in text.split(","):
        key, sep, value = (part.strip() for part in entry.partition("="))
        if key not in POOL_FIELDS or not sep:
            raise ConfigError(f"{name}: expected field=value with field one of {', '.join(POOL_FIELDS)}, "
                              f"got {entry.strip()!r}")
        if key in out:
            raise ConfigError(f"{name}: {key} given twice")
        kind = str(types[key])
        if value.lower() == "none" and "None" in kind:
            out[key] = None
            continue
        try:
            out[key] = int(value) if kind.startswith("int") else float(value) if kind.startswith("float") else value
        except ValueError:
            raise ConfigError(f"{name}: {key} must be {kind.split(' ')[0]}, got {value!r}") from None
    return out


# config.json of a run in vLLM's hybrid KV-cache groups: each group's kind, window and block size,
# what `kvsim gpu-replay` verifies its op stream by (`sim.studies.run_folder.write_run`)
KV_GROUPS_KEY = "kv_cache_groups"

@dataclass
class SimConfig:
    """Everything a run depends on besides the workload (with it and `seed`, a run is deterministic)."""

    # model and hardware (names from sim.engine.catalog)
    model: str = "llama-3-8b"
    gpu: str = "h100-sxm"
    tensor_parallel: int = 1
    # KV cache
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: derived from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    num_cpu_blocks: int = 0  # swap space; needed for preemption="swap"
    enable_prefix_caching: bool = True
    eviction: str = "lru"
    watermark: float = 0.0
    defrag_threshold: int | None = None
    sliding_window: int | None = None  # None: the model's own (if any)
    # vLLM's --prefix-cache-retention-interval: which of a sliding window's full blocks are hashed;
    # 0 (vLLM 0.33's default) only the tail a later request can resume from, N also one every N
    # tokens, None every block (kvcache.sliding_window.retained_ranges)
    prefix_cache_retention_interval: int | None = 0
    # vLLM's --disable-hybrid-kv-cache-manager for a model mixing layer kinds: None as vLLM on a
    # CUDA host decides (its hybrid KV-cache groups, but not with chunked local attention unless
    # hybrid_chunked_local), True every layer keeps every token (one group), False asked for
    disable_hybrid_kv_cache_manager: bool | None = None
    hybrid_chunked_local: bool = False  # vLLM's VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1
    # vLLM's --kv-cache-dtype: "auto" (the model's 16 bits) or an 8-bit float (fp8, fp8_e4m3,
    # fp8_e5m2): the bytes of a block, so the blocks that fit and the KV read time, follow it
    kv_cache_dtype: str = "auto"
    # the vLLM release whose manager and scheduler rules to follow (kvcache.profiles)
    vllm_version: str = "0.33"
    # scheduler; None: what vLLM 0.33 picks on the GPU (see `batch_limits`)
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    # vLLM's --max-num-scheduled-tokens: one step's token budget, when below max_num_batched_tokens
    # (the forward's size, which still sizes activations and the adaptive long-prefill floor)
    max_num_scheduled_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # cap on one request's prefill chunk; 0: none
    long_prefill_token_threshold_adaptive: bool = False  # (vLLM 0.31+) floor that cap at budget / requests
    max_num_active_seqs: int | None = None  # (vLLM 0.31+) most requests admitted into RUNNING; None: max_num_seqs
    scheduler_reserve_full_isl: bool = True  # admit a request only if its whole known context fits
    prefill_schedule_interval: int = 1  # (vLLM 0.33) prefill only once every N executed steps
    preemption: str = "recompute"  # or "swap"
    scheduling: str = "fcfs"  # or "priority"
    num_lookahead_tokens: int = 0
    # a request with n > 1: "fanout", vLLM V1's n requests sharing the prompt through the prefix
    # cache; "fork", vLLM v0's samples forked after the prefill (copy-on-write of the last block)
    parallel_sampling: str = "fanout"
    # vLLM's --async-scheduling: batch k+1 is scheduled before batch k's output is applied
    # (sim.engine.output.AsyncOutput); recompute preemption only, no lookahead slots. None: as
    # `vllm serve` 0.33 resolves it, on unless this config asks what only sync runs (`runs_async`)
    async_scheduling: bool | None = None
    # the scheduler's exact speed shortcuts (sim.engine.shortcuts: lazy decodes, blocked-head
    # skips); off: every running sequence is visited and the head retried every step, same results
    shortcuts: bool = True
    # vLLM's --max-model-len: a prompt must leave room for one output token, and a
    # sequence stops growing at this length; None: no limit (the catalog has each model's)
    max_model_len: int | None = None
    # sessions: multi-turn requests arrive think_time after the previous turn finished
    closed_loop_sessions: bool = True
    # arrival-rate multiplier: a request of the workload arriving at t arrives at t / load
    load: float = 1.0
    # a cluster (sim.cluster): `replicas` exact copies of this engine on one clock behind a router
    # (ROUTER_NAMES), which sees engine metrics as snapshots taken every router_metrics_interval s
    replicas: int = 1
    router: str = "round-robin"
    router_metrics_interval: float = 0.05
    # event-fed routers (EVENT_ROUTERS): a step's KV events reach the router's index this many
    # seconds after the step ended; dynamo's softmax temperature (0: the lowest cost)
    kv_event_delay: float = KV_EVENT_DELAY
    router_temperature: float = 0.0
    # a scoring router's scorer weights, 'name:weight,...' (ROUTER_SCORERS: llm-d, llm-d-precise); None: its defaults
    router_scorers: str | None = None
    # sglang-cache-aware (sgl-router's router_args.py defaults): prefix-match rate above which it
    # follows the match; the imbalance test (max - min > abs and max > rel x min in-flight requests);
    # its radix tree's characters per replica, and the seconds between the tree's evictions
    router_cache_threshold: float = 0.3
    router_balance_abs: int = 64
    router_balance_rel: float = 1.5
    router_tree_size: int = 2**26
    router_eviction_interval: float = 120.0
    # cost model; step_time: every step takes exactly this many seconds on a grid (no cost
    # model), and every request is queued at its arrival time (sessions open loop)
    step_time: float | None = None
    calibration: str | None = None  # path to a calibration profile (JSON) from `kvsim calibrate`
    # KV offloading to host memory, as vLLM 0.33's --kv-offloading-size GiB (native backend) and
    # its OffloadingConnector options (sim.engine.offload); None: off
    kv_offloading_size: float | None = None
    offload_eviction_policy: str = "lru"  # vLLM's eviction_policy: lru or arc
    offload_store_threshold: int = 0  # vLLM's store_threshold: store a chunk once offered this often (< 2: always)
    offload_blocks_per_chunk: int = 1  # vLLM's blocks_per_chunk: GPU blocks an offloaded chunk holds
    offload_prompt_only: bool = True  # vLLM's offload_prompt_only: store prompt chunks only
    # a file-system tier below the host tier (vLLM's TieringOffloadingSpec, secondary_tiers [{"type": "fs"}])
    offload_fs: bool = False
    offload_fs_size: float | None = None  # GiB of disk for its files; None: unbounded (a full disk fails writes)
    offload_fs_threads: int = 16  # vLLM's n_read_threads and n_write_threads
    offload_fs_gbps: float = 2.0  # GB/s one I/O thread reads or writes
    offload_fs_probe_s: float = 1e-5  # seconds the probe thread takes to check one file
    # prefill/decode disaggregation, one replica standing alone in one role for every request (vLLM
    # 0.33's NixlConnector, sim.engine.nixl): "decode" reads each prompt's KV from a prefill side,
    # "prefill" runs each request to one token and holds its blocks until the decode side has read
    # them (at most kv_lease_duration s); a read takes kv_transfer_latency s plus its bytes at
    # kv_transfer_gbps GB/s a rank (BLIS's NIXL defaults); None: off
    kv_transfer_role: str | None = None
    kv_transfer_gbps: float = 25.0
    kv_transfer_latency: float = 5e-5
    kv_lease_duration: float = 30.0
    # a P/D cluster (sim.cluster.pd): prefill_replicas engines run prompts, decode_replicas decode,
    # each pool behind its own `router`; pd_decider (sim.cluster.deciders.DECIDERS) says which
    # prompts go to the prefill pool (pd_threshold: llm-d's nonCachedTokens); 0 and 0: off
    prefill_replicas: int = 0
    decode_replicas: int = 0
    pd_decider: str = "always"
    pd_threshold: int = 16
    # Dynamo's router_queue_threshold for its load-aware deciders (dynamo-load, dynamo-isl-or-load): a
    # prefill replica is busy past this many times its max_num_batched_tokens of active prefill tokens
    # as the router counts them (4.0: Dynamo's Python KvRouterConfig); None: no signal, never busy
    pd_busy_threshold: float | None = 4.0
    # what each pool sets apart from the rest of this config, 'field=value,...' (POOL_FIELDS: its GPU,
    # TP, blocks and limits), e.g. 'tensor_parallel=4,max_num_seqs=512'; None: the config as it is
    prefill_pool: str | None = None
    decode_pool: str | None = None
    # an aggregated cluster of replicas that differ: 'count:field=value,...;count:...' (POOL_FIELDS),
    # the counts summing to `replicas`, e.g. '2:gpu=a100-80g,tensor_parallel=2;2:' (the first two on
    # A100s at TP 2, the other two as the rest of this config); None: every replica alike
    replica_pools: str | None = None
    # outputs
    record_ops: bool = False
    debug_invariants: bool = False
    # vLLM's KV events (kvcache.events), taken once a step (the shortcuts keep each step's batch as it is)
    kv_events: bool = False
    slo_ttft: float | None = None  # seconds, for goodput
    slo_tpot: float | None = None
    seed: int = 0

    def num_gpus(self) -> int:
        """The GPUs this configuration runs on: its tensor-parallel ranks times its replicas (a P/D
        cluster's prefill and decode replicas, each pool at its own TP)."""
        if self.prefill_replicas:
            return (self.prefill_replicas * self.pool_config("prefill").tensor_parallel
                    + self.decode_replicas * self.pool_config("decode").tensor_parallel)
        if self.replica_pools:
            return sum(c.tensor_parallel for c in self.replica_configs())
        return self.tensor_parallel * self.replicas

    def replica_groups(self) -> list[tuple[int, SimConfig, bool]]:
        """An aggregated cluster's groups of replicas, in replica order: (how many, the config they run
        under, whether it sets anything apart from this one): `replica_pools`' groups, or one of all."""
        if not self.replica_pools:
            return [(self.replicas, self, False)]
        return [(count, self.replace(**changes, replica_pools=None), bool(changes))
                for count, changes in parse_replica_pools(self.replica_pools)]

    def replica_configs(self) -> list[SimConfig]:
        """The config each replica of an aggregated cluster runs under, in replica order (`replica_groups`)."""
        return [c for count, c, _ in self.replica_groups() for _ in range(count)]

    def pool_config(self, pool: str) -> SimConfig:
        """The config a P/D pool's engines run under ('prefill' or 'decode'): this one with the pool's
        own fields (`prefill_pool`, `decode_pool`), and no pool fields left."""
        if pool not in ("prefill", "decode"):
            raise ValueError(f"pool must be 'prefill' or 'decode', got {pool!r}")
        changes = parse_pool(getattr(self, f"{pool}_pool"), f"{pool}_pool")
        return self.replace(**changes, prefill_pool=None, decode_pool=None)

    def validate(self) -> SimConfig:
        """Raise ConfigError for values no run could use."""
        check_block_size(self.block_size)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ConfigError(f"num_gpu_blocks must be at least 2 (block 0 is reserved), got {self.num_gpu_blocks}")
        for name in ("num_gpu_blocks", "num_cpu_blocks"):
            if isinstance(getattr(self, name), int):
                try:
                    check_memory(getattr(self, name), name)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if not (math.isfinite(self.load) and self.load > 0):
            raise ConfigError(f"load must be a positive finite number, got {self.load}")
        self._validate_cluster()
        for name in ("slo_ttft", "slo_tpot"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {v}")
        for name in ("num_cpu_blocks", "num_lookahead_tokens", "defrag_threshold"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")
        retention = self.prefix_cache_retention_interval
        if retention is not None and (isinstance(retention, bool) or not isinstance(retention, int) or retention < 0
                                      or retention % self.block_size):
            raise ConfigError(f"prefix_cache_retention_interval must be none, or a multiple of block_size "
                              f"({self.block_size}) >= 0, got {retention!r}")
        if self.preemption not in ("recompute", "swap"):
            raise ConfigError(f"preemption must be 'recompute' or 'swap', got {self.preemption!r}")
        if self.preemption == "swap" and self.num_cpu_blocks <= 0:
            raise ConfigError("preemption='swap' needs num_cpu_blocks > 0")
        if self.prefill_schedule_interval > 1 and self.preemption != "recompute":
            raise ConfigError("prefill_schedule_interval needs preemption='recompute' (vLLM V1 has no swap)")
        for name in ("async_scheduling", "disable_hybrid_kv_cache_manager"):  # (None: as vLLM decides)
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true, false or none (as vLLM decides), got {getattr(self, name)!r}")
        if self.async_scheduling and self.preemption != "recompute":
            raise ConfigError(f"async_scheduling needs preemption='recompute' (vLLM V1 has no swap), got {self.preemption!r}")
        if self.async_scheduling and self.num_lookahead_tokens:
            raise ConfigError(f"async_scheduling does not model lookahead slots, got num_lookahead_tokens={self.num_lookahead_tokens}")
        if self.scheduling not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling must be 'fcfs' or 'priority', got {self.scheduling!r}")
        if self.parallel_sampling not in ("fanout", "fork"):
            raise ConfigError(f"parallel_sampling must be 'fanout' or 'fork', got {self.parallel_sampling!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.step_time is not None and not (math.isfinite(self.step_time) and self.step_time > 0):
            raise ConfigError(f"step_time must be a positive number of seconds, got {self.step_time}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        self._validate_offloading()
        self._validate_transfer()
        from kvsim.kvcache.profiles import profile

        try:
            rules = profile(self.vllm_version)
            rules.check_watermark(self.watermark)
            rules.check_scheduler(self.max_num_active_seqs, self.long_prefill_token_threshold_adaptive,
                                  self.prefill_schedule_interval)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for name in ("max_num_batched_tokens", "max_num_seqs", "tensor_parallel", "max_num_active_seqs",
                     "prefill_schedule_interval", "max_num_scheduled_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        tokens, seqs = self.batch_limits()
        if tokens < seqs:  # vllm/config/scheduler.py SchedulerConfig.__post_init__
            raise ConfigError(f"max_num_batched_tokens ({tokens}) must be >= max_num_seqs ({seqs})")
        if self.max_num_active_seqs is not None and self.max_num_active_seqs > seqs:  # (the same)
            raise ConfigError(f"max_num_active_seqs ({self.max_num_active_seqs}) must be <= max_num_seqs ({seqs})")
        self._validate_scheduled_tokens(tokens)
        try:
            check_policy(self.eviction)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return self

    def _validate_scheduled_tokens(self, tokens: int) -> None:
        """kvsim models max_num_scheduled_tokens up to max_num_batched_tokens, with chunked prefill
        (vLLM takes any value; above, its releases differ, and without chunking a prompt longer
        than the step budget waits forever)."""
        n = self.max_num_scheduled_tokens
        if n is None:
            return
        if n > tokens:
            raise ConfigError(f"max_num_scheduled_tokens ({n}) must be <= max_num_batched_tokens ({tokens}): "
                              "kvsim models a step budget within the forward's size")
        if n < tokens and not self.enable_chunked_prefill:
            raise ConfigError(f"max_num_scheduled_tokens ({n}) below max_num_batched_tokens ({tokens}) needs "
                              "chunked prefill: without it vLLM never schedules a longer prompt")

    def step_tokens(self) -> int:
        """One step's token budget: max_num_scheduled_tokens, else max_num_batched_tokens
        (vllm/v1/core/sched/scheduler.py Scheduler.__init__, max_num_scheduled_tokens)."""
        n = self.max_num_scheduled_tokens
        return self.batch_limits()[0] if n is None else n

    def _validate_cluster(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ConfigError(f"replicas must be an integer >= 1, got {self.replicas!r}")
        if self.router not in ROUTER_NAMES:
            raise ConfigError(f"router must be one of {', '.join(ROUTER_NAMES)}, got {self.router!r}")
        interval = self.router_metrics_interval
        if isinstance(interval, bool) or not isinstance(interval, int | float) or not (
                math.isfinite(interval) and interval > 0):
            raise ConfigError(f"router_metrics_interval must be a positive number of seconds, got {interval!r}")
        self._validate_router_options()
        if self.replica_pools:
            self._validate_replica_pools()
        for name in ("kv_event_delay", "router_temperature"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{name} must be a number >= 0, got {v!r}")
        if self.router_temperature and self.router != "dynamo":
            raise ConfigError(f"router_temperature: only dynamo samples by temperature, not {self.router}")

    def _validate_router_options(self) -> None:
        if self.router_scorers is not None:
            known = ROUTER_SCORERS.get(self.router)
            if known is None:
                raise ConfigError(f"router_scorers: router {self.router} weighs no scorers "
                                  f"(those that do: {', '.join(ROUTER_SCORERS)})")
            parse_router_scorers(self.router_scorers, self.router)
        threshold = self.router_cache_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"router_cache_threshold must be a number in [0, 1], got {threshold!r}")
        for name in ("router_balance_abs", "router_tree_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")
        for name, low in (("router_balance_rel", 0.0), ("router_eviction_interval", 0.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > low):
                raise ConfigError(f"{name} must be a positive number, got {v!r}")

    def _validate_offloading(self) -> None:
        from kvsim.kvcache.offload import OFFLOAD_POLICIES

        if self.offload_eviction_policy not in OFFLOAD_POLICIES:
            raise ConfigError(f"offload_eviction_policy must be one of {', '.join(OFFLOAD_POLICIES)}, "
                              f"got {self.offload_eviction_policy!r}")
        if self.offload_blocks_per_chunk < 1 or self.offload_store_threshold < 0:
            raise ConfigError("offload_blocks_per_chunk must be >= 1 and offload_store_threshold >= 0")
        size = self.kv_offloading_size
        if size is None:
            if self.offload_fs:
                raise ConfigError("offload_fs needs kv_offloading_size: the file tier sits below the host tier")
            return
        if not (math.isfinite(size) and size > 0):
            raise ConfigError(f"kv_offloading_size must be a positive number of GiB, got {size}")
        if self.offload_fs:
            self._validate_fs()
        for bad, why in ((self.preemption != "recompute", "swap preemption"),
                         (self.sliding_window is not None, "a sliding window"), (self.defrag_threshold is not None,
                         "defragmentation"), (profile(self.vllm_version).version != "0.33", f"vllm_version {self.vllm_version}")):
            if bad:
                raise ConfigError(f"kv_offloading_size cannot be combined with {why}: kvsim models offloading "
                                  "under vLLM 0.33's scheduler (sync or async), full attention and recompute preemption")

    def _validate_transfer(self) -> None:
        role = self.kv_transfer_role
        if not (math.isfinite(self.kv_transfer_gbps) and self.kv_transfer_gbps > 0):
            raise ConfigError(f"kv_transfer_gbps must be a positive number of GB/s, got {self.kv_transfer_gbps}")
        if not (math.isfinite(self.kv_transfer_latency) and self.kv_transfer_latency >= 0):
            raise ConfigError(f"kv_transfer_latency must be >= 0 seconds, got {self.kv_transfer_latency}")
        if not (math.isfinite(self.kv_lease_duration) and self.kv_lease_duration > 0):
            raise ConfigError(f"kv_lease_duration must be a positive number of seconds, got {self.kv_lease_duration}")
        self._validate_pd()
        if role is None:
            return
        if role not in ("decode", "prefill"):
            raise ConfigError(f"kv_transfer_role must be 'decode' or 'prefill', got {role!r}")
        for bad, why in ((self.kv_offloading_size is not None, "kv_offloading_size (two connectors)"),
                         (self.preemption != "recompute", "swap preemption"),
                         (self.replicas > 1, "replicas (P/D pools are not modelled yet)"),
                         (self.defrag_threshold is not None, "defragmentation"),
                         (self.parallel_sampling != "fanout", "parallel_sampling 'fork'"),
                         (profile(self.vllm_version).version != "0.33", f"vllm_version {self.vllm_version}")):
            if bad:
                raise ConfigError(f"kv_transfer_role cannot be combined with {why}: kvsim models vLLM 0.33's NIXL "
                                  "connector with recompute preemption and one connector")

    def _validate_pd(self) -> None:
        p, d = self.prefill_replicas, self.decode_replicas
        for name, v in (("prefill_replicas", p), ("decode_replicas", d), ("pd_threshold", self.pd_threshold)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")
        if not p and not d:
            for name in ("prefill_pool", "decode_pool"):
                if getattr(self, name):
                    raise ConfigError(f"{name} needs a P/D cluster (prefill_replicas and decode_replicas)")
            return
        if not (p and d):
            raise ConfigError(f"a P/D cluster needs both pools: prefill_replicas {p}, decode_replicas {d}")
        if self.pd_decider not in PD_DECIDERS:
            raise ConfigError(f"pd_decider must be one of {', '.join(PD_DECIDERS)}, got {self.pd_decider!r}")
        busy = self.pd_busy_threshold
        if busy is not None and (isinstance(busy, bool) or not isinstance(busy, int | float)
                                 or not (math.isfinite(busy) and busy >= 0)):
            raise ConfigError(f"pd_busy_threshold must be none or a number >= 0, got {busy!r}")
        for bad, why in ((self.replicas > 1, "replicas (an aggregated cluster)"),
                         (self.kv_transfer_role is not None, "kv_transfer_role (a lone replica's role)"),
                         (self.kv_offloading_size is not None, "kv_offloading_size (two connectors)"),
                         (self.preemption != "recompute", "swap preemption"),
                         (self.kv_events, "kv_events"),
                         (self.parallel_sampling != "fanout", "parallel_sampling 'fork'"),
                         (profile(self.vllm_version).version != "0.33", f"vllm_version {self.vllm_version}")):
            if bad:
                raise ConfigError(f"prefill_replicas cannot be combined with {why}: kvsim models a P/D cluster of "
                                  "vLLM 0.33 replicas with the NIXL connector and recompute preemption")
        if self.prefill_pool or self.decode_pool:
            from kvsim.sim.engine.nixl_tp import check_tp_pair

            for pool in ("prefill", "decode"):
                try:
                    self.pool_config(pool).validate()
                except ConfigError as e:
                    raise ConfigError(f"{pool}_pool: {e}") from None
            check_tp_pair(self.pool_config("prefill").tensor_parallel, self.pool_config("decode").tensor_parallel)

    def _validate_replica_pools(self) -> None:
        if self.replicas < 2:
            raise ConfigError("replica_pools needs an aggregated cluster (replicas > 1)")
        groups = parse_replica_pools(self.replica_pools)
        total = sum(n for n, _ in groups)
        if total != self.replicas:
            raise ConfigError(f"replica_pools: its counts sum to {total}, but replicas is {self.replicas}")
        for k, (_, changes) in enumerate(groups):
            try:
                self.replace(**changes, replica_pools=None).validate()
            except ConfigError as e:
                raise ConfigError(f"replica_pools group {k + 1}: {e}") from None

    def _validate_fs(self) -> None:
        if self.offload_store_threshold >= 2:  # vllm/v1/kv_offload/tiering/spec.py get_manager
            raise ConfigError("offload_store_threshold >= 2 cannot be combined with offload_fs (vLLM refuses it)")
        fs = self.offload_fs_size
        if fs is not None and not (math.isfinite(fs) and fs > 0):
            raise ConfigError(f"offload_fs_size must be a positive number of GiB, got {fs}")
        if self.offload_fs_threads < 1:
            raise ConfigError(f"offload_fs_threads must be >= 1, got {self.offload_fs_threads}")
        for name in ("offload_fs_gbps", "offload_fs_probe_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive number, got {v}")

    def batch_limits(self) -> tuple[int, int]:
        """(max_num_batched_tokens, max_num_seqs): the given ones, else vLLM 0.33's defaults for
        the GPU (sim.engine.catalog.vllm_batch_defaults); with chunked prefill off and no token budget
        given, at least max_model_len; with no max_num_seqs given, at most the token budget
        (vllm/engine/arg_utils.py EngineArgs._set_default_max_num_seqs_and_batched_tokens_args)."""
        tokens, seqs = vllm_batch_defaults(get_gpu(self.gpu))
        if self.max_num_batched_tokens is not None:
            tokens = self.max_num_batched_tokens
        elif not self.enable_chunked_prefill and self.max_model_len is not None:
            tokens = max(tokens, self.max_model_len)
        return tokens, self.max_num_seqs if self.max_num_seqs is not None else min(seqs, tokens)

    @property
    def runs_async(self) -> bool:
        """Whether batch k+1 is scheduled while batch k runs: `async_scheduling` when set, else what
        vLLM 0.33 makes of its `None` (`VllmConfig.__post_init__`, vllm/config/vllm.py: on, unless
        pipeline parallelism, a pooling model or a speculative method it cannot overlap). kvsim keeps
        the step-by-step scheduler where it models no async one: another release's rules, swap
        preemption or forked samples (vLLM v0's), and lookahead slots."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return not (profile(self.vllm_version).version != "0.33" or self.preemption != "recompute"
                    or self.parallel_sampling != "fanout" or self.num_lookahead_tokens)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> SimConfig:
        """Build from a dict (a TOML table, a run's config.json); unknown keys are errors."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            import difflib

            hints = [difflib.get_close_matches(k, names, 1) for k in unknown]
            msg = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in zip(unknown, hints, strict=True))
            raise ConfigError(f"{source}: unknown config key(s) {msg}")
        return cls(**d)

    @classmethod
    def from_run_config(cls, d: dict[str, Any], source: str = "config.json") -> SimConfig:
        """Build from a run folder's config.json: `from_dict` of its settings, less what the run
        folder adds for `kvsim gpu-replay` (`KV_GROUPS_KEY`, a hybrid run's groups)."""
        return cls.from_dict({k: v for k, v in d.items() if k != KV_GROUPS_KEY}, source=source)

    def replace(self, **changes: Any) -> SimConfig:
        return dataclasses.replace(self, **changes)
