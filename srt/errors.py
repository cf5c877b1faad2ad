"""The runtime's lifecycle error: a request used out of order.

Argument errors are ``TypeError`` (wrong kind), ``ValueError`` (bad value) and ``IndexError`` (an
index outside its table), each naming the argument. A call that is well formed but wrong for the
request's current phase (admitted twice, admitted while still staging, finished twice, decoded
before admission, a row nobody admitted) raises :class:`RequestStateError`. Like every rejection of
the runtime classes, it is raised before anything changes: the request keeps its phase and its
pages.

A request row of :class:`~sparsekv.srt.managers.hisparse_coordinator.HiSparseCoordinator` moves
through these phases::

    free --alloc_direct_host_slots--> transfer --admit_request_direct--> decode
    free --admit_request_direct---------------------------------------> decode
    free --admit_request_into_staging--> staging --collect_ready_reqs--> decode
    transfer | staging | decode --request_finished--> free
"""

from __future__ import annotations


class RequestStateError(ValueError):
    """A request-lifecycle call made in the wrong phase (see the module docstring); nothing changed.

    A ``ValueError``, so callers that catch bad input keep working.
    """
