// Host-side glue, compiled only in the tvm-ffi translation unit the loader generates: argument
// checks that raise Python TypeError / ValueError / IndexError naming the argument, and launch(),
// which runs a kernel on the module's backend (SPARSEKV_BACKEND_CUDA / SPARSEKV_BACKEND_SIM, set by
// the loader; the sim backend takes CPU tensors and runs the kernels' CUDA path in the simulator).
//
// THE INPUT CONTRACT of every host entry (every kernel family follows it; each rule has a helper
// below). All checks run before any byte moves.
//   1. Types, shapes, strides, devices: `check(t, "name")...` (TypeError / ValueError naming it).
//   2. Memory: an argument the kernel writes must not share memory with any other argument it
//      reads or writes, or it would read its own writes or write twice (`check_disjoint`,
//      ValueError naming both, one call per entry listing every tensor argument). Byte spans are
//      compared, so interleaved views of one buffer count. A written argument must not overlap
//      itself either (an `expand`ed view writes one element from many places).
//   3. Destinations: a destination named twice must come with the same source
//      (`check_no_conflicting_destinations`). Checked where the ids are host-readable; for
//      device-resident ids it is the caller's duty (say so in the kernel's contract; the wrapper
//      checks them with torch on the device when SPARSEKV_CHECK_INDICES=1).
//   4. Pointer tables (uint64 per-layer base addresses): no null entry (`check_pointer_table`);
//      when source and destination tables share a base address, no id may be both a source and
//      another pair's destination (`check_no_chained_ids`), since the result would depend on order.
//   5. Indices: O(1) checks always; kernels skip out-of-range entries (safe by construction);
//      every index is validated in full before anything moves when host-readable, or on request
//      (`IndexCheck`, driven by SPARSEKV_CHECK_INDICES=1; for device tables the wrapper validates
//      them with torch on the device, `torch_op.index_checks_on_device`).
//   6. Optional tensors are `OptionalTensor` (Python None = absent); a 0-dim tensor passed for one
//      is rejected (`optional_arg`), never mistaken for "absent".
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "sparsekv/kv_layout.h"
#include "sparsekv/portability.h"

#ifndef SPARSEKV_BACKEND_CUDA
#error "SPARSEKV_BACKEND_CUDA must be defined (0 or 1) by the translation unit the loader generates"
#endif

#ifndef SPARSEKV_BACKEND_SIM
#define SPARSEKV_BACKEND_SIM 0
#endif

#if SPARSEKV_BACKEND_CUDA || SPARSEKV_BACKEND_SIM
// Defined in the loader-generated .cu (kernels_sim.cpp for sim), so this file needs no CUDA header.
extern "C" const char* sparsekv_cuda_error_string(int error);
extern "C" int sparsekv_cuda_device_count(int* count);
extern "C" int sparsekv_cuda_set_device(int device, int* previous);
extern "C" int sparsekv_cuda_is_pinned(const void* ptr, int* pinned);
#endif

