// Paged decode attention: one query token per sequence over its K/V in the block pool.
//
// Layout (streamkv/kernels/ops.py): key_cache, value_cache [num_blocks, kv_heads, BLOCK, HEAD],
// so one (block, kv head) tile is BLOCK * HEAD contiguous elements and each token's row of
// HEAD elements is contiguous. docs/kernels.md explains the choice and the design below.
//
// Grid: x = partition of the context, y = kv head (x head chunk), z = sequence.
// One CTA serves every query head of its kv head (up to GPAD of them), so each K/V tile
// is read from memory once per kv head whatever the GQA ratio. A token's row is read by a
// group of TG threads with 16-byte loads; consecutive groups take consecutive tokens, so a
// warp reads whole rows of one tile. Two passes over the partition: q.k into shared
// logits, softmax, then p.v. A long context is split into partitions (flash-decoding
// style) whose partial results are merged by the last CTA of the sequence to finish (or by
// paged_attention_reduce_kernel), so the context length is bounded only by the block table.
//
// Both decode kernels take the cache's element type C after their other template arguments,
// defaulting to the query's T: C = __nv_fp8_e4m3 is the fp8 cache, widened in registers
// after each load (the launcher folds the K scale into `scale` and multiplies the output by
// the V scale). With C = T the code is the 16-bit / fp32 kernel as it always was.
#include "dtypes.cuh"
#include "pdl.cuh"

namespace streamkv {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPartition = 1024;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kNegInf = -3.402823466e38f;  // -FLT_MAX: finite, so exp(x - max) never sees inf - inf

__host__ __device__ constexpr int next_pow2(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

template <typename T, int HEAD, int STAGES>
struct RowShape {
  static constexpr int VEC = Traits<T>::VEC;          // elements per 16-byte vector
  static constexpr int NV = HEAD / VEC;               // vectors per token row
  static constexpr int TG = NV >= 32 ? 32 : next_pow2(NV);  // threads per token
  static constexpr int NVT = (NV + TG - 1) / TG;      // vectors per thread per token
  static constexpr int NG = kThreads / TG;            // tokens a CTA reads per step
  // Tokens per thread per iteration. Register loads (STAGES == 0) need them all in flight at
  // once; the cp.async ring keeps STAGES - 1 iterations in flight, so each can be shorter.
  static constexpr int UNROLL = (STAGES == 0 ? 8 : 4) / NVT;
  static constexpr int STEP = NG * UNROLL;            // tokens per CTA per iteration
  static constexpr int RING = STAGES * UNROLL * NVT * kThreads;  // uint4 slots of the ring
  static_assert(HEAD % VEC == 0, "head size must be a multiple of 16 bytes");
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  // src-size 0 writes 16 zero bytes and reads nothing: padding tokens cost no traffic.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Streams one partition's K (or V) rows to the threads: iteration `it` gives each token group
// the rows of tokens it * STEP + u * NG + grp (u < UNROLL), each thread its vectors lg + j * TG.
// STAGES == 0 loads straight into registers. STAGES > 0 copies through a per-thread ring in
// shared memory with cp.async, STAGES - 1 iterations ahead: in-flight bytes then cost shared
// memory instead of registers, and V's first stages load while the softmax runs. A thread
// only ever reads the slots it filled itself, so the ring needs no barriers.
template <typename T, int HEAD, int BLOCK, int STAGES>
struct RowStream {
  using R = RowShape<T, HEAD, STAGES>;
  const T* base;  // cache + this kv head's tile offset
  const int* blk;  // the partition's block ids (shared memory)
  long long blk_stride;
  int n_tok, n_iter, grp, lg;
  uint4* ring;

  __device__ __forceinline__ const T* row(int t) const {
    return base + (t < n_tok ? (long long)blk[t / BLOCK] * blk_stride : 0) + (t % BLOCK) * HEAD;
  }

  // This thread's slots of iteration `it`: vector (u, j) is slot[(u * NVT + j) * kThreads].
  __device__ __forceinline__ uint4* slot(int it) const {
    return ring + (it % STAGES) * (R::UNROLL * R::NVT * kThreads) + threadIdx.x;
  }

  __device__ __forceinline__ void issue(int it) const {
    if constexpr (STAGES > 0) {
      if (it < n_iter) {
        uint4* slot = this->slot(it);
#pragma unroll
        for (int u = 0; u < R::UNROLL; ++u) {
          const int t = it * R::STEP + u * R::NG + grp;
          const T* r = row(t);
#pragma unroll
          for (int j = 0; j < R::NVT; ++j) {
            const int c = lg + j * R::TG;
            const bool ok = t < n_tok && c < R::NV;
            cp_async16(slot + (u * R::NVT + j) * kThreads, ok ? r + c * R::VEC : base, ok);
          }
        }
      }
      cp_async_commit();  // empty groups too, so wait_group counts stay aligned
    }
  }

  __device__ __forceinline__ void start() const {
#pragma unroll
    for (int s = 0; s + 1 < STAGES; ++s) issue(s);
  }

  __device__ __forceinline__ void fetch(int it, uint4 (&v)[R::UNROLL][R::NVT]) const {
    if constexpr (STAGES > 0) {
      issue(it + STAGES - 1);
      cp_async_wait<STAGES - 1>();
      const uint4* slot = this->slot(it);
#pragma unroll
      for (int u = 0; u < R::UNROLL; ++u)
#pragma unroll
        for (int j = 0; j < R::NVT; ++j) v[u][j] = slot[(u * R::NVT + j) * kThreads];
    } else {
#pragma unroll
      for (int u = 0; u < R::UNROLL; ++u) {
        const int t = it * R::STEP + u * R::NG + grp;
        const T* r = row(t);
#pragma unroll
        for (int j = 0; j < R::NVT; ++j) {
          const int c = lg + j * R::TG;
          v[u][j] = (t < n_tok && c < R::NV)
                        ? __ldg(reinterpret_cast<const uint4*>(r + c * R::VEC))
                        : make_uint4(0, 0, 0, 0);
        }
      }
    }
  }
};

// Sums N per-head partial dot products over the lanes of a token group. While a lane still
// carries more than one head it keeps half of them and sends the other half (a
// reduce-scatter), so the group needs N-1+log2(TG/N) shuffles instead of N*log2(TG).
// On return v[0..N/min(N,TG)) hold heads head..; lanes that differ only in the bits of the
// plain-sum levels hold the same values.
template <int N, int OFFSET>
__device__ __forceinline__ void group_reduce(float* v, int lane, int& head) {
  if constexpr (OFFSET >= 1) {
    if constexpr (N > 1) {
      const bool upper = (lane & OFFSET) != 0;
#pragma unroll
      for (int j = 0; j < N / 2; ++j) {
        const float send = upper ? v[j] : v[j + N / 2];
        const float keep = upper ? v[j + N / 2] : v[j];
        v[j] = keep + __shfl_xor_sync(kFullMask, send, OFFSET);
      }
      if (upper) head += N / 2;
      group_reduce<N / 2, OFFSET / 2>(v, lane, head);
    } else {
      v[0] += __shfl_xor_sync(kFullMask, v[0], OFFSET);
      group_reduce<1, OFFSET / 2>(v, lane, head);
    }
  }
}

template <int GPAD>
__device__ __forceinline__ void load_probs(const float* row, float* p) {
  if constexpr (GPAD % 4 == 0) {
#pragma unroll
    for (int g = 0; g < GPAD; g += 4) {
      const float4 x = *reinterpret_cast<const float4*>(row + g);
      p[g] = x.x;
      p[g + 1] = x.y;
      p[g + 2] = x.z;
      p[g + 3] = x.w;
    }
  } else {
#pragma unroll
    for (int g = 0; g < GPAD; ++g) p[g] = row[g];
  }
}

template <int GPAD>
__device__ __forceinline__ float block_reduce_max(float v, float (*red)[GPAD], int h) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o >= GPAD; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  if (lane < GPAD) red[warp][lane] = v;
  __syncthreads();
  v = red[0][h];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) v = fmaxf(v, red[w][h]);
  return v;
}

template <int GPAD>
__device__ __forceinline__ float block_reduce_sum(float v, float (*red)[GPAD], int h) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o >= GPAD; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  if (lane < GPAD) red[warp][lane] = v;
  __syncthreads();
  v = red[0][h];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) v += red[w][h];
  return v;
}

