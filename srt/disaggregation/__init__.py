"""Prefill/decode (PD) disaggregation: state routing, the transfer engine, rendezvous and admission.

A prefill server computes a request's KV and state and writes them into a decode server's pools;
the pieces, each in its own module:

* :mod:`.kv_args` -- :class:`KVArgs` (what one side registers) and :class:`StateType`;
* :mod:`.state_routing` -- :func:`kv_args_of` (a pool's ``KVArgs``) and :func:`setup_state_kv_args`,
  which state components a pool has;
* :mod:`.buffer_layers` -- which layer each registered buffer holds (PP-aligned slicing);
* :mod:`.transfer_plan` -- the generic send as a pure plan of ``(src, dst, len)`` runs;
* :mod:`.planning` -- every write of one room, per region pair and state sender, checked first;
* :mod:`.manifest` -- the state manifest both sides agree on before any write;
* :mod:`.backend` -- the transfer-engine interface; :mod:`.nixl_backend` and :mod:`.mooncake_backend`
  its engines; :mod:`.engines` -- the table of them (:data:`ENGINES`) and opening one by name (:func:`open_backend`);
* :mod:`.bootstrap` -- the rendezvous over a socket and the message framing;
* :mod:`.messages` / :mod:`.protocol` -- the checked fields, and the typed messages made of them;
* :mod:`.room` -- a room's states and their transitions; :mod:`.deadlines` -- the bound of each wait;
* :mod:`.sender` -- :class:`KVSender` (prefill); :mod:`.receiver` -- :class:`KVReceiver` (decode);
* :mod:`.hisparse_direct` -- the decode side with HiSparse: C4 KV straight into host memory;
* :mod:`.admission` -- the prefill admission bound (the full pool, never the SWA pool).

``sparsekv pd-demo`` runs a prefill and a decode process over them (:mod:`sparsekv.testing.pd_session`).
"""

from sparsekv._lazy import lazy_getattr

_LAZY = {
    "StateType": "kv_args",
    "KVArgs": "kv_args",
    "kv_args_of": "state_routing",
    "setup_state_kv_args": "state_routing",
    "HybridLinearStatePool": "state_routing",
    "DSAStatePool": "state_routing",
    "plan_transfer": "transfer_plan",
    "Manifest": "manifest",
    "ManifestMismatchError": "manifest",
    "TransferBackend": "backend",
    "TransferError": "backend",
    "open_backend": "engines",
    "NixlBackend": "nixl_backend",
    "MooncakeBackend": "mooncake_backend",
    "ENGINES": "engines",
    "Deadlines": "deadlines",
    "RoomStatus": "room",
    "KVSender": "sender",
    "KVReceiver": "receiver",
    "hisparse_decode_kv_args": "hisparse_direct",
    "max_token_pool_size": "admission",
    "PrefillAdmission": "admission",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
