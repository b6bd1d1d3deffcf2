// Token files, Megatron-LM indexed datasets, sequences and mixtures (ferry/loaders/tokens.h).
//
// Note [Token positions in O(1)]
// Nothing here reads a corpus before its first sample: a flat file's windows are arithmetic on
// the token count, a Megatron corpus's document boundaries come from a binary search of its
// pointer array (memory-mapped), and a mixture's source for a global index comes from the block's
// counts (largest remainder) and a permutation evaluated at one position (IndexPermutation). So
// the first batch costs what one batch costs whatever the corpus size, and a resume is the same
// arithmetic from another index. The index is checked where it is read: a sample that touches a
// pointer checks it against its neighbour and the .bin's size, so a damaged index is a DataError
// naming the .idx and the entry's byte offset, found when a sample reaches it (fuzzed: FERRY_FUZZ_TOKENS).
#include "ferry/loaders/tokens.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>

#include "io.h"

namespace ferry {

std::size_t token_size(TokenType type) noexcept {
  switch (type) {
    case TokenType::UInt8:
    case TokenType::Int8: return 1;
    case TokenType::Int16:
    case TokenType::UInt16: return 2;
    case TokenType::Int32:
    case TokenType::UInt32: return 4;
    case TokenType::Int64: return 8;
  }
  return 0;
}

const char* token_type_name(TokenType type) noexcept {
  switch (type) {
    case TokenType::UInt8: return "uint8";
    case TokenType::Int8: return "int8";
    case TokenType::Int16: return "int16";
    case TokenType::UInt16: return "uint16";
    case TokenType::Int32: return "int32";
    case TokenType::UInt32: return "uint32";
    case TokenType::Int64: return "int64";
  }
  return "?";
}

TokenType parse_token_type(const std::string& name) {
  for (TokenType t : {TokenType::UInt8, TokenType::Int8, TokenType::Int16, TokenType::UInt16, TokenType::Int32, TokenType::UInt32,
                      TokenType::Int64})
    if (name == token_type_name(t)) return t;
  throw Error("token type '" + name + "' is not one of uint8, int8, int16, uint16, int32, uint32, int64");
}

std::uint64_t TokenCorpus::document_offset(std::uint64_t) const {
  throw Error(name() + ": its documents are not indexed (a Megatron index is)");
}

TokenCorpus::Array TokenCorpus::in_memory(std::string& why) const {
  why = name() + " is not one array in memory";
  return {};
}

namespace {

// A T stored at `p` (the formats are little-endian, as is every host ferry builds for).
template <class T>
T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <class T>
void widen_as(const std::byte* src, std::span<std::int64_t> out) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::int64_t>(load<T>(src + i * sizeof(T)));
}

void widen(TokenType type, const std::byte* src, std::span<std::int64_t> out) {
  switch (type) {
    case TokenType::UInt8: return widen_as<std::uint8_t>(src, out);
    case TokenType::Int8: return widen_as<std::int8_t>(src, out);
    case TokenType::Int16: return widen_as<std::int16_t>(src, out);
    case TokenType::UInt16: return widen_as<std::uint16_t>(src, out);
    case TokenType::Int32: return widen_as<std::int32_t>(src, out);
    case TokenType::UInt32: return widen_as<std::uint32_t>(src, out);
    case TokenType::Int64: return widen_as<std::int64_t>(src, out);
  }
}

// A file's bytes: a local file mapped, an object read by ranged GETs, or bytes in memory.
class Bytes {
 public:
  static Bytes open(const std::string& path) {
    Bytes b;
    b.name_ = path;
    if (loaders::is_remote(path)) {
      b.size_ = loaders::Blob::open(path)->size();
      b.ranges_ = std::make_shared<loaders::RangeReader>(path);
    } else {
      b.map_ = loaders::MappedFile::open(path);
      b.memory_ = b.map_->bytes();
      b.size_ = b.memory_.size();
    }
    return b;
  }
  static Bytes wrap(std::span<const std::byte> bytes, std::string name) {
    Bytes b;
    b.name_ = std::move(name);
    b.memory_ = bytes;
    b.size_ = bytes.size();
    return b;
  }
  /// An object read whole into memory (an index searched many times a sample).
  void load_whole() {
    if (!ranges_) return;
    auto owned = std::make_shared<std::vector<std::byte>>();
    loaders::read_file(name_, *owned);
    owned_ = owned;
    memory_ = *owned;
    size_ = memory_.size();
    ranges_.reset();
  }
  /// n bytes at `offset`: in place, or read into `scratch` (taken from this thread's prefetch when
  /// it holds them). DataError when they run past the end.
  const std::byte* view(std::uint64_t offset, std::size_t n, std::vector<std::byte>& scratch) const {
    if (offset > size_ || n > size_ - offset)
      throw DataError(name_, offset,
                      "needs " + std::to_string(n) + " bytes here, the file has " + std::to_string(size_) + " (truncated?)");
    if (!ranges_) return memory_.data() + offset;
    if (loaders::take_prefetched(name_, offset, n, scratch) && scratch.size() == n) return scratch.data();
    ranges_->read(offset, n, scratch);
    return scratch.data();
  }
  /// The bytes in this process's memory (null for an object read by requests).
  const std::byte* memory() const noexcept { return ranges_ ? nullptr : memory_.data(); }
  bool mapped() const noexcept { return map_ != nullptr; }
  /// Whether reads are requests (an object), which prefetch() can send ahead.
  bool remote() const noexcept { return ranges_ != nullptr; }
  std::uint64_t size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }

 private:
  std::string name_;
  std::uint64_t size_ = 0;
  std::shared_ptr<const loaders::MappedFile> map_;
  std::shared_ptr<loaders::RangeReader> ranges_;
  std::shared_ptr<const std::vector<std::byte>> owned_;
  std::span<const std::byte> memory_;
};

thread_local std::vector<std::byte> t_scratch;

