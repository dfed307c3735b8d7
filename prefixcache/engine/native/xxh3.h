// XXH3-64, written for prefixcache from the published XXH3 algorithm description.
//
// prefixcache::xxh3_64(data, len, seed) returns the same 64-bit value as the
// reference implementation's XXH3_64bits_withSeed (and so as the Python
// package's xxhash.xxh3_64_intdigest(data, seed=seed)) for every input length
// and seed; tests/native/test_xxh3.py checks this with hypothesis.
//
// Header-only C++17; noexcept; no allocation, no global state (the default
// secret is a constant). Inputs up to 240 bytes go through short branchy code
// paths; longer inputs run the stripe/accumulate/scramble loop, on one of three
// interchangeable accumulator kernels: AVX2 when the translation unit is
// compiled with it (-mavx2, -march=native); otherwise, with GCC or Clang on
// x86, AVX2 chosen at run time when the CPU has it (one
// __builtin_cpu_supports test a call), else SSE2 (part of the x86-64
// baseline); portable scalar code elsewhere. Define PREFIXCACHE_XXH3_SCALAR to
// force the scalar kernel, PREFIXCACHE_XXH3_NO_DISPATCH to leave out the
// run-time choice. All kernels compute the same bits; xxh3_64_with<Kernel> and
// xxh3_detail::hash_long_avx2 expose each one so tests can compare them.
//
// Why AVX2 at run time: measured on an AMD EPYC (Zen 4) VM, once AVX-512 code
// had run in the process (xxHash's own dispatching XXH3), legacy-encoded SSE2
// code, ours and xxHash's alike, took 480 ns instead of 47 ns for 1,024 bytes,
// while VEX-encoded AVX2 code stayed at 38 ns (benchmarks/bench_xxh3.cpp with
// and without --lib). A Python process runs such code (numpy, torch, xxhash).
//
// Token sources (xxh3_64_source): the long-input loop reads its input 64 bytes
// at a time through a "source", so block_hashing.h can hash int64 tokens as
// their little-endian int32 bytes without copying a whole block anywhere.

#ifndef PREFIXCACHE_ENGINE_NATIVE_XXH3_H_
#define PREFIXCACHE_ENGINE_NATIVE_XXH3_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#if !defined(PREFIXCACHE_XXH3_SCALAR) && \
    (defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2))
