// host_simd: what the cpu backend's hot loops need to use the CPU's vector units although the
// build targets baseline x86-64 (SSE2).
//
//   SPARSEKV_HOST_SIMD_CLONES  on a function: compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2 +
//                              FMA) and the baseline, picked once at load time. Internal-linkage,
//                              non-template functions only; empty under nvcc and on other hosts.
//   HostFloat8                 eight floats as one value (GNU vector extension: one AVX register in
//                              a v3/v4 clone, two SSE registers in the baseline one). Spelled out
//                              because for a [dim][8] tile the vectorizer otherwise picks the
//                              strided loop and runs at scalar speed (measured 3.4x slower).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define SPARSEKV_HOST_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPARSEKV_HOST_SIMD_CLONES
#endif

namespace sparsekv {

typedef float HostFloat8 __attribute__((vector_size(32)));

}  // namespace sparsekv
