// HazardAgeBins: hazard's age bin, min(int(log2(x) * 4), 127) for x = age + 1.0, without
// calling log2 on the hot path.
//
// policies/hazard_learning.py's _age_bin is the reference, and the native policy must
// return exactly what it returns with the C library's log2 (Python's math.log2 calls it).
// Each bin k >= 1 starts at the smallest double x whose reference bin is >= k, found once
// per process by a binary search over the bit patterns of [1, 2**33] with std::log2 itself;
// a lookup then starts from the octave in x's exponent and steps down past the starts
// above x (at most six compares). That agrees with the reference wherever the computed
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
    int k = first_guess(x);
    while (start_[k] > x) --k;
    return k;
  }

  /// Whether ``x`` lies in bin ``k`` by the table (false when the table is inexact).
  bool holds(int k, double x) const noexcept {
    return exact_ && start_[k] <= x && x < start_[k + 1];
  }

  bool exact() const noexcept { return exact_; }

 private:
  HazardAgeBins() {
    start_[0] = -std::numeric_limits<double>::infinity();
    start_[kNumAgeBins] = std::numeric_limits<double>::infinity();
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
      if (!(start_[k] > start_[k - 1]) || first_guess(start_[k]) < k) exact_ = false;
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

  // A bin at or above x's: its octave's last bin plus two (x >= 1, so the exponent >= 0).
  static int first_guess(double x) noexcept {
    const int exponent = static_cast<int>((bits(x) >> 52) & 0x7ff) - 1023;
    if (exponent < 0) return 0;
    return exponent >= 30 ? kNumAgeBins - 1 : kBinsPerOctave * exponent + 5;
  }

  double start_[kNumAgeBins + 1];  // start_[k]: the smallest x in bin k; [128] = infinity
  bool exact_;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_HAZARD_BINS_H_
