"""Renamed keywords (``sparsekv.deprecation``): an old keyword warns, naming the old and the new name,
and its value arrives under the new name; both names at once are refused. Every renamed keyword of the
runtime is listed here, so each keeps working until the release that drops it."""

from __future__ import annotations

import inspect
import re
import warnings
from types import SimpleNamespace

import pytest
import torch

from sparsekv.deprecation import renamed_keywords
from sparsekv.kv_layout import V4


@renamed_keywords(top_k="num_top_k", device_buffer_size="hot_buffer_size")
def _swap_in_sizes(rows: int, *, num_top_k: int, hot_buffer_size: int = 8) -> tuple[int, int, int]:
    return rows, num_top_k, hot_buffer_size


def _renames(caught) -> list[tuple[str, str]]:
    """``(old, new)`` of each rename warning caught."""
    return [tuple(re.search(r"argument `(\w+)` of .* is renamed `(\w+)`", str(w.message)).groups()) for w in caught]


def test_an_old_keyword_warns_naming_both_and_its_value_arrives_under_the_new_name():
    with pytest.warns(DeprecationWarning) as caught:
        assert _swap_in_sizes(2, top_k=5, device_buffer_size=9) == (2, 5, 9)
    assert _renames(caught) == [("top_k", "num_top_k"), ("device_buffer_size", "hot_buffer_size")]
    assert "_swap_in_sizes()" in str(caught[0].message)
    assert {w.category for w in caught} == {DeprecationWarning}
    assert caught[0].filename == __file__  # the warning points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names never warn
        assert _swap_in_sizes(2, num_top_k=5) == (2, 5, 8)
    assert list(inspect.signature(_swap_in_sizes).parameters) == ["rows", "num_top_k", "hot_buffer_size"]


def test_both_names_of_one_keyword_are_refused():
    with pytest.raises(TypeError, match="both `top_k` and its new name `num_top_k`"):
        _swap_in_sizes(2, top_k=5, num_top_k=6)


@renamed_keywords(page_size="page_slots", extra_page_size="extra_page_slots")
def _attention_sizes(q: int, page_slots: int, later: int | None = None, *, extra_page_slots: int | None = None,
                     out: int | None = None) -> tuple:
    return q, page_slots, later, extra_page_slots, out


def test_the_wrapper_binds_as_the_function_does():
    # The wrapper takes the function's own parameters by name (a renamed positional one, and those
    # after it, may come by the old keyword instead): defaults arrive, and what Python refuses is
    # refused with Python's words for the function.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _attention_sizes(1, 2, 3, out=4) == (1, 2, 3, None, 4)
        assert _attention_sizes(1, page_slots=2, extra_page_slots=0) == (1, 2, None, 0, None)
    with pytest.warns(DeprecationWarning) as caught:
        assert _attention_sizes(1, page_size=2, extra_page_size=5) == (1, 2, None, 5, None)
    assert _renames(caught) == [("page_size", "page_slots"), ("extra_page_size", "extra_page_slots")]
    with pytest.raises(TypeError, match=r"_attention_sizes\(\) missing 1 required positional argument: 'page_slots'"):
        _attention_sizes(1)
    with pytest.raises(TypeError, match=r"_attention_sizes\(\) got an unexpected keyword argument 'pagesize'"):
        _attention_sizes(1, 2, pagesize=3)
    with pytest.raises(TypeError, match="both `extra_page_size` and its new name `extra_page_slots`"):
        _attention_sizes(1, 2, extra_page_slots=None, extra_page_size=3)  # given, though equal to the default
    with pytest.raises(TypeError, match="both `page_size` and its new name `page_slots`"):
        _attention_sizes(1, 2, page_size=3)
    assert list(inspect.signature(_attention_sizes).parameters) == ["q", "page_slots", "later", "extra_page_slots",
                                                                    "out"]


