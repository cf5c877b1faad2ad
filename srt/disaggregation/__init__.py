"""Prefill/decode (PD) disaggregation: state routing, the transfer engine, rendezvous and admission.

A prefill server computes a request's KV and state and writes them into a decode server's pools;
the pieces, each in its own module:

* :mod:`.kv_args` -- :class:`KVArgs` (what one side registers) and :class:`StateType`;
* :mod:`.state_routing` -- :func:`setup_state_kv_args`, which state components a pool has;
* :mod:`.buffer_layers` -- which layer each registered buffer holds (PP-aligned slicing);
* :mod:`.transfer_plan` -- the generic send as a pure plan of ``(src, dst, len)`` runs;
* :mod:`.manifest` -- the state manifest both sides agree on before any write;
* :mod:`.backend` / :mod:`.nixl_backend` -- the transfer-engine interface and its NIXL implementation;
* :mod:`.bootstrap` -- the rendezvous over a socket and the message framing;
* :mod:`.conn` -- :class:`KVSender` (prefill) and :class:`KVReceiver` (decode);
* :mod:`.hisparse_direct` -- the decode side with HiSparse: C4 KV straight into host memory;
* :mod:`.admission` -- the prefill admission bound (the full pool, never the SWA pool);
* :mod:`.pd_demo` -- ``sparsekv pd-demo``.
"""

from sparsekv._lazy import lazy_getattr

_LAZY = {
    "StateType": "kv_args",
    "KVArgs": "kv_args",
    "kv_args_of": "kv_args",
    "setup_state_kv_args": "state_routing",
    "HybridLinearStatePool": "state_routing",
    "DSAStatePool": "state_routing",
    "plan_transfer": "transfer_plan",
    "Manifest": "manifest",
    "ManifestMismatchError": "manifest",
    "TransferBackend": "backend",
    "TransferError": "backend",
    "NixlBackend": "nixl_backend",
    "KVSender": "conn",
    "KVReceiver": "conn",
    "hisparse_decode_kv_args": "hisparse_direct",
    "max_token_pool_size": "admission",
    "PrefillAdmission": "admission",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
