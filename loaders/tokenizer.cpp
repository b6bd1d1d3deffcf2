// tokenizer.cpp — a Hugging Face tokenizer.json's BPE stages (Note [tokenizer.json] in
// ferry/loaders/tokenizer.h) and open_tokenizer.
#include "ferry/loaders/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <deque>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "ferry/core/error.h"
#include "tokenizer_impl.h"

namespace ferry {
namespace {

using nlohmann::json;

// GPT-2's pre-tokenizer split (ByteLevel with use_regex), as `tokenizers` writes it.
constexpr const char* kGpt2Split = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's bytes_to_unicode: the printable bytes stand for themselves, the others for 256 + n.
struct ByteAlphabet {
  std::array<char32_t, 256> to_char{};
  std::unordered_map<char32_t, std::uint8_t> to_byte;
  ByteAlphabet() {
    std::array<bool, 256> printable{};
    for (int b = '!'; b <= '~'; ++b) printable[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      to_char[b] = printable[b] ? static_cast<char32_t>(b) : next++;
      to_byte[to_char[b]] = static_cast<std::uint8_t>(b);
    }
  }
};
const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet a;
  return a;
}

// Decodes one UTF-8 character at s[i] (valid UTF-8 assumed); advances i.
char32_t next_char(std::string_view s, std::size_t& i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) {
    ++i;
    return c;
  }
  const int n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
  char32_t v = c & (0x7F >> n);
  for (int k = 1; k < n; ++k) v = (v << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n;
  return v;
}

// Byte fallback's token for byte b: "<0x0A>".
std::string byte_token(unsigned char b) {
  static constexpr char hex[] = "0123456789ABCDEF";
  return std::string{'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
}

std::size_t char_length(unsigned char lead) { return lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2; }

// The text of a vocabulary entry in the byte alphabet as the bytes it stands for; false when a
// character is outside the alphabet (an entry byte-level text never reaches).
bool decode_byte_level(std::string_view token, std::string& out) {
  out.clear();
  const auto& alpha = byte_alphabet();
  for (std::size_t i = 0; i < token.size();) {
    const auto it = alpha.to_byte.find(next_char(token, i));
    if (it == alpha.to_byte.end()) return false;
    out.push_back(static_cast<char>(it->second));
  }
  return true;
}

[[noreturn]] void refuse(const std::string& name, const std::string& what) {
  throw Error("tokenizer " + name + ": " + what + " (ferry reads the stages listed in ferry/loaders/tokenizer.h)");
}

std::string type_of(const json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : "?";
}

// A compiled PCRE2 pattern; matches on the calling thread's match data.
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& name) {
    int err = 0;
    PCRE2_SIZE at = 0;
    code_ =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err, &at, nullptr);
    if (!code_) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(err, msg.data(), msg.size());
      throw Error("tokenizer " + name + ": the regex " + pattern + " does not compile at " + std::to_string(at) + ": " +
                  reinterpret_cast<const char*>(msg.data()));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  /// The first match at or after `start` in s: [begin, end), or false. s is valid UTF-8.
  bool find(std::string_view s, std::size_t start, std::size_t& begin, std::size_t& end) const {
    struct Data {
      pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
      ~Data() { pcre2_match_data_free(md); }
    };
    thread_local Data data;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    const int rc = jit_ ? pcre2_jit_match(code_, subject, s.size(), start, PCRE2_NO_UTF_CHECK, data.md, nullptr)
                        : pcre2_match(code_, subject, s.size(), start, PCRE2_NO_UTF_CHECK, data.md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) throw DataError("text", start, "the tokenizer's regex failed (PCRE2 error " + std::to_string(rc) + ")");
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data.md);
    begin = ov[0];
    end = ov[1];
    return true;
  }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

struct AddedToken {
  std::string content;
  std::int32_t id;
  bool normalized;
};

struct NormalizeStep {
  bool prepend;  // else replace
  std::string a, b;
};

