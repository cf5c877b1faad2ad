// window_pool: the DSV4 compressors' window pooling and ring writes, the building blocks of the
// compressor (dsv4_compress) and of the compressor fused with the store (dsv4_compress_store). In
// namespace dsv4_compress, whose kernels (CompressEvents, RingWrite) are these.
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
//   RingWrite: copies input rows into ring rows ([kv | score], 2 * coff * d floats or bf16 per row),
//     as 16-byte words (RingRow).
//   Decode step (DecodeRows): both of the above for one new token per batch row, with the sources
//     and ring rows read on the device from the caller's state rows and positions (no host plan).
//
// Building blocks:
//   WindowPool: the pooled channels of one event. A slot's token row comes from the ragged input or
//     from a ring row of the state buffer, as the event's source table says (source >= 0: input
//     row; -1: masked; <= -2: ring row -source - 2). Without a source table the input is one whole
//     sequence and event i reads tokens ratio * i - (4 for C4) ... directly (compress_pool). Its
//     forms: pool_streamed (a channel a lane, any rows), pool_slots (C4 from 16-byte aligned rows,
//     the window held in a warp's registers) and pool_split (C128 from 16-byte aligned rows, the
//     window split over a CTA's warps), the same floats.
//   RingWrite: copies input rows into ring rows ([kv | score], 2 * coff * d floats per row).
//   Decode step (DecodeRows): both of the above for one new token per batch row, with the sources
//     and ring rows read on the device from the caller's state rows and positions (no host plan).
// The host section checks a streaming step's or a decode step's inputs, state and tables
// (check_extend, check_decode) and returns their launch parameters.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "sparsekv/fp8.h"
#include "sparsekv/lane_reduce.h"
#include "sparsekv/portability.h"

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

struct WindowPool {
  using Params = EventParams;

  // The rows of slot j of event e: value row (kv), logit rows (score, ape), already offset to the
  // slot's half; false if the slot is masked or names a row outside its table.
  struct SlotRows {
    const float* kv;  // input rows (float32), or null when the slot is in a bf16 ring
    const float* score;
    const uint16_t* kv16;  // bf16 ring rows
    const uint16_t* score16;
    const float* ape;
  };

  // p.ratio, or kRatio where the caller knows it at compile time (its index arithmetic then folds).
  template <int64_t kRatio>
  SPARSEKV_HOST_DEVICE static int64_t ratio_of(const Params& p) { return kRatio != 0 ? kRatio : p.ratio; }

  // The token row of slot j of event e: >= 0 an input row, <= -2 ring row -source - 2, -1 none (a
  // masked slot, or a row outside its table).
  template <int64_t kRatio = 0>
  SPARSEKV_HOST_DEVICE static int64_t source(const Params& p, int64_t e, int64_t j) {
    const int64_t ratio = ratio_of<kRatio>(p);
    int64_t src;
    if (p.decode.rows != nullptr) {
      const int64_t last = window_of(ratio) - 1;
      if (p.decode.positions[e] - last + j < 0) return -1;  // before the sequence (C4's entry 0)
      if (j == last) return e;  // the new token: input row e
      const int64_t r = p.decode.row(e, j);
      src = r < 0 ? -1 : -2 - r;
    } else if (p.sources != nullptr) {
      src = p.sources[e * window_of(ratio) + j];
    } else {
      src = ratio == 4 ? 4 * e + j - 4 : ratio * e + j;  // negative: the masked A half of entry 0
      if (src < 0) src = -1;
    }
    return src >= p.num_inputs || (src <= -2 && -src - 2 >= p.num_ring_rows) ? -1 : src;
  }