// Where a decode CTA works: its sequence, KV head, query heads and slice of the context.
template <int GPAD>
struct PartitionWork {
  int part, kvh, seq, num_heads, head0, n_heads, ctx, start, n_tok;

  __device__ __forceinline__ PartitionWork(const int* context_lens, int num_kv_heads,
                                           int group_size, int partition_size) {
    part = blockIdx.x;
    const int chunks = (group_size + GPAD - 1) / GPAD;
    kvh = blockIdx.y / chunks;
    const int chunk = blockIdx.y - kvh * chunks;
    seq = blockIdx.z;
    num_heads = num_kv_heads * group_size;
    head0 = kvh * group_size + chunk * GPAD;
    n_heads = min(GPAD, group_size - chunk * GPAD);
    ctx = context_lens[seq];
    start = part * partition_size;
    n_tok = min(partition_size, ctx - start);
  }

  // True when the partition starts past the context, so the CTA has nothing to do. An empty
  // context (a padded batch slot) gets zeros rather than garbage from its first CTA.
  template <typename T, int HEAD>
  __device__ __forceinline__ bool idle(T* out, int max_partitions,
                                       const int* merge_counters) const {
    if (start < ctx) return false;
    if (ctx <= 0 && part == 0 && (max_partitions == 1 || merge_counters != nullptr)) {
      for (int i = threadIdx.x; i < n_heads * HEAD; i += kThreads)
        out[((long long)seq * num_heads + head0) * HEAD + i] = Traits<T>::from_float(0.f);
    }
    return true;
  }

  // The partition's block ids into shared memory (the caller synchronises).
  template <int BLOCK>
  __device__ __forceinline__ void load_blocks(int* blk_s, const int* block_tables,
                                              int block_table_stride) const {
    const int* bt = block_tables + (long long)seq * block_table_stride + start / BLOCK;
    for (int i = threadIdx.x; i < (n_tok + BLOCK - 1) / BLOCK; i += kThreads) blk_s[i] = bt[i];
  }
};