struct PreStep {
  enum Kind { Split, ByteLevel } kind;
  std::unique_ptr<Regex> regex;  // Split (a string pattern compiled as its quoted regex), ByteLevel with use_regex
  bool remove = false;           // Split: behavior Removed (else Isolated)
  bool add_prefix_space = false;
};

std::atomic<std::uint64_t> g_next_tokenizer{1};

class JsonTokenizer final : public Tokenizer {
 public:
  JsonTokenizer(const json& j, std::string name) : name_(std::move(name)), serial_(g_next_tokenizer.fetch_add(1)) {
    read_model(j.at("model"));
    read_added(j);
    if (j.contains("normalizer")) read_normalizer(j["normalizer"]);
    if (j.contains("pre_tokenizer")) read_pre(j["pre_tokenizer"]);
    for (const char* key : {"truncation", "padding"})
      if (j.contains(key) && !j[key].is_null()) refuse(name_, std::string(key) + " is set (ferry cuts sequences itself)");
  }

  void encode(std::string_view text, std::vector<std::int32_t>& out, std::string_view where) const override {
    const std::size_t bad = detail::invalid_utf8(text);
    if (bad != std::string_view::npos)
      throw DataError(std::string(where.empty() ? "text" : where), bad, "not UTF-8 (the tokenizer takes UTF-8 text)");
    split_added(text, /*normalized=*/false, out, [&](std::string_view piece) {
      if (normalize_.empty()) return split_added(piece, true, out, [&](std::string_view p) { pre_tokenize(p, out); });
      std::string norm = normalize(piece);
      split_added(norm, true, out, [&](std::string_view p) { pre_tokenize(p, out); });
    });
  }
  std::size_t vocab_size() const noexcept override { return vocab_size_; }
  std::optional<std::int32_t> token_id(std::string_view token) const override {
    for (const auto& a : added_)
      if (a.content == token) return a.id;
    std::string key(token);
    if (byte_level_ && !decode_byte_level(token, key)) return std::nullopt;
    const auto it = vocab_.find(key);
    if (it == vocab_.end()) return std::nullopt;
    return it->second;
  }
  const std::string& name() const noexcept override { return name_; }

 private:
  // --- reading the file ---------------------------------------------------------------------
  void read_model(const json& m) {
    const std::string type = type_of(m);
    if (type != "BPE") refuse(name_, "model " + type);
    if (m.contains("dropout") && !m["dropout"].is_null()) refuse(name_, "BPE dropout (it makes ids random)");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (m.contains(key) && m[key].is_string() && !m[key].get<std::string>().empty()) refuse(name_, std::string("BPE ") + key);
    byte_fallback_ = m.value("byte_fallback", false);
    fuse_unk_ = m.value("fuse_unk", false);
    ignore_merges_ = m.value("ignore_merges", false);
    for (const auto& [token, id] : m.at("vocab").items()) {
      const auto v = id.get<std::int64_t>();
      if (v < 0 || v > INT32_MAX) throw Error("tokenizer " + name_ + ": vocab id " + std::to_string(v) + " of " + token);
      file_vocab_.emplace(token, static_cast<std::int32_t>(v));
      vocab_size_ = std::max<std::size_t>(vocab_size_, static_cast<std::size_t>(v) + 1);
    }
    if (m.contains("unk_token") && m["unk_token"].is_string()) {
      const auto it = file_vocab_.find(m["unk_token"].get<std::string>());
      if (it == file_vocab_.end()) throw Error("tokenizer " + name_ + ": unk_token is not in the vocab");
      unk_ = it->second;
    }
    const json& merges = m.at("merges");
    merges_.reserve(merges.size() * 2);
    std::int32_t rank = 0;
    for (const auto& e : merges) {
      std::string a, b;
      if (e.is_string()) {  // "a b"
        const auto s = e.get<std::string>();
        const auto sp = s.find(' ');
        if (sp == std::string::npos) throw Error("tokenizer " + name_ + ": merge " + std::to_string(rank) + " is not \"a b\"");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        a = e.at(0).get<std::string>();
        b = e.at(1).get<std::string>();
      }
      const auto ia = file_vocab_.find(a), ib = file_vocab_.find(b), ic = file_vocab_.find(a + b);
      if (ia == file_vocab_.end() || ib == file_vocab_.end() || ic == file_vocab_.end())
        throw Error("tokenizer " + name_ + ": merge " + std::to_string(rank) + " (" + a + " " + b +
                    ") names a token not in the vocab");
      merges_.insert_or_assign(pair_key(ia->second, ib->second),
                               std::make_pair(rank, ic->second));  // a repeated pair: the last holds, as in `tokenizers`
      ++rank;
    }
  }

