// Elementwise work around the matmuls, one launch each instead of a chain of torch ops:
// residual add + RMSNorm (and + LayerNorm for OPT), plain RMSNorm, rotary embedding in
// place on q and k, SiLU-and-mul, the per-token fp8 quantization of an activation, and
// the scales of a small batch's fp8 product.
//
// Every kernel is templated on the element type T and on N, the elements one thread moves
// per access: 16 / sizeof(T) (one 16-byte vector) when the rows and pointers allow it, 1
// otherwise. Arithmetic is fp32. Each kernel rounds to T exactly where the unfused torch
// ops it replaces do (after the residual add, after the normalisation, after SiLU), so its
// results differ from them only by the order of the fp32 reductions.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "pdl.cuh"

namespace streamkv {

// Every kernel here may be launched with programmatic dependent launch (fused_cuda.py):
// it lets the next kernel start early, then waits for the previous one before it reads.
__device__ __forceinline__ void pdl_enter() {
  launch_dependents();
  grid_dependency_wait();
}

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// x rounded to T and back: what a torch op producing a T tensor hands to the next op.
template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_f(from_f<T>(x)); }

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load(const T* p, long long i) {
  return reinterpret_cast<const Pack<T, N>*>(p)[i];
}

template <typename T, int N>
__device__ __forceinline__ void store(T* p, long long i, const Pack<T, N>& v) {
  reinterpret_cast<Pack<T, N>*>(p)[i] = v;
}

// Sum over the CTA (blockDim.x a multiple of 32); every thread gets the total.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // a previous call's readers are done with `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? partial[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One CTA per row of `hidden` elements (hidden % N == 0).
// ADD: residual[r] = T(residual[r] + x[r]), then out[r] = w * T(residual[r] * rstd), with
//      out == x in the model (vLLM's fused_add_rms_norm).
// otherwise: out[r] = w * T(x[r] * rstd). rstd = rsqrt(mean(v^2) + eps) over the row.
// The second pass re-reads the row, which this thread wrote or read a moment ago (L1/L2).
// out and x may be the same rows (no __restrict__ on them).
template <typename T, int N, bool ADD>
__global__ void rms_norm_kernel(T* out, T* __restrict__ residual, const T* x,
                                const T* __restrict__ weight,
                                long long out_stride, long long res_stride, long long x_stride,
                                int hidden, float eps) {
  pdl_enter();
  const long long row = blockIdx.x;
  const int packs = hidden / N;
  const T* xr = x + row * x_stride;
  T* rr = ADD ? residual + row * res_stride : nullptr;
  float sq = 0.f;
  for (int i = threadIdx.x; i < packs; i += blockDim.x) {
    Pack<T, N> a = load<T, N>(xr, i);
    if (ADD) {
      const Pack<T, N> r = load<T, N>(rr, i);
#pragma unroll
      for (int j = 0; j < N; ++j) a.v[j] = from_f<T>(to_f(r.v[j]) + to_f(a.v[j]));
      store<T, N>(rr, i, a);
    }
#pragma unroll
    for (int j = 0; j < N; ++j) sq += to_f(a.v[j]) * to_f(a.v[j]);
  }
  const float rstd = rsqrtf(block_sum(sq) / hidden + eps);
  const T* src = ADD ? rr : xr;
  T* dst = out + row * out_stride;
  for (int i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, N> a = load<T, N>(src, i);
    const Pack<T, N> w = load<T, N>(weight, i);
    Pack<T, N> o;
#pragma unroll
    for (int j = 0; j < N; ++j)
      o.v[j] = from_f<T>(to_f(w.v[j]) * round_to<T>(to_f(a.v[j]) * rstd));
    store<T, N>(dst, i, o);
  }
}

// OPT: residual[r] = T(residual[r] + x[r]); x[r] = T((residual[r] - mean) * rstd * w + b)
// (nn.LayerNorm's single rounding); weight / bias may be null (no elementwise affine).
template <typename T, int N>
__global__ void add_layer_norm_kernel(T* __restrict__ x, T* __restrict__ residual,
                                      const T* __restrict__ weight, const T* __restrict__ bias,
                                      long long x_stride, long long res_stride, int hidden,
                                      float eps) {
  pdl_enter();
  const long long row = blockIdx.x;
  const int packs = hidden / N;
  T* xr = x + row * x_stride;
  T* rr = residual + row * res_stride;
  float sum = 0.f;
  for (int i = threadIdx.x; i < packs; i += blockDim.x) {
    Pack<T, N> a = load<T, N>(xr, i);
    const Pack<T, N> r = load<T, N>(rr, i);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      a.v[j] = from_f<T>(to_f(r.v[j]) + to_f(a.v[j]));
      sum += to_f(a.v[j]);
    }
    store<T, N>(rr, i, a);
  }
  const float mean = block_sum(sum) / hidden;
  float var = 0.f;
  for (int i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, N> a = load<T, N>(rr, i);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float d = to_f(a.v[j]) - mean;
      var += d * d;
    }
  }
  const float rstd = rsqrtf(block_sum(var) / hidden + eps);
  for (int i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, N> a = load<T, N>(rr, i);
    Pack<T, N> o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float v = (to_f(a.v[j]) - mean) * rstd;
      if (weight != nullptr) v *= to_f(weight[i * N + j]);
      if (bias != nullptr) v += to_f(bias[i * N + j]);
      o.v[j] = from_f<T>(v);
    }
    store<T, N>(xr, i, o);
  }
}

