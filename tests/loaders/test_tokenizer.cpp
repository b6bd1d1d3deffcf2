// The tokenizer.json reader on small files written here (python/tests/test_text.py compares whole
// corpora with `tokenizers` and SentencePiece): merge order, added tokens, byte fallback, the
// stages refused by name, text that is not UTF-8, and encode() from several threads at once.
#include <catch2/catch.hpp>

#include <string>
#include <thread>
#include <vector>

#include "ferry/core/error.h"
#include "ferry/loaders/tokenizer.h"

using Catch::Contains;
using Ids = std::vector<std::int32_t>;

namespace {

// GPT-2's layout over a tiny vocabulary: "Ġ" is the byte-level space.
const char* kByteLevel = R"({
  "added_tokens": [{"id": 9, "content": "<|eot|>", "special": true, "normalized": false}],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
  "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "Ġ": 3, "ab": 4, "bc": 5, "abc": 6, "Ġab": 7, "1": 8},
            "merges": [["b", "c"], ["a", "b"], ["a", "bc"], ["Ġ", "ab"]]}})";

}  // namespace

TEST_CASE("BPE merges by rank, lowest first, as tokenizers does", "[tokenizer]") {
  const auto tok = ferry::tokenizer_from_json(kByteLevel, "tiny.json");
  CHECK(tok->vocab_size() == 10);
  // "abc": b+c (rank 0) before a+b (rank 1), then a+bc.
  CHECK(tok->encode("abc") == Ids{6});
  // " ab" is a word of its own (GPT-2's split keeps the space): Ġ + ab.
  CHECK(tok->encode("ab ab") == Ids{4, 7});
  CHECK(tok->encode("ab<|eot|>c") == Ids{4, 9, 2});
  CHECK(tok->encode("") == Ids{});
  // Bytes the vocabulary lacks ("d", no unk): dropped, as tokenizers drops them.
  CHECK(tok->encode("dab") == Ids{4});
  CHECK(tok->token_id("<|eot|>") == 9);
  CHECK(tok->token_id("Ġab") == 7);
  CHECK_FALSE(tok->token_id("zz").has_value());
}

TEST_CASE("Character BPE with byte fallback and fused unk", "[tokenizer]") {
  const auto tok = ferry::tokenizer_from_json(R"({
    "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "_"},
                                                       {"type": "Replace", "pattern": {"String": " "}, "content": "_"}]},
    "pre_tokenizer": null,
    "model": {"type": "BPE", "byte_fallback": true, "fuse_unk": true, "unk_token": "<unk>",
              "vocab": {"<unk>": 0, "_": 1, "a": 2, "_a": 3, "<0xC3>": 4, "<0xA9>": 5},
              "merges": ["_ a"]}})",
                                              "fallback.json");
  // "a é": _a, _, then é's two bytes by fallback.
  CHECK(tok->encode("a \xc3\xa9") == Ids{3, 1, 4, 5});
  // "日本" has no byte tokens: one fused unk.
  CHECK(tok->encode("a\xe6\x97\xa5\xe6\x9c\xac") == Ids{3, 0});
}

TEST_CASE("Stages ferry lacks are refused by name", "[tokenizer]") {
  CHECK_THROWS_WITH(ferry::tokenizer_from_json(R"({"model": {"type": "Unigram", "vocab": []}})", "u.json"),
                    Contains("u.json: model Unigram"));
  CHECK_THROWS_WITH(ferry::tokenizer_from_json(
                        R"({"normalizer": {"type": "NFKC"}, "model": {"type": "BPE", "vocab": {}, "merges": []}})", "n.json"),
                    Contains("normalizer NFKC"));
  CHECK_THROWS_WITH(ferry::tokenizer_from_json(R"({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                        {"type": "ByteLevel"}, {"type": "Digits"}]}, "model": {"type": "BPE", "vocab": {}, "merges": []}})",
                                               "o.json"),
                    Contains("pre_tokenizer Digits after ByteLevel"));
  CHECK_THROWS_WITH(ferry::tokenizer_from_json("[1, 2", "x.json"), Contains("x.json: not JSON"));
  CHECK_THROWS_WITH(ferry::tokenizer_from_json(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})", "m.json"),
                    Contains("merge 0 (a b) names a token not in the vocab"));
  CHECK_THROWS_WITH(ferry::open_tokenizer("/nonexistent/tokenizer.json"), Contains("cannot open"));
}

TEST_CASE("Text that is not UTF-8 is a DataError naming where and the byte", "[tokenizer]") {
  const auto tok = ferry::tokenizer_from_json(kByteLevel, "tiny.json");
  std::vector<std::int32_t> out;
  try {
    tok->encode(std::string("ab\xff", 3), out, "t.parquet, row group 2, row 5");
    FAIL("no error");
  } catch (const ferry::DataError& e) {
    CHECK(e.offset() == 2);
    CHECK_THAT(std::string(e.what()), Contains("t.parquet, row group 2, row 5: at byte 2: not UTF-8"));
  }
  for (const char* bad : {"\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe6\x97"})
    CHECK_THROWS_AS(tok->encode(bad), ferry::DataError);
}

TEST_CASE("encode() from many threads gives each the same ids", "[tokenizer][threads]") {
  const auto tok = ferry::tokenizer_from_json(kByteLevel, "tiny.json");
  std::string text;
  for (int i = 0; i < 200; ++i) text += "abc ab<|eot|>bc a1 ";
  const Ids want = tok->encode(text);
  std::vector<Ids> got(4);
  {
    std::vector<std::jthread> threads;
    for (std::size_t t = 0; t < got.size(); ++t)
      threads.emplace_back([&, t] {
        for (int r = 0; r < 20; ++r) got[t] = tok->encode(text);
      });
  }
  for (const Ids& g : got) CHECK(g == want);
}
