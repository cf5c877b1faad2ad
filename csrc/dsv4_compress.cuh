// dsv4_compress: the DSV4 compressors (C4: overlapping windows of 8, stride 4; C128: windows of
// 128) over raw token rows, the ring writes of the streaming state, and the online C128 fold.
//
// Contract. Token t brings kv_t and score_t (float32, coff * d wide, coff = 2 for ratio 4, 1 for
// ratio 128) and ape is float32 [ratio, coff * d]. Entry i is, independently per channel c < d,
//   out[i, c] = sum_j softmax_j(logit_j) * value_j
// over the slots j of its window:
//   ratio 128: slot j < 128 is token 128 i + j: value kv[., c], logit score[., c] + ape[j, c].
//   ratio 4:   slot j < 4 is token 4 (i - 1) + j with the A half: value kv[., c], logit
//              score[., c] + ape[j, c] (masked out for i = 0); slot 4 + j is token 4 i + j with the
//              B half: value kv[., d + c], logit score[., d + c] + ape[j, d + c].
// The softmax subtracts the slot maximum first; masked slots take no part. With a bf16 state ring
// (the pool's bf16 compress-state option) every kv and score is rounded to bf16 before pooling,
// input rows as well as ring rows, so entries still do not depend on how a sequence was chunked.
//
// Kernels:
//   CompressEvents: one entry per event. A slot's token row comes from the ragged input or from
//     a ring row of the state buffer, as the event's source table says (source >= 0: input row;
//     -1: masked; <= -2: ring row -source - 2). Without a source table the input is one whole
//     sequence and event i reads tokens ratio * i - (4 for C4) ... directly (compress_pool).
//   RingWrite: copies input rows into ring rows ([kv | score], 2 * coff * d floats per row).
//   Decode step (DecodeRows): both of the above for one new token per batch row, with the sources
//     and ring rows read on the device from the caller's state rows and positions (no host plan).
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
// GPU: one warp per (event, 32-channel tile); lane = channel, so each slot is one 128-byte load.
// cpu backend: the events of a prefill call (compress_pool, compress_extend and the fused store)
// run on up to num_threads host threads (run_on_host_threads); each item is computed whole by one
// thread, so the output does not depend on the thread count.
#pragma once

#include <cmath>

#include "sparsekv/fp8.h"
#include "sparsekv/portability.h"
#include "sparsekv/lane_reduce.h"

namespace sparsekv::dsv4_compress {

inline constexpr int kTile = team::kTeamLanes;  // one channel per (virtual) lane

// A decode step: one new token per batch row b, at positions[b]. rows[b, j] is the ring row of
// position positions[b] - (W - 1) + j (W = window_of(ratio)); j = W - 1 is the new token's own row.
// The row's token completes an entry iff (positions[b] + 1) % ratio == 0, and that entry's window
// is exactly those W positions. Planned on the device: nothing is read on the host.
struct DecodeRows {
  const void* rows = nullptr;  // int32 or int64 [batch, W], row stride `stride`; null: not a decode step
  bool rows_int64 = false;
  int64_t stride = 0;
  const int64_t* positions = nullptr;  // [batch]
  int64_t ratio = 0;

  SPARSEKV_HOST_DEVICE int64_t row(int64_t b, int64_t j) const {
    return rows_int64 ? static_cast<const int64_t*>(rows)[b * stride + j]
                      : static_cast<int64_t>(static_cast<const int32_t*>(rows)[b * stride + j]);
  }
  SPARSEKV_HOST_DEVICE bool emits(int64_t b) const { return positions[b] >= 0 && (positions[b] + 1) % ratio == 0; }
};

struct EventParams {
  const float* kv;
  const float* score;
  int64_t kv_stride;  // floats between input rows
  int64_t score_stride;
  int64_t num_inputs;
  const float* ape;      // [ratio, coff * d], contiguous
  const void* ring;      // [ring_rows, 2 * coff * d] float or bf16, contiguous (null without sources)
  int64_t num_ring_rows;
  bool ring_bf16;  // a bf16 ring: every pooled kv and score (input rows too) is rounded to bf16 first
  const int64_t* sources;  // [num_events, window] or null (one-shot)
  float* out;              // [num_events, d]
  int64_t num_events;
  int64_t d;
  int64_t ratio;
  DecodeRows decode{};      // a decode step: event e is batch row e (sources unused)
  bool* emitted = nullptr;  // decode: [batch], whether row e completed an entry
};

// Window slots of an entry: 8 for ratio 4 (two halves of 4), 128 for ratio 128.
SPARSEKV_HOST_DEVICE int64_t window_of(int64_t ratio) { return ratio == 4 ? 8 : ratio; }

// The bytes an event reads per pooled channel (kv and score of every window slot): the work measure
// by which the threaded host driver splits events over threads.
inline int64_t event_bytes_per_channel(int64_t ratio) {
  return window_of(ratio) * 2 * static_cast<int64_t>(sizeof(float));
}

struct CompressEvents {
  using Params = EventParams;