// Softmax over a partition's logits[t * stride + h] (t < n_tok, h < GPAD) in place, leaving
// unnormalised exp(x - max) and the per-head max and sum in max_s / sum_s; thread tid works
// on head tid % GPAD. Its last barrier publishes the probabilities to the whole CTA.
template <int GPAD>
__device__ __forceinline__ void cta_softmax(float* logits, int stride, int n_tok,
                                            float (*red_max)[GPAD], float (*red_sum)[GPAD],
                                            float* max_s, float* sum_s) {
  const int tid = threadIdx.x, h = tid % GPAD;
  float m = kNegInf;
  for (int t = tid / GPAD; t < n_tok; t += kThreads / GPAD) m = fmaxf(m, logits[t * stride + h]);
  m = block_reduce_max<GPAD>(m, red_max, h);
  float s = 0.f;
  for (int t = tid / GPAD; t < n_tok; t += kThreads / GPAD) {
    const float p = expf(logits[t * stride + h] - m);
    logits[t * stride + h] = p;
    s += p;
  }
  s = block_reduce_sum<GPAD>(s, red_sum, h);
  if (tid < GPAD) {
    max_s[tid] = m;
    sum_s[tid] = s;
  }
}

// The end of a partition, shared by both decode kernels. outs[w][g][d] holds warp w's sum of
// p * v for head g (scaled by wscale[w][g] when given), sum_s / max_s the partition's softmax
// denominator and max per head. A single-partition sequence writes its output directly;
// otherwise the partition stores its normalised output, max and sum for the merge, which the
// last CTA of the (sequence, kv head) to finish performs itself when merge_counters is given.
template <typename T, int HEAD, int GPAD>
__device__ __forceinline__ void finish_partition(
    const float* outs, const float (*wscale)[GPAD], const float* max_s, const float* sum_s,
    T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_max,
    float* __restrict__ part_sum, int* __restrict__ merge_counters, int seq, int num_heads,
    int head0, int n_heads, int part, int ctx, int partition_size, int max_partitions) {
  using Tr = Traits<T>;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // With merge counters a sequence that fits one partition skips the partials altogether.
  const int n_parts = (ctx + partition_size - 1) / partition_size;
  const bool direct = max_partitions == 1 || (merge_counters != nullptr && n_parts == 1);
  for (int i = tid; i < n_heads * HEAD; i += kThreads) {
    const int g = i / HEAD, d = i - g * HEAD;
    float v = 0.f;
    if (wscale == nullptr) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) v += outs[(w * GPAD + g) * HEAD + d];
    } else {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) v = fmaf(wscale[w][g], outs[(w * GPAD + g) * HEAD + d], v);
    }
    v /= sum_s[g];
    const long long row = (long long)seq * num_heads + head0 + g;
    if (direct) {
      out[row * HEAD + d] = Tr::from_float(v);
    } else {
      part_out[(row * max_partitions + part) * HEAD + d] = v;
    }
  }
  if (direct) return;
  if (tid < n_heads) {
    const long long idx = ((long long)seq * num_heads + head0 + tid) * max_partitions + part;
    part_max[idx] = max_s[tid];
    part_sum[idx] = sum_s[tid];
  }
  if (merge_counters == nullptr) return;  // paged_attention_reduce_kernel merges

  // Fused merge: the last CTA of a (sequence, kv head) to finish merges its partitions, so
  // no second launch and no tail of tiny merge CTAs. Each thread fences its partials before
  // the CTA is counted; the merging CTA reads them from L2 (ld.cg), never a stale L1 line.
  __shared__ int last_s;
  __shared__ float gmax_s[GPAD], ginv_s[GPAD];
  __threadfence();
  __syncthreads();
  int* counter = merge_counters + (long long)seq * gridDim.y + blockIdx.y;
  if (tid == 0) last_s = atomicAdd(counter, 1) == n_parts - 1;
  __syncthreads();
  if (!last_s) return;
  if (tid == 0) *counter = 0;  // every CTA of the column has counted: ready for the next launch
  __threadfence();
  for (int g = warp; g < n_heads; g += kWarps) {  // one warp per head: max and denominator
    const long long row = (long long)seq * num_heads + head0 + g;
    const float* pm = part_max + row * max_partitions;
    const float* ps = part_sum + row * max_partitions;
    float m = kNegInf;
    for (int p = lane; p < n_parts; p += 32) m = fmaxf(m, __ldcg(pm + p));
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, o));
    float w = 0.f;
    for (int p = lane; p < n_parts; p += 32) w += __ldcg(ps + p) * expf(__ldcg(pm + p) - m);
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) w += __shfl_xor_sync(kFullMask, w, o);
    if (lane == 0) {
      gmax_s[g] = m;
      ginv_s[g] = 1.f / w;
    }
  }
  __syncthreads();
  for (int i = tid; i < n_heads * HEAD; i += kThreads) {
    const int g = i / HEAD, d = i - g * HEAD;
    const long long row = (long long)seq * num_heads + head0 + g;
    const float* pm = part_max + row * max_partitions;
    const float* ps = part_sum + row * max_partitions;
    const float* po = part_out + row * max_partitions * HEAD + d;
    float acc = 0.f;
#pragma unroll 4
    for (int p = 0; p < n_parts; ++p)
      acc = fmaf(__ldcg(ps + p) * expf(__ldcg(pm + p) - gmax_s[g]), __ldcg(po + p * HEAD), acc);
    out[row * HEAD + d] = Tr::from_float(acc * ginv_s[g]);
  }
}

