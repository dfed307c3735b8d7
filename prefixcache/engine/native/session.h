// SessionState: a conversation's chain between turns, native (issue 27; DESIGN.md, "Sessions").
//
// The C++ twin of prefixcache/engine/python_session.py's Session, for the fused path (the native
// engine with xxh3_64 chains from the facade's root and no collaborator watching): the
// hashes of the conversation's full blocks, the blocks that held them (the block-table row,
// grown in place by doubling), the tokens of the partial last block, the allocator's
// structure key at the last release and each remembered block's registration generation.
// A turn composes exactly the engine calls the Python Session composes, in the same order
// (lookup, take_hit, allocate, register_chain, release), so the engine's state after every step is the Python Session's; one native call a step
// spares the dozen Python-level calls.
//
// Every check precedes the first engine write (take_hit's, allocate's or release's own
// checks included), so a refused step changes nothing, the session included; the one
// exception is the Python Session's too (append's registration under a parent hash that
// was evicted after its registration was refused: see session.cpp). Not thread-safe.

#ifndef PREFIXCACHE_ENGINE_NATIVE_SESSION_H_
#define PREFIXCACHE_ENGINE_NATIVE_SESSION_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine.h"

namespace prefixcache {

/// What changes whenever a block may have lost its hash or moved: the facade's layout
/// epoch (bumped on reset and relocation) and the engine's eviction and drop counters.
struct StructureKey {
  int64_t epoch = 0, evicted = 0, dropped = 0;
  bool operator==(const StructureKey& other) const noexcept {
    return epoch == other.epoch && evicted == other.evicted && dropped == other.dropped;
  }
};

class SessionState {
 public:
  SessionState(size_t block_size, uint64_t root) : block_size_(block_size), root_(root) {}

  /// Start a turn: the conversation so far plus ``tokens`` (count >= 1). Returns the blocks
  /// served from the cache. Throws EngineError (nothing changed) when a turn runs or the
  /// pool cannot hold the prompt.
  int64_t admit(Engine& engine, int64_t epoch, const int32_t* tokens, size_t count);
  /// admit, whose capacity check also covers ``reserve`` tokens after the prompt (a
  /// response to come: turn's, or a caller running a turn's steps apart).
  int64_t admit_reserving(Engine& engine, int64_t epoch, const int32_t* tokens, size_t count,
                          size_t reserve);
  /// admit(tokens), append(response) (count >= 1 each), release() as one step: the capacity
  /// check covers both, so a refused turn changes nothing. Returns admit's hits.
  int64_t turn(Engine& engine, int64_t epoch, const int32_t* tokens, size_t count,
               const int32_t* response, size_t response_count);
  /// Add decoded tokens (count >= 1) to the running turn; blocks that fill are registered.
  void append(Engine& engine, const int32_t* tokens, size_t count);
  /// End the running turn: drop its references; remember the structure key and the
  /// generations of the blocks the turn added.
  void release(Engine& engine, int64_t epoch);

  /// The conversation ended (no turn running): free the cached leaves among the blocks
  /// after the first turn's hits, tail-first; the session starts over. Returns how many.
  int64_t end(Engine& engine);
  /// Throws BlockStateError unless a turn runs (``running``) or none does: what admit
  /// (false) and append (true) check first, before their tokens are read.
  void expect_running(bool running) const;
  bool running() const noexcept { return num_held_ > 0; }
  int64_t num_tokens() const noexcept { return num_tokens_; }
  size_t num_held() const noexcept { return num_held_; }
  const int32_t* ids() const noexcept { return ids_.data(); }
  /// The chained hashes of the conversation's full blocks (num_tokens / block_size).
  const std::vector<int64_t>& hashes() const noexcept { return hashes_; }
  /// Tokens hashed and hashes looked up so far (what a turn's cost follows).
  int64_t num_hashed_tokens() const noexcept { return num_hashed_tokens_; }
  int64_t num_looked_up() const noexcept { return num_looked_up_; }
  /// Scratch for turn's response while its prompt is read (the binding fills it).
  std::vector<int32_t>& reply() noexcept { return reply_; }

 private:
  static StructureKey key_of(const Engine& engine, int64_t epoch) noexcept {
    const Counters& counters = engine.counters();
    return StructureKey{epoch, counters.num_evicted, counters.num_dropped};
  }
  /// How many leading remembered blocks still hold the chain (the row was trusted at the
  /// last release and the layout epoch is unchanged): the tail's registration generation
  /// unchanged means all (the leaf rule: no ancestor leaves while a descendant stays), else
  /// a binary search (validity is prefix-closed). O(1), O(log n) when the tail was lost.
  size_t valid_prefix(const Engine& engine) const noexcept;
  /// ``pending_`` then ``tokens`` as one run (``pending_`` empty: ``tokens`` itself).
  const int32_t* joined(const int32_t* tokens, size_t count);
  /// The new full blocks' hashes of ``prompt`` (``length`` tokens) into ``new_hashes_``.
  void hash_new_blocks(const int32_t* prompt, size_t length);
  /// The chain's hash at ``index`` (remembered, then the turn's new ones).
  int64_t chain_hash(size_t index) const noexcept {
    return index < hashes_.size() ? hashes_[index] : new_hashes_[index - hashes_.size()];
  }
  /// The chain's hashes ``first..stop-1`` as one run (into ``query_`` when they straddle).
  const int64_t* chain_run(size_t first, size_t stop);
  /// Register ``count`` blocks of the row from ``first`` (chain positions ``first..``).
  void register_run(Engine& engine, size_t first, size_t count, const int64_t* hashes);
  void grow(size_t num_blocks);

  const size_t block_size_;
  const uint64_t root_;
  std::vector<int64_t> hashes_;  // chained hashes of the full blocks so far
  std::vector<int32_t> ids_;     // their blocks, then the turn's partial one (capacity)
  std::vector<int32_t> pending_;  // tokens of the partial last block
  int64_t num_tokens_ = 0;
  size_t num_held_ = 0;  // blocks the running turn references (0: idle)
  size_t pinned_ = 0;    // the running turn's pinned chain length (0: full references)
  size_t shared_ = 0;    // blocks the first turn hit (maybe shared prefixes): end() keeps them
  bool has_key_ = false;  // key_ holds the structure key at the last release
  StructureKey key_;
  // The per-session check (valid_prefix): the registration generation of each remembered
  // block, read while the turn held it, for the first recorded_ blocks; trusted_: every
  // remembered block carried its hash at the last release, under layout epoch epoch_.
  std::vector<int64_t> generations_;
  size_t recorded_ = 0;
  bool trusted_ = false;
  int64_t epoch_ = 0;
  bool refused_ = false;  // a registration of this turn was refused (hash held elsewhere)
  int64_t num_hashed_tokens_ = 0, num_looked_up_ = 0;
  // Scratch, reused across turns.
  std::vector<int32_t> prompt_, context_, reply_;
  std::vector<int64_t> new_hashes_, query_;
  std::vector<uint8_t> flags_;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_SESSION_H_
