// Megatron-LM indexed datasets (prefix.bin + prefix.idx) as a TokenCorpus (ferry/loaders/tokens.h).
#include <algorithm>
#include <cstring>

#include "ferry/loaders/tokens.h"
#include "token_bytes.h"

namespace ferry {

using loaders::Bytes;
using loaders::load;
using loaders::TokenBytes;

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
  // An index entry read by request (an .idx in object storage read whole is in memory): this
  // thread's bytes of it.
  static std::vector<std::byte>& scratch() {
    thread_local std::vector<std::byte> bytes;
    return bytes;
  }
  std::uint64_t bin_tokens(std::uint64_t bytes) const { return bytes / token_size(type_); }
  std::uint64_t pointer(std::uint64_t j) const {
    const std::int64_t p = load<std::int64_t>(idx_.view(pointers_at_ + j * 8, 8, scratch()));
    if (p < 0 || static_cast<std::uint64_t>(p) % token_size(type_) != 0)
      throw DataError(
          idx_.name(), pointers_at_ + j * 8,
          "sequence " + std::to_string(j) + "'s pointer " + std::to_string(p) + " is negative or not a whole token's offset");
    return static_cast<std::uint64_t>(p);
  }
  std::uint64_t length(std::uint64_t j) const {
    const std::int32_t n = load<std::int32_t>(idx_.view(lengths_at_ + j * 4, 4, scratch()));
    if (n < 0)
      throw DataError(idx_.name(), lengths_at_ + j * 4,
                      "sequence " + std::to_string(j) + " has a negative length " + std::to_string(n));
    return static_cast<std::uint64_t>(n);
  }
  std::uint64_t doc_index(std::uint64_t k) const {
    return static_cast<std::uint64_t>(load<std::int64_t>(idx_.view(docs_at_ + k * 8, 8, scratch())));
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

}  // namespace ferry