// Tokens [data_offset, data_offset + tokens * size) of a file, checked against a vocabulary.
class TokenBytes {
 public:
  TokenBytes(Bytes bytes, std::uint64_t data_offset, std::uint64_t tokens, TokenType type, std::optional<std::int64_t> vocab)
      : bytes_(std::move(bytes)), offset_(data_offset), tokens_(tokens), type_(type), vocab_(vocab) {}
  void read(std::uint64_t begin, std::span<std::int64_t> out) const {
    const std::size_t isz = token_size(type_);
    if (begin > tokens_ || out.size() > tokens_ - begin)
      throw DataError(bytes_.name(), offset_ + begin * isz,
                      "tokens [" + std::to_string(begin) + ", " + std::to_string(begin + out.size()) + ") run past the file's " +
                          std::to_string(tokens_) + " tokens");
    widen(type_, bytes_.view(offset_ + begin * isz, out.size() * isz, t_scratch), out);
    if (vocab_)
      for (std::size_t i = 0; i < out.size(); ++i)
        if (out[i] < 0 || out[i] >= *vocab_)
          throw DataError(bytes_.name(), offset_ + (begin + i) * isz,
                          "token id " + std::to_string(out[i]) + " (token " + std::to_string(begin + i) +
                              ") is outside the vocabulary [0, " + std::to_string(*vocab_) + ")");
  }
  std::uint64_t tokens() const noexcept { return tokens_; }
  TokenType type() const noexcept { return type_; }
  TokenCorpus::Array in_memory(std::string& why) const {
    if (!bytes_.memory()) {
      why = bytes_.name() + " is an object in storage, read by requests, not an array in memory";
      return {};
    }
    if (vocab_) {
      why = "token ids are checked against vocab_size as the host reads them";
      return {};
    }
    return {bytes_.memory() + offset_, bytes_.mapped()};
  }
  const Bytes& bytes() const noexcept { return bytes_; }
  void prefetch(std::span<const std::pair<std::uint64_t, std::uint64_t>> ranges) const {
    if (!bytes_.remote()) return;
    const std::size_t isz = token_size(type_);
    std::vector<loaders::Wanted> wanted;
    for (const auto& [begin, count] : ranges)
      if (begin <= tokens_ && count <= tokens_ - begin && count > 0)
        wanted.push_back({bytes_.name(), offset_ + begin * isz, static_cast<std::size_t>(count * isz)});
    loaders::prefetch(wanted);
  }

 private:
  Bytes bytes_;
  std::uint64_t offset_, tokens_;
  TokenType type_;
  std::optional<std::int64_t> vocab_;
};

class FlatCorpus final : public TokenCorpus {
 public:
  FlatCorpus(TokenBytes tokens, std::optional<std::int64_t> eod) : tokens_(std::move(tokens)), eod_(eod) {}
  std::uint64_t size() const noexcept override { return tokens_.tokens(); }
  TokenType type() const noexcept override { return tokens_.type(); }
  const std::string& name() const noexcept override { return tokens_.bytes().name(); }
  void read(std::uint64_t begin, std::span<std::int64_t> out) const override { tokens_.read(begin, out); }
  void document_starts(std::uint64_t begin, std::span<const std::int64_t> tokens,
                       std::vector<std::uint64_t>& out) const override {
    if (!eod_) return;
    for (std::size_t k = 1; k < tokens.size(); ++k)
      if (tokens[k - 1] == *eod_) out.push_back(begin + k);
  }
  bool has_documents() const noexcept override { return eod_.has_value(); }
  void prefetch(std::span<const std::pair<std::uint64_t, std::uint64_t>> ranges) const override { tokens_.prefetch(ranges); }
  Array in_memory(std::string& why) const override { return tokens_.in_memory(why); }

 private:
  TokenBytes tokens_;
  std::optional<std::int64_t> eod_;
};

TokenType npy_token_type(const std::string& descr, const std::string& name, std::uint64_t at) {
  static const std::pair<const char*, TokenType> kTypes[] = {
      {"u1", TokenType::UInt8}, {"i1", TokenType::Int8},   {"i2", TokenType::Int16}, {"u2", TokenType::UInt16},
      {"i4", TokenType::Int32}, {"u4", TokenType::UInt32}, {"i8", TokenType::Int64}};
  if (descr.size() == 3 && (descr[0] == '<' || descr[0] == '|' || (descr[0] == '>' && descr[2] == '1') || descr[0] == '='))
    for (auto& [code, type] : kTypes)
      if (descr.compare(1, 2, code) == 0) return type;
  throw DataError(name, at, "a token .npy must hold little-endian integers (uint8/16/32, int8/16/32/64), not '" + descr + "'");
}

}  // namespace

LlmcHeader parse_llmc_header(std::span<const std::byte> header, const std::string& name) {
  constexpr std::int32_t kMagic = 20240520;
  if (header.size() < 1024)
    throw DataError(name, header.size(),
                    "truncated llm.c header: it is 1024 bytes, the file has " + std::to_string(header.size()));
  if (load<std::int32_t>(header.data()) != kMagic)
    throw DataError(
        name, 0, "not an llm.c token file: magic " + std::to_string(load<std::int32_t>(header.data())) + ", expected 20240520");
  const std::int32_t version = load<std::int32_t>(header.data() + 4);
  if (version != 1 && version != 2)
    throw DataError(name, 4,
                    "unsupported llm.c token file version " + std::to_string(version) + " (1: uint16 tokens, 2: uint32)");
  const std::int32_t count = load<std::int32_t>(header.data() + 8);
  if (count < 0) throw DataError(name, 8, "llm.c header: negative token count " + std::to_string(count));
  return {version == 1 ? TokenType::UInt16 : TokenType::UInt32, static_cast<std::uint64_t>(count)};
}

std::shared_ptr<const TokenCorpus> open_token_file(const std::string& path, const TokenFileOptions& o) {
  Bytes bytes = Bytes::open(path);
  if (bytes.size() == 0) throw DataError(path, DataError::kNoOffset, "is empty (0 bytes)");
  std::vector<std::byte> head_buf;
  const std::size_t head_n = static_cast<std::size_t>(std::min<std::uint64_t>(bytes.size(), 65536));
  const std::byte* head = bytes.view(0, head_n, head_buf);
  const std::span<const std::byte> head_span(head, head_n);
  using Format = TokenFileOptions::Format;
  Format format = o.format;
  if (format == Format::Auto) {
    if (head_n >= 6 && std::memcmp(head, "\x93NUMPY", 6) == 0)
      format = Format::Npy;
    else if (head_n >= 4 && load<std::int32_t>(head) == 20240520)
      format = Format::LlmC;
    else
      format = Format::Raw;
  }
  auto check_type = [&](TokenType found) {
    if (o.type && *o.type != found)
      throw DataError(
          path, 0,
          std::string("holds ") + token_type_name(found) + " tokens, and " + token_type_name(*o.type) + " was asked for");
  };
  std::uint64_t offset = 0, tokens = 0;
  TokenType type = TokenType::UInt16;
  if (format == Format::Npy) {
    const loaders::NpyLayout l = loaders::npy_layout(head_span, path);
    type = npy_token_type(l.descr, path, l.header_offset);
    if (l.shape.size() != 1)
      throw DataError(path, l.header_offset,
                      "a token .npy must be 1-D, this one has shape of " + std::to_string(l.shape.size()) + " dimensions");
    offset = l.data_offset;
    tokens = static_cast<std::uint64_t>(l.shape[0]);
    check_type(type);
  } else if (format == Format::LlmC) {
    const LlmcHeader h = parse_llmc_header(head_span, path);
    type = h.type;
    offset = 1024;
    tokens = h.tokens;
    check_type(type);
  } else {
    if (!o.type) throw Error(path + ": a raw token file needs its token type (uint16 for nanoGPT's .bin)");
    type = *o.type;
    if (bytes.size() % token_size(type) != 0)
      throw DataError(
          path, bytes.size() - bytes.size() % token_size(type),
          std::to_string(bytes.size()) + " bytes is not a whole number of " + token_type_name(type) + " tokens (truncated?)");
    tokens = bytes.size() / token_size(type);
  }
  const std::uint64_t need = offset + loaders::checked_mul(tokens, token_size(type), path, "token data size");
  if (need != bytes.size())
    throw DataError(path, std::min(need, bytes.size()),
                    "the header declares " + std::to_string(tokens) + " " + token_type_name(type) + " tokens (" +
                        std::to_string(need) + " bytes in all), the file has " + std::to_string(bytes.size()) +
                        (need > bytes.size() ? " (truncated)" : " (trailing bytes)"));
  return std::make_shared<FlatCorpus>(TokenBytes(std::move(bytes), offset, tokens, type, o.vocab_size), o.eod);
}