// N consecutive elements of T (N * sizeof(T) a multiple of 16 bytes) as floats, in 16-byte loads.
template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* p, float* f) {
  constexpr int PER = 16 / sizeof(T);
#pragma unroll
  for (int k = 0; k < N / PER; ++k) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p + k * PER);  // one 16-byte load
    Traits<T>::to_float(raw, f + k * PER);
  }
}

// Dynamic shared memory: the ring (RowShape::RING uint4) then max(partition_size,
// kWarps * HEAD) * GPAD floats for the logits and later the output sums (the host computes it).
// A row is HEAD elements of the cache type C, so an fp8 row is half the vectors of a bf16 one.
template <typename T, int HEAD, int BLOCK, int GPAD, int STAGES, typename C = T>
__global__ void __launch_bounds__(kThreads) paged_attention_decode_kernel(
    T* __restrict__ out,              // [seqs, heads, HEAD] (single-partition launches)
    float* __restrict__ part_out,     // [seqs, heads, max_partitions, HEAD]
    float* __restrict__ part_max,     // [seqs, heads, max_partitions]
    float* __restrict__ part_sum,     // [seqs, heads, max_partitions]
    int* __restrict__ merge_counters,  // [seqs, gridDim.y] zeros (fused merge), or null;
                                      // left at zero again by the merging CTAs
    const T* __restrict__ query,      // [seqs, heads, HEAD], seq stride q_stride
    const C* __restrict__ key_cache, const C* __restrict__ value_cache,
    const int* __restrict__ block_tables, const int* __restrict__ context_lens, float scale,
    long long q_stride, int block_table_stride, int num_kv_heads, int group_size,
    int partition_size, int max_partitions) {
  launch_dependents();  // the o projection after it may start loading its weights
  grid_dependency_wait();  // launched with PDL: q and the cache come from the kernels before
  using R = RowShape<C, HEAD, STAGES>;
  using Tc = Traits<C>;
  static_assert(kMaxPartition % BLOCK == 0, "partition must hold whole blocks");
  static_assert(GPAD <= 32 && (GPAD & (GPAD - 1)) == 0, "GPAD is a power of two <= 32");

  extern __shared__ float4 smem4[];
  uint4* ring = reinterpret_cast<uint4*>(smem4);
  float* smem = reinterpret_cast<float*>(ring + R::RING);
  __shared__ int blk_s[kMaxPartition / BLOCK];
  __shared__ float red_max[kWarps][GPAD];
  __shared__ float red_sum[kWarps][GPAD];
  __shared__ float max_s[GPAD];
  __shared__ float sum_s[GPAD];

  const PartitionWork<GPAD> w(context_lens, num_kv_heads, group_size, partition_size);
  if (w.template idle<T, HEAD>(out, max_partitions, merge_counters)) return;
  const int part = w.part, kvh = w.kvh, seq = w.seq, num_heads = w.num_heads;
  const int head0 = w.head0, n_heads = w.n_heads, ctx = w.ctx, n_tok = w.n_tok;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  w.template load_blocks<BLOCK>(blk_s, block_tables, block_table_stride);

  const int lg = tid % R::TG;  // this thread's vectors in a row: lg, lg + TG, ...
  const int grp = tid / R::TG;  // token group
  const long long blk_stride = (long long)num_kv_heads * BLOCK * HEAD;
  const long long head_off = (long long)kvh * BLOCK * HEAD;
  const int n_iter = (n_tok + R::STEP - 1) / R::STEP;
  __syncthreads();  // blk_s
  const RowStream<C, HEAD, BLOCK, STAGES> keys{key_cache + head_off, blk_s, blk_stride,
                                               n_tok, n_iter, grp, lg, ring};
  keys.start();

  // q for every head of the group in registers, pre-scaled; padded heads are zero.
  float q[GPAD][R::NVT][R::VEC];
#pragma unroll
  for (int g = 0; g < GPAD; ++g) {
#pragma unroll
    for (int j = 0; j < R::NVT; ++j) {
      const int c = lg + j * R::TG;
      if (g < n_heads && c < R::NV) {
        load_floats<T, R::VEC>(query + seq * q_stride + (long long)(head0 + g) * HEAD + c * R::VEC,
                               q[g][j]);
#pragma unroll
        for (int e = 0; e < R::VEC; ++e) q[g][j][e] *= scale;
      } else {
#pragma unroll
        for (int e = 0; e < R::VEC; ++e) q[g][j][e] = 0.f;
      }
    }
  }

  float* logits = smem;  // [partition][GPAD]

  // Pass 1: logits. The loop bound is uniform over the CTA so every lane reaches the
  // shuffles; tokens past the end read zeros and are not stored.
  constexpr int kSplit = GPAD < R::TG ? GPAD : R::TG;
  constexpr int kHeld = GPAD / kSplit;                // heads a lane holds after the reduce
  constexpr int kDupMask = R::TG / kSplit - 1;        // lanes holding duplicate sums
  for (int it = 0; it < n_iter; ++it) {
    uint4 kv[R::UNROLL][R::NVT];
    keys.fetch(it, kv);
#pragma unroll
    for (int u = 0; u < R::UNROLL; ++u) {
      float acc[GPAD];
#pragma unroll
      for (int g = 0; g < GPAD; ++g) acc[g] = 0.f;
#pragma unroll
      for (int j = 0; j < R::NVT; ++j) {
        float kf[R::VEC];
        Tc::to_float(kv[u][j], kf);
#pragma unroll
        for (int g = 0; g < GPAD; ++g)
#pragma unroll
          for (int e = 0; e < R::VEC; ++e) acc[g] = fmaf(q[g][j][e], kf[e], acc[g]);
      }
      int h = 0;
      group_reduce<GPAD, R::TG / 2>(acc, lane, h);
      const int t = it * R::STEP + u * R::NG + grp;
      if (t < n_tok && (lg & kDupMask) == 0) {
#pragma unroll
        for (int j = 0; j < kHeld; ++j) logits[t * GPAD + h + j] = acc[j];
      }
    }
  }
  // V's first stages load while the softmax below runs.
  const RowStream<C, HEAD, BLOCK, STAGES> values{value_cache + head_off, blk_s, blk_stride,
                                                 n_tok, n_iter, grp, lg, ring};
  values.start();
  __syncthreads();

  cta_softmax<GPAD>(logits, GPAD, n_tok, red_max, red_sum, max_s, sum_s);

  // Pass 2: unnormalised p.v, each thread owning vectors lg, lg + TG, ... of the row.
  float acc[GPAD][R::NVT][R::VEC];
#pragma unroll
  for (int g = 0; g < GPAD; ++g)
#pragma unroll
    for (int j = 0; j < R::NVT; ++j)
#pragma unroll
      for (int e = 0; e < R::VEC; ++e) acc[g][j][e] = 0.f;

  for (int it = 0; it < n_iter; ++it) {
    uint4 vv[R::UNROLL][R::NVT];
    values.fetch(it, vv);
#pragma unroll
    for (int u = 0; u < R::UNROLL; ++u) {
      const int t = it * R::STEP + u * R::NG + grp;
      if (t < n_tok) {
        float p[GPAD];
        load_probs<GPAD>(logits + t * GPAD, p);
#pragma unroll
        for (int j = 0; j < R::NVT; ++j) {
          float vf[R::VEC];
          Tc::to_float(vv[u][j], vf);
#pragma unroll
          for (int g = 0; g < GPAD; ++g)
#pragma unroll
            for (int e = 0; e < R::VEC; ++e) acc[g][j][e] = fmaf(p[g], vf[e], acc[g][j][e]);
        }
      }
    }
  }
  if constexpr (STAGES > 0) cp_async_wait<0>();  // only empty groups remain; leave none behind

  // Sum the token groups: first the groups sharing a warp, then the warps through smem
  // (which reuses the logits, hence the barrier first).
#pragma unroll
  for (int o = R::TG; o < 32; o <<= 1)
#pragma unroll
    for (int g = 0; g < GPAD; ++g)
#pragma unroll
      for (int j = 0; j < R::NVT; ++j)
#pragma unroll
        for (int e = 0; e < R::VEC; ++e)
          acc[g][j][e] += __shfl_xor_sync(kFullMask, acc[g][j][e], o);
  __syncthreads();
  float* outs = smem;  // [kWarps][GPAD][HEAD]
  if (lane < R::TG) {
#pragma unroll
    for (int g = 0; g < GPAD; ++g)
#pragma unroll
      for (int j = 0; j < R::NVT; ++j) {
        const int c = lg + j * R::TG;
        if (c < R::NV) {
#pragma unroll
          for (int e = 0; e < R::VEC; ++e)
            outs[(warp * GPAD + g) * HEAD + c * R::VEC + e] = acc[g][j][e];
        }
      }
  }
  __syncthreads();

  finish_partition<T, HEAD, GPAD>(outs, nullptr, max_s, sum_s, out, part_out, part_max, part_sum,
                                  merge_counters, seq, num_heads, head0, n_heads, part, ctx,
                                  partition_size, max_partitions);
}

