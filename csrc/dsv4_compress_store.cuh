// dsv4_compress_store: the DSV4 compressor fused with the store. Each event pools its window
// (csrc/include/sparsekv/window_pool.h, WindowPool::pool_slots, pool_split or pool_tile, as
// dsv4_compress does) into a team row, then the row goes through the store's RMSNorm + RoPE
// (+ Walsh-Hadamard) + quantize into its paged cache slot (csrc/include/sparsekv/entry_store.h,
// EntryStore::finish, as dsv4_store does); no float entry is written to memory. The bytes are
// those of compress then norm_rope_store: both steps are the same per-item functions.
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
// byte store is the decode step's `emitted`). C4 from 16-byte aligned rows (HeldStore, the GPU's
// serving case), a warp per entry, pools as the compressor's held form: per 128-channel chunk
// 4 channels a lane, the 8 window slots unrolled, each row read once with 16-byte loads
// (WindowPool::pool_slots), into a float stage in the warp's shared memory whose columns then make
// the team row (a lane's 4 consecutive channels are 4 virtual lanes of one column); two CTAs an SM
// (128 registers), as the compressor's. Static issue estimate (tools/bench/bench_sass_budget.py, 4k
// C4 tokens, the float32 ring; no GPU has timed it): the chunk loop 0.68x the roofline on an H200,
// 0.84x with the store's code; 1.12x and 1.38x on a B200. C128 from 16-byte aligned rows
// (SplitStore), a CTA of 8 warps per entry, pools as the compressor's split form (WindowPool::
// pool_split: per 128-channel chunk the 128 slots 16 a warp, the sums added in slot order a channel
// a thread) into a float row in shared memory, and warp 0 stores it: at 4k C128 tokens (32 entries,
// so 32 SMs, each chunk loop 1,686 instructions x 8 warps x 4 chunks) 1.95x the roofline on an H200,
// 2.1x with the store's code; 3.2x (3.4x) on a B200, where the channel-a-lane form, a warp per entry
// over 4 SMs, took 183x. Rows off a 16-byte boundary (StreamedStore, and the cpu backend) pool a
// channel a lane (WindowPool::pool_tile): an entry's 16 32-channel columns each walk the window
// twice, 5.6x (6.0x) at 4k C4 tokens on an H200.
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

// What every form of an entry shares: the decode step's `emitted` flag, whether the entry stores.
template <class Kind>
struct EntryPlan {
  bool emits;   // a decode row only when its token completes an entry
  bool pooled;  // stores, or writes its floats to `entries`: else nothing to do

  SPARSEKV_HOST_DEVICE static bool stores_at(const CompressStoreParams& p, bool emits, int64_t slot) {
    return emits && slot >= 0 && slot < p.store.num_slots;
  }

  SPARSEKV_HOST_DEVICE static EntryPlan of(const CompressStoreParams& p, int64_t n, Lanes lanes) {
    const dsv4_compress::DecodeRows& decode = p.events.decode;
    const bool emits = decode.rows == nullptr || decode.emits(n);
    if (p.events.emitted != nullptr && lanes.lane == 0) p.events.emitted[n] = emits;
    return {emits, stores_at(p, emits, p.store.slots[n]) || p.entries != nullptr};
  }

  // Norm + RoPE + quantize + store of the pooled row x at slots[n]. The slot is read again, not
  // kept: live across the pooling, it and its flag took registers that the 64 of four CTAs per SM
  // lack on sm_100a (a 16 B stack).
  SPARSEKV_HOST_DEVICE void finish(typename dsv4_store::EntryStore<Kind>::Row& x, const CompressStoreParams& p,
                                   int64_t n, Lanes lanes) const {
    const int64_t slot = p.store.slots[n];
    if (!stores_at(p, emits, slot)) return;
    const dsv4_compress::DecodeRows& decode = p.events.decode;
    const int64_t anchor = decode.rows != nullptr ? decode.positions[n] - (p.events.ratio - 1) : p.store.positions[n];
    dsv4_store::EntryStore<Kind>::finish(x, p.store, anchor, slot, lanes);
  }
};

