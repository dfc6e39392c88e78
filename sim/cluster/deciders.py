"""Whether a request's prefill runs on a prefill replica (disaggregated) or on its decode replica: the
deciders of P/D clusters, each as its source defines it.

- `never`, `always`: every request local, or every request disaggregated.
- `llm-d`: llm-d's `prefix-based-pd-decider` (llm-d router, `disagg` plugins,
  `PrefixBasedPDDecider.disaggregate` and `computeNonCachedTokens`): the non-cached suffix is the
  prompt's tokens less the chosen decode endpoint's cached blocks x the block size, as the prefix
  producer (the decode router's index) reports them; disaggregate iff that suffix is at least
  `nonCachedTokens` (16 in llm-d's P/D sample configs; 0 disables it). Without prefix information
  for the endpoint it does not disaggregate (`ok` false): behind a router with no prefix index, llm-d
  never disaggregates.
- `dynamo`: Dynamo's conditional disaggregation, its default `IslBounding` policy (ai-dynamo/dynamo
  lib/kv-router/src/conditional_disagg.rs, `IslBoundingPolicy::should_bypass_remote_prefill`):
  eff_isl = prompt tokens less the cache-hot decode worker's overlap blocks x block size; the prefill
  stays local iff eff_isl < 2048 and eff_isl / max(prompt, 1) < 0.7 (its
  `DEFAULT_CONDITIONAL_DISAGG_EFF_ISL_THRESHOLD` and `..._RATIO_THRESHOLD`); disaggregated otherwise.
- `dynamo-load`: Dynamo's `PrefillLoadPolicy` (same file): the prefill stays local iff the prefill
  worker the prefill router would pick (a peek: the selection without booking the request) is busy,
  its active prefill tokens (the router's own count, as `ActiveSequences` keeps it) above
  `pd_busy_threshold` x its max_num_batched_tokens (the router's `router_queue_threshold`, 4.0 in
  Dynamo's Python `KvRouterConfig`; the Rust default, None, gives no signal). No signal (none set, or a
  prefill router keeping no prefill-token count: only `dynamo` keeps one) counts as calm: disaggregated.
- `dynamo-isl-or-load`: `IslOrLoadPolicy`: local iff `dynamo` or `dynamo-load` says local.

Which replica is chosen first follows each source: llm-d runs its decode profile, then the decider
on the decode pick, then the prefill profile; Dynamo's prefill router decides from the decode side's
overlap, routes the prefill, and the decode worker is picked once the prefill is done
(`DECODE_FIRST`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.sim.engine.config import PD_DECIDERS

DECIDERS = PD_DECIDERS
LLMD_NON_CACHED_TOKENS = 16  # llm-d's P/D sample configs (the plugin's own default, 0, disables it)
DYNAMO_EFF_ISL_THRESHOLD = 2048
DYNAMO_EFF_ISL_RATIO = 0.7
DECODE_FIRST = {"never": True, "always": True, "llm-d": True, "dynamo": False, "dynamo-load": False,
                "dynamo-isl-or-load": False}
# the deciders that ask whether the prefill pool's pick is busy (Dynamo's `needs_prefill_worker_busy`)
NEEDS_PREFILL_BUSY = ("dynamo-load", "dynamo-isl-or-load")


@dataclass(frozen=True, slots=True)
class Decision:
    """What a decider saw and said: the prompt, the decode side's cached tokens as the router believes
    (None: no prefix information), and whether the prefill runs remotely."""

    prompt_tokens: int
    cached_tokens: int | None
    disaggregate: bool


def _isl_local(prompt_tokens: int, cached_tokens: int | None) -> bool:
    """Dynamo's `IslBoundingPolicy::should_bypass_remote_prefill`."""
    eff = max(prompt_tokens - (cached_tokens or 0), 0)
    return eff < DYNAMO_EFF_ISL_THRESHOLD and eff / max(prompt_tokens, 1) < DYNAMO_EFF_ISL_RATIO


def decide(name: str, prompt_tokens: int, cached_tokens: int | None, *,
           threshold: int = LLMD_NON_CACHED_TOKENS, prefill_busy: bool | None = None) -> Decision:
    """Decider `name` on a prompt of `prompt_tokens` of which the chosen (or cache-hot) decode replica
    holds `cached_tokens` (block-aligned, as a prefix index counts them; None: unknown); for the
    load-aware ones, whether the prefill pool's pick is busy (`prefill_busy`; None: no signal)."""
    if name == "never":
        remote = False
    elif name == "always":
        remote = True
    elif name == "llm-d":
        remote = threshold > 0 and cached_tokens is not None and prompt_tokens - cached_tokens >= threshold
    elif name == "dynamo":
        remote = not _isl_local(prompt_tokens, cached_tokens)
    elif name == "dynamo-load":
        remote = not prefill_busy
    elif name == "dynamo-isl-or-load":
        remote = not (_isl_local(prompt_tokens, cached_tokens) or prefill_busy)
    else:
        raise ValueError(f"pd_decider must be one of {', '.join(DECIDERS)}, got {name!r}")
    return Decision(prompt_tokens, cached_tokens, remote)
