// Paged varlen prefill attention: every prompt span of a step in one launch.
//
// A span is the last q_len tokens of a sequence whose context (cached prefix + the span,
// already written by reshape-and-cache) lives in the block pool
// [num_blocks, kv_heads, block_size, HEAD] (streamkv/kernels/ops.py). Query row t of a span
// sits at position prefix + t and attends causally to context tokens 0 .. prefix + t, all
// read through the span's block table: fresh prompts, prompt chunks, prefix-cache hits and
// recompute are the same case. docs/kernels.md ("Prefill") has the design and measurements.
//
// FlashAttention-2 structure on mma.sync m16n8k16 (fp16 / bf16 in, fp32 accumulators):
// a CTA owns BM query rows; each of its WARPS warps owns MT m16 tiles (16 rows each) and
// keeps their output in registers across the whole context, which streams through shared
// memory in tiles of BN keys with an online softmax. Rows are (token, head) pairs: the G
// query heads that share a KV head sit side by side in one tile (row r = token r / G, head
// r % G), so short spans (decode-sized chunks) still fill the M dimension, and each K/V
// tile a CTA loads serves all G heads. K/V rows are fetched one token row at a time through
// the block table, so every power-of-two block size takes the same path.
//
// Grid: x = query tile (over all spans, see tile_of), y = group of G query heads.
//
// The cache's element type C follows the other template arguments, defaulting to T. With
// C = __nv_fp8_e4m3 (the fp8 cache) each thread copies its 8-byte chunks of a K/V tile into a
// staging area with cp.async, then, once they landed, widens them to T into the same padded
// tile the 16-bit path fills directly; everything after that is unchanged. The launcher
// folds the K scale into scale_log2 and multiplies the output by the V scale.
#include "dtypes.cuh"

namespace streamkv {
namespace prefill {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kPad = 8;  // elements of padding per shared row: ldmatrix rows hit distinct banks

template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                             unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
  }
};

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                             unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
  }
};

__device__ __forceinline__ float kNegInf() { return __int_as_float(0xff800000u); }  // -inf

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  // src-size 0 writes 16 zero bytes and reads nothing: rows past the context cost no
  // traffic and hold zeros, so a masked (zero) probability never meets a NaN.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async8(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(valid ? 8 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Which span and which of its query tiles CTA x (counted from the end) works on. Span i's
