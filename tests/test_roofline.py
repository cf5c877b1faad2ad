"""The roofline model (``sparsekv.testing.roofline``) against figures worked out by hand from each cost
function's documented formula and the GPUs' published peaks (the arithmetic is written out beside
each expected value)."""

from __future__ import annotations

import pytest

from sparsekv.testing import roofline
from sparsekv.testing.roofline import GPUS

H100, H200, B200 = GPUS["H100"], GPUS["H200"], GPUS["B200"]


def test_fused_compress_store_of_4k_c4_tokens_is_the_issues_34_mb_in_7_1_us_on_h200():
    cost = roofline.compress_store(4096, 4)
    # 4096 tokens * (kv + score, A and B halves: 2 * 2 * 512 * 4 B) + 1024 records * 584 B
    assert cost.bytes == 4096 * 8192 + 1024 * 584 == 34_152_448
    assert cost.roofline_s(H200) == pytest.approx(7.1151e-6, rel=1e-4)  # 34,152,448 / 4.8e12
    assert cost.roofline_s(H100) == pytest.approx(10.1948e-6, rel=1e-4)  # / 3.35e12
    assert cost.roofline_s(B200) == pytest.approx(4.2691e-6, rel=1e-4)  # / 8e12
    assert roofline.compress_store(4096, 128).bytes == 4096 * 4096 + 32 * 584  # C128: one half, 32 entries
    assert roofline.compress(4096, 4).bytes == 4096 * 8192 + 1024 * 2048  # fp32 entries of 512 channels


def test_decode_attention_at_batch_64_top_k_512_is_memory_bound_at_5_8_us_on_h200():
    cost = roofline.attention(64, 512)
    # records and indices 64*512*(584+4) = 19,267,584; bf16 q and out 64*64*512*4 = 8,388,608;
    # lse 64*64*4 = 16,384; sink 64*4 = 256
    assert cost.bytes == 27_672_832
    assert cost.flops == 4 * 64 * 64 * 512 * 512 == 4_294_967_296
    times = cost.times_s(H200)
    assert times["memory"] == pytest.approx(5.7652e-6, rel=1e-4)
    assert times["math"] == pytest.approx(4.3427e-6, rel=1e-4)  # 4.295e9 / 989e12
    assert cost.bound(H200) == "memory" and cost.roofline_s(H200) == times["memory"]
    assert cost.roofline_s(B200) == pytest.approx(3.4591e-6, rel=1e-4)  # 27,672,832 / 8e12


def test_one_row_of_128_heads_over_2048_rows_is_bound_by_the_tensor_cores():
    cost = roofline.attention(1, 2048, heads=128)
    assert cost.bytes == 2048 * 588 + 128 * 512 * 4 + 128 * 4 + 128 * 4 == 1_467_392
    assert cost.flops == 536_870_912  # 4 * 128 * 512 * 2048
    assert cost.bound(H200) == "math"
    assert cost.roofline_s(H200) == pytest.approx(0.54284e-6, rel=1e-4)  # / 989e12


def test_indexer_scores_of_64k_fp8_keys_are_the_issues_8_9_mb_in_1_9_us():
    cost = roofline.indexer_scores(1, 65536)
    # keys + scores 65536 * 136 = 8,912,896; page table 1024 * 4; bf16 query and weights 64 * (256 + 4)
    assert cost.bytes == 8_933_632
    assert cost.math == "fp8" and cost.flops == 2 * 64 * 128 * 65536
    assert cost.roofline_s(H200) == pytest.approx(1.8612e-6, rel=1e-4)
    assert cost.times_s(H200)["math"] == pytest.approx(0.54258e-6, rel=1e-4)  # 1.074e9 / 1979e12
    # FP4 keys: 68 B records, 65536 * (68 + 4) + the same page table, query and weights
    assert roofline.indexer_scores(1, 65536, key_bytes=68).bytes == 4_718_592 + 4096 + 16_640


def test_topk_gather_and_swap_in():
    assert roofline.indexer_topk(1, 65536, 512).bytes == (65536 + 512) * 4 == 264_192
    gather = roofline.gather_rows(16384, 584)
    assert gather.bytes == 16384 * (2 * 584 + 16) == 19_398_656
    assert gather.roofline_s(H200) == pytest.approx(4.0414e-6, rel=1e-4)
    swap = roofline.swap_in(64, 512, 33)  # 0.1 % of 64 * 512 selected tokens miss
    assert swap.bytes == 64 * 512 * 12 + 33 * 584 and swap.host_bytes == 33 * 584
    assert swap.bound(H200) == "host" and swap.roofline_s(H200) == pytest.approx(0.35040e-6, rel=1e-4)  # / 55e9
    assert roofline.store(100).bytes == 100 * (2048 + 16 + 584)
    assert roofline.quantize(100, x_bytes=4).bytes == 100 * (2048 + 8 + 584)


def test_a_row_gets_every_gpus_roofline_and_a_ratio_only_for_a_gpu_it_knows():
    cost = roofline.compress_store(4096, 4)
    row = roofline.fields(cost, 10e-6, "NVIDIA H200")
    assert row["h200_roofline_us"] == 7.115 and row["h100_roofline_us"] == 10.195 and row["b200_roofline_us"] == 4.269
    assert row["roofline_gpu"] == "H200" and row["measured_over_roofline"] == 1.41  # 10 / 7.1151
    assert roofline.fields(cost, 10e-6, "NVIDIA H100 80GB HBM3")["measured_over_roofline"] == 0.98  # 10 / 10.1948
    for elsewhere in (roofline.fields(cost, 10e-6, "cpu"), roofline.fields(cost, 10e-6), roofline.fields(cost)):
        assert "measured_over_roofline" not in elsewhere and elsewhere["bytes"] == 34_152_448