#define PREFIXCACHE_XXH3_HAVE_SSE2 1
#include <emmintrin.h>
#endif
#if !defined(PREFIXCACHE_XXH3_SCALAR) && defined(__AVX2__)
#define PREFIXCACHE_XXH3_HAVE_AVX2 1
#include <immintrin.h>
#endif
// Without -mavx2, GCC and Clang on x86 still compile the AVX2 kernel (as
// target("avx2") functions) and pick it at run time when the CPU has AVX2.
#if !defined(PREFIXCACHE_XXH3_SCALAR) && !defined(PREFIXCACHE_XXH3_NO_DISPATCH) && \
    !defined(__AVX2__) && defined(PREFIXCACHE_XXH3_HAVE_SSE2) &&                    \
    (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define PREFIXCACHE_XXH3_HAVE_AVX2 1
#define PREFIXCACHE_XXH3_RUNTIME_AVX2 1
#define PREFIXCACHE_XXH3_AVX2_TARGET __attribute__((target("avx2")))
#include <immintrin.h>
#else
#define PREFIXCACHE_XXH3_AVX2_TARGET
#endif

#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && \
    __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define PREFIXCACHE_XXH3_BIG_ENDIAN 1
#else
#define PREFIXCACHE_XXH3_BIG_ENDIAN 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define PREFIXCACHE_XXH3_INLINE inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define PREFIXCACHE_XXH3_INLINE __forceinline
#else
#define PREFIXCACHE_XXH3_INLINE inline
#endif

namespace prefixcache {
namespace xxh3_detail {

constexpr uint64_t kPrime32_1 = 0x9E3779B1U;
constexpr uint64_t kPrime32_2 = 0x85EBCA77U;
constexpr uint64_t kPrime32_3 = 0xC2B2AE3DU;
constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ULL;
constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ULL;
constexpr uint64_t kPrimeMx1 = 0x165667919E3779F9ULL;
constexpr uint64_t kPrimeMx2 = 0x9FB21C651E98DF25ULL;

constexpr size_t kSecretSize = 192;      // the default secret's length
constexpr size_t kStripeLen = 64;        // bytes consumed by one accumulate step
constexpr size_t kSecretConsumeRate = 8; // secret advance per stripe
constexpr size_t kStripesPerBlock = (kSecretSize - kStripeLen) / kSecretConsumeRate;  // 16
constexpr size_t kBlockLen = kStripeLen * kStripesPerBlock;                           // 1024
constexpr size_t kMidSizeMax = 240;      // longest input of the 129-240 path
constexpr size_t kSecretLastAccStart = 7;
constexpr size_t kSecretMergeAccsStart = 11;
constexpr size_t kMidSizeStartOffset = 3;
constexpr size_t kMidSizeLastOffset = 17;
constexpr size_t kSecretSizeMin = 136;

// The default secret of the XXH3 specification.
alignas(64) inline constexpr uint8_t kSecret[kSecretSize] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

// ---------------------------------------------------------------------------
// Arithmetic helpers
// ---------------------------------------------------------------------------

PREFIXCACHE_XXH3_INLINE uint32_t bswap32(uint32_t x) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  return __builtin_bswap32(x);
#else
  return ((x << 24) & 0xff000000U) | ((x << 8) & 0x00ff0000U) | ((x >> 8) & 0x0000ff00U) |
         ((x >> 24) & 0x000000ffU);
#endif
}

PREFIXCACHE_XXH3_INLINE uint64_t bswap64(uint64_t x) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  return __builtin_bswap64(x);
#else
  return (static_cast<uint64_t>(bswap32(static_cast<uint32_t>(x))) << 32) |
         bswap32(static_cast<uint32_t>(x >> 32));
#endif
}

// Unaligned little-endian loads and stores; memcpy compiles to one mov.
PREFIXCACHE_XXH3_INLINE uint32_t read32(const uint8_t* p) noexcept {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return PREFIXCACHE_XXH3_BIG_ENDIAN ? bswap32(v) : v;
}

PREFIXCACHE_XXH3_INLINE uint64_t read64(const uint8_t* p) noexcept {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return PREFIXCACHE_XXH3_BIG_ENDIAN ? bswap64(v) : v;
}

PREFIXCACHE_XXH3_INLINE void write32(uint8_t* p, uint32_t v) noexcept {
  if (PREFIXCACHE_XXH3_BIG_ENDIAN) v = bswap32(v);
  std::memcpy(p, &v, sizeof v);
}

PREFIXCACHE_XXH3_INLINE void write64(uint8_t* p, uint64_t v) noexcept {
  if (PREFIXCACHE_XXH3_BIG_ENDIAN) v = bswap64(v);
  std::memcpy(p, &v, sizeof v);
}

PREFIXCACHE_XXH3_INLINE uint64_t rotl64(uint64_t x, unsigned r) noexcept {
  return (x << r) | (x >> (64 - r));  // r is always a constant in 1..63 here
}

// 64x64 -> 128-bit product folded to 64 bits (low half XOR high half), without
// a 128-bit integer type: four 32x32 products and the carries between them.
PREFIXCACHE_XXH3_INLINE uint64_t mul128_fold64_portable(uint64_t a, uint64_t b) noexcept {
  const uint64_t a_lo = a & 0xFFFFFFFFU, a_hi = a >> 32;
  const uint64_t b_lo = b & 0xFFFFFFFFU, b_hi = b >> 32;
  const uint64_t lo_lo = a_lo * b_lo;
  const uint64_t hi_lo = a_hi * b_lo;
  const uint64_t lo_hi = a_lo * b_hi;
  const uint64_t hi_hi = a_hi * b_hi;
  const uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFU) + lo_hi;
  const uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
  const uint64_t lower = (cross << 32) | (lo_lo & 0xFFFFFFFFU);
  return lower ^ upper;
}

PREFIXCACHE_XXH3_INLINE uint64_t mul128_fold64(uint64_t a, uint64_t b) noexcept {
#if defined(__SIZEOF_INT128__)
  __extension__ typedef unsigned __int128 u128;  // __extension__: quiet under -Wpedantic
  const u128 product = static_cast<u128>(a) * b;
  return static_cast<uint64_t>(product) ^ static_cast<uint64_t>(product >> 64);
#else
  return mul128_fold64_portable(a, b);
#endif
}

// The final mix of XXH64, used by the 0..3 byte paths.
PREFIXCACHE_XXH3_INLINE uint64_t xxh64_avalanche(uint64_t h) noexcept {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  h ^= h >> 32;
  return h;
}

