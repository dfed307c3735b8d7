// HazardAgeBins: hazard's age bin, min(int(log2(x) * 4), 127) for x = age + 1.0, without
// calling log2 on the hot path.
//
// policies/hazard_learning.py's _age_bin is the reference, and the native policy must
// return exactly what it returns with the C library's log2 (Python's math.log2 calls it).
// Each bin k >= 1 starts at the smallest double x whose reference bin is >= k, found once
// per process by a binary search over the bit patterns of [1, 2**33] with std::log2 itself;
// a lookup counts the starts at or below x among the six bins around the octave in x's
// exponent (no branch). That agrees with the reference wherever the computed
// log2 is monotone across each bin start; glibc's log2 errs by well under one ulp, so a
// non-monotone stretch can only be a few doubles wide around a start, and the build checks
// the 64 doubles on either side of every start. Should any check fail (another libm), the
// table is marked inexact and every call goes to std::log2, so results never differ.
// starts() also gives each bin's range, so hazard.cpp can tell that an age is still in the
// bin it cached without computing the bin again.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_HAZARD_BINS_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_HAZARD_BINS_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace prefixcache {

class HazardAgeBins {
 public:
  static constexpr int kBinsPerOctave = 4;
  static constexpr int kNumAgeBins = 128;  // covers idle ages up to 2 ** 32 clock ticks

  /// The table of this process, built on first use (thread-safe static initialisation).
  static const HazardAgeBins& get() {
    static const HazardAgeBins bins;
    return bins;
  }

  /// _age_bin's formula with std::log2: the reference every lookup must equal.
  static int reference(double x) noexcept {
    const double bin = std::log2(x) * kBinsPerOctave;
    return bin >= kNumAgeBins - 1 ? kNumAgeBins - 1 : static_cast<int>(bin);
  }

  /// The bin of ``x`` = age + 1.0 (age >= 0), as reference(x).
  int bin(double x) const noexcept {
    if (!exact_) return reference(x);
    const int base = lowest_candidate(x);
    if (base >= kNumAgeBins - 1) return kNumAgeBins - 1;
    int k = base;  // + the starts at or below x among the next five bins (no branch)
    for (int step = 1; step <= kCandidates; ++step) k += start_[base + step] <= x;
    return k;
  }

  /// The x of bin ``k``, [low, high); an empty range when the table is inexact.
  void range(int k, double& low, double& high) const noexcept {
    low = exact_ ? start_[k] : std::numeric_limits<double>::infinity();
    high = exact_ ? start_[k + 1] : -std::numeric_limits<double>::infinity();
  }

  bool exact() const noexcept { return exact_; }

 private:
  HazardAgeBins() {
    start_[0] = -std::numeric_limits<double>::infinity();
    for (int k = kNumAgeBins; k < kNumStarts; ++k) {
      start_[k] = std::numeric_limits<double>::infinity();
    }
    exact_ = true;
    for (int k = 1; k < kNumAgeBins; ++k) {
      uint64_t low = bits(1.0), high = bits(8589934592.0);  // reference < k at 1, >= k at 2**33
      while (high - low > 1) {
        const uint64_t middle = low + (high - low) / 2;
        (reference(value(middle)) >= k ? high : low) = middle;
      }
      start_[k] = value(high);
      for (uint64_t step = 1; step <= 64; ++step) {
        if (reference(value(high - step)) >= k || reference(value(high + step - 1)) < k) {
          exact_ = false;
        }
      }
      if (!(start_[k] > start_[k - 1])) exact_ = false;
    }
    // Each octave [2**e, 2**(e + 1)) must lie within its candidates' bins.
    for (int exponent = 0; exponent < 32; ++exponent) {
      const double first = std::ldexp(1.0, exponent);
      const double last = value(bits(std::ldexp(1.0, exponent + 1)) - 1);
      const int base = lowest_candidate(first);
      if (!(start_[base] <= first) || !(start_[base + kCandidates + 1] > last)) exact_ = false;
    }
  }

  static uint64_t bits(double x) noexcept {
    uint64_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
  }
  static double value(uint64_t b) noexcept {
    double x;
    std::memcpy(&x, &b, sizeof x);
    return x;
  }

  // The lowest bin x may be in: the one before its octave's first (x >= 1: exponent >= 0).
  static int lowest_candidate(double x) noexcept {
    const int exponent = static_cast<int>((bits(x) >> 52) & 0x7ff) - 1023;
    if (exponent <= 0) return 0;
    return exponent >= 32 ? kNumAgeBins - 1 : kBinsPerOctave * exponent - 1;
  }

  static constexpr int kCandidates = 5;  // bins above lowest_candidate x may be in
  static constexpr int kNumStarts = kNumAgeBins + kCandidates + 1;
  double start_[kNumStarts];  // start_[k]: the smallest x in bin k; infinity from 128 on
  bool exact_;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_HAZARD_BINS_H_
