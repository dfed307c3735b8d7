// Chained block hashes in C++, the same values as prefixcache.engine.hashing.
//
// compute_block_hashes(tokens, block_size, parent=p) with the default algorithm
// "xxh3_64" cuts the tokens into full blocks, takes each block's tokens as
// little-endian int32 bytes, and hashes block i with XXH3-64 seeded by the
// hash of block i - 1 (block 0: the parent p); each digest is folded to a
// positive 63-bit value (& (2**63 - 1), 0 mapped to 1), which is both the
// block's hash and the next block's seed. chain_block_hashes below computes
// exactly that list for int32 or int64 token arrays; the caller passes the
// root (root_hash(salt, extra_keys)) or the last hash of a chain to continue
// as ``parent``. Salts and extra keys are encoded on the Python side; only the
// default root (no salt, no keys) is also available here, as default_root().
//
// Header-only C++17, noexcept, no allocation: int64 tokens are narrowed to
// int32 into a 4 KiB stack buffer, whole blocks at a time (blocks of more than
// 1,024 tokens: 64 bytes at a time, as the hash reads them).

#ifndef PREFIXCACHE_ENGINE_NATIVE_BLOCK_HASHING_H_
#define PREFIXCACHE_ENGINE_NATIVE_BLOCK_HASHING_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "xxh3.h"

namespace prefixcache {

/// Largest block hash, 2**63 - 1: every hash fits an int64, 0 and -1 stay free.
constexpr uint64_t kMaxBlockHash = (uint64_t{1} << 63) - 1;

/// A 64-bit digest folded to a block hash in [1, 2**63 - 1].
///
/// Complexity: O(1).
inline uint64_t fold63(uint64_t digest) noexcept {
  const uint64_t h = digest & kMaxBlockHash;
  return h != 0 ? h : 1;
}

/// The root of the chain without salt or extra keys: equals Python's
/// ``prefixcache.engine.hashing.root_hash()`` (XXH3-64 of the root material,
/// the tag ``prefixcache.hashing.root.v1\0``, then the empty salt as
/// ``b`` + 8-byte length 0 and the empty key tuple as ``t`` + 8-byte count 0).
///
/// Complexity: O(1).
inline uint64_t default_root() noexcept {
  static constexpr char kTag[] = "prefixcache.hashing.root.v1";  // + its NUL: 28 bytes
  uint8_t material[sizeof kTag + 2 * 9] = {};
  std::memcpy(material, kTag, sizeof kTag);
  material[sizeof kTag] = 'b';      // salt: bytes, length 0 (8 zero bytes follow)
  material[sizeof kTag + 9] = 't';  // extra keys: tuple, count 0 (8 zero bytes follow)
  return fold63(xxh3_64(material, sizeof material, 0));
}

/// Why chain_block_hashes wrote nothing.
enum class ChainError : uint8_t {
  kNone = 0,
  kZeroBlockSize,     // block_size was 0
  kParentOutOfRange,  // parent not in [1, 2**63 - 1]
  kTokenOutOfRange,   // an int64 token outside int32 (at ChainResult::bad_index)
};

/// What chain_block_hashes did: ``num_blocks`` hashes written to ``out``, or
/// an error (then ``num_blocks`` is 0 and ``out`` is untouched).
struct ChainResult {
  size_t num_blocks;
  ChainError error;
  size_t bad_index;  // index of the offending token for kTokenOutOfRange, else 0
};

/// Number of full blocks (hashes) in ``num_tokens`` tokens; 0 when block_size is 0.
///
/// Complexity: O(1).
inline size_t num_full_blocks(size_t num_tokens, size_t block_size) noexcept {
  return block_size == 0 ? 0 : num_tokens / block_size;
}

namespace block_hashing_detail {

// Whether any of tokens[0, kRangeChunk) is outside int32. t + 2**31, in uint64
// (wraps, no overflow), is below 2**32 exactly when t fits: OR the high halves.
// Add, shift and OR are SSE2 (a 64-bit compare would need SSE4.2); written
// out because GCC -O2 leaves the plain loop scalar (0.1 against 1.2 ns a token).
constexpr size_t kRangeChunk = 256;

PREFIXCACHE_XXH3_INLINE bool chunk_has_token_outside_int32(const int64_t* tokens) noexcept {
#if PREFIXCACHE_XXH3_HAVE_SSE2 && !PREFIXCACHE_XXH3_BIG_ENDIAN
  const __m128i bias = _mm_set1_epi64x(0x80000000LL);
  __m128i high = _mm_setzero_si128();
  for (size_t i = 0; i < kRangeChunk; i += 2) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tokens + i));
    high = _mm_or_si128(high, _mm_srli_epi64(_mm_add_epi64(t, bias), 32));
  }
  return _mm_movemask_epi8(_mm_cmpeq_epi32(high, _mm_setzero_si128())) != 0xFFFF;