PREFIXCACHE_XXH3_INLINE uint64_t avalanche(uint64_t h) noexcept {
  h ^= h >> 37;
  h *= kPrimeMx1;
  h ^= h >> 32;
  return h;
}

// The stronger final mix of the 4..8 byte path ("rrmxmx").
PREFIXCACHE_XXH3_INLINE uint64_t rrmxmx(uint64_t h, uint64_t len) noexcept {
  h ^= rotl64(h, 49) ^ rotl64(h, 24);
  h *= kPrimeMx2;
  h ^= (h >> 35) + len;
  h *= kPrimeMx2;
  h ^= h >> 28;
  return h;
}

PREFIXCACHE_XXH3_INLINE uint64_t mix16(const uint8_t* in, const uint8_t* secret,
                                       uint64_t seed) noexcept {
  const uint64_t lo = read64(in);
  const uint64_t hi = read64(in + 8);
  return mul128_fold64(lo ^ (read64(secret) + seed), hi ^ (read64(secret + 8) - seed));
}

// ---------------------------------------------------------------------------
// Inputs of 0 to 240 bytes (always with the default secret)
// ---------------------------------------------------------------------------

inline uint64_t hash_0to16(const uint8_t* in, size_t len, uint64_t seed) noexcept {
  const uint8_t* s = kSecret;
  if (len > 8) {
    const uint64_t flip_lo = (read64(s + 24) ^ read64(s + 32)) + seed;
    const uint64_t flip_hi = (read64(s + 40) ^ read64(s + 48)) - seed;
    const uint64_t lo = read64(in) ^ flip_lo;
    const uint64_t hi = read64(in + len - 8) ^ flip_hi;
    const uint64_t acc = len + bswap64(lo) + hi + mul128_fold64(lo, hi);
    return avalanche(acc);
  }
  if (len >= 4) {
    seed ^= static_cast<uint64_t>(bswap32(static_cast<uint32_t>(seed))) << 32;
    const uint64_t first = read32(in);
    const uint64_t last = read32(in + len - 4);
    const uint64_t flip = (read64(s + 8) ^ read64(s + 16)) - seed;
    const uint64_t keyed = (last + (first << 32)) ^ flip;
    return rrmxmx(keyed, len);
  }
  if (len > 0) {
    const uint32_t c1 = in[0], c2 = in[len >> 1], c3 = in[len - 1];
    const uint32_t combined =
        (c1 << 16) | (c2 << 24) | c3 | (static_cast<uint32_t>(len) << 8);
    const uint64_t flip = static_cast<uint64_t>(read32(s) ^ read32(s + 4)) + seed;
    return xxh64_avalanche(static_cast<uint64_t>(combined) ^ flip);
  }
  return xxh64_avalanche(seed ^ read64(s + 56) ^ read64(s + 64));
}

inline uint64_t hash_17to128(const uint8_t* in, size_t len, uint64_t seed) noexcept {
  const uint8_t* s = kSecret;
  uint64_t acc = len * kPrime64_1;
  if (len > 32) {
    if (len > 64) {
      if (len > 96) {
        acc += mix16(in + 48, s + 96, seed);
        acc += mix16(in + len - 64, s + 112, seed);
      }
      acc += mix16(in + 32, s + 64, seed);
      acc += mix16(in + len - 48, s + 80, seed);
    }
    acc += mix16(in + 16, s + 32, seed);
    acc += mix16(in + len - 32, s + 48, seed);
  }
  acc += mix16(in, s, seed);
  acc += mix16(in + len - 16, s + 16, seed);
  return avalanche(acc);
}

inline uint64_t hash_129to240(const uint8_t* in, size_t len, uint64_t seed) noexcept {
  const uint8_t* s = kSecret;
  const size_t rounds = len / 16;
  uint64_t acc = len * kPrime64_1;
  for (size_t i = 0; i < 8; ++i) acc += mix16(in + 16 * i, s + 16 * i, seed);
  acc = avalanche(acc);
  for (size_t i = 8; i < rounds; ++i) {
    acc += mix16(in + 16 * i, s + 16 * (i - 8) + kMidSizeStartOffset, seed);
  }
  acc += mix16(in + len - 16, s + kSecretSizeMin - kMidSizeLastOffset, seed);
  return avalanche(acc);
}

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

// ---------------------------------------------------------------------------
// Sources: where the long-input loop reads its stripes from
// ---------------------------------------------------------------------------

