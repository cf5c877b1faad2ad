"""The input contract of every DSV4 kernel entry (csrc/include/sparsekv/ffi.h), across the families.

Each host entry of dsv4_quant, dsv4_indexer, dsv4_attention, dsv4_store, dsv4_compress and dsv4_compress_store is called
directly on its module, so the caller-owned outputs the wrappers allocate are covered too:

* aliasing: a property test draws, for every entry, a written argument and any other tensor
  argument and lays the two over one buffer; the call must refuse naming both and write nothing;
  a written argument that overlaps itself (``expand``) is refused;
* page sizes: every entry bounds ``page_slots`` (2^20) before any size product;
* scalars at the public wrappers (meta tensors through the ops' fake implementations), the int32
  slot wrap, the int64 position edge, allocation only after validation, NaN carried through attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4 import (
    RopeParams,
    StoreTarget,
    dequantize_fp8_ds_mla,
    indexer_scores,
    indexer_topk,
    norm_rope_store,
    quantize_fp8_ds_mla,
    quantize_indexer_keys,
    sparse_decode_attention,
)
from sparsekv.jit_kernel.dsv4_attention import ATTENTION
from sparsekv.jit_kernel.dsv4_compress import DSV4_COMPRESS
from sparsekv.jit_kernel.dsv4_compress_store import DSV4_COMPRESS_STORE
from sparsekv.jit_kernel.dsv4_indexer import INDEXER, INDEXER_TOPK, lightning_indexer, visible_entries
from sparsekv.jit_kernel.dsv4_quant import DSV4_QUANT
from sparsekv.jit_kernel.dsv4_store import DSV4_STORE
from sparsekv.kv_layout import INDEXER_FP4, INDEXER_FP8, MAX_PAGE_SLOTS, V4
from sparsekv.srt.mem_cache.compressor_state import CompressorState
from sparsekv.testing.backends import device_of

PAGE = 4


@dataclass
class Entry:
    """One host entry: its module function, its arguments in order (named as the entry names them in
    its errors), and which tensors it writes."""

    call: Callable[[], Callable]
    args: dict
    written: tuple[str, ...]

    def run(self, args: dict) -> None:
        self.call()(*args.values())

    def tensors(self) -> list[str]:
        return [k for k, v in self.args.items() if isinstance(v, torch.Tensor)]


def _i64(*values):
    return torch.tensor(values, dtype=torch.int64)


def _i32(rows):
    return torch.tensor(rows, dtype=torch.int32)


def _entries(device: torch.device) -> dict[str, Entry]:
    """Small valid arguments for every entry (the calls succeed as given)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    backend = "cuda" if device.type == "cuda" else "cpu"
    v4_cache = torch.zeros(2, V4.page_bytes(PAGE), dtype=torch.uint8)
    idx_cache = torch.zeros(2, INDEXER_FP8.page_bytes(PAGE), dtype=torch.uint8)
    table = RopeParams(1e4).table(16)
    entries = {
        "quantize_fp8_ds_mla": Entry(lambda: DSV4_QUANT.module(backend=backend).quantize_fp8_ds_mla,
                                     dict(x=rand(2, 512), cache=v4_cache.clone(), slots=_i64(0, 5), page_slots=PAGE),
                                     ("cache",)),
        "dequantize_fp8_ds_mla": Entry(lambda: DSV4_QUANT.module(backend=backend).dequantize_fp8_ds_mla,
                                       dict(cache=v4_cache.clone(), slots=_i64(0, 5), page_slots=PAGE,
                                            out=torch.zeros(2, 512)), ("out",)),
        "quantize_indexer_fp8": Entry(lambda: DSV4_QUANT.module(backend=backend).quantize_indexer_fp8,
                                      dict(x=rand(2, 128), cache=idx_cache.clone(), slots=_i64(0, 5), page_slots=PAGE),
                                      ("cache",)),
        "quantize_indexer_fp4": Entry(lambda: DSV4_QUANT.module(backend=backend).quantize_indexer_fp4,
                                      dict(x=rand(2, 128), cache=torch.zeros(2, INDEXER_FP4.page_bytes(PAGE),
                                                                             dtype=torch.uint8),
                                           slots=_i64(0, 5), page_slots=PAGE), ("cache",)),
        "indexer_scores": Entry(lambda: INDEXER.module(layout="fp8", q_dtype=torch.float32,
                                                       backend=backend).indexer_scores,
                                dict(q=rand(2, 2, 128), weights=rand(2, 2), k_cache=idx_cache.clone(),
                                     page_table=_i32([[0, 1], [1, 0]]), positions=_i64(31, 15), page_slots=PAGE,
                                     out=torch.zeros(2, 8)), ("out",)),
        "indexer_topk": Entry(lambda: INDEXER_TOPK.module(backend=backend).indexer_topk,
                              dict(scores=rand(2, 8), positions=_i64(31, 15), out=torch.zeros(2, 3, dtype=torch.int32),
                                   page_table=_i32([[0, 1], [1, 0]]), out_slots=torch.zeros(2, 3, dtype=torch.int32),
                                   page_slots=PAGE, workspace=None), ("out", "out_slots")),
        "sparse_decode_attention": Entry(
            lambda: ATTENTION.module(q_dtype=torch.float32, backend=backend).sparse_decode_attention,
            dict(q=rand(2, 2, 512), kv_cache=v4_cache.clone(), indices=_i32([[0, 5, -1], [1, 1, 2]]),
                 sink=torch.zeros(2), page_slots=PAGE, softmax_scale=0.05, extra_kv_cache=v4_cache[:1].clone(),
                 extra_indices=_i32([[0, -1], [3, 2]]), extra_page_slots=PAGE, out=torch.zeros(2, 2, 512),
                 lse=torch.zeros(2, 2), part_out=torch.zeros(2, 2, 2, 512), part_lse=torch.zeros(2, 2, 2),
                 part_arrivals=torch.zeros(2, 1, 2, dtype=torch.int32), num_splits=2, topk_length=_i32([3, 2])),
            ("out", "lse", "part_out", "part_lse", "part_arrivals")),
        "norm_rope_store": Entry(lambda: DSV4_STORE.module(cache_kind="V4", backend=backend).norm_rope_store,
                                 dict(x=rand(2, 512), weight=torch.ones(512), eps=1e-6, positions=_i64(0, 4),
                                      cache=v4_cache.clone(), slots=_i64(1, 6), page_slots=PAGE,
                                      rope_cos=table.cos.clone(), rope_sin=table.sin.clone()), ("cache",)),
        # C4 over d = 128 (the indexer cache): one entry from kv rows 0-3, two ring writes.
        "compress_store": Entry(lambda: DSV4_COMPRESS_STORE.module(cache_kind="INDEXER_FP8",
                                                                   backend=backend).compress_store,
                                dict(kv=rand(4, 256), score=rand(4, 256), ape=rand(4, 256), ratio=4,
                                     state=torch.zeros(8, 512), sources=_i64(-1, -1, -1, -1, 0, 1, 2, 3)[None],
                                     writes=_i64(0, 0, 1, 1).reshape(2, 2), weight=torch.ones(128), eps=1e-6,
                                     positions=_i64(0), cache=idx_cache.clone(), slots=_i64(2), page_slots=PAGE,
                                     rope_cos=table.cos.clone(), rope_sin=table.sin.clone(), num_threads=2),
                                ("state", "cache")),
        "compress_pool": Entry(lambda: DSV4_COMPRESS.module(backend=backend).compress_pool,
                               dict(kv=rand(8, 32), score=rand(8, 32), ape=rand(4, 32), ratio=4,
                                    out=torch.zeros(2, 16), num_threads=2), ("out",)),
        "compress_extend": Entry(lambda: DSV4_COMPRESS.module(backend=backend).compress_extend,
                                 dict(kv=rand(4, 32), score=rand(4, 32), ape=rand(4, 32), ratio=4,
                                      state=torch.zeros(8, 64), sources=_i64(-1, -1, -1, -1, 0, 1, 2, 3)[None],
                                      writes=_i64(0, 0, 1, 1).reshape(2, 2), out=torch.zeros(1, 16), num_threads=2),
                                 ("state", "out")),
        "compress_decode": Entry(lambda: DSV4_COMPRESS.module(backend=backend).compress_decode,
                                 dict(kv=rand(2, 32), score=rand(2, 32), ape=rand(4, 32), ratio=4,
                                      state=torch.zeros(16, 64), state_rows=torch.arange(16).reshape(2, 8),
                                      positions=_i64(3, 9), out=torch.zeros(2, 16),
                                      emitted=torch.zeros(2, dtype=torch.bool)), ("state", "out", "emitted")),
        "compress_decode_store": Entry(
            lambda: DSV4_COMPRESS_STORE.module(cache_kind="INDEXER_FP8", backend=backend).compress_decode_store,
            dict(kv=rand(2, 256), score=rand(2, 256), ape=rand(4, 256), ratio=4, state=torch.zeros(16, 512),
                 state_rows=torch.arange(16).reshape(2, 8), positions=_i64(3, 9), out=torch.zeros(2, 128),
                 emitted=torch.zeros(2, dtype=torch.bool), weight=torch.ones(128), eps=1e-6, cache=idx_cache.clone(),
                 slots=_i64(2, 5), page_slots=PAGE, rope_cos=table.cos.clone(), rope_sin=table.sin.clone()),
            ("state", "out", "emitted", "cache")),
        "compress_online_c128": Entry(lambda: DSV4_COMPRESS.module(backend=backend).compress_online_c128,
                                      dict(kv=rand(4, 16), score=rand(4, 16), ape=rand(128, 16),
                                           state=torch.zeros(4, 32), snapshots=2,
                                           segments=_i64(0, 0, 4, -1, -1, 0, 1)[None], out=torch.zeros(1, 16)),
                                      ("state", "out")),
    }
    for entry in entries.values():
        entry.args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in entry.args.items()}
    return entries


