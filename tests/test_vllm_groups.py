"""The layout of the split's compressed specs over vLLM's KV cache groups (`rlkv.vllm_plugin.groups`): vLLM's
grouping rule as rlkv models it, and buckets that keep the mask's saving (the vLLM tier checks the groups
vLLM really builds: tests/vllm_tier/test_sink_window.py)."""

from __future__ import annotations

import math

import pytest

from rlkv.vllm_plugin.groups import KEEP_SAVING, bucket_of_parts, evaluate, plan_groups, vllm_group_size
from rlkv.vllm_plugin.split import HeadSplit


def test_vllms_rule_takes_the_largest_bucket_when_under_one_and_a_half_times_the_smallest():
    assert vllm_group_size([45, 67]) == 67  # 67 < 67.5: the full kind is padded by 22
    assert vllm_group_size([44, 68]) == 44  # 68 >= 66
    assert vllm_group_size([12, 13]) == 13  # vLLM's own example: gpt-oss-20b + eagle


def test_qwen_7b_geometry_at_s06_keeps_the_whole_saving_with_two_compressed_buckets():
    """The padding benchmark's miss (45 full of 112 KV heads: 67% of the ideal saving kept with one bucket)."""
    plain = evaluate(45, (67,))
    assert (plain.group_size, round(plain.saving_kept, 3)) == (67, 0.672)
    plan = plan_groups(45, 67)
    assert plan.buckets == (34, 33) and plan.group_size == 45 and plan.groups == 3
    assert plan.saving_kept == 1.0


@pytest.mark.parametrize(
    "full, compressed", [(56, 56), (28, 84), (16, 16), (8, 24), (67, 45), (0, 12), (12, 0)]
)
def test_layouts_vllm_already_groups_without_loss_stay_one_bucket(full, compressed):
    plan = plan_groups(full, compressed)
    assert plan.buckets == ((compressed,) if compressed else ())
    assert plan.saving_kept == 1.0


def test_every_count_keeps_at_least_what_one_bucket_keeps_and_the_target_where_one_bucket_misses_it():
    for full in range(1, 61):
        for compressed in range(1, 61):
            plain, plan = evaluate(full, (compressed,)), plan_groups(full, compressed)
            assert sum(plan.buckets) == compressed and all(b > 0 for b in plan.buckets)
            assert plan.saving_kept >= plain.saving_kept - 1e-12, (full, compressed)
            assert plan.saving_kept >= KEEP_SAVING, (full, compressed, plan)
            # the plan is what vLLM's rule makes of it
            g = vllm_group_size([full, *plan.buckets])
            assert plan.group_size == g
            assert plan.groups == sum(math.ceil(n / g) for n in (full, *plan.buckets))


def test_parts_fill_the_buckets_in_layer_order_and_the_split_assigns_every_compressed_part():
    assert bucket_of_parts(plan_groups(45, 67)) == [0] * 34 + [1] * 33
    # 4 layers x 2 KV heads, 5 full: one compressed bucket would pad the full kind to 6 (67% kept)
    split = HeadSplit(((0, 1), (0,), (0, 1), ()), window=64, sink=16, full_prompt=True)
    buckets = split.compressed_buckets(2)
    assert sorted(buckets) == [(1, 0), (3, 0), (3, 1)]
    assert len(set(buckets.values())) == 2
    windowed = HeadSplit(((0, 1), (0,), (0, 1), ()), window=64, sink=0, full_prompt=False)
    assert set(windowed.compressed_buckets(2).values()) == {0}  # vLLM's own sliding-window spec: no bucket
