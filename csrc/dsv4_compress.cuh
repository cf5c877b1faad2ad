// dsv4_compress: the DSV4 compressors (C4: overlapping windows of 8, stride 4; C128: windows of
// 128) over raw token rows, the ring writes of the streaming state, and the online C128 fold.
//
// Contract: the window pooling of csrc/include/sparsekv/window_pool.h (entry i = a per-channel
// softmax over its window's slots; C4 windows of 8 in two halves, C128 windows of 128; bf16 rings).
//
// Kernels:
//   CompressEvents<ratio>: the entries of the events, pooled by WindowPool from the ragged input,
//     the ring rows of the state buffer, or a decode step's rows (window_pool.h); a warp (C4) or a
//     CTA (C128) per (event, channel chunk), launched as one of its PoolEvents kernels (the design
//     note below).
//   RingWrite (window_pool.h): copies input rows into ring rows.
//   OnlineC128: folds a segment of one 128-window token by token into a running (max, sum,
//     accumulator) per channel, starting from a stored snapshot or from nothing, stores the
//     snapshot after chosen tokens, and emits acc / sum when the segment closes the window.
//     Snapshot layout (two ring rows of 2 d floats): row a = [acc | max], row b = [sum | 0].
//
//   PlanRawStep: the event and ring-write tables of a streaming step, planned on the device from a
//     few numbers per request (StepRequest) and the ring ids the step touches.
//
// CompressorState (sparsekv.srt.mem_cache.compressor_state) plans the raw ring's event and write
// tables with PlanRawStep and the online fold's segments on the host; when tables are
// host-readable the host entry checks every row they name before the first launch. Rows outside their tables are skipped by the kernels (safe
// by construction).
// GPU: CompressEvents' lanes own 4 consecutive channels each, so a slot is one 16-byte load a lane.
// cpu backend: the events of a prefill call (compress_pool, compress_extend and the fused store)
// run on up to num_threads host threads (run_on_host_threads); each item is computed whole by one
// thread, so the output does not depend on the thread count.
#pragma once

#include <cmath>

#include "sparsekv/fp8.h"
#include "sparsekv/lane_reduce.h"
#include "sparsekv/portability.h"
#include "sparsekv/window_pool.h"

