// gather_rows: strided byte-row gather, the smallest real kernel of the toolkit.
//
// Contract: for every i < N, dst[dst_indices[i], :] = src[src_indices[i], :], where src and dst are
// uint8 [rows, row_bytes] with a unit last stride and any row stride (column slices of wider
// buffers work), and the index tensors are contiguous Index [N] on the same device. Bytes of dst
// outside the named rows are never touched. Rows named by an out-of-range index are skipped by the
// kernel itself (safe by construction).
//
// Input contract (ffi.h): dst must not share memory with src or the index tensors (ValueError naming
// both; overlapping views of one buffer count). Before any byte moves, host-readable indices are
// validated in full: every index in range, and a destination row named twice only with the same
// source row. For device-resident indices, distinct destinations are the caller's duty (rows
// written twice race on the GPU).
//
// Design: one warp per row, copy_bytes (portability.h) at the widest word the row allows. A copy
// is bound by HBM bandwidth and the loads in flight: 16k rows of 584 B (19 MB) have a 4 us
// roofline on an H200. 584-byte rows (584 % 16 = 8) move as 16-byte words with an 8-byte head and
// tail when source and destination rows sit equally off a 16-byte boundary, else as 8-byte words;
// rows of any other width and alignment take the widest words their relative offset allows, and no
// byte loads (LDG.U8). Instruction budget at that shape: 16k warps x ~30
// instructions (2-3 load/store pairs per lane, the index loads, the address math) = 0.5M warp
// instructions over 132 SMs x 4 schedulers: ~1,000 issue cycles, under 1 us at 1.7 GHz, so HBM
// stays the bound.
#pragma once

#include "sparsekv/portability.h"

namespace sparsekv::gather_rows {

template <class Index>
struct GatherRows {
  static_assert(std::is_same_v<Index, int32_t> || std::is_same_v<Index, int64_t>,
                "gather_rows: Index must be int32_t or int64_t");
  struct Params {
    uint8_t* dst;
    const uint8_t* src;
    const Index* dst_indices;
    const Index* src_indices;
    int64_t num_indices;
    int64_t row_bytes;
    int64_t dst_row_stride;
    int64_t src_row_stride;
    int64_t dst_rows;
    int64_t src_rows;
  };

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.num_indices; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const int64_t d = p.dst_indices[i];
    const int64_t s = p.src_indices[i];
    if (d < 0 || d >= p.dst_rows || s < 0 || s >= p.src_rows) return;
    copy_bytes(p.dst + d * p.dst_row_stride, p.src + s * p.src_row_stride, p.row_bytes, lanes);
  }
};

}  // namespace sparsekv::gather_rows

#ifdef SPARSEKV_HOST_ENTRY
#include "sparsekv/ffi.h"

namespace sparsekv::gather_rows {

template <class Index>
void gather_rows(TensorView dst, TensorView dst_indices, TensorView src, TensorView src_indices) {
  // 1. Validate: dtypes, devices, shapes.
  check(dst, "dst").dtype<uint8_t>().ndim(2).rows_dense().on_backend_device();
  check(src, "src").dtype<uint8_t>().ndim(2).rows_dense().same_device(dst, "dst");
  check(src, "src").size(1, dst.size(1), "row bytes of dst");
  check(dst_indices, "dst_indices").dtype<Index>().ndim(1).contiguous().same_device(dst, "dst");
  check(src_indices, "src_indices").dtype<Index>().ndim(1).contiguous().same_device(dst, "dst");
  check(src_indices, "src_indices").size(0, dst_indices.size(0), "length of dst_indices");
  check_disjoint({written(dst, "dst"), read(src, "src"), read(dst_indices, "dst_indices"),
                  read(src_indices, "src_indices")});

  // 2. Derive sizes and the launch parameters.
  using K = GatherRows<Index>;
  const typename K::Params params{
      static_cast<uint8_t*>(dst.data_ptr()),         static_cast<const uint8_t*>(src.data_ptr()),
      static_cast<const Index*>(dst_indices.data_ptr()), static_cast<const Index*>(src_indices.data_ptr()),
      dst_indices.size(0),                            dst.size(1),
      dst.stride(0),                                  src.stride(0),
      dst.size(0),                                    src.size(0)};
  if (params.num_indices == 0) return;

  // 3. Host-readable indices are validated in full before any byte moves.
  if (dst.device().device_type != kDLCUDA) {
    check_indices_in_range(params.dst_indices, params.num_indices, params.dst_rows, "dst_indices");
    check_indices_in_range(params.src_indices, params.num_indices, params.src_rows, "src_indices");
    check_no_conflicting_destinations(params.dst_indices, params.src_indices, params.num_indices, "dst_indices",
                                      "src_indices");
  }

  // 4. Launch.
  launch<K>(params, dst.device());
}

}  // namespace sparsekv::gather_rows
#endif