namespace sparsekv {

using tvm::ffi::TensorView;
using OptionalTensor = tvm::ffi::Optional<TensorView>;

inline constexpr DLDeviceType kBackendDevice = SPARSEKV_BACKEND_CUDA ? kDLCUDA : kDLCPU;
inline constexpr const char* kBackendName = SPARSEKV_BACKEND_CUDA ? "cuda" : SPARSEKV_BACKEND_SIM ? "sim" : "cpu";

template <class T>
constexpr DLDataType dtype_of() {
  if constexpr (std::is_same_v<T, bool>) {
    return DLDataType{kDLBool, 8, 1};
  } else if constexpr (std::is_floating_point_v<T>) {
    return DLDataType{kDLFloat, static_cast<uint8_t>(sizeof(T) * 8), 1};
  } else if constexpr (std::is_signed_v<T>) {
    return DLDataType{kDLInt, static_cast<uint8_t>(sizeof(T) * 8), 1};
  } else {
    return DLDataType{kDLUInt, static_cast<uint8_t>(sizeof(T) * 8), 1};
  }
}

inline std::string dtype_name(DLDataType t) { return std::string(tvm::ffi::DLDataTypeToString(t)); }

inline std::string shape_string(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// Raised when a cuda-backend module is used on a machine whose CUDA runtime cannot run: a clear
// RuntimeError instead of a crash or a misleading device complaint.
inline void require_cuda_runtime() {
#if SPARSEKV_BACKEND_CUDA
  int count = 0;
  const int err = sparsekv_cuda_device_count(&count);
  if (err != 0) {
    TVM_FFI_THROW(RuntimeError) << "sparsekv: this module was built for the cuda backend, but the CUDA "
                                << "runtime cannot run here: " << sparsekv_cuda_error_string(err);
  }
  if (count == 0) TVM_FFI_THROW(RuntimeError) << "sparsekv: cuda backend module, but no CUDA device is visible";
#endif
}

// Whether a host address lies in pinned (page-locked, GPU-mapped) memory. The answer is kept per
// address (a host cache is pinned once and lives as long as its pool), so the driver is asked once
// per buffer, not on every call; an address seen pageable is asked again (it may be pinned now).
// The cost: a pinned buffer freed and its address reused by pageable memory would still pass, so
// host caches are pinned for the life of their pool (as the pools do).
inline bool is_pinned_host(const void* ptr) {
#if SPARSEKV_BACKEND_CUDA
  static std::mutex mutex;
  static std::vector<const void*> pinned;  // few: one per host cache
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (std::find(pinned.begin(), pinned.end(), ptr) != pinned.end()) return true;
  }
  int is_pinned = 0;
  const int err = sparsekv_cuda_is_pinned(ptr, &is_pinned);
  if (err != 0) {
    TVM_FFI_THROW(RuntimeError) << "sparsekv: cudaPointerGetAttributes failed: " << sparsekv_cuda_error_string(err);
  }
  if (is_pinned) {
    const std::lock_guard<std::mutex> lock(mutex);
    pinned.push_back(ptr);
  }
  return is_pinned != 0;
#else
  (void)ptr;
  return true;
#endif
}

// Fluent checks on one tensor argument. Every failure names the argument with the expected and
// actual values.
class Arg {
 public:
  Arg(const TensorView& t, const char* name) : t_(t), name_(name) {}

  const Arg& dtype(DLDataType want) const {
    if (!(t_.dtype() == want)) {
      TVM_FFI_THROW(TypeError) << "sparsekv: argument `" << name_ << "` must have dtype " << dtype_name(want)
                               << ", got " << dtype_name(t_.dtype());
    }
    return *this;
  }
  template <class T>
  const Arg& dtype() const {
    return dtype(dtype_of<T>());
  }
  // One of two integer index dtypes; returns true for the 64-bit one.
  bool int32_or_int64() const {
    const DLDataType d = t_.dtype();
    if (!(d == dtype_of<int32_t>() || d == dtype_of<int64_t>())) {
      TVM_FFI_THROW(TypeError) << "sparsekv: argument `" << name_ << "` must have dtype int32 or int64, got "
                               << dtype_name(d);
    }
    return d.bits == 64;
  }
  const Arg& ndim(int want) const {
    if (t_.ndim() != want) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << name_ << "` must be " << want << "-D, got shape "
                                << shape_string(t_);
    }
    return *this;
  }
  const Arg& size(int dim, int64_t want, const char* what = nullptr) const {
    if (t_.size(dim) != want) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << name_ << "` must have size " << want << " in dim "
                                << dim << (what ? std::string(" (") + what + ")" : std::string()) << ", got shape "
                                << shape_string(t_);
    }
    return *this;
  }
  const Arg& contiguous() const {
    if (!t_.IsContiguous()) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << name_ << "` must be contiguous (shape "
                                << shape_string(t_) << ")";
    }
    return *this;
  }
  // The last dimension is dense; outer strides are free (e.g. a column slice of a wider buffer).
  const Arg& rows_dense() const {
    if (t_.ndim() > 0 && t_.size(t_.ndim() - 1) > 1 && t_.stride(t_.ndim() - 1) != 1) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << name_ << "` must have a unit stride in its last dim";
    }
    return *this;
  }
  const Arg& on_backend_device() const {
    const DLDevice dev = t_.device();
    const bool ok = SPARSEKV_BACKEND_CUDA ? dev.device_type == kDLCUDA
                                          : (dev.device_type == kDLCPU || dev.device_type == kDLCUDAHost);
    if (!ok) {
      require_cuda_runtime();
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << name_ << "` is on device type " << dev.device_type
                                << ", but this module was built for the " << kBackendName << " backend";
    }
    return *this;
  }
  // Memory the backend's kernels can address: the backend's device or, for the cuda backend, host
  // memory too (kernels read page-locked host memory over PCIe; a CPU tensor must be pinned or
  // registered, which cannot be told from its DLPack device).
  // The cuda backend's kernels read host memory only when it is pinned: a pageable buffer would
  // be an illegal address on the GPU and poison the context.
  const Arg& on_backend_device_or_host() const {
    const DLDeviceType type = t_.device().device_type;
    if (SPARSEKV_BACKEND_CUDA && type == kDLCUDAHost) return *this;
    if (SPARSEKV_BACKEND_CUDA && type == kDLCPU) {
      require_cuda_runtime();
      if (!is_pinned_host(t_.data_ptr())) {
        TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << name_ << "` is pageable host memory, which the GPU "
                                  << "cannot read; pin it (torch: tensor.pin_memory(), or allocate it with "
                                  << "pin_memory=True)";
      }
      return *this;
    }
    return on_backend_device();
  }
  const Arg& same_device(const TensorView& other, const char* other_name) const {
    const DLDevice a = t_.device(), b = other.device();
    if (a.device_type != b.device_type || a.device_id != b.device_id) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << name_ << "` and `" << other_name
                                << "` must be on the same device";
    }
    return *this;
  }

  const TensorView& tensor() const { return t_; }

 private:
  const TensorView& t_;
  const char* name_;
};

