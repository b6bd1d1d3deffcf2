// Token files: the token types, flat token files (nanoGPT's raw .bin, llm.c's .bin, a 1-D .npy)
// as a TokenCorpus (ferry/loaders/tokens.h). megatron.cpp has Megatron-LM's indexed datasets,
// sequences.cpp the sequences cut from a corpus, mixture.cpp the mixtures.
#include <algorithm>
#include <cstring>

#include "ferry/loaders/tokens.h"
#include "token_bytes.h"

namespace ferry {

using loaders::Bytes;
using loaders::load;
using loaders::TokenBytes;

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

}  // namespace ferry
