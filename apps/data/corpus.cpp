#include "apps/data/corpus.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace zsdemo {

double Rng::normal() {
  // Box–Muller; 1 − u keeps the logarithm's argument in (0, 1].
  const double u = 1.0 - uniform(), v = uniform();
  return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
}

namespace {

struct Noun {
  const char* sg;
  const char* pl;
};
struct Verb {
  const char* third;  // "chases": after a singular subject
  const char* base;   // "chase": after a plural subject, and in questions
};

constexpr Noun kNouns[] = {
    {"cat", "cats"},       {"dog", "dogs"},     {"bird", "birds"},     {"fox", "foxes"},
    {"child", "children"}, {"mouse", "mice"},   {"farmer", "farmers"}, {"teacher", "teachers"},
    {"robot", "robots"},   {"horse", "horses"}, {"sailor", "sailors"}, {"queen", "queens"},
    {"wolf", "wolves"},    {"baker", "bakers"}, {"owl", "owls"},       {"artist", "artists"}};
constexpr const char* kAdjectives[] = {"small", "old",    "quick", "lazy",  "happy", "green",
                                       "quiet", "clever", "brave", "tired", "young", "angry"};
constexpr Verb kTransitive[] = {{"sees", "see"},       {"chases", "chase"}, {"likes", "like"},
                                {"follows", "follow"}, {"finds", "find"},   {"helps", "help"},
                                {"watches", "watch"},  {"feeds", "feed"},   {"visits", "visit"}};
constexpr Verb kIntransitive[] = {{"sleeps", "sleep"}, {"runs", "run"},     {"sings", "sing"},
                                  {"waits", "wait"},   {"laughs", "laugh"}, {"jumps", "jump"}};
constexpr const char* kPlaces[] = {"the river",     "the garden", "the market", "the hill",
                                   "the old house", "the forest", "the bridge"};
constexpr const char* kPrepositions[] = {"near", "behind", "in", "under", "beside"};
constexpr const char* kAdverbs[] = {"quietly", "slowly", "often", "today", "again"};
constexpr const char* kSingularDet[] = {"the", "a", "one", "every", "this"};
constexpr const char* kPluralDet[] = {"the", "two", "three", "some", "many", "these"};
constexpr const char* kTimes[] = {"in the morning", "at night", "after the rain", "every day"};

template <class T, size_t N>
const T& pick(Rng& r, const T (&a)[N]) {
  return a[r.below(N)];
}

bool starts_with_vowel(const std::string& w) {
  return !w.empty() && std::string("aeiou").find(w[0]) != std::string::npos;
}

// A noun phrase; `plural` decides agreement with its verb. "a" becomes "an" before a vowel,
// a rule the model can only learn by looking ahead one word.
std::string noun_phrase(Rng& r, bool plural) {
  std::string det = plural ? pick(r, kPluralDet) : pick(r, kSingularDet);
  std::string rest;
  if (r.below(2) == 0) rest = std::string(pick(r, kAdjectives)) + " ";
  const Noun& n = pick(r, kNouns);
  rest += plural ? n.pl : n.sg;
  if (det == "a" && starts_with_vowel(rest)) det = "an";
  return det + " " + rest;
}

std::string verb_phrase(Rng& r, bool plural) {
  if (r.below(3) == 0) {
    const Verb& v = pick(r, kIntransitive);
    std::string s = plural ? v.base : v.third;
    if (r.below(2) == 0) s += std::string(" ") + pick(r, kAdverbs);
    return s;
  }
  const Verb& v = pick(r, kTransitive);
  return std::string(plural ? v.base : v.third) + " " + noun_phrase(r, r.below(2) == 0);
}

std::string sentence(Rng& r) {
  const bool plural = r.below(2) == 0;
  std::string s;
  switch (r.below(6)) {
    case 0:  // a fronted time clause
      s = std::string(pick(r, kTimes)) + " , " + noun_phrase(r, plural) + " " +
          verb_phrase(r, plural);
      break;
    case 1:  // coordination keeps the subject's number across "and"
      s = noun_phrase(r, plural) + " " + verb_phrase(r, plural) + " and " + verb_phrase(r, plural);
      break;
    case 2: {  // a yes/no question and its answer, which repeats the question's nouns
      const std::string subj = noun_phrase(r, plural);
      const Verb& v = pick(r, kTransitive);
      const std::string obj = noun_phrase(r, r.below(2) == 0);
      s = std::string(plural ? "do " : "does ") + subj + " " + v.base + " " + obj + " ? ";
      if (r.below(2) == 0)
        s += "yes , " + subj + " " + (plural ? v.base : v.third) + " " + obj;
      else
        s +=
            std::string("no , ") + subj + (plural ? " do not " : " does not ") + v.base + " " + obj;
      break;
    }
    default:
      s = noun_phrase(r, plural) + " " + verb_phrase(r, plural);
      if (r.below(2) == 0) s += std::string(" ") + pick(r, kPrepositions) + " " + pick(r, kPlaces);
  }
  return s + " .";
}

}  // namespace