#else
  uint64_t high = 0;
  for (size_t i = 0; i < kRangeChunk; ++i) {
    high |= (static_cast<uint64_t>(tokens[i]) + 0x80000000ULL) >> 32;
  }
  return high != 0;
#endif
}

}  // namespace block_hashing_detail

/// Index of the first int64 token outside the int32 range, or ``num_tokens``
/// if all fit.
///
/// Complexity: O(num_tokens).
inline size_t first_token_outside_int32(const int64_t* tokens, size_t num_tokens) noexcept {
  // Whole chunks without an early exit first; the exact index is looked for
  // only from the first chunk that has a bad token.
  size_t start = 0;
  while (start + block_hashing_detail::kRangeChunk <= num_tokens &&
         !block_hashing_detail::chunk_has_token_outside_int32(tokens + start)) {
    start += block_hashing_detail::kRangeChunk;
  }
  for (size_t i = start; i < num_tokens; ++i) {
    if (tokens[i] < INT32_MIN || tokens[i] > INT32_MAX) return i;
  }
  return num_tokens;
}

namespace block_hashing_detail {

// int64 blocks of up to this many tokens are narrowed into a stack buffer
// (4 KiB) and hashed from there; longer ones through Int64TokenSource.
constexpr size_t kChunkTokens = 1024;

// tokens[0, count) (range-checked) as int32 values whose bytes in memory are
// little-endian. A plain loop of int32 stores, which the compiler vectorises.
PREFIXCACHE_XXH3_INLINE void narrow(const int64_t* tokens, size_t count, uint32_t* out) noexcept {
  for (size_t i = 0; i < count; ++i) {
    const auto value = static_cast<uint32_t>(tokens[i]);
    out[i] = PREFIXCACHE_XXH3_BIG_ENDIAN ? xxh3_detail::bswap32(value) : value;
  }
}

// int64 tokens read as little-endian int32 bytes (they have been range-checked),
// 64 bytes at a time. Byte offsets from the hash are multiples of 4: a block
// is 4 * block_size bytes.
struct Int64TokenSource {
  const int64_t* tokens;
  PREFIXCACHE_XXH3_INLINE const uint8_t* stripe(size_t offset, uint8_t* scratch) const noexcept {
    const int64_t* t = tokens + offset / 4;
    for (size_t i = 0; i < xxh3_detail::kStripeLen / 4; ++i) {
      xxh3_detail::write32(scratch + 4 * i, static_cast<uint32_t>(t[i]));
    }
    return scratch;
  }
  PREFIXCACHE_XXH3_INLINE void copy(size_t len, uint8_t* out) const noexcept {
    for (size_t i = 0; i < len / 4; ++i) {
      xxh3_detail::write32(out + 4 * i, static_cast<uint32_t>(tokens[i]));
    }
  }
};

// int32 tokens on a big-endian host: bytes swapped to little-endian as read.
struct Int32TokenSource {
  const int32_t* tokens;
  PREFIXCACHE_XXH3_INLINE const uint8_t* stripe(size_t offset, uint8_t* scratch) const noexcept {
    const int32_t* t = tokens + offset / 4;
    for (size_t i = 0; i < xxh3_detail::kStripeLen / 4; ++i) {
      xxh3_detail::write32(scratch + 4 * i, static_cast<uint32_t>(t[i]));
    }
    return scratch;
  }
  PREFIXCACHE_XXH3_INLINE void copy(size_t len, uint8_t* out) const noexcept {
    for (size_t i = 0; i < len / 4; ++i) {
      xxh3_detail::write32(out + 4 * i, static_cast<uint32_t>(tokens[i]));
    }
  }
};

inline ChainError check_args(size_t block_size, uint64_t parent) noexcept {
  if (block_size == 0) return ChainError::kZeroBlockSize;
  if (parent == 0 || parent > kMaxBlockHash) return ChainError::kParentOutOfRange;
  return ChainError::kNone;
}

}  // namespace block_hashing_detail