def test_the_runtime_takes_its_old_keywords_for_one_release():
    from sparsekv.srt.managers import HiSparseCoordinator
    from sparsekv.srt.mem_cache import (
        DeepSeekV4PagedHostPool,
        HiSparseC4DevicePool,
        HiSparseTokenToKVPoolAllocator,
        HostKVCache,
    )
    from sparsekv.srt.model_executor.deployment import model_instances, serving_instances

    allocator = HiSparseTokenToKVPoolAllocator(1024, 256)
    device_pool = HiSparseC4DevicePool(allocator, 1, "cpu")
    table = type("Pool", (), {"req_to_token": torch.zeros(2, 512, dtype=torch.int64)})()
    with pytest.warns(DeprecationWarning) as caught:
        coord = HiSparseCoordinator(table, allocator, device_pool, top_k=5, device_buffer_size=7)
        host = DeepSeekV4PagedHostPool("c4", [torch.zeros(2, V4.page_bytes(32), dtype=torch.uint8)], 2,
                                       slot_page_size=32)
        flash = model_instances("dsv4-flash", hot_buffer=2048)
        old = serving_instances(top_k=512, hot_buffer=1024)
        base = SimpleNamespace()  # what a host pool's super().__init__ sets up
        HostKVCache.__init__(base, layer_num=1, page_size=16, num_pages=2, pin_memory=False)
    assert _renames(caught) == [("top_k", "num_top_k"), ("device_buffer_size", "hot_buffer_size"),
                                ("slot_page_size", "page_slots"), ("hot_buffer", "hot_buffer_size"),
                                ("top_k", "num_top_k"), ("hot_buffer", "hot_buffer_size"), ("page_size", "page_slots")]
    assert {w.filename for w in caught} == {__file__}  # constructors' warnings point at the caller too
    assert (coord.num_top_k, coord.hot_buffer_size, host.page_slots, base.page_slots) == (5, 7, 32, 16)
    assert flash == model_instances("dsv4-flash", hot_buffer_size=2048)
    assert old == serving_instances(num_top_k=512, hot_buffer_size=1024)
    assert ("hisparse", {"num_top_k": 512, "hot_buffer_size": 1024, "layout": "dsv4", "page_slots": 64}) in old


def test_the_store_target_takes_page_size_for_one_release():
    from sparsekv.jit_kernel.dsv4_store import StoreTarget
    from sparsekv.rope import RopeParams

    cache, rope = torch.zeros(1, V4.page_bytes(4), dtype=torch.uint8), RopeParams(1e4).table(8)
    with pytest.warns(DeprecationWarning) as caught:
        target = StoreTarget(cache, torch.ones(512), 1e-6, rope=rope, page_size=4)
    assert _renames(caught) == [("page_size", "page_slots")]
    assert caught[0].filename == __file__
    assert target.page_slots == 4 and target.cache is cache and target.rope is rope


def test_the_attention_backend_takes_top_k_for_one_release():
    # The README's one-rank stack with one window-only layer; the old keyword's value arrives as `num_top_k`.
    from sparsekv.jit_kernel.dsv4 import RopeParams
    from sparsekv.srt.layers import Dsv4AttentionBackend, Dsv4LayerParams
    from sparsekv.srt.mem_cache import DeepSeekV4TokenToKVPool
    from sparsekv.srt.model_executor import DSV4ModelSpec, ServerSpec, plan_pipeline

    spec = DSV4ModelSpec(num_hidden_layers=1, compress_ratios=(0,), context_len=1024)
    rank = plan_pipeline(spec, ServerSpec(page_size=256, max_running_requests=1), 16 << 20).ranks[0]
    pool = DeepSeekV4TokenToKVPool(rank.config, rank.configurator, device="cpu")
    layers = [Dsv4LayerParams(0, torch.zeros(8), torch.ones(512), RopeParams(1e4).table(1024))]
    tables = (256 + torch.arange(1024)).repeat(1, 1)
    with pytest.warns(DeprecationWarning) as caught:
        backend = Dsv4AttentionBackend(pool, layers, tables, tables, top_k=16, window=8)
    assert _renames(caught) == [("top_k", "num_top_k")]
    assert caught[0].filename == __file__
    assert backend.num_top_k == 16