  // The rows of slot j whose token row is src (source()); false if it has none.
  template <bool kBf16, int64_t kRatio = 0>
  SPARSEKV_HOST_DEVICE static bool rows_of(const Params& p, int64_t src, int64_t j, SlotRows& rows) {
    const int64_t ratio = ratio_of<kRatio>(p);
    const int64_t coff = ratio == 4 ? 2 : 1;
    const int64_t half = (ratio == 4 && j >= 4) ? p.d : 0;
    const int64_t ape_row = ratio == 4 ? (j & 3) : j;
    if (src == -1) return false;
    rows = SlotRows{nullptr, nullptr, nullptr, nullptr, p.ape + ape_row * coff * p.d + half};
    if (src >= 0) {
      rows.kv = p.kv + src * p.kv_stride + half;
      rows.score = p.score + src * p.score_stride + half;
    } else if (src <= -2) {
      const int64_t offset = (-src - 2) * 2 * coff * p.d + half;
      if constexpr (kBf16) {
        rows.kv16 = static_cast<const uint16_t*>(p.ring) + offset;
        rows.score16 = rows.kv16 + coff * p.d;
      } else {
        rows.kv = static_cast<const float*>(p.ring) + offset;
        rows.score = rows.kv + coff * p.d;
      }
    }
    return true;
  }

  template <bool kBf16, int64_t kRatio = 0>
  SPARSEKV_HOST_DEVICE static bool slot_rows(const Params& p, int64_t e, int64_t j, SlotRows& rows) {
    return rows_of<kBf16, kRatio>(p, source<kRatio>(p, e, j), j, rows);
  }

  // The C lanes' values of channels c0 .. c0 + count - 1 of a row (the rest 0). kWide: one 16-byte
  // load per 4 channels (the caller checked that the row and c0 are 16-byte aligned and count = C).
  template <bool kWide, int C>
  SPARSEKV_HOST_DEVICE static void load(const float* row, int64_t c0, int count, float (&v)[C]) {
#ifdef __CUDA_ARCH__
    if constexpr (kWide) {
      static_assert(C % 4 == 0, "window_pool: wide loads take 4 channels at a time");
      for (int q = 0; q < C / 4; ++q) {
        const float4 f = *reinterpret_cast<const float4*>(row + c0 + 4 * q);
        v[4 * q] = f.x, v[4 * q + 1] = f.y, v[4 * q + 2] = f.z, v[4 * q + 3] = f.w;
      }
      return;
    }
#endif
    for (int i = 0; i < C; ++i) v[i] = i < count ? row[c0 + i] : 0.0f;
  }
  // The same of a bf16 row (kWide: one 8-byte load per 4 channels).
  template <bool kWide, int C>
  SPARSEKV_HOST_DEVICE static void load(const uint16_t* row, int64_t c0, int count, float (&v)[C]) {
#ifdef __CUDA_ARCH__
    if constexpr (kWide) {
      static_assert(C % 4 == 0, "window_pool: wide loads take 4 channels at a time");
      for (int q = 0; q < C / 4; ++q) {
        const uint2 w = *reinterpret_cast<const uint2*>(row + c0 + 4 * q);
        v[4 * q] = fp8::bf16_to_float(static_cast<uint16_t>(w.x)), v[4 * q + 1] = fp8::bf16_to_float(w.x >> 16);
        v[4 * q + 2] = fp8::bf16_to_float(static_cast<uint16_t>(w.y)), v[4 * q + 3] = fp8::bf16_to_float(w.y >> 16);
      }
      return;
    }
#endif
    for (int i = 0; i < C; ++i) v[i] = i < count ? fp8::bf16_to_float(row[c0 + i]) : 0.0f;
  }
  // Channels c0 .. c0 + count - 1 of a slot's kv or score row: the float32 row `row` (an input row,
  // or a float32 ring's), else the bf16 ring row `row16`; a bf16 ring (kBf16) rounds input rows alike.
  template <bool kBf16, bool kWide, int C>
  SPARSEKV_HOST_DEVICE static void load_row(const float* row, const uint16_t* row16, int64_t c0, int count,
                                            float (&v)[C]) {
    if constexpr (kWide || !kBf16) {
      if (!kBf16 || row != nullptr) {
        load<kWide>(row, c0, count, v);
        if constexpr (kBf16) {
          for (int i = 0; i < C; ++i) v[i] = fp8::round_bf16(v[i]);
        }
      } else {
        load<kWide>(row16, c0, count, v);
      }
    } else {  // a select a channel, not a branch a row: the one-channel-a-lane loops stay short
      for (int i = 0; i < C; ++i) {
        v[i] = i < count ? (row != nullptr ? fp8::round_bf16(row[c0 + i]) : fp8::bf16_to_float(row16[c0 + i])) : 0.0f;
      }
    }
  }

