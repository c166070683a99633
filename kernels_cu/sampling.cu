// The sampler's per-row work over the vocabulary, one CTA per draw, reading the logits in
// their own dtype (no float copy): layers/sampler.py's semantics, launched by
// kernels/sampling_cuda.py.
//
// - GREEDY: argmax (the first index on ties, as torch.argmax) and its logprob, in one pass
//   (a running max and log-sum-exp).
// - SCORE: the logprob of a token chosen elsewhere (top-k rows, drawn by torch.topk).
// - SAMPLE: the exponential race argmax(p / q), q ~ Exp(1) from a counter-based hash (the
//   one layers/stream_hash.py computes with torch: the same draws bit for bit), then the
//   nucleus test and its redraws, all here: a draw is kept when the mass of the tokens more
//   likely than it is below top_p; otherwise the row redraws among those tokens (keys of
//   the next round), which still hold the whole nucleus, until one is kept. Each pass of a
//   round also runs the next round's race over the tokens above the current pick, so a
//   round costs one pass over the row. min_p keeps tokens with p >= min_p * p_max.
// Logprobs are of the row as given (after penalties and masks, before temperature).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "pdl.cuh"

namespace streamkv {
namespace sampling {

constexpr int GREEDY = 0, SAMPLE = 1, SCORE = 2, MODE_MASK = 3;
constexpr int UNSEEDED = 4;  // the row's key base comes from random_bases (the generator)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LOWEST = -3.402823466e38f;  // a running max starts here, not at -inf: no inf - inf

// One draw, 32 bytes, as sampling_cuda.draw_table lays it out.
struct Draw {
  int row;
  int mode;
  unsigned base_lo, base_hi;  // 64-bit key base of a seeded row (stream_hash.stream_bases)
  float temperature, top_p, min_p;
  int pad;
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

// splitmix64's finalizer, and a round's 32-bit key: stream_hash.stream_keys on the device.
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ unsigned round_key(unsigned long long base, int round) {
  const unsigned long long z = mix64(base ^ static_cast<unsigned long long>(round));
  return static_cast<unsigned>(z ^ (z >> 32));
}

// stream_hash.hashed_exponentials for one token: murmur3's finalizer, then -log(u) with u
// rounded exactly as torch rounds it, so seeded draws match the torch path.
__device__ __forceinline__ float exponential(unsigned key, int token) {
  unsigned x = static_cast<unsigned>(token) * 0x9E3779B1u + key;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  const float u = __fmul_rn(__fadd_rn(__uint2float_rn(x >> 8), 0.5f), 5.9604644775390625e-8f);
  return -logf(u);  // the accurate log: u is near 1 for the likeliest winners (q near 0)
}

// (value, index) a beats b: larger value, then smaller index; index < 0 is "none".
__device__ __forceinline__ bool beats(float av, int ai, float bv, int bi) {
  if (ai < 0) return false;
  if (bi < 0) return true;
  return av > bv || (av == bv && ai < bi);
}

// CTA-wide reductions (blockDim.x a multiple of 32); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // a previous call's readers are done with `part`
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x % 32 < blockDim.x / 32 ? part[threadIdx.x % 32] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float block_max(float v) {
  __shared__ float part[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x % 32 < blockDim.x / 32 ? part[threadIdx.x % 32] : LOWEST;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (beats(ov, oi, v, i)) v = ov, i = oi;
  }
}

__device__ __forceinline__ void block_best(float& v, int& i) {
  __shared__ float vals[32];
  __shared__ int ids[32];
  warp_best(v, i);
  __syncthreads();
  if (threadIdx.x % 32 == 0) vals[threadIdx.x / 32] = v, ids[threadIdx.x / 32] = i;
  __syncthreads();
  const bool mine = threadIdx.x % 32 < blockDim.x / 32;
  v = mine ? vals[threadIdx.x % 32] : 0.f;
  i = mine ? ids[threadIdx.x % 32] : -1;
  warp_best(v, i);
}

// Calls f(first index, values, count) over the row, every thread on its share, each thread
// in increasing index order (so "the first index wins" ties need only a strict compare).
// Rows need not be 16-byte aligned: a scalar head and tail around 16-byte vectors.
template <typename T, typename F>
__device__ __forceinline__ void for_each(const T* __restrict__ row, int vocab, F&& f) {
  constexpr int N = Pack<T>::N;
  const int misalign = static_cast<int>(reinterpret_cast<unsigned long long>(row) & 15);
  const int head = min(vocab, ((16 - misalign) & 15) / static_cast<int>(sizeof(T)));
  float v[N];
  for (int i = threadIdx.x; i < head; i += blockDim.x) {
    v[0] = to_f(row[i]);
    f(i, v, 1);
  }
  const int nvec = (vocab - head) / N;
  const Pack<T>* vrow = reinterpret_cast<const Pack<T>*>(row + head);
  int k = threadIdx.x;
  for (; k + static_cast<int>(blockDim.x) < nvec; k += 2 * blockDim.x) {
    const Pack<T> a = vrow[k], b = vrow[k + blockDim.x];  // two loads in flight
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = to_f(a.v[j]);
    f(head + k * N, v, N);
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = to_f(b.v[j]);
    f(head + (k + blockDim.x) * N, v, N);
  }
  if (k < nvec) {
    const Pack<T> a = vrow[k];
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = to_f(a.v[j]);
    f(head + k * N, v, N);
  }
  for (int i = head + nvec * N + threadIdx.x; i < vocab; i += blockDim.x) {
    v[0] = to_f(row[i]);
    f(i, v, 1);
  }
}

// One round's pass once the row's max is known: the mass (exp((x - max) / T), unnormalised)
// of the tokens above `thr`, and the race with `key` among them (those with weight >= min_p).
template <typename T>
__device__ __forceinline__ void round_pass(const T* __restrict__ row, int vocab, float max, float k2,
                                           float min_p, float thr, unsigned key, float& above,
                                           int& pick) {
  constexpr int N = Pack<T>::N;
  float mass = 0.f, r_best = 0.f;
  int i_best = -1;
  for_each(row, vocab, [&](int i0, const float* v, int count) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (j < count && v[j] > thr) {
        const float e = exp2f((v[j] - max) * k2);
        mass += e;
        if (e >= min_p) {
          const float r = __fdividef(e, exponential(key, i0 + j));
          if (i_best < 0 || r > r_best) r_best = r, i_best = i0 + j;
        }
      }
    }
  });
  above = block_sum(mass);
  block_best(r_best, i_best);
  pick = i_best;
}

// A sampled row's first pass: the max, the two normalisers (logprobs without temperature,
// sampling with it) and, with RACE (no min_p), round 0's race, every sum relative to this
// thread's running max (rescaled as it grows). Returns the row's max; the sums are the CTA's.
template <typename T, bool RACE>
__device__ __forceinline__ float first_pass(const T* __restrict__ row, int vocab, float k2,
                                            unsigned key, float& lse, float& total, int& pick) {
  constexpr int N = Pack<T>::N;
  float m = LOWEST, l1 = 0.f, l2 = 0.f, r_best = 0.f;
  int i_best = -1;
  for_each(row, vocab, [&](int i0, const float* v, int count) {
    float vmax = v[0];
#pragma unroll
    for (int j = 1; j < N; ++j)
      if (j < count) vmax = fmaxf(vmax, v[j]);
    if (vmax > m) {
      const float s = exp2f((m - vmax) * k2);
      l1 *= exp2f((m - vmax) * LOG2E), l2 *= s, r_best *= s, m = vmax;
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (j < count) {
        l1 += exp2f((v[j] - m) * LOG2E);
        const float e = exp2f((v[j] - m) * k2);
        l2 += e;
        if (RACE) {
          const float r = __fdividef(e, exponential(key, i0 + j));
          if (i_best < 0 || r > r_best) r_best = r, i_best = i0 + j;
        }
      }
    }
  });
  const float top = block_max(m);
  const float scale = exp2f((m - top) * k2);
  lse = top + logf(block_sum(l1 * exp2f((m - top) * LOG2E)));
  total = block_sum(l2 * scale);
  if (RACE) {
    r_best *= scale;
    block_best(r_best, i_best);
    pick = i_best;
  }
  return top;
}

template <typename T>
__global__ void __launch_bounds__(512, 2) sample_kernel(
    const T* __restrict__ logits, long long row_stride, int vocab, const Draw* __restrict__ draws,
    const unsigned long long* __restrict__ random_bases, long long* __restrict__ chosen,
    float* __restrict__ logprobs) {
  constexpr int N = Pack<T>::N;  // elements per 16-byte load
  launch_dependents();
  grid_dependency_wait();  // the logits (and a top-k row's token) come from the kernels before
  const Draw d = draws[blockIdx.x];
  const int mode = d.mode & MODE_MASK;
  const T* __restrict__ row = logits + d.row * row_stride;

  if (mode != SAMPLE) {
    // Running max (and its first index) and sum of exp(x - max), rescaled as the max grows.
    float m = LOWEST, l = 0.f;
    int arg = -1;
    for_each(row, vocab, [&](int i0, const float* v, int count) {
      float vmax = v[0];
      int vi = 0;
#pragma unroll
      for (int j = 1; j < N; ++j)
        if (j < count && v[j] > vmax) vmax = v[j], vi = j;
      if (vmax > m) l *= exp2f((m - vmax) * LOG2E), m = vmax, arg = i0 + vi;
#pragma unroll
      for (int j = 0; j < N; ++j)
        if (j < count) l += exp2f((v[j] - m) * LOG2E);
    });
    float top = m;
    block_best(top, arg);
    const float lse = top + logf(block_sum(l * exp2f((m - top) * LOG2E)));
    if (threadIdx.x == 0) {
      const long long token = mode == SCORE ? chosen[blockIdx.x] : (arg < 0 ? 0 : arg);
      if (mode == GREEDY) chosen[blockIdx.x] = token;
      logprobs[blockIdx.x] = to_f(row[token]) - lse;
    }
    return;
  }

  const unsigned long long base =
      d.mode & UNSEEDED ? random_bases[blockIdx.x]
                        : (static_cast<unsigned long long>(d.base_hi) << 32) | d.base_lo;
  const float k2 = LOG2E / d.temperature;  // exp((x - max) / T) = exp2((x - max) * k2)
  const unsigned key0 = round_key(base, 0);
  float lse, total, top, above;
  int pick = -1;
  if (d.min_p > 0.f) {  // min_p needs the max before the race: a pass of its own
    top = first_pass<T, false>(row, vocab, k2, key0, lse, total, pick);
    round_pass(row, vocab, top, k2, d.min_p, -__int_as_float(0x7f800000), key0, above, pick);
  } else {
    top = first_pass<T, true>(row, vocab, k2, key0, lse, total, pick);
  }
  if (d.top_p < 1.f) {
    // The candidate set only shrinks (a strictly rising threshold), so this ends; the pick
    // of a round stands when the mass above it is below top_p.
    for (int round = 1;; ++round) {
      int next;
      round_pass(row, vocab, top, k2, d.min_p, to_f(row[pick < 0 ? 0 : pick]),
                 round_key(base, round), above, next);
      if (above < d.top_p * total || next < 0) break;
      pick = next;
    }
  }
  if (threadIdx.x == 0) {
    chosen[blockIdx.x] = pick < 0 ? 0 : pick;
    logprobs[blockIdx.x] = to_f(row[pick < 0 ? 0 : pick]) - lse;
  }
}

}  // namespace sampling
}  // namespace streamkv