namespace sparsekv::dsv4_compress {

// Design: C4, a warp pools one 128-channel chunk of one event: a lane owns 4 consecutive channels
// (one float4 of kv, score and ape per window slot; 8 bytes of a bf16 ring row), 4 warps an event
// at d = 512; the 8 slots unrolled, their token rows found once, their logits held in registers, so
// each row is read once: score and ape for the max, then kv for the weighted sum. C128, a CTA of 8
// warps pools one 128-channel chunk of one event (WindowPool::pool_split): its few events (32 at 4k
// tokens) then take 4 CTAs each, and the 128 slots, 16 a warp, are no serial chain. A lane owns 4
// channels as in C4 (16-byte loads, its 16 slots' logits held); the maximum goes through shared
// memory (order-free); the weights and products, independent per slot, are staged 16 slots a round,
// and a thread adds up one channel's sum or acc in slot order (2 instructions a slot, where the
// channel-a-lane loop spent 218). Per channel the float operations are those of every other path
// (WindowPool), so the entries are bit for bit those of the fused store and of the cpu build's loop.
// The 16-byte loads need every row 16-byte aligned (the base pointers, the row strides and d a
// multiple of 4 floats); rows off that take the channel-a-lane form (the window streamed, read
// twice), same floats. Each (ratio, ring dtype, form) is a kernel of its own (PoolEvents), chosen at
// launch from the pointers, so the held and split kernels' one loop is the chunk they pool.
// Bound, at 4k tokens and d = 512 (C4: 34 MB, 7.4 us on an H200; C128: 17 MB, 3.5 us): by memory.
// The static instruction budget (tools/bench/bench_sass_budget.py, docs/sass.md, no GPU has timed
// it), the code of all three step kinds counted, puts C4's issue at 0.85x that on an H200 and 1.40x
// on a B200; C128's (1,767 instructions a warp, 128 CTAs of 8 warps) at 0.51x and 0.83x, where the
// channel-a-lane form, bound by its 128 serial slots on 64 SMs, took 7.9x and 13.4x.
template <int64_t kRatio, bool kBf16, bool kWide>
struct PoolEvents {
  static_assert(kRatio == 4 || kRatio == 128, "dsv4_compress: the ratio is 4 or 128");
  using Params = EventParams;
  // From 16-byte aligned rows: C4 the window held in registers, 4 channels a lane, a warp per (event,
  // 128-channel chunk); C128 the window split over a CTA per (event, 128-channel chunk)
  // (WindowPool::pool_split: cta_item). Otherwise (C4 rows off a 16-byte boundary, C128's too; the
  // cpu build) a channel a lane, the window streamed.
  static constexpr bool kHeld = kRatio == 4 && kWide;
  static constexpr bool kSplit = kRatio == 128 && kWide;
  static constexpr int kPerLane = kHeld ? 4 : 1;
  static constexpr int kLaneChannels = kPerLane * team::kVirtualPerThread;  // a host call takes the chunk
  static constexpr int64_t kChunk = kSplit ? WindowPool::kSplitChunk : kPerLane * int64_t{kTile};
  // CTAs of 256 threads an SM: 2 held (128 registers: the 8 slots' logits and loads in flight); 1
  // split (a warp's 16 slots' logits and loads in flight spilled at 128 registers); else 4.
  static constexpr int kCtasPerSm = kHeld ? 2 : (kSplit ? 1 : 4);
  static constexpr int kThreads = WindowPool::kSplitThreads;  // the split form's CTA
  using Stage = WindowPool::SplitStage;

  SPARSEKV_HOST_DEVICE static int64_t chunks(const Params& p) { return (p.d + kChunk - 1) / kChunk; }
  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.num_events * chunks(p); }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    constexpr int C = kLaneChannels;
    const int64_t e = i / chunks(p);
    const int64_t first = (i - e * chunks(p)) * kChunk;
    const bool emits = p.decode.rows == nullptr || p.decode.emits(e);
    if (p.emitted != nullptr && first == 0 && lanes.lane == 0) p.emitted[e] = emits;
    const int64_t c0 = first + kPerLane * lanes.lane;
    const int count = static_cast<int>(c0 >= p.d ? 0 : (p.d - c0 < C ? p.d - c0 : C));
    float out[C];
    // A lane past d pools nothing: the held form's 16-byte loads take no count, and would read past
    // the rows (past the kv and ape tables where d is not a multiple of the chunk).
    if (emits && count > 0) {
      if constexpr (kHeld) {
        int64_t src[8];
        SPARSEKV_UNROLLED
        for (int j = 0; j < 8; ++j) src[j] = WindowPool::source<4>(p, e, j);
        WindowPool::pool_slots<kBf16>(p, src, c0, count, out);
      } else {
        WindowPool::pool_streamed<kBf16, C, kRatio>(p, e, c0, count, out);
      }
    } else {
      for (int v = 0; v < C; ++v) out[v] = 0.0f;  // a decode row without an entry, or a lane past d
    }
    float* row = p.out + e * p.d;
#ifdef __CUDA_ARCH__
    if constexpr (kHeld) {  // count is 0 or 4 (d is a multiple of 4)
      if (count == C) *reinterpret_cast<float4*>(row + c0) = float4{out[0], out[1], out[2], out[3]};
      return;
    }
#endif
    for (int v = 0; v < C; ++v) {
      if (v < count) row[c0 + v] = out[v];
    }
  }

