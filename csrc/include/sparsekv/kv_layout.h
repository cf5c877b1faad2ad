// kv_layout: the byte layouts of the DSV4 KV caches, the single C++ source every kernel addresses
// tokens through (mirrored in Python by sparsekv.kv_layout; tests/kernels/test_kv_layout.py
// checks that the two agree).
//
// A token of every layout is a value record followed, logically, by a scale record. A page of P
// slots stores them block-split, not token by token:
//
//   [value 0][value 1]...[value P-1][scale 0][scale 1]...[scale P-1][padding to a multiple of kPageAlign]
//   value of slot s: page + s * kValueBytes
//   scale of slot s: page + P * kValueBytes + s * kScaleBytes
//
// so one token is two byte ranges, never one. Layouts:
//
//   layout         value                         scale                         bytes  page align
//   V4             448 e4m3 nope + 64 bf16 rope  7 UE8M0 + 1 pad               584    576 (FlashMLA)
//   V41            512 e4m3                      16 UE8M0 (one per 32)         528    512
//   V41Fp4         256 packed e2m1               32 e4m3 (one per 16)          288    256 (our choice)
//   IndexerFp8     128 e4m3                      1 fp32                        132    1 (no padding)
//   IndexerFp4     64 packed e2m1                4 UE8M0                       68     1 (our choice)
//
// No published page alignment exists for V41Fp4 and IndexerFp4: V41Fp4 follows the rule of the other
// main-KV layouts (a page is a whole number of value records), IndexerFp4 that of the FP8 indexer
// (no padding; at any power-of-two P >= 4 a page is a multiple of 16 bytes anyway).
//
// API (stable; kernels of other families include this header):
//   kMaxPageSlots (2^20: the largest page any kernel takes; every size product below fits int64)
//   Layout::kValueBytes, kScaleBytes, kBytesPerToken, kPageAlign
//   Layout::page_bytes(page_slots) (-1 outside [1, kMaxPageSlots]), value_offset(slot_in_page),
//   scale_offset(slot_in_page, page_slots)
//   PagedKV<Layout, PageSlots>::kPageBytes, kScaleBase, token(base, slot) -> TokenBytes{value, scale}
// Everything is constexpr / SPARSEKV_HOST_DEVICE, so it works in kernels, host code and static_asserts.
#pragma once

#include <cstdint>

#include "sparsekv/portability.h"

namespace sparsekv::kv_layout {

// The largest page, in slots. With records of at most 2^10 bytes a page is at most 2^30 bytes, so
// no size product of this header can overflow int64 for a page size in [1, kMaxPageSlots] and a
// slot inside its page (a 2^62-slot page once wrapped page_bytes to 0 and passed a shape check).
inline constexpr int64_t kMaxPageSlots = int64_t{1} << 20;

template <int64_t ValueBytes, int64_t ScaleBytes, int64_t PageAlign>
struct Layout {
  static_assert(ValueBytes > 0 && ScaleBytes > 0, "kv_layout: value and scale records must be non-empty");
  static_assert(PageAlign > 0, "kv_layout: page alignment must be positive");
  static_assert(ValueBytes + ScaleBytes <= 1024 && PageAlign <= 1024, "kv_layout: records of at most 1 KiB keep "
                "every page size product below 2^31");

  static constexpr int64_t kValueBytes = ValueBytes;
  static constexpr int64_t kScaleBytes = ScaleBytes;
  static constexpr int64_t kBytesPerToken = ValueBytes + ScaleBytes;
  static constexpr int64_t kPageAlign = PageAlign;

  // Bytes of one page of page_slots tokens, padding included; -1 (no buffer has that width) for a
  // page_slots outside [1, kMaxPageSlots], so a shape check against it refuses such a page size.
  SPARSEKV_HOST_DEVICE static constexpr int64_t page_bytes(int64_t page_slots) {
    if (page_slots < 1 || page_slots > kMaxPageSlots) return -1;
    return (kBytesPerToken * page_slots + kPageAlign - 1) / kPageAlign * kPageAlign;
  }
  // Byte offset, inside its page, of the value record of slot slot_in_page.
  SPARSEKV_HOST_DEVICE static constexpr int64_t value_offset(int64_t slot_in_page) {
    return slot_in_page * kValueBytes;
  }
  // Byte offset, inside its page, of the scale record of slot slot_in_page.
  SPARSEKV_HOST_DEVICE static constexpr int64_t scale_offset(int64_t slot_in_page, int64_t page_slots) {
    return page_slots * kValueBytes + slot_in_page * kScaleBytes;
  }
};

// Distinct types (not aliases), so a kernel instantiated for one layout names it in diagnostics.
struct V4 : Layout<576, 8, 576> {};
struct V41 : Layout<512, 16, 512> {};
struct V41Fp4 : Layout<256, 32, 256> {};
struct IndexerFp8 : Layout<128, 4, 1> {};
struct IndexerFp4 : Layout<64, 4, 1> {};

static_assert(V4::kBytesPerToken == 584 && V4::page_bytes(64) == 37440, "kv_layout: V4 is 584 B, 37,440 B per C4 page");

// The two byte ranges of one token.
template <class Byte>
struct TokenBytes {
  Byte* value;  // L::kValueBytes bytes
  Byte* scale;  // L::kScaleBytes bytes
};

// Token addressing in a paged buffer: page p of the buffer starts at base + p * page_stride
// (page_stride defaults to kPageBytes: a [pages, kPageBytes] uint8 buffer; a page-first host
// buffer [pages, layers, kPageBytes] seen from one layer has page_stride = layers * kPageBytes).
template <class L, int64_t PageSlots>
struct PagedKV {
  static_assert(PageSlots > 0 && PageSlots <= kMaxPageSlots, "kv_layout: a page holds 1 to kMaxPageSlots slots");
  using LayoutT = L;
  static constexpr int64_t kPageSlots = PageSlots;
  static constexpr int64_t kPageBytes = L::page_bytes(PageSlots);
  static constexpr int64_t kScaleBase = L::scale_offset(0, PageSlots);

  // slot must be non-negative (callers skip or reject negative ids before addressing).
  template <class Byte>
  SPARSEKV_HOST_DEVICE static TokenBytes<Byte> token(Byte* base, int64_t slot, int64_t page_stride = kPageBytes) {
    static_assert(sizeof(Byte) == 1, "kv_layout: address pages through a byte pointer");
    const auto s = static_cast<uint64_t>(slot);  // unsigned: division by a power of two is a shift
    const int64_t page = static_cast<int64_t>(s / PageSlots);
    const int64_t in_page = static_cast<int64_t>(s % PageSlots);
    Byte* const p = base + page * page_stride;
    return {p + L::value_offset(in_page), p + L::scale_offset(in_page, PageSlots)};
  }
};

}  // namespace sparsekv::kv_layout
