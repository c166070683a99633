// Kernels that move K/V bytes without looking at them: writing new tokens into their
// slots and moving whole blocks. They are templated on the copy unit U (uint4 when rows
// and pointers allow 16-byte accesses, narrower otherwise), not on the element dtype.
// The one exception is the fp8 cache write, which quantizes on its way in.
#include <cuda_runtime.h>

#include "dtypes.cuh"
#include "pdl.cuh"

namespace streamkv {

// One CTA per token: copies the token's [heads, row] K and V into
// cache[block, head, offset, :] for slot = block * block_size + offset; slot < 0 is padding.
template <typename U>
__global__ void reshape_and_cache_kernel(const U* __restrict__ key, const U* __restrict__ value,
                                         U* __restrict__ key_cache, U* __restrict__ value_cache,
                                         const long long* __restrict__ slot_mapping,
                                         long long key_stride, long long value_stride,
                                         int num_heads, int block_size, int row_units) {
  launch_dependents();
  grid_dependency_wait();  // launched with PDL (cache_ops.py): k and v come from the kernels before
  const long long t = blockIdx.x;
  const long long slot = slot_mapping[t];
  if (slot < 0) return;
  const long long blk = slot / block_size;
  const long long off = slot - blk * block_size;
  const int n = num_heads * row_units;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / row_units;
    const int c = i - h * row_units;
    const long long dst = ((blk * num_heads + h) * block_size + off) * row_units + c;
    key_cache[dst] = key[t * key_stride + i];
    value_cache[dst] = value[t * value_stride + i];
  }
}

// reshape_and_cache_kernel for an fp8 (e4m3) cache: each element pair of a token's K / V row
// (T) goes into its slot as x * inv_scale saturated to +-448 (__NV_SATFINITE) and rounded to
// e4m3, two bytes per store. Rows are head_size contiguous elements; head_size is even.
template <typename T>
__global__ void reshape_and_cache_fp8_kernel(
    const T* __restrict__ key, const T* __restrict__ value,
    __nv_fp8x2_storage_t* __restrict__ key_cache, __nv_fp8x2_storage_t* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping, long long key_stride, long long value_stride,
    int num_heads, int block_size, int head_size, float k_inv_scale, float v_inv_scale) {
  launch_dependents();
  grid_dependency_wait();  // launched with PDL (cache_ops.py): k and v come from the kernels before
  const long long t = blockIdx.x;
  const long long slot = slot_mapping[t];
  if (slot < 0) return;
  const long long blk = slot / block_size;
  const long long off = slot - blk * block_size;
  const int pairs = head_size / 2;
  const int n = num_heads * pairs;
  auto quantize = [](const T* x, float inv_scale) {
    const float2 f = make_float2(scalar_to_float(x[0]) * inv_scale, scalar_to_float(x[1]) * inv_scale);
    return __nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, __NV_E4M3);
  };
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / pairs;
    const long long dst = ((blk * num_heads + h) * block_size + off) * pairs + (i - h * pairs);
    key_cache[dst] = quantize(key + t * key_stride + 2 * i, k_inv_scale);
    value_cache[dst] = quantize(value + t * value_stride + 2 * i, v_inv_scale);
  }
}

// Grid (pairs, pools): CTA (i, p) copies block mapping[i][0] of pool src_ptrs[p] to block
// mapping[i][1] of pool dst_ptrs[p]. One launch serves copy-on-write for every layer's K and
// V (src == dst pools), and the gather / scatter around a host transfer (one side is a
// staging buffer). Blocks are block_units contiguous units in every pool.
template <typename U>
__global__ void move_blocks_kernel(const long long* __restrict__ src_ptrs,
                                   const long long* __restrict__ dst_ptrs,
                                   const long long* __restrict__ mapping, long long block_units) {
  constexpr int kInFlight = 4;  // loads issued before the first store
  const long long pair = blockIdx.x;
  const int pool = blockIdx.y;
  const U* __restrict__ src =
      reinterpret_cast<const U*>(src_ptrs[pool]) + mapping[2 * pair] * block_units;
  U* __restrict__ dst = reinterpret_cast<U*>(dst_ptrs[pool]) + mapping[2 * pair + 1] * block_units;
  const long long step = blockDim.x;
  long long i = threadIdx.x;
  for (; i + (kInFlight - 1) * step < block_units; i += kInFlight * step) {
    U r[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) r[k] = src[i + k * step];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) dst[i + k * step] = r[k];
  }
  for (; i < block_units; i += step) dst[i] = src[i];
}

}  // namespace streamkv