// fp16 / bf16 tensor-core form of mma.sync.m16n8k16 (A row-major, B column-major, fp32
// accumulators), with the fragment layout of the PTX ISA: lane = 4 * group + quad holds
// A[group | group + 8][2 * quad + {0, 1} | + 8], B[2 * quad + {0, 1} | + 8][group] and
// C[group | group + 8][2 * quad + {0, 1}].
template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
  }
};

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
  }
};

// Minimum CTAs per multiprocessor promised to ptxas for the tensor-core kernel: 1 lets it use
// the registers it wants (see below), except that two chunks per step at head size 128 are held
// to 128 registers so that 4 CTAs (16 warps) fit a multiprocessor.
__host__ __device__ constexpr int tc_min_ctas(int head, int unroll) {
  return head == 128 && unroll == 2 ? 4 : 1;
}

__device__ __forceinline__ unsigned word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Tensor-core decode for fp16 / bf16 caches and head sizes that are multiples of 64. Same
// grid, partitions, partials and merge as paged_attention_decode_kernel; the two products
// run on mma.sync, with the CTA's query heads (up to 8) as the N dimension, so a token costs
// a few tensor-core instructions instead of GPAD * HEAD fp32 multiply-adds per row.
//
// Each warp takes chunks of 16 tokens. Pass 1 (logits^T = K q^T): A is the chunk of K
// (16 tokens x 16 dims per mma), B the heads' q. A dot product does not care in which order it
// walks the head dimension, so lane (group, quad) feeds the mma straight from the 16-byte
// vectors quad, quad + 4, ... of rows group and group + 8 (K and q alike): whole rows per
// warp load, no shuffles, no shared memory. Pass 2 (out^T = V^T p^T): A is V transposed
// (16 dims x 16 tokens), B the probabilities; lane (group, quad) loads vectors group,
// group + 8, ... of tokens 2q, 2q+1, 2q+8, 2q+9 and pairs the two tokens' halves with byte
// permutes. Probabilities go to the tensor cores in the cache's 16-bit type; all sums are
// fp32. Dynamic shared memory: max(partition_size * 8, kWarps * GPAD * HEAD) floats.
//
// WARP_SOFTMAX: each warp takes the softmax of its own chunks (shuffles, no CTA barrier
// between the passes, so warps drift apart and one warp's softmax overlaps another's loads),
// and the warps' (max, sum, output) are rescaled to the partition's max at the end; otherwise
// one block-wide softmax between two CTA barriers.
//
// UNROLL: chunks a warp loads per step before it multiplies any of them (16 rows, 4 KB at
// head 128), so UNROLL chunks per warp are in flight while it waits: more bytes in flight
// for more registers (fewer CTAs per multiprocessor). Pass 2's first step is loaded before
// the softmax.
//
// __launch_bounds__(kThreads, 1), not (kThreads): with a minimum of one CTA per multiprocessor
// stated, ptxas used 86 registers instead of 69 for bf16 / 128, and that code was up to 25%
// faster on an H200 (docs/kernels.md).
//
// C = __nv_fp8_e4m3: a lane loads the same 8 elements per vector as for 16-bit, as 8 bytes
// (uint2), and widens them to T just before the mma that takes them, so the loads of a
// step stay in flight as before.
template <typename T, int HEAD, int BLOCK, int GPAD, bool WARP_SOFTMAX, int UNROLL,
          typename C = T>
