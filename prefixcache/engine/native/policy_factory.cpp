// make_policy: every built-in native policy by name (see policy.h).
//
// One line a policy: its name and the function in native/policies/NAME.cpp that builds it.
#include <algorithm>
#include <cmath>
#include <string>
#include <stdexcept>

#include "policy.h"
#include "policies/factories.h"

namespace prefixcache {

namespace {

struct Entry {
  const char* name;
  std::unique_ptr<Policy> (*make)(int32_t num_blocks, const PolicyOptions& options);
};

const Entry kPolicies[] = {
    {"arc", make_arc_policy},
    {"auto", make_auto_policy},
    {"fifo", make_fifo_policy},
    {"hazard", make_hazard_policy},
    {"lfu", make_lfu_policy},
    {"lru", make_lru_policy},
    {"priority", make_priority_policy},
    {"protected_lru", make_protected_lru_policy},
    {"reuse_lru", make_reuse_lru_policy},
    {"s3fifo", make_s3fifo_policy},
    {"slru", make_slru_policy},
};

}  // namespace

double PolicyOptions::get(const std::string& name, double fallback) const {
  for (const auto& [key, value] : values_) {
    if (key == name) {
      used_.push_back(name);
      return value;
    }
  }
  return fallback;
}

int64_t PolicyOptions::get_int(const std::string& name, int64_t fallback,
                               int64_t minimum) const {
  const double value = get(name, static_cast<double>(fallback));
  if (!(value >= static_cast<double>(minimum)) || value != std::floor(value) || value > 9.0e18) {
    throw std::invalid_argument(name + " must be an int >= " + std::to_string(minimum) +
                                ", got " + std::to_string(value));
  }
  return static_cast<int64_t>(value);
}

std::string PolicyOptions::unused() const {
  std::string names;
  for (const auto& entry : values_) {
    if (std::find(used_.begin(), used_.end(), entry.first) != used_.end()) continue;
    names += (names.empty() ? "" : ", ") + entry.first;
  }
  return names;
}

std::unique_ptr<Policy> make_policy(const std::string& name, int32_t num_blocks,
                                    const PolicyOptions& options) {
  for (const Entry& entry : kPolicies) {
    if (name != entry.name) continue;
    std::unique_ptr<Policy> policy = entry.make(num_blocks, options);
    const std::string unused = options.unused();
    if (!unused.empty()) {
      throw std::invalid_argument("policy " + name + " has no option(s) " + unused);
    }
    return policy;
  }
  throw std::invalid_argument("no native policy named " + name);
}

std::vector<std::string> native_policy_names() {
  std::vector<std::string> names;
  for (const Entry& entry : kPolicies) names.emplace_back(entry.name);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace prefixcache
