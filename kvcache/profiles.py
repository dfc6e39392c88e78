"""vLLM release profiles: the block-manager and scheduler rules that differ between releases.

kvsim matches vLLM 0.33.0 by default. Each rule that changed between 0.23
and 0.33 is named here once, with the release that introduced it and the
vLLM file that holds it; `profile("0.23")` gives the rules of that release.
Nothing else in kvsim compares version numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_VERSION = "0.33"
OLDEST, NEWEST = (0, 23), (0, 33)


@dataclass(frozen=True)
class Rule:
    """One behaviour and the releases that have it (inclusive bounds, (major, minor))."""

    name: str
    since: tuple[int, int]
    until: tuple[int, int] = NEWEST
    where: str = ""
    what: str = ""


RULES = (
    Rule(
        "free_unhashed_first", (0, 24),
        where="vllm/v1/core/block_pool.py BlockPool.free_blocks (PR #42656)",
        what="a freed block with no block hash goes to the front of the free queue "
             "(reused first, several keep their order); a hashed one is appended at the tail. "
             "Before 0.24 every freed block was appended.",
    ),
    Rule(
        "free_appends_without_caching", (0, 27), (0, 27),
        where="vllm/v1/core/block_pool.py BlockPool.free_blocks",
        what="with prefix caching off, freed blocks are appended, not prepended "
             "(0.27 only; 0.28 put them back at the front).",
    ),
    Rule(
        "watermark", (0, 24),
        where="vllm/v1/core/kv_cache_manager.py KVCacheManager.allocate_slots; "
              "vllm/config/scheduler.py SchedulerConfig.watermark",
        what="a fraction of the blocks is kept free when admitting a WAITING or PREEMPTED "
             "request while any request is running (absent before 0.24).",
    ),
    Rule(
        "long_prefill_sole_request", (0, 31),
        where="vllm/v1/core/sched/scheduler.py Scheduler.schedule",
        what="long_prefill_token_threshold is ignored while only one request is running or "
             "waiting (since 0.31; before, it always capped a chunk).",
    ),
    Rule(
        "admission_knobs", (0, 31),
        where="vllm/config/scheduler.py SchedulerConfig.max_num_active_seqs, "
              "long_prefill_token_threshold_adaptive; vllm/v1/core/sched/scheduler.py Scheduler.schedule",
        what="max_num_active_seqs caps admissions into RUNNING below max_num_seqs, and an adaptive "
             "long-prefill cap is floored at max_num_batched_tokens / (running + waiting requests) "
             "(both options came in 0.31).",
    ),
    Rule(
        "prefill_schedule_interval", (0, 24),
        where="vllm/config/scheduler.py SchedulerConfig.prefill_schedule_interval",
        what="the option exists (0.24+); it paced data-parallel engines only until 0.33.",
    ),
    Rule(
        "sparse_retention", (0, 29),
        where="vllm/config/cache.py CacheConfig.prefix_cache_retention_interval (PR #52216, default 0); "
              "vllm/v1/core/single_type_kv_cache_manager.py SlidingWindowManager.reachable_block_mask",
        what="a sliding-window group hashes only the blocks a later request can resume from (the window's "
             "tail at the prompt's replay boundary; with an interval N > 0, a tail every N tokens too). "
             "PR #52216 (merged 2026-08-13) made the option an argument defaulting to 0; vLLM 0.29.0 is reported "
             "with that default (vllm issue #57610). Before, every full block was hashed (the option's "
             "environment variable, PR #43447, defaulted to None).",
    ),
    Rule(
        "local_prefill_cadence", (0, 33),
        where="vllm/v1/core/sched/scheduler.py Scheduler.__init__ (local_prefill_interval), Scheduler.schedule",
        what="prefill_schedule_interval holds prefill in an engine without data parallelism: until N "
             "executed steps have passed since the last step that carried prefill, a step admits no "
             "prompt and runs no prefill chunk while some running request decodes (since 0.33; from "
             "0.24 the option paced only data-parallel engines, so one engine ignored it).",
    ),
)


@dataclass(frozen=True)
class Profile:
    """The rules in force for one vLLM release."""

    version: str
    free_unhashed_first: bool
    free_appends_without_caching: bool
    watermark: bool
    long_prefill_sole_request: bool
    admission_knobs: bool
    prefill_schedule_interval: bool
    local_prefill_cadence: bool
    sparse_retention: bool

    def check_watermark(self, watermark: float) -> None:
        """ValueError if a watermark is asked of a release that has none (before 0.24)."""
        if watermark and not self.watermark:
            raise ValueError(f"vLLM {self.version} has no watermark (it came in 0.24); use watermark=0")

    def check_scheduler(self, max_num_active_seqs: int | None, adaptive_long_prefill: bool,
                        prefill_schedule_interval: int = 1) -> None:
        """ValueError if a scheduler option is asked of a release that has none."""
        if prefill_schedule_interval > 1 and not self.prefill_schedule_interval:
            raise ValueError(f"vLLM {self.version} has no prefill_schedule_interval (it came in 0.24)")
        if not self.admission_knobs:
            for name, asked in (("max_num_active_seqs", max_num_active_seqs is not None),
                                ("long_prefill_token_threshold_adaptive", adaptive_long_prefill)):
                if asked:
                    raise ValueError(f"vLLM {self.version} has no {name} (it came in 0.31)")

    def free_first(self, enable_caching: bool) -> bool:
        """Whether freed blocks without a hash go to the front of the free queue."""
        if not self.free_unhashed_first:
            return False
        return enable_caching or not self.free_appends_without_caching


def parse_version(version: str) -> tuple[int, int]:
    """'0.33', '0.33.0' or 'v0.33.1' -> (0, 33); a clear error otherwise."""
    text = version.strip().lstrip("v")
    parts = text.split(".")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        major, minor, *_ = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"vllm version {version!r}: expected MAJOR.MINOR such as 0.33") from None
    if not OLDEST <= (major, minor) <= NEWEST:
        raise ValueError(
            f"vllm version {version!r} is not modelled; kvsim has the rules of "
            f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"
        )
    return major, minor


def profile(version: str = DEFAULT_VERSION) -> Profile:
    """The rules of vLLM `version` (any release from 0.23 to 0.33)."""
    v = parse_version(version)
    on = {r.name: r.since <= v <= r.until for r in RULES}
    return Profile(version=f"{v[0]}.{v[1]}", **on)


def describe() -> list[str]:
    """One line per rule, for `--help` texts and the README."""
    out = []
    for r in RULES:
        span = f"{r.since[0]}.{r.since[1]}" + ("+" if r.until == NEWEST else f"-{r.until[0]}.{r.until[1]}")
        out.append(f"{r.name} ({span}; {r.where}): {r.what}")
    return out
