// Test driver for prefixcache/engine/native/xxh3.h and block_hashing.h.
//
// tests/native/test_xxh3.py compiles this program and talks to it over
// stdin/stdout, one request per line, one answer line each:
//
//   kernels                         -> names of the compiled-in kernels
//   x <kernel> <seed> <skew> <hex>  -> XXH3-64 of the bytes, placed <skew>
//                                      bytes past an aligned address; kernel
//                                      is default|scalar|sse2|avx2|source|int32
//                                      (avx2: compiled with -mavx2 or chosen at
//                                      run time; "na" if the CPU lacks it)
//                                      (source: through xxh3_64_source; int32:
//                                      the bytes as int32 tokens through the
//                                      big-endian hosts' token source), or
//                                      "na" if that kernel is not compiled in
//                                      (int32: or the length is not 4k)
//   c32 <parent> <block_size> <n> <tokens...>  -> "ok <hashes...>" or
//   c64 <parent> <block_size> <n> <tokens...>     "err <code> <bad_index>"
//   root                            -> default_root()
//   mul <a> <b>                     -> mul128_fold64 and its portable form
//
// Every input sits in a heap buffer that ends exactly where the input ends,
// so a build with -fsanitize=address reports any read past it.

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "block_hashing.h"
#include "xxh3.h"

namespace {

using prefixcache::xxh3_detail::ByteSource;

// The words of one request line, read left to right.
struct Words {
  char* rest;
  // The next word (empty at the end of the line); later calls overwrite nothing.
  const char* next() {
    while (*rest == ' ') ++rest;
    const char* word = rest;
    while (*rest != ' ' && *rest != '\0') ++rest;
    if (*rest == ' ') *rest++ = '\0';
    return word;
  }
  uint64_t u64() { return std::strtoull(next(), nullptr, 10); }
  long long i64() { return std::strtoll(next(), nullptr, 10); }
};

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return c - 'A' + 10;
}

std::string kernels() {
  std::string names = "default scalar source int32";
#if PREFIXCACHE_XXH3_HAVE_SSE2 && !PREFIXCACHE_XXH3_BIG_ENDIAN
  names += " sse2";
#endif
#if PREFIXCACHE_XXH3_HAVE_AVX2 && !PREFIXCACHE_XXH3_BIG_ENDIAN
  if (prefixcache::xxh3_detail::cpu_has_avx2()) names += " avx2";
#endif
  return names;
}

std::string hash_request(Words& in) {
  const std::string kernel = in.next();
  const uint64_t seed = in.u64();
  const size_t skew = in.u64();
  const char* hex = in.next();  // empty for empty input
  const size_t len = std::strlen(hex) / 2;
  std::unique_ptr<uint8_t[]> buffer(new uint8_t[skew + len]);
  uint8_t* data = buffer.get() + skew;
  for (size_t i = 0; i < len; ++i) {
    data[i] = static_cast<uint8_t>(hex_digit(hex[2 * i]) * 16 + hex_digit(hex[2 * i + 1]));
  }
  namespace d = prefixcache::xxh3_detail;
  uint64_t h = 0;
  if (kernel == "default") {
    h = prefixcache::xxh3_64(data, len, seed);
  } else if (kernel == "scalar") {
    h = prefixcache::xxh3_64_with<d::ScalarKernel>(data, len, seed);
  } else if (kernel == "source") {
    h = prefixcache::xxh3_64_source(ByteSource{data}, len, seed);
  } else if (kernel == "int32") {
    if (len % 4 != 0) return "na";
    // Native-endian int32 tokens holding these bytes (this test runs on
    // little-endian hosts, where they are the same little-endian values).
    std::unique_ptr<int32_t[]> tokens(new int32_t[len / 4 + 1]);
    std::memcpy(tokens.get(), data, len);
    using prefixcache::block_hashing_detail::Int32TokenSource;
    h = prefixcache::xxh3_64_source(Int32TokenSource{tokens.get()}, len, seed);
#if PREFIXCACHE_XXH3_HAVE_SSE2 && !PREFIXCACHE_XXH3_BIG_ENDIAN
  } else if (kernel == "sse2") {
    h = prefixcache::xxh3_64_with<d::Sse2Kernel>(data, len, seed);
#endif
#if PREFIXCACHE_XXH3_HAVE_AVX2 && !PREFIXCACHE_XXH3_BIG_ENDIAN
  } else if (kernel == "avx2") {
    if (!d::cpu_has_avx2()) return "na";
    h = len <= d::kMidSizeMax ? prefixcache::xxh3_64(data, len, seed)
                              : d::hash_long_avx2(data, len, seed);
#endif
  } else {
    return "na";
  }
  return std::to_string(h);
}

template <class Token>
std::string chain_request(Words& in) {
  const uint64_t parent = in.u64();
  const size_t block_size = in.u64();
  const size_t count = in.u64();
  std::unique_ptr<Token[]> tokens(new Token[count + 1]);
  for (size_t i = 0; i < count; ++i) tokens[i] = static_cast<Token>(in.i64());
  // Poisoned output: entries past num_blocks must stay as they were.
  constexpr uint64_t kPoison = 0xDEADBEEFULL;
  std::vector<uint64_t> out(prefixcache::num_full_blocks(count, block_size) + 1, kPoison);
  const prefixcache::ChainResult result =
      prefixcache::chain_block_hashes(tokens.get(), count, block_size, parent, out.data());
  if (result.error != prefixcache::ChainError::kNone) {
    for (uint64_t v : out) {
      if (v != kPoison) return "wrote-on-error";
    }
    return "err " + std::to_string(static_cast<int>(result.error)) + ' ' +
           std::to_string(result.bad_index);
  }
  if (out[result.num_blocks] != kPoison) return "wrote-past-end";
  std::string answer = "ok";
  for (size_t i = 0; i < result.num_blocks; ++i) answer += ' ' + std::to_string(out[i]);
  return answer;
}

std::string mul_request(Words& in) {
  const uint64_t a = in.u64();
  const uint64_t b = in.u64();
  namespace d = prefixcache::xxh3_detail;
  return std::to_string(d::mul128_fold64(a, b)) + ' ' +
         std::to_string(d::mul128_fold64_portable(a, b));
}

std::string answer(Words& in) {
  const std::string op = in.next();
  if (op == "x") return hash_request(in);
  if (op == "c32") return chain_request<int32_t>(in);
  if (op == "c64") return chain_request<int64_t>(in);
  if (op == "root") return std::to_string(prefixcache::default_root());
  if (op == "mul") return mul_request(in);
  if (op == "kernels") return kernels();
  return "unknown-op";
}

// One line of stdin without its newline; false at end of input.
bool read_line(std::vector<char>& line) {
  line.clear();
  int c;
  while ((c = std::getchar()) != EOF && c != '\n') line.push_back(static_cast<char>(c));
  line.push_back('\0');
  return c != EOF || line.size() > 1;
}

}  // namespace

int main() {
  bool supported = true;
#if defined(__AVX2__) && (defined(__GNUC__) || defined(__clang__))
  // A build with -mavx2 on a CPU without AVX2 answers every request with "no-avx2".
  supported = __builtin_cpu_supports("avx2");
#endif
  std::vector<char> line;
  while (read_line(line)) {
    Words in{line.data()};
    const std::string reply = supported ? answer(in) : "no-avx2";
    std::fputs(reply.c_str(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
  }
  return 0;
}