inline Arg check(const TensorView& t, const char* name) { return Arg(t, name); }

// Scalar argument range check, closed [lo, hi]: the convention of sparsekv.checks, so both languages
// word a refusal the same way.
inline void check_range(int64_t value, int64_t lo, int64_t hi, const char* name) {
  if (value < lo || value > hi) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << name << "` must be in [" << lo << ", " << hi << "], got "
                              << value;
  }
}

// a * b for non-negative sizes, or ValueError naming `what` when the product leaves int64.
inline int64_t checked_product(int64_t a, int64_t b, const char* what) {
  int64_t product = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &product)) {
    TVM_FFI_THROW(ValueError) << "sparsekv: " << what << " (" << a << " x " << b << ") does not fit int64";
  }
  return product;
}

// A slots-per-page argument (page_slots): a power of two in [1, kv_layout::kMaxPageSlots]; returns
// its log2. Every entry that takes one checks it here first, so no size product overflows.
inline int check_page_slots(int64_t page_slots, const char* name) {
  if (page_slots < 1 || page_slots > kv_layout::kMaxPageSlots || (page_slots & (page_slots - 1)) != 0) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << name << "` must be a power of two in [1, 2^20], got "
                              << page_slots;
  }
  int shift = 0;
  while ((int64_t{1} << shift) < page_slots) ++shift;
  return shift;
}

// The bytes [first, last) a tensor's elements span (first == last when it has none). A strided
// view spans from its lowest to its highest element, gaps included.
inline std::pair<uintptr_t, uintptr_t> byte_span(const TensorView& t) {
  if (t.numel() == 0) return {0, 0};
  const int64_t item = (int64_t{t.dtype().bits} * t.dtype().lanes + 7) / 8;
  int64_t lo = 0, hi = 0;
  for (int i = 0; i < t.ndim(); ++i) {
    const int64_t reach = (t.size(i) - 1) * t.stride(i) * item;
    (reach < 0 ? lo : hi) += reach;
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.data_ptr()) + t.byte_offset();
  return {base + lo, base + hi + item};
}

// For an output that a kernel writes while it still reads an input: the two must not share
// memory, or the kernel reads its own writes. Spans are compared, so interleaved views of one
// buffer (e.g. alternate columns) are refused too although no element is shared.
inline void check_spans_apart(std::pair<uintptr_t, uintptr_t> a, const char* a_name, std::pair<uintptr_t, uintptr_t> b,
                              const char* b_name) {
  if (a.first < a.second && b.first < b.second && a.first < b.second && b.first < a.second) {
    TVM_FFI_THROW(ValueError) << "sparsekv: arguments `" << a_name << "` and `" << b_name
                              << "` must not share memory (the kernel writes one while reading the other)";
  }
}

inline void check_no_overlap(const TensorView& a, const char* a_name, const TensorView& b, const char* b_name) {
  check_spans_apart(byte_span(a), a_name, byte_span(b), b_name);
}

// Full index validation for host-resident indices: every entry in [0, limit).
template <class Index>
void check_indices_in_range(const Index* indices, int64_t n, int64_t limit, const char* name) {
  for (int64_t i = 0; i < n; ++i) {
    if (indices[i] < 0 || indices[i] >= limit) {
      TVM_FFI_THROW(IndexError) << "sparsekv: argument `" << name << "`[" << i << "] = " << indices[i]
                                << " is out of range [0, " << limit << ")";
    }
  }
}