#ifdef __CUDACC__
  // The split form's item, run by the whole CTA: thread t writes channel first + t.
  SPARSEKV_DEVICE static void cta_item(const Params& p, int64_t i, Stage& stage) {
    static_assert(kSplit, "dsv4_compress: only the split form takes a CTA an item");
    const int64_t e = i / chunks(p);
    const int64_t first = (i - e * chunks(p)) * kChunk;
    const bool emits = p.decode.rows == nullptr || p.decode.emits(e);  // the same in every thread
    const auto thread = static_cast<int64_t>(threadIdx.x);
    if (p.emitted != nullptr && first == 0 && thread == 0) p.emitted[e] = emits;
    const float x = emits ? WindowPool::pool_split<kBf16>(p, e, first, stage) : 0.0f;
    if (thread < kChunk && first + thread < p.d) p.out[e * p.d + first + thread] = x;
  }
#endif
};

template <int64_t kRatio>
struct CompressEvents {
  using Params = EventParams;
  using Narrow = PoolEvents<kRatio, false, false>;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return Narrow::num_items(p); }

  // The cpu backend's item (the GPU runs one of the PoolEvents kernels).
  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    p.ring_bf16 ? PoolEvents<kRatio, true, false>::item(p, i, lanes) : Narrow::item(p, i, lanes);
  }

#ifdef __CUDACC__
  static int run_on_cuda(const Params& p, void* stream) {
    if (WindowPool::wide_rows(p)) {
      if constexpr (kRatio == 4) {
        return p.ring_bf16 ? sparsekv::run_on_cuda<PoolEvents<kRatio, true, true>>(p, stream)
                           : sparsekv::run_on_cuda<PoolEvents<kRatio, false, true>>(p, stream);
      } else {
        return p.ring_bf16 ? run_cta_per_item<PoolEvents<kRatio, true, true>>(p, stream)
                           : run_cta_per_item<PoolEvents<kRatio, false, true>>(p, stream);
      }
    }
    return p.ring_bf16 ? sparsekv::run_on_cuda<PoolEvents<kRatio, true, false>>(p, stream)
                       : sparsekv::run_on_cuda<Narrow>(p, stream);
  }
#endif
};

// The plan of one streaming step of the raw ring, on the device (PlanRawStep). The host hands over
// a few numbers per request (StepRequest) and the ring ids that its reads and writes touch; every
// event's window sources, anchor and request, and every ring write, are derived here. Request b's
// chunk covers positions [start, start + n) at input rows row0 ...; its events are the entries
// i = start / ratio + k (k < its event count) whose last token lies in the chunk, event k of the
// step's table being its event event0 + k; slot j of entry i is position q = ratio i - (4 for C4) + j:
// masked (-1) when q < 0, input row row0 + q - start when q >= start, ring row -2 - ring_row(q)
// otherwise. Its ring writes are positions write_from .. start + n - 1 (the last ring_size), write
// write0 + k being position write_from + k.
struct StepRequest {
  int64_t start;       // position of the chunk's first token
  int64_t row0;        // input row of that token
  int64_t event0;      // its first event in the step's tables (non-decreasing over requests)
  int64_t write0;      // its first ring write (non-decreasing over requests)
  int64_t write_from;  // the first position it writes to the ring
  int64_t ids;         // offset of its ring ids in the ring-id table: the read range's, then the write range's
  int64_t read_lo;     // ring index (position / span, 0 without span) of the read range's first id
  int64_t read_count;  // ids of the read range
  int64_t write_lo;    // ring index of the write range's first id
};
static_assert(sizeof(StepRequest) == 9 * sizeof(int64_t), "dsv4_compress: a step request is 9 int64");

struct PlanParams {
  const StepRequest* requests;
  int64_t num_requests;
  const int64_t* ring_ids;
  int64_t num_ring_ids;
  int64_t ratio;
  int64_t ring_size;  // rows per ring id
  int64_t span;       // positions per ring id, 0: one ring id per request
  int64_t num_events;
  int64_t num_writes;
  int64_t* sources;         // [num_events, window]
  int64_t* anchors;         // [num_events]: ratio * i
  int64_t* event_requests;  // [num_events]: the request (its index in the batch) of each event
  int64_t* writes;          // [num_writes, 2]: (input row, ring row)
};

