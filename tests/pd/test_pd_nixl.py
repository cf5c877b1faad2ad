"""What only the NIXL backend has: its own argument checks (the engine contract, every engine's
sessions, is ``test_pd_engines.py``)."""

from __future__ import annotations

import pytest

from sparsekv.testing.components import needs_engine

pytestmark = needs_engine("nixl")  # the only reason these tests may skip (CI: fail)


def test_negative_progress_delay_is_refused():
    from sparsekv.srt.disaggregation.nixl_backend import NixlBackend

    with pytest.raises(ValueError, match="progress_delay_us"):
        NixlBackend(progress_delay_us=-1)
