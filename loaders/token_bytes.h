// The token files' bytes (token_files.cpp, megatron.cpp): a file mapped, an object read by ranged
// requests or bytes in memory (Bytes), and the tokens stored in them widened to int64 and checked
// against a vocabulary (TokenBytes).
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ferry/loaders/tokens.h"
#include "io.h"

namespace ferry::loaders {

// A T stored at `p` (the formats are little-endian, as is every host ferry builds for).
template <class T>
inline T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <class T>
void widen_as(const std::byte* src, std::span<std::int64_t> out) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::int64_t>(load<T>(src + i * sizeof(T)));
}

inline void widen(TokenType type, const std::byte* src, std::span<std::int64_t> out) {
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
    thread_local std::vector<std::byte> scratch;  // an object's bytes, read by request
    widen(type_, bytes_.view(offset_ + begin * isz, out.size() * isz, scratch), out);
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

}  // namespace ferry::loaders