  void read_added(const json& j) {
    if (!j.contains("added_tokens")) return;
    for (const auto& t : j["added_tokens"]) {
      for (const char* key : {"single_word", "lstrip", "rstrip"})
        if (t.value(key, false)) refuse(name_, "added token " + t.value("content", std::string()) + " with " + key);
      AddedToken a{t.at("content").get<std::string>(), t.at("id").get<std::int32_t>(), t.value("normalized", false)};
      if (a.content.empty()) continue;
      vocab_size_ = std::max<std::size_t>(vocab_size_, static_cast<std::size_t>(a.id) + 1);
      added_.push_back(std::move(a));
    }
    // Longest first within each first byte: the first that matches at a position is the longest.
    std::sort(added_.begin(), added_.end(),
              [](const AddedToken& x, const AddedToken& y) { return x.content.size() > y.content.size(); });
    for (std::size_t k = 0; k < added_.size(); ++k) {
      auto& starts = added_.at(k).normalized ? first_normalized_ : first_raw_;
      starts[static_cast<unsigned char>(added_[k].content[0])].push_back(k);
      (added_[k].normalized ? any_normalized_ : any_raw_) = true;
    }
  }

  void read_normalizer(const json& n) {
    if (n.is_null()) return;
    const std::string type = type_of(n);
    if (type == "Sequence") {
      for (const auto& s : n.at("normalizers")) read_normalizer(s);
    } else if (type == "Prepend") {
      normalize_.push_back({true, n.at("prepend").get<std::string>(), {}});
    } else if (type == "Replace") {
      const json& p = n.at("pattern");
      if (!p.contains("String")) refuse(name_, "normalizer Replace with a regex pattern");
      normalize_.push_back({false, p["String"].get<std::string>(), n.at("content").get<std::string>()});
      if (normalize_.back().a.empty()) refuse(name_, "normalizer Replace of the empty string");
    } else {
      refuse(name_, "normalizer " + type);
    }
  }

  void read_pre(const json& p) {
    if (p.is_null()) return;
    const std::string type = type_of(p);
    if (!pre_.empty() && pre_.back().kind == PreStep::ByteLevel) refuse(name_, "pre_tokenizer " + type + " after ByteLevel");
    if (type == "Sequence") {
      for (const auto& s : p.at("pretokenizers")) read_pre(s);
    } else if (type == "ByteLevel") {
      PreStep s{PreStep::ByteLevel, nullptr};
      s.add_prefix_space = p.value("add_prefix_space", true);
      if (p.value("use_regex", true)) s.regex = std::make_unique<Regex>(kGpt2Split, name_);
      pre_.push_back(std::move(s));
      byte_level_ = true;
      byte_vocab();
    } else if (type == "Split") {
      if (p.value("invert", false)) refuse(name_, "pre_tokenizer Split with invert");
      const std::string behavior = p.value("behavior", std::string("Isolated"));
      if (behavior != "Isolated" && behavior != "Removed") refuse(name_, "pre_tokenizer Split with behavior " + behavior);
      const json& pat = p.at("pattern");
      std::string regex;
      if (pat.contains("Regex")) {
        regex = pat["Regex"].get<std::string>();
      } else {
        const auto s = pat.at("String").get<std::string>();
        regex = "\\Q" + s + "\\E";
        if (s.find("\\E") != std::string::npos) refuse(name_, "pre_tokenizer Split with a string pattern holding \\E");
      }
      PreStep s{PreStep::Split, std::make_unique<Regex>(regex, name_)};
      s.remove = behavior == "Removed";
      pre_.push_back(std::move(s));
    } else {
      refuse(name_, "pre_tokenizer " + type);
    }
  }