__global__ void __launch_bounds__(kThreads, tc_min_ctas(HEAD, UNROLL)) paged_attention_decode_tc_kernel(
    T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_max,
    float* __restrict__ part_sum, int* __restrict__ merge_counters,
    const T* __restrict__ query, const C* __restrict__ key_cache,
    const C* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ context_lens, float scale, long long q_stride,
    int block_table_stride, int num_kv_heads, int group_size, int partition_size,
    int max_partitions) {
  launch_dependents();  // the o projection after it may start loading its weights
  grid_dependency_wait();  // launched with PDL: q and the cache come from the kernels before
  using Tr = Traits<T>;
  using Wd = Widen8<T, C>;
  using Raw = typename Wd::Raw;  // one lane's load of 8 cache elements
  static_assert(HEAD % 64 == 0, "tensor-core decode needs a head size that is a multiple of 64");
  static_assert(Tr::VEC == 8, "tensor-core decode is for 16-bit caches");
  static_assert(GPAD <= 8 && (GPAD & (GPAD - 1)) == 0, "GPAD is a power of two <= 8");
  static_assert(kMaxPartition % BLOCK == 0, "partition must hold whole blocks");
  static_assert(UNROLL >= 1 && UNROLL <= 4, "UNROLL is 1 to 4 chunks per warp step");
  constexpr int NH = 8;            // mma N: the CTA's heads, zero-padded
  constexpr int CHUNK = 16;        // tokens per warp step
  constexpr int KV1 = HEAD / 32;   // pass 1: vectors per row per lane
  constexpr int KV2 = HEAD / 64;   // pass 2: vectors per token per lane
  constexpr int MT = HEAD / 16;    // pass 2: m-tiles (16 dims each) of the output

  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  __shared__ int blk_s[kMaxPartition / BLOCK];
  __shared__ float red_max[kWarps][GPAD];
  __shared__ float red_sum[kWarps][GPAD];
  __shared__ float max_s[GPAD];
  __shared__ float sum_s[GPAD];

  const PartitionWork<GPAD> w(context_lens, num_kv_heads, group_size, partition_size);
  if (w.template idle<T, HEAD>(out, max_partitions, merge_counters)) return;
  const int part = w.part, kvh = w.kvh, seq = w.seq, num_heads = w.num_heads;
  const int head0 = w.head0, n_heads = w.n_heads, ctx = w.ctx, n_tok = w.n_tok;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, quad = lane & 3;
  w.template load_blocks<BLOCK>(blk_s, block_tables, block_table_stride);

  const long long blk_stride = (long long)num_kv_heads * BLOCK * HEAD;
  const long long head_off = (long long)kvh * BLOCK * HEAD;
  const int n_chunks = (n_tok + CHUNK - 1) / CHUNK;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const Raw raw_zero = Wd::zero();

  // q of head `grp` (zero past the CTA's heads), vectors quad + 4 v.
  uint4 qf[KV1];
#pragma unroll
  for (int v = 0; v < KV1; ++v)
    qf[v] = grp < n_heads ? *reinterpret_cast<const uint4*>(
                                query + seq * q_stride + (long long)(head0 + grp) * HEAD +
                                (quad + 4 * v) * 8)
                          : zero;
  __syncthreads();  // blk_s

  auto row = [&](const C* cache, int t) {
    return reinterpret_cast<const Raw*>(cache + head_off + blk_s[t / BLOCK] * blk_stride +
                                        (t % BLOCK) * HEAD);
  };
  float* logits = smem;  // [partition][NH]
  constexpr int STEP = kWarps * UNROLL;  // chunks a CTA takes per step

  // Pass 1: logits of tokens (grp, grp + 8) of each chunk for heads (2 quad, 2 quad + 1).
  // A step loads UNROLL chunks (ch0, ch0 + kWarps, ...) before multiplying any of them.
  for (int ch0 = warp; ch0 < n_chunks; ch0 += STEP) {
    Raw k0[UNROLL][KV1], k1[UNROLL][KV1];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t0 = (ch0 + u * kWarps) * CHUNK + grp, t1 = t0 + 8;
      const bool ok0 = t0 < n_tok, ok1 = t1 < n_tok;
      const Raw* r0 = ok0 ? row(key_cache, t0) : nullptr;
      const Raw* r1 = ok1 ? row(key_cache, t1) : nullptr;
#pragma unroll
      for (int v = 0; v < KV1; ++v) {
        k0[u][v] = ok0 ? __ldg(r0 + quad + 4 * v) : raw_zero;
        k1[u][v] = ok1 ? __ldg(r1 + quad + 4 * v) : raw_zero;
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t0 = (ch0 + u * kWarps) * CHUNK + grp, t1 = t0 + 8;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int v = 0; v < KV1; ++v) {
        const uint4 ka = Wd::run(k0[u][v]), kb = Wd::run(k1[u][v]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const unsigned a[4] = {word(ka, 2 * h), word(kb, 2 * h), word(ka, 2 * h + 1),
                                 word(kb, 2 * h + 1)};
          const unsigned b[2] = {word(qf[v], 2 * h), word(qf[v], 2 * h + 1)};
          Mma<T>::run(acc, a, b);
        }
      }
      if (t0 < n_tok)
        *reinterpret_cast<float2*>(logits + t0 * NH + 2 * quad) =
            make_float2(acc[0] * scale, acc[1] * scale);
      if (t1 < n_tok)
        *reinterpret_cast<float2*>(logits + t1 * NH + 2 * quad) =
            make_float2(acc[2] * scale, acc[3] * scale);
    }
  }

  // Pass 2's first step of V loads goes out now, before the softmax: the probabilities are
  // not needed to fetch V, so the memory system stays busy across the barrier and softmax.
  // Token i of a chunk's lane: 2 quad + (i & 1) + 8 (i >> 1).
  Raw vv[UNROLL][KV2][4];
  auto load_v = [&](int ch0) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int t = (ch0 + u * kWarps) * CHUNK + 2 * quad + (i & 1) + (i >> 1) * 8;
        const Raw* r = t < n_tok ? row(value_cache, t) : nullptr;
