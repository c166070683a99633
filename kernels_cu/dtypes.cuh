// Element types of the KV cache and their 16-byte vector form.
//
// Every kernel moves K/V as 16-byte vectors (uint4) because that is the widest load a
// thread can issue; Traits<T> turns one such vector into VEC floats and a float back
// into T. All arithmetic happens in fp32 whatever the cache dtype.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace streamkv {

template <typename T>
struct Traits;

template <>
struct Traits<float> {
  static constexpr int VEC = 4;
  static __device__ __forceinline__ void to_float(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};

template <>
struct Traits<__half> {
  static constexpr int VEC = 8;
  static __device__ __forceinline__ void to_float(const uint4& v, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 p = __half22float2(h[i]);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct Traits<__nv_bfloat16> {
  static constexpr int VEC = 8;
  static __device__ __forceinline__ void to_float(const uint4& v, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 p = __bfloat1622float2(h[i]);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
};

}  // namespace streamkv
