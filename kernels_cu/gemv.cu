// Matrix-vector products for decode steps of a few tokens: out[i] = x[i] W^T (+ bias) for
// i < m <= M, W [rows, k] row-major (a torch Linear weight). At M = 1 a decode step reads
// every weight once and does two flops per weight, so it runs at memory bandwidth or not
// at all. cuBLAS ran llama3-8b's projections at 2.7-4.4 TB/s on an H200, two of them with a
// split-K reduce launch after them, and the MLP's SiLU-and-mul as another launch.
//
// Warps take two weight rows each over a slice of k: lane l loads the 16-byte vectors
// l, l + 32, ... of its slice of both rows, UNROLL vectors of each in flight before it
// multiplies, and each input row's matching vector comes from L1 (x is a few KiB, read by
// every warp). Per-lane sums go over k in a fixed order, the warp sums them with a fixed
// butterfly and the slices meet in a fixed order, so an output row does not depend on M or
// m (a graph padded to M rows gives the eager result bit for bit).
//
// SILU pairs row r (gate) with row r + n (up) of the fused gate/up weight and writes
// T(T(silu(T(gate))) * T(up)) to out[i][r], rounding where torch's F.linear followed by
// silu_and_mul does: the MLP's activation costs no launch and no round trip of [m, 2n].
//
// Launched with programmatic dependent launch (pdl.cuh), a kernel issues its first weight
// loads before it waits for the kernel before it: the weights do not depend on it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "dtypes.cuh"
#include "pdl.cuh"

namespace streamkv {

__device__ __forceinline__ float gemv_to_f(float v) { return v; }
__device__ __forceinline__ float gemv_to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float gemv_to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ float gemv_round(float v) {
  return gemv_to_f(Traits<T>::from_float(v));
}

// Weights are read once per step: keep them out of L1, where x lives.
__device__ __forceinline__ uint4 load_weights(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

constexpr int kMaxGemvWarps = 8;

// n: output columns (SILU: the weight has 2n rows). k % VEC == 0, rows and x 16-byte
// aligned (gemv.py checks). A CTA of W warps serves W / slices row pairs (SILU: output
// columns); the `slices` warps of a pair split k into contiguous ranges and meet in shared
// memory, so a warp's part of a row is a few loads deep: one round trip to memory instead of
// a chain of them (whole rows per warp ran at 2.4-3.2 TB/s on an H200 for N <= 6144, where
// the grid had too few warps to cover the latency). Grid: ceil(pairs / (W / slices)).
template <typename T, int M, int UNROLL, bool SILU>
__global__ void __launch_bounds__(256) gemv_kernel(T* __restrict__ out, const T* __restrict__ x,
                                                   const T* __restrict__ w,
                                                   const T* __restrict__ bias,
                                                   long long out_stride, long long x_stride,
                                                   int m, int n, int k, int slices) {
  constexpr int VEC = Traits<T>::VEC;
  __shared__ float partial[kMaxGemvWarps][M][2];
  launch_dependents();
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  const int slice = wib % slices;
  const int pair = blockIdx.x * ((blockDim.x >> 5) / slices) + wib / slices;
  const int row0 = SILU ? pair : 2 * pair;
  const bool active = row0 < n;
  const bool second = SILU || row0 + 1 < n;
  const long long row1 = SILU ? (long long)row0 + n : (second ? row0 + 1 : row0);
  const int nvec = k / VEC;
  const int per = (nvec + slices - 1) / slices;
  const int begin = slice * per, end = min(nvec, begin + per);
  const uint4* w0 = reinterpret_cast<const uint4*>(w + (long long)row0 * k);
  const uint4* w1 = reinterpret_cast<const uint4*>(w + row1 * k);

  float acc0[M], acc1[M];
#pragma unroll
  for (int i = 0; i < M; ++i) acc0[i] = acc1[i] = 0.f;

  for (int base = begin; active && base < end; base += 32 * UNROLL) {
    uint4 a[UNROLL], b[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = base + u * 32 + lane;
      if (v < end) {
        a[u] = load_weights(w0 + v);
        b[u] = load_weights(w1 + v);
      } else {
        a[u] = b[u] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    if (base == begin) grid_dependency_wait();  // x (and out) belong to the kernels before
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = base + u * 32 + lane;
      if (v < end) {
        float wa[VEC], wb[VEC];
        Traits<T>::to_float(a[u], wa);
        Traits<T>::to_float(b[u], wb);
#pragma unroll
        for (int i = 0; i < M; ++i) {
          if (i < m) {
            const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + i * x_stride) + v);
            float xf[VEC];
            Traits<T>::to_float(xv, xf);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              acc0[i] = fmaf(wa[e], xf[e], acc0[i]);
              acc1[i] = fmaf(wb[e], xf[e], acc1[i]);
            }
          }
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < M; ++i) {
    acc0[i] = warp_sum(acc0[i]);
    acc1[i] = warp_sum(acc1[i]);
    if (lane == 0) {
      partial[wib][i][0] = acc0[i];
      partial[wib][i][1] = acc1[i];
    }
  }
  __syncthreads();
  // Slice 0 of each pair has waited for the previous kernel (its range is never empty).
  if (!active || slice != 0 || lane != 0) return;
  const float b0 = bias != nullptr ? gemv_to_f(bias[row0]) : 0.f;
  const float b1 = bias != nullptr ? gemv_to_f(bias[row1]) : 0.f;
#pragma unroll
  for (int i = 0; i < M; ++i) {
    if (i >= m) break;
    float g = 0.f, up = 0.f;
    for (int s = 0; s < slices; ++s) {  // a fixed order: the result does not depend on m
      g += partial[wib + s][i][0];
      up += partial[wib + s][i][1];
    }
    T* o = out + i * out_stride;
    if (SILU) {
      const float gr = gemv_round<T>(g + b0), ur = gemv_round<T>(up + b1);
      const float act = gemv_round<T>(__fdiv_rn(gr, 1.f + expf(-gr)));
      o[row0] = Traits<T>::from_float(__fmul_rn(act, ur));
    } else {
      o[row0] = Traits<T>::from_float(g + b0);
      if (second) o[row0 + 1] = Traits<T>::from_float(up + b1);
    }
  }
}

}  // namespace streamkv