#pragma unroll
        for (int j = 0; j < KV2; ++j) vv[u][j][i] = t < n_tok ? __ldg(r + grp + 8 * j) : raw_zero;
      }
  };
  load_v(warp);

  if constexpr (WARP_SOFTMAX) {
    // Lane works on head lane % GPAD over this warp's tokens k = lane / GPAD, + 32 / GPAD, ...
    // (k-th token of the warp: chunk warp + kWarps * (k / 16), row k % 16).
    __syncwarp();
    const int h = lane % GPAD;
    const int my_tokens = ((n_chunks - warp + kWarps - 1) / kWarps) * CHUNK;
    auto token = [&](int k) { return (warp + kWarps * (k / CHUNK)) * CHUNK + k % CHUNK; };
    float m = kNegInf;
    for (int k = lane / GPAD; k < my_tokens; k += 32 / GPAD) {
      const int t = token(k);
      if (t < n_tok) m = fmaxf(m, logits[t * NH + h]);
    }
#pragma unroll
    for (int o = 16; o >= GPAD; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, o));
    float s = 0.f;
    for (int k = lane / GPAD; k < my_tokens; k += 32 / GPAD) {
      const int t = token(k);
      if (t < n_tok) {
        const float p = expf(logits[t * NH + h] - m);
        logits[t * NH + h] = p;
        s += p;
      }
    }