// A channel a lane, the window streamed (WindowPool::pool_tile): rows off a 16-byte boundary, and the
// cpu backend.
template <class Kind>
struct StreamedStore {
  using Params = CompressStoreParams;
  using Row = typename dsv4_store::EntryStore<Kind>::Row;
  // Four CTAs of 256 threads per SM (64 registers): the row held in registers (16 of them) would
  // otherwise take sm_100a to 79.
  static constexpr int kCtasPerSm = 4;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.events.num_events; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t n, Lanes lanes) {
    const EntryPlan<Kind> plan = EntryPlan<Kind>::of(p, n, lanes);
    if (!plan.pooled) return;
    // Column k of the team row is the 32-channel tile 32 k .. 32 k + 31 (virtual lane = channel - 32 k).
    Row x{};
    for (int k = 0; k < Row::kPerLane; ++k) {
      float tile[team::kVirtualPerThread];
      if (plan.emits) {
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
    plan.finish(x, p, n, lanes);
  }
};

// C4 from 16-byte aligned rows (WindowPool::wide_rows): the compressor's held form. The warp pools
// its entry in 128-channel chunks, 4 consecutive channels a lane (WindowPool::pool_slots: the 8
// slots unrolled, each row read once with 16-byte loads), into a float stage in the warp's shared
// memory, and reads the team row back from it (column k, virtual lane l: channel 32 k + l).
template <class Kind, bool kBf16>
struct HeldStore {
  using Params = CompressStoreParams;
  using Row = typename dsv4_store::EntryStore<Kind>::Row;
  static constexpr int64_t kChunk = 4 * int64_t{team::kTeamLanes};
  static_assert(Kind::kDim % kChunk == 0, "dsv4_compress_store: an entry is whole 128-channel chunks");
  // Two CTAs of 256 threads per SM (128 registers), as the compressor's: the 8 slots' logits and
  // the loads in flight.
  static constexpr int kCtasPerSm = 2;
  // The warp's pooled channels, and its entry's 8 slot sources (found once, by 8 lanes; kept here,
  // not in registers, where live across the chunk loop they spilled).
  struct alignas(16) Stage {
    float v[Kind::kDim];
    int64_t src[8];
  };

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.events.num_events; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t n, Lanes lanes) {
    constexpr int C = 4 * team::kVirtualPerThread;  // a lane's channels of a chunk (a host call: the chunk)
    const EntryPlan<Kind> plan = EntryPlan<Kind>::of(p, n, lanes);
    if (!plan.pooled) return;
#ifdef __CUDA_ARCH__
    Stage& stage = row_store::warp_stage<Stage>();
#else
    Stage stage;
#endif
    for (int j = lanes.lane; j < 8; j += lanes.count) {
      stage.src[j] = dsv4_compress::WindowPool::source<4>(p.events, n, j);
    }
#ifdef __CUDA_ARCH__
    __syncwarp();  // the sources are in the stage
#endif
    SPARSEKV_ROLLED  // a chunk a trip: unrolled, the chunks' held windows would only add registers
    for (int64_t first = 0; first < Kind::kDim; first += kChunk) {
      const int64_t c0 = first + 4 * lanes.lane;
      float out[C];
      if (plan.emits) {
        dsv4_compress::WindowPool::pool_slots<kBf16>(p.events, stage.src, c0, C, out);
      } else {
        for (int v = 0; v < C; ++v) out[v] = 0.0f;
      }
#ifdef __CUDA_ARCH__
      const float4 word{out[0], out[1], out[2], out[3]};
      *reinterpret_cast<float4*>(stage.v + c0) = word;
      if (p.entries != nullptr) *reinterpret_cast<float4*>(p.entries + n * Kind::kDim + c0) = word;
#else
      for (int v = 0; v < C; ++v) {
        stage.v[c0 + v] = out[v];
        if (p.entries != nullptr) p.entries[n * Kind::kDim + c0 + v] = out[v];
      }
#endif
    }
#ifdef __CUDA_ARCH__
    __syncwarp();  // every lane's chunks are in the stage
#endif
    Row x;
    for (int j = 0; j < team::kVirtualPerThread; ++j) {
      for (int k = 0; k < Row::kPerLane; ++k) x.v[j][k] = stage.v[Row::channel(lanes, j, k)];
    }
#ifdef __CUDA_ARCH__
    __syncwarp();  // the stage is read before the warp's next entry overwrites it
#endif
    plan.finish(x, p, n, lanes);
  }
};