// Plain bytes: a stripe is a pointer into the input, nothing is copied.
struct ByteSource {
  const uint8_t* data;
  PREFIXCACHE_XXH3_INLINE const uint8_t* stripe(size_t offset, uint8_t* /*scratch*/) const noexcept {
    return data + offset;
  }
  PREFIXCACHE_XXH3_INLINE void copy(size_t len, uint8_t* out) const noexcept {
    std::memcpy(out, data, len);
  }
};

// ---------------------------------------------------------------------------
// Inputs over 240 bytes
// ---------------------------------------------------------------------------

// The seed's custom secret: the default secret with the seed added to the
// first and subtracted from the second 8 bytes of every 16.
PREFIXCACHE_XXH3_INLINE void derive_secret(uint64_t seed, uint8_t out[kSecretSize]) noexcept {
  for (size_t i = 0; i < kSecretSize / 16; ++i) {
    write64(out + 16 * i, read64(kSecret + 16 * i) + seed);
    write64(out + 16 * i + 8, read64(kSecret + 16 * i + 8) - seed);
  }
}

// The eight lanes folded into the 64-bit result.
PREFIXCACHE_XXH3_INLINE uint64_t merge_lanes(const uint64_t lane[8], const uint8_t* secret,
                                             size_t len) noexcept {
  const uint8_t* merge = secret + kSecretMergeAccsStart;
  uint64_t result = len * kPrime64_1;
  for (size_t i = 0; i < 4; ++i) {
    result += mul128_fold64(lane[2 * i] ^ read64(merge + 16 * i),
                            lane[2 * i + 1] ^ read64(merge + 16 * i + 8));
  }
  return avalanche(result);
}

template <class Kernel, class Source>
inline uint64_t hash_long(const Source& src, size_t len, uint64_t seed) noexcept {
  alignas(64) uint8_t custom[kSecretSize];
  const uint8_t* secret = kSecret;
  if (seed != 0) {
    derive_secret(seed, custom);
    secret = custom;
  }
  alignas(64) uint8_t scratch[kStripeLen];
  Kernel acc;
  acc.init();
  const size_t num_blocks = (len - 1) / kBlockLen;
  for (size_t b = 0; b < num_blocks; ++b) {
    for (size_t s = 0; s < kStripesPerBlock; ++s) {
      acc.accumulate(src.stripe(b * kBlockLen + s * kStripeLen, scratch),
                     secret + s * kSecretConsumeRate);
    }
    acc.scramble(secret + kSecretSize - kStripeLen);
  }
  // The last, partial block: its whole stripes, then the input's last 64
  // bytes (which may overlap the stripe before) with a shifted secret.
  const size_t tail = num_blocks * kBlockLen;
  const size_t num_stripes = ((len - 1) - tail) / kStripeLen;
  for (size_t s = 0; s < num_stripes; ++s) {
    acc.accumulate(src.stripe(tail + s * kStripeLen, scratch), secret + s * kSecretConsumeRate);
  }
  acc.accumulate(src.stripe(len - kStripeLen, scratch),
                 secret + kSecretSize - kStripeLen - kSecretLastAccStart);

  uint64_t lane[8];
  acc.store(lane);
  return merge_lanes(lane, secret, len);
}

#if PREFIXCACHE_XXH3_RUNTIME_AVX2
// hash_long<Avx2Kernel> over bytes, as an AVX2-target function: GCC inlines
// AVX2 intrinsics only into functions of that target, so the loop of
// hash_long is written out again here (keep the two in step; the tests
// compare every kernel with xxhash).
__attribute__((noinline)) PREFIXCACHE_XXH3_AVX2_TARGET inline uint64_t hash_long_avx2(
    const uint8_t* in, size_t len, uint64_t seed) noexcept {
  alignas(64) uint8_t custom[kSecretSize];
  const uint8_t* secret = kSecret;
  if (seed != 0) {
    derive_secret(seed, custom);
    secret = custom;
  }
  Avx2Kernel acc;
  acc.init();
  const size_t num_blocks = (len - 1) / kBlockLen;
  for (size_t b = 0; b < num_blocks; ++b) {
    for (size_t s = 0; s < kStripesPerBlock; ++s) {
      acc.accumulate(in + b * kBlockLen + s * kStripeLen, secret + s * kSecretConsumeRate);
    }
    acc.scramble(secret + kSecretSize - kStripeLen);
  }
  const size_t tail = num_blocks * kBlockLen;
  const size_t num_stripes = ((len - 1) - tail) / kStripeLen;
  for (size_t s = 0; s < num_stripes; ++s) {
    acc.accumulate(in + tail + s * kStripeLen, secret + s * kSecretConsumeRate);
  }
  acc.accumulate(in + len - kStripeLen, secret + kSecretSize - kStripeLen - kSecretLastAccStart);
  uint64_t lane[8];
  acc.store(lane);
  return merge_lanes(lane, secret, len);
}