// --- Megatron-LM indexed datasets ---------------------------------------------------------------

namespace {

// prefix.idx, as megatron-core's _IndexWriter writes it (little-endian):
//   9 bytes  "MMIDIDX\0\0"
//   u64      version (1)
//   u8       dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
//   u64      sequence count S
//   u64      document count D (entries of the document index: documents + 1)
//   i32[S]   sequence lengths, in tokens
//   i64[S]   sequence pointers, byte offsets into prefix.bin
//   i64[D]   document indices: the first sequence of each document, then S
//   (i8[S]   sequence modes, multimodal datasets only)
constexpr std::size_t kIdxHeader = 9 + 8 + 1 + 8 + 8;

class MegatronCorpus final : public TokenCorpus {
 public:
  MegatronCorpus(Bytes idx, Bytes bin, std::string name, const MegatronOptions& o)
      : idx_(std::move(idx)), name_(std::move(name)) {
    std::vector<std::byte> buf;
    const std::string& in = idx_.name();
    if (idx_.size() < kIdxHeader)
      throw DataError(in, idx_.size(), "truncated Megatron index: " + std::to_string(idx_.size()) + " bytes, the header is 34");
    const std::byte* h = idx_.view(0, kIdxHeader, buf);
    if (std::memcmp(h, "MMIDIDX\0\0", 9) != 0)
      throw DataError(in, 0, "not a Megatron index (the magic MMIDIDX\\0\\0 is missing)");
    if (load<std::uint64_t>(h + 9) != 1)
      throw DataError(in, 9, "unsupported Megatron index version " + std::to_string(load<std::uint64_t>(h + 9)) + " (1 is read)");
    const auto code = std::to_integer<unsigned>(h[17]);
    static const std::optional<TokenType> kCodes[] = {std::nullopt,     TokenType::UInt8, TokenType::Int8,
                                                      TokenType::Int16, TokenType::Int32, TokenType::Int64,
                                                      std::nullopt,     std::nullopt,     TokenType::UInt16};
    if (code >= 9 || !kCodes[code])
      throw DataError(in, 17,
                      "Megatron dtype code " + std::to_string(code) +
                          (code == 6 || code == 7 ? " is a float type, not tokens" : " is unknown"));
    type_ = *kCodes[code];
    sequences_ = load<std::uint64_t>(h + 18);
    doc_entries_ = load<std::uint64_t>(h + 26);
    if (sequences_ == 0) throw DataError(in, 18, "the index holds no sequences");
    const std::uint64_t per_seq = 4 + 8;
    if (sequences_ > (std::numeric_limits<std::uint64_t>::max() - kIdxHeader) / 16 ||
        doc_entries_ > std::numeric_limits<std::uint64_t>::max() / 16)
      throw DataError(
          in, 18,
          "counts overflow: " + std::to_string(sequences_) + " sequences, " + std::to_string(doc_entries_) + " document entries");
    lengths_at_ = kIdxHeader;
    pointers_at_ = lengths_at_ + sequences_ * 4;
    docs_at_ = pointers_at_ + sequences_ * 8;
    const std::uint64_t end = docs_at_ + doc_entries_ * 8;
    if (end < docs_at_ || (idx_.size() != end && idx_.size() != end + sequences_))
      throw DataError(in, std::min<std::uint64_t>(idx_.size(), end),
                      std::to_string(sequences_) + " sequences (" + std::to_string(per_seq) + " bytes each) and " +
                          std::to_string(doc_entries_) + " document entries need an index of " + std::to_string(end) +
                          " bytes, it has " + std::to_string(idx_.size()));
    if (doc_entries_ < 2)
      throw DataError(
          in, 26, "the document index has " + std::to_string(doc_entries_) + " entries (at least 2: 0 and the sequence count)");
    idx_.load_whole();  // an object's index is searched a sample at a time: read it once (a local one is mapped)
    const std::size_t isz = token_size(type_);
    if (bin.size() % isz != 0)
      throw DataError(bin.name(), bin.size(),
                      std::to_string(bin.size()) + " bytes is not a whole number of " + token_type_name(type_) + " tokens");
    // The stream is the whole .bin: the first sequence at 0, the last ending at its end.
    if (pointer(0) != 0)
      throw DataError(in, pointers_at_,
                      "the first sequence starts at byte " + std::to_string(pointer(0)) + " of the .bin, not 0");
    const std::uint64_t last = sequences_ - 1;
    const std::uint64_t last_end = pointer(last) + length(last) * isz;
    if (last_end != bin.size())
      throw DataError(in, pointers_at_ + last * 8,
                      "the last sequence ends at byte " + std::to_string(last_end) + " of the .bin, which has " +
                          std::to_string(bin.size()) + " bytes" + (last_end > bin.size() ? " (pointers run past the .bin)" : ""));
    if (doc_index(0) != 0 || doc_index(doc_entries_ - 1) != sequences_)
      throw DataError(in, docs_at_, "the document index must run from 0 to the sequence count " + std::to_string(sequences_));
    tokens_.emplace(std::move(bin), 0, bin_tokens(last_end), type_, o.vocab_size);
  }
  std::uint64_t size() const noexcept override { return tokens_->tokens(); }
  TokenType type() const noexcept override { return type_; }
  const std::string& name() const noexcept override { return name_; }
  void read(std::uint64_t begin, std::span<std::int64_t> out) const override { tokens_->read(begin, out); }
  void prefetch(std::span<const std::pair<std::uint64_t, std::uint64_t>> ranges) const override { tokens_->prefetch(ranges); }
  bool has_documents() const noexcept override { return true; }
  Array in_memory(std::string& why) const override { return tokens_->in_memory(why); }  // the .bin, read front to back
  std::uint64_t documents() const noexcept override { return sequences_; }
  std::uint64_t document_offset(std::uint64_t d) const override {
    if (d >= sequences_) return tokens_->tokens();
    if (d > 0) check_follows(d);
    return pointer(d) / token_size(type_);
  }
  void document_starts(std::uint64_t begin, std::span<const std::int64_t> tokens,
                       std::vector<std::uint64_t>& out) const override {
    const std::size_t isz = token_size(type_);
    const std::uint64_t lo = begin * isz, hi = (begin + tokens.size()) * isz;
    // The first sequence starting after `lo`: a binary search over the pointers (checked where read).
    std::uint64_t a = 0, b = sequences_;
    while (a < b) {
      const std::uint64_t m = a + (b - a) / 2;
      if (pointer(m) <= lo)
        a = m + 1;
      else
        b = m;
    }
    for (std::uint64_t j = a; j < sequences_; ++j) {
      const std::uint64_t p = pointer(j);
      if (j > 0) check_follows(j);
      if (p >= hi) break;
      out.push_back(p / isz);
    }
  }

