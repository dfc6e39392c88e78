"""The file tier below the host tier in the engine (vLLM 0.33's TieringOffloadingSpec with an `fs`
secondary tier, vllm/v1/kv_offload/tiering/): probes that defer admissions, cascades of stored
chunks to files, promotions of file hits into the host tier, and a disk that fills up.

Every run here: the sync scheduler, blocks of 4 tokens, 8 GPU blocks, a 6-chunk host tier, 1 MiB
chunks moved in 1 s by one I/O thread and files probed in 0.25 s each; the host link is instant. The
workload is tests/sim/engine/test_offload.py's: a (16 tokens) at 0, f (24) at 10, b (a's 16 + 4) at 20.
"""

from __future__ import annotations

import pytest

from kvsim.sim.engine.config import ConfigError, SimConfig
from kvsim.sim.engine.run import simulate
from kvsim.workloads.request import Workload
from tests.sim.engine.test_offload import MIB, HostLinkCost, _evicted_prefix

FS = {"offload_fs": True, "offload_fs_gbps": MIB / 1e9, "offload_fs_probe_s": 0.25}


def _run(disk_chunks: int | None = None):
    cfg = SimConfig(block_size=4, num_gpu_blocks=8, kv_offloading_size=6 * MIB / (1 << 30), **FS,
                    offload_fs_size=None if disk_chunks is None else disk_chunks * MIB / (1 << 30),
                    async_scheduling=False)
    res = simulate(Workload.from_list(_evicted_prefix(), "test"), cfg, cost_model=HostLinkCost())
    return res.requests.set_index("id"), res.summary


def test_a_prefix_evicted_from_the_host_is_promoted_from_its_files() -> None:
    """Every host miss is probed first, and the request waits for the answer (vLLM `lookup`: RETRY
    until the probe is back; the connector defers on RETRY): a's 4 keys take 1 s, f's 6 take 1.5 s.
    f's stores evict a's 4 chunks from the host, but they were cascaded to files once stored
    (`complete_store`). At 20 b's 5 host misses are probed (1.25 s); at 21.25 a's 4 files are
    found and promoted, each taking a host slot (evicting f's chunks), its own last chunk has no
    file; the 4-chunk read takes 4 s on one thread, and at 25.25 b finds them in the host and
    loads them like any host hit."""
    r, s = _run()
    assert r["first_scheduled"].tolist() == [1.0, 11.5, 25.25]
    assert r["hit_tokens"].tolist() == [0, 0, 0]
    assert (s["offload_hit_tokens"], s["fs_hit_tokens"], s["loaded_blocks"]) == (16, 16, 4)
    # a's 4, f's 6 and b's last chunk stored and written; a's 4 read back
    assert (s["stored_blocks"], s["fs_files"], s["fs_chunks_written"], s["fs_chunks_read"]) == (11, 11, 11, 4)
    # f evicts a's 4, the promotions 4 of f's, b's own chunk one more
    assert (s["offload_evictions"], s["fs_failed_jobs"], s["fs_promotion_failures"]) == (9, 0, 0)


@pytest.mark.parametrize(("disk", "files", "failed", "loaded", "b_at"), [(4, 4, 2, 16, 25.25), (2, 2, 3, 8, 23.25)])
def test_a_full_disk_fails_the_writes_past_it(disk, files, failed, loaded, b_at) -> None:
    """vLLM bounds nothing; a full disk fails a write (ENOSPC), which stops its job with the files
    before it kept (vllm/v1/kv_offload/tiering/fs/io.py `batch_store_block`). With room for 4
    files, f's and b's cascades fail; with 2, a's fails after 2 files, and b promotes 2 chunks
    (2 s) and loads 8 tokens."""
    r, s = _run(disk)
    assert (s["fs_files"], s["fs_failed_jobs"], s["fs_hit_tokens"], s["offload_hit_tokens"]) == (files, failed,
                                                                                                 loaded, loaded)
    assert r.loc["b", "first_scheduled"] == b_at


@pytest.mark.parametrize(("change", "error"), [
    ({"kv_offloading_size": None}, "offload_fs needs kv_offloading_size"),
    ({"offload_store_threshold": 2}, "offload_store_threshold >= 2 cannot be combined with offload_fs"),
    ({"offload_fs_size": 0.0}, "offload_fs_size must be a positive"),
    ({"offload_fs_threads": 0}, "offload_fs_threads must be >= 1"),
    ({"offload_fs_gbps": -1.0}, "offload_fs_gbps must be a positive"),
])
def test_file_tier_config_errors(change, error) -> None:
    with pytest.raises(ConfigError, match=error):
        SimConfig(**{"kv_offloading_size": 1.0, "offload_fs": True, **change}).validate()
