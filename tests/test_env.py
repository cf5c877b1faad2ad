"""The environment table (``sparsekv.env``): its cheap read of a variable says what ``os.environ`` says."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparsekv import env

NAME = "SPARSEKV_TEST_ENV_READ"
# What an environment value can hold: no NUL; surrogates stand for undecodable bytes (surrogateescape).
values = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=12)


@given(value=st.none() | values)
def test_a_read_is_what_os_environ_holds_set_or_unset(value):
    before = os.environ.pop(NAME, None)
    try:
        if value is not None:
            os.environ[NAME] = value
        assert env._read(NAME) == os.environ.get(NAME, "")
        assert env._read(NAME) == ("" if value is None else value)
    finally:
        os.environ.pop(NAME, None)
        if before is not None:
            os.environ[NAME] = before


def test_the_cpu_backend_and_a_flag_follow_changes_between_calls(monkeypatch):
    monkeypatch.delenv("SPARSEKV_CPU_BACKEND", raising=False)
    monkeypatch.delenv("SPARSEKV_CHECK_INDICES", raising=False)
    assert (env.cpu_backend(), env.check_indices()) == ("cpu", False)
    monkeypatch.setenv("SPARSEKV_CPU_BACKEND", " sim ")
    monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "On")
    assert (env.cpu_backend(), env.check_indices()) == ("sim", True)
    monkeypatch.setenv("SPARSEKV_CPU_BACKEND", "gpu")
    with pytest.raises(ValueError, match="SPARSEKV_CPU_BACKEND must be one of"):
        env.cpu_backend()