// Design: planning is a gather over a few hundred bytes per request, bound by launch latency at
// every shape (4k C4 tokens: 1,024 events x 8 slots = 64 KiB of sources); one warp per event or
// write, lanes over the window's slots, a binary search over the requests per item (log2 B steps,
// B <= a few hundred). Instruction budget: ~40 instructions per slot, 8k slots over 132 SMs: far
// under the launch's ~3 us.
struct PlanRawStep {
  using Params = PlanParams;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.num_events + p.num_writes; }

  // The request whose item range holds item k: the last one whose first item is <= k.
  template <bool kWrites>
  SPARSEKV_HOST_DEVICE static int64_t request_of(const Params& p, int64_t k) {
    int64_t lo = 0, hi = p.num_requests;  // the answer lies in [lo, hi)
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      const int64_t first = kWrites ? p.requests[mid].write0 : p.requests[mid].event0;
      if (first <= k) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    return lo;
  }

  // Ring row of position q of request r, or -1 if its ring id is not in the table (the host
  // checked every id it hands over, so this is unreachable).
  SPARSEKV_HOST_DEVICE static int64_t ring_row(const Params& p, const StepRequest& r, int64_t q) {
    const int64_t index = p.span > 0 ? q / p.span : 0;
    const int64_t t = index < r.read_lo + r.read_count ? index - r.read_lo : r.read_count + index - r.write_lo;
    if (t < 0 || r.ids + t >= p.num_ring_ids) return -1;
    return p.ring_ids[r.ids + t] * p.ring_size + q % p.ring_size;
  }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t k, Lanes lanes) {
    if (k < p.num_events) {
      const int64_t b = request_of<false>(p, k);
      const StepRequest& r = p.requests[b];
      const int64_t entry = r.start / p.ratio + (k - r.event0);
      const int64_t window = window_of(p.ratio);
      const int64_t first = p.ratio * entry - (p.ratio == 4 ? 4 : 0);
      for (int64_t j = lanes.lane; j < window; j += lanes.count) {
        const int64_t q = first + j;
        p.sources[k * window + j] = q < 0 ? -1 : (q >= r.start ? r.row0 + q - r.start : -2 - ring_row(p, r, q));
      }
      if (lanes.lane == 0) {
        p.anchors[k] = p.ratio * entry;
        p.event_requests[k] = b;
      }
      return;
    }
    const int64_t w = k - p.num_events;
    if (lanes.lane != 0) return;
    const StepRequest& r = p.requests[request_of<true>(p, w)];
    const int64_t q = r.write_from + (w - r.write0);
    p.writes[2 * w] = r.row0 + q - r.start;
    p.writes[2 * w + 1] = ring_row(p, r, q);
  }
};

// One segment of the online C128 fold: tokens pos0 .. pos0 + count - 1 (all in one 128-window)
// at input rows row0 ...
struct Segment {
  int64_t row0;
  int64_t pos0;
  int64_t count;
  int64_t read_row;   // snapshot to start from (row a; row b = read_row + 1), -1 to start empty
  int64_t out_row;    // entry row of out when the segment closes its window, else -1
  int64_t ring_base;  // first ring row of the request: snapshot of length L at ring_base + 2 (L % K)
  int64_t keep_from;  // snapshots are stored for lengths >= keep_from (that are not multiples of 128)
};
static_assert(sizeof(Segment) == 7 * sizeof(int64_t), "dsv4_compress: a segment is 7 int64");

struct OnlineParams {
  const float* kv;
  const float* score;
  int64_t kv_stride;
  int64_t score_stride;
  int64_t num_inputs;
  const float* ape;  // [128, d]
  float* ring;       // [ring_rows, 2 d]
  int64_t num_ring_rows;
  int64_t snapshots;  // K: snapshot slots per ring
  const Segment* segments;
  int64_t num_segments;
  float* out;
  int64_t num_out;
  int64_t d;
};

