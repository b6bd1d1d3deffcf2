// tokenizer_impl.h — what tokenizer.cpp and sentencepiece.cpp share.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "ferry/loaders/tokenizer.h"

namespace ferry::detail {

/// A SentencePiece model (Note [SentencePiece]) from the file's bytes; `path` names it.
std::shared_ptr<const Tokenizer> open_sentencepiece(const std::string& path, const std::string& bytes);

/// The offset of the first byte of `s` that is not part of valid UTF-8 (overlong forms,
/// surrogates and code points past U+10FFFF included), or npos.
std::size_t invalid_utf8(std::string_view s) noexcept;

}  // namespace ferry::detail