// Rotary embedding in place, non-interleaved halves (Hugging Face Llama / GPT-NeoX): for
// each head, with x1 = x[:half], x2 = x[half:] and c, s = cos / sin[position] (fp32 tables
// [positions, half], any rope scaling already in them):
//   x1' = x1 c - x2 s,  x2' = x2 c + x1 s.
// One CTA per token; its threads walk (head, pack) over the q heads, then the k heads.
// Products and sums are rounded separately (no fused multiply-add), as the unfused torch
// ops compute them, so the result equals theirs bit for bit.
template <typename T, int N>
__global__ void rotary_embedding_kernel(T* __restrict__ q, T* __restrict__ k,
                                        const long long* __restrict__ positions,
                                        const float* __restrict__ cos_table,
                                        const float* __restrict__ sin_table, long long q_stride,
                                        long long k_stride, int q_heads, int k_heads, int half) {
  pdl_enter();
  const long long t = blockIdx.x;
  const long long pos = positions[t];
  const float* cr = cos_table + pos * half;
  const float* sr = sin_table + pos * half;
  const int packs = half / N;
  const int work = (q_heads + k_heads) * packs;
  for (int i = threadIdx.x; i < work; i += blockDim.x) {
    const int head = i / packs, p = i - head * packs;
    T* base = head < q_heads ? q + t * q_stride + (long long)head * 2 * half
                             : k + t * k_stride + (long long)(head - q_heads) * 2 * half;
    Pack<T, N> a = load<T, N>(base, p);
    Pack<T, N> b = load<T, N>(base + half, p);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float c = cr[p * N + j], s = sr[p * N + j];
      const float x1 = to_f(a.v[j]), x2 = to_f(b.v[j]);
      a.v[j] = from_f<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
      b.v[j] = from_f<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    }
    store<T, N>(base, p, a);
    store<T, N>(base + half, p, b);
  }
}

// out[t] = T(T(silu(gate)) * up) with x[t] = [gate (inter) | up (inter)]: F.silu then the
// product, each rounded to T as torch does. Grid (tokens, packs / blockDim).
template <typename T, int N>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x,
                                    long long out_stride, long long x_stride, int inter) {
  pdl_enter();
  const long long t = blockIdx.x;
  const int p = blockIdx.y * blockDim.x + threadIdx.x;
  if (p >= inter / N) return;
  const T* xr = x + t * x_stride;
  const Pack<T, N> g = load<T, N>(xr, p);
  const Pack<T, N> u = load<T, N>(xr + inter, p);
  Pack<T, N> o;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float gf = to_f(g.v[j]);
    const float s = round_to<T>(__fdiv_rn(gf, 1.f + expf(-gf)));
    o.v[j] = from_f<T>(__fmul_rn(s, to_f(u.v[j])));
  }
  store<T, N>(out + t * out_stride, p, o);
}

// Max over the CTA (blockDim.x a multiple of 32); every thread gets it.
__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // a previous call's readers are done with `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? partial[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Per-token fp8 (e4m3) quantization of an activation [tokens, k] (k % N == 0), one CTA per
// row, bit for bit layers/fp8.py's _quantize_rows: scale[t] = max(amax|x[t]| / 448, 1e-12)
// and q[t] = e4m3(x[t] / scale[t]), both IEEE divisions, rounded to nearest even.
// |x / scale| <= 448 up to the scale's rounding, so __NV_SATFINITE is the reference's clamp.
// (NaN inputs differ: a NaN element stays NaN here, torch's amax makes the whole row NaN.)
// q is e4m3 bytes; the second pass re-reads the row from L1 / L2.
template <typename T, int N>
__global__ void quant_fp8_rows_kernel(unsigned char* __restrict__ q, float* __restrict__ scale,
                                      const T* __restrict__ x, long long q_stride,
                                      long long x_stride, int k) {
  pdl_enter();
  const long long row = blockIdx.x;
  const int packs = k / N;
  const T* xr = x + row * x_stride;
  float amax = 0.f;
  for (int i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, N> a = load<T, N>(xr, i);
#pragma unroll
    for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(to_f(a.v[j])));
  }
  const float s = fmaxf(__fdiv_rn(block_max(amax), 448.f), 1e-12f);
  if (threadIdx.x == 0) scale[row] = s;
  unsigned char* qr = q + row * q_stride;
  for (int i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, N> a = load<T, N>(xr, i);
    Pack<unsigned char, N> o;
#pragma unroll
    for (int j = 0; j < N; ++j)
      o.v[j] = __nv_cvt_float_to_fp8(__fdiv_rn(to_f(a.v[j]), s), __NV_SATFINITE, __NV_E4M3);
    store<unsigned char, N>(qr, i, o);
  }
}

// The scales of fp8_linear's small-batch product (layers/fp8.py): acc [rows, cols] is the
// fp32 product of the unscaled fp8 operands, and out[r] = T(acc[r] * row_scale[r] *
// col_scale (+ bias)), the epilogue a row-wise torch._scaled_mm applies to the same
// accumulator. bias may be null. Grid (rows, packs / blockDim), cols % N == 0.
template <typename T, int N>
__global__ void scale_fp8_product_kernel(T* __restrict__ out, const float* __restrict__ acc,
                                         const float* __restrict__ row_scale,
                                         const float* __restrict__ col_scale,
                                         const T* __restrict__ bias, int cols) {
  pdl_enter();
  const long long r = blockIdx.x;
  const int p = blockIdx.y * blockDim.x + threadIdx.x;
  if (p >= cols / N) return;
  const Pack<float, N> a = load<float, N>(acc + r * cols, p);
  const Pack<float, N> c = load<float, N>(col_scale, p);
  const float s = row_scale[r];
  Pack<T, N> o;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float v = __fmul_rn(__fmul_rn(a.v[j], s), c.v[j]);
    if (bias != nullptr) v = __fadd_rn(v, to_f(bias[p * N + j]));
    o.v[j] = from_f<T>(v);
  }
  store<T, N>(out + r * cols, p, o);
}

}  // namespace streamkv