std::string generate_corpus(uint64_t seed, int64_t chars) {
  Rng r(seed ^ 0xC0A7B5E5u);
  std::string out;
  out.reserve(size_t(chars) + 256);
  while (int64_t(out.size()) < chars) {
    const int sentences = 2 + int(r.below(4));
    for (int i = 0; i < sentences; ++i) out += (i ? " " : "") + sentence(r);
    out += '\n';
  }
  return out;
}

CharTokenizer::CharTokenizer(const std::string& text) {
  bool seen[256] = {};
  for (unsigned char c : text) seen[c] = true;
  std::fill(std::begin(index_), std::end(index_), -1);
  for (int c = 0; c < 256; ++c) {
    if (!seen[c]) continue;
    index_[c] = int32_t(chars_.size());
    chars_.push_back(char(c));
  }
}

std::vector<int32_t> CharTokenizer::encode(const std::string& text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const int32_t id = index_[static_cast<unsigned char>(text[i])];
    if (id < 0)
      throw std::invalid_argument("character " + std::to_string(int(text[i])) +
                                  " is not in the vocabulary");
    ids[i] = id;
  }
  return ids;
}

std::string CharTokenizer::decode(int32_t id) const {
  return std::string(1, chars_[size_t(id)]);
}

std::string CharTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s;
  for (int32_t id : ids) s += chars_[size_t(id)];
  return s;
}

BatchSampler::BatchSampler(std::vector<int32_t> tokens, int rank, int world, int64_t seq,
                           uint64_t seed)
    : tokens_(std::move(tokens)), seq_(seq), rng_(seed * 0x100000001B3ull + uint64_t(rank) + 1) {
  const int64_t total = int64_t(tokens_.size());
  const int64_t train = total - total / 20;
  train_begin_ = train * rank / world;
  train_end_ = train * (rank + 1) / world;
  val_begin_ = train + (total - train) * rank / world;
  val_end_ = train + (total - train) * (rank + 1) / world;
  // A window needs seq inputs plus the one target after them.
  if (train_end_ - train_begin_ < seq + 1 || val_end_ - val_begin_ < seq + 1)
    throw std::invalid_argument("the text (" + std::to_string(total) +
                                " tokens) is too short for " + std::to_string(world) +
                                " ranks with windows of " + std::to_string(seq + 1) +
                                " tokens (95 % train, 5 % validation)");
}

Batch BatchSampler::window(const std::vector<int64_t>& starts) const {
  Batch b;
  for (int64_t s : starts) {
    b.inputs.insert(b.inputs.end(), tokens_.begin() + s, tokens_.begin() + s + seq_);
    b.targets.insert(b.targets.end(), tokens_.begin() + s + 1, tokens_.begin() + s + seq_ + 1);
  }
  return b;
}

Batch BatchSampler::next_train(int64_t batch) {
  std::vector<int64_t> starts(static_cast<size_t>(batch));
  const uint64_t span = uint64_t(train_end_ - train_begin_ - seq_);
  for (auto& s : starts) s = train_begin_ + int64_t(rng_.below(span));
  return window(starts);
}

Batch BatchSampler::validation(int64_t batch) const {
  std::vector<int64_t> starts(static_cast<size_t>(batch));
  const int64_t span = val_end_ - val_begin_ - seq_;
  for (int64_t i = 0; i < batch; ++i)
    starts[size_t(i)] = val_begin_ + span * i / std::max<int64_t>(1, batch);
  return window(starts);
}

}  // namespace zsdemo
