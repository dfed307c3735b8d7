// auto's use counts (policies/auto_sketch.py): a count-min sketch of block hashes, 4 rows
// of one-byte counters saturating at 15, conservative update, every count halved each
// sample_ratio x pool uses. Row r's counter for hash h is the top log2(width) bits of
// (h mod 2**64) * multiplier[r] mod 2**64: uint64 arithmetic gives the Python ints' values.
#include <algorithm>

#include "auto.h"

namespace prefixcache {

void AutoPolicy::resize_sketch(int64_t pool) {
  // Size the sketch for ``pool`` blocks, keeping every count (a wider row repeats them).
  // The Python class counts up from 1; the pool only grows, so from width_ is the same.
  int64_t width = width_;
  while (static_cast<double>(width) < options_.sketch_ratio * static_cast<double>(pool)) {
    width *= 2;
  }
  const double sample = options_.sample_ratio * static_cast<double>(pool);
  sample_ = std::max<int64_t>(1, sample >= 9.0e18 ? INT64_C(9000000000000000000)
                                                  : static_cast<int64_t>(sample));
  if (width <= width_) return;
  // Indices are the top bits of a 64-bit product: one more bit splits each old counter in
  // two, so each new counter starts at the count of the old one it came from.
  const int64_t factor = width / width_;
  std::vector<uint8_t> grown(static_cast<size_t>(kAutoRows * width));
  if (factor == 2) {  // the pool grows a block at a time: the width doubles (vectorizes)
    const size_t old_size = sketch_.size();
    for (size_t i = 0; i < old_size; ++i) grown[2 * i] = grown[2 * i + 1] = sketch_[i];
  } else {
    size_t at = 0;
    for (const uint8_t counter : sketch_) {  // row by row, each old counter factor times
      for (int64_t copy = 0; copy < factor; ++copy) grown[at++] = counter;
    }
  }
  sketch_.swap(grown);
  width_ = width;
  int bits = 0;
  for (int64_t w = width; w > 1; w >>= 1) ++bits;
  shift_ = 64 - bits;
}

uint8_t AutoPolicy::locate(int64_t block_hash, size_t* at) const noexcept {
  // Each row's counter of ``block_hash`` (into ``at``); the least of them.
  // shift_ is in [1, 64]: two shifts, since a shift by 64 is undefined in C++.
  const auto key = static_cast<uint64_t>(block_hash);
  const auto width = static_cast<size_t>(width_);
  const int shift = shift_ - 1;
  const uint8_t* const counters = sketch_.data();
  uint8_t least = kAutoMaxCount;
  for (int row = 0; row < kAutoRows; ++row) {
    const uint64_t product = key * options_.multipliers[row];
    at[row] = static_cast<size_t>(row) * width + static_cast<size_t>((product >> 1) >> shift);
    least = std::min(least, counters[at[row]]);
  }
  return least;
}

int64_t AutoPolicy::uses(int64_t block_hash) const noexcept {
  size_t at[kAutoRows];
  return locate(block_hash, at);
}

void AutoPolicy::halve() noexcept {
  for (uint8_t& counter : sketch_) counter >>= 1;
}

int64_t AutoPolicy::count_at(const size_t* at, int64_t least, int64_t num_uses) {
  // Add ``num_uses`` to the counters ``at`` whose least is ``least`` (locate: conservative
  // update); halve all when due. The uses afterwards.
  int64_t target = std::min<int64_t>(least + num_uses, kAutoMaxCount);
  uint8_t* const counters = sketch_.data();
  for (int row = 0; row < kAutoRows; ++row) {
    if (counters[at[row]] < target) counters[at[row]] = static_cast<uint8_t>(target);
  }
  added_ += num_uses;
  if (added_ >= sample_) {
    halve();
    added_ /= 2;  // non-negative: floor division
    target >>= 1;  // the minimum of halved counters is the halved minimum
  }
  return target;
}

int64_t AutoPolicy::count(int64_t block_hash, int64_t num_uses) {
  // Add ``num_uses`` (conservative update); halve all when due. The uses afterwards.
  size_t at[kAutoRows];
  const uint8_t least = locate(block_hash, at);
  return count_at(at, least, num_uses);
}

void AutoPolicy::count_run(const int64_t* hashes, size_t count) {
  // count(h, 1) for each hash of a registration run.
  int64_t added = added_;
  for (size_t i = 0; i < count; ++i) {
    size_t at[kAutoRows];
    const int target = locate(hashes[i], at) + 1;
    if (target <= kAutoMaxCount) {
      uint8_t* const counters = sketch_.data();
      for (int row = 0; row < kAutoRows; ++row) {
        if (counters[at[row]] < target) counters[at[row]] = static_cast<uint8_t>(target);
      }
    }
    if (++added >= sample_) {
      halve();
      added /= 2;
    }
  }
  added_ = added;
}

int64_t AutoPolicy::uses_after(int64_t least, int64_t new_uses) const noexcept {
  // What a hash's uses would be after count(hash, new_uses), ``least`` its locate(); no
  // change.
  int64_t estimate = least;
  if (new_uses > 0) {
    estimate = std::min<int64_t>(estimate + new_uses, kAutoMaxCount);
    if (added_ + new_uses >= sample_) estimate >>= 1;
  }
  return estimate;
}

}  // namespace prefixcache