// Scatter-copy validation for host-resident (dst, src) id pairs already known to be non-negative:
// a destination may repeat only when every repeat names the same source (the bytes written are
// then the same whatever the order). Duplicates are found with a bitmap in one O(N) pass when the
// ids are dense enough, and only then located exactly by sorting.
template <class Index>
void check_no_conflicting_destinations(const Index* dst, const Index* src, int64_t n, const char* dst_name,
                                       const char* src_name) {
  if (n < 2) return;
  Index max_id = 0;
  for (int64_t i = 0; i < n; ++i) max_id = dst[i] > max_id ? dst[i] : max_id;
  bool may_repeat = true;
  if (static_cast<uint64_t>(max_id) < static_cast<uint64_t>(n) * 64) {
    std::vector<uint64_t> seen(static_cast<size_t>(max_id) / 64 + 1, 0);
    may_repeat = false;
    for (int64_t i = 0; i < n && !may_repeat; ++i) {
      uint64_t& word = seen[static_cast<size_t>(dst[i]) / 64];
      const uint64_t bit = uint64_t{1} << (static_cast<uint64_t>(dst[i]) % 64);
      may_repeat = (word & bit) != 0;
      word |= bit;
    }
  }
  if (!may_repeat) return;
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return dst[a] < dst[b]; });
  // Within a run of equal destinations all sources agree iff every adjacent pair agrees.
  for (size_t k = 1; k < order.size(); ++k) {
    const int64_t a = order[k - 1], b = order[k];
    if (dst[a] == dst[b] && src[a] != src[b]) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << dst_name << "` names destination " << dst[a]
                                << " twice (positions " << a << " and " << b << ") with different sources `"
                                << src_name << "`[" << a << "] = " << src[a] << " and `" << src_name << "`[" << b
                                << "] = " << src[b];
    }
  }
}

// Rule 6: the tensor of an optional argument, or nullptr when absent (Python None).
inline const TensorView* optional_arg(const OptionalTensor& t, const char* name) {
  if (!t.has_value()) return nullptr;
  if ((*t).ndim() == 0) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << name << "` is a 0-dim tensor; pass None to omit it";
  }
  return &*t;
}

// One argument of a check_disjoint call: a tensor (nullptr = an absent optional one), its name and
// whether the kernel writes it.
struct Operand {
  const TensorView* tensor;
  const char* name;
  bool written;
};
inline Operand written(const TensorView& t, const char* name) { return {&t, name, true}; }
inline Operand written(const TensorView* t, const char* name) { return {t, name, true}; }
inline Operand read(const TensorView& t, const char* name) { return {&t, name, false}; }
inline Operand read(const TensorView* t, const char* name) { return {t, name, false}; }

// Whether distinct indices of t may name one element: with its dims of size > 1 sorted by stride,
// each stride must step past everything the smaller dims reach (true for every slice, transpose or
// column view of a dense buffer; false for a stride-0 `expand`).
inline bool may_self_overlap(const TensorView& t) {
  // (stride, size) of each dim: on the stack up to 8 dims (every call's tensors), no allocation per
  // checked argument (issue 36 item 2: the entries' checks run at every call).
  std::pair<int64_t, int64_t> local[8];
  std::vector<std::pair<int64_t, int64_t>> more;
  std::pair<int64_t, int64_t>* dims = local;
  if (t.ndim() > 8) {
    more.resize(static_cast<size_t>(t.ndim()));
    dims = more.data();
  }
  int n = 0;
  for (int i = 0; i < t.ndim(); ++i) {
    if (t.size(i) > 1) dims[n++] = {t.stride(i) < 0 ? -t.stride(i) : t.stride(i), t.size(i)};
  }
  std::sort(dims, dims + n);
  int64_t reach = 0;  // the largest element offset reached by the dims so far
  for (int i = 0; i < n; ++i) {
    if (dims[i].first <= reach) return true;
    reach += (dims[i].second - 1) * dims[i].first;
  }
  return false;
}

// Rule 2: no written argument shares memory with any other argument, nor overlaps itself.
inline void check_disjoint(std::initializer_list<Operand> args) {
  // Each argument's span once (on the stack up to 16 arguments, every entry's count), then the pairs
  // compare numbers: the pairs recomputed both spans before (issue 36 item 2: "cached spans").
  std::pair<uintptr_t, uintptr_t> local[16];
  std::vector<std::pair<uintptr_t, uintptr_t>> more;
  std::pair<uintptr_t, uintptr_t>* spans = local;
  if (args.size() > 16) {
    more.resize(args.size());
    spans = more.data();
  }
  size_t n = 0;
  for (const Operand& a : args) {
    if (a.written && a.tensor && may_self_overlap(*a.tensor)) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << a.name << "` is written but its elements overlap each "
                                << "other (e.g. an expand()ed view, stride 0); pass a tensor with distinct elements";
    }
    spans[n++] = a.tensor ? byte_span(*a.tensor) : std::pair<uintptr_t, uintptr_t>{0, 0};
  }
  const Operand* ops = args.begin();
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = a + 1; b < n; ++b) {
      if ((ops[a].written || ops[b].written) && ops[a].tensor && ops[b].tensor) {
        check_spans_apart(spans[a], ops[a].name, spans[b], ops[b].name);
      }
    }
  }
}