/// Chained hashes of the full blocks of int32 ``tokens``, written to ``out``.
///
/// Hash i is fold63(XXH3-64(block i's 4 * block_size bytes, seed = hash i - 1)),
/// with hash -1 = ``parent``: the list that Python's
/// ``compute_block_hashes(tokens, block_size, parent=parent)`` returns. A
/// trailing partial block gets no hash. On error nothing is written.
///
/// Args:
///   tokens: ``num_tokens`` token IDs (any alignment; may be null if 0 tokens).
///   block_size: tokens per block, > 0.
///   parent: the chain's root (``root_hash(...)``, or default_root()) or the
///     last hash of a chain to continue; in [1, 2**63 - 1].
///   out: room for num_full_blocks(num_tokens, block_size) hashes.
///
/// Complexity: O(num_tokens), one XXH3 call per full block.
inline ChainResult chain_block_hashes(const int32_t* tokens, size_t num_tokens, size_t block_size,
                                      uint64_t parent, uint64_t* out) noexcept {
  const ChainError error = block_hashing_detail::check_args(block_size, parent);
  if (error != ChainError::kNone) return ChainResult{0, error, 0};
  const size_t num_blocks = num_tokens / block_size;
  const size_t block_bytes = 4 * block_size;
  uint64_t h = parent;
  for (size_t b = 0; b < num_blocks; ++b) {
    const int32_t* block = tokens + b * block_size;
#if PREFIXCACHE_XXH3_BIG_ENDIAN
    h = fold63(xxh3_64_source(block_hashing_detail::Int32TokenSource{block}, block_bytes, h));
#else
    h = fold63(xxh3_64(block, block_bytes, h));  // the tokens' bytes are already canonical
#endif
    out[b] = h;
  }
  return ChainResult{num_blocks, ChainError::kNone, 0};
}

/// Chained hashes of the full blocks of int64 ``tokens``, written to ``out``.
///
/// Every token (those of a trailing partial block included) must fit in
/// int32, as the Python function requires; they are hashed as int32 bytes,
/// so the result equals the int32 overload's for the same values. If a token
/// does not fit, returns kTokenOutOfRange with its index and writes nothing.
/// Arguments as for the int32 overload.
///
/// Complexity: O(num_tokens): one range-check pass, one XXH3 call per full block.
inline ChainResult chain_block_hashes(const int64_t* tokens, size_t num_tokens, size_t block_size,
                                      uint64_t parent, uint64_t* out) noexcept {
  const ChainError error = block_hashing_detail::check_args(block_size, parent);
  if (error != ChainError::kNone) return ChainResult{0, error, 0};
  const size_t bad = first_token_outside_int32(tokens, num_tokens);
  if (bad != num_tokens) return ChainResult{0, ChainError::kTokenOutOfRange, bad};
  const size_t num_blocks = num_tokens / block_size;
  const size_t block_bytes = 4 * block_size;
  uint64_t h = parent;
  if (block_size <= block_hashing_detail::kChunkTokens) {
    // Narrow as many whole blocks as fit in the buffer, then hash them in place.
    const size_t per_chunk = block_hashing_detail::kChunkTokens / block_size;
    alignas(64) uint32_t chunk[block_hashing_detail::kChunkTokens];
    const auto* bytes = reinterpret_cast<const uint8_t*>(chunk);
    for (size_t first = 0; first < num_blocks; first += per_chunk) {
      const size_t count = num_blocks - first < per_chunk ? num_blocks - first : per_chunk;
      block_hashing_detail::narrow(tokens + first * block_size, count * block_size, chunk);
      for (size_t k = 0; k < count; ++k) {
        h = fold63(xxh3_64(bytes + k * block_bytes, block_bytes, h));
        out[first + k] = h;
      }
    }
  } else {
    for (size_t b = 0; b < num_blocks; ++b) {
      const block_hashing_detail::Int64TokenSource source{tokens + b * block_size};
      h = fold63(xxh3_64_source(source, block_bytes, h));
      out[b] = h;
    }
  }
  return ChainResult{num_blocks, ChainError::kNone, 0};
}

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_BLOCK_HASHING_H_