 private:
  std::uint64_t bin_tokens(std::uint64_t bytes) const { return bytes / token_size(type_); }
  std::uint64_t pointer(std::uint64_t j) const {
    const std::int64_t p = load<std::int64_t>(idx_.view(pointers_at_ + j * 8, 8, t_scratch));
    if (p < 0 || static_cast<std::uint64_t>(p) % token_size(type_) != 0)
      throw DataError(
          idx_.name(), pointers_at_ + j * 8,
          "sequence " + std::to_string(j) + "'s pointer " + std::to_string(p) + " is negative or not a whole token's offset");
    return static_cast<std::uint64_t>(p);
  }
  std::uint64_t length(std::uint64_t j) const {
    const std::int32_t n = load<std::int32_t>(idx_.view(lengths_at_ + j * 4, 4, t_scratch));
    if (n < 0)
      throw DataError(idx_.name(), lengths_at_ + j * 4,
                      "sequence " + std::to_string(j) + " has a negative length " + std::to_string(n));
    return static_cast<std::uint64_t>(n);
  }
  std::uint64_t doc_index(std::uint64_t k) const {
    return static_cast<std::uint64_t>(load<std::int64_t>(idx_.view(docs_at_ + k * 8, 8, t_scratch)));
  }
  // Sequence j starts where sequence j - 1 ends: the stream is the .bin read front to back.
  void check_follows(std::uint64_t j) const {
    const std::uint64_t prev = pointer(j - 1), len = length(j - 1), p = pointer(j);
    if (len > (std::numeric_limits<std::uint64_t>::max() - prev) / token_size(type_) || prev + len * token_size(type_) != p)
      throw DataError(idx_.name(), pointers_at_ + j * 8,
                      "sequence " + std::to_string(j) + " starts at byte " + std::to_string(p) + " of the .bin, sequence " +
                          std::to_string(j - 1) + " ends at " + std::to_string(prev + len * token_size(type_)) +
                          " (ferry reads indices whose sequences follow each other, as megatron-core writes them)");
  }

  Bytes idx_;
  std::string name_;
  TokenType type_ = TokenType::UInt16;
  std::uint64_t sequences_ = 0, doc_entries_ = 0, lengths_at_ = 0, pointers_at_ = 0, docs_at_ = 0;
  std::optional<TokenBytes> tokens_;
};

}  // namespace

std::shared_ptr<const TokenCorpus> open_megatron(const std::string& prefix, const MegatronOptions& o) {
  Bytes idx = Bytes::open(prefix + ".idx");  // the index first: a missing dataset is named by it
  Bytes bin = Bytes::open(prefix + ".bin");
  return std::make_shared<MegatronCorpus>(std::move(idx), std::move(bin), prefix, o);
}

std::shared_ptr<const TokenCorpus> megatron_from_memory(std::span<const std::byte> idx, std::span<const std::byte> bin,
                                                        const std::string& name, const MegatronOptions& o) {
  return std::make_shared<MegatronCorpus>(Bytes::wrap(idx, name + ".idx"), Bytes::wrap(bin, name + ".bin"), name, o);
}

// --- sequences ----------------------------------------------------------------------------------

TokenSequences::TokenSequences(std::shared_ptr<const TokenCorpus> corpus, TokenSequenceOptions options)
    : corpus_(std::move(corpus)), options_(options) {
  if (!corpus_) throw Error("TokenSequences: no corpus");
  const std::string& n = corpus_->name();
  if (options_.seq_len < 1 || options_.seq_len > (std::size_t{1} << 30))
    throw Error("TokenSequences(" + n + "): seq_len must be in [1, 2^30], got " + std::to_string(options_.seq_len));
  if (options_.dtype != DType::Int64 && options_.dtype != DType::Int32)
    throw Error("TokenSequences(" + n + "): dtype must be int64 or int32, got " + dtype_name(options_.dtype));
  if (options_.packed && !corpus_->has_documents())
    throw Error(
        "TokenSequences(" + n +
        "): packed sequences need the corpus's documents: give the end-of-document token id (eod), or read a Megatron index");
  if (options_.shuffle_documents && corpus_->documents() == 0)
    throw Error("TokenSequences(" + n +
                "): shuffle_documents needs an indexed corpus (a Megatron index): a flat file's documents are "
                "found only by reading it");
  if (options_.shuffle_documents && options_.random_offset)
    throw Error("TokenSequences(" + n +
                "): shuffle_documents and random_offset do not go together (random windows have no order)");
  if (options_.shuffle_documents && options_.document_block < 1)
    throw Error("TokenSequences(" + n + "): document_block must be >= 1");
  if (options_.best_fit_group > 0) {
    if (!options_.packed) throw Error("TokenSequences(" + n + "): best_fit_group is for packed sequences (packed = true)");
    if (corpus_->documents() == 0)
      throw Error("TokenSequences(" + n +
                  "): best-fit packing needs an indexed corpus (a Megatron index): it places documents by "
                  "their lengths, which a flat file gives only when read");
    if (options_.random_offset || options_.raw)
      throw Error("TokenSequences(" + n + "): best-fit packing does not go with random_offset or raw windows");
    if (options_.best_fit_group > 65536)
      throw Error("TokenSequences(" + n + "): best_fit_group must be at most 65536, got " +
                  std::to_string(options_.best_fit_group));
  }
  if (options_.num_samples && !options_.random_offset)
    throw Error("TokenSequences(" + n +
                "): num_samples is for random_offset windows (ordered windows are as many as the corpus holds)");
  if (corpus_->size() < options_.seq_len + 1)
    throw Error("TokenSequences(" + n + "): the corpus has " + std::to_string(corpus_->size()) +
                " tokens, fewer than one window of seq_len + 1 = " + std::to_string(options_.seq_len + 1));
  size_ = static_cast<std::size_t>((corpus_->size() - 1) / options_.seq_len);
  if (options_.num_samples) size_ = *options_.num_samples;
  static std::atomic<std::uint64_t> ids{0};
  id_ = ++ids;
}