// Whether this CPU runs AVX2 (libgcc/compiler-rt read CPUID once, at load).
PREFIXCACHE_XXH3_INLINE bool cpu_has_avx2() noexcept { return __builtin_cpu_supports("avx2"); }
#elif PREFIXCACHE_XXH3_HAVE_AVX2 && !PREFIXCACHE_XXH3_BIG_ENDIAN
inline uint64_t hash_long_avx2(const uint8_t* in, size_t len, uint64_t seed) noexcept {
  return hash_long<Avx2Kernel>(ByteSource{in}, len, seed);
}
PREFIXCACHE_XXH3_INLINE bool cpu_has_avx2() noexcept { return true; }  // compiled for it
#endif

// Inputs over 240 bytes with the best kernel this build and CPU can run.
PREFIXCACHE_XXH3_INLINE uint64_t hash_long_bytes(const uint8_t* in, size_t len,
                                                 uint64_t seed) noexcept {
#if PREFIXCACHE_XXH3_RUNTIME_AVX2
  if (cpu_has_avx2()) return hash_long_avx2(in, len, seed);
#endif
  return hash_long<DefaultKernel>(ByteSource{in}, len, seed);
}

PREFIXCACHE_XXH3_INLINE uint64_t hash_short(const uint8_t* in, size_t len, uint64_t seed) noexcept {
  if (len <= 16) return hash_0to16(in, len, seed);
  if (len <= 128) return hash_17to128(in, len, seed);
  return hash_129to240(in, len, seed);
}

}  // namespace xxh3_detail

/// XXH3-64 of ``len`` bytes at ``data`` with one accumulator kernel
/// (xxh3_detail::ScalarKernel, Sse2Kernel, or Avx2Kernel in a -mavx2 build;
/// a run-time-dispatch build reaches AVX2 through xxh3_detail::hash_long_avx2).
/// Every kernel returns the same value; tests compare them.
template <class Kernel>
inline uint64_t xxh3_64_with(const void* data, size_t len, uint64_t seed = 0) noexcept {
  const auto* in = static_cast<const uint8_t*>(data);
  if (len <= xxh3_detail::kMidSizeMax) return xxh3_detail::hash_short(in, len, seed);
  return xxh3_detail::hash_long<Kernel>(xxh3_detail::ByteSource{in}, len, seed);
}

/// XXH3-64 (the 64-bit XXH3 of xxHash 0.8) of ``len`` bytes at ``data``.
///
/// Equals the reference XXH3_64bits_withSeed(data, len, seed) and Python's
/// xxhash.xxh3_64_intdigest(data, seed=seed). ``data`` may be unaligned, and
/// may be null when ``len`` is 0. Thread-safe, allocation-free.
///
/// Complexity: O(len).
inline uint64_t xxh3_64(const void* data, size_t len, uint64_t seed = 0) noexcept {
  const auto* in = static_cast<const uint8_t*>(data);
  if (len <= xxh3_detail::kMidSizeMax) return xxh3_detail::hash_short(in, len, seed);
  return xxh3_detail::hash_long_bytes(in, len, seed);
}

/// XXH3-64 of ``len`` bytes read through a stripe source (see ByteSource):
/// ``src.copy(len, buf)`` for inputs up to 240 bytes, ``src.stripe(offset,
/// scratch)`` (64 bytes at ``offset``, either in place or written to the
/// 64-byte ``scratch``) for longer ones.
///
/// Complexity: O(len).
template <class Source, class Kernel = xxh3_detail::DefaultKernel>
inline uint64_t xxh3_64_source(const Source& src, size_t len, uint64_t seed = 0) noexcept {
  if (len <= xxh3_detail::kMidSizeMax) {
    uint8_t buf[xxh3_detail::kMidSizeMax];
    std::memset(buf, 0, 4);  // never read unwritten, but GCC's -Wmaybe-uninitialized cannot tell
    src.copy(len, buf);
    return xxh3_detail::hash_short(buf, len, seed);
  }
  return xxh3_detail::hash_long<Kernel>(src, len, seed);
}

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_XXH3_H_
