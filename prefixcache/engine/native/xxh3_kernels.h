// XXH3-64, part 2 of 3: the accumulator kernels for inputs over 240 bytes (scalar,
// SSE2, AVX2), which compute the same bits. Included through xxh3.h.

#ifndef PREFIXCACHE_ENGINE_NATIVE_XXH3_KERNELS_H_
#define PREFIXCACHE_ENGINE_NATIVE_XXH3_KERNELS_H_

#include "xxh3_short.h"

namespace prefixcache {
namespace xxh3_detail {

// ---------------------------------------------------------------------------
// Accumulator kernels for inputs over 240 bytes. Each holds the eight 64-bit
// lanes and offers init / accumulate (one 64-byte stripe) / scramble / store.
// ---------------------------------------------------------------------------

constexpr uint64_t kInitAcc[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                                  kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};

struct ScalarKernel {
  uint64_t lane[8];

  PREFIXCACHE_XXH3_INLINE void init() noexcept {
    for (size_t i = 0; i < 8; ++i) lane[i] = kInitAcc[i];
  }
  PREFIXCACHE_XXH3_INLINE void accumulate(const uint8_t* in, const uint8_t* secret) noexcept {
    for (size_t i = 0; i < 8; ++i) {
      const uint64_t data = read64(in + 8 * i);
      const uint64_t key = data ^ read64(secret + 8 * i);
      lane[i ^ 1] += data;  // the input also lands, unmixed, in the neighbouring lane
      lane[i] += (key & 0xFFFFFFFFU) * (key >> 32);
    }
  }
  PREFIXCACHE_XXH3_INLINE void scramble(const uint8_t* secret) noexcept {
    for (size_t i = 0; i < 8; ++i) {
      uint64_t a = lane[i];
      a ^= a >> 47;
      a ^= read64(secret + 8 * i);
      lane[i] = a * kPrime32_1;
    }
  }
  PREFIXCACHE_XXH3_INLINE void store(uint64_t out[8]) const noexcept {
    for (size_t i = 0; i < 8; ++i) out[i] = lane[i];
  }
};

#if PREFIXCACHE_XXH3_HAVE_SSE2 && !PREFIXCACHE_XXH3_BIG_ENDIAN
struct Sse2Kernel {
  __m128i lane[4];

  PREFIXCACHE_XXH3_INLINE void init() noexcept {
    for (int i = 0; i < 4; ++i) {
      lane[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kInitAcc + 2 * i));
    }
  }
  PREFIXCACHE_XXH3_INLINE void accumulate(const uint8_t* in, const uint8_t* secret) noexcept {
    for (int i = 0; i < 4; ++i) {
      const __m128i data = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 16 * i));
      const __m128i key = _mm_xor_si128(
          data, _mm_loadu_si128(reinterpret_cast<const __m128i*>(secret + 16 * i)));
      // Low 32 bits of each 64-bit lane times its high 32 bits.
      const __m128i key_hi = _mm_shuffle_epi32(key, _MM_SHUFFLE(0, 3, 0, 1));
      const __m128i product = _mm_mul_epu32(key, key_hi);
      // The two 64-bit halves swapped: lane i receives lane i ^ 1's input.
      const __m128i swapped = _mm_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
      lane[i] = _mm_add_epi64(lane[i], _mm_add_epi64(product, swapped));
    }
  }
  PREFIXCACHE_XXH3_INLINE void scramble(const uint8_t* secret) noexcept {
    const __m128i prime = _mm_set1_epi32(static_cast<int>(kPrime32_1));
    for (int i = 0; i < 4; ++i) {
      __m128i a = lane[i];
      a = _mm_xor_si128(a, _mm_srli_epi64(a, 47));
      a = _mm_xor_si128(a, _mm_loadu_si128(reinterpret_cast<const __m128i*>(secret + 16 * i)));
      // 64-bit x 32-bit multiply from two 32x32 products: lo*p + (hi*p << 32).
      const __m128i hi = _mm_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1));
      const __m128i prod_lo = _mm_mul_epu32(a, prime);
      const __m128i prod_hi = _mm_mul_epu32(hi, prime);
      lane[i] = _mm_add_epi64(prod_lo, _mm_slli_epi64(prod_hi, 32));
    }
  }
  PREFIXCACHE_XXH3_INLINE void store(uint64_t out[8]) const noexcept {
    for (int i = 0; i < 4; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), lane[i]);
  }
};
#endif

#if PREFIXCACHE_XXH3_HAVE_AVX2 && !PREFIXCACHE_XXH3_BIG_ENDIAN
struct Avx2Kernel {
  __m256i lane[2];

  PREFIXCACHE_XXH3_INLINE PREFIXCACHE_XXH3_AVX2_TARGET void init() noexcept {
    for (int i = 0; i < 2; ++i) {
      lane[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kInitAcc + 4 * i));
    }
  }
  PREFIXCACHE_XXH3_INLINE PREFIXCACHE_XXH3_AVX2_TARGET void accumulate(const uint8_t* in, const uint8_t* secret) noexcept {
    for (int i = 0; i < 2; ++i) {
      const __m256i data = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 32 * i));
      const __m256i key = _mm256_xor_si256(
          data, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret + 32 * i)));
      const __m256i key_hi = _mm256_shuffle_epi32(key, _MM_SHUFFLE(0, 3, 0, 1));
      const __m256i product = _mm256_mul_epu32(key, key_hi);
      const __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
      lane[i] = _mm256_add_epi64(lane[i], _mm256_add_epi64(product, swapped));
    }
  }
  PREFIXCACHE_XXH3_INLINE PREFIXCACHE_XXH3_AVX2_TARGET void scramble(const uint8_t* secret) noexcept {
    const __m256i prime = _mm256_set1_epi32(static_cast<int>(kPrime32_1));
    for (int i = 0; i < 2; ++i) {
      __m256i a = lane[i];
      a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
      a = _mm256_xor_si256(
          a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret + 32 * i)));
      const __m256i hi = _mm256_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1));
      const __m256i prod_lo = _mm256_mul_epu32(a, prime);
      const __m256i prod_hi = _mm256_mul_epu32(hi, prime);
      lane[i] = _mm256_add_epi64(prod_lo, _mm256_slli_epi64(prod_hi, 32));
    }
  }
  PREFIXCACHE_XXH3_INLINE PREFIXCACHE_XXH3_AVX2_TARGET void store(uint64_t out[8]) const noexcept {
    for (int i = 0; i < 2; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 4 * i), lane[i]);
    }
  }
};
#endif

#if PREFIXCACHE_XXH3_HAVE_AVX2 && !PREFIXCACHE_XXH3_RUNTIME_AVX2 && !PREFIXCACHE_XXH3_BIG_ENDIAN
using DefaultKernel = Avx2Kernel;
#elif PREFIXCACHE_XXH3_HAVE_SSE2 && !PREFIXCACHE_XXH3_BIG_ENDIAN
using DefaultKernel = Sse2Kernel;
#else
using DefaultKernel = ScalarKernel;
#endif

}  // namespace xxh3_detail
}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_XXH3_KERNELS_H_