// tiles take slots cu[i] / TM + i ..: strictly increasing with i and never fewer slots than
// the span has tiles, so a binary search over cu finds the span without a host-built map.
// Slots past a span's last tile idle. The grid runs from the end, so each span's longest
// (last) tiles start first.
__device__ __forceinline__ int span_of(const int* cu, int num_spans, int tm, int x) {
  int lo = 0, hi = num_spans - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(cu + mid) / tm + mid <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The 16-byte chunks of a tile of ROWS rows of CPR chunks that thread `tid` copies: N of
// them, chunk i in row row(tid, i). When a row's chunks divide the CTA, a thread keeps one
// chunk column (rows tid / CPR, + THREADS / CPR, ...), so its address math stays in few
// registers; otherwise chunks are dealt out in order.
template <int ROWS, int CPR, int THREADS>
struct ChunkMap {
  static constexpr bool kColumn = THREADS % CPR == 0;
  static constexpr int kStep = kColumn ? THREADS / CPR : 1;
  static constexpr int N =
      kColumn ? (ROWS + kStep - 1) / kStep : (ROWS * CPR + THREADS - 1) / THREADS;
  static __device__ __forceinline__ int row(int tid, int i) {
    return kColumn ? tid / CPR + i * kStep : (tid + i * THREADS) / CPR;
  }
  static __device__ __forceinline__ int col(int tid, int i) {
    return kColumn ? tid % CPR : (tid + i * THREADS) % CPR;
  }
  static __device__ __forceinline__ bool used(int tid, int i) {
    if constexpr (kColumn)
      return ROWS % kStep == 0 || row(tid, i) < ROWS;
    else
      return (ROWS * CPR) % THREADS == 0 || tid + i * THREADS < ROWS * CPR;
  }
};

// Calls copy(row, chunk) for every 16-byte chunk of ROWS rows of CPR chunks, spread over the
// CTA. When a row's chunks divide the CTA, a thread keeps one chunk column (rows row0,
// row0 + THREADS / CPR, ...), so its address math stays in few registers.
template <int ROWS, int CPR, int THREADS, typename F>
__device__ __forceinline__ void for_chunks(int tid, F&& copy) {
  if constexpr (THREADS % CPR == 0) {
    constexpr int RPP = THREADS / CPR;
    const int row0 = tid / CPR, col = tid % CPR;
#pragma unroll
    for (int i = 0; i < (ROWS + RPP - 1) / RPP; ++i)
      if (ROWS % RPP == 0 || row0 + i * RPP < ROWS) copy(row0 + i * RPP, col);
  } else {
    for (int c = tid; c < ROWS * CPR; c += THREADS) copy(c / CPR, c % CPR);
  }
}

// Dynamic shared memory: (BM + 2 * BN) rows of HEAD + kPad elements (Q, one K tile, one V
// tile), then 2 * BN row offsets of 8 bytes, then for an fp8 cache the staging area (8 bytes
// per chunk of a tile); computed by streamkv/kernels/prefill.py.
template <typename T, int HEAD, int G, int WARPS, int MT, int BN, typename C = T>
__global__ void __launch_bounds__(WARPS * 32, WARPS == 4 ? 2 : 1) paged_prefill_kernel(
    T* __restrict__ out, long long out_stride,  // [tokens, heads, HEAD], token stride
    const T* __restrict__ query, long long q_stride,  // [tokens, heads, HEAD]
    const C* __restrict__ key_cache, const C* __restrict__ value_cache,
    const int* __restrict__ block_tables, int block_table_stride,  // [spans, max_blocks]
    const int* __restrict__ cu_query_lens,  // [spans + 1]: span i's rows cu[i] .. cu[i+1]
    const int* __restrict__ context_lens,   // [spans]: tokens in the cache, span included
    int num_spans, float scale_log2, int num_kv_heads, int group_size, int block_shift) {
  static_assert(Traits<T>::VEC == 8, "prefill attention is for 16-bit queries");
  constexpr bool kFp8 = sizeof(C) == 1;  // C is __nv_fp8_e4m3
  static_assert(HEAD % 16 == 0, "head size must be a multiple of 16");
  static_assert(BN % 16 == 0, "key tile must be a multiple of 16");
  static_assert(BN <= WARPS * 32, "a thread publishes each key row's offset");
  constexpr int THREADS = WARPS * 32;
  constexpr int BM = WARPS * MT * 16;  // query rows (token, head pairs) per CTA
  constexpr int TM = BM / G;           // tokens per CTA
  constexpr int LD = HEAD + kPad;      // shared row stride (elements)
  constexpr int CPR = HEAD / 8;        // 16-byte chunks per row
  constexpr int NT = BN / 8;           // n8 tiles of logits per m16 tile
  constexpr int DT = HEAD / 8;         // n8 tiles of output per m16 tile
  static_assert(BM % G == 0, "heads per tile must divide the tile's rows");
  using M = Mma<T>;

  extern __shared__ float4 smem4[];
  T* sQ = reinterpret_cast<T*>(smem4);
  T* sK = sQ + BM * LD;
  T* sV = sK + BN * LD;
  long long* sOff = reinterpret_cast<long long*>(sV + BN * LD);  // [2][BN], see publish

  // The G-head groups of one query tile are neighbours in launch order, and tiles run from
  // the last slot down: all heads of a span's longest tiles start first, so the short tiles
  // of the first span are what is left at the end (no long CTA starts late and tails).
  const int head_groups = num_kv_heads * group_size / G;
  const int x = gridDim.x / head_groups - 1 - blockIdx.x / head_groups;
  const int span = span_of(cu_query_lens, num_spans, TM, x);
  const int q_start = __ldg(cu_query_lens + span);
  const int q_len = __ldg(cu_query_lens + span + 1) - q_start;
  const int t0 = (x - (q_start / TM + span)) * TM;
  if (t0 >= q_len) return;
  const int ctx = __ldg(context_lens + span);
  const int prefix = ctx - q_len;
  const int n_kv = min(ctx, prefix + t0 + TM);  // keys any row of this tile can see
  const int head0 = blockIdx.x % head_groups * G;
  const int kvh = head0 / group_size;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, quad = lane & 3;
  const int bmask = (1 << block_shift) - 1;
  const int* bt = block_tables + (long long)span * block_table_stride;

  // Q rows of this tile; rows past the span are zero.
  for_chunks<BM, CPR, THREADS>(tid, [&](int r, int col) {
    const int t = t0 + r / G;
    const bool ok = t < q_len;
    const T* src = query + (long long)(q_start + (ok ? t : 0)) * q_stride +
                   (long long)(head0 + r % G) * HEAD + col * 8;
    cp_async16(sQ + r * LD + col * 8, src, ok);
  });
  // K/V rows are found through the block table once per tile, not once per copied chunk:
  // thread r < BN turns key tile * BN + r into its row's byte offset in a cache (the same
  // for K and V) and publishes it in sOff, double-buffered by tile parity; every copy then
  // costs one shared load and an add. Each thread's table read is issued a tile ahead, so
  // its latency hides behind a whole iteration. Keys past the context get offset 0 (a
  // valid address) and copy nothing.
  const long long blk_bytes = (long long)num_kv_heads * HEAD * sizeof(C) << block_shift;
  const long long head_bytes = (long long)kvh * HEAD * sizeof(C) << block_shift;
  auto fetch_id = [&](int tile) {
    const int k = tile * BN + tid;
    return tid < BN && tile >= 0 ? __ldg(bt + ((k < n_kv ? k : 0) >> block_shift)) : 0;
  };
  auto publish = [&](int tile, int id) {
    const int k = tile * BN + tid;
    if (tid < BN)
      sOff[(tile & 1) * BN + tid] =
          k < n_kv ? id * blk_bytes + head_bytes + (k & bmask) * (HEAD * (int)sizeof(C)) : 0;
  };
  using KV = ChunkMap<BN, CPR, THREADS>;
  // fp8: chunk i of this thread is staged at stage[i * THREADS + tid] (8 bytes), which only
  // this thread writes and reads, so staging needs no barrier of its own; K and V share it
  // (a tile is widened before the next one is copied in).
  uint2* stage = reinterpret_cast<uint2*>(sOff + 2 * BN);
  auto load_kv = [&](T* dst, const C* cache, int tile) {
    const char* base = reinterpret_cast<const char*>(cache);
    const long long* off = sOff + (tile & 1) * BN;
#pragma unroll
    for (int i = 0; i < KV::N; ++i) {
      if (!KV::used(tid, i)) continue;
      const int r = KV::row(tid, i), col = KV::col(tid, i);
      if constexpr (kFp8)
        cp_async8(stage + i * THREADS + tid, base + off[r] + col * 8, tile * BN + r < n_kv);
      else
        cp_async16(dst + r * LD + col * 8, base + off[r] + col * 16, tile * BN + r < n_kv);
    }
  };
  // fp8: this thread's staged chunks of the tile that just landed, widened into dst (the
  // barrier after it publishes them to the CTA). A no-op for a 16-bit cache.
  auto widen_kv = [&](T* dst) {
    if constexpr (kFp8) {
#pragma unroll
      for (int i = 0; i < KV::N; ++i) {
        if (!KV::used(tid, i)) continue;
        const int r = KV::row(tid, i), col = KV::col(tid, i);
        *reinterpret_cast<uint4*>(dst + r * LD + col * 8) =
            Widen8<T, C>::run(stage[i * THREADS + tid]);
      }
    }
  };

  const int n_tiles = (n_kv + BN - 1) / BN;
  publish(n_tiles - 1, fetch_id(n_tiles - 1));
  int next_id = fetch_id(n_tiles - 2);
  __syncthreads();  // sOff of the first tile
  load_kv(sK, key_cache, n_tiles - 1);
  cp_async_commit();

  const int row_base = warp * MT * 16;
  const int min_pos = prefix + t0;

  float o[MT][DT][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int d = 0; d < DT; ++d) o[i][d][0] = o[i][d][1] = o[i][d][2] = o[i][d][3] = 0.f;
    m[i][0] = m[i][1] = kNegInf();
    l[i][0] = l[i][1] = 0.f;
  }

  // Key tiles from the last (the ones the causal mask cuts) to the first. One buffer each
  // for K and V: V(j) streams in during Q K(j)^T, K(j-1) during the softmax and P V(j).
  // (Two (K, V) buffers with one barrier per tile measured 2-9% slower: docs/kernels.md.)
  for (int j = n_tiles - 1; j >= 0; --j) {
    if (j > 0) {
      publish(j - 1, next_id);  // its buffer's last reader was V(j+1), before the last barrier
      next_id = fetch_id(j - 2);
    }
    cp_async_wait_all();
    widen_kv(sK);
    __syncthreads();  // K(j) (and Q) landed, sOff(j-1) is out; every warp is done with V(j+1)
    load_kv(sV, value_cache, j);
    cp_async_commit();

    float s[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int n = 0; n < NT; ++n) s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HEAD / 16; ++kk) {
      unsigned a[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i)
        ldmatrix_x4(a[i], sQ + (row_base + i * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        unsigned b[4];
        ldmatrix_x4(b, sK + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 +
                           ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          M::run(s[i][2 * np], a[i], b[0], b[1]);
          M::run(s[i][2 * np + 1], a[i], b[2], b[3]);
        }
      }
    }

    if (j * BN + BN - 1 > min_pos) {  // some key of the tile lies past some row's position
      // Rows past the span take the span's last position: finite, and never stored.
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int pos = prefix + min(t0 + (row_base + i * 16 + grp + 8 * h) / G, q_len - 1);
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (j * BN + n * 8 + 2 * quad + e > pos) s[i][n][2 * h + e] = kNegInf();
        }
    }

    cp_async_wait_all();
    widen_kv(sV);
    __syncthreads();  // V(j) landed; every warp is done with K(j)
    if (j > 0) {
      load_kv(sK, key_cache, j - 1);
      cp_async_commit();
    }

    // Online softmax in base 2 (scale_log2 = scale * log2 e). A row whose keys so far are
    // all masked keeps max -inf; it subtracts 0 instead, so exp2(-inf) = 0, never NaN. The
    // probabilities are packed to 16 bits at once (the A operand of P V), so the fp32 logits
    // die here and P V runs with fewer live registers.
    unsigned p[MT][BN / 16][4];
    // Lazy rescale: the max a row subtracts moves only when a tile's max passes it by more
    // than kLazy (log2 units). Below that, probabilities stay under 2^kLazy (far inside the
    // range of fp32 sums and of 16-bit P, whose relative precision does not depend on scale)
    // and the output keeps its scale, so the warp skips its 2 * DT multiplies per row half
    // unless one of its rows moved: after the first tiles, almost always (docs/kernels.md).
    constexpr float kLazy = 8.f;
    float alpha[MT][2];
    bool moved = false;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = kNegInf();
#pragma unroll
        for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[i][n][2 * h], s[i][n][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
        const float m_tile = mx * scale_log2;
        const bool move = m_tile > m[i][h] + kLazy;  // false while both are -inf
        const float m_new = move ? m_tile : m[i][h];
        moved |= move;
        const float m_use = m_new == kNegInf() ? 0.f : m_new;
        alpha[i][h] = move ? fast_exp2(m[i][h] - m_use) : 1.f;
        m[i][h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const float p0 = fast_exp2(fmaf(s[i][n][2 * h], scale_log2, -m_use));
          const float p1 = fast_exp2(fmaf(s[i][n][2 * h + 1], scale_log2, -m_use));
          sum += p0 + p1;
          // n8 tile n is half (n & 1) of k16 step n / 2; row half h is register h.
          p[i][n >> 1][(n & 1) * 2 + h] = M::pack(p0, p1);
        }
        l[i][h] = fmaf(l[i][h], alpha[i][h], sum);
      }
    if (__any_sync(kFullMask, moved)) {
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int d = 0; d < DT; ++d) {
          o[i][d][0] *= alpha[i][0];
          o[i][d][1] *= alpha[i][0];
          o[i][d][2] *= alpha[i][1];
          o[i][d][3] *= alpha[i][1];
        }
    }

    // O += P V(j).
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        unsigned b[4];
        ldmatrix_x4_trans(b, sV + (kk * 16 + (lane & 7) + (lane & 8)) * LD + dp * 16 +
                                 (lane >> 4) * 8);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          M::run(o[i][2 * dp], p[i][kk], b[0], b[1]);
          M::run(o[i][2 * dp + 1], p[i][kk], b[2], b[3]);
        }
      }
    }
  }

  // Normalise, stage the warp's rows in its own slice of sQ (no other warp reads it), then
  // store whole 16-byte chunks of each (token, head) row.
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = l[i][h];
      sum += __shfl_xor_sync(kFullMask, sum, 1);
      sum += __shfl_xor_sync(kFullMask, sum, 2);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int r = row_base + i * 16 + grp + 8 * h;
#pragma unroll
      for (int d = 0; d < DT; ++d)
        *reinterpret_cast<unsigned*>(sQ + r * LD + d * 8 + 2 * quad) =
            M::pack(o[i][d][2 * h] * inv, o[i][d][2 * h + 1] * inv);
    }
  __syncwarp();
  for (int c = lane; c < MT * 16 * CPR; c += 32) {
    const int r = row_base + c / CPR, col = c % CPR;
    const int t = t0 + r / G;
    if (t < q_len)
      *reinterpret_cast<uint4*>(out + (long long)(q_start + t) * out_stride +
                                (long long)(head0 + r % G) * HEAD + col * 8) =
          *reinterpret_cast<const uint4*>(sQ + r * LD + col * 8);
  }
}

}  // namespace prefill
}  // namespace streamkv