struct OnlineC128 {
  using Params = OnlineParams;
  static constexpr int64_t kRatio = 128;

  SPARSEKV_HOST_DEVICE static int64_t tiles(const Params& p) { return (p.d + kTile - 1) / kTile; }
  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.num_segments * tiles(p); }

  SPARSEKV_HOST_DEVICE static bool ring_ok(const Params& p, int64_t row) {
    return row >= 0 && row + 1 < p.num_ring_rows;
  }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const int64_t s = i / tiles(p);
    const int64_t first = (i - s * tiles(p)) * kTile;
    const Segment seg = p.segments[s];
    if (seg.row0 < 0 || seg.row0 + seg.count > p.num_inputs) return;
    const int64_t row_stride = 2 * p.d;
    for (int64_t c = first + lanes.lane; c < first + kTile && c < p.d; c += lanes.count) {
      float m = -INFINITY, sum = 0.0f, acc = 0.0f;
      if (seg.read_row >= 0 && ring_ok(p, seg.read_row)) {
        const float* a = p.ring + seg.read_row * row_stride;
        acc = a[c];
        m = a[p.d + c];
        sum = a[row_stride + c];
      }
      for (int64_t t = 0; t < seg.count; ++t) {
        const int64_t pos = seg.pos0 + t;
        const float v = p.kv[(seg.row0 + t) * p.kv_stride + c];
        const float logit = team::add_rn(p.score[(seg.row0 + t) * p.score_stride + c], p.ape[(pos % kRatio) * p.d + c]);
        // Explicitly rounded steps: nvcc would contract `sum * decay + 1` into an FMA, the host build not.
        if (logit > m) {
          const float decay = expf(m - logit);  // 0 for the first token (m = -inf)
          sum = team::add_rn(team::mul_rn(sum, decay), 1.0f);
          acc = team::add_rn(team::mul_rn(acc, decay), v);
          m = logit;
        } else {
          const float w = expf(logit - m);
          sum = team::add_rn(sum, w);
          acc = team::add_rn(acc, team::mul_rn(w, v));
        }
        const int64_t length = pos + 1;
        if (length >= seg.keep_from && length % kRatio != 0) {
          const int64_t row = seg.ring_base + 2 * (length % p.snapshots);
          if (ring_ok(p, row)) {
            float* a = p.ring + row * row_stride;
            a[c] = acc;
            a[p.d + c] = m;
            a[row_stride + c] = sum;
            a[row_stride + p.d + c] = 0.0f;
          }
        }
      }
      if (seg.out_row >= 0 && seg.out_row < p.num_out) p.out[seg.out_row * p.d + c] = sum > 0.0f ? acc / sum : 0.0f;
    }
  }
};

}  // namespace sparsekv::dsv4_compress

#ifdef SPARSEKV_HOST_ENTRY
#include "sparsekv/ffi.h"

