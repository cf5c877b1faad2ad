// dsv4_quant: the DSV4 "fp8_ds_mla" token quantizer and dequantizer (584 B V4 layout), and the
// plain indexer-key quantizers (IndexerFp8 132 B, IndexerFp4 68 B).
//
// Contract: row i of x (float32 or bf16, 512 wide for V4, 128 for the indexer layouts) is written
// into token slot slots[i] of a paged [pages, page_bytes] cache by the row encoders of
// csrc/include/sparsekv/row_store.h (store_v4, store_indexer_fp8, store_indexer_fp4: the byte
// formats are stated there). A float32 x is quantized from its own value (no bf16 step).
// quantize_indexer_fp8 / _fp4 store keys as given (no norm, no RoPE, no Hadamard); the fused store
// (dsv4_store.cuh) calls the same row encoders on its normalized, rotated rows.
// Dequantize (V4): e4m3 * 2^(byte - 127) for dims 0-447, the bf16 values for 448-511.
//
// Safety: a slot outside [0, num_slots) is skipped by the kernel; the host entry rejects such
// slots and duplicated slots before any byte is written when the slots are host-readable.
// GPU: one warp per token through the team helpers (csrc/include/sparsekv/lane_reduce.h).
// Design: bound by HBM: 4096 bf16 rows in (4 MB) and 584 B records out (2.4 MB), a 1.4 us roofline
// on an H200. The V4 record is staged in the warp's shared memory and written whole (row_store.h
// store_v4: 36 STG.128 and one STG.64, no byte stores; tests/jit/test_sass.py, wide_store), its
// e4m3 codes from the hardware convert, one F2FP per pair on sm_89+ (fp8::float_to_e4m3x2;
// fp8_encode). Static issue estimate (tools/bench/bench_sass_budget.py, 4096 rows): 1.25x the
// roofline on an H200, 1.74x on a B200 (3.25x on the H200 with the software encode).
#pragma once

#include "sparsekv/fp8.h"
#include "sparsekv/kv_layout.h"
#include "sparsekv/lane_reduce.h"
#include "sparsekv/portability.h"
#include "sparsekv/row_store.h"

namespace sparsekv::dsv4_quant {

using row_store::IndexerFp4;
using row_store::IndexerFp8;
using row_store::kBlock;
using row_store::kDim;
using row_store::kIndexerDim;
using row_store::kNopeDims;
using row_store::V4;

struct QuantizeParams {
  const void* x;
  int64_t x_row_stride;  // elements
  const int64_t* slots;
  uint8_t* cache;
  int64_t num_tokens;
  int64_t page_slots;
  int64_t page_stride;  // bytes
  int64_t num_slots;    // pages * page_slots
};

// Row i of the quantizer input, held by a team. InT: float or uint16_t (bf16 bits, widened exactly).
template <int D, class InT>
SPARSEKV_HOST_DEVICE team::Row<D> load_row(const QuantizeParams& p, int64_t i, Lanes lanes) {
  const InT* row = static_cast<const InT*>(p.x) + i * p.x_row_stride;
  team::Row<D> x;
  for (int j = 0; j < team::kVirtualPerThread; ++j) {
    for (int k = 0; k < team::Row<D>::kPerLane; ++k) {
      const InT v = row[team::Row<D>::channel(lanes, j, k)];
      if constexpr (std::is_same_v<InT, float>) {
        x.v[j][k] = v;
      } else {
        x.v[j][k] = fp8::bf16_to_float(v);
      }
    }
  }
  return x;
}

// Rows into tokens of layout L: V4 (fp8_ds_mla, 512 wide), or IndexerFp8 (132 B) / IndexerFp4 (68 B)
// for 128-wide indexer keys as given (no norm, no RoPE, no Hadamard: the bytes the fused store writes
// for its rotated row). InT: float or uint16_t (bf16 bits).
template <class L, class InT>
struct QuantizeRows {
  static_assert(std::is_same_v<L, V4> || std::is_same_v<L, IndexerFp8> || std::is_same_v<L, IndexerFp4>,
                "dsv4_quant: a V4 or indexer layout");
  static_assert(std::is_same_v<InT, float> || std::is_same_v<InT, uint16_t>, "dsv4_quant: input is float or bf16");
  using Params = QuantizeParams;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.num_tokens; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const int64_t slot = p.slots[i];
    if (slot < 0 || slot >= p.num_slots) return;
    const auto token_of = [&p, slot] { return row_store::token_bytes<L>(p.cache, slot, p.page_slots, p.page_stride); };
    if constexpr (std::is_same_v<L, V4>) {
      row_store::store_v4(load_row<kDim, InT>(p, i, lanes), token_of, lanes);
    } else if constexpr (std::is_same_v<L, IndexerFp8>) {
      row_store::store_indexer_fp8(load_row<kIndexerDim, InT>(p, i, lanes), token_of, lanes);
    } else {
      row_store::store_indexer_fp4(load_row<kIndexerDim, InT>(p, i, lanes), token_of, lanes);
    }
  }
};

template <class InT>
using QuantizeFp8DsMla = QuantizeRows<V4, InT>;

