"""The scalar checks leaf (``sparsekv.checks``): one type rule and one closed range convention for
every layer, the command-line flags' ranges included."""

from __future__ import annotations

import argparse
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.argtypes import int_range
from sparsekv.checks import as_bool, as_float, as_int, describe_range, index_in, int_in, one_of

bounds = st.one_of(st.none(), st.integers(-50, 50))


@given(value=st.integers(-60, 60), lo=bounds, hi=bounds)
def test_a_range_is_closed_at_both_ends_and_a_missing_bound_is_open(value, lo, hi):
    inside = (lo is None or value >= lo) and (hi is None or value <= hi)
    if inside:
        assert int_in(value, "n", lo, hi) == value
    else:
        with pytest.raises(ValueError, match=re.escape(f"argument `n` must be an int {describe_range(lo, hi)}")):
            int_in(value, "n", lo, hi)


@given(value=st.integers(-60, 60), lo=st.integers(-50, 50), hi=bounds)
def test_a_flag_takes_exactly_the_values_the_checks_take(value, lo, hi):
    parse = int_range(lo, hi)
    try:
        int_in(value, "n", lo, hi)
    except ValueError:
        words = re.escape(f"expected an integer {describe_range(lo, hi)}")
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse(str(value))
    else:
        assert parse(str(value)) == value


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), torch.tensor(3), torch.tensor([3], dtype=torch.int16)])
def test_ints_of_every_kind_are_python_ints(value):
    got = as_int(value, "n")
    assert got == 3 and type(got) is int


@pytest.mark.parametrize("value", [True, np.bool_(False), torch.tensor(True), 3.0, 3.7, np.float32(3), "3", None,
                                   torch.tensor(3.0), torch.tensor([1, 2])])
def test_anything_else_is_a_type_error_naming_the_argument(value):
    with pytest.raises(TypeError, match="argument `page_size` must be an int"):
        as_int(value, "page_size")
    with pytest.raises(TypeError, match="argument `page_size` must be an int"):
        int_in(value, "page_size", 0, 10)


def test_the_owner_and_the_reason_are_in_the_message():
    with pytest.raises(ValueError, match=re.escape("sparsekv: hisparse argument `num_top_k` must be an int in "
                                                   "[1, 32767] (int16 slot ids), got 0")):
        int_in(0, "num_top_k", 1, 32767, why="int16 slot ids", owner="hisparse")
    with pytest.raises(ValueError, match=re.escape("sparsekv: gather_rows argument `index_dtype` must be one of "
                                                   "(torch.int32, torch.int64), got torch.float32")):
        one_of(torch.float32, "index_dtype", (torch.int32, torch.int64), owner="gather_rows")


def test_an_index_is_below_its_size_and_never_negative():
    assert index_in(np.int64(4), "row", 5) == 4
    for bad in (5, -1):
        with pytest.raises(IndexError, match=re.escape(f"argument `row` = {bad} is out of range [0, 5)")):
            index_in(bad, "row", 5)


def test_flags_floats_and_choices():
    assert as_bool(False, "reset") is False
    with pytest.raises(TypeError, match="`reset` must be a bool"):
        as_bool(0, "reset")
    assert as_float(np.float32(0.5), "eps") == 0.5 and as_float(2, "eps") == 2.0
    for bad in (True, "0.1", None):
        with pytest.raises(TypeError, match="`eps` must be a real number"):
            as_float(bad, "eps")
    with pytest.raises(ValueError, match="`ratio` must be a finite number >= 0, got nan"):
        as_float(float("nan"), "ratio", finite=True, lo=0)
    with pytest.raises(ValueError, match="`ratio` must be a finite number >= 0, got -0.5"):
        as_float(-0.5, "ratio", finite=True, lo=0)
    assert as_float(float("inf"), "scale") == float("inf")
    with pytest.raises(ValueError, match="`layout` must be one of"):
        one_of(True, "layout", (True, 1))  # a bool is never a choice, even where it compares equal


def _library_int_checks():
    """Library checks of one int argument each, as (name, check(value), a good value, its result, a bad int)."""
    from sparsekv.jit_kernel.hisparse_params import check_block_size
    from sparsekv.jit_kernel.triton.checks import page_shift
    from sparsekv.kv_layout import V4, c4_page_slots
    from sparsekv.rope import RopeParams
    from sparsekv.srt.model_executor import DSV4PoolConfigurator, ParallelSpec, ServerSpec, dsv4_preset
    from sparsekv.srt.model_executor.deployment import serving_instances

    return {
        "page_shift": ("page_slots", lambda v: page_shift(v, "page_slots"), 64, 6, 48),
        "rope_table": ("max_position", lambda v: RopeParams(1e4).table(v).max_position, 8, 8, 0),
        "block_size": ("block_size", lambda v: check_block_size("hisparse", v, 8), 64, 64, 48),
        "page_bytes": ("page_slots", V4.page_bytes, 64, 37_440, 0),
        "c4_page_slots": ("page_size", c4_page_slots, 256, 64, 64),
        "serving_instances": ("page_size", lambda v: serving_instances(num_top_k=8, hot_buffer_size=8,
                                                                        page_size=v)[-1][1]["page_slots"], 256, 64, 64),
        "pool_page_size": ("page_size", lambda v: DSV4PoolConfigurator(
            dsv4_preset("dsv4-flash"), ParallelSpec(), ServerSpec()).calculate_pool_sizes_from_max_tokens(
                1 << 20, v).c4_max_total_num_tokens, 256, 1 << 18, 64),
    }


@pytest.mark.parametrize("check", ["page_shift", "rope_table", "block_size", "page_bytes", "c4_page_slots",
                                   "serving_instances", "pool_page_size"])
def test_every_library_int_check_follows_the_one_rule(check):
    # A float (even a whole one) or a bool is the wrong kind of value: TypeError; a bad int: ValueError.
    name, fn, good, result, bad = _library_int_checks()[check]
    assert fn(good) == result and fn(np.int64(good)) == result
    for wrong in (float(good), True, str(good)):
        with pytest.raises(TypeError, match=f"`{name}` must be an int"):
            fn(wrong)
    with pytest.raises(ValueError, match=f"`{name}`"):
        fn(bad)


def test_library_messages_name_arguments_and_the_cli_names_its_flags():
    from sparsekv.srt.model_executor.deployment import model_instances

    with pytest.raises(ValueError, match=re.escape("argument `hot_buffer_size` must be >= the model's index top-k "
                                                   "(512), got 8")) as hot:
        model_instances("dsv4-flash", hot_buffer_size=8)
    with pytest.raises(ValueError, match=re.escape("`page_size` must be one of (128, 256, 512), got 3")) as page:
        model_instances("dsv4-flash", page_size=3)
    assert "--" not in str(hot.value) + str(page.value)