namespace sparsekv::dsv4_compress {

// Launches the compressor of `ratio` over the events of `params` (the cpu backend: on up to
// num_threads host threads).
inline void launch_events(const EventParams& params, DLDevice device, int64_t num_threads) {
  if (params.ratio == 4) {
    launch_threaded<CompressEvents<4>>(params, device, num_threads,
                                       event_bytes_per_channel(4) * CompressEvents<4>::Narrow::kChunk, [] {});
  } else {
    launch_threaded<CompressEvents<128>>(params, device, num_threads,
                                         event_bytes_per_channel(128) * CompressEvents<128>::Narrow::kChunk, [] {});
  }
}

// One-shot compression of a whole sequence.
inline void compress_pool(TensorView kv, TensorView score, TensorView ape, int64_t ratio, TensorView out,
                          int64_t num_threads) {
  // 1. Validate.
  check_disjoint({read(kv, "kv"), read(score, "score"), read(ape, "ape"), written(out, "out")});
  const int64_t d = check_inputs(kv, score, ape, ratio);
  const int64_t entries = kv.size(0) / ratio;
  check(out, "out").dtype<float>().ndim(2).contiguous().same_device(kv, "kv");
  check(out, "out").size(0, entries, "T // ratio").size(1, d, "d");

  // 2. Derive sizes and launch.
  const EventParams params{static_cast<const float*>(kv.data_ptr()), static_cast<const float*>(score.data_ptr()),
                           kv.stride(0), score.stride(0), kv.size(0), static_cast<const float*>(ape.data_ptr()),
                           nullptr, 0, false, nullptr, static_cast<float*>(out.data_ptr()), entries, d, ratio};
  if (entries == 0) return;
  launch_events(params, kv.device(), num_threads);
}

// Streaming step of the raw ring: pools the planned events, then stores the planned ring rows.
inline void compress_extend(TensorView kv, TensorView score, TensorView ape, int64_t ratio, TensorView state,
                            TensorView sources, TensorView writes, TensorView out, int64_t num_threads) {
  // 1. Validate (memory first: the plan checks read `sources` and `writes`).
  check_disjoint({read(kv, "kv"), read(score, "score"), read(ape, "ape"), written(state, "state"),
                  read(sources, "sources"), read(writes, "writes"), written(out, "out")});
  check(out, "out").dtype<float>().ndim(2).contiguous().same_device(kv, "kv");
  const ExtendPlan plan = check_extend(kv, score, ape, ratio, state, sources, writes,
                                       static_cast<float*>(out.data_ptr()));
  check(out, "out").size(0, sources.size(0), "events").size(1, plan.events.d, "d");

  // 2. Pool every event (reading ring rows as they were), then store the new ring rows.
  if (plan.events.num_events > 0) launch_events(plan.events, kv.device(), num_threads);
  if (plan.ring.num_writes > 0) launch<RingWrite>(plan.ring, kv.device());
}

// Plans one streaming step of the raw ring on the tensor's device (PlanRawStep): `meta` int64
// [9 B + R] holds the StepRequest rows of the B requests, then the R ring ids they name; the
// tables of compress_extend (and the anchors and event requests of the fused store) go to `plan`
// int64 [E * (W + 2) + 2 M]: sources [E, W], anchors [E], event requests [E], writes [M, 2].
inline void plan_raw_step(TensorView meta, int64_t num_requests, int64_t ratio, int64_t ring_size, int64_t span,
                          int64_t num_events, int64_t num_writes, TensorView plan) {
  // 1. Validate.
  check_disjoint({read(meta, "meta"), written(plan, "plan")});
  coff_of(ratio);
  check(meta, "meta").dtype<int64_t>().ndim(1).contiguous().on_backend_device();
  check(plan, "plan").dtype<int64_t>().ndim(1).contiguous().same_device(meta, "meta");
  constexpr int64_t kFields = sizeof(StepRequest) / sizeof(int64_t);
  check_range(num_requests, 0, meta.size(0) / kFields, "num_requests");
  check_range(ring_size, 1, INT64_MAX - 1, "ring_size");
  check_range(span, 0, INT64_MAX - 1, "span");
  check_range(num_events, 0, INT64_MAX / 256, "num_events");
  check_range(num_writes, 0, INT64_MAX / 4, "num_writes");
  const int64_t window = window_of(ratio);
  check(plan, "plan").size(0, num_events * (window + 2) + 2 * num_writes, "E (W + 2) + 2 M");
  if (num_requests == 0 && num_events + num_writes > 0) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `num_requests` is 0 but the step has " << num_events
                              << " events and " << num_writes << " writes";
  }

  // 2. Derive the tables' places and launch.
  const auto* in = static_cast<const int64_t*>(meta.data_ptr());
  auto* out = static_cast<int64_t*>(plan.data_ptr());
  const PlanParams params{reinterpret_cast<const StepRequest*>(in), num_requests, in + kFields * num_requests,
                          meta.size(0) - kFields * num_requests, ratio, ring_size, span, num_events, num_writes, out,
                          out + num_events * window, out + num_events * (window + 1), out + num_events * (window + 2)};
  if (num_events + num_writes > 0) launch<PlanRawStep>(params, meta.device());
}

