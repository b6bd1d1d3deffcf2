// ferry/loaders/tokenizer.h — text to token ids in the loader's workers, from the tokenizer files
// models ship: a Hugging Face `tokenizer.json` or a SentencePiece `.model`.
//
//   auto tok = ferry::open_tokenizer("tokenizer.json");      // or "spm.model"
//   std::vector<std::int32_t> ids;
//   tok->encode("Hello, world", ids);                       // appends; no BOS/EOS added
//
// Note [tokenizer.json]
// The file's stages run as the `tokenizers` library runs them for encode(text,
// add_special_tokens=False), and give the same ids:
// * added tokens (special or not) found in the text first, leftmost and longest first; each is its
//   id, and the text between them goes through the stages below piece by piece. Only added tokens
//   with single_word, lstrip and rstrip false are taken (what byte-level models ship).
// * normalizer: none, Prepend, Replace (a string pattern), or a Sequence of these.
// * pre_tokenizer: ByteLevel (add_prefix_space; use_regex: GPT-2's split), Split (a regex or string
//   pattern; behavior Isolated or Removed; invert false), or a Sequence of these with ByteLevel, if
//   present, last. Regexes run on PCRE2 (Unicode properties; `tokenizers` uses Oniguruma: the two
//   agree on the patterns models ship, and on every document of the test corpus, but follow
//   their own Unicode versions for characters added recently).
// * model: BPE with its vocab and merges (either file layout), ignore_merges, byte_fallback,
//   unk_token and fuse_unk; no dropout, continuing_subword_prefix or end_of_word_suffix.
// Any other stage or option the file names is refused by its name (ferry::Error at open), never
// guessed: Unigram and WordPiece models, NFC/NFKC and other normalizers, Metaspace, Digits and
// other pre-tokenizers. The post_processor and decoder are not read (encode adds no special
// tokens; ferry adds BOS/EOS per document where its options ask).
//
// Note [SentencePiece]
// A `.model` file is read by the SentencePiece library ferry links (Debian's libsentencepiece
// 0.1.97), and the ids are that library's. PyPI's `sentencepiece` 0.2 breaks ties between equally
// scored unigram segmentations differently (`333` as `33`+`3` against `3`+`33`), so a few
// documents in a hundred differ from it; users of 0.2 who need its ids exactly use the model's
// `tokenizer.json`, or from Python a callable tokenizer.
//
// Text must be UTF-8: anything else is a DataError naming `where` (the caller's file and row) and
// the byte offset.
//
// Thread safety: a Tokenizer is immutable after open and encode() may run on many threads at once
// (each keeps its own cache of recent words).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ferry {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// Appends the ids of `text` to `out` (no BOS or EOS). `where` names the text in a DataError
  /// (for example "train.parquet, row group 3, row 17").
  virtual void encode(std::string_view text, std::vector<std::int32_t>& out, std::string_view where = {}) const = 0;
  /// The ids of `text`.
  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> out;
    encode(text, out);
    return out;
  }
  /// Ids are below this.
  virtual std::size_t vocab_size() const noexcept = 0;
  /// The id of a token of the vocabulary or an added token, by its text ("<|endoftext|>").
  virtual std::optional<std::int32_t> token_id(std::string_view token) const = 0;
  /// The file it was read from.
  virtual const std::string& name() const noexcept = 0;
};

/// Opens a tokenizer file: `.model` a SentencePiece model, anything else a `tokenizer.json`.
/// ferry::Error for a file that does not parse or names a stage ferry lacks (by its name).
std::shared_ptr<const Tokenizer> open_tokenizer(const std::string& path);
/// A `tokenizer.json` given as text; `name` names it in errors.
std::shared_ptr<const Tokenizer> tokenizer_from_json(std::string_view json, const std::string& name);

}  // namespace ferry