  // The ape row of slot j (rows_of's rows.ape; an unused slot reads it as its score and value too).
  template <int64_t kRatio>
  SPARSEKV_HOST_DEVICE static const float* ape_row_of(const Params& p, int64_t j) {
    return p.ape + (kRatio == 4 ? ((j & 3) * 2 + (j >> 2)) * p.d : j * p.d);
  }

  // The rows of slot j (token row src, source()) that the held forms read: rows_of's, or, for an
  // unused slot (src = -1), its ape row in place of each (read, and ignored): no branch a slot.
  template <bool kBf16, int64_t kRatio>
  SPARSEKV_HOST_DEVICE static SlotRows held_rows(const Params& p, int64_t src, int64_t j) {
    const float* ape_row = ape_row_of<kRatio>(p, j);
    SlotRows rows;
    if (!rows_of<kBf16, kRatio>(p, src, j, rows)) rows = SlotRows{ape_row, ape_row, nullptr, nullptr, ape_row};
    rows.ape = ape_row;  // as rows_of's, by the one expression
    return rows;
  }

  // The logits (score + ape) of channels c0 .. c0 + C - 1 of a slot (its held_rows), from 16-byte
  // aligned rows (the caller checked); -inf for an unused slot.
  template <bool kBf16, int C>
  SPARSEKV_HOST_DEVICE static void held_logits(const SlotRows& rows, bool used, int64_t c0, int count,
                                               float (&logit)[C]) {
    float ape[C];
    load_row<kBf16, true>(rows.score, rows.score16, c0, count, logit);
    load<true>(rows.ape, c0, count, ape);
    for (int v = 0; v < C; ++v) logit[v] = used ? team::add_rn(logit[v], ape[v]) : -INFINITY;
  }

  // The weights exp(logit - m) of a slot (its held_rows, its logits from held_logits) and their
  // products with its values (kv, 0 for an unused slot), every step rounded as written: the terms
  // that a channel's sum and acc add up in slot order. An unused slot's terms leave them as skipping
  // it would: with m finite its weight exp(-inf) is +0, and sum + 0, acc + 0 * 0 are sum and acc
  // (neither is ever -0: each starts at +0); with m = -inf (every used logit -inf or none used)
  // sum is NaN or 0 either way, and the entry 0.
  template <bool kBf16, int C>
  SPARSEKV_HOST_DEVICE static void held_terms(const SlotRows& rows, bool used, int64_t c0, int count,
                                              const float (&logit)[C], const float (&m)[C], float (&weight)[C],
                                              float (&product)[C]) {
    float value[C];
    load_row<kBf16, true>(rows.kv, rows.kv16, c0, count, value);
    for (int v = 0; v < C; ++v) {
      weight[v] = expf(team::sub_rn(logit[v], m[v]));
      product[v] = team::mul_rn(weight[v], used ? value[v] : 0.0f);
    }
  }

  // An entry channel from its sums: acc / sum, 0 where no weight counts.
  SPARSEKV_HOST_DEVICE static float entry_of(float sum, float acc) { return sum > 0.0f ? acc / sum : 0.0f; }

