// The native block-hash chain against raw XXH3 over the same bytes (bench_native.py --hashing).
//
// For a W2-sized prompt (2,304 int32 tokens) cut into blocks of 16 and of 64
// tokens: raw xxh3_64 of each block with one fixed seed (independent calls,
// which the CPU overlaps: the throughput floor, and the ratios' baseline);
// raw xxh3_64 of each block seeded by the previous digest (the same calls
// made serial, as any chain must be: the latency floor); chain_block_hashes,
// what admit_request runs (the serial calls plus the 63-bit fold); one
// xxh3_64 over the whole 9,216 bytes. Nanoseconds per prompt, min / median /
// max over 10 rounds of the given number of repeats. Prints a markdown table.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "block_hashing.h"

namespace {

volatile uint64_t g_sink;

template <class F>
void measure(const char* name, int block_size, int repeats, double baseline, F&& run) {
  std::vector<double> rounds;
  for (int round = 0; round < 10; ++round) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < repeats; ++i) g_sink = run();
    const auto stop = std::chrono::steady_clock::now();
    rounds.push_back(std::chrono::duration<double, std::nano>(stop - start).count() / repeats);
  }
  std::sort(rounds.begin(), rounds.end());
  const double median = rounds[rounds.size() / 2];
  const int blocks = 2304 / block_size;
  std::printf("| %d | %s | %.0f / %.0f / %.0f | %.1f | %.2fx |\n", block_size, name,
              rounds.front(), median, rounds.back(), median / blocks, median / baseline);
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 2000;
  std::vector<int32_t> tokens(2304);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(1 + i * 7919 % 150000);
  std::vector<uint64_t> out(tokens.size());
  const uint64_t root = prefixcache::default_root();
  std::printf("| block size (tokens) | what | ns per prompt min / median / max | ns per block | vs independent raw calls |\n");
  std::printf("|---:|---|---:|---:|---:|\n");
  for (const int block_size : {16, 64}) {
    const size_t bytes = 4 * static_cast<size_t>(block_size);
    const size_t blocks = tokens.size() / block_size;
    // Raw first: its median is the baseline of the chain's ratio.
    auto raw = [&] {
      uint64_t acc = 0;
      for (size_t b = 0; b < blocks; ++b) {
        acc ^= prefixcache::xxh3_64(tokens.data() + b * block_size, bytes, root);
      }
      return acc;
    };
    std::vector<double> samples;
    for (int round = 0; round < 10; ++round) {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < repeats; ++i) g_sink = raw();
      samples.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / repeats);
    }
    std::sort(samples.begin(), samples.end());
    const double baseline = samples[samples.size() / 2];
    measure("raw `xxh3_64` per block, one seed", block_size, repeats, baseline, raw);
    measure("raw `xxh3_64` per block, seeded by the previous digest", block_size, repeats,
            baseline, [&] {
              uint64_t h = root;
              for (size_t b = 0; b < blocks; ++b) {
                h = prefixcache::xxh3_64(tokens.data() + b * block_size, bytes, h);
              }
              return h;
            });
    measure("`chain_block_hashes` (the chain)", block_size, repeats, baseline, [&] {
      prefixcache::chain_block_hashes(tokens.data(), tokens.size(), block_size, root, out.data());
      return out[blocks - 1];
    });
    measure("one `xxh3_64` over all 9,216 bytes", block_size, repeats, baseline, [&] {
      return prefixcache::xxh3_64(tokens.data(), tokens.size() * 4, root);
    });
  }
  return 0;
}