struct DequantizeParams {
  const uint8_t* cache;
  const int64_t* slots;
  float* out;
  int64_t num_tokens;
  int64_t page_slots;
  int64_t page_stride;
  int64_t num_slots;
};

// Rows of out for slots outside [0, num_slots) are left as they are (the host entry rejects them).
struct DequantizeFp8DsMla {
  using Params = DequantizeParams;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.num_tokens; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const int64_t slot = p.slots[i];
    if (slot < 0 || slot >= p.num_slots) return;
    const auto token = row_store::token_bytes<V4>(const_cast<uint8_t*>(p.cache), slot, p.page_slots, p.page_stride);
    float* row = p.out + i * kDim;
    for (int c = lanes.lane; c < kNopeDims; c += lanes.count) {
      row[c] = fp8::e4m3_to_float(token.value[c]) * fp8::ue8m0_to_float(token.scale[c / kBlock]);
    }
    for (int c = kNopeDims + lanes.lane; c < kDim; c += lanes.count) {
      row[c] = row_store::load_bf16(token.value + kNopeDims + 2 * (c - kNopeDims));
    }
  }
};

}  // namespace sparsekv::dsv4_quant

#ifdef SPARSEKV_HOST_ENTRY
#include <utility>

#include "sparsekv/ffi.h"

namespace sparsekv::dsv4_quant {

// Validates a quantizer call (float32 or bf16 rows of width D into unique slots of a paged cache of
// layout L); returns its parameters and whether the rows are float32.
template <class L, int D>
std::pair<QuantizeParams, bool> check_quantize(TensorView x, TensorView cache, TensorView slots, int64_t page_slots) {
  check_disjoint({read(x, "x"), written(cache, "cache"), read(slots, "slots")});
  const bool is_float = x.dtype() == dtype_of<float>();
  if (!is_float && !(x.dtype() == DLDataType{kDLBfloat, 16, 1})) {
    TVM_FFI_THROW(TypeError) << "sparsekv: argument `x` must have dtype float32 or bfloat16, got "
                             << dtype_name(x.dtype());
  }
  check(x, "x").ndim(2).size(1, D, "head dim").rows_dense().same_device(cache, "cache");
  check(slots, "slots").ndim(1).size(0, x.size(0), "rows of x");
  const auto [page_stride, num_slots] = row_store::check_paged_cache<L>(cache, slots, page_slots, true);
  return {QuantizeParams{x.data_ptr(), x.stride(0), static_cast<const int64_t*>(slots.data_ptr()),
                         static_cast<uint8_t*>(cache.data_ptr()), x.size(0), page_slots, page_stride, num_slots},
          is_float};
}

inline void quantize_fp8_ds_mla(TensorView x, TensorView cache, TensorView slots, int64_t page_slots) {
  // 1. Validate (memory first: the slot checks read `slots`) and derive sizes.
  const auto [params, is_float] = check_quantize<V4, kDim>(x, cache, slots, page_slots);
  if (params.num_tokens == 0) return;

  // 2. Launch.
  if (is_float) {
    launch<QuantizeFp8DsMla<float>>(params, cache.device());
  } else {
    launch<QuantizeFp8DsMla<uint16_t>>(params, cache.device());
  }
}

// Plain indexer keys (no norm, no RoPE) into an IndexerFp8 or IndexerFp4 cache.
template <class L>
void quantize_indexer(TensorView x, TensorView cache, TensorView slots, int64_t page_slots) {
  // 1. Validate (memory first: the slot checks read `slots`) and derive sizes.
  const auto [params, is_float] = check_quantize<L, kIndexerDim>(x, cache, slots, page_slots);
  if (params.num_tokens == 0) return;

  // 2. Launch.
  if (is_float) {
    launch<QuantizeRows<L, float>>(params, cache.device());
  } else {
    launch<QuantizeRows<L, uint16_t>>(params, cache.device());
  }
}

inline void quantize_indexer_fp8(TensorView x, TensorView cache, TensorView slots, int64_t page_slots) {
  quantize_indexer<IndexerFp8>(x, cache, slots, page_slots);
}

inline void quantize_indexer_fp4(TensorView x, TensorView cache, TensorView slots, int64_t page_slots) {
  quantize_indexer<IndexerFp4>(x, cache, slots, page_slots);
}

inline void dequantize_fp8_ds_mla(TensorView cache, TensorView slots, int64_t page_slots, TensorView out) {
  // 1. Validate.
  check_disjoint({read(cache, "cache"), read(slots, "slots"), written(out, "out")});
  const auto [page_stride, num_slots] = row_store::check_paged_cache<V4>(cache, slots, page_slots, false);
  check(out, "out").dtype<float>().ndim(2).contiguous().same_device(cache, "cache");
  check(out, "out").size(0, slots.size(0), "length of slots").size(1, kDim, "head dim");

  // 2. Derive sizes and launch.
  const DequantizeParams params{static_cast<const uint8_t*>(cache.data_ptr()),
                                static_cast<const int64_t*>(slots.data_ptr()),
                                static_cast<float*>(out.data_ptr()),
                                slots.size(0),
                                page_slots,
                                page_stride,
                                num_slots};
  if (params.num_tokens == 0) return;
  launch<DequantizeFp8DsMla>(params, cache.device());
}

}  // namespace sparsekv::dsv4_quant
#endif
