#!/usr/bin/env bash
# Build FlashMLA's sparse decode kernels (sm_90a and the sm_100 family), their scheduler-metadata and
# combine kernels, and our extern "C" shim (flashmla_shim.cu) into one shared library, for the peer
# benchmark (`bench_dsv4_attention --peer flashmla=LIB`) and `make gpu-check`.
#
#   tools/peers/build_flashmla.sh FLASHMLA_DIR [OUT_DIR]
#
# FLASHMLA_DIR: a FlashMLA checkout at the pinned commit below with its CUTLASS submodule, e.g.
#   git clone https://github.com/deepseek-ai/FlashMLA && cd FlashMLA &&
#   git checkout 9241ae3ef9bac614dd25e45e507e089f888280e0 && git submodule update --init csrc/cutlass
# (CUTLASS elsewhere: CUTLASS_DIR=/path/to/cutlass at commit 147f5673d0c1c3dcf66f78d677fd647e4a020219).
# OUT_DIR (default: peers/flashmla, ignored by git) receives libsparsekv_flashmla.so, build.json and obj/.
# Needs nvcc >= 12.9 (sm_100); no torch, no GPU. Compiles in parallel: JOBS=N (default: the core count).
set -euo pipefail

PINNED_COMMIT=9241ae3ef9bac614dd25e45e507e089f888280e0
PINNED_CUTLASS=147f5673d0c1c3dcf66f78d677fd647e4a020219

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 FLASHMLA_DIR [OUT_DIR]" >&2
    exit 2
fi
src=$(cd "$1" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${2:-$here/../../peers/flashmla}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cutlass=${CUTLASS_DIR:-$src/csrc/cutlass}
nvcc=${NVCC:-nvcc}
jobs=${JOBS:-$(nproc)}

[[ -f $src/csrc/params.h ]] || { echo "$src is not a FlashMLA checkout (no csrc/params.h)" >&2; exit 2; }
[[ -f $cutlass/include/cute/tensor.hpp ]] || {
    echo "no CUTLASS at $cutlass: run 'git submodule update --init csrc/cutlass' in the checkout or set CUTLASS_DIR" >&2
    exit 2
}
commit=$(git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown)
if [[ $commit != "$PINNED_COMMIT" ]]; then
    echo "warning: FlashMLA at $commit, not the pinned $PINNED_COMMIT: the shim's layout check decides at load" >&2
fi
cutlass_commit=$(git -C "$cutlass" rev-parse HEAD 2>/dev/null || echo unknown)

sm90=(-gencode arch=compute_90a,code=sm_90a)
sm100=(-gencode arch=compute_100f,code=sm_100f)
flags=(-O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -DFLASH_MLA_DISABLE_FP16 -Xcompiler=-fPIC
       --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math -Wno-deprecated-declarations
       -I"$src/csrc" -I"$src/csrc/kerutils/include" -I"$cutlass/include" -I"$cutlass/tools/util/include")

# source : architectures it is compiled for
units=(
    "$here/flashmla_shim.cu:both"
    "$src/csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu:both"
    "$src/csrc/smxx/decode/combine/combine.cu:both"
    "$src/csrc/sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu:sm90"
    "$src/csrc/sm90/decode/sparse_fp8/instantiations/model1_persistent_h128.cu:sm90"
    "$src/csrc/sm100/decode/head64/instantiations/model1.cu:sm100"
    "$src/csrc/sm100/prefill/sparse/fwd_for_small_topk/head128/instantiations/phase1_decode_k512.cu:sm100"
)

# Objects are kept in OUT_DIR/obj: a rerun compiles only the units whose source is newer than its object.
objdir=$out/obj
mkdir -p "$objdir"
pids=()
objects=()
for unit in "${units[@]}"; do
    file=${unit%:*}
    case ${unit##*:} in
        both) arch=("${sm90[@]}" "${sm100[@]}") ;;
        sm90) arch=("${sm90[@]}") ;;
        sm100) arch=("${sm100[@]}") ;;
    esac
    obj=$objdir/$(basename "$(dirname "$file")")_$(basename "${file%.cu}").o
    objects+=("$obj")
    [[ -f $obj && $obj -nt $file ]] && continue
    while [[ $(jobs -rp | wc -l) -ge $jobs ]]; do wait -n; done
    echo "nvcc ${file#"$src"/}" >&2
    "$nvcc" "${flags[@]}" "${arch[@]}" -c "$file" -o "$obj" &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

# The kernels call the driver API (tensor-map encoding): link against libcuda.so.1. A build machine
# without a driver or the toolkit's stub gets a symbol-less stand-in that only records the dependency;
# the symbols bind to the real driver when the library is loaded on a GPU machine.
stubs=$(dirname "$(command -v "$nvcc")")/../lib64/stubs
if [[ ! -f $stubs/libcuda.so ]]; then
    stubs=$objdir/stubs
    mkdir -p "$stubs"
    echo "" | ${CC:-cc} -x c -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so" -
fi
lib=$out/libsparsekv_flashmla.so
"$nvcc" -shared "${sm90[@]}" "${sm100[@]}" -o "$lib.tmp" "${objects[@]}" -L"$stubs" -Xlinker --no-as-needed -lcuda
strip --strip-unneeded "$lib.tmp" 2>/dev/null || true
mv "$lib.tmp" "$lib"
cat > "$out/build.json" <<JSON
{"flashmla_commit": "$commit", "pinned_commit": "$PINNED_COMMIT", "cutlass_commit": "$cutlass_commit",
 "pinned_cutlass": "$PINNED_CUTLASS", "nvcc": "$("$nvcc" --version | tail -1)", "library": "$(basename "$lib")",
 "bytes": $(stat -c %s "$lib")}
JSON
echo "$lib ($(du -h "$lib" | cut -f1))"
