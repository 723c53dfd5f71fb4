#pragma once
// Training text for the demo: a generator of English-like sentences from a small grammar (with
// agreement, articles and clause structure, so a character-level model has real patterns to
// learn), a character tokenizer, and the per-rank batch sampler (each rank draws its windows
// from its own slice of the text: data parallelism).

#include <cstdint>
#include <string>
#include <vector>

namespace zsdemo {

/// Deterministic 64-bit generator (splitmix64): the same seed gives the same stream on every
/// platform, which the ranks rely on to build identical corpora and initial weights.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, n).
  uint64_t below(uint64_t n) { return next() % n; }
  /// Uniform in [0, 1).
  double uniform() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }
  /// Standard normal (Box–Muller): two draws of next() per value.
  double normal();
  /// Skips n draws of next(), in O(1) (the state is a counter): a generator that skipped 2·k
  /// draws gives the normal() values a fresh one gives from the k-th on.
  void discard(uint64_t n) { s_ += n * 0x9E3779B97F4A7C15ull; }

 private:
  uint64_t s_;
};

/// About `chars` characters of generated sentences (paragraphs separated by newlines).
std::string generate_corpus(uint64_t seed, int64_t chars);

/// Character-level tokenizer whose vocabulary is the sorted set of bytes in a text.
class CharTokenizer {
 public:
  explicit CharTokenizer(const std::string& text);
  int vocab_size() const { return int(chars_.size()); }
  std::vector<int32_t> encode(const std::string& text) const;  ///< throws on unknown bytes
  std::string decode(const std::vector<int32_t>& ids) const;
  std::string decode(int32_t id) const;

 private:
  std::string chars_;   // id → byte
  int32_t index_[256];  // byte → id, −1 if absent
};

/// A batch of windows: inputs[b·T + t] and targets (the next token) of the same shape.
struct Batch {
  std::vector<int32_t> inputs, targets;
};

/// Draws training windows from this rank's slice of the first 95 % of the tokens; the last 5 %
/// is held out for validation, also split by rank.
class BatchSampler {
 public:
  /// Throws std::invalid_argument if a rank's slice is shorter than a window.
  BatchSampler(std::vector<int32_t> tokens, int rank, int world, int64_t seq, uint64_t seed);
  Batch next_train(int64_t batch);
  /// The same `batch` validation windows every call (evenly spaced in this rank's slice).
  Batch validation(int64_t batch) const;
  int64_t train_tokens_per_rank() const { return train_end_ - train_begin_; }

 private:
  Batch window(const std::vector<int64_t>& starts) const;
  std::vector<int32_t> tokens_;
  int64_t seq_;
  int64_t train_begin_, train_end_, val_begin_, val_end_;
  Rng rng_;
};

}  // namespace zsdemo
