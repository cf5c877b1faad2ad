"""sparsekv.testing.backends.to_device moves arguments as the views they are: a bad-input test of a
strided or aliased argument must hand the GPU the same strided or aliased argument."""

from __future__ import annotations

import torch

from sparsekv.testing.backends import core_backends, kernel_backends, to_device

META = torch.device("meta")  # another device, on any machine


def test_views_keep_their_sizes_strides_offsets_and_dtype():
    cases = [torch.zeros(3, 4, 2, dtype=torch.int32)[..., 0], torch.arange(4)[::2],
             torch.zeros(4, 6, dtype=torch.uint8).view(torch.int16), torch.arange(12.0).view(3, 4).t(),
             torch.arange(10, dtype=torch.int32)[3:8]]
    for before, after in zip(cases, to_device(META, cases)):
        assert after.device == META and after.dtype == before.dtype
        assert (after.shape, after.stride(), after.storage_offset()) == (
            before.shape, before.stride(), before.storage_offset())
        assert after.is_contiguous() == before.is_contiguous()


def test_views_of_one_buffer_stay_views_of_one_buffer():
    buffer = torch.arange(10, dtype=torch.int32)
    moved = to_device(META, {"a": buffer[:5], "b": buffer[2:7], "other": torch.arange(5, dtype=torch.int32),
                             "scalar": 3})
    assert moved["a"].untyped_storage()._cdata == moved["b"].untyped_storage()._cdata
    assert moved["a"].untyped_storage()._cdata != moved["other"].untyped_storage()._cdata
    assert moved["scalar"] == 3


def test_a_tensor_already_on_the_device_is_passed_as_is():
    base = torch.arange(24, dtype=torch.int64).view(4, 6)
    view = base[1:, ::3]
    (moved,) = to_device(torch.device("cpu"), [view])  # already there: the tensor itself
    assert moved is view


def test_core_tests_run_on_sim_too_unless_the_session_chose_its_backends(monkeypatch):
    # make test (no choice): each family's core property test runs its CUDA path on sim as well;
    # make test-sim / test-gpu / test-sanitize choose theirs, and get exactly those.
    def values(params):
        assert all([mark.name for mark in p.marks] == ["core"] for p in params)  # CI's test-sim leaves them out
        return [p.values[0] for p in params]

    monkeypatch.delenv("SPARSEKV_TEST_BACKENDS", raising=False)
    assert values(core_backends()) == [*kernel_backends(), "sim"]
    for chosen in ("cpu", "sim", "cpu,cuda"):
        monkeypatch.setenv("SPARSEKV_TEST_BACKENDS", chosen)
        assert values(core_backends()) == kernel_backends() == chosen.split(",")