  // A byte-level model's vocab by the bytes its entries stand for, and each byte's id.
  void byte_vocab() {
    vocab_.clear();
    std::string raw;
    for (const auto& [token, id] : file_vocab_)
      if (decode_byte_level(token, raw)) vocab_.emplace(raw, id);
    byte_id_.fill(-1);
    for (int b = 0; b < 256; ++b) {
      const auto it = vocab_.find(std::string(1, static_cast<char>(b)));
      if (it != vocab_.end()) byte_id_[b] = it->second;
    }
  }

  // --- encoding -----------------------------------------------------------------------------
  static std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }

  // Calls rest(piece) for the text between added tokens of the kind given, appending the tokens'
  // ids in their places.
  template <class Rest>
  void split_added(std::string_view text, bool normalized, std::vector<std::int32_t>& out, Rest&& rest) const {
    if (!(normalized ? any_normalized_ : any_raw_)) {
      if (!text.empty()) rest(text);
      return;
    }
    const auto& first = normalized ? first_normalized_ : first_raw_;
    std::size_t from = 0;
    for (std::size_t i = 0; i < text.size(); ++i) {
      for (std::size_t k : first[static_cast<unsigned char>(text[i])]) {
        const std::string& c = added_[k].content;
        if (text.compare(i, c.size(), c) != 0) continue;
        if (i > from) rest(text.substr(from, i - from));
        out.push_back(added_[k].id);
        from = i + c.size();
        i = from - 1;
        break;
      }
    }
    if (from < text.size()) rest(text.substr(from));
  }

  std::string normalize(std::string_view piece) const {
    std::string s(piece);
    for (const auto& step : normalize_) {
      if (step.prepend) {
        if (!s.empty()) s.insert(0, step.a);
      } else {
        std::string r;
        std::size_t at = 0;
        for (std::size_t hit; (hit = s.find(step.a, at)) != std::string::npos; at = hit + step.a.size()) {
          r.append(s, at, hit - at);
          r += step.b;
        }
        r.append(s, at, std::string::npos);
        s = std::move(r);
      }
    }
    return s;
  }

  // The pre-tokenizer's stages over one piece, then the model over each of their pieces.
  void pre_tokenize(std::string_view piece, std::vector<std::int32_t>& out) const { pre_stage(0, piece, out); }

  void pre_stage(std::size_t k, std::string_view piece, std::vector<std::int32_t>& out) const {
    if (piece.empty()) return;
    if (k == pre_.size()) return model(piece, out);
    const PreStep& s = pre_[k];
    std::string prefixed;
    if (s.kind == PreStep::ByteLevel && s.add_prefix_space && piece.front() != ' ') {
      prefixed.reserve(piece.size() + 1);
      prefixed.push_back(' ');
      prefixed.append(piece);
      piece = prefixed;
    }
    if (!s.regex) return pre_stage(k + 1, piece, out);
    std::size_t at = 0, begin = 0, end = 0;
    while (at < piece.size() && s.regex->find(piece, at, begin, end)) {
      if (begin > at) pre_stage(k + 1, piece.substr(at, begin - at), out);
      if (end == begin) {  // an empty match: no piece; go on from the next character
        if (begin >= piece.size()) break;
        const std::size_t next = begin + char_length(static_cast<unsigned char>(piece[begin]));
        pre_stage(k + 1, piece.substr(begin, next - begin), out);
        at = next;
        continue;
      }
      if (!s.remove) pre_stage(k + 1, piece.substr(begin, end - begin), out);
      at = end;
    }
    if (at < piece.size()) pre_stage(k + 1, piece.substr(at), out);
  }

  struct WordCache {
    std::uint64_t owner = 0;
    std::unordered_map<std::string, std::vector<std::int32_t>> words;
  };
  static constexpr std::size_t kCacheWords = 1 << 16, kCachedLength = 128;

  void model(std::string_view word, std::vector<std::int32_t>& out) const {
    if (ignore_merges_) {
      const auto it = vocab_.find(std::string(word));
      if (it != vocab_.end()) return out.push_back(it->second);
    }
    thread_local WordCache cache;
    const bool cached = word.size() <= kCachedLength;
    if (cached) {
      if (cache.owner != serial_) {
        cache.words.clear();
        cache.owner = serial_;
      }
      const auto it = cache.words.find(std::string(word));
      if (it != cache.words.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const std::size_t before = out.size();
    merge_word(word, out);
    if (cached) {
      if (cache.words.size() >= kCacheWords) cache.words.clear();
      cache.words.emplace(std::string(word),
                          std::vector<std::int32_t>(out.begin() + static_cast<std::ptrdiff_t>(before), out.end()));
    }
  }

  struct Symbol {
    std::int32_t id;
    std::int32_t prev, next;
    bool live;
  };
  struct Merge {
    std::int32_t rank, pos, id;
    bool operator>(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };

  // The word's first symbols (bytes of a byte-level model, else characters; unknown ones by byte
  // fallback or unk), then merges lowest rank first, leftmost first among equals (as `tokenizers`).
  void merge_word(std::string_view word, std::vector<std::int32_t>& out) const {
    thread_local std::vector<Symbol> syms;
    syms.clear();
    auto add = [&](std::int32_t id) {
      const auto n = static_cast<std::int32_t>(syms.size());
      syms.push_back({id, n - 1, -1, true});
      if (n > 0) syms[n - 1].next = n;
    };
    // A unit (a byte of a byte-level model, else a character) not in the vocab: its bytes' fallback
    // tokens, else unk (runs of unknown units fused into one with fuse_unk), else nothing.
    std::int32_t pending_unk = -1;  // an unk not yet added (fuse_unk grows it)
    std::string unit;
    for (std::size_t i = 0; i < word.size();) {
      const std::size_t len = byte_level_ ? 1 : char_length(static_cast<unsigned char>(word[i]));
      unit.assign(word.substr(i, len));
      i += len;
      std::int32_t id = -1;
      if (byte_level_) {
        id = byte_id_[static_cast<unsigned char>(unit[0])];
      } else if (const auto it = vocab_.find(unit); it != vocab_.end()) {
        id = it->second;
      }
      if (id >= 0) {
        if (pending_unk >= 0) add(pending_unk), pending_unk = -1;
        add(id);
        continue;
      }
      if (byte_fallback_) {
        std::array<std::int32_t, 4> ids{};
        bool all = true;
        for (std::size_t b = 0; b < unit.size() && all; ++b) {
          const auto f = vocab_.find(byte_token(static_cast<unsigned char>(unit[b])));
          if (f == vocab_.end())
            all = false;
          else
            ids[b] = f->second;
        }
        if (all) {
          if (pending_unk >= 0) add(pending_unk), pending_unk = -1;
          for (std::size_t b = 0; b < unit.size(); ++b) add(ids[b]);
          continue;
        }
      }
      if (unk_) {
        if (pending_unk >= 0 && !fuse_unk_) add(pending_unk);
        pending_unk = *unk_;
      }
    }
    if (pending_unk >= 0) add(pending_unk);
    if (syms.size() > 1) {
      thread_local std::vector<Merge> heap;
      heap.clear();
      auto push = [&](std::int32_t pos) {
        const std::int32_t nx = syms[pos].next;
        if (nx < 0) return;
        const auto it = merges_.find(pair_key(syms[pos].id, syms[nx].id));
        if (it == merges_.end()) return;
        heap.push_back({it->second.first, pos, it->second.second});
        std::push_heap(heap.begin(), heap.end(), std::greater<>());
      };
      for (std::int32_t p = 0; p + 1 < static_cast<std::int32_t>(syms.size()); ++p) push(p);
      while (!heap.empty()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<>());
        const Merge top = heap.back();
        heap.pop_back();
        Symbol& s = syms[top.pos];
        if (!s.live || s.next < 0) continue;
        const auto it = merges_.find(pair_key(s.id, syms[s.next].id));
        if (it == merges_.end() || it->second.second != top.id) continue;
        Symbol& right = syms[s.next];
        s.id = top.id;
        right.live = false;
        s.next = right.next;
        if (s.next >= 0) syms[s.next].prev = top.pos;
        if (s.prev >= 0) push(s.prev);
        push(top.pos);
      }
    }
    for (const Symbol& s : syms)
      if (s.live) out.push_back(s.id);
  }

  std::string name_;
  std::uint64_t serial_;
  std::unordered_map<std::string, std::int32_t> file_vocab_;                         // as the file spells the entries
  std::unordered_map<std::string, std::int32_t> vocab_;                              // by the text they stand for
  std::unordered_map<std::uint64_t, std::pair<std::int32_t, std::int32_t>> merges_;  // (a, b) -> (rank, merged id)
  std::array<std::int32_t, 256> byte_id_{};
  std::optional<std::int32_t> unk_;
  bool byte_fallback_ = false, fuse_unk_ = false, ignore_merges_ = false, byte_level_ = false;
  std::vector<AddedToken> added_;
  std::array<std::vector<std::size_t>, 256> first_raw_, first_normalized_;  // added tokens by first byte
  bool any_raw_ = false, any_normalized_ = false;                           // whether each kind has any
  std::vector<NormalizeStep> normalize_;
  std::vector<PreStep> pre_;
  std::size_t vocab_size_ = 0;

 public:
  // After the stages are read: the vocab by the text its entries stand for.
  void finish() {
    if (byte_level_)
      file_vocab_.clear();
    else
      vocab_ = std::move(file_vocab_);
  }
};

}  // namespace

