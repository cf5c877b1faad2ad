// Host-side glue, compiled only in the tvm-ffi translation unit the loader generates: argument
// checks that raise Python TypeError / ValueError / IndexError naming the argument, and launch(),
// which runs a kernel on the module's backend (SPARSEKV_BACKEND_CUDA, set by the loader).
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "sparsekv/portability.h"

#ifndef SPARSEKV_BACKEND_CUDA
#error "SPARSEKV_BACKEND_CUDA must be defined (0 or 1) by the translation unit the loader generates"
#endif

#if SPARSEKV_BACKEND_CUDA
// Defined in the loader-generated .cu, so this file needs no CUDA header.
extern "C" const char* sparsekv_cuda_error_string(int error);
extern "C" int sparsekv_cuda_device_count(int* count);
#endif

namespace sparsekv {

using tvm::ffi::TensorView;

inline constexpr DLDeviceType kBackendDevice = SPARSEKV_BACKEND_CUDA ? kDLCUDA : kDLCPU;
inline constexpr const char* kBackendName = SPARSEKV_BACKEND_CUDA ? "cuda" : "cpu";

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
  const Arg& on_backend_device_or_host() const {
    const DLDeviceType type = t_.device().device_type;
    if (SPARSEKV_BACKEND_CUDA && (type == kDLCPU || type == kDLCUDAHost)) return *this;
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

// Scalar argument range check.
inline void check_range(int64_t value, int64_t lo, int64_t hi_exclusive, const char* name) {
  if (value < lo || value >= hi_exclusive) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << name << "` must be in [" << lo << ", " << hi_exclusive
                              << "), got " << value;
  }
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
inline void check_no_overlap(const TensorView& a, const char* a_name, const TensorView& b, const char* b_name) {
  const auto [a_first, a_last] = byte_span(a);
  const auto [b_first, b_last] = byte_span(b);
  if (a_first < a_last && b_first < b_last && a_first < b_last && b_first < a_last) {
    TVM_FFI_THROW(ValueError) << "sparsekv: arguments `" << a_name << "` and `" << b_name
                              << "` must not share memory (the kernel writes one while reading the other)";
  }
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

// Runs kernel K on the module's backend: a host loop, or a launch on the caller's current stream.
template <class K>
void launch(const typename K::Params& params, DLDevice device) {
#if SPARSEKV_BACKEND_CUDA
  void* stream = TVMFFIEnvGetStream(device.device_type, device.device_id);
  const int err = run_on_cuda<K>(params, stream);
  if (err != 0) TVM_FFI_THROW(RuntimeError) << "sparsekv: CUDA launch failed: " << sparsekv_cuda_error_string(err);
#else
  (void)device;
  run_on_host<K>(params);
#endif
}

}  // namespace sparsekv
