// Structured outputs' token masks (streamkv/layers/token_mask.py): every token outside a row's
// bitmask gets -inf, for all masked rows of a step in one launch. The mask is little-endian
// int32 words, bit t % 32 of word t / 32 set: token t allowed; a token past the words is banned.
#include <cuda_runtime.h>

namespace streamkv {

// grid (ceil(vocab / (blockDim.x * TOKENS)), masked rows); words [rows, num_words] row r for
// logits row rows[r] (rows == nullptr: row r).
template <typename T>
__global__ void ban_outside_mask_kernel(T* __restrict__ logits, const int* __restrict__ words,
                                        const int* __restrict__ rows, long long row_stride,
                                        int num_words, int vocab) {
  const int r = blockIdx.y;
  T* out = logits + (rows != nullptr ? (long long)rows[r] : (long long)r) * row_stride;
  const int* w = words + (long long)r * num_words;
  const T banned = -__int_as_float(0x7f800000);  // -inf (NVRTC has no math.h)
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < vocab; t += gridDim.x * blockDim.x) {
    const int k = t >> 5;
    const unsigned bits = k < num_words ? (unsigned)__ldg(w + k) : 0u;
    if (!((bits >> (t & 31)) & 1u)) out[t] = banned;
  }
}

}  // namespace streamkv
