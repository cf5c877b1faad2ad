// dsv4_store: the fused RMSNorm + RoPE (+ Walsh-Hadamard) + quantize + paged store of compressed
// DSV4 entries, for the main cache (512 wide, fp8_ds_mla V4, 584 B) and the indexer cache (128
// wide: IndexerFp8 132 B with one fp32 scale, or IndexerFp4 68 B with a UE8M0 scale per 32).
//
// Its own stem rather than part of dsv4_compress: the same step stores the SWA key path and any
// entry pooled elsewhere, and its instances are per cache layout while the compressor's are not.
// The compressor fused with this store is the dsv4_compress_store stem.
//
// Contract, per entry n: row x[n] (D floats) is finished by EntryStore<Kind>
// (csrc/include/sparsekv/entry_store.h: bf16 cast, RMSNorm with weight, RoPE at positions[n],
// Walsh-Hadamard for the indexer caches, quantize) into token slot slots[n] of the paged cache.
//
// Safety: a slot outside the cache is skipped by the kernel; the host entry rejects such slots
// and duplicated slots before any byte is written when the slots are host-readable.
//
// Design: one warp per entry (256-thread CTAs, 4 per SM), bound by HBM: 4096 entries read 8 MB of
// float rows and write 2.4 MB of 584 B records, a 2.3 us roofline on an H200. A lane's channels
// are 32 apart, so the V4 record is staged in the warp's 592 B of shared memory and written whole
// (row_store.h store_v4): 36 STG.128 and one STG.64 per record where byte stores took 26 STG.U8 per
// lane (tests/jit/test_sass.py, wide_store). Its e4m3 codes come from the hardware convert, one F2FP
// per pair on sm_89+ (fp8::float_to_e4m3x2; fp8_encode). Static issue estimate
// (tools/bench/bench_sass_budget.py, 4096 entries): 1.53x the roofline on an H200, 2.24x on a B200
// (2.75x on the H200 with the software encode): the norm, RoPE and the team reductions remain.
#pragma once

#include <cstdint>

#include "sparsekv/entry_store.h"
#include "sparsekv/lane_reduce.h"
#include "sparsekv/portability.h"

namespace sparsekv::dsv4_store {

template <class Kind>
struct NormRopeStore {
  static constexpr int kDim = Kind::kDim;
  using Row = team::Row<kDim>;
  using Params = StoreParams;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const StoreParams& p) { return p.num_entries; }

  SPARSEKV_HOST_DEVICE static void item(const StoreParams& p, int64_t n, Lanes lanes) {
    const int64_t slot = p.slots[n];
    if (slot < 0 || slot >= p.num_slots) return;
    const float* src = p.x + n * p.x_stride;
    Row x;
    for (int j = 0; j < team::kVirtualPerThread; ++j) {
      for (int k = 0; k < Row::kPerLane; ++k) x.v[j][k] = src[Row::channel(lanes, j, k)];
    }
    EntryStore<Kind>::finish(x, p, p.positions[n], slot, lanes);
  }
};

}  // namespace sparsekv::dsv4_store

#ifdef SPARSEKV_HOST_ENTRY
#include "sparsekv/ffi.h"

namespace sparsekv::dsv4_store {

template <class Kind>
void norm_rope_store(TensorView x, TensorView weight, double eps, TensorView positions, TensorView cache,
                     TensorView slots, int64_t page_slots, TensorView rope_cos, TensorView rope_sin) {
  // 1. Validate (memory first: the slot checks read `slots`).
  check_disjoint({read(x, "x"), read(weight, "weight"), read(positions, "positions"), written(cache, "cache"),
                  read(slots, "slots"), read(rope_cos, "rope_cos"), read(rope_sin, "rope_sin")});
  check(x, "x").dtype<float>().ndim(2).size(1, Kind::kDim, "head dim").rows_dense().same_device(cache, "cache");
  StoreParams params =
      check_store<Kind>(x.size(0), weight, eps, positions, cache, slots, page_slots, rope_cos, rope_sin);

  // 2. Derive sizes and launch.
  params.x = static_cast<const float*>(x.data_ptr());
  params.x_stride = x.stride(0);
  if (params.num_entries == 0) return;
  launch<NormRopeStore<Kind>>(params, cache.device());
}

}  // namespace sparsekv::dsv4_store
#endif
