// The factory of each built-in native policy, one a file in this folder (policy_factory.cpp
// lists them by name). Each throws std::invalid_argument for an option out of range, with
// the Python class's message.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_FACTORIES_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_FACTORIES_H_

#include <memory>

#include "../policy.h"

namespace prefixcache {

std::unique_ptr<Policy> make_auto_policy(int32_t num_blocks, const PolicyOptions& options);
std::unique_ptr<Policy> make_arc_policy(int32_t num_blocks, const PolicyOptions& options);
std::unique_ptr<Policy> make_fifo_policy(int32_t num_blocks, const PolicyOptions& options);
std::unique_ptr<Policy> make_hazard_policy(int32_t num_blocks, const PolicyOptions& options);
std::unique_ptr<Policy> make_lfu_policy(int32_t num_blocks, const PolicyOptions& options);
std::unique_ptr<Policy> make_lru_policy(int32_t num_blocks, const PolicyOptions& options);
std::unique_ptr<Policy> make_priority_policy(int32_t num_blocks, const PolicyOptions& options);
std::unique_ptr<Policy> make_protected_lru_policy(int32_t num_blocks,
                                                  const PolicyOptions& options);
std::unique_ptr<Policy> make_reuse_lru_policy(int32_t num_blocks, const PolicyOptions& options);
std::unique_ptr<Policy> make_s3fifo_policy(int32_t num_blocks, const PolicyOptions& options);
std::unique_ptr<Policy> make_slru_policy(int32_t num_blocks, const PolicyOptions& options);

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_FACTORIES_H_
