// Time prefixcache::xxh3_64 (prefixcache/engine/native/xxh3.h) against xxHash's
// own C implementation, both called from C++. Driven by
// benchmarks/bench_native_hashing.py, which compiles this file and finds the
// xxHash libraries; by hand:
//
//   g++ -O3 -std=c++17 -Iprefixcache/engine/native benchmarks/bench_xxh3.cpp -o bench_xxh3 -ldl
//   ./bench_xxh3 --lib libxxhash=libxxhash.so.0 --sizes 64,1024
//
// Options:
//   --lib NAME=PATH   an xxHash shared library to time (repeatable); its
//                     XXH3_64bits_withSeed and, where exported,
//                     XXH3_64bits_withSeed_dispatch (runtime SIMD choice)
//   --preload PATH    a library loaded first, with RTLD_GLOBAL (libpython, for
//                     the Python package's _xxhash extension module)
//   --sizes A,B,...   input sizes in bytes (default 64,1024)
//   --calls N         calls per timed sample (default 200000)
//   --repeats R       timed samples after one warm-up sample (default 11)
//
// Two access patterns per size, over consecutive inputs of a 256 KiB buffer
// (a prompt's tokens, in cache):
//   chain        each seed is the previous digest folded to 63 bits, as in
//                block hashing: one call cannot start before the last ends
//   independent  a fixed seed, digests XORed together: calls may overlap
// plus, for sizes that are whole tokens, prefixcache::chain_block_hashes over
// int32 and int64 tokens, in ns per block (its own chain: pattern "chain").
// Every implementation's digests are checked against ours first. The samples
// of all implementations are interleaved (one sample of each in turn), so a
// noisy neighbour slows them alike. Prints one tab-separated row per
// (implementation, size, pattern): ns per call, min / median / max.

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "block_hashing.h"
#include "xxh3.h"

