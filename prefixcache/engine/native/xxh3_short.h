// XXH3-64, part 1 of 3: build switches, constants, the default secret, arithmetic
// helpers, and inputs of 0 to 240 bytes. Included through xxh3.h (its header comment
// describes the whole); split so each part reads in one sitting.

#ifndef PREFIXCACHE_ENGINE_NATIVE_XXH3_SHORT_H_
#define PREFIXCACHE_ENGINE_NATIVE_XXH3_SHORT_H_

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

}  // namespace xxh3_detail
}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_XXH3_SHORT_H_