std::uint64_t TokenSequences::window_start(std::size_t index, SampleContext& ctx) const {
  if (index >= size_)
    throw Error(corpus_->name() + ": window " + std::to_string(index) + " out of range for " + std::to_string(size_));
  if (options_.random_offset) return ctx.rng().randint(corpus_->size() - options_.seq_len);
  return static_cast<std::uint64_t>(index) * options_.seq_len;
}

// Note [Token windows on the GPU] (ferry/loaders/tokens.h): input_ids and labels are two windows
// of the corpus's one array, at shift 0 and 1, from the sample's window_start.
std::vector<HostRows> TokenSequences::host_rows(std::string& why) const {
  if (options_.packed) {
    why = "packed windows' position_ids and cu_seqlens are made on the host";
    return {};
  }
  if (options_.shuffle_documents) {
    why = "a window of shuffled documents is not one run of the file";
    return {};
  }
  const TokenCorpus::Array array = corpus_->in_memory(why);
  if (!array.data) return {};
  const TokenType type = corpus_->type();
  HostRows base;
  base.data = array.data;
  base.rows = static_cast<std::int64_t>(corpus_->size());
  base.row_bytes = token_size(type);
  base.dtype = raw_dtype();
  base.name = corpus_->name();
  base.mapped_file = array.mapped_file;
  RowWindow w;
  w.is_unsigned = type == TokenType::UInt8 || type == TokenType::UInt16 || type == TokenType::UInt32;
  const std::uint64_t seq = options_.seq_len, tokens = corpus_->size();
  // window_start's rule, without a SampleContext (the same generator: Generator(seed, epoch, index)).
  if (options_.random_offset)
    w.start = [seq, tokens](std::size_t i, std::uint64_t seed, std::uint64_t epoch) {
      return Generator(seed, epoch, i).randint(tokens - seq);
    };
  else
    w.start = [seq](std::size_t i, std::uint64_t, std::uint64_t) { return static_cast<std::uint64_t>(i) * seq; };
  std::vector<HostRows> fields;
  if (options_.raw) {
    w.length = static_cast<std::int64_t>(seq + 1);
    w.dtype = raw_dtype();
    fields.push_back(base);
    fields.back().window = w;
    return fields;
  }
  w.length = static_cast<std::int64_t>(seq);
  w.dtype = options_.dtype;
  for (std::int64_t shift : {0, 1}) {
    fields.push_back(base);
    fields.back().window = w;
    fields.back().window->shift = shift;
  }
  return fields;
}

std::vector<std::string> TokenSequences::field_names() const {
  std::vector<std::string> names =
      options_.raw ? std::vector<std::string>{"tokens"} : std::vector<std::string>{"input_ids", "labels"};
  if (options_.packed) {
    names.emplace_back("position_ids");
    names.emplace_back("cu_seqlens");
  }
  return names;
}

DType TokenSequences::raw_dtype() const noexcept {
  switch (corpus_->type()) {
    case TokenType::UInt8: return DType::UInt8;
    case TokenType::Int8: return DType::Int8;
    case TokenType::Int16:
    case TokenType::UInt16: return DType::Int16;
    case TokenType::Int32:
    case TokenType::UInt32: return DType::Int32;
    case TokenType::Int64: return DType::Int64;
  }
  return DType::Int64;
}

namespace {
template <class T>
void store(const std::int64_t* src, std::size_t n, void* dst) {
  T* d = static_cast<T*>(dst);
  for (std::size_t i = 0; i < n; ++i) d[i] = static_cast<T>(src[i]);
}
}  // namespace

std::vector<Tensor> TokenSequences::make_batch(std::size_t rows, BatchAllocator& allocator) const {
  const auto n = static_cast<std::int64_t>(rows), len = static_cast<std::int64_t>(options_.seq_len);
  std::vector<Tensor> b;
  b.reserve(4);
  if (options_.raw) {
    b.push_back(empty(raw_dtype(), {n, len + 1}, allocator));
  } else {
    b.push_back(empty(options_.dtype, {n, len}, allocator));
    b.push_back(empty(options_.dtype, {n, len}, allocator));
  }
  if (options_.packed) {
    b.push_back(empty(options_.raw ? DType::Int32 : options_.dtype, {n, len}, allocator));
    b.push_back(empty(DType::Int32, {n, len + 1}, allocator));
  }
  return b;
}

void TokenSequences::prefetch(std::span<const std::size_t> indices) const {
  if (options_.random_offset || options_.shuffle_documents) return;
  thread_local std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  ranges.clear();
  for (std::size_t i : indices)
    if (i < size_) ranges.emplace_back(static_cast<std::uint64_t>(i) * options_.seq_len, options_.seq_len + 1);
  corpus_->prefetch(ranges);
}

std::vector<Tensor> TokenSequences::get(std::size_t index, SampleContext& ctx) const {
  std::vector<Tensor> b = make_batch(1, pageable_allocator());
  get_into(index, b, 0, ctx);
  for (Tensor& t : b) t = t.select(0);
  return b;
}

template <class Fn>
void TokenSequences::for_each_document(std::uint64_t lo, std::uint64_t hi, SampleContext& ctx, Fn&& fn) const {
  const std::uint64_t docs = corpus_->documents();
  if (!options_.shuffle_documents) {
    std::uint64_t a = 0, b = docs;  // the last document whose start <= lo
    while (b - a > 1) {
      const std::uint64_t m = a + (b - a) / 2;
      if (corpus_->document_offset(m) <= lo)
        a = m;
      else
        b = m;
    }
    for (std::uint64_t d = a, off = corpus_->document_offset(d); d < docs && off < hi; ++d) {
      const std::uint64_t end = corpus_->document_offset(d + 1);
      fn(off, end - off, off);
      off = end;
    }
    return;
  }
  // Note [Documents shuffled in blocks].
  const std::uint64_t D = options_.document_block, blocks = (docs + D - 1) / D;
  auto block_start = [&](std::uint64_t b) { return corpus_->document_offset(std::min(b * D, docs)); };
  std::uint64_t a = 0, b = blocks;
  while (b - a > 1) {
    const std::uint64_t m = a + (b - a) / 2;
    if (block_start(m) <= lo)
      a = m;
    else
      b = m;
  }
  std::uint64_t pos = block_start(a);
  for (std::uint64_t blk = a; blk < blocks && pos < hi; ++blk) {
    const std::uint64_t first = blk * D, count = std::min(D, docs - first);
    const IndexPermutation order(count, mix_seed(ctx.seed() ^ 0x646f637368756666ull, ctx.epoch(), blk));
    for (std::uint64_t j = 0; j < count && pos < hi; ++j) {
      const std::uint64_t d = first + order.at(j);
      const std::uint64_t off = corpus_->document_offset(d), len = corpus_->document_offset(d + 1) - off;
      if (pos + len > lo) fn(off, len, pos);
      pos += len;
    }
  }
}