  // Channels c0 .. c0 + C - 1 of a C4 event whose slots' token rows are src (source()), from 16-byte
  // aligned rows (the GPU's 16-byte loads; the caller checked), every step rounded as written and in
  // slot order per channel, so this form, pool_streamed (a channel a lane, 32 a host call), pool_split
  // and the fused store produce the same floats: the maximum of the logits, then sum and acc of the
  // weights exp(logit - max). The 8 slots are unrolled and their logits held in registers, so each row
  // is read once: score and ape for the max, kv for the weighted sum.
  template <bool kBf16, int C>
  SPARSEKV_HOST_DEVICE static void pool_slots(const Params& p, const int64_t (&src)[8], int64_t c0, int count,
                                              float (&out)[C]) {
    float m[C], sum[C], acc[C], weight[C], product[C];
    float logit[8][C];
    for (int v = 0; v < C; ++v) m[v] = -INFINITY, sum[v] = 0.0f, acc[v] = 0.0f;
    SPARSEKV_UNROLLED  // the logits stay in registers; the values are read in the second pass
    for (int j = 0; j < 8; ++j) {
      held_logits<kBf16>(held_rows<kBf16, 4>(p, src[j], j), src[j] != -1, c0, count, logit[j]);
      for (int v = 0; v < C; ++v) m[v] = logit[j][v] > m[v] ? logit[j][v] : m[v];
    }
    SlotRows rows;
    SPARSEKV_UNROLLED
    for (int j = 0; j < 8; ++j) {
      // An unused slot reads row 0 of ape as its value (read, and ignored).
      if (!rows_of<kBf16, 4>(p, src[j], j, rows)) rows = SlotRows{p.ape, p.ape, nullptr, nullptr, p.ape};
      held_terms<kBf16>(rows, src[j] != -1, c0, count, logit[j], m, weight, product);
      for (int v = 0; v < C; ++v) sum[v] = team::add_rn(sum[v], weight[v]), acc[v] = team::add_rn(acc[v], product[v]);
    }
    for (int v = 0; v < C; ++v) out[v] = entry_of(sum[v], acc[v]);
  }

  // The same, the window's slots read twice (the max, then the weights), at any window (kRatio: as
  // ratio_of).
  template <bool kBf16, int C, int64_t kRatio = 0>
  SPARSEKV_HOST_DEVICE static void pool_streamed(const Params& p, int64_t e, int64_t c0, int count,
                                                 float (&out)[C]) {
    const int64_t window = window_of(ratio_of<kRatio>(p));
    float m[C], sum[C], acc[C], ape[C], value[C], score[C];
    for (int v = 0; v < C; ++v) m[v] = -INFINITY, sum[v] = 0.0f, acc[v] = 0.0f, out[v] = 0.0f;
    if (count <= 0) return;  // a lane past d (with a channel a lane, the loops then read unconditionally)
    SlotRows rows;
    SPARSEKV_ROLLED  // a slot a trip, as the instruction budget counts it (unrolled copies only add code)
    for (int64_t j = 0; j < window; ++j) {
      if (!slot_rows<kBf16, kRatio>(p, e, j, rows)) continue;
      load_row<kBf16, false>(rows.score, rows.score16, c0, count, score);
      load<false>(rows.ape, c0, count, ape);
      for (int v = 0; v < C; ++v) {
        const float logit = team::add_rn(score[v], ape[v]);
        m[v] = logit > m[v] ? logit : m[v];
      }
    }
    SPARSEKV_ROLLED
    for (int64_t j = 0; j < window; ++j) {
      if (!slot_rows<kBf16, kRatio>(p, e, j, rows)) continue;
      load_row<kBf16, false>(rows.kv, rows.kv16, c0, count, value);
      load_row<kBf16, false>(rows.score, rows.score16, c0, count, score);
      load<false>(rows.ape, c0, count, ape);
      for (int v = 0; v < C; ++v) {
        const float w = expf(team::sub_rn(team::add_rn(score[v], ape[v]), m[v]));
        sum[v] = team::add_rn(sum[v], w);
        acc[v] = team::add_rn(acc[v], team::mul_rn(w, value[v]));
      }
    }
    for (int v = 0; v < C; ++v) out[v] = entry_of(sum[v], acc[v]);
  }

