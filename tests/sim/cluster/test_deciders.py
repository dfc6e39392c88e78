"""P/D deciders (sim/cluster/deciders.py), hand-worked against their sources.

llm-d: llm-d router `PrefixBasedPDDecider.disaggregate` / `computeNonCachedTokens` (nonCached =
input tokens - cached blocks x block size; disaggregate iff nonCached >= nonCachedTokens > 0; no
prefix information: no disaggregation). Dynamo: lib/kv-router/src/conditional_disagg.rs
`IslBoundingPolicy::should_bypass_remote_prefill` (bypass iff eff_isl < 2048 and eff_isl /
max(prompt, 1) < 0.7), with the cases of its own unit tests."""

from __future__ import annotations

import pytest

from kvsim.sim.cluster.deciders import DECODE_FIRST, decide


def test_never_and_always():
    assert not decide("never", 10_000, 0).disaggregate
    assert decide("always", 1, 1).disaggregate


@pytest.mark.parametrize("prompt, cached, remote", [
    (100, 0, True),      # 100 non-cached >= 16
    (100, 84, True),     # exactly 16: at the threshold disaggregates (not `<`)
    (100, 96, False),    # 4 non-cached < 16
    (15, 0, False),      # a short prompt never reaches the threshold
    (100, None, False),  # no prefix information: decode profile only
])
def test_llmd_prefix_based_pd_decider(prompt, cached, remote):
    assert decide("llm-d", prompt, cached).disaggregate is remote


def test_llmd_threshold_zero_disables_it():
    assert not decide("llm-d", 10_000, 0, threshold=0).disaggregate


@pytest.mark.parametrize("prompt, cached, remote", [
    (1000, 14 * 64, False),        # Dynamo's small_and_mostly_cached_bypasses: eff 104, ratio 0.104
    (100_000, 1000 * 64, True),    # large_eff_isl: 36k >= 2048
    (200, 0, True),                # ratio 1.0 >= 0.7
    (2048, 0, True),               # boundary: eff == 2048 does not bypass
    (0, 0, False),                 # zero prompt: eff 0, ratio 0 -> bypass (local)
    (500, 640, False),             # overlap past the prompt saturates eff to 0
    (10_000, 7_000, True),         # eff 3000 >= 2048
])
def test_dynamo_isl_bounding(prompt, cached, remote):
    eff = max(prompt - cached, 0)
    expected_local = eff < 2048 and eff / max(prompt, 1) < 0.7
    assert decide("dynamo", prompt, cached).disaggregate is (not expected_local)
    assert decide("dynamo", prompt, cached).disaggregate is remote


def test_dynamo_ratio_case_by_hand():
    # 3000 prompt, 1000 cached: eff 2000 < 2048 and 2000 / 3000 = 0.667 < 0.7: stays local
    assert not decide("dynamo", 3000, 1000).disaggregate
    # 2800 prompt, 800 cached: eff 2000 < 2048 but 2000 / 2800 = 0.714 >= 0.7: disaggregated
    assert decide("dynamo", 2800, 800).disaggregate


def test_who_picks_first():
    assert DECODE_FIRST["llm-d"] and not DECODE_FIRST["dynamo"]


def test_unknown_decider():
    with pytest.raises(ValueError, match="pd_decider must be one of"):
        decide("sometimes", 1, 0)


@pytest.mark.parametrize("busy, remote", [(True, False), (False, True), (None, True)])
def test_dynamo_prefill_load_policy(busy, remote):
    # conditional_disagg.rs `PrefillLoadPolicy::should_bypass_remote_prefill`: bypass iff the peeked
    # prefill worker is busy; no signal (None) is calm. The prompt and its overlap play no part.
    assert decide("dynamo-load", 100_000, 0, prefill_busy=busy).disaggregate is remote
    assert decide("dynamo-load", 10, 10, prefill_busy=busy).disaggregate is remote


@pytest.mark.parametrize("prompt, cached, busy, remote", [
    (1000, 14 * 64, False, False),   # ISL says local
    (200, 0, True, False),           # load says local
    (200, 0, False, True),           # neither
    (200, 0, None, True),            # neither (no load signal)
])
def test_dynamo_isl_or_load_policy(prompt, cached, busy, remote):
    # `IslOrLoadPolicy`: bypass iff IslBounding or PrefillLoad bypasses
    assert decide("dynamo-isl-or-load", prompt, cached, prefill_busy=busy).disaggregate is remote
    assert not DECODE_FIRST["dynamo-isl-or-load"] and not DECODE_FIRST["dynamo-load"]
