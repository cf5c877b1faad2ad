"""KV pools, host pools, allocators, typed slot ids and the compressors' per-request state.

The classes resolve lazily from their modules (``from sparsekv.srt.mem_cache import X``), so
importing one pool does not import the others.
"""

from sparsekv._lazy import lazy_getattr

_LAZY = {
    "BaseSWAKVPool": "base_swa_pool",
    "BufInfos": "base_swa_pool",
    "CompressorState": "compressor_state",
    "DeepSeekV4TokenToKVPool": "deepseekv4_memory_pool",
    "HostKVCache": "host_kv_cache",
    "HostStaging": "host_staging",
    "HiSparseHostPoolMixin": "hisparse_host_pool",
    "DeepSeekV4PagedHostPool": "dsv4_paged_host_pool",
    "HiSparseC4DevicePool": "hisparse_device_pool",
    "PagedAllocator": "allocators",
    "AllocatorExhaustedError": "allocators",
    "HostPoolExhaustedError": "hisparse_host_pool",
    "HiSparseTokenToKVPoolAllocator": "allocators",
    "HostSlots": "ids",
    "HostPages": "ids",
    "DeviceSlots": "ids",
    "DevicePages": "ids",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