ENTRY_NAMES = list(_entries(torch.device("cpu")))
WRITTEN = [(name, w) for name, e in _entries(torch.device("cpu")).items() for w in e.written]


@pytest.mark.parametrize("name", ENTRY_NAMES)
def test_every_entry_runs_on_its_valid_arguments(backend, name):
    # The baseline the refusals below are measured against: the same arguments, unaliased, succeed.
    entry = _entries(device_of(backend))[name]
    entry.run(entry.args)


def _overlaid(a: torch.Tensor, b: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies of ``a`` and ``b`` in one byte buffer, ``b`` starting ``shift`` bytes after ``a`` (which may be
    negative): the two share memory. ``b``'s values win where they overlap."""
    na, nb = a.numel() * a.element_size(), b.numel() * b.element_size()
    start_a, start_b = max(0, -shift), max(0, shift)
    buffer = torch.zeros(max(start_a + na, start_b + nb), dtype=torch.uint8, device=a.device)
    view_a = buffer[start_a:start_a + na].view(a.dtype).view(a.shape)
    view_b = buffer[start_b:start_b + nb].view(b.dtype).view(b.shape)
    view_a.copy_(a)
    view_b.copy_(b)
    return buffer, view_a, view_b


@settings(deadline=None)  # the active profile's count (--slow: deep)
@given(data=st.data())
@example(data=None)  # the listed instance: indexer_topk's `out` over `scores` (a -1 where 3 belonged)
def test_a_written_argument_sharing_memory_with_any_other_is_refused_and_nothing_is_written(backend, data):
    entries = _entries(device_of(backend))
    if data is None:
        name, written, other, step = "indexer_topk", "out", "scores", 0
    else:
        name, written = data.draw(st.sampled_from(WRITTEN))
        other = data.draw(st.sampled_from([t for t in entries[name].tensors() if t != written]))
    entry = entries[name]
    a, b = entry.args[written], entry.args[other]
    na, nb = a.numel() * a.element_size(), b.numel() * b.element_size()
    if data is not None:  # b starts anywhere from just before a's first byte to a's last one (8-byte aligned)
        step = data.draw(st.integers(-((nb - 1) // 8), (na - 1) // 8))
    buffer, view_a, view_b = _overlaid(a, b, 8 * step)
    args = dict(entry.args, **{written: view_a, other: view_b})
    others = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and k not in (written, other)}
    before = buffer.clone()
    with pytest.raises(ValueError, match="must not share memory") as info:
        entry.run(args)
    assert f"`{written}`" in str(info.value) and f"`{other}`" in str(info.value)
    assert torch.equal(buffer, before)
    for k, v in others.items():
        assert torch.equal(args[k], v), k


@pytest.mark.parametrize("name, written", WRITTEN)
def test_a_written_argument_that_overlaps_itself_is_refused(backend, name, written):
    entry = _entries(device_of(backend))[name]
    target = entry.args[written]
    dim = next(d for d in range(target.dim()) if target.shape[d] > 1)
    one = target.narrow(dim, 0, 1)
    before = one.clone()
    args = dict(entry.args, **{written: one.expand(target.shape)})  # stride 0: many indices, one element
    with pytest.raises(ValueError, match=f"`{written}` is written but its elements overlap"):
        entry.run(args)
    assert torch.equal(one, before)


def test_wrapper_outputs_made_with_expand_are_refused(backend):
    device = device_of(backend)
    cache = torch.zeros(1, V4.page_bytes(PAGE), dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="`cache` is written"):
        quantize_fp8_ds_mla(torch.randn(2, 512, device=device), cache.expand(3, -1), _i64(0, 1).to(device), PAGE)
    entries = _entries(device)["indexer_scores"].args
    out = torch.zeros(1, 8, device=device)
    with pytest.raises(ValueError, match="`out` is written"):
        indexer_scores(entries["q"], entries["weights"], entries["k_cache"], entries["page_table"],
                       entries["positions"], page_slots=PAGE, out=out.expand(2, 8))
    assert not out.any()


PAGE_SIZE_ARGS = [(name, arg) for name, e in _entries(torch.device("cpu")).items()
                  for arg in ("page_slots", "extra_page_slots") if arg in e.args]


@pytest.mark.parametrize("name, arg", PAGE_SIZE_ARGS)
@pytest.mark.parametrize("page_slots", [2**62, 2**21, MAX_PAGE_SLOTS * 2, 0, 3])
def test_every_entry_bounds_its_page_slots(backend, name, arg, page_slots):
    entry = _entries(device_of(backend))[name]
    before = {k: v.clone() for k, v in entry.args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=f"`{arg}` must be a power of two in \\[1, 2\\^20\\]"):
        entry.run(dict(entry.args, **{arg: page_slots}))
    for k, v in before.items():
        assert torch.equal(entry.args[k], v), k


@pytest.mark.parametrize("call", [
    # The listed crash: page_bytes(2^62) wrapped to 0, so a [pages, 0] cache passed and the kernel read wild memory.
    lambda d: dequantize_fp8_ds_mla(torch.zeros(1, 0, dtype=torch.uint8, device=d), _i64(5).to(d), 2**62),
    lambda d: quantize_fp8_ds_mla(torch.zeros(1, 512, device=d), torch.zeros(1, 0, dtype=torch.uint8, device=d),
                                  _i64(5).to(d), 2**62),
    lambda d: norm_rope_store(torch.zeros(1, 512, device=d), torch.ones(512, device=d), 1e-6, _i64(0).to(d),
                              torch.zeros(1, 0, dtype=torch.uint8, device=d), _i64(5).to(d), 2**62,
                              RopeParams(1e4).table(1, d)),
], ids=["dequantize", "quantize", "norm_rope_store"])
def test_a_page_slots_whose_page_bytes_overflow_is_refused(backend, call):
    with pytest.raises(ValueError, match="`page_slots`"):
        call(device_of(backend))


def test_topk_refuses_a_page_whose_slots_overflow_int32(backend, index_checks):
    device = device_of(backend)
    scores = torch.arange(8, dtype=torch.float32, device=device)[None]
    for page in (2**26 + 3, 2**25):  # slot 2^32 + 195 wrapped onto page 3; 2^31 + 7 wrapped negative
        table = _i32([[page, 1]]).to(device)
        out = torch.full((1, 2), 7, dtype=torch.int32, device=device)
        with pytest.raises(IndexError, match="`page_table`\\[0, 0\\].*slots fit int32"):
            indexer_topk(scores, _i64(31).to(device), 2, page_table=table, page_slots=64, out=out)
        assert bool((out == 7).all())
    # The last page whose slots all fit still works, and its slots are exact.
    last = 2**31 // 64 - 1
    tokens, slots = indexer_topk(scores, _i64(31).to(device), 2, page_table=_i32([[last, 1]]).to(device),
                                 page_slots=64)
    assert sorted(slots.cpu().tolist()[0]) == [last * 64 + 6, last * 64 + 7]


@given(page=st.integers(0, 2**31 - 1), page_shift=st.integers(0, 20), offset=st.integers(0, 2**20 - 1))
# index_checks only sets an environment variable, the same for every example.
@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_topk_slots_are_exact_or_refused(backend, index_checks, page, page_shift, offset):
    # Every slot the top-k returns is page * P + offset exactly; a page whose slots leave int32 is refused.
    device, p = device_of(backend), 1 << page_shift
    offset %= p
    scores = torch.full((1, offset + 1), -1.0, device=device)
    scores[0, offset] = 1.0
    positions = _i64(4 * (offset + 1) - 1).to(device)  # sees exactly offset + 1 entries
    table = _i32([[page]]).to(device)
    if (page + 1) * p > 2**31:
        with pytest.raises(IndexError, match="`page_table`"):
            indexer_topk(scores, positions, 1, page_table=table, page_slots=p)
    else:
        _, slots = indexer_topk(scores, positions, 1, page_table=table, page_slots=p)
        assert int(slots[0, 0]) == page * p + offset


def test_the_largest_int64_position_is_not_an_overflow(backend, index_checks):
    # (t + 1) // 4 at t = 2^63 - 1 wrapped to a negative count (0 visible), so the call was accepted.
    device = device_of(backend)
    t = torch.tensor([2**63 - 1, 2**63 - 2, 2**63 - 4, 2**62, -5, 2], dtype=torch.int64)
    assert visible_entries(t).tolist() == [2**61, 2**61 - 1, 2**61 - 1, 2**60, 0, 0]
    args = _entries(device)["indexer_topk"].args
    with pytest.raises(ValueError, match="`page_table`.*sees 2305843009213693952 entries"):
        indexer_topk(args["scores"], _i64(2**63 - 1, 15).to(device), 3, page_table=args["page_table"],
                     page_slots=PAGE)
    with pytest.raises(ValueError, match="`page_table`.*sees 2305843009213693952 entries"):
        e = _entries(device)["indexer_scores"].args
        indexer_scores(e["q"], e["weights"], e["k_cache"], e["page_table"], _i64(2**63 - 1, 15).to(device),
                       page_slots=PAGE)


def _wrapper_calls(device):
    """Each public wrapper with valid arguments, as (call(**overrides), the arguments)."""
    e = _entries(device)
    q, kv = e["quantize_fp8_ds_mla"].args, e["sparse_decode_attention"].args
    qi = e["quantize_indexer_fp8"].args
    ix, tk, st_ = e["indexer_scores"].args, e["indexer_topk"].args, e["norm_rope_store"].args
    return {
        "quantize": (quantize_fp8_ds_mla, dict(x=q["x"], cache=q["cache"], slots=q["slots"], page_slots=PAGE)),
        "dequantize": (dequantize_fp8_ds_mla, dict(cache=q["cache"], slots=q["slots"], page_slots=PAGE)),
        "quantize_indexer_keys": (quantize_indexer_keys, dict(keys=qi["x"], cache=qi["cache"], slots=qi["slots"],
                                                              page_slots=PAGE, fmt="fp8")),
        "attention": (sparse_decode_attention, dict(q=kv["q"], kv_cache=kv["kv_cache"], indices=kv["indices"],
                                                    sink=kv["sink"], page_slots=PAGE)),
        "indexer_scores": (indexer_scores, dict(q=ix["q"], weights=ix["weights"], k_cache=ix["k_cache"],
                                                page_table=ix["page_table"], positions=ix["positions"],
                                                page_slots=PAGE)),
        "indexer_topk": (indexer_topk, dict(scores=tk["scores"], positions=tk["positions"], num_top_k=3,
                                            page_table=tk["page_table"], page_slots=PAGE)),
        "norm_rope_store": (norm_rope_store, dict(x=st_["x"], weight=st_["weight"], eps=1e-6,
                                                  positions=st_["positions"], cache=st_["cache"], slots=st_["slots"],
                                                  page_slots=PAGE, rope=RopeParams(1e4).table(64, device))),
    }


BAD_SCALARS = [
    ("quantize", "page_slots", 64.7), ("quantize", "page_slots", "4"), ("quantize", "page_slots", True),
    ("dequantize", "page_slots", 4.0), ("attention", "page_slots", "4"), ("attention", "page_slots", True),
    ("attention", "softmax_scale", "0.1"), ("attention", "softmax_scale", True), ("attention", "num_splits", True),
    ("attention", "num_splits", 1.0), ("indexer_scores", "page_slots", 4.5), ("indexer_topk", "page_slots", "4"),
    ("indexer_topk", "num_top_k", 3.0), ("indexer_topk", "num_top_k", True), ("norm_rope_store", "eps", "1e-6"),
    ("norm_rope_store", "page_slots", True), ("norm_rope_store", "eps", True),
    ("quantize_indexer_keys", "page_slots", 4.0), ("quantize_indexer_keys", "page_slots", True),
    ("quantize_indexer_keys", "fmt", 8),
]


@pytest.mark.parametrize("wrapper, arg, value", BAD_SCALARS)
def test_a_scalar_of_the_wrong_type_is_refused_naming_it(backend, wrapper, arg, value):
    fn, args = _wrapper_calls(device_of(backend))[wrapper]
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(TypeError, match=f"`{arg}` must be"):
        fn(**dict(args, **{arg: value}))
    for k, v in before.items():
        assert torch.equal(args[k], v), k


@pytest.mark.parametrize("value", [np.int64(3), np.int32(3)])
def test_numpy_ints_are_ints(backend, value):
    fn, args = _wrapper_calls(device_of(backend))["indexer_topk"]
    tokens, slots = fn(**dict(args, num_top_k=value, page_slots=np.int64(PAGE)))
    expected = fn(**args)
    assert torch.equal(tokens, expected[0]) and torch.equal(slots, expected[1])


#: Each renamed keyword of the kernel wrappers (``sparsekv.deprecation``): ``page_size`` was slots per
#: page (now ``page_slots``; ``page_size`` is tokens per full page only), ``top_k`` the indexer's top-k.
RENAMED = [("quantize", "page_size"), ("dequantize", "page_size"), ("quantize_indexer_keys", "page_size"),
           ("attention", "page_size"), ("attention", "extra_page_size"), ("indexer_scores", "page_size"),
           ("indexer_topk", "page_size"), ("indexer_topk", "top_k"), ("lightning_indexer", "page_size"),
           ("lightning_indexer", "top_k"), ("norm_rope_store", "page_size")]
NEW_NAMES = {"page_size": "page_slots", "extra_page_size": "extra_page_slots", "top_k": "num_top_k"}


def _tensors(returned) -> list[torch.Tensor]:
    """The tensors a wrapper returned: one, a tuple of them, or none."""
    if isinstance(returned, torch.Tensor):
        return [returned]
    return [t for t in returned or () if t is not None]


def _renamed_calls(device):
    calls = _wrapper_calls(device)
    fn, args = calls["attention"]
    extra = _entries(device)["sparse_decode_attention"].args
    calls["attention"] = fn, dict(args, extra_kv_cache=extra["extra_kv_cache"], extra_indices=extra["extra_indices"],
                                  extra_page_slots=PAGE)
    ix, tk = calls["indexer_scores"][1], calls["indexer_topk"][1]
    calls["lightning_indexer"] = lightning_indexer, dict(ix, num_top_k=tk["num_top_k"])
    return calls


@pytest.mark.parametrize("wrapper, old", RENAMED)
def test_an_old_kernel_keyword_warns_and_computes_what_the_new_one_does(backend, wrapper, old):
    new = NEW_NAMES[old]
    fn, args = _renamed_calls(device_of(backend))[wrapper]

    def run(**kwargs):  # on fresh copies of the tensors, returning what the call returned and wrote
        kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        returned = fn(**kwargs)
        return returned, [v for v in kwargs.values() if isinstance(v, torch.Tensor)]

    expected = run(**args)
    old_args = {(old if k == new else k): v for k, v in args.items()}
    with pytest.warns(DeprecationWarning, match=f"argument `{old}` of {fn.__name__}\\(\\) is renamed `{new}`"):
        got = run(**old_args)
    flat = [_tensors(returned) + written for returned, written in (got, expected)]
    assert len(flat[0]) == len(flat[1]) > 0
    for a, b in zip(*flat):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match=f"both `{old}` and its new name `{new}`"):
        fn(**args, **{old: args[new]})


@pytest.mark.no_backend("dataclass field checks in Python; no kernel runs")
def test_rope_and_store_target_fields_are_typed():
    with pytest.raises(TypeError, match="`rope.theta`"):
        RopeParams("1e4")
    with pytest.raises(TypeError, match="`rope.original_max_positions`"):
        RopeParams(1e4, 2.0, 4096.5)
    cache = torch.zeros(1, V4.page_bytes(PAGE), dtype=torch.uint8)
    with pytest.raises(TypeError, match="`store.page_slots`"):
        StoreTarget(cache, torch.ones(512), 1e-6, 4.0, RopeParams(1e4).table(8))
    with pytest.raises(TypeError, match="`store.rope`"):
        StoreTarget(cache, torch.ones(512), 1e-6, 4, RopeParams(1e4))  # the parameters, not the table


@pytest.mark.parametrize("wrapper", ["quantize", "dequantize", "attention", "indexer_scores", "indexer_topk",
                                     "norm_rope_store", "quantize_indexer_keys"])
def test_meta_tensors_run_through_the_fake_implementations(backend, wrapper):
    # Custom ops: meta tensors (shapes only) give outputs of the eager shapes, without "Cannot pack tensors on meta".
    fn, args = _wrapper_calls(device_of(backend))[wrapper]
    eager = fn(**args)
    meta = fn(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    eager, meta = (x if isinstance(x, tuple) else (x,) for x in (eager, meta))
    for got, want in zip(meta, eager):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.is_meta and got.shape == want.shape and got.dtype == want.dtype


def test_huge_splits_and_top_k_are_refused_before_anything_is_allocated(backend):
    calls = _wrapper_calls(device_of(backend))
    fn, args = calls["attention"]
    for splits in (2**40, 10**6, 4):  # 10**6 once allocated 2 GB of split workspace first
        with pytest.raises(ValueError, match="`num_splits` must be in \\[1, max\\(1, K \\+ K2\\) = 3\\]"):
            fn(**args, num_splits=splits)
    fn, args = calls["indexer_topk"]
    with pytest.raises(ValueError, match="`num_top_k`"):
        fn(**dict(args, num_top_k=2**40))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_nan_in_q_gives_nan_not_an_empty_row(backend, num_splits):
    fn, args = _wrapper_calls(device_of(backend))["attention"]
    args = dict(args, q=args["q"].clone())
    args["q"][1, 0, 7] = float("nan")
    out, lse = fn(**args, num_splits=num_splits)
    clean_out, clean_lse = fn(**dict(args, q=torch.nan_to_num(args["q"])), num_splits=num_splits)
    assert bool(out[1, 0].isnan().all()) and bool(lse[1, 0].isnan())
    keep = torch.ones(2, 2, dtype=torch.bool)
    keep[1, 0] = False  # every other (b, h) is untouched by the NaN
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])
    # A row with no valid entry is still out = 0, lse = +inf.
    empty_out, empty_lse = fn(**dict(args, indices=torch.full_like(args["indices"], -1)), num_splits=1)
    assert not empty_out[0].any() and bool(torch.isinf(empty_lse[0]).all())


def _compressor(**overrides):
    args = dict(state=torch.zeros(16, 64), ape=torch.randn(4, 32), ratio=4, ring_size=8)
    args.update(overrides)
    return CompressorState(**args)


@pytest.mark.parametrize("overrides, exc, name", [
    (dict(state=torch.zeros(64)), ValueError, "`state`"),
    (dict(state=torch.zeros(16, 48)), ValueError, "`state`"),
    (dict(ape=torch.randn(4, 16)), ValueError, "`ape`"),
    (dict(ring_size=32), ValueError, "`ring_size`.*larger than `state`"),
    (dict(ring_size=8.0), TypeError, "`ring_size`"),
    (dict(ratio=4.0), TypeError, "`ratio`"),
])
@pytest.mark.no_backend("constructor checks in Python, before any kernel runs")
def test_compressor_state_checks_its_arguments_at_construction(overrides, exc, name):
    with pytest.raises(exc, match=name):
        _compressor(**overrides)


def test_compressor_extend_refuses_float_ids_duplicates_and_aliasing(backend):
    device = device_of(backend)
    state = torch.zeros(16, 64, device=device)
    comp = _compressor(state=state, ape=torch.randn(4, 32, device=device))
    kv, score = torch.randn(8, 32, device=device), torch.randn(8, 32, device=device)
    with pytest.raises(TypeError, match="`rings`"):  # ring 1.7 was truncated to ring 1
        comp.extend([7], [[1.7]], [0], kv, score)
    with pytest.raises(TypeError, match="`request_ids`"):
        comp.extend([7.0], [[1]], [0], kv, score)
    with pytest.raises(ValueError, match="`request_ids` names a request twice"):  # 4 entries came back for 8 tokens
        comp.extend([7, 7], [[0], [0]], [0, 4], kv, score, lengths=[4, 4])
    with pytest.raises(ValueError, match="`score`.*must not share memory|must not share memory.*`score`"):
        comp.extend([7], [[0]], [0], kv, state[:8, :32])  # the ring itself as score
    viewing = _compressor(state=state, ape=state[8:12, :32])
    with pytest.raises(ValueError, match="`ape`.*must not share memory|must not share memory.*`ape`"):
        viewing.extend([7], [[0]], [0], kv, score)
    assert not state.any()
    entries, _ = comp.extend([7], [[0]], [0], kv, score)  # the refusals left the request where it was
    assert entries.shape[0] == 2


@pytest.mark.parametrize("wrapper, arg, bad, name", [
    ("quantize_indexer_keys", "keys", lambda t: t.double(), "keys"),      # the entry calls them `x`
    ("quantize_indexer_keys", "keys", lambda t: t[:, :64], "keys"),
    ("indexer_scores", "out", lambda t: t.double(), "out"),               # the entry calls it `scores`
    ("quantize", "cache", lambda t: t[0, 0], "cache"),                    # 0-dim: an IndexError, naming nothing
    ("dequantize", "cache", lambda t: t[0, 0], "cache"),
    ("quantize_indexer_keys", "cache", lambda t: t[0, 0], "cache"),
    ("norm_rope_store", "cache", lambda t: t[0, 0], "cache"),
    ("indexer_scores", "k_cache", lambda t: t[0, 0], "k_cache"),
    ("attention", "kv_cache", lambda t: t[0, 0], "kv_cache"),
])
def test_a_refusal_names_the_argument_the_caller_passed(backend, wrapper, arg, bad, name):
    fn, args = _wrapper_calls(device_of(backend))[wrapper]
    if arg == "out":
        args = dict(args, out=torch.zeros(args["page_table"].shape[0], 64, device=args["q"].device))
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises((TypeError, ValueError), match=f"argument `{name}`"):
        fn(**dict(args, **{arg: bad(args[arg])}))
    for k, v in before.items():
        assert torch.equal(args[k], v), k


def test_lightning_indexer_names_its_scores_buffer_scores(backend):
    fn, args = _wrapper_calls(device_of(backend))["indexer_scores"]
    scores = torch.zeros(args["page_table"].shape[0], 64, dtype=torch.float64, device=args["q"].device)
    with pytest.raises(TypeError, match="argument `scores` must have dtype float32"):
        lightning_indexer(args["q"], args["weights"], args["k_cache"], args["page_table"], args["positions"], 2,
                          page_slots=args["page_slots"], scores=scores)
    assert bool((scores == 0).all())

