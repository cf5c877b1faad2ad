// dsv4_compress_store: the DSV4 compressor fused with the store. Each event pools its window
// (csrc/include/sparsekv/window_pool.h, WindowPool::pool_tile, as dsv4_compress does) straight into
// a team row, then the row goes through the store's RMSNorm + RoPE (+ Walsh-Hadamard) + quantize
// into its paged cache slot (csrc/include/sparsekv/entry_store.h, EntryStore::finish, as dsv4_store
// does); no float entry is written to memory. The bytes are those of compress then norm_rope_store:
// both steps are the same per-item functions.
//
// Entries:
//   compress_store: a streaming step of the raw ring (the event and ring-write tables that
//     compress_extend takes), every event stored at slots[n] with RoPE position positions[n].
//   compress_decode_store: a decode step planned on the device (compress_decode's state rows and
//     positions); a row whose token completes an entry stores it at slots[row] (RoPE position: the
//     entry's anchor positions[row] - ratio + 1) and writes the pooled floats to `out`.
// Both pool every event first (reading ring rows as they were), then write the new ring rows.
//
// Design: the record goes out as dsv4_store's does (row_store.h store_v4: staged in the warp's
// shared memory, written as 16-byte words, e4m3 codes from the hardware convert on sm_89+; the only
// byte store is the decode step's `emitted`). It pools a channel a lane (WindowPool::pool_tile, the
// streamed window): an entry's 16 32-channel columns each walk the 8 window slots twice. Static issue
// estimate (tools/bench/bench_sass_budget.py, 4k C4 tokens, the float32 ring): 5.6x the roofline on an
// H200 from the two pooling loops alone (6.0x with the store's code), 10.4x on a B200 (11.1x).
//
// Its own stem because it fuses two families (the compressor's pooling and the store's per-layout
// finish) that do not depend on each other; its instances are per cache layout, like the store's.
#pragma once

#include "sparsekv/entry_store.h"
#include "sparsekv/lane_reduce.h"
#include "sparsekv/portability.h"
#include "sparsekv/rope.h"
#include "sparsekv/row_store.h"
#include "sparsekv/window_pool.h"

namespace sparsekv::dsv4_compress_store {

struct CompressStoreParams {
  dsv4_compress::EventParams events;
  dsv4_store::StoreParams store;
  float* entries = nullptr;  // decode step: [batch, D], the pooled entries (zeros for rows without one)
};

template <class Kind>
struct CompressStore {
  using Params = CompressStoreParams;
  using Store = dsv4_store::EntryStore<Kind>;
  using Row = typename Store::Row;
  // Four CTAs of 256 threads per SM (64 registers): the row held in registers (16 of them) would
  // otherwise take sm_100a to 79.
  static constexpr int kCtasPerSm = 4;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.events.num_events; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t n, Lanes lanes) {
    // A decode step: row n stores only when its token completes an entry, at anchor position - ratio + 1.
    const dsv4_compress::DecodeRows& decode = p.events.decode;
    const bool emits = decode.rows == nullptr || decode.emits(n);
    if (p.events.emitted != nullptr && lanes.lane == 0) p.events.emitted[n] = emits;
    const auto stores_at = [&p, emits](int64_t slot) { return emits && slot >= 0 && slot < p.store.num_slots; };
    if (!stores_at(p.store.slots[n]) && p.entries == nullptr) return;
    // Column k of the team row is the 32-channel tile 32 k .. 32 k + 31 (virtual lane = channel - 32 k).
    Row x{};
    for (int k = 0; k < Row::kPerLane; ++k) {
      float tile[team::kVirtualPerThread];
      if (emits) {
        dsv4_compress::WindowPool::pool_tile(p.events, n, int64_t{team::kTeamLanes} * k, lanes, tile);
      } else {
        for (int j = 0; j < team::kVirtualPerThread; ++j) tile[j] = 0.0f;
      }
      for (int j = 0; j < team::kVirtualPerThread; ++j) {
#ifdef __CUDA_ARCH__
        // This loop stays rolled (each column pools a whole window), so x.v[j][k] at a run-time k
        // would put the row on the stack (64 B of LDL/STL); a select into every column, each at a
        // constant index, keeps it in registers.
        for (int c = 0; c < Row::kPerLane; ++c) x.v[j][c] = c == k ? tile[j] : x.v[j][c];
#else
        x.v[j][k] = tile[j];
#endif
        if (p.entries != nullptr) p.entries[n * Kind::kDim + team::kTeamLanes * k + lanes.lane + j] = tile[j];
      }
    }
    // The slot is read again, not kept: live across the pooling, it and its flag took registers that
    // the 64 of four CTAs per SM lack on sm_100a (a 16 B stack).
    const int64_t slot = p.store.slots[n];
    if (!stores_at(slot)) return;
    const int64_t anchor = decode.rows != nullptr ? decode.positions[n] - (p.events.ratio - 1) : p.store.positions[n];
    Store::finish(x, p.store, anchor, slot, lanes);
  }
};

// The ring writes of a fused step, instantiated per Kind like the other kernels of the family.
template <class Kind>
struct StoreRingWrite : dsv4_compress::RingWrite {};

}  // namespace sparsekv::dsv4_compress_store