  SPARSEKV_HOST_DEVICE static int64_t tiles(const Params& p) { return (p.d + kTile - 1) / kTile; }
  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.num_events * tiles(p); }

  // The rows of slot j of event e: value row (kv), logit rows (score, ape), already offset to the
  // slot's half; false if the slot is masked or names a row outside its table.
  struct SlotRows {
    const float* kv;  // input rows (float32), or null when the slot is in a bf16 ring
    const float* score;
    const uint16_t* kv16;  // bf16 ring rows
    const uint16_t* score16;
    const float* ape;
  };

  // Value (kv) and score of channel c of a slot; a bf16 ring (kBf16) rounds input rows alike.
  template <bool kBf16>
  SPARSEKV_HOST_DEVICE static float kv_at(const SlotRows& r, int64_t c) {
    if constexpr (kBf16) return r.kv ? fp8::round_bf16(r.kv[c]) : fp8::bf16_to_float(r.kv16[c]);
    return r.kv[c];
  }
  template <bool kBf16>
  SPARSEKV_HOST_DEVICE static float score_at(const SlotRows& r, int64_t c) {
    if constexpr (kBf16) return r.score ? fp8::round_bf16(r.score[c]) : fp8::bf16_to_float(r.score16[c]);
    return r.score[c];
  }
  SPARSEKV_HOST_DEVICE static bool slot_rows(const Params& p, int64_t e, int64_t j, SlotRows& rows) {
    const int64_t coff = p.ratio == 4 ? 2 : 1;
    const int64_t half = (p.ratio == 4 && j >= 4) ? p.d : 0;
    const int64_t ape_row = p.ratio == 4 ? (j & 3) : j;
    int64_t src;
    if (p.decode.rows != nullptr) {
      const int64_t last = window_of(p.ratio) - 1;
      if (p.decode.positions[e] - last + j < 0) return false;  // before the sequence (C4's entry 0)
      if (j == last) {
        src = e;  // the new token: input row e
      } else {
        const int64_t r = p.decode.row(e, j);
        if (r < 0) return false;
        src = -2 - r;
      }
    } else if (p.sources != nullptr) {
      src = p.sources[e * window_of(p.ratio) + j];
    } else {
      src = p.ratio == 4 ? 4 * e + j - 4 : p.ratio * e + j;  // negative: the masked A half of entry 0
      if (src < 0) src = -1;
    }
    rows = SlotRows{nullptr, nullptr, nullptr, nullptr, nullptr};
    if (src >= 0) {
      if (src >= p.num_inputs) return false;
      rows.kv = p.kv + src * p.kv_stride + half;
      rows.score = p.score + src * p.score_stride + half;
    } else if (src <= -2) {
      const int64_t r = -src - 2;
      if (r >= p.num_ring_rows) return false;
      const int64_t offset = r * 2 * coff * p.d + half;
      if (p.ring_bf16) {
        rows.kv16 = static_cast<const uint16_t*>(p.ring) + offset;
        rows.score16 = rows.kv16 + coff * p.d;
      } else {
        rows.kv = static_cast<const float*>(p.ring) + offset;
        rows.score = rows.kv + coff * p.d;
      }
    } else {
      return false;
    }
    rows.ape = p.ape + ape_row * coff * p.d + half;
    return true;
  }