// Rule 4: every base address of a host-readable pointer table is non-null.
inline void check_pointer_table(const uint64_t* ptrs, int64_t n, const char* name) {
  for (int64_t l = 0; l < n; ++l) {
    if (ptrs[l] == 0) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << name << "`[" << l << "] is a null base address";
    }
  }
}

// Whether two per-layer pointer tables name the same buffer in some layer.
inline bool tables_share_a_buffer(const uint64_t* a, const uint64_t* b, int64_t n) {
  for (int64_t l = 0; l < n; ++l) {
    if (a[l] == b[l]) return true;
  }
  return false;
}

// Rule 4: within one buffer, no id is both a source and the destination of another pair (a chain
// such as 1 -> 2, 2 -> 3 reads a slot another pair writes). A pair copying an id onto itself is fine.
template <class Index>
void check_no_chained_ids(const Index* src, const Index* dst, int64_t n, const char* src_name, const char* dst_name) {
  std::vector<Index> sources(src, src + n);
  std::sort(sources.begin(), sources.end());
  for (int64_t i = 0; i < n; ++i) {
    if (dst[i] != src[i] && std::binary_search(sources.begin(), sources.end(), dst[i])) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << dst_name << "`[" << i << "] = " << dst[i]
                                << " is also a source in `" << src_name << "` while source and destination share "
                                << "a buffer (the result would depend on the copy order)";
    }
  }
}

// Rule 5: the index-check mode of an entry that has one (Python passes SPARSEKV_CHECK_INDICES).
enum class IndexCheck : int64_t {
  kOff = 0,      // O(1) checks, then run (kernels skip bad entries)
  kThenRun = 1,  // validate every index, then run (host-readable tables)
};

inline IndexCheck index_check_mode(int64_t mode) {
  check_range(mode, 0, 1, "index_check");
  return static_cast<IndexCheck>(mode);
}

// Runs kernel K on the module's backend: a host loop, or a launch on the caller's current stream.
#if SPARSEKV_BACKEND_CUDA
// Makes the tensors' GPU current for the launch (and for cudaFuncSetAttribute, which acts on the
// current device), and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    const int err = sparsekv_cuda_set_device(device, &previous_);
    if (err != 0) {
      TVM_FFI_THROW(RuntimeError) << "sparsekv: cannot make CUDA device " << device
                                  << " current: " << sparsekv_cuda_error_string(err);
    }
    device_ = device;
  }
  ~DeviceGuard() {
    int ignored = 0;
    if (previous_ != device_) sparsekv_cuda_set_device(previous_, &ignored);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  int device_ = 0;
};
#endif

template <class K>
void launch(const typename K::Params& params, DLDevice device) {
#if SPARSEKV_BACKEND_CUDA
  const DeviceGuard guard(device.device_id);
  void* stream = TVMFFIEnvGetStream(device.device_type, device.device_id);
  const int err = run_on_cuda<K>(params, stream);
  if (err != 0) TVM_FFI_THROW(RuntimeError) << "sparsekv: CUDA launch failed: " << sparsekv_cuda_error_string(err);
#elif SPARSEKV_BACKEND_SIM
  (void)device;
  const int err = run_on_cuda<K>(params, nullptr);
  if (err != 0) TVM_FFI_THROW(RuntimeError) << "sparsekv: sim launch failed: " << sparsekv_cuda_error_string(err);
#else
  (void)device;
  run_on_host<K>(params);
#endif
}

// launch(), except that the cpu backend runs the items on up to num_threads host threads (see
// run_on_host_threads) and calls on_chunk_end on each thread after its share.
template <class K, class OnChunkEnd>
void launch_threaded(const typename K::Params& params, DLDevice device, int64_t num_threads, int64_t bytes_per_item,
                     OnChunkEnd on_chunk_end) {
#if SPARSEKV_BACKEND_CUDA || SPARSEKV_BACKEND_SIM
  (void)num_threads, (void)bytes_per_item, (void)on_chunk_end;
  launch<K>(params, device);
#else
  (void)device;
  run_on_host_threads<K>(params, num_threads, bytes_per_item, on_chunk_end);
#endif
}

}  // namespace sparsekv