// One decode step of the raw ring: each batch row's new token into its ring row, and the entry it
// completes (zeros and emitted = false for a row whose token completes none).
inline void compress_decode(TensorView kv, TensorView score, TensorView ape, int64_t ratio, TensorView state,
                            TensorView state_rows, TensorView positions, TensorView out, TensorView emitted) {
  // 1. Validate (memory first: the row checks read `state_rows` and `positions`).
  check_disjoint({read(kv, "kv"), read(score, "score"), read(ape, "ape"), written(state, "state"),
                  read(state_rows, "state_rows"), read(positions, "positions"), written(out, "out"),
                  written(emitted, "emitted")});
  check(out, "out").dtype<float>().ndim(2).contiguous().same_device(kv, "kv");
  const ExtendPlan plan = check_decode(kv, score, ape, ratio, state, state_rows, positions, emitted,
                                       static_cast<float*>(out.data_ptr()));
  check(out, "out").size(0, kv.size(0), "rows of kv").size(1, plan.events.d, "d");

  // 2. Pool every row's window (reading ring rows as they were), then store the new ring rows.
  if (plan.events.num_events > 0) launch_events(plan.events, kv.device(), 1);
  if (plan.ring.num_writes > 0) launch<RingWrite>(plan.ring, kv.device());
}

// Streaming step of the online C128 state.
inline void compress_online_c128(TensorView kv, TensorView score, TensorView ape, TensorView state,
                                 int64_t snapshots, TensorView segments, TensorView out) {
  // 1. Validate (memory first: the segment checks read `segments`).
  check_disjoint({read(kv, "kv"), read(score, "score"), read(ape, "ape"), written(state, "state"),
                  read(segments, "segments"), written(out, "out")});
  const int64_t d = check_inputs(kv, score, ape, 128);
  check_state(state, kv, d, false);
  check(segments, "segments").dtype<int64_t>().ndim(2).contiguous().same_device(kv, "kv").size(1, 7, "fields");
  check(out, "out").dtype<float>().ndim(2).contiguous().same_device(kv, "kv").size(1, d, "d");
  if (snapshots < 1) TVM_FFI_THROW(ValueError) << "sparsekv: argument `snapshots` must be >= 1, got " << snapshots;
  const int64_t ring_rows = state.size(0);
  const auto* segs = static_cast<const Segment*>(segments.data_ptr());
  if (kv.device().device_type != kDLCUDA) {
    for (int64_t k = 0; k < segments.size(0); ++k) {
      const Segment& s = segs[k];
      const bool ok = s.row0 >= 0 && s.count >= 1 && s.row0 + s.count <= kv.size(0) && s.pos0 >= 0 &&
                      s.pos0 / 128 == (s.pos0 + s.count - 1) / 128 && s.read_row >= -1 &&
                      s.read_row + 1 < ring_rows && s.out_row >= -1 && s.out_row < out.size(0) &&
                      s.ring_base >= 0 && s.ring_base + 2 * snapshots <= ring_rows;
      if (!ok) {
        TVM_FFI_THROW(IndexError) << "sparsekv: argument `segments` row " << k << " names rows outside kv ("
                                  << kv.size(0) << "), state (" << ring_rows << ") or out (" << out.size(0)
                                  << "), or spans two windows";
      }
    }
  }

  // 2. Launch.
  const OnlineParams params{static_cast<const float*>(kv.data_ptr()), static_cast<const float*>(score.data_ptr()),
                            kv.stride(0), score.stride(0), kv.size(0), static_cast<const float*>(ape.data_ptr()),
                            static_cast<float*>(state.data_ptr()), ring_rows, snapshots, segs, segments.size(0),
                            static_cast<float*>(out.data_ptr()), out.size(0), d};
  if (params.num_segments > 0) launch<OnlineC128>(params, kv.device());
}

}  // namespace sparsekv::dsv4_compress
#endif
