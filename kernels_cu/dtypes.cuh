// Element types of the KV cache and their 16-byte vector form.
//
// Every kernel moves K/V as 16-byte vectors (uint4) because that is the widest load a
// thread can issue; Traits<T> turns one such vector into VEC floats and a float back
// into T. All arithmetic happens in fp32 whatever the cache dtype.
//
// An fp8 cache (__nv_fp8_e4m3, 1 byte) holds x / scale; the kernels widen it in registers
// (e4m3 -> fp16 is exact, one cvt per pair on sm_89+) and the launchers apply the per-layer
// scales outside the kernels: K's folds into the softmax scale, V's multiplies the output.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

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

// Two e4m3 bytes (low byte first) as fp16 / fp32 pairs.
__device__ __forceinline__ __half2 fp8x2_to_half2(unsigned short x) {
  return __half2(__nv_cvt_fp8x2_to_halfraw2(x, __NV_E4M3));
}

template <>
struct Traits<__nv_fp8_e4m3> {
  static constexpr int VEC = 16;
  static __device__ __forceinline__ void to_float(const uint4& v, float* f) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 lo = __half22float2(fp8x2_to_half2(w[i] & 0xffffu));
      const float2 hi = __half22float2(fp8x2_to_half2(w[i] >> 16));
      f[4 * i] = lo.x;
      f[4 * i + 1] = lo.y;
      f[4 * i + 2] = hi.x;
      f[4 * i + 3] = hi.y;
    }
  }
};

// One element of T as a float (the fp8 cache write reads K/V element pairs).
__device__ __forceinline__ float scalar_to_float(float x) { return x; }
__device__ __forceinline__ float scalar_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float scalar_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
constexpr bool kIsHalf = false;
template <>
constexpr bool kIsHalf<__half> = true;

// Eight cache elements widened to eight T (a 16-byte vector of a 16-bit type), for the
// tensor-core kernels, whose fragments are 16-bit. With C == T the vector is the load itself.
template <typename T, typename C>
struct Widen8 {
  using Raw = uint4;  // what a thread loads: 8 elements of C
  static __device__ __forceinline__ uint4 zero() { return make_uint4(0, 0, 0, 0); }
  static __device__ __forceinline__ uint4 run(const uint4& v) { return v; }
};

template <typename T>
struct Widen8<T, __nv_fp8_e4m3> {
  using Raw = uint2;
  static __device__ __forceinline__ uint2 zero() { return make_uint2(0, 0); }
  static __device__ __forceinline__ unsigned pair(unsigned short x) {
    const __half2 h = fp8x2_to_half2(x);
    if constexpr (kIsHalf<T>) {
      return *reinterpret_cast<const unsigned*>(&h);
    } else {
      const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(h));  // exact: e4m3 fits bf16
      return *reinterpret_cast<const unsigned*>(&b);
    }
  }
  static __device__ __forceinline__ uint4 run(const uint2& v) {
    return make_uint4(pair(v.x & 0xffffu), pair(v.x >> 16), pair(v.y & 0xffffu), pair(v.y >> 16));
  }
};

}  // namespace streamkv