std::size_t detail::invalid_utf8(std::string_view s) noexcept {
  std::size_t i = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    std::size_t len;
    char32_t min;
    if ((p[i] & 0xE0) == 0xC0)
      len = 2, min = 0x80;
    else if ((p[i] & 0xF0) == 0xE0)
      len = 3, min = 0x800;
    else if ((p[i] & 0xF8) == 0xF0)
      len = 4, min = 0x10000;
    else
      return i;
    if (i + len > n) return i;
    char32_t v = p[i] & (0x7F >> len);
    for (std::size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      v = (v << 6) | (p[i + k] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::shared_ptr<const Tokenizer> tokenizer_from_json(std::string_view text, const std::string& name) {
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    throw Error("tokenizer " + name + ": not JSON: " + e.what());
  }
  try {
    if (!j.is_object()) throw Error("tokenizer " + name + ": not a JSON object");
    auto t = std::make_shared<JsonTokenizer>(j, name);
    t->finish();
    return t;
  } catch (const json::exception& e) {
    throw Error("tokenizer " + name + ": " + e.what());
  }
}

std::shared_ptr<const Tokenizer> open_tokenizer(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("tokenizer " + path + ": cannot open the file");
  std::ostringstream text;
  text << in.rdbuf();
  if (path.size() >= 6 && path.compare(path.size() - 6, 6, ".model") == 0) return detail::open_sentencepiece(path, text.str());
  return tokenizer_from_json(text.str(), path);
}

}  // namespace ferry
