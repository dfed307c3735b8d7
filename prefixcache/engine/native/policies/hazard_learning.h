// HazardLearning: the learning half of hazard (policies/hazard_learning.py): per class, the
// blocks that entered it and the reuses seen per age bin, decayed and summed into
// cumulative tables every 256 events, and the hazard score of a leaf at an age.
//
// Every count, refresh and score repeats the Python mixin's double arithmetic in its
// order; what differs is only what is skipped or kept, where skipping gives the same
// numbers:
// - The tables are by age bin, then class, so a refresh runs the 32 classes' running
//   sums side by side (each still adds its own bins in order) and adds each pooled entry
//   over the classes in order, four entries at a time.
// - A refresh stops at the highest bin any reuse was recorded in: above it every reuse
//   count is 0 and every table row equals the last one computed, so reads clamp to that
//   row (rows_) instead of the rows being written.
// - A class's score depends on the age only through two bins, so it is kept with them and
//   computed again only when either bin changes, the class's count changes (enter) or the
//   tables refresh; the bins are kept across the last two (they depend on the ages alone).
// Not thread-safe.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_HAZARD_LEARNING_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_HAZARD_LEARNING_H_

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>

#include "hazard_bins.h"

namespace prefixcache {

template <int kNumClasses>
class HazardLearning {
 public:
  static constexpr int kNumAgeBins = HazardAgeBins::kNumAgeBins;
  static constexpr int64_t kRefreshEvents = 256;

  HazardLearning(double decay, double prior_weight, double window)
      : decay_(decay), prior_weight_(prior_weight), window_(window) {
    clear();
  }

  /// Forget every statistic: no class has seen a block.
  void clear() noexcept {
    std::fill(std::begin(entered_), std::end(entered_), 0.0);
    for (auto& reuses : reuses_) std::fill(std::begin(reuses), std::end(reuses), 0.0);
    for (auto& cumulative : cumulative_) {
      std::fill(std::begin(cumulative), std::end(cumulative), 0.0);
    }
    std::fill(std::begin(pooled_), std::end(pooled_), 0.0);
    for (Scored& scored : scored_) scored.forget();
    used_bins_ = rows_ = 0;
    events_ = 0;
    lifetime_ = 0.0;
  }

  /// Count a block entering ``klass`` (an event).
  void enter(int klass) {
    entered_[klass] += 1.0;
    scored_[klass].fresh = false;
    tick();
  }

  /// Count a reuse of ``klass`` at ``age`` (clamped at 0).
  void record_reuse(int klass, int64_t age) noexcept {
    const int bin = bins_.bin(static_cast<double>(std::max<int64_t>(age, 0)) + 1.0);
    reuses_[bin][klass] += 1.0;
    used_bins_ = std::max(used_bins_, bin + 1);
  }

  /// A victim left after ``idle_age`` ticks: move the running cache lifetime (an event).
  void evicted(int64_t idle_age, double smoothing) {
    lifetime_ += (static_cast<double>(idle_age) - lifetime_) * smoothing;
    tick();
  }

  /// window x lifetime: the horizon the scores look ahead, for score().
  double reach() const noexcept { return window_ * lifetime_; }

  /// Python's _score(klass, age) with ``reach`` = reach().
  double score(int klass, double age, double reach) noexcept {
    const double x = age + 1.0;
    const double y = (age + reach) + 1.0;
    Scored& scored = scored_[klass];
    if (scored.x_low <= x && x < scored.x_high && scored.y_low <= y && y < scored.y_high) {
      if (scored.fresh) return scored.score;
    } else {
      scored.low = bins_.bin(x);
      scored.high = bins_.bin(y) + 1;
      bins_.range(scored.low, scored.x_low, scored.x_high);
      bins_.range(scored.high - 1, scored.y_low, scored.y_high);
    }
    const int low_row = std::min(scored.low, rows_), high_row = std::min(scored.high, rows_);
    const double reused_in_window =
        cumulative_[high_row][klass] - cumulative_[low_row][klass] +
        prior_weight_ * (pooled_[high_row] - pooled_[low_row]);
    const double survivors = entered_[klass] - cumulative_[low_row][klass] +
                             prior_weight_ * (1.0 - pooled_[low_row]);
    scored.score = survivors > 0 ? reused_in_window / survivors : 0.0;
    scored.fresh = true;
    return scored.score;
  }

 private:
  // A class's two bins, valid while age + 1 and age + reach + 1 stay in [x_low, x_high) and
  // [y_low, y_high) (the bins depend on nothing else), and its score at them while fresh
  // (until the class's count changes or the tables refresh).
  struct Scored {
    double x_low, x_high, y_low, y_high;
    double score;
    int low, high;  // bin of age + 1, and 1 + bin of age + reach + 1
    bool fresh;
    void forget() noexcept {
      x_low = std::numeric_limits<double>::infinity();
      fresh = false;
    }
  };

  void tick() {
    if (++events_ % kRefreshEvents == 0) refresh();
  }

  // Decay the counts and rebuild the cumulative tables (Python's _refresh).
  void refresh() noexcept {
    double total_entered = 0.0;
    for (int klass = 0; klass < kNumClasses; ++klass) {
      entered_[klass] *= decay_;
      total_entered += entered_[klass];
    }
    double running[kNumClasses] = {};
    for (int bin = 0; bin < used_bins_; ++bin) {
      double* reuses = reuses_[bin];
      double* cumulative = cumulative_[bin + 1];
      for (int klass = 0; klass < kNumClasses; ++klass) {
        reuses[klass] *= decay_;
        running[klass] += reuses[klass];
        cumulative[klass] = running[klass];
      }
    }
    rows_ = used_bins_;
    const double scale = total_entered > 0 ? 1.0 / total_entered : 0.0;
    pooled_[0] = 0.0 * scale;
    int row = 1;
    for (; row + 3 <= rows_; row += 4) {
      double sum0 = 0.0, sum1 = 0.0, sum2 = 0.0, sum3 = 0.0;
      for (int klass = 0; klass < kNumClasses; ++klass) {
        sum0 += cumulative_[row][klass];
        sum1 += cumulative_[row + 1][klass];
        sum2 += cumulative_[row + 2][klass];
        sum3 += cumulative_[row + 3][klass];
      }
      pooled_[row] = sum0 * scale;
      pooled_[row + 1] = sum1 * scale;
      pooled_[row + 2] = sum2 * scale;
      pooled_[row + 3] = sum3 * scale;
    }
    for (; row <= rows_; ++row) {
      double sum = 0.0;
      for (int klass = 0; klass < kNumClasses; ++klass) sum += cumulative_[row][klass];
      pooled_[row] = sum * scale;
    }
    for (Scored& scored : scored_) scored.fresh = false;
  }

  const double decay_;
  const double prior_weight_;
  const double window_;
  const HazardAgeBins& bins_ = HazardAgeBins::get();
  double entered_[kNumClasses];                      // blocks that entered each class
  double reuses_[kNumAgeBins][kNumClasses];          // reuses by age bin, then class
  double cumulative_[kNumAgeBins + 1][kNumClasses];  // [b][c]: reuses of c at bins < b
  double pooled_[kNumAgeBins + 1];                   // all classes, per entered block
  Scored scored_[kNumClasses];
  int used_bins_;  // bins at or above hold no reuse
  int rows_;       // table rows above this one equal it (as of the last refresh)
  int64_t events_;
  double lifetime_;  // running mean idle age of victims
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_HAZARD_LEARNING_H_