  // C128 from 16-byte aligned rows (wide_rows), the window split over a CTA of kSplitThreads: its 8
  // warps pool the kSplitChunk channels first .. first + 127 of event e, 4 consecutive channels a
  // lane (16-byte loads), warp w the 16 slots 16 r + 2 w + s (r < 8, s < 2), its logits held in
  // registers (held_logits), so each row is read once. The maximum over slots is order-free: each
  // warp takes its slots', then each lane the 8 warps' from the stage. It is fmaxf (one instruction),
  // not the other forms' `logit > m ? logit : m`: both skip a NaN logit (m never is NaN), and they
  // differ only in the sign of a zero maximum, under which every weight exp(logit - m) is the same. The weights and products
  // (held_terms) of each slot are independent of the others, so the warps make them for 16 slots at
  // a time (a round) into the stage; then thread t adds up channel first + t % 128's weights
  // (t < 128: sum) or products (acc) in slot order, one column of the stage, 16 adds a round. So
  // every float is that of pool_streamed and pool_slots: the same terms, rounded alike, added in the
  // same order. Returns channel first + t's entry in thread t < 128 (others: 0; d is a multiple of 4,
  // so a lane's 4 channels are all in the row or all past it). Every thread of the CTA calls it (it
  // holds __syncthreads).
  static constexpr int kSplitWarps = 8;
  static constexpr int kSplitThreads = kSplitWarps * kWarpSize;
  static constexpr int kSplitChunk = 4 * kWarpSize;
  static constexpr int kRoundSlots = 16;  // a round's slots: 2 a warp
  struct SplitStage {
    float terms[2][kRoundSlots][kSplitChunk];  // a round's weights, then its products (16 KiB)
    float partial[kSplitWarps][kSplitChunk];   // the warps' maxima; then row 0 the acc threads' sums
    SlotRows rows[128];                        // the event's slots' held_rows
    bool used[128];                            // whether each slot has a token row
  };

#ifdef __CUDACC__
  // Whether every row the events read and the output rows are 16-byte aligned, 4 channels at a time
  // (pool_slots' loads; checked at launch, on the host).
  static bool wide_rows(const Params& p) {
    const auto address = [](const void* q) { return reinterpret_cast<uintptr_t>(q); };
    return ((address(p.kv) | address(p.score) | address(p.ape) | address(p.ring) | address(p.out)) & 15) == 0 &&
           ((p.kv_stride | p.score_stride | p.d) & 3) == 0;
  }

