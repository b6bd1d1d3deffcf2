// python/src/text.cpp — ferry.Tokenizer: the tokenizers the loaders run (ferry/loaders/tokenizer.h),
// for a script to check its ids against its own tokenizer's, and for the benchmarks.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <thread>

#include "ferry/loaders/tokenizer.h"
#include "module.h"
#include "python_datasets.h"

namespace ferry_py {
namespace {

using namespace nb::literals;
using Tok = const ferry::Tokenizer;

// The ids of each text, on `threads` threads with the GIL released.
std::vector<std::vector<std::int32_t>> encode_batch(const ferry::Tokenizer& tok, const std::vector<std::string>& texts,
                                                    int threads) {
  std::vector<std::vector<std::int32_t>> out(texts.size());
  NoGil nogil;
  const auto n = static_cast<std::size_t>(std::clamp(threads, 1, 256));
  if (n == 1 || texts.size() < 2) {
    for (std::size_t i = 0; i < texts.size(); ++i) tok.encode(texts[i], out[i]);
    return out;
  }
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::jthread> pool;
  for (std::size_t t = 0; t < n; ++t)
    pool.emplace_back([&, t] {
      try {
        for (std::size_t i = t; i < texts.size(); i += n) tok.encode(texts[i], out[i]);
      } catch (...) {
        errors[t] = std::current_exception();
      }
    });
  pool.clear();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

}  // namespace

void register_text(nb::module_& m) {
  nb::class_<Tok>(m, "Tokenizer",
                  "A tokenizer.json (BPE) or SentencePiece .model, as ferry's loaders run it (ferry/loaders/tokenizer.h).")
      .def_static("from_file", &ferry::open_tokenizer, "path"_a,
                  "Opens a tokenizer file: `.model` a SentencePiece model, anything else a tokenizer.json.")
      .def(
          "encode", [](Tok& t, std::string_view text) { return t.encode(text); }, "text"_a,
          "The ids of `text` (no BOS/EOS), as `tokenizers`' encode(text, add_special_tokens=False).ids.")
      .def(
          "encode",
          [](Tok& t, const nb::bytes& text) {
            std::vector<std::int32_t> out;
            t.encode(std::string_view(text.c_str(), text.size()), out, "bytes");
            return out;
          },
          "text"_a, "The ids of UTF-8 bytes (ferry.DataError naming the first byte that is not UTF-8).")
      .def("encode_batch", &encode_batch, "texts"_a, "threads"_a = 1,
           "The ids of each text, on `threads` threads (the GIL released).")
      .def_prop_ro("vocab_size", &Tok::vocab_size, "Ids are below this.")
      .def("token_id", &Tok::token_id, "token"_a, "The id of a vocabulary entry or added token by its text, or None.")
      .def_prop_ro(
          "name", [](Tok& t) { return t.name(); }, "The file it was read from.");
}

}  // namespace ferry_py