  // Channels first + lanes.lane + v (v < kVirtualPerThread, those below d) of event e: two passes
  // over the slots (the maximum, then the weights exp(logit - max)), every step rounded as written,
  // so the fused store (dsv4_compress_store.cuh) produces the same floats. On the host one call covers a
  // whole 32-channel tile with the channel loop innermost.
  template <bool kBf16>
  SPARSEKV_HOST_DEVICE static void pool_tile_as(const Params& p, int64_t e, int64_t first, Lanes lanes,
                                                float (&out)[team::kVirtualPerThread]) {
    constexpr int kV = team::kVirtualPerThread;
    const int64_t window = window_of(p.ratio);
    const int64_t c0 = first + lanes.lane;
    const int count = static_cast<int>(c0 >= p.d ? 0 : (p.d - c0 < kV ? p.d - c0 : kV));
    float m[kV], sum[kV], acc[kV];
    for (int v = 0; v < kV; ++v) m[v] = -INFINITY, sum[v] = 0.0f, acc[v] = 0.0f;
    SlotRows rows;
    for (int64_t j = 0; j < window; ++j) {
      if (!slot_rows(p, e, j, rows)) continue;
      for (int v = 0; v < count; ++v) {
        const float logit = team::add_rn(score_at<kBf16>(rows, c0 + v), rows.ape[c0 + v]);
        m[v] = logit > m[v] ? logit : m[v];
      }
    }
    for (int64_t j = 0; j < window; ++j) {
      if (!slot_rows(p, e, j, rows)) continue;
      for (int v = 0; v < count; ++v) {
        const float w = expf(team::sub_rn(team::add_rn(score_at<kBf16>(rows, c0 + v), rows.ape[c0 + v]), m[v]));
        sum[v] = team::add_rn(sum[v], w);
        acc[v] = team::add_rn(acc[v], team::mul_rn(w, kv_at<kBf16>(rows, c0 + v)));
      }
    }
    for (int v = 0; v < kV; ++v) out[v] = sum[v] > 0.0f ? acc[v] / sum[v] : 0.0f;
  }

  SPARSEKV_HOST_DEVICE static void pool_tile(const Params& p, int64_t e, int64_t first, Lanes lanes,
                                             float (&out)[team::kVirtualPerThread]) {
    if (p.ring_bf16) {
      pool_tile_as<true>(p, e, first, lanes, out);
    } else {
      pool_tile_as<false>(p, e, first, lanes, out);
    }
  }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const int64_t e = i / tiles(p);
    const int64_t first = (i - e * tiles(p)) * kTile;
    float out[team::kVirtualPerThread];
    const bool emits = p.decode.rows == nullptr || p.decode.emits(e);
    if (p.emitted != nullptr && first == 0 && lanes.lane == 0) p.emitted[e] = emits;
    if (emits) {
      pool_tile(p, e, first, lanes, out);
    } else {
      for (int v = 0; v < team::kVirtualPerThread; ++v) out[v] = 0.0f;  // a decode row without an entry
    }
    for (int v = 0; v < team::kVirtualPerThread; ++v) {
      const int64_t c = first + lanes.lane + v;
      if (c < p.d) p.out[e * p.d + c] = out[v];
    }
  }
};

struct WriteParams {
  const float* kv;
  const float* score;
  int64_t kv_stride;
  int64_t score_stride;
  int64_t num_inputs;
  void* ring;  // float or bf16 (ring_bf16)
  int64_t num_ring_rows;
  bool ring_bf16;
  const int64_t* writes;  // [num_writes, 2]: (input row, ring row)
  int64_t num_writes;
  int64_t width;      // coff * d
  DecodeRows decode{};  // a decode step: write i is input row i into its own ring row (writes unused)
};

struct RingWrite {
  using Params = WriteParams;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.num_writes; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const bool decode = p.decode.rows != nullptr;
    const int64_t src = decode ? i : p.writes[2 * i];
    const int64_t dst = decode ? p.decode.row(i, window_of(p.decode.ratio) - 1) : p.writes[2 * i + 1];
    if (src < 0 || src >= p.num_inputs || dst < 0 || dst >= p.num_ring_rows) return;
    const float* kv = p.kv + src * p.kv_stride;
    const float* score = p.score + src * p.score_stride;
    if (p.ring_bf16) {
      uint16_t* row = static_cast<uint16_t*>(p.ring) + dst * 2 * p.width;
      for (int64_t c = lanes.lane; c < p.width; c += lanes.count) {
        row[c] = fp8::float_to_bf16(kv[c]);
        row[p.width + c] = fp8::float_to_bf16(score[c]);
      }
      return;
    }
    float* row = static_cast<float*>(p.ring) + dst * 2 * p.width;
    copy_bytes(row, kv, p.width * 4, lanes);
    copy_bytes(row + p.width, score, p.width * 4, lanes);
  }
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
#include <algorithm>
#include <vector>

