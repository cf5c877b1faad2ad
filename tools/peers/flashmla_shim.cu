// sparsekv's extern "C" entry to FlashMLA's sparse decode (DeepSeek-V4 MODEL1 / fp8_ds_mla caches), for
// measuring FlashMLA beside our kernel in the same process. Built by tools/peers/build_flashmla.sh
// against a FlashMLA checkout at the pinned commit; nothing of FlashMLA is kept in this repository.
//
// Contract. The caller (tools/peers/flashmla.py) fills FlashMLA's own `SparseAttnDecodeParams` (declared
// in the checkout's csrc/params.h) from our tensors, including the split-KV scratch it allocated; this
// entry runs what FlashMLA's `sparse_decode_fwd` runs after its checks: the scheduler-metadata kernel,
// the decode kernel for the GPU's architecture and head count, and the combine kernel (which writes
// `out` and `lse` and applies the sink), all on `params->stream`. It never synchronizes.
// The layout of the struct is read back by the loader through `sparsekv_flashmla_params_layout`, so a
// checkout whose struct differs from the loader's mirror is refused before any launch.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>

#include "params.h"
#include "sm100/decode/head64/kernel.h"
#include "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace {

// Rows of the top-k list one scheduler block covers (FlashMLA's `block_size_topk`).
constexpr int kBlockSizeTopk = 64;

int fail(char* error, int error_len, const char* what) {
  if (error != nullptr && error_len > 0) std::snprintf(error, static_cast<size_t>(error_len), "%s", what);
  return 1;
}

}  // namespace

