"""The Python layout mirror agrees with the C++ header, holds the reference numbers, and its views
address the right bytes without copying."""

from __future__ import annotations

import subprocess

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekv import kv_layout
from sparsekv.jit_kernel.build.loader import csrc_root
from sparsekv.jit_kernel.build.toolchain import host_compiler

pytestmark = pytest.mark.no_backend("byte layouts, in Python and in the C++ header: no kernel runs")

PAGE_SLOTS = (1, 2, 32, 63, 64, 128, 256)


def test_reference_numbers():
    v4 = kv_layout.V4
    assert v4.bytes_per_token == 584
    assert v4.page_bytes(64) == 37_440 and v4.scale_offset(0, 64) == 36_864 and v4.padding_offset(64) == 37_376
    assert v4.page_bytes(256) == 149_760 and v4.page_bytes(2) == 1_728
    assert kv_layout.V41.bytes_per_token == 528 and kv_layout.V41_FP4.bytes_per_token == 288
    assert kv_layout.INDEXER_FP8.bytes_per_token == 132 and kv_layout.INDEXER_FP8.page_bytes(64) == 8_448
    assert kv_layout.INDEXER_FP4.bytes_per_token == 68 and kv_layout.INDEXER_FP4.page_bytes(64) == 4_352


@pytest.mark.parametrize("layout", kv_layout.LAYOUTS.values(), ids=kv_layout.LAYOUTS)
def test_page_geometry_invariants(layout):
    for p in PAGE_SLOTS:
        pb = layout.page_bytes(p)
        assert pb % layout.page_align == 0
        assert layout.padding_offset(p) <= pb < layout.padding_offset(p) + layout.page_align
        # Records tile the page without overlap: last value ends where the scales begin.
        assert layout.value_offset(p - 1) + layout.value_bytes == layout.scale_offset(0, p)
        assert layout.scale_offset(p - 1, p) + layout.scale_bytes == layout.padding_offset(p)


def test_cpp_header_agrees_with_python(tmp_path):
    """Generate static_asserts from the Python mirror and let the host compiler check them."""
    lines = ['#include "sparsekv/kv_layout.h"', "using namespace sparsekv::kv_layout;",
             f"static_assert(kMaxPageSlots == {kv_layout.MAX_PAGE_SLOTS});"]
    for layout in kv_layout.LAYOUTS.values():
        t = layout.cpp_name
        # Outside [1, kMaxPageSlots] no page exists: the C++ size is -1 (a 2^62-slot page once wrapped to 0).
        lines += [f"static_assert({t}::page_bytes({p}) == -1);" for p in (0, -1, kv_layout.MAX_PAGE_SLOTS + 1, 2**62)]
        lines += [
            f"static_assert({t}::kValueBytes == {layout.value_bytes});",
            f"static_assert({t}::kScaleBytes == {layout.scale_bytes});",
            f"static_assert({t}::kBytesPerToken == {layout.bytes_per_token});",
            f"static_assert({t}::kPageAlign == {layout.page_align});",
        ]
        for p in PAGE_SLOTS:
            lines += [
                f"static_assert({t}::page_bytes({p}) == {layout.page_bytes(p)});",
                f"static_assert(PagedKV<{t}, {p}>::kPageBytes == {layout.page_bytes(p)});",
                f"static_assert(PagedKV<{t}, {p}>::kScaleBase == {layout.scale_offset(0, p)});",
            ]
            for s in sorted({0, 1, p // 2, p - 1}):
                lines += [
                    f"static_assert({t}::value_offset({s}) == {layout.value_offset(s)});",
                    f"static_assert({t}::scale_offset({s}, {p}) == {layout.scale_offset(s, p)});",
                ]
    source = tmp_path / "agree.cpp"
    source.write_text("\n".join(lines) + "\n")
    root = csrc_root()
    cmd = [host_compiler(None).path, "-std=c++17", "-fsyntax-only", f"-I{root / 'include'}", str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("page_slots, error", [(0, ValueError), (kv_layout.MAX_PAGE_SLOTS + 1, ValueError),
                                               (2**62, ValueError), (64.0, TypeError), (True, TypeError)])
def test_page_bytes_refuses_a_page_no_kernel_takes(page_slots, error):
    # sparsekv.checks' rule: the wrong kind of value (a float, a bool) is a TypeError, a bad int a ValueError.
    assert kv_layout.V4.padding_offset(kv_layout.MAX_PAGE_SLOTS) == 584 * 2**20 <= kv_layout.V4.page_bytes(2**20)
    with pytest.raises(error, match="`page_slots`"):
        kv_layout.V4.page_bytes(page_slots)


@pytest.mark.parametrize("page_size, error", [(256.0, TypeError), (True, TypeError), ("256", TypeError),
                                              (64, ValueError), (1024, ValueError)])
def test_c4_page_slots_takes_a_dsv4_page_size_only(page_size, error):
    assert [kv_layout.c4_page_slots(p) for p in kv_layout.DSV4_PAGE_SIZES] == [32, 64, 128]
    with pytest.raises(error, match="`page_size`"):
        kv_layout.c4_page_slots(page_size)


@given(layout=st.sampled_from(list(kv_layout.LAYOUTS.values())), page_slots=st.sampled_from([1, 2, 8, 64]),
       num_pages=st.integers(1, 3), slot=st.data(), row_pad=st.integers(0, 40))
def test_views_address_the_documented_bytes(layout, page_slots, num_pages, slot, row_pad):
    pb = layout.page_bytes(page_slots)
    # A page buffer with a row stride wider than the page (a column slice of a wider buffer).
    wide = torch.zeros(num_pages, pb + row_pad, dtype=torch.uint8)
    pages = wide[:, :pb]
    page = slot.draw(st.integers(0, num_pages - 1))
    s = slot.draw(st.integers(0, page_slots - 1))
    values = layout.value_view(pages, page_slots)
    scales = layout.scale_view(pages, page_slots)
    assert values.shape == (num_pages, page_slots, layout.value_bytes)
    assert scales.shape == (num_pages, page_slots, layout.scale_bytes)
    values[page, s] = 1
    scales[page, s] = 2
    row = wide[page]
    vo, so = layout.value_offset(s), layout.scale_offset(s, page_slots)
    assert torch.all(row[vo : vo + layout.value_bytes] == 1)
    assert torch.all(row[so : so + layout.scale_bytes] == 2)
    assert int(wide.sum()) == layout.value_bytes + 2 * layout.scale_bytes  # nothing else written


def test_view_errors_name_the_argument():
    v4 = kv_layout.V4
    with pytest.raises(TypeError, match="`pages`"):
        v4.value_view(torch.zeros(1, 37_440, dtype=torch.int8), 64)
    with pytest.raises(ValueError, match="`pages`"):
        v4.scale_view(torch.zeros(1, 37_439, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="`pages`"):
        v4.value_view(torch.zeros(1, 2 * 37_440, dtype=torch.uint8)[:, ::2], 64)
    with pytest.raises(ValueError, match="`page_slots`"):
        v4.page_bytes(0)