#include "sparsekv/ffi.h"

namespace sparsekv::dsv4_compress {

inline int64_t coff_of(int64_t ratio) {
  if (ratio != 4 && ratio != 128) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `ratio` must be 4 or 128, got " << ratio;
  }
  return ratio == 4 ? 2 : 1;
}

// kv and score: float32 [N, coff * d] (unit last stride); returns d.
inline int64_t check_inputs(TensorView kv, TensorView score, TensorView ape, int64_t ratio) {
  const int64_t coff = coff_of(ratio);
  check(kv, "kv").dtype<float>().ndim(2).rows_dense().on_backend_device();
  check(score, "score").dtype<float>().ndim(2).rows_dense().same_device(kv, "kv");
  check(score, "score").size(0, kv.size(0), "rows of kv").size(1, kv.size(1), "width of kv");
  if (kv.size(1) == 0 || kv.size(1) % coff != 0) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `kv` must have a positive width divisible by " << coff
                              << " for ratio " << ratio << ", got shape " << shape_string(kv);
  }
  check(ape, "ape").dtype<float>().ndim(2).contiguous().same_device(kv, "kv");
  check(ape, "ape").size(0, ratio, "ratio").size(1, kv.size(1), "width of kv");
  return kv.size(1) / coff;
}

// The state ring: float32, or bfloat16 when allow_bf16; returns true for bf16.
inline bool check_state(TensorView state, TensorView kv, int64_t width, bool allow_bf16) {
  const bool bf16 = allow_bf16 && state.dtype() == DLDataType{kDLBfloat, 16, 1};
  if (!bf16) check(state, "state").dtype<float>();
  check(state, "state").ndim(2).contiguous().same_device(kv, "kv");
  check(state, "state").size(1, 2 * width, "2 x width of kv");
  return bf16;
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
  launch_threaded<CompressEvents>(params, kv.device(), num_threads, event_bytes_per_channel(ratio) * kTile, [] {});
}

struct ExtendPlan {
  EventParams events;
  WriteParams ring;
};