// C128 from 16-byte aligned rows (WindowPool::wide_rows): the compressor's split form, a CTA per
// entry. Its 8 warps pool the entry's 128-channel chunks one after another
// (WindowPool::pool_split: each chunk's window split over the warps, the sums added in slot order)
// into a float row in shared memory, from which warp 0 reads the team row and finishes it.
template <class Kind, bool kBf16>
struct SplitStore {
  using Params = CompressStoreParams;
  using Row = typename dsv4_store::EntryStore<Kind>::Row;
  using WindowPool = dsv4_compress::WindowPool;
  static constexpr int64_t kChunk = WindowPool::kSplitChunk;
  static_assert(Kind::kDim % kChunk == 0, "dsv4_compress_store: an entry is whole 128-channel chunks");
  static constexpr int kThreads = WindowPool::kSplitThreads;
  // One CTA of 256 threads per SM, as the compressor's split kernels (at 128 registers they spilled).
  static constexpr int kCtasPerSm = 1;
  struct Stage {
    WindowPool::SplitStage pool;
    float row[Kind::kDim];
  };

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.events.num_events; }

#ifdef __CUDACC__
  SPARSEKV_DEVICE static void cta_item(const Params& p, int64_t n, Stage& stage) {
    const int thread = static_cast<int>(threadIdx.x);
    // Thread 0 writes the decode step's flag; the plan is the same in every thread.
    const EntryPlan<Kind> plan = EntryPlan<Kind>::of(p, n, Lanes{thread, kThreads});
    if (!plan.pooled) return;
    SPARSEKV_ROLLED  // a chunk a trip: each pools a whole window
    for (int64_t first = 0; first < Kind::kDim; first += kChunk) {
      const float x = plan.emits ? WindowPool::pool_split<kBf16>(p.events, n, first, stage.pool) : 0.0f;
      if (thread < kChunk) {
        stage.row[first + thread] = x;
        if (p.entries != nullptr) p.entries[n * Kind::kDim + first + thread] = x;
      }
    }
    __syncthreads();  // the row is in the stage
    if (thread < kWarpSize) {
      const Lanes lanes{thread, kWarpSize};
      Row x;
      for (int j = 0; j < team::kVirtualPerThread; ++j) {
        for (int k = 0; k < Row::kPerLane; ++k) x.v[j][k] = stage.row[Row::channel(lanes, j, k)];
      }
      plan.finish(x, p, n, lanes);
    }
    __syncthreads();  // the row is read before the next entry overwrites it
  }
#endif
};

// The fused step's launch: on the cpu backend the streamed form; on the GPU C4 from 16-byte
// aligned rows (and `entries`) takes the held form and C128 from 16-byte aligned rows the split
// form, per ring dtype a kernel of its own, as the compressor's PoolEvents.
template <class Kind>
struct CompressStore {
  using Params = CompressStoreParams;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.events.num_events; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t n, Lanes lanes) {
    StreamedStore<Kind>::item(p, n, lanes);
  }

#ifdef __CUDACC__
  static int run_on_cuda(const Params& p, void* stream) {
    const bool wide_entries = (reinterpret_cast<uintptr_t>(p.entries) & 15) == 0;
    if (p.events.ratio == 4 && wide_entries && dsv4_compress::WindowPool::wide_rows(p.events)) {
      return p.events.ring_bf16 ? sparsekv::run_on_cuda<HeldStore<Kind, true>>(p, stream)
                                : sparsekv::run_on_cuda<HeldStore<Kind, false>>(p, stream);
    }
    if (p.events.ratio == 128 && dsv4_compress::WindowPool::wide_rows(p.events)) {
      return p.events.ring_bf16 ? run_cta_per_item<SplitStore<Kind, true>>(p, stream)
                                : run_cta_per_item<SplitStore<Kind, false>>(p, stream);
    }
    return sparsekv::run_on_cuda<StreamedStore<Kind>>(p, stream);
  }
#endif
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
