// sentencepiece.cpp — SentencePiece models through the library ferry links (Note [SentencePiece]
// in ferry/loaders/tokenizer.h).
#include <sentencepiece_processor.h>

#include "ferry/core/error.h"
#include "tokenizer_impl.h"

namespace ferry::detail {
namespace {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& path, const std::string& bytes) : name_(path) {
    const auto status = sp_.LoadFromSerializedProto(bytes);
    if (!status.ok()) throw Error("tokenizer " + path + ": not a SentencePiece model: " + status.ToString());
  }
  void encode(std::string_view text, std::vector<std::int32_t>& out, std::string_view where) const override {
    const std::size_t bad = invalid_utf8(text);
    if (bad != std::string_view::npos)
      throw DataError(std::string(where.empty() ? "text" : where), bad, "not UTF-8 (the tokenizer takes UTF-8 text)");
    thread_local std::vector<int> ids;
    ids.clear();
    const auto status = sp_.Encode(text, &ids);
    if (!status.ok())
      throw DataError(std::string(where.empty() ? "text" : where), DataError::kNoOffset, "SentencePiece: " + status.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
  }
  std::size_t vocab_size() const noexcept override { return static_cast<std::size_t>(sp_.GetPieceSize()); }
  std::optional<std::int32_t> token_id(std::string_view token) const override {
    const int id = sp_.PieceToId(token);
    // PieceToId answers unk's id for a piece it lacks: only unk's own text maps there.
    if (id == sp_.unk_id() && sp_.IdToPiece(id) != token) return std::nullopt;
    return id;
  }
  const std::string& name() const noexcept override { return name_; }

 private:
  std::string name_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

std::shared_ptr<const Tokenizer> open_sentencepiece(const std::string& path, const std::string& bytes) {
  return std::make_shared<SentencePieceTokenizer>(path, bytes);
}

}  // namespace ferry::detail