  // The split form (above).
  template <bool kBf16>
  SPARSEKV_DEVICE static float pool_split(const Params& p, int64_t e, int64_t first, SplitStage& stage) {
    constexpr int kSlots = 128, kPerWarp = kSlots / kSplitWarps, kPerRound = kRoundSlots / kSplitWarps;
    static_assert(kSplitThreads == 2 * kSplitChunk, "window_pool: a thread adds up one channel's sum or acc");
    const int thread = static_cast<int>(threadIdx.x), warp = thread / kWarpSize, lane = thread % kWarpSize;
    if (thread < kSlots) {
      const int64_t src = source<128>(p, e, thread);
      stage.rows[thread] = held_rows<kBf16, 128>(p, src, thread);
      stage.used[thread] = src != -1;
    }
    __syncthreads();  // the slots' rows are in the stage
    // A lane past d pools the row's last 4 channels again (never written out): in the row, and no
    // branch a slot.
    const int64_t c0 = first + 4 * lane < p.d ? first + 4 * lane : p.d - 4;
    float logit[kPerWarp][4], m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    SPARSEKV_UNROLLED  // the logits stay in registers (indexed by the counter)
    for (int k = 0; k < kPerWarp; ++k) {
      const int j = kRoundSlots * (k / kPerRound) + kPerRound * warp + k % kPerRound;
      held_logits<kBf16>(stage.rows[j], stage.used[j], c0, 4, logit[k]);
      for (int v = 0; v < 4; ++v) m[v] = fmaxf(m[v], logit[k][v]);
    }
    *reinterpret_cast<float4*>(&stage.partial[warp][4 * lane]) = float4{m[0], m[1], m[2], m[3]};
    __syncthreads();  // every warp's maximum is in the stage
    SPARSEKV_UNROLLED
    for (int w = 0; w < kSplitWarps; ++w) {
      const float4 other = *reinterpret_cast<const float4*>(&stage.partial[w][4 * lane]);
      const float x[4] = {other.x, other.y, other.z, other.w};
      for (int v = 0; v < 4; ++v) m[v] = fmaxf(m[v], x[v]);
    }
    const int column = thread % kSplitChunk;
    const float* terms = &stage.terms[thread / kSplitChunk][0][column];  // weights (sum) or products (acc)
    float total = 0.0f;
    SPARSEKV_UNROLLED
    for (int r = 0; r < kSlots / kRoundSlots; ++r) {
      SPARSEKV_UNROLLED
      for (int s = 0; s < kPerRound; ++s) {
        const int k = kPerRound * r + s, slot = kPerRound * warp + s;
        float weight[4], product[4];
        const int j = kRoundSlots * r + slot;
        held_terms<kBf16>(stage.rows[j], stage.used[j], c0, 4, logit[k], m, weight, product);
        *reinterpret_cast<float4*>(&stage.terms[0][slot][4 * lane]) = float4{weight[0], weight[1], weight[2], weight[3]};
        *reinterpret_cast<float4*>(&stage.terms[1][slot][4 * lane]) =
            float4{product[0], product[1], product[2], product[3]};
      }
      __syncthreads();  // the round's terms are in the stage
      SPARSEKV_UNROLLED
      for (int s = 0; s < kRoundSlots; ++s) total = team::add_rn(total, terms[s * kSplitChunk]);
      __syncthreads();  // the round's terms are added before the next round overwrites them
    }
    if (thread >= kSplitChunk) stage.partial[0][column] = total;
    __syncthreads();  // the acc threads' sums are in the stage
    return thread < kSplitChunk ? entry_of(total, stage.partial[0][column]) : 0.0f;
  }
#endif