void TokenSequences::read_window(std::size_t index, SampleContext& ctx, std::span<std::int64_t> window,
                                 std::vector<std::size_t>* starts) const {
  const std::size_t seq = options_.seq_len;
  const std::uint64_t start = window_start(index, ctx);
  if (!options_.shuffle_documents) {
    corpus_->read(start, window);
    if (!starts) return;
    thread_local std::vector<std::uint64_t> at;
    at.clear();
    corpus_->document_starts(start, window.first(seq), at);
    for (std::uint64_t p : at) starts->push_back(static_cast<std::size_t>(p - start));
    return;
  }
  // Note [Documents shuffled in blocks]
  // Block b holds documents [b * D, (b + 1) * D) in the
  // order IndexPermutation(D', key(seed, epoch, b)); its tokens start where the corpus order's do
  // (a block's length does not change with its order), so the block holding stream position p is
  // a binary search over block starts, and its documents are walked in their order from there
  // (for_each_document).
  std::size_t filled = 0;
  const std::uint64_t end = start + window.size();
  for_each_document(start, end, ctx, [&](std::uint64_t off, std::uint64_t len, std::uint64_t pos) {
    const std::uint64_t from = std::max(start, pos), to = std::min(end, pos + len);
    if (to <= from) return;  // an empty document
    const auto at = static_cast<std::size_t>(from - start);
    if (starts && pos > start && at < seq) starts->push_back(at);
    corpus_->read(off + (from - pos), window.subspan(at, static_cast<std::size_t>(to - from)));
    filled += static_cast<std::size_t>(to - from);
  });
  if (filled < window.size())
    throw Error(corpus_->name() + ": window " + std::to_string(index) + " runs past the stream's end (the index changed?)");
}

// Best-fit packing (Note [Best-fit packing], ferry/loaders/tokens.h). A group's pieces are known
// from the index alone; the sequences of the last group a thread packed are kept, keyed by
// (sequences, seed, epoch, group), so a sampler that visits a group's sequences together packs it once.
void TokenSequences::read_best_fit(std::size_t index, SampleContext& ctx, std::span<std::int64_t> inputs,
                                   std::span<std::int64_t> labels, std::vector<std::size_t>& starts) const {
  if (index >= size_)
    throw Error(corpus_->name() + ": window " + std::to_string(index) + " out of range for " + std::to_string(size_));
  struct Piece {
    std::uint64_t at;  // corpus offset
    std::uint64_t len;
  };
  struct Packed {
    std::uint64_t id = 0, seed = 0, epoch = 0, group = ~std::uint64_t{0};
    std::vector<std::vector<Piece>> bins;
  };
  thread_local Packed cache;
  const std::uint64_t S = options_.seq_len, G = options_.best_fit_group;
  const std::uint64_t group = index / G;
  if (cache.id != id_ || cache.seed != ctx.seed() || cache.epoch != ctx.epoch() || cache.group != group) {
    const std::uint64_t n = std::min<std::uint64_t>(G, size_ - group * G);  // the group's sequences
    const std::uint64_t lo = group * G * S, hi = lo + n * S;
    std::vector<Piece> pieces;
    for_each_document(lo, hi, ctx, [&](std::uint64_t off, std::uint64_t len, std::uint64_t pos) {
      const std::uint64_t a = std::max(lo, pos), b = std::min(hi, pos + len);
      for (std::uint64_t p = a; p < b; p += S) pieces.push_back({off + (p - pos), std::min(S, b - p)});
    });
    // Best fit decreasing: the longest first (then in stream order), each into the sequence whose
    // room it fills most closely (the first such).
    std::vector<std::size_t> order(pieces.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return pieces[x].len > pieces[y].len; });
    std::vector<std::uint64_t> room(n, S);
    std::vector<std::vector<Piece>> bins(n);
    std::vector<std::size_t> left;
    std::set<std::pair<std::uint64_t, std::size_t>> by_room;  // (room, sequence): the closest fit is a lower_bound
    for (std::size_t b = 0; b < n; ++b) by_room.emplace(S, b);
    for (std::size_t k : order) {
      const auto it = by_room.lower_bound({pieces[k].len, 0});
      if (it == by_room.end()) {
        left.push_back(k);
        continue;
      }
      const std::size_t best = it->second;
      by_room.erase(it);
      bins[best].push_back(pieces[k]);
      room[best] -= pieces[k].len;
      if (room[best] > 0) by_room.emplace(room[best], best);
    }
    // The pieces that fit nowhere fill the rooms left, in stream order, cut to fit (the rooms
    // hold exactly their tokens: the group's pieces are n * S tokens).
    std::sort(left.begin(), left.end());
    std::size_t b = 0;
    for (std::size_t k : left) {
      Piece p = pieces[k];
      while (p.len > 0) {
        while (b < n && room[b] == 0) ++b;
        if (b == n)
          throw Error(corpus_->name() + ": best-fit packing: group " + std::to_string(group) +
                      " has more tokens than its sequences hold (the index changed?)");
        const std::uint64_t take = std::min(p.len, room[b]);
        bins[b].push_back({p.at, take});
        room[b] -= take;
        p.at += take;
        p.len -= take;
      }
    }
    cache.bins = std::move(bins);
    cache.id = id_, cache.seed = ctx.seed(), cache.epoch = ctx.epoch(), cache.group = group;
  }
  const std::vector<Piece>& bin = cache.bins.at(index - group * G);
  const std::uint64_t tokens = corpus_->size();
  thread_local std::vector<std::int64_t> buf;
  std::size_t filled = 0;
  for (const Piece& p : bin) {
    if (filled + p.len > S) throw Error(corpus_->name() + ": best-fit packing: a sequence overflows (the index changed?)");
    const std::uint64_t n = std::min(p.len + 1, tokens - p.at);  // with the token after the piece, where there is one
    buf.resize(n);
    corpus_->read(p.at, buf);
    std::copy_n(buf.begin(), p.len, inputs.begin() + static_cast<std::ptrdiff_t>(filled));
    std::copy_n(buf.begin() + 1, n - 1, labels.begin() + static_cast<std::ptrdiff_t>(filled));
    if (n == p.len) labels[filled + p.len - 1] = buf[p.len - 1];  // the corpus's last token: no next one
    if (filled > 0) starts.push_back(filled);
    filled += p.len;
  }
  if (filled != S)
    throw Error(corpus_->name() + ": best-fit packing: sequence " + std::to_string(index) + " holds " + std::to_string(filled) +
                " tokens, not " + std::to_string(S));
}