extern "C" {

// Writes sizeof(SparseAttnDecodeParams) and then each field's offset, in declaration order, into
// `out` (at most `capacity` values); returns how many values the full layout has.
int sparsekv_flashmla_params_layout(int64_t* out, int capacity) {
#define SPARSEKV_FIELD(name) offsetof(SparseAttnDecodeParams, name)
  const int64_t layout[] = {
      static_cast<int64_t>(sizeof(SparseAttnDecodeParams)),
      SPARSEKV_FIELD(b), SPARSEKV_FIELD(s_q), SPARSEKV_FIELD(h_q), SPARSEKV_FIELD(h_kv), SPARSEKV_FIELD(d_qk),
      SPARSEKV_FIELD(d_v), SPARSEKV_FIELD(sm_scale), SPARSEKV_FIELD(sm_scale_div_log2), SPARSEKV_FIELD(num_blocks),
      SPARSEKV_FIELD(page_block_size), SPARSEKV_FIELD(topk), SPARSEKV_FIELD(model_type), SPARSEKV_FIELD(q),
      SPARSEKV_FIELD(kv), SPARSEKV_FIELD(indices), SPARSEKV_FIELD(topk_length), SPARSEKV_FIELD(attn_sink),
      SPARSEKV_FIELD(lse), SPARSEKV_FIELD(out), SPARSEKV_FIELD(extra_num_blocks),
      SPARSEKV_FIELD(extra_page_block_size), SPARSEKV_FIELD(extra_topk), SPARSEKV_FIELD(extra_kv),
      SPARSEKV_FIELD(extra_indices), SPARSEKV_FIELD(extra_topk_length), SPARSEKV_FIELD(stride_q_b),
      SPARSEKV_FIELD(stride_q_s_q), SPARSEKV_FIELD(stride_q_h_q), SPARSEKV_FIELD(stride_kv_block),
      SPARSEKV_FIELD(stride_kv_row), SPARSEKV_FIELD(stride_indices_b), SPARSEKV_FIELD(stride_indices_s_q),
      SPARSEKV_FIELD(stride_lse_b), SPARSEKV_FIELD(stride_lse_s_q), SPARSEKV_FIELD(stride_o_b),
      SPARSEKV_FIELD(stride_o_s_q), SPARSEKV_FIELD(stride_o_h_q), SPARSEKV_FIELD(stride_extra_kv_block),
      SPARSEKV_FIELD(stride_extra_kv_row), SPARSEKV_FIELD(stride_extra_indices_b),
      SPARSEKV_FIELD(stride_extra_indices_s_q), SPARSEKV_FIELD(stream), SPARSEKV_FIELD(lse_accum),
      SPARSEKV_FIELD(o_accum), SPARSEKV_FIELD(stride_lse_accum_split), SPARSEKV_FIELD(stride_lse_accum_s_q),
      SPARSEKV_FIELD(stride_o_accum_split), SPARSEKV_FIELD(stride_o_accum_s_q), SPARSEKV_FIELD(stride_o_accum_h_q),
      SPARSEKV_FIELD(tile_scheduler_metadata_ptr), SPARSEKV_FIELD(num_splits_ptr), SPARSEKV_FIELD(num_sm_parts),
  };
#undef SPARSEKV_FIELD
  const int count = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
  for (int i = 0; i < count && i < capacity; ++i) out[i] = layout[i];
  return count;
}

// Bytes of one scheduler record (FlashMLA's DecodingSchedMeta): the loader sizes the metadata with it.
int sparsekv_flashmla_sched_meta_bytes() { return static_cast<int>(sizeof(DecodingSchedMeta)); }

// Runs FlashMLA's sparse decode on `*params` (MODEL1, s_q = 1 or more, h_q 64 or 128). `arch_major` is
// 9 (sm_90a) or 10 (sm_100 family); `fixed_overhead_blocks` is the scheduler's per-split overhead
// (FlashMLA's get_meta: 5, or 3 for the sm_100 128-head kernel). Returns 0, or 1 with a message in `error`.
int sparsekv_flashmla_sparse_decode(const SparseAttnDecodeParams* params, int arch_major, int fixed_overhead_blocks,
                                    char* error, int error_len) {
  if (params == nullptr) return fail(error, error_len, "params is null");
  if (params->model_type != ModelType::MODEL1) return fail(error, error_len, "only the MODEL1 cache is wired");
  if (params->h_q != 64 && params->h_q != 128) return fail(error, error_len, "h_q must be 64 or 128");
  if (arch_major != 9 && arch_major != 10) return fail(error, error_len, "arch_major must be 9 or 10");
  try {
    // 1. The split plan over (topk_length | extra) rows, on the device.
    GetDecodeSchedMetaParams sched = {
        params->b, params->s_q, kBlockSizeTopk, fixed_overhead_blocks, params->topk, params->extra_topk,
        params->topk_length, params->extra_topk_length, nullptr, params->tile_scheduler_metadata_ptr,
        params->num_splits_ptr, params->num_sm_parts, params->stream};
    smxx::decode::run_get_decoding_sched_meta_kernel(sched);
    // 2. The decode kernel of this architecture and head count.
    if (arch_major == 9) {
      if (params->h_q == 64) {
        sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, 64>(*params);
      } else {
        sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, 128>(*params);
      }
    } else if (params->h_q == 64) {
      sm100::decode::head64::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1>(*params);
    } else {
      sm100::fwd_for_small_topk::head128::run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::DecodeWithSplitKV,
                                                                               512>(*params);
    }
    // 3. Merge the splits, apply the sink, write out (bf16) and lse.
    CombineParams combine = {
        params->b, params->s_q, params->h_q, params->d_v,
        params->lse, params->out, params->stride_lse_b, params->stride_lse_s_q,
        params->stride_o_b, params->stride_o_s_q, params->stride_o_h_q,
        params->lse_accum, params->o_accum, params->stride_lse_accum_split, params->stride_lse_accum_s_q,
        params->stride_o_accum_split, params->stride_o_accum_s_q, params->stride_o_accum_h_q,
        params->tile_scheduler_metadata_ptr, params->num_splits_ptr, params->num_sm_parts,
        params->attn_sink, params->stream};
    smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(combine);
  } catch (const std::exception& e) {
    return fail(error, error_len, e.what());
  }
  return 0;
}

}  // extern "C"