  // Channels first + lanes.lane + v (v < kVirtualPerThread, those below d) of event e: a channel a
  // lane (a column of the fused store's team row; on the host one call covers a whole 32-channel
  // tile), streamed at both ratios: the fused store's form for C128 and C4 rows off 16 bytes, whose
  // 64 registers (four CTAs an SM) hold its row, not C4's logits.
  SPARSEKV_HOST_DEVICE static void pool_tile(const Params& p, int64_t e, int64_t first, Lanes lanes,
                                             float (&out)[team::kVirtualPerThread]) {
    constexpr int kV = team::kVirtualPerThread;
    const int64_t c0 = first + lanes.lane;
    const int count = static_cast<int>(c0 >= p.d ? 0 : (p.d - c0 < kV ? p.d - c0 : kV));
    p.ring_bf16 ? pool_streamed<true>(p, e, c0, count, out) : pool_streamed<false>(p, e, c0, count, out);
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

// A ring element from an input float: the float (fp32 ring) or its bf16 bits, rounded to nearest even.
template <class T>
SPARSEKV_HOST_DEVICE T ring_element(float x) {
  if constexpr (sizeof(T) == 2) {
    return fp8::float_to_bf16(x);
  } else {
    return x;
  }
}

// Writes one input row into one ring row: the ring row is one run of n = 2 * width elements T (float,
// or uint16_t bf16 bits), element k being kv[k] for k < width and score[k - width] after.
//
// GPU: the lanes write the run as 16-byte words (STG.E.128: 4 floats or 8 bf16 a lane, from one or
// two 16-byte loads where the source is 16-byte aligned, else 4-byte loads), and the elements before
// the run's first 16-byte boundary (the head) and after its last (the tail) as 4-byte words (STG.E).
// No lane stores a byte or 2 bytes (STG.E.U8 / .U16; tests/jit/test_sass.py's wide_store). Alignment:
// every element of a float32 or bf16 tensor sits on its own size's boundary, and a ring row is
// 8 * width (fp32) or 4 * width (bf16) bytes, so a row sits where the ring's base puts it:
//   - on a 4-byte boundary (every fp32 ring; a bf16 ring whose base is on one, as every allocation
//     and every view at an even element offset is): the head and the tail are whole 4-byte words of
//     the row (its byte count is a multiple of 4), so nothing outside the row is written. On a 16-byte
//     boundary (a 16-byte aligned ring with width even for fp32, a multiple of 4 for bf16: the serving
//     rings, width 1024) a row has no head and no tail; otherwise each is under 16 bytes.
//   - 2 bytes off one (a bf16 ring at an odd element offset): the row's first and last elements each
//     share a 4-byte word with the neighbouring ring row or with the memory beside the ring. Each goes
//     out by a 16-bit compare-and-swap of its own half (store_half: PTX atom.cas.b16, which the GPU
//     runs as a 4-byte ATOMG.E.CAS loop on the aligned word), so the other half keeps whatever another
//     warp writes there meanwhile; the aligned word never crosses the end of an allocation (device
//     allocations come in whole 256-byte granules at least).
// Host: an element loop (fp32: two memcpy).
// Design: a write reads an fp32 input row and writes a ring row, so it is bound by the accesses a
// warp keeps in flight. At the serving shape (C4, d 512: a bf16 ring row of 2,048 elements, 4 KiB) a
// warp writes a row as 256 16-byte words, 8 STG.E.128 a lane, where one element a lane took 2,048
// 2-byte stores (64 STG.E.U16 a lane); its loads go from 64 LDG.E to 16 LDG.E.128 a lane. A decode
// step writes one row per batch row (batch 64: 256 KiB, about 0.05 us of an H200's HBM), so the
// launch, not the write, is its cost. A static estimate from the SASS: no GPU has timed it.
template <class T>
struct RingRow {
  T* row;
  const float* kv;
  const float* score;
  int64_t width;

#ifdef __CUDA_ARCH__
  static constexpr int kPerWord = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte word
  static constexpr int kPerU32 = 4 / static_cast<int>(sizeof(T));    // elements per 4-byte word

  SPARSEKV_DEVICE float source(int64_t k) const { return k < width ? kv[k] : score[k - width]; }

  // Elements k .. k + kPerWord - 1: 16-byte loads where they lie in one half on a 16-byte boundary (a
  // half's words all do, or none: its elements' offsets from the half's start are multiples of 16 bytes).
  SPARSEKV_DEVICE void load_word(int64_t k, float (&x)[kPerWord]) const {
    const float* from = k < width ? kv + k : score + (k - width);
    const auto at = reinterpret_cast<uintptr_t>(from);
    if (k < width && k + kPerWord > width) {  // the one word that straddles kv | score
      for (int i = 0; i < kPerWord; ++i) x[i] = source(k + i);
    } else if ((at & 15) == 0) {
      for (int i = 0; i < kPerWord; i += 4) {
        const float4 f = *reinterpret_cast<const float4*>(from + i);
        x[i] = f.x, x[i + 1] = f.y, x[i + 2] = f.z, x[i + 3] = f.w;
      }
    } else {
      for (int i = 0; i < kPerWord; ++i) x[i] = from[i];
    }
  }

  // The 4-byte word of elements x[0 .. kPerU32 - 1], little-endian.
  SPARSEKV_DEVICE static uint32_t pack(const float* x) {
    if constexpr (kPerU32 == 2) {
      return static_cast<uint32_t>(ring_element<T>(x[0])) | (static_cast<uint32_t>(ring_element<T>(x[1])) << 16);
    } else {
      return fp8::float_bits(x[0]);
    }
  }

  // One 16-byte word at a 16-byte boundary. PTX, not a uint4 assignment: nvcc splits the assignment
  // of the fp32 ring's words (its elements copied unchanged) into two 4-byte and an 8-byte store.
  SPARSEKV_DEVICE static void store_word(T* at, uint4 word) {
#ifdef SPARSEKV_SIM
    *reinterpret_cast<uint4*>(at) = word;
#else
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(at), "r"(word.x), "r"(word.y), "r"(word.z),
                 "r"(word.w)
                 : "memory");
#endif
  }

  // One bf16 element whose 4-byte word's other half is not this row's (see above).
  SPARSEKV_DEVICE static void store_half(T* at, T bits) {
    auto* half = reinterpret_cast<unsigned short*>(at);
    unsigned short expected = bits;
    for (;;) {
      const unsigned short seen = atomicCAS(half, expected, static_cast<unsigned short>(bits));
      if (seen == expected) return;
      expected = seen;
    }
  }

  SPARSEKV_DEVICE void write(Lanes lanes) const {
    const int64_t n = 2 * width;
    const auto at = reinterpret_cast<uintptr_t>(row);
    const auto to_boundary = static_cast<int64_t>(((16 - (at & 15)) & 15) / sizeof(T));
    const int64_t head = to_boundary < n ? to_boundary : n;
    const int64_t words = (n - head) / kPerWord;
    const int64_t tail = head + words * kPerWord;
    SPARSEKV_ROLLED  // a row is a few words per lane: unrolled copies of the loop only add registers
    for (int64_t w = lanes.lane; w < words; w += lanes.count) {
      const int64_t k = head + w * kPerWord;
      float x[kPerWord];
      load_word(k, x);
      store_word(row + k, uint4{pack(x), pack(x + kPerU32), pack(x + 2 * kPerU32), pack(x + 3 * kPerU32)});
    }
    // The edges in 4-byte words: elements [-lone, head_end) and [tail_start, n + lone), where lone = 1
    // puts the row's first and last elements in words they share with their neighbours.
    const auto lone = static_cast<int64_t>((at & 3) / sizeof(T));
    const int64_t head_end = words > 0 ? head : n + lone;
    const int64_t tail_start = words > 0 ? tail : n + lone;
    const int64_t head_units = (head_end + lone) / kPerU32;
    const int64_t units = head_units + (n + lone - tail_start) / kPerU32;
    SPARSEKV_ROLLED  // at most 8 words (under 16 bytes at each end): one round of the warp
    for (int64_t u = lanes.lane; u < units; u += lanes.count) {
      const int64_t k = u < head_units ? u * kPerU32 - lone : tail_start + (u - head_units) * kPerU32;
      if (k >= 0 && k + kPerU32 <= n) {
        float x[kPerU32];
        for (int i = 0; i < kPerU32; ++i) x[i] = source(k + i);
        *reinterpret_cast<uint32_t*>(row + k) = pack(x);
      } else if constexpr (kPerU32 == 2) {
        const int64_t own = k < 0 ? k + 1 : k;  // the one element of this row in the word
        store_half(row + own, ring_element<T>(source(own)));
      }
    }
  }
#else
  void write(Lanes) const {
    if constexpr (sizeof(T) == sizeof(float)) {
      std::memcpy(row, kv, static_cast<size_t>(width) * sizeof(float));
      std::memcpy(row + width, score, static_cast<size_t>(width) * sizeof(float));
    } else {
      for (int64_t c = 0; c < width; ++c) {
        row[c] = ring_element<T>(kv[c]);
        row[width + c] = ring_element<T>(score[c]);
      }
    }
  }
#endif
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
      RingRow<uint16_t>{static_cast<uint16_t*>(p.ring) + dst * 2 * p.width, kv, score, p.width}.write(lanes);
    } else {
      RingRow<float>{static_cast<float*>(p.ring) + dst * 2 * p.width, kv, score, p.width}.write(lanes);
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

}  // namespace sparsekv::dsv4_compress
#endif