void TokenSequences::get_into(std::size_t index, std::vector<Tensor>& batch, std::size_t row, SampleContext& ctx) const {
  const std::size_t seq = options_.seq_len;
  thread_local std::vector<std::int64_t> window;
  thread_local std::vector<std::size_t> starts;
  window.resize(seq + 1);
  starts.clear();
  thread_local std::vector<std::int64_t> labels;
  if (options_.best_fit_group > 0) {
    labels.resize(seq);
    read_best_fit(index, ctx, std::span(window).first(seq), labels, starts);
  } else {
    read_window(index, ctx, window, options_.packed ? &starts : nullptr);
  }
  const auto r = static_cast<std::int64_t>(row);
  auto field = [&](std::size_t k, const std::int64_t* src, std::size_t n) {
    void* dst = batch[k].select(r).raw();
    switch (batch[k].dtype()) {
      case DType::Int64: std::memcpy(dst, src, n * sizeof(std::int64_t)); break;
      case DType::Int32: store<std::int32_t>(src, n, dst); break;
      case DType::Int16: store<std::int16_t>(src, n, dst); break;  // uint16 ids keep their bits
      case DType::Int8: store<std::int8_t>(src, n, dst); break;
      default: store<std::uint8_t>(src, n, dst); break;
    }
  };
  std::size_t next_field = 2;
  if (options_.raw) {
    field(0, window.data(), seq + 1);
    next_field = 1;
  } else {
    field(0, window.data(), seq);
    field(1, options_.best_fit_group > 0 ? labels.data() : window.data() + 1, seq);
  }
  if (!options_.packed) return;
  thread_local std::vector<std::int64_t> positions;
  positions.resize(seq);
  auto* c = static_cast<std::int32_t*>(batch[next_field + 1].select(r).raw());
  std::size_t docs = 0, next = 0, first = 0;
  c[docs++] = 0;
  for (std::size_t k = 0; k < seq; ++k) {
    if (next < starts.size() && starts[next] == k) {
      first = k;
      ++next;
      c[docs++] = static_cast<std::int32_t>(k);
    }
    positions[k] = static_cast<std::int64_t>(k - first);
  }
  while (docs <= seq) c[docs++] = static_cast<std::int32_t>(seq);
  field(next_field, positions.data(), seq);
}

// --- permutations -------------------------------------------------------------------------------

IndexPermutation::IndexPermutation(std::uint64_t n, std::uint64_t key) noexcept : n_(n), key_(key) {
  const int bits = n <= 4 ? 2 : std::bit_width(n - 1);
  half_bits_ = (bits + 1) / 2;
}

std::uint64_t IndexPermutation::round(std::uint64_t half, int r) const noexcept {
  return mix_seed(key_, half, static_cast<std::uint64_t>(r)) & ((std::uint64_t{1} << half_bits_) - 1);
}

std::uint64_t IndexPermutation::at(std::uint64_t i) const noexcept {
  if (n_ <= 1) return i;
  const std::uint64_t mask = (std::uint64_t{1} << half_bits_) - 1;
  std::uint64_t x = i;
  do {  // cycle walking: a bijection of [0, 4^half_bits) applied until it lands in [0, n)
    std::uint64_t l = x >> half_bits_, r = x & mask;
    for (int k = 0; k < 4; ++k) {
      const std::uint64_t t = l ^ round(r, k);
      l = r;
      r = t;
    }
    x = (l << half_bits_) | r;
  } while (x >= n_);
  return x;
}

// --- mixtures -----------------------------------------------------------------------------------

// Note [Mixture draws]
// Within a phase (weights in force from `start`), position j of block b takes the slot
// IndexPermutation(block)(j); the slots [slot_begin[s], slot_begin[s + 1]) are source s's, so
// block b gives source s its k-th draws for k in [b * counts[s], (b + 1) * counts[s]), in the
// order of the permuted slots: O(1) a sample. Weights changed at an index inside a block leave
// some of that block's k unused; their draws wait in `pending` (sorted) and are the next phase's
// first, and the phase's draw k is pending[k], then next + (k - pending.size()): every draw of a
// source is taken once, in a block or two of where it would have been, whatever the changes.
struct Mixture::Phase {
  std::uint64_t start = 0;                          // the first global index drawn with these weights
  std::vector<std::size_t> counts;                  // a block's samples of each source
  std::vector<std::size_t> slot_begin;              // each source's first slot in a block (prefix sums), then the block size
  std::vector<std::vector<std::uint64_t>> pending;  // each source's draws left by the phase before, sorted
  std::vector<std::uint64_t> next;                  // each source's first draw after the pending ones
  std::vector<std::uint64_t> taken;                 // each source's samples before `start`
  std::uint64_t draw(std::size_t s, std::uint64_t k) const {
    return k < pending[s].size() ? pending[s][k] : next[s] + (k - pending[s].size());
  }
};

namespace {

std::vector<std::size_t> block_counts(const std::vector<double>& w, std::size_t block) {
  const double sum = std::accumulate(w.begin(), w.end(), 0.0);
  std::vector<std::size_t> counts(w.size());
  std::vector<std::pair<double, std::size_t>> frac;
  std::size_t given = 0;
  for (std::size_t s = 0; s < w.size(); ++s) {
    const double exact = static_cast<double>(block) * (w[s] / sum);
    counts[s] = std::min(block, static_cast<std::size_t>(std::floor(exact)));
    given += counts[s];
    frac.emplace_back(-(exact - std::floor(exact)), s);  // largest remainder first; ties to the lower source
  }
  std::sort(frac.begin(), frac.end());
  for (std::size_t k = 0; given < block && k < frac.size(); ++k, ++given) ++counts[frac[k].second];
  for (std::size_t k = 0; given < block; ++k, ++given)
    ++counts[k % counts.size()];  // rounding left a slot over (never in practice)
  return counts;
}

void check_weights(const std::vector<double>& w, std::size_t sources) {
  if (w.size() != sources)
    throw Error("Mixture: " + std::to_string(w.size()) + " weights for " + std::to_string(sources) +
                " sources (one weight each)");
  double sum = 0;
  for (std::size_t s = 0; s < w.size(); ++s) {
    if (!std::isfinite(w[s]) || w[s] < 0)
      throw Error("Mixture: weight " + std::to_string(s) + " is " + std::to_string(w[s]) + " (finite and >= 0 needed)");
    sum += w[s];
  }
  if (!(sum > 0)) throw Error("Mixture: the weights sum to 0");
}

}  // namespace