// Validates one streaming step of the raw ring (inputs, state, the event sources and ring writes)
// and returns its launch parameters; events write to `out` (null for the fused store).
inline ExtendPlan check_extend(TensorView kv, TensorView score, TensorView ape, int64_t ratio, TensorView state,
                               TensorView sources, TensorView writes, float* out) {
  const int64_t d = check_inputs(kv, score, ape, ratio);
  const int64_t width = kv.size(1);
  const bool ring_bf16 = check_state(state, kv, width, true);
  check(sources, "sources").dtype<int64_t>().ndim(2).contiguous().same_device(kv, "kv");
  check(sources, "sources").size(1, window_of(ratio), "window slots");
  check(writes, "writes").dtype<int64_t>().ndim(2).contiguous().same_device(kv, "kv").size(1, 2, "pairs");
  const int64_t ring_rows = state.size(0);
  if (kv.device().device_type != kDLCUDA) {
    const auto* src = static_cast<const int64_t*>(sources.data_ptr());
    for (int64_t k = 0; k < sources.numel(); ++k) {
      const int64_t v = src[k];
      if (v >= kv.size(0) || (v <= -2 && -v - 2 >= ring_rows)) {
        TVM_FFI_THROW(IndexError) << "sparsekv: argument `sources` entry " << k << " = " << v
                                  << " names a row outside kv (" << kv.size(0) << ") or state (" << ring_rows << ")";
      }
    }
    const auto* w = static_cast<const int64_t*>(writes.data_ptr());
    for (int64_t k = 0; k < writes.size(0); ++k) {
      if (w[2 * k] < 0 || w[2 * k] >= kv.size(0) || w[2 * k + 1] < 0 || w[2 * k + 1] >= ring_rows) {
        TVM_FFI_THROW(IndexError) << "sparsekv: argument `writes` pair " << k << " = (" << w[2 * k] << ", "
                                  << w[2 * k + 1] << ") is outside kv or state";
      }
    }
  }
  return {EventParams{static_cast<const float*>(kv.data_ptr()), static_cast<const float*>(score.data_ptr()),
                      kv.stride(0), score.stride(0), kv.size(0), static_cast<const float*>(ape.data_ptr()),
                      state.data_ptr(), ring_rows, ring_bf16, static_cast<const int64_t*>(sources.data_ptr()), out,
                      sources.size(0), d, ratio},
          WriteParams{static_cast<const float*>(kv.data_ptr()), static_cast<const float*>(score.data_ptr()),
                      kv.stride(0), score.stride(0), kv.size(0), state.data_ptr(), ring_rows, ring_bf16,
                      static_cast<const int64_t*>(writes.data_ptr()), writes.size(0), width}};
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
  if (plan.events.num_events > 0) {
    launch_threaded<CompressEvents>(plan.events, kv.device(), num_threads,
                                    event_bytes_per_channel(ratio) * kTile, [] {});
  }
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

// Validates a decode step (inputs, state, the state rows and positions of each batch row) and returns
// its launch parameters; events write to `out` (null for the fused store). Host-readable tables are
// checked in full: every ring row the step reads or writes is in `state`, no two rows write one ring row.
inline ExtendPlan check_decode(TensorView kv, TensorView score, TensorView ape, int64_t ratio, TensorView state,
                               TensorView state_rows, TensorView positions, TensorView emitted, float* out) {
  const int64_t d = check_inputs(kv, score, ape, ratio);
  const int64_t width = kv.size(1), batch = kv.size(0), window = window_of(ratio);
  const bool ring_bf16 = check_state(state, kv, width, true);
  const bool rows64 = state_rows.dtype() == dtype_of<int64_t>();
  if (!rows64 && !(state_rows.dtype() == dtype_of<int32_t>())) {
    TVM_FFI_THROW(TypeError) << "sparsekv: argument `state_rows` must have dtype int32 or int64, got "
                             << dtype_name(state_rows.dtype());
  }
  check(state_rows, "state_rows").ndim(2).rows_dense().same_device(kv, "kv").size(0, batch, "rows of kv");
  check(state_rows, "state_rows").size(1, window, "the window (8 for ratio 4, 128 for ratio 128)");
  check(positions, "positions").dtype<int64_t>().ndim(1).contiguous().same_device(kv, "kv");
  check(positions, "positions").size(0, batch, "rows of kv");
  check(emitted, "emitted").dtype<bool>().ndim(1).contiguous().same_device(kv, "kv").size(0, batch, "rows of kv");
  const int64_t ring_rows = state.size(0);
  const DecodeRows decode{state_rows.data_ptr(), rows64, state_rows.stride(0),
                          static_cast<const int64_t*>(positions.data_ptr()), ratio};
  if (kv.device().device_type != kDLCUDA) {
    std::vector<int64_t> written(batch);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t pos = decode.positions[b];
      if (pos < 0) TVM_FFI_THROW(IndexError) << "sparsekv: argument `positions`[" << b << "] = " << pos << " is negative";
      for (int64_t j = pos < window - 1 ? window - 1 - pos : 0; j < window; ++j) {
        const int64_t r = decode.row(b, j);
        if (r < 0 || r >= ring_rows) {
          TVM_FFI_THROW(IndexError) << "sparsekv: argument `state_rows`[" << b << ", " << j << "] = " << r
                                    << " is outside state [0, " << ring_rows << ")";
        }
      }
      written[b] = decode.row(b, window - 1);
    }
    std::sort(written.begin(), written.end());
    for (int64_t b = 1; b < batch; ++b) {
      if (written[b] == written[b - 1]) {
        TVM_FFI_THROW(ValueError) << "sparsekv: argument `state_rows` gives ring row " << written[b]
                                  << " to the new token of two batch rows";
      }
    }
  }
  EventParams events{static_cast<const float*>(kv.data_ptr()), static_cast<const float*>(score.data_ptr()),
                     kv.stride(0), score.stride(0), batch, static_cast<const float*>(ape.data_ptr()),
                     state.data_ptr(), ring_rows, ring_bf16, nullptr, out, batch, d, ratio};
  events.decode = decode;
  events.emitted = static_cast<bool*>(emitted.data_ptr());
  WriteParams ring{static_cast<const float*>(kv.data_ptr()), static_cast<const float*>(score.data_ptr()),
                   kv.stride(0), score.stride(0), batch, state.data_ptr(), ring_rows, ring_bf16, nullptr, batch, width};
  ring.decode = decode;
  return {events, ring};
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
  if (plan.events.num_events > 0) launch<CompressEvents>(plan.events, kv.device());
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
