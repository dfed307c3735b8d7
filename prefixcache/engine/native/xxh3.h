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

// The parts: xxh3_short.h (switches, constants, helpers, inputs up to 240 bytes),
// xxh3_kernels.h (the accumulator kernels), this file (sources, long inputs, the API).

#ifndef PREFIXCACHE_ENGINE_NATIVE_XXH3_H_
#define PREFIXCACHE_ENGINE_NATIVE_XXH3_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "xxh3_kernels.h"

namespace prefixcache {
namespace xxh3_detail {

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