Mixture::Phase Mixture::make_phase(const std::vector<double>& weights, std::uint64_t start) const {
  check_weights(weights, sources_.size());
  Phase p;
  p.start = start;
  p.counts = block_counts(weights, options_.block);
  p.slot_begin.assign(1, 0);
  for (std::size_t c : p.counts) p.slot_begin.push_back(p.slot_begin.back() + c);
  return p;
}

std::size_t Mixture::phase_of(std::uint64_t global) const noexcept {
  const auto& phases = *phases_;
  std::size_t k = phases.size() - 1;
  while (k > 0 && phases[k].start > global) --k;
  return k;
}

Mixture::Mixture(std::vector<AnyDataset<std::vector<Tensor>>> sources, std::vector<double> weights, MixtureOptions options)
    : sources_(std::move(sources)), options_(options) {
  if (sources_.empty()) throw Error("Mixture: no sources");
  if (options_.block < 1) throw Error("Mixture: block must be >= 1");
  std::size_t total = 0;
  for (std::size_t s = 0; s < sources_.size(); ++s) {
    source_sizes_.push_back(sources_[s].size());
    if (source_sizes_.back() == 0) throw Error("Mixture: source " + std::to_string(s) + " has no samples");
    total += source_sizes_.back();
  }
  size_ = options_.size.value_or(total);
  Phase p = make_phase(weights, 0);
  p.pending.assign(sources_.size(), {});
  p.next.assign(sources_.size(), 0);
  p.taken.assign(sources_.size(), 0);
  phases_ = std::make_shared<const std::vector<Phase>>(std::vector<Phase>{std::move(p)});
}

namespace {
// The slot that position j of block b (of phase `phase`) takes: a permutation of the block.
std::uint64_t block_slot(std::uint64_t seed, std::size_t phase, std::uint64_t b, std::size_t block, std::uint64_t j) {
  return IndexPermutation(block, mix_seed(seed ^ 0x6d69787475726531ull, phase, b)).at(j);
}
std::size_t slot_source(const std::vector<std::size_t>& slot_begin, std::uint64_t slot) {
  return static_cast<std::size_t>(std::upper_bound(slot_begin.begin(), slot_begin.end(), slot) - slot_begin.begin() - 1);
}
}  // namespace

std::vector<std::uint64_t> Mixture::counts_before(std::uint64_t global) const {
  const std::size_t k = phase_of(global);
  const Phase& p = (*phases_)[k];
  const std::uint64_t r = global - p.start, blocks = r / options_.block, rem = r % options_.block;
  std::vector<std::uint64_t> out(sources_.size());
  for (std::size_t s = 0; s < out.size(); ++s) out[s] = p.taken[s] + blocks * p.counts[s];
  for (std::uint64_t j = 0; j < rem; ++j)
    ++out[slot_source(p.slot_begin, block_slot(options_.seed, k, blocks, options_.block, j))];
  return out;
}

Mixture Mixture::reweighted(std::vector<double> weights, std::uint64_t from) const {
  const auto& phases = *phases_;
  if (from < phases.back().start)
    throw Error("Mixture::reweighted: index " + std::to_string(from) + " is before the last weights' start " +
                std::to_string(phases.back().start));
  // Where `from` falls in the last phase: its draws k below b * counts are taken, and of block b's
  // the slots of positions [0, rem) (Note [Mixture draws]).
  const std::size_t last = phases.size() - 1;
  const Phase& old = phases.back();
  const std::uint64_t r = from - old.start, b = r / options_.block, rem = r % options_.block;
  std::vector<std::vector<bool>> used(sources_.size());
  for (std::size_t s = 0; s < used.size(); ++s) used[s].assign(old.counts[s], false);
  for (std::uint64_t j = 0; j < rem; ++j) {
    const std::uint64_t slot = block_slot(options_.seed, last, b, options_.block, j);
    const std::size_t s = slot_source(old.slot_begin, slot);
    used[s][slot - old.slot_begin[s]] = true;
  }
  Phase p = make_phase(weights, from);
  p.taken = counts_before(from);
  for (std::size_t s = 0; s < sources_.size(); ++s) {
    const std::uint64_t first = b * old.counts[s], end = first + old.counts[s];  // block b's k
    std::vector<std::uint64_t> pending;
    for (std::uint64_t k = first; k < end; ++k)
      if (!used[s][k - first]) pending.push_back(old.draw(s, k));
    for (std::uint64_t k = end; k < old.pending[s].size(); ++k) pending.push_back(old.pending[s][k]);
    std::sort(pending.begin(), pending.end());
    p.pending.push_back(std::move(pending));
    p.next.push_back(old.next[s] + (end > old.pending[s].size() ? end - old.pending[s].size() : 0));
  }
  auto next = phases;
  if (next.back().start == from)
    next.back() = std::move(p);  // new weights at the same index replace the last
  else
    next.push_back(std::move(p));
  Mixture m = *this;
  m.phases_ = std::make_shared<const std::vector<Phase>>(std::move(next));
  return m;
}

Mixture::Pick Mixture::pick(std::uint64_t global) const {
  const std::size_t k = phase_of(global);
  const Phase& p = (*phases_)[k];
  const std::uint64_t r = global - p.start, b = r / options_.block, j = r % options_.block;
  const std::uint64_t slot = block_slot(options_.seed, k, b, options_.block, j);
  Pick out;
  out.source = slot_source(p.slot_begin, slot);
  out.draw = p.draw(out.source, b * p.counts[out.source] + (slot - p.slot_begin[out.source]));
  const std::uint64_t n = source_sizes_[out.source];
  out.sample =
      static_cast<std::size_t>(IndexPermutation(n, mix_seed(options_.seed, out.source + 1, out.draw / n)).at(out.draw % n));
  return out;
}

std::vector<Tensor> Mixture::get(std::size_t index, SampleContext& ctx) const {
  if (index >= size_) throw Error("Mixture: index " + std::to_string(index) + " out of range for " + std::to_string(size_));
  const Pick p = pick(ctx.epoch() * size_ + index);
  // The source's own randomness (random_offset windows, transforms) keyed by its epoch and sample.
  SampleContext sub(p.sample, mix_seed(options_.seed, p.source + 1), p.draw / source_sizes_[p.source], ctx.worker());
  return sources_[p.source].get(p.sample, sub);
}

}  // namespace ferry
