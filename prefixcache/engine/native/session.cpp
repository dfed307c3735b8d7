// SessionState (session.h): a session's turn composed of the engine's calls, in the order
// and with the arguments of prefixcache/engine/python_session.py's Session (its fused-path
// branch: no collaborator watches, prefix caching on). Each step names the Python lines it
// mirrors; the differential tests in tests/engine/test_sessions.py run both side by side.

#include "session.h"

#include <algorithm>
#include <string>

#include "block_hashing.h"

namespace prefixcache {
namespace {

[[noreturn]] void refuse(ErrorKind kind, std::string message) {
  throw EngineError{kind, std::move(message)};
}

}  // namespace

void SessionState::expect_running(bool running) const {
  if (running && !num_held_) {
    refuse(ErrorKind::kBlockState, "no turn of this session is running; admit() one first");
  }
  if (!running && num_held_) {
    refuse(ErrorKind::kBlockState, "a turn of this session is running; release() it first");
  }
}

const int32_t* SessionState::joined(const int32_t* tokens, size_t count) {
  if (pending_.empty()) return tokens;
  prompt_.assign(pending_.begin(), pending_.end());
  prompt_.insert(prompt_.end(), tokens, tokens + count);
  return prompt_.data();
}

void SessionState::hash_new_blocks(const int32_t* prompt, size_t length) {
  const size_t count = length / block_size_;
  new_hashes_.resize(count);
  if (!count) return;  // Python hashes only a prompt of a full block or more
  const uint64_t parent = hashes_.empty() ? root_ : static_cast<uint64_t>(hashes_.back());
  chain_block_hashes(prompt, length, block_size_, parent,
                     reinterpret_cast<uint64_t*>(new_hashes_.data()));
  num_hashed_tokens_ += static_cast<int64_t>(length);
}

const int64_t* SessionState::chain_run(size_t first, size_t stop) {
  const size_t known = hashes_.size();
  if (first >= known) return new_hashes_.data() + (first - known);
  if (stop <= known) return hashes_.data() + first;
  query_.assign(hashes_.begin() + static_cast<std::ptrdiff_t>(first), hashes_.end());
  query_.insert(query_.end(), new_hashes_.begin(),
                new_hashes_.begin() + static_cast<std::ptrdiff_t>(stop - known));
  return query_.data();
}

void SessionState::register_run(Engine& engine, size_t first, size_t count,
                                const int64_t* hashes) {
  flags_.resize(2 * count);
  const bool has_parent = first > 0;
  engine.register_chain(ids_.data() + first, hashes, count, has_parent,
                        has_parent ? chain_hash(first - 1) : 0, flags_.data(),
                        flags_.data() + count);
  for (size_t i = 0; i < count && !refused_; ++i) refused_ = !flags_[i];
}

void SessionState::grow(size_t num_blocks) {
  if (num_blocks > ids_.size()) {
    ids_.resize(std::max({num_blocks, 2 * ids_.size(), size_t{16}}));
    generations_.resize(ids_.size());
  }
}

size_t SessionState::valid_prefix(const Engine& engine) const noexcept {
  // Block i is valid when its registration is the one read while a turn held it. The leaf
  // rule (every deregistration takes a leaf or a whole subtree) keeps a valid block's parent
  // registered, and a parent set at registration moves only with relocation (the epoch):
  // valid(i) implies valid(i - 1), so the tail decides for all, and a binary search finds
  // the first invalid block otherwise. Generations are given once, so a chain evicted and
  // recomputed with its tail on the old ID fails here (a hash_of check would pass).
  const auto valid = [&](size_t i) { return engine.registration_of(ids_[i]) == generations_[i]; };
  const size_t known = recorded_;
  if (valid(known - 1)) return known;
  size_t low = 0, high = known - 1;  // blocks before low valid, block high not
  while (low < high) {
    const size_t middle = low + (high - low) / 2;
    if (valid(middle)) {
      low = middle + 1;
    } else {
      high = middle;
    }
  }
  return low;
}

int64_t SessionState::admit(Engine& engine, int64_t epoch, const int32_t* tokens,
                            size_t count) {
  return admit_reserving(engine, epoch, tokens, count, 0);
}

int64_t SessionState::turn(Engine& engine, int64_t epoch, const int32_t* tokens, size_t count,
                           const int32_t* response, size_t response_count) {
  // The Python Session.turn: admit with the response's blocks in the capacity check, so the
  // append after it finds room (the room only shrinks by what the admit took).
  const int64_t num_hit = admit_reserving(engine, epoch, tokens, count, response_count);
  append(engine, response, response_count);
  release(engine, epoch);
  return num_hit;
}

int64_t SessionState::admit_reserving(Engine& engine, int64_t epoch, const int32_t* tokens,
                                      size_t count, size_t reserve) {
  expect_running(false);
  const size_t size = block_size_;
  const int32_t* prompt = joined(tokens, count);
  const size_t prompt_length = pending_.size() + count;
  const size_t num_tokens = static_cast<size_t>(num_tokens_) + count;
  hash_new_blocks(prompt, prompt_length);
  const size_t known = hashes_.size();
  const size_t num_matchable = (num_tokens - 1) / size;
  const size_t num_blocks = (num_tokens + size - 1) / size;
  grow(num_blocks);  // capacity only: the remembered row is untouched
  // The remembered blocks still holding the chain: all when nothing was evicted, dropped,
  // relocated or reset since the last release (the structure key); else the per-session
  // check (valid_prefix; none when the row was not trusted or the layout moved).
  size_t base = known;
  if (known && !(has_key_ && key_ == key_of(engine, epoch))) {
    base = trusted_ && epoch_ == epoch ? valid_prefix(engine) : 0;
  }
  // The hits as one run, in the row: the lookups write past the valid prefix, over
  // remembered blocks known stale (validity is prefix-closed, and a found block cannot carry
  // a lost one's generation), so a refused turn leaves the session meaning what it did.
  int32_t* hit = ids_.data();
  size_t num_hit = base;
  if (num_matchable > base) {
    const int64_t* query = chain_run(base, num_matchable);
    num_hit += engine.lookup(query, num_matchable - base, hit + base);
    num_looked_up_ += static_cast<int64_t>(num_matchable - base);
  }
  const int64_t needed = static_cast<int64_t>(num_blocks - num_hit);
  // What the capacity check covers: the prompt's blocks, and a turn's response beside them.
  const int64_t wanted = static_cast<int64_t>((num_tokens + reserve + size - 1) / size - num_hit);
  if (wanted > engine.num_free()) {  // else no eviction: no need to count the cached hits
    // At most the room (see room_beside in pins.py); the exact count only when pinned
    // chains' lengths could make the difference.
    int64_t room = engine.num_free() + engine.num_cached() - static_cast<int64_t>(num_hit);
    if (wanted > room - engine.pin_bound()) {
      int64_t cached_hits = 0;
      for (size_t i = 0; i < num_hit; ++i) {
        cached_hits += engine.active_refs(hit[i]) == 0 && engine.paused_refs(hit[i]) == 0;
      }
      room = engine.num_free() + engine.num_cached() - cached_hits;
      if (engine.pin_bound() && wanted > room - engine.pin_bound()) {
        room = engine.reclaimable(hit, num_hit);
      }
    }
    if (wanted > room) {
      refuse(ErrorKind::kCapacity, "the turn needs " + std::to_string(wanted) + " blocks; " +
                                       std::to_string(room) + " can be freed");
    }
  }
  // The first write: take_hit checks (free blocks, reference headroom) before its own. The
  // chain pin (engine_pins.cpp): the tail's reference stands for one on each hit block.
  const size_t pinned = num_hit > 1 && engine.can_pin() ? num_hit : 0;
  if (pinned) {
    engine.pin_chain(hit[num_hit - 1], static_cast<int64_t>(num_hit),
                     static_cast<int64_t>(num_matchable));
  } else {
    engine.take_hit(hit, num_hit, static_cast<int64_t>(num_matchable), true);
  }
  recorded_ = base;  // the blocks after it get their generations at release
  engine.allocate(needed, ids_.data() + num_hit);  // room was checked
  const size_t num_full = known + new_hashes_.size();
  if (num_full > num_hit) register_run(engine, num_hit, num_full - num_hit, chain_run(num_hit, num_full));
  if (known == 0) shared_ = num_hit;  // the first turn's hits: kept by end()
  hashes_.insert(hashes_.end(), new_hashes_.begin(), new_hashes_.end());
  num_tokens_ = static_cast<int64_t>(num_tokens);
  pending_.assign(prompt + new_hashes_.size() * size, prompt + prompt_length);
  num_held_ = num_blocks;
  pinned_ = pinned;
  return static_cast<int64_t>(num_hit);
}

void SessionState::append(Engine& engine, const int32_t* tokens, size_t count) {
  expect_running(true);
  const size_t size = block_size_;
  const int32_t* pending = joined(tokens, count);
  const size_t pending_length = pending_.size() + count;
  const size_t num_tokens = static_cast<size_t>(num_tokens_) + count;
  const int64_t needed = static_cast<int64_t>((num_tokens + size - 1) / size - num_held_);
  bool short_of_room = needed > engine.num_free();
  if (short_of_room) {  // room_beside (pins.py): the bound, else the exact count
    const int64_t room = engine.num_free() + engine.num_cached();
    const int64_t bound = engine.pin_bound();
    short_of_room = needed > (!bound || needed <= room - bound ? room : engine.reclaimable(nullptr, 0));
  }
  if (short_of_room) {
    refuse(ErrorKind::kCapacity,
           "the tokens need " + std::to_string(needed) + " more blocks; the pool is short");
  }
  hash_new_blocks(pending, pending_length);
  if (needed) {
    grow(num_held_ + static_cast<size_t>(needed));
    engine.allocate(needed, ids_.data() + num_held_);
    num_held_ += static_cast<size_t>(needed);
  }
  const size_t num_filled = new_hashes_.size();
  const size_t known = hashes_.size();
  if (num_filled && known && engine.block_of(hashes_.back()) < 0) {
    // The parent hash is gone (this turn's registration of it was refused and its holder
    // evicted since): the filled blocks stay unregistered and the next turn looks up again.
    refused_ = true;
  } else if (num_filled) {
    register_run(engine, known, num_filled, new_hashes_.data());
  }
  hashes_.insert(hashes_.end(), new_hashes_.begin(), new_hashes_.end());
  pending_.assign(pending + num_filled * size, pending + pending_length);
  num_tokens_ = static_cast<int64_t>(num_tokens);
}

void SessionState::release(Engine& engine, int64_t epoch) {
  if (!num_held_) refuse(ErrorKind::kBlockState, "no turn of this session is running");
  const StructureKey before = key_of(engine, epoch);
  // The generations of the blocks this turn added to the chain, read while it holds them
  // (O(new + looked-up blocks)); a refused registration leaves the row untrusted.
  const size_t known = hashes_.size();
  if (!refused_) {
    for (size_t i = recorded_; i < known; ++i) generations_[i] = engine.registration_of(ids_[i]);
  }
  if (pinned_) {  // the tail stands for its chain: release it and the turn's blocks
    engine.release_pinned(ids_.data() + pinned_ - 1, num_held_ - pinned_ + 1,
                          static_cast<int64_t>(pinned_));
  } else {
    engine.release(ids_.data(), num_held_, false);  // checks the counts before it writes
  }
  num_held_ = pinned_ = 0;
  const StructureKey after = key_of(engine, epoch);
  // The next turn trusts the remembered blocks only if this release dropped none of them
  // and every block carries its hash; otherwise it looks the chain up again.
  has_key_ = before == after && !refused_;
  key_ = after;
  trusted_ = !refused_;
  recorded_ = trusted_ ? known : 0;
  epoch_ = epoch;
  refused_ = false;
}

int64_t SessionState::end(Engine& engine) {
  // The blocks after the first turn's hits, looked up (the hit counters do not move),
  // freed where they are cached leaves, tail-first (Engine::evict_blocks); then the
  // session starts over. The Python Session.end is the reference.
  expect_running(false);
  int64_t freed = 0;
  if (engine.retains_unreferenced() && hashes_.size() > shared_) {
    context_.resize(hashes_.size());
    const size_t found = engine.lookup(hashes_.data(), hashes_.size(), context_.data());
    if (found > shared_) freed = engine.evict_blocks(context_.data() + shared_, found - shared_);
  }
  hashes_.clear();
  pending_.clear();
  num_tokens_ = 0;
  shared_ = 0;
  has_key_ = trusted_ = false;
  recorded_ = 0;
  refused_ = false;
  return freed;
}

}  // namespace prefixcache