#pragma unroll
    for (int o = 16; o >= GPAD; o >>= 1) s += __shfl_xor_sync(kFullMask, s, o);
    if (lane < GPAD) {
      red_max[warp][lane] = m;
      red_sum[warp][lane] = s;
    }
    __syncwarp();  // the probabilities are visible to the whole warp
  } else {
    __syncthreads();
    cta_softmax<GPAD>(logits, NH, n_tok, red_max, red_sum, max_s, sum_s);
  }

  // Pass 2: out^T[d][head] over tokens (2 quad, 2 quad + 1, 2 quad + 8, 2 quad + 9) of each
  // chunk; lane (grp, quad) owns dims 8 (grp + 8 j) + e, m-tile mt taking e = 2 (mt % 4) and
  // e + 1 of vector j = mt / 4.
  float o[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  for (int ch0 = warp; ch0 < n_chunks; ch0 += STEP) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int ch = ch0 + u * kWarps;
      float p[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int t = ch * CHUNK + 2 * quad + (i & 1) + (i >> 1) * 8;
        p[i] = t < n_tok && grp < GPAD ? logits[t * NH + grp] : 0.f;
      }
      const unsigned b[2] = {Mma<T>::pack(p[0], p[1]), Mma<T>::pack(p[2], p[3])};
#pragma unroll
      for (int j = 0; j < KV2; ++j) {
        const uint4 v0 = Wd::run(vv[u][j][0]), v1 = Wd::run(vv[u][j][1]);
        const uint4 v2 = Wd::run(vv[u][j][2]), v3 = Wd::run(vv[u][j][3]);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const unsigned w0 = word(v0, w), w1 = word(v1, w);
          const unsigned w2 = word(v2, w), w3 = word(v3, w);
          const unsigned a[4] = {__byte_perm(w0, w1, 0x5410), __byte_perm(w0, w1, 0x7632),
                                 __byte_perm(w2, w3, 0x5410), __byte_perm(w2, w3, 0x7632)};
          Mma<T>::run(o[4 * j + w], a, b);
        }
      }
    }
    if (ch0 + STEP < n_chunks) load_v(ch0 + STEP);
  }
  __syncthreads();  // everyone is done with the probabilities: outs reuses their memory

  float* outs = smem;  // [kWarps][GPAD][HEAD]
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int d = 8 * (grp + 8 * (mt / 4)) + 2 * (mt % 4);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int h = 2 * quad + k;
      if (h < GPAD) {
        outs[(warp * GPAD + h) * HEAD + d] = o[mt][k];
        outs[(warp * GPAD + h) * HEAD + d + 1] = o[mt][2 + k];
      }
    }
  }
  __syncthreads();
  if constexpr (WARP_SOFTMAX) {
    // Rescale each warp's sums to the partition's max (a warp without tokens has max -FLT_MAX
    // and sum 0, so its weight is 0).
    __shared__ float wscale_s[kWarps][GPAD];
    if (tid < GPAD) {
      float m = red_max[0][tid];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) m = fmaxf(m, red_max[w][tid]);
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = expf(red_max[w][tid] - m);
        wscale_s[w][tid] = f;
        total = fmaf(red_sum[w][tid], f, total);
      }
      max_s[tid] = m;
      sum_s[tid] = total;
    }
    __syncthreads();
    finish_partition<T, HEAD, GPAD>(outs, wscale_s, max_s, sum_s, out, part_out, part_max,
                                    part_sum, merge_counters, seq, num_heads, head0, n_heads,
                                    part, ctx, partition_size, max_partitions);
  } else {
    finish_partition<T, HEAD, GPAD>(outs, nullptr, max_s, sum_s, out, part_out, part_max,
                                    part_sum, merge_counters, seq, num_heads, head0, n_heads,
                                    part, ctx, partition_size, max_partitions);
  }
}

// Merges the per-partition results of one (sequence, head): each partition's normalised
// output is weighted by its share exp(max_p - max) * sum_p of the softmax denominator.
// Dynamic shared memory: max_partitions floats.
template <typename T, int HEAD>
__global__ void __launch_bounds__(kThreads) paged_attention_reduce_kernel(
    T* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_max,
    const float* __restrict__ part_sum, const int* __restrict__ context_lens, int num_heads,
    int partition_size, int max_partitions) {
  launch_dependents();  // the o projection after it may start loading its weights
  grid_dependency_wait();  // launched with PDL: q and the cache come from the kernels before
  extern __shared__ float4 smem4[];
  float* w_s = reinterpret_cast<float*>(smem4);
  __shared__ float red[kWarps];
  __shared__ float total_s[2];

  const int head = blockIdx.x, seq = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int ctx = context_lens[seq];
  const int n = (max(ctx, 0) + partition_size - 1) / partition_size;
  const long long row = (long long)seq * num_heads + head;
  T* o = out + row * HEAD;
  if (n == 0) {
    for (int d = tid; d < HEAD; d += kThreads) o[d] = Traits<T>::from_float(0.f);
    return;
  }
  const float* pm = part_max + row * max_partitions;
  const float* ps = part_sum + row * max_partitions;

  float m = kNegInf;
  for (int p = tid; p < n; p += kThreads) m = fmaxf(m, pm[p]);
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, off));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  if (tid == 0) {
    float x = red[0];
    for (int w = 1; w < kWarps; ++w) x = fmaxf(x, red[w]);
    total_s[0] = x;
  }
  __syncthreads();
  const float gmax = total_s[0];

  float s = 0.f;
  for (int p = tid; p < n; p += kThreads) {
    const float w = ps[p] * expf(pm[p] - gmax);
    w_s[p] = w;
    s += w;
  }
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) s += __shfl_xor_sync(kFullMask, s, off);
  __syncthreads();  // everyone has read red[] for the max
  if (lane == 0) red[warp] = s;
  __syncthreads();
  if (tid == 0) {
    float x = 0.f;
    for (int w = 0; w < kWarps; ++w) x += red[w];
    total_s[1] = x;
  }
  __syncthreads();
  const float inv_total = 1.f / total_s[1];

  const float* po = part_out + row * max_partitions * HEAD;
  for (int d = tid; d < HEAD; d += kThreads) {
    float acc = 0.f;
    for (int p = 0; p < n; ++p) acc = fmaf(w_s[p], po[(long long)p * HEAD + d], acc);
    o[d] = Traits<T>::from_float(acc * inv_total);
  }
}

}  // namespace streamkv