#ifdef SPARSEKV_HOST_ENTRY
#include <vector>

#include "sparsekv/ffi.h"

namespace sparsekv::dsv4_compress_store {

// One streaming step of the raw ring fused with the store: pool + norm + RoPE + quantize + store
// of every planned event, then the ring writes.
template <class Kind>
void compress_store(TensorView kv, TensorView score, TensorView ape, int64_t ratio, TensorView state,
                    TensorView sources, TensorView writes, TensorView weight, double eps, TensorView positions,
                    TensorView cache, TensorView slots, int64_t page_slots, TensorView rope_cos,
                    TensorView rope_sin, int64_t num_threads) {
  // 1. Validate (memory first: the plan checks read `sources` and `writes`).
  check_disjoint({read(kv, "kv"), read(score, "score"), read(ape, "ape"), written(state, "state"),
                  read(sources, "sources"), read(writes, "writes"), read(weight, "weight"),
                  read(positions, "positions"), written(cache, "cache"), read(slots, "slots"),
                  read(rope_cos, "rope_cos"), read(rope_sin, "rope_sin")});
  const dsv4_compress::ExtendPlan plan = dsv4_compress::check_extend(kv, score, ape, ratio, state, sources, writes,
                                                                     nullptr);
  if (plan.events.d != Kind::kDim) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `kv` gives entries of width " << plan.events.d
                              << ", but this cache stores " << Kind::kDim;
  }
  const dsv4_store::StoreParams store =
      dsv4_store::check_store<Kind>(sources.size(0), weight, eps, positions, cache, slots, page_slots, rope_cos,
                                    rope_sin);
  check(cache, "cache").same_device(kv, "kv");

  // 2. Pool + store every event (reading ring rows as they were), then store the new ring rows.
  // The cpu backend splits the events over up to num_threads threads, one whole entry per item.
  if (plan.events.num_events > 0) {
    launch_threaded<CompressStore<Kind>>(CompressStoreParams{plan.events, store}, kv.device(), num_threads,
                                         dsv4_compress::event_bytes_per_channel(ratio) * Kind::kDim, [] {});
  }
  if (plan.ring.num_writes > 0) launch<StoreRingWrite<Kind>>(plan.ring, kv.device());
}

// A decode step fused with the store: each row's new token into its ring row; a row whose token
// completes an entry pools it into `out` and stores it at slots[row] (RoPE position: the entry's
// anchor positions[row] - ratio + 1); other rows get zeros and emitted = false and store nothing.
template <class Kind>
void compress_decode_store(TensorView kv, TensorView score, TensorView ape, int64_t ratio, TensorView state,
                           TensorView state_rows, TensorView positions, TensorView out, TensorView emitted,
                           TensorView weight, double eps, TensorView cache, TensorView slots, int64_t page_slots,
                           TensorView rope_cos, TensorView rope_sin) {
  // 1. Validate (memory first; slots are read for the rows that store: host-readable ones are checked here).
  check_disjoint({read(kv, "kv"), read(score, "score"), read(ape, "ape"), written(state, "state"),
                  read(state_rows, "state_rows"), read(positions, "positions"), written(out, "out"),
                  written(emitted, "emitted"), read(weight, "weight"), written(cache, "cache"), read(slots, "slots"),
                  read(rope_cos, "rope_cos"), read(rope_sin, "rope_sin")});
  check(out, "out").dtype<float>().ndim(2).contiguous().same_device(kv, "kv");
  const dsv4_compress::ExtendPlan plan = dsv4_compress::check_decode(kv, score, ape, ratio, state, state_rows,
                                                                     positions, emitted,
                                                                     static_cast<float*>(out.data_ptr()));
  if (plan.events.d != Kind::kDim) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `kv` gives entries of width " << plan.events.d
                              << ", but this cache stores " << Kind::kDim;
  }
  check(out, "out").size(0, kv.size(0), "rows of kv").size(1, Kind::kDim, "d");
  check(cache, "cache").same_device(kv, "kv");
  const dsv4_store::StoreParams store =
      dsv4_store::check_store<Kind>(kv.size(0), weight, eps, positions, cache, slots, page_slots, rope_cos,
                                    rope_sin, false);
  if (cache.device().device_type != kDLCUDA) {
    std::vector<int64_t> stored;
    for (int64_t b = 0; b < kv.size(0); ++b) {
      if (!plan.events.decode.emits(b)) continue;
      stored.push_back(store.slots[b]);
      rope::check_position(plan.events.decode.positions[b] - (ratio - 1), b, store.rope_positions,
                                      "positions");
    }
    row_store::check_unique_slots(stored.data(), static_cast<int64_t>(stored.size()), store.num_slots, "slots");
  }

  // 2. Pool + store every row (reading ring rows as they were), then store the new ring rows.
  if (plan.events.num_events > 0) {
    launch<CompressStore<Kind>>(CompressStoreParams{plan.events, store, static_cast<float*>(out.data_ptr())},
                                kv.device());
  }
  if (plan.ring.num_writes > 0) launch<StoreRingWrite<Kind>>(plan.ring, kv.device());
}

}  // namespace sparsekv::dsv4_compress_store
#endif