namespace {

using HashFn = uint64_t (*)(const void*, size_t, uint64_t);

struct Impl {
  std::string name;
  HashFn fn;
};

constexpr size_t kBufferBytes = 256 * 1024;
constexpr uint64_t kMask63 = (uint64_t{1} << 63) - 1;

// Our function behind a real call, the same call shape as a library's.
__attribute__((noinline)) uint64_t ours_called(const void* p, size_t n, uint64_t s) noexcept {
  return prefixcache::xxh3_64(p, n, s);
}
__attribute__((noinline)) uint64_t ours_scalar(const void* p, size_t n, uint64_t s) noexcept {
  return prefixcache::xxh3_64_with<prefixcache::xxh3_detail::ScalarKernel>(p, n, s);
}

#if PREFIXCACHE_XXH3_HAVE_SSE2
__attribute__((noinline)) uint64_t ours_sse2(const void* p, size_t n, uint64_t s) noexcept {
  return prefixcache::xxh3_64_with<prefixcache::xxh3_detail::Sse2Kernel>(p, n, s);
}
#endif

std::string kernel_name() {
#if PREFIXCACHE_XXH3_RUNTIME_AVX2
  return prefixcache::xxh3_detail::cpu_has_avx2() ? "avx2 chosen at run time" : "sse2";
#elif PREFIXCACHE_XXH3_HAVE_AVX2
  return "avx2";
#elif PREFIXCACHE_XXH3_HAVE_SSE2
  return "sse2";
#else
  return "scalar";
#endif
}

using Clock = std::chrono::steady_clock;

double ns_per(Clock::time_point start, Clock::time_point stop, size_t count) {
  return std::chrono::duration<double, std::nano>(stop - start).count() /
         static_cast<double>(count);
}

// One sample: ns per call of `calls` calls through `hash` (a function pointer
// or, for the inlined row, a lambda the compiler inlines).
template <class Hash>
double sample(const Hash& hash, const uint8_t* buffer, size_t size, size_t calls, bool chain,
              uint64_t* sink) {
  const size_t slots = kBufferBytes / size;
  uint64_t seed = 1, acc = 0;
  size_t slot = 0;
  const Clock::time_point start = Clock::now();
  for (size_t i = 0; i < calls; ++i) {
    const uint64_t h = hash(buffer + slot * size, size, seed);
    if (chain) {
      seed = (h & kMask63) | ((h & kMask63) == 0);
    } else {
      acc ^= h;
    }
    if (++slot == slots) slot = 0;
  }
  const Clock::time_point stop = Clock::now();
  *sink ^= seed ^ acc;
  return ns_per(start, stop, calls);
}

// One sample of chain_block_hashes over the whole token buffer: ns per block.
template <class Token>
double chain_sample(const std::vector<Token>& tokens, size_t block_size, size_t num_blocks_wanted,
                    std::vector<uint64_t>* out, uint64_t* sink) {
  const size_t per_call = tokens.size() / block_size;
  const size_t rounds = num_blocks_wanted / per_call + 1;
  const Clock::time_point start = Clock::now();
  for (size_t r = 0; r < rounds; ++r) {
    prefixcache::chain_block_hashes(tokens.data(), tokens.size(), block_size, r + 1, out->data());
    *sink ^= (*out)[per_call - 1];
  }
  const Clock::time_point stop = Clock::now();
  return ns_per(start, stop, rounds * per_call);
}

struct Row {
  std::string name;
  bool chain;
  std::function<double()> run;
  std::vector<double> ns;
};

void print_rows(std::vector<Row>& rows, size_t size, size_t repeats) {
  for (Row& row : rows) row.run();  // warm-up
  for (size_t r = 0; r < repeats; ++r) {
    for (Row& row : rows) row.ns.push_back(row.run());
  }
  for (Row& row : rows) {
    std::sort(row.ns.begin(), row.ns.end());
    std::printf("%s\t%zu\t%s\t%.2f\t%.2f\t%.2f\n", row.name.c_str(), size,
                row.chain ? "chain" : "independent", row.ns.front(), row.ns[row.ns.size() / 2],
                row.ns.back());
  }
}

std::vector<size_t> parse_sizes(const char* text) {
  std::vector<size_t> sizes;
  for (const char* p = text; *p != '\0';) {
    char* end = nullptr;
    sizes.push_back(std::strtoull(p, &end, 10));
    p = (*end == ',') ? end + 1 : end;
  }
  return sizes;
}

bool load_library(const std::string& spec, std::vector<Impl>* impls) {
  const size_t eq = spec.find('=');
  const std::string name = spec.substr(0, eq);
  const std::string path = eq == std::string::npos ? spec : spec.substr(eq + 1);
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    std::fprintf(stderr, "cannot load %s: %s\n", path.c_str(), dlerror());
    return false;
  }
  const char* symbols[] = {"XXH3_64bits_withSeed", "XXH3_64bits_withSeed_dispatch"};
  for (const char* symbol : symbols) {
    if (void* fn = dlsym(handle, symbol)) {
      impls->push_back({name + " " + symbol, reinterpret_cast<HashFn>(fn)});
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<size_t> sizes = {64, 1024};
  size_t calls = 200000, repeats = 11;
  std::vector<Impl> libs;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--lib") {
      if (!load_library(value, &libs)) return 2;
    } else if (flag == "--preload") {
      if (dlopen(value.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
        std::fprintf(stderr, "cannot preload %s: %s\n", value.c_str(), dlerror());
        return 2;
      }
    } else if (flag == "--sizes") {
      sizes = parse_sizes(value.c_str());
    } else if (flag == "--calls") {
      calls = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--repeats") {
      repeats = std::max<size_t>(1, std::strtoull(value.c_str(), nullptr, 10));
    } else {
      std::fprintf(stderr, "unknown option %s\n", flag.c_str());
      return 2;
    }
  }
  std::vector<uint8_t> buffer(kBufferBytes);
  uint64_t x = 0x9E3779B97F4A7C15ULL;
  for (uint8_t& byte : buffer) {  // xorshift: reproducible, not all-zero
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    byte = static_cast<uint8_t>(x);
  }
  const std::string kernel = kernel_name();
  std::vector<Impl> called = {{"prefixcache xxh3_64 (" + kernel + ", called)", ours_called},
                              {"prefixcache xxh3_64 (scalar, called)", ours_scalar}};
#if PREFIXCACHE_XXH3_RUNTIME_AVX2
  called.push_back({"prefixcache xxh3_64 (sse2, called)", ours_sse2});
#endif
  for (const Impl& lib : libs) called.push_back(lib);

  for (size_t size : sizes) {  // every implementation must agree before it is timed
    if (size == 0 || size > kBufferBytes) {
      std::fprintf(stderr, "size %zu outside 1..%zu\n", size, kBufferBytes);
      return 2;
    }
    for (uint64_t seed : {uint64_t{0}, uint64_t{12345}}) {
      const uint64_t want = prefixcache::xxh3_64(buffer.data() + 3, size, seed);
      for (const Impl& impl : called) {
        if (impl.fn(buffer.data() + 3, size, seed) != want) {
          std::fprintf(stderr, "%s disagrees at size %zu\n", impl.name.c_str(), size);
          return 1;
        }
      }
    }
  }
  std::vector<int32_t> tokens32(kBufferBytes / 4);
  std::memcpy(tokens32.data(), buffer.data(), kBufferBytes);
  const std::vector<int64_t> tokens64(tokens32.begin(), tokens32.end());
  std::vector<uint64_t> out(tokens32.size());

  std::printf("implementation\tbytes\tpattern\tmin_ns\tmedian_ns\tmax_ns\n");
  uint64_t sink = 0;
  const uint8_t* data = buffer.data();
  for (size_t size : sizes) {
    std::vector<Row> rows;
    for (const bool chain : {true, false}) {
      const auto inlined = [](const void* p, size_t n, uint64_t s) {
        return prefixcache::xxh3_64(p, n, s);
      };
      rows.push_back({"prefixcache xxh3_64 (" + kernel + ", inlined)", chain,
                      [=, &sink] { return sample(inlined, data, size, calls, chain, &sink); },
                      {}});
      for (const Impl& impl : called) {
        const HashFn volatile fn = impl.fn;  // an opaque pointer: no devirtualising
        const HashFn opaque = fn;
        rows.push_back({impl.name, chain,
                        [=, &sink] { return sample(opaque, data, size, calls, chain, &sink); },
                        {}});
      }
    }
    if (size % 4 == 0) {
      const size_t block_size = size / 4;
      rows.push_back({"prefixcache chain_block_hashes (int32 tokens, per block)", true,
                      [&, block_size] {
                        return chain_sample(tokens32, block_size, calls, &out, &sink);
                      },
                      {}});
      rows.push_back({"prefixcache chain_block_hashes (int64 tokens, per block)", true,
                      [&, block_size] {
                        return chain_sample(tokens64, block_size, calls, &out, &sink);
                      },
                      {}});
    }
    print_rows(rows, size, repeats);
  }
  std::fprintf(stderr, "(sink %llu)\n", static_cast<unsigned long long>(sink));
  return 0;
}
