// Tests that token files (raw, llm.c, .npy) and Megatron-LM indexed datasets (files megatron-core
// wrote) read back token for token; that windows cover every token once an epoch and packed
// sequences carry their documents' boundaries; that a mixture meets its weights per block,
// changes them at an index without touching what came before, and resumes exactly at other worker
// counts and world sizes (4 -> 3 -> 2 -> 1, ranks simulated in one process); and that damaged
// files are DataErrors naming the file and the offset.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <map>
#include <numeric>
#include <set>

#include "ferry/ferry.h"
#include "loaders/files.h"

using namespace ferry;
using namespace ferry::test;

// Options below are written with designated initializers, which GCC 12 reports under -Wextra for
// every member left to its default.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace {

std::vector<std::uint16_t> pattern(std::size_t n) {
  std::vector<std::uint16_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint16_t>((i * 7 + 3) % 65521);
  return v;
}

std::vector<std::int64_t> values(const Tensor& t) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < out.size(); ++i) {
    const auto k = static_cast<std::int64_t>(i);
    out[i] = t.dtype() == DType::Int64   ? t.item<std::int64_t>(k)
             : t.dtype() == DType::Int16 ? t.item<std::int16_t>(k)
                                         : t.item<std::int32_t>(k);
  }
  return out;
}

// Every batch of one epoch, each field's values.
template <class D>
std::vector<std::vector<std::vector<std::int64_t>>> epoch(const D& dataset, DataLoaderOptions o, std::uint64_t e = 0) {
  DataLoader loader(dataset, o);
  loader.set_epoch(e);
  std::vector<std::vector<std::vector<std::int64_t>>> out;
  for (auto& batch : loader) {
    std::vector<std::vector<std::int64_t>> fields;
    for (const Tensor& t : batch) fields.push_back(values(t));
    out.push_back(std::move(fields));
  }
  return out;
}

DataLoaderOptions opts(std::size_t batch, int workers, bool shuffle = true) {
  DataLoaderOptions o;
  o.batch_size = batch;
  o.num_workers = workers;
  o.shuffle = shuffle;
  o.seed = 99;
  return o;
}

struct Fixture {
  std::string prefix;
  std::int64_t vocab;
  std::vector<std::uint64_t> lengths;
};
Fixture fixture(const std::string& name) {
  const std::string prefix = std::string(FERRY_TEST_FIXTURES) + "/megatron/" + name;
  std::ifstream f(prefix + ".json");
  REQUIRE(f.good());
  const nlohmann::json j = nlohmann::json::parse(f);
  return {prefix, j["vocab"].get<std::int64_t>(), j["lengths"].get<std::vector<std::uint64_t>>()};
}

}  // namespace

TEST_CASE("raw, llm.c and .npy token files read back token for token", "[unit][tokens]") {
  TempDir dir;
  const auto tokens = pattern(1000);
  write_file(dir / "raw.bin", raw_bytes(tokens));
  Bytes llmc(1024);
  const std::int32_t header[3] = {20240520, 1, 1000};
  std::memcpy(llmc.data(), header, sizeof header);
  const Bytes body = raw_bytes(tokens);
  llmc.insert(llmc.end(), body.begin(), body.end());
  write_file(dir / "llmc.bin", llmc);
  write_file(dir / "t.npy", npy_bytes("{'descr': '<u2', 'fortran_order': False, 'shape': (1000,), }", body));
  std::vector<std::uint32_t> wide(tokens.begin(), tokens.end());
  wide[5] = 100000;  // past uint16
  Bytes llmc2(1024);
  const std::int32_t header2[3] = {20240520, 2, 1000};
  std::memcpy(llmc2.data(), header2, sizeof header2);
  const Bytes body2 = raw_bytes(wide);
  llmc2.insert(llmc2.end(), body2.begin(), body2.end());
  write_file(dir / "llmc2.bin", llmc2);

  for (const auto& [path, type] : std::vector<std::pair<std::string, TokenType>>{
           {dir / "raw.bin", TokenType::UInt16}, {dir / "llmc.bin", TokenType::UInt16}, {dir / "t.npy", TokenType::UInt16}}) {
    INFO(path);
    auto corpus = open_token_file(path, {.type = TokenType::UInt16});
    CHECK(corpus->size() == 1000);
    CHECK(corpus->type() == type);
    std::vector<std::int64_t> out(10);
    corpus->read(990, out);
    for (std::size_t i = 0; i < 10; ++i) CHECK(out[i] == tokens[990 + i]);
  }
  auto c2 = open_token_file(dir / "llmc2.bin");
  CHECK(c2->type() == TokenType::UInt32);
  std::vector<std::int64_t> out(6);
  c2->read(0, out);
  CHECK(out[5] == 100000);
  // The header's type is checked against one given.
  CHECK_THROWS_WITH(open_token_file(dir / "llmc2.bin", {.type = TokenType::UInt16}), Catch::Contains("holds uint32 tokens"));
  CHECK_THROWS_WITH(open_token_file(dir / "raw.bin"), Catch::Contains("needs its token type"));
}

TEST_CASE("a token file larger than the machine's memory and swap is mapped (2 TiB, sparse)", "[unit][tokens]") {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  WARN("skipped under a sanitizer: its mmap interceptor touches shadow memory in proportion to the mapping");
  return;
#endif
  TempDir dir;
  const std::string path = dir / "huge.bin";
  const std::uint64_t bytes = std::uint64_t{1} << 41;  // 2^40 uint16 tokens: no machine's RAM + swap
  {
    std::ofstream(path, std::ios::binary).put('\0');
    std::filesystem::resize_file(path, bytes);
  }
  const auto corpus = open_token_file(path, {.type = TokenType::UInt16});  // a private mapping charged in full failed here
  CHECK(corpus->size() == bytes / 2);
  TokenSequences seqs(corpus, {.seq_len = 4096});
  CHECK(seqs.size() == (bytes / 2 - 1) / 4096);
  const WorkerInfo w;
  SampleContext ctx(seqs.size() - 1, 0, 0, w);
  const std::vector<Tensor> last = seqs.get(seqs.size() - 1, ctx);  // a window near the end: zeros, read
  CHECK(last.at(0).data<std::int64_t>()[4095] == 0);
}

TEST_CASE("damaged token files are DataErrors naming the file and the offset", "[errors][tokens]") {
  TempDir dir;
  const Bytes body = raw_bytes(pattern(100));
  auto error_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const DataError& e) {
      return e.what();
    } catch (const std::exception& e) {
      return std::string("not a DataError: ") + e.what();
    }
    return "no error";
  };
  // llm.c: wrong magic (format forced), bad version, a count the file does not hold, a short header.
  Bytes bad(1024);
  std::int32_t h[3] = {1234, 1, 100};
  std::memcpy(bad.data(), h, sizeof h);
  bad.insert(bad.end(), body.begin(), body.end());
  write_file(dir / "magic.bin", bad);
  CHECK_THROWS_WITH(open_token_file(dir / "magic.bin", {.format = TokenFileOptions::Format::LlmC}),
                    Catch::Contains("magic.bin: at byte 0") && Catch::Contains("20240520"));
  h[0] = 20240520;
  h[1] = 7;
  std::memcpy(bad.data(), h, sizeof h);
  write_file(dir / "version.bin", bad);
  CHECK(error_of([&] {
          open_token_file(dir / "version.bin");
        }).find("version.bin: at byte 4: unsupported llm.c token file version 7") != std::string::npos);
  h[1] = 1;
  h[2] = 101;
  std::memcpy(bad.data(), h, sizeof h);
  write_file(dir / "count.bin", bad);
  CHECK(error_of([&] { open_token_file(dir / "count.bin"); }).find("(truncated)") != std::string::npos);
  write_file(dir / "short.bin", Bytes(bad.begin(), bad.begin() + 100));
  CHECK(error_of([&] {
          open_token_file(dir / "short.bin", {.format = TokenFileOptions::Format::LlmC});
        }).find("truncated llm.c header") != std::string::npos);
  // Raw: an odd number of bytes for uint16 tokens; a token past the vocabulary, named with its offset.
  write_file(dir / "odd.bin", Bytes(body.begin(), body.end() - 1));
  CHECK(error_of([&] { open_token_file(dir / "odd.bin", {.type = TokenType::UInt16}); }).find("odd.bin: at byte 198") !=
        std::string::npos);
  write_file(dir / "ok.bin", body);
  auto v = open_token_file(dir / "ok.bin", {.type = TokenType::UInt16, .vocab_size = 500});
  std::vector<std::int64_t> out(100);
  const std::string e = error_of([&] { v->read(0, out); });
  const auto toks = pattern(100);
  const std::size_t first_bad =
      static_cast<std::size_t>(std::find_if(toks.begin(), toks.end(), [](auto t) { return t >= 500; }) - toks.begin());
  CHECK(e.find("ok.bin: at byte " + std::to_string(first_bad * 2) + ": token id") != std::string::npos);
  CHECK(e.find("outside the vocabulary [0, 500)") != std::string::npos);
  // .npy: 2-D, floats.
  write_file(dir / "2d.npy", npy_bytes("{'descr': '<u2', 'fortran_order': False, 'shape': (10, 10), }", body));
  CHECK(error_of([&] { open_token_file(dir / "2d.npy"); }).find("must be 1-D") != std::string::npos);
  write_file(dir / "f.npy", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (50,), }", body));
  CHECK(error_of([&] { open_token_file(dir / "f.npy"); }).find("not '<f4'") != std::string::npos);
  CHECK(error_of([&] { open_token_file(dir / "missing.bin", {.type = TokenType::UInt16}); }).find("missing.bin") !=
        std::string::npos);
  write_file(dir / "empty.bin", {});
  CHECK(error_of([&] { open_token_file(dir / "empty.bin", {.type = TokenType::UInt16}); }).find("empty.bin") !=
        std::string::npos);
}

TEST_CASE("windows hold every token once an epoch, labels shifted by one, the same batches for 0, 1 and 4 workers",
          "[unit][tokens][ordering]") {
  TempDir dir;
  const auto tokens = pattern(16 * 50 + 7);
  write_file(dir / "t.bin", raw_bytes(tokens));
  TokenSequences seqs(open_token_file(dir / "t.bin", {.type = TokenType::UInt16}), {.seq_len = 16});
  REQUIRE(seqs.size() == 50);
  CHECK(seqs.field_names() == std::vector<std::string>{"input_ids", "labels"});
  const auto ref = epoch(seqs, opts(8, 0));
  REQUIRE(ref.size() == 7);
  std::multiset<std::int64_t> starts;
  for (const auto& b : ref) {
    const auto& in = b[0];
    const auto& lab = b[1];
    REQUIRE(in.size() % 16 == 0);
    for (std::size_t r = 0; r < in.size() / 16; ++r) {
      // Find the window by its first token's position: the pattern is injective over 0..806.
      const auto pos = static_cast<std::size_t>(std::find(tokens.begin(), tokens.end(), in[r * 16]) - tokens.begin());
      CHECK(pos % 16 == 0);
      starts.insert(static_cast<std::int64_t>(pos));
      for (std::size_t k = 0; k < 16; ++k) {
        CHECK(in[r * 16 + k] == tokens[pos + k]);
        CHECK(lab[r * 16 + k] == tokens[pos + k + 1]);
      }
    }
  }
  CHECK(starts.size() == 50);
  CHECK(std::set<std::int64_t>(starts.begin(), starts.end()).size() == 50);  // each window once
  CHECK(epoch(seqs, opts(8, 1)) == ref);
  CHECK(epoch(seqs, opts(8, 4)) == ref);
  CHECK(epoch(seqs, opts(8, 4), 1) != ref);  // another epoch, another order
  // Raw windows: the seq_len + 1 tokens as the file stores them (uint16 bits in an int16 tensor).
  TokenSequences raw(open_token_file(dir / "t.bin", {.type = TokenType::UInt16}), {.seq_len = 16, .raw = true});
  CHECK(raw.field_names() == std::vector<std::string>{"tokens"});
  CHECK(raw.raw_dtype() == DType::Int16);
  const auto raw_batches = epoch(raw, opts(8, 2));
  REQUIRE(raw_batches.size() == ref.size());
  for (std::size_t b = 0; b < ref.size(); ++b)
    for (std::size_t r = 0; r < ref[b][0].size() / 16; ++r)
      for (std::size_t k = 0; k < 17; ++k) {
        const auto v = static_cast<std::uint16_t>(raw_batches[b][0][r * 17 + k]);
        CHECK(v == (k < 16 ? ref[b][0][r * 16 + k] : ref[b][1][r * 16 + 15]));
      }
  // int32 output
  TokenSequences narrow(open_token_file(dir / "t.bin", {.type = TokenType::UInt16}), {.seq_len = 16, .dtype = DType::Int32});
  DataLoader l(narrow, opts(4, 0));
  for (auto& b : l) {
    CHECK(b[0].dtype() == DType::Int32);
    break;
  }
  CHECK_THROWS_WITH(TokenSequences(open_token_file(dir / "t.bin", {.type = TokenType::UInt16}), {.seq_len = 1000}),
                    Catch::Contains("fewer than one window"));
  CHECK_THROWS_WITH(TokenSequences(open_token_file(dir / "t.bin", {.type = TokenType::UInt16}), {.packed = true}),
                    Catch::Contains("need the corpus's documents"));
}

TEST_CASE("random-offset windows are the same for any worker count and are windows of the file", "[unit][tokens][ordering]") {
  TempDir dir;
  const auto tokens = pattern(3000);
  write_file(dir / "t.bin", raw_bytes(tokens));
  TokenSequences seqs(open_token_file(dir / "t.bin", {.type = TokenType::UInt16}),
                      {.seq_len = 32, .random_offset = true, .num_samples = 40});
  REQUIRE(seqs.size() == 40);
  const auto ref = epoch(seqs, opts(8, 0, false));
  CHECK(epoch(seqs, opts(8, 3, false)) == ref);
  std::set<std::size_t> offsets;
  for (const auto& b : ref)
    for (std::size_t r = 0; r < b[0].size() / 32; ++r) {
      const auto pos = static_cast<std::size_t>(std::find(tokens.begin(), tokens.end(), b[0][r * 32]) - tokens.begin());
      REQUIRE(pos + 33 <= tokens.size());
      offsets.insert(pos);
      for (std::size_t k = 0; k < 32; ++k) CHECK(b[1][r * 32 + k] == tokens[pos + k + 1]);
    }
  CHECK(offsets.size() > 30);  // random offsets, not the 93 aligned windows' starts only
  CHECK(std::any_of(offsets.begin(), offsets.end(), [](std::size_t p) { return p % 32 != 0; }));
}

// Note [Token windows on the GPU]: what the device gather is given (the GPU test checks what it
// makes): input_ids and labels as windows of the file at shifts 0 and 1, starting where
// window_start says, and a reason wherever the windows are not runs of one array in memory.
TEST_CASE("token windows offered to the device gather are the host path's windows of the file", "[unit][tokens][gather]") {
  TempDir dir;
  const auto tokens = pattern(3000);
  write_file(dir / "t.bin", raw_bytes(tokens));
  const auto corpus = open_token_file(dir / "t.bin", {.type = TokenType::UInt16});
  for (bool random : {false, true}) {
    INFO("random_offset " << random);
    TokenSequences seqs(corpus, {.seq_len = 32, .random_offset = random, .dtype = DType::Int32});
    std::string why;
    const std::vector<HostRows> rows = seqs.host_rows(why);
    REQUIRE(rows.size() == 2);
    CHECK(why.empty());
    for (std::size_t k = 0; k < 2; ++k) {
      const HostRows& r = rows[k];
      CHECK(detail::row_window_problem(r).empty());
      CHECK(r.rows == 3000);
      CHECK(r.row_bytes == 2);
      CHECK(r.mapped_file);
      REQUIRE(r.window);
      CHECK(r.window->length == 32);
      CHECK(r.window->shift == static_cast<std::int64_t>(k));
      CHECK(r.window->dtype == DType::Int32);
      CHECK(r.window->is_unsigned);
      CHECK(detail::gathered_row_bytes(r) == 32 * 4);
      const auto* file = static_cast<const std::uint16_t*>(r.data);
      for (std::size_t i : {std::size_t{0}, std::size_t{7}, seqs.size() - 1}) {
        const WorkerInfo w{};
        SampleContext ctx(i, 5, 2, w);
        const std::uint64_t start = r.window->start(i, 5, 2);
        CHECK(start == seqs.window_start(i, ctx));
        SampleContext fresh(i, 5, 2, w);  // ctx's generator has drawn the offset already
        const std::vector<Tensor> sample = seqs.get(i, fresh);
        for (std::size_t t = 0; t < 32; ++t)
          CHECK(sample[k].item<std::int32_t>(static_cast<std::int64_t>(t)) == file[start + k + t]);
      }
    }
  }
  // Raw windows: one field of seq_len + 1 tokens, as stored.
  std::string why;
  const auto raw = TokenSequences(corpus, {.seq_len = 32, .raw = true}).host_rows(why);
  REQUIRE(raw.size() == 1);
  CHECK(raw[0].window->length == 33);
  CHECK(raw[0].window->dtype == DType::Int16);
  // Declined, each with its reason.
  auto declined = [&](const TokenSequences& s) {
    std::string w;
    CHECK(s.host_rows(w).empty());
    return w;
  };
  CHECK_THAT(declined(TokenSequences(open_token_file(dir / "t.bin", {.type = TokenType::UInt16, .eod = 7}),
                                     {.seq_len = 32, .packed = true})),
             Catch::Contains("position_ids"));
  CHECK_THAT(
      declined(TokenSequences(open_token_file(dir / "t.bin", {.type = TokenType::UInt16, .vocab_size = 65536}), {.seq_len = 32})),
      Catch::Contains("vocab_size"));
  // A window set by hand that does not fit its array is named.
  HostRows bad = raw[0];
  bad.window->length = 3001;
  CHECK_THAT(detail::row_window_problem(bad), Catch::Contains("a window of 3001 elements"));
  bad = raw[0];
  bad.window->dtype = DType::Int8;
  CHECK_THAT(detail::row_window_problem(bad), Catch::Contains("at least as wide"));
}

TEST_CASE("Megatron indexed datasets written by megatron-core read back document for document", "[unit][tokens][megatron]") {
  for (const char* name : {"u16", "i32"}) {
    INFO(name);
    const Fixture f = fixture(name);
    auto corpus = open_megatron(f.prefix, {.vocab_size = f.vocab});
    CHECK(corpus->type() == (std::string(name) == "u16" ? TokenType::UInt16 : TokenType::Int32));
    CHECK(corpus->documents() == f.lengths.size());
    const std::uint64_t total = std::accumulate(f.lengths.begin(), f.lengths.end(), std::uint64_t{0});
    REQUIRE(corpus->size() == total);
    std::vector<std::int64_t> all(total);
    corpus->read(0, all);
    std::uint64_t at = 0;
    std::vector<std::uint64_t> expected_starts;
    for (std::size_t d = 0; d < f.lengths.size(); ++d) {
      if (d > 0) expected_starts.push_back(at);
      for (std::uint64_t t = 0; t < f.lengths[d]; ++t)
        REQUIRE(all[at + t] == static_cast<std::int64_t>((d * 7919 + t * 31) % f.vocab));
      at += f.lengths[d];
    }
    std::vector<std::uint64_t> starts;
    corpus->document_starts(0, all, starts);
    CHECK(starts == expected_starts);
    // Any window's starts are the documents' starts inside it.
    starts.clear();
    corpus->document_starts(1000, std::span<const std::int64_t>(all).subspan(1000, 500), starts);
    std::vector<std::uint64_t> inside;
    for (std::uint64_t s : expected_starts)
      if (s > 1000 && s < 1500) inside.push_back(s);
    CHECK(starts == inside);
    // A vocabulary smaller than the tokens is named at the first token past it.
    auto small = open_megatron(f.prefix, {.vocab_size = 100});
    std::vector<std::int64_t> out(300);
    CHECK_THROWS_WITH(small->read(0, out),
                      Catch::Contains(f.prefix + ".bin: at byte") && Catch::Contains("outside the vocabulary [0, 100)"));
  }
}

TEST_CASE("packed sequences: position ids restart at each document, cu_seqlens agree, every token once an epoch",
          "[unit][tokens][megatron]") {
  const Fixture f = fixture("u16");
  TokenSequences seqs(open_megatron(f.prefix), {.seq_len = 64, .packed = true});
  CHECK(seqs.field_names() == std::vector<std::string>{"input_ids", "labels", "position_ids", "cu_seqlens"});
  std::set<std::uint64_t> doc_starts{0};
  std::uint64_t at = 0;
  for (auto n : f.lengths) doc_starts.insert(at += n);
  CHECK(epoch(seqs, opts(5, 2)) == epoch(seqs, opts(5, 0)));
  // In order (the fixture's token rule repeats: windows 9 and 94 hold the same tokens), window w at w * 64.
  const auto ref = epoch(seqs, opts(5, 0, false));
  std::vector<int> seen(seqs.size() * 64, 0);
  auto corpus = open_megatron(f.prefix);
  std::vector<std::int64_t> all(corpus->size());
  corpus->read(0, all);
  std::size_t window = 0;
  for (const auto& b : ref) {
    const std::size_t rows = b[0].size() / 64;
    for (std::size_t r = 0; r < rows; ++r, ++window) {
      const std::size_t pos = window * 64;
      REQUIRE(std::equal(all.begin() + static_cast<std::ptrdiff_t>(pos), all.begin() + static_cast<std::ptrdiff_t>(pos + 64),
                         b[0].begin() + static_cast<std::ptrdiff_t>(r * 64)));
      // Labels: the next corpus token everywhere, across a document's end too.
      REQUIRE(std::equal(all.begin() + static_cast<std::ptrdiff_t>(pos + 1), all.begin() + static_cast<std::ptrdiff_t>(pos + 65),
                         b[1].begin() + static_cast<std::ptrdiff_t>(r * 64)));
      std::vector<std::int64_t> cu{0};
      for (std::size_t k = 0; k < 64; ++k) {
        ++seen[pos + k];
        const std::int64_t p = b[2][r * 64 + k];
        const bool starts = doc_starts.count(pos + k) != 0;
        if (k > 0 && starts) cu.push_back(static_cast<std::int64_t>(k));
        // 0 at the window's first token and at each document's (as Megatron-LM's reset_position_ids).
        CHECK(p == (starts || k == 0 ? 0 : b[2][r * 64 + k - 1] + 1));
      }
      while (cu.size() < 65) cu.push_back(64);
      const std::vector<std::int64_t> got(b[3].begin() + static_cast<std::ptrdiff_t>(r * 65),
                                          b[3].begin() + static_cast<std::ptrdiff_t>(r * 65 + 65));
      CHECK(got == cu);
    }
  }
  for (std::size_t i = 0; i < seen.size(); ++i) {
    INFO("token " << i);
    REQUIRE(seen[i] == 1);
  }
}

// Note [Best-fit packing]: a corpus whose token ids are their corpus positions, so every input
// names where it came from. Every token is an input once an epoch, sequences are full, labels are
// the next corpus token, positions restart at each piece (cu_seqlens agree), batches are the same
// for any worker count, and documents of at most seq_len are cut far less often than windows cut them.
TEST_CASE("best-fit packing: every token once, full sequences, documents whole where they fit, deterministic",
          "[unit][tokens][packing]") {
  constexpr std::size_t S = 64;
  std::vector<std::int32_t> lengths;
  std::vector<std::int64_t> pointers;
  std::int64_t total = 0;
  for (int d = 0; d < 600; ++d) {
    const int len = 1 + (d * 37 + 11) % (d % 10 == 0 ? 200 : 60);  // most shorter than S, some longer
    lengths.push_back(len);
    pointers.push_back(total * 4);
    total += len;
  }
  std::vector<std::int64_t> doc_index(lengths.size() + 1);
  std::iota(doc_index.begin(), doc_index.end(), std::int64_t{0});
  std::vector<std::int32_t> ids(static_cast<std::size_t>(total));
  std::iota(ids.begin(), ids.end(), 0);
  const Bytes idx = megatron_idx_bytes(4, lengths, pointers, doc_index), bin = raw_bytes(ids);
  const auto corpus = megatron_from_memory(idx, bin, "bestfit");
  std::vector<std::int64_t> doc_of(static_cast<std::size_t>(total));
  for (std::size_t d = 0, at = 0; d < lengths.size(); ++d)
    for (std::int32_t k = 0; k < lengths[d]; ++k) doc_of[at++] = static_cast<std::int64_t>(d);
  // Documents of at most S tokens whose tokens do not lie in one run of one sequence.
  auto cut_short_documents = [&](const std::vector<std::vector<std::vector<std::int64_t>>>& batches) {
    std::map<std::int64_t, std::set<std::pair<std::size_t, std::size_t>>> runs;  // doc -> (row, first k of a run)
    std::size_t row = 0;
    for (const auto& b : batches)
      for (std::size_t r = 0; r < b[0].size() / S; ++r, ++row)
        for (std::size_t k = 0; k < S; ++k) {
          const std::int64_t v = b[0][r * S + k];
          const bool continues = k > 0 && b[0][r * S + k - 1] == v - 1 && b[2][r * S + k] != 0;
          if (!continues) runs[doc_of[static_cast<std::size_t>(v)]].insert({row, k});
        }
    std::size_t cut = 0;
    for (const auto& [d, rs] : runs) cut += lengths[static_cast<std::size_t>(d)] <= static_cast<std::int32_t>(S) && rs.size() > 1;
    return cut;
  };
  for (bool shuffled : {false, true}) {
    INFO("shuffle_documents " << shuffled);
    const TokenSequences fit(
        corpus, {.seq_len = S, .packed = true, .shuffle_documents = shuffled, .document_block = 16, .best_fit_group = 16});
    const TokenSequences windows(corpus, {.seq_len = S, .packed = true, .shuffle_documents = shuffled, .document_block = 16});
    REQUIRE(fit.size() == windows.size());
    const auto ref = epoch(fit, opts(16, 0), 1);
    CHECK(epoch(fit, opts(16, 3), 1) == ref);
    CHECK(epoch(fit, opts(5, 2, false), 1) != ref);  // the sampler's order, not the sequences, changes with it
    std::vector<int> seen(static_cast<std::size_t>(total), 0);
    std::size_t sequences = 0;
    for (const auto& b : ref) {
      REQUIRE(b.size() == 4);
      for (std::size_t r = 0; r < b[0].size() / S; ++r, ++sequences) {
        std::vector<std::int64_t> cu{0};
        for (std::size_t k = 0; k < S; ++k) {
          const std::int64_t v = b[0][r * S + k], label = b[1][r * S + k], pos = b[2][r * S + k];
          ++seen[static_cast<std::size_t>(v)];
          CHECK((label == v + 1 || (v == total - 1 && label == v)));
          if (k == 0)
            CHECK(pos == 0);
          else if (pos != 0)
            CHECK((b[0][r * S + k - 1] == v - 1 && b[2][r * S + k - 1] == pos - 1));
          else
            cu.push_back(static_cast<std::int64_t>(k));
        }
        while (cu.size() < S + 1) cu.push_back(S);
        const std::vector<std::int64_t> got(b[3].begin() + static_cast<std::ptrdiff_t>(r * (S + 1)),
                                            b[3].begin() + static_cast<std::ptrdiff_t>((r + 1) * (S + 1)));
        CHECK(got == cu);
      }
    }
    CHECK(sequences == fit.size());
    CHECK(std::accumulate(seen.begin(), seen.end(), std::size_t{0}) == fit.size() * S);  // full sequences
    CHECK(*std::max_element(seen.begin(), seen.end()) == 1);                             // every token once at most
    if (!shuffled)  // the corpus order: exactly the windows' tokens
      for (std::size_t v = 0; v < seen.size(); ++v) REQUIRE(seen[v] == (v < fit.size() * S ? 1 : 0));
    const std::size_t cut_fit = cut_short_documents(ref), cut_windows = cut_short_documents(epoch(windows, opts(16, 0), 1));
    INFO("documents of at most seq_len cut: best fit " << cut_fit << ", windows " << cut_windows);
    CHECK(cut_fit * 3 < cut_windows);
  }
  CHECK_THROWS_WITH(TokenSequences(corpus, {.seq_len = S, .best_fit_group = 8}), Catch::Contains("packed"));
}

TEST_CASE("documents shuffled each epoch: every token once, documents whole between their starts, another order each epoch",
          "[unit][tokens][megatron]") {
  const Fixture f = fixture("u16");
  TokenSequences seqs(open_megatron(f.prefix), {.seq_len = 64, .packed = true, .shuffle_documents = true, .document_block = 8});
  auto corpus = open_megatron(f.prefix);
  std::vector<std::int64_t> all(corpus->size());
  corpus->read(0, all);
  const std::multiset<std::int64_t> whole(all.begin(), all.end());
  auto doc_of = [&](std::int64_t first_token) {  // the fixture's documents start with d * 7919 % vocab
    for (std::int64_t d = 0; d < static_cast<std::int64_t>(f.lengths.size()); ++d)
      if ((d * 7919) % f.vocab == first_token) return d;
    return std::int64_t{-1};
  };
  std::vector<std::vector<std::int64_t>> orders;
  for (std::uint64_t e : {0, 1}) {
    const auto ref = epoch(seqs, opts(5, 0, false), e);
    CHECK(epoch(seqs, opts(5, 3, false), e) == ref);  // any worker count
    std::vector<std::int64_t> stream, order, labels;
    for (const auto& b : ref)
      for (std::size_t r = 0; r < b[0].size() / 64; ++r)
        for (std::size_t k = 0; k < 64; ++k) {
          const std::int64_t t = b[0][r * 64 + k], p = b[2][r * 64 + k];
          labels.push_back(b[1][r * 64 + k]);
          // Inside a document each token is the one before + 31 (mod vocab): pieces are whole.
          if (p > 0) CHECK(t == (stream.back() + 31) % f.vocab);
          if (p == 0 && k > 0) order.push_back(doc_of(t));
          stream.push_back(t);
        }
    REQUIRE(stream.size() == seqs.size() * 64);
    // Labels: the shuffled stream's next token, across a piece's end to the next document's first
    // (the windows in order are the stream; the last window's last label is past it).
    for (std::size_t i = 0; i + 1 < stream.size(); ++i) {
      INFO("stream position " << i);
      REQUIRE(labels[i] == stream[i + 1]);
    }
    std::multiset<std::int64_t> seen(stream.begin(), stream.end());
    for (std::int64_t t : seen) CHECK(seen.count(t) <= whole.count(t));  // nothing read twice
    CHECK(whole.size() - seen.size() < 64);                              // only the tail past the last window
    CHECK(std::count(order.begin(), order.end(), -1) == 0);
    orders.push_back(order);
  }
  CHECK(orders[0] != orders[1]);
  std::vector<std::int64_t> sorted = orders[0];
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted != orders[0]);  // not the corpus order
  CHECK_THROWS_WITH(
      TokenSequences(open_token_file(std::string(FERRY_TEST_FIXTURES) + "/megatron/u16.bin", {.type = TokenType::UInt16}),
                     {.shuffle_documents = true}),
      Catch::Contains("needs an indexed corpus"));
}

TEST_CASE("a flat file's documents are the runs ended by the end-of-document id", "[unit][tokens]") {
  TempDir dir;
  // Documents of 5, 9, 3 and 20 tokens, each ended by 0 (the eod id).
  std::vector<std::uint16_t> t;
  for (int n : {5, 9, 3, 20}) {
    for (int k = 1; k < n; ++k) t.push_back(static_cast<std::uint16_t>(100 + k));
    t.push_back(0);
  }
  write_file(dir / "eod.bin", raw_bytes(t));
  TokenSequences seqs(open_token_file(dir / "eod.bin", {.type = TokenType::UInt16, .eod = 0}), {.seq_len = 12, .packed = true});
  WorkerInfo w;
  SampleContext ctx(0, 0, 0, w);
  const auto s0 = seqs.get(0, ctx);  // tokens 0..11: documents start at 5
  CHECK(values(s0[2]) == std::vector<std::int64_t>{0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6});
  CHECK(values(s0[3])[0] == 0);
  CHECK(values(s0[3])[1] == 5);
  CHECK(values(s0[3])[2] == 12);
  const auto s1 = seqs.get(1, ctx);  // tokens 12..23: documents start at 14 and 17
  CHECK(values(s1[2]) == std::vector<std::int64_t>{0, 1, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6});
  const auto cu = values(s1[3]);
  CHECK(std::vector<std::int64_t>(cu.begin(), cu.begin() + 4) == std::vector<std::int64_t>{0, 2, 5, 12});
  CHECK(cu.back() == 12);
}

TEST_CASE("damaged Megatron indices are DataErrors naming the .idx and the offset", "[errors][tokens][megatron]") {
  TempDir dir;
  const Bytes bin = raw_bytes(pattern(30));  // 3 documents of 10 uint16 tokens
  auto make = [&](const std::string& name, const Bytes& idx, const Bytes& b) {
    write_file(dir / (name + ".idx"), idx);
    write_file(dir / (name + ".bin"), b);
    return dir / name;
  };
  auto error_of = [](const std::string& prefix, bool read_all = false) -> std::string {
    try {
      auto c = open_megatron(prefix);
      if (read_all) {
        std::vector<std::int64_t> all(c->size());
        c->read(0, all);
        std::vector<std::uint64_t> s;
        c->document_starts(0, all, s);
      }
    } catch (const DataError& e) {
      return e.what();
    } catch (const std::exception& e) {
      return std::string("not a DataError: ") + e.what();
    }
    return "no error";
  };
  const Bytes good = megatron_idx_bytes(8, {10, 10, 10}, {0, 20, 40}, {0, 1, 2, 3});
  CHECK(error_of(make("good", good, bin), true) == "no error");
  Bytes magic = good;
  magic[0] = std::byte{'X'};
  CHECK(error_of(make("magic", magic, bin)).find("magic.idx: at byte 0: not a Megatron index") != std::string::npos);
  CHECK(error_of(make("float", megatron_idx_bytes(7, {10, 10, 10}, {0, 20, 40}, {0, 1, 2, 3}), bin))
            .find("float.idx: at byte 17") != std::string::npos);
  Bytes overflow = good;
  const std::uint64_t huge = ~std::uint64_t{0} / 4;
  std::memcpy(overflow.data() + 18, &huge, 8);
  CHECK(error_of(make("overflow", overflow, bin)).find("overflow.idx: at byte 18: counts overflow") != std::string::npos);
  CHECK(error_of(make("short", Bytes(good.begin(), good.end() - 8), bin)).find("short.idx") != std::string::npos);
  // Pointers past the .bin; a .bin shorter than the index says.
  CHECK(error_of(make("past", megatron_idx_bytes(8, {10, 10, 20}, {0, 20, 40}, {0, 1, 2, 3}), bin))
            .find("pointers run past the .bin") != std::string::npos);
  CHECK(error_of(make("trunc", good, Bytes(bin.begin(), bin.end() - 2))).find("trunc.idx") != std::string::npos);
  // A gap between sequences is found when a sample reads there, named at the pointer's offset.
  const std::string gap = error_of(make("gap", megatron_idx_bytes(8, {10, 8, 10}, {0, 20, 40}, {0, 1, 2, 3}), bin), true);
  CHECK(gap.find("gap.idx: at byte " + std::to_string(34 + 3 * 4 + 2 * 8)) != std::string::npos);
  CHECK(error_of(make("docs", megatron_idx_bytes(8, {10, 10, 10}, {0, 20, 40}, {0, 1, 2, 5}), bin)).find("document index") !=
        std::string::npos);
  CHECK(error_of(make("odd", megatron_idx_bytes(8, {10, 10, 10}, {0, 21, 40}, {0, 1, 2, 3}), bin), true)
            .find("not a whole token") != std::string::npos);
  CHECK(error_of(dir / "nothing").find("nothing.idx") != std::string::npos);
}

TEST_CASE("IndexPermutation is a permutation of [0, n), and another key gives another", "[unit][tokens]") {
  for (std::uint64_t n : {1ull, 2ull, 3ull, 5ull, 17ull, 64ull, 1000ull, 4097ull}) {
    IndexPermutation p(n, 7), q(n, 8);
    std::vector<int> hit(n, 0);
    bool differs = false;
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint64_t v = p.at(i);
      REQUIRE(v < n);
      ++hit[v];
      differs = differs || v != q.at(i);
    }
    CHECK(std::all_of(hit.begin(), hit.end(), [](int h) { return h == 1; }));
    if (n > 3) CHECK(differs);
  }
}

namespace {
// Three sources: sample i of source s is a 4-token sequence whose first token is s * 1000 + i.
struct Tagged {
  std::int64_t tag;
  std::size_t n;
  std::size_t size() const { return n; }
  std::vector<Tensor> get(std::size_t i) const {
    Tensor t = Tensor::empty(DType::Int64, {4});
    for (int k = 0; k < 4; ++k) static_cast<std::int64_t*>(t.raw())[k] = tag * 1000 + static_cast<std::int64_t>(i) + k;
    return {t};
  }
};
Mixture three(std::vector<double> w, std::size_t block = 100) {
  return Mixture({Tagged{0, 50}, Tagged{1, 200}, Tagged{2, 7}}, std::move(w), {.seed = 5, .block = block, .size = 600});
}
std::int64_t source_of(std::int64_t v) { return v / 1000; }
}  // namespace

TEST_CASE("a mixture gives each source its weight's share of every block, and sources start their next epochs alone",
          "[unit][tokens][mixture]") {
  const Mixture m = three({0.5, 0.3, 0.2});
  REQUIRE(m.size() == 600);
  std::map<std::size_t, std::map<std::uint64_t, std::size_t>> drawn;  // source -> draw -> sample
  for (std::uint64_t b = 0; b < 12; ++b) {
    std::vector<int> count(3, 0);
    for (std::uint64_t j = 0; j < 100; ++j) {
      const Mixture::Pick p = m.pick(b * 100 + j);
      ++count[p.source];
      CHECK(drawn[p.source].emplace(p.draw, p.sample).second);  // each draw once
    }
    CHECK(count == std::vector<int>{50, 30, 20});
    // A block's draws of each source are the next ones: the draws so far are 0..n-1.
    for (auto& [source, draws] : drawn) CHECK(draws.rbegin()->first == draws.size() - 1);
  }
  std::map<std::size_t, std::vector<std::size_t>> by_draw;
  for (auto& [source, draws] : drawn)
    for (auto& [d, sample] : draws) by_draw[source].push_back(sample);
  // Source 2 (7 samples) ran through its epochs: each run of 7 draws is a permutation, and not all the same.
  const auto& s2 = by_draw[2];
  std::set<std::vector<std::size_t>> orders;
  for (std::size_t e = 0; e + 7 <= s2.size(); e += 7) {
    std::vector<std::size_t> run(s2.begin() + static_cast<std::ptrdiff_t>(e), s2.begin() + static_cast<std::ptrdiff_t>(e + 7));
    orders.insert(run);
    std::sort(run.begin(), run.end());
    CHECK(run == std::vector<std::size_t>{0, 1, 2, 3, 4, 5, 6});
  }
  CHECK(orders.size() > 1);
  // Fractional weights: within one sample a block of the exact share.
  const Mixture odd = three({1, 1, 1}, 10);
  const auto c = odd.counts_before(1000);
  for (std::uint64_t n : c) CHECK((n >= 300 && n <= 400));
  CHECK(c[0] + c[1] + c[2] == 1000);
  CHECK_THROWS_WITH(three({1, -1, 1}), Catch::Contains("weight 1"));
  CHECK_THROWS_WITH(three({1, 1}), Catch::Contains("2 weights for 3 sources"));
  CHECK_THROWS_WITH(three({0, 0, 0}), Catch::Contains("sum to 0"));
}

TEST_CASE("weights changed at an index keep every sample before it and apply from it", "[unit][tokens][mixture]") {
  const Mixture before = three({0.5, 0.3, 0.2});
  for (std::uint64_t from : {0ull, 250ull, 300ull, 777ull}) {
    INFO("from " << from);
    const Mixture after = before.reweighted({0.1, 0.1, 0.8}, from);
    for (std::uint64_t g = 0; g < from; ++g) {
      const auto a = before.pick(g), b = after.pick(g);
      REQUIRE((a.source == b.source && a.sample == b.sample));
    }
    // From `from` on, the new proportions, and each source's draws over the whole run are
    // 0..n-1, each once: none repeated, none skipped, whatever block the change fell in.
    std::vector<int> count(3, 0);
    for (std::uint64_t g = from; g < from + 1000; ++g) ++count[after.pick(g).source];
    CHECK(std::abs(count[0] - 100) <= 10);
    CHECK(std::abs(count[2] - 800) <= 10);
    const Mixture again = after.reweighted({0.4, 0.4, 0.2}, from + 333);
    std::vector<std::set<std::uint64_t>> draws(3);
    const std::uint64_t end = from + 333 + 1700;  // block-aligned in the last weights, their pending draws long taken
    for (std::uint64_t g = 0; g < end; ++g) {
      const auto p = again.pick(g);
      CHECK(draws[p.source].insert(p.draw).second);
    }
    const auto taken = again.counts_before(end);
    for (std::size_t s = 0; s < 3; ++s) {
      CHECK(draws[s].size() == taken[s]);
      CHECK((draws[s].empty() || *draws[s].rbegin() == draws[s].size() - 1));
    }
    // The same weights again at a later index change nothing before it.
    const Mixture same = after.reweighted({0.1, 0.1, 0.8}, from + 500);
    for (std::uint64_t g = 0; g < from + 500; g += 7) CHECK(same.pick(g).sample == after.pick(g).sample);
  }
  CHECK_THROWS_WITH(before.reweighted({1, 1, 1}, 100).reweighted({1, 2, 3}, 50),
                    Catch::Contains("before the last weights' start"));
}

namespace {
// The global batches of an epoch (a batch's rows as the whole group sees them, in the epoch's
// order) from `world` ranks simulated in one process, each rank running `steps` batches (all when
// 0) from `state` (or the epoch's start); returns rank 0's state after.
std::optional<LoaderState> run_group(const Mixture& m, std::size_t world, std::size_t global_batch, int workers,
                                     std::size_t steps, const std::optional<LoaderState>& state,
                                     std::vector<std::vector<std::int64_t>>& global) {
  const std::size_t per_rank = global_batch / world;
  std::vector<std::vector<std::vector<std::int64_t>>> ranks(world);  // rank -> batch -> first tokens
  std::optional<LoaderState> out;
  for (std::size_t r = 0; r < world; ++r) {
    DataLoaderOptions o;
    o.batch_size = per_rank;
    o.num_workers = workers;
    o.seed = 3;
    o.sampler = std::make_shared<DistributedSampler>(m.size(), world, r, true, 3);
    DataLoader loader(m, o);
    if (state) loader.restore(*state);
    std::size_t taken = 0;
    for (auto it = loader.begin(); it != loader.end(); ++it) {
      const auto v = values((*it)[0]);
      std::vector<std::int64_t> firsts;
      for (std::size_t row = 0; row < v.size() / 4; ++row) firsts.push_back(v[row * 4]);
      ranks[r].push_back(std::move(firsts));
      if (++taken == steps) break;
    }
    if (r == 0) out = loader.state();
  }
  for (std::size_t b = 0; b < ranks[0].size(); ++b) {  // position = start + b * G + k * world + r
    std::vector<std::int64_t> g;
    for (std::size_t k = 0; k < per_rank; ++k)
      for (std::size_t r = 0; r < world; ++r) g.push_back(ranks[r][b][k]);
    global.push_back(std::move(g));
  }
  return out;
}
}  // namespace

TEST_CASE(
    "a mixture resumed at world sizes 4 -> 3 -> 2 -> 1 and other worker counts gives the uninterrupted run's global batches",
    "[resume][tokens][mixture][distributed]") {
  const Mixture m = three({0.6, 0.3, 0.1});  // 600 samples an epoch: 50 global batches of 12
  std::vector<std::vector<std::int64_t>> whole;
  run_group(m, 4, 12, 2, 0, std::nullopt, whole);
  REQUIRE(whole.size() == 50);
  std::vector<std::vector<std::int64_t>> resumed;
  auto s = run_group(m, 4, 12, 0, 10, std::nullopt, resumed);
  s = run_group(m, 3, 12, 3, 15, s, resumed);
  s = run_group(m, 2, 12, 1, 5, s, resumed);
  run_group(m, 1, 12, 4, 0, s, resumed);
  REQUIRE(resumed.size() == whole.size());
  CHECK(resumed == whole);
  // Every global sample's source matches the mixture's pick of its index (the group's order).
  std::size_t matched = 0;
  const auto order = DistributedSampler(m.size(), 1, 0, true, 3).indices(0);
  for (std::size_t b = 0; b < whole.size(); ++b)
    for (std::size_t k = 0; k < 12; ++k)
      matched += source_of(whole[b][k]) == static_cast<std::int64_t>(m.pick(order[b * 12 + k]).source);
  CHECK(matched == 600);
}

TEST_CASE("token sequences through the registry: tokens and megatron, with their keys checked", "[unit][tokens][registry]") {
  TempDir dir;
  write_file(dir / "t.bin", raw_bytes(pattern(1000)));
  auto& reg = DatasetRegistry::global();
  DynamicDataset d = reg.create("tokens", "path=" + (dir / "t.bin") + ",dtype=uint16,seq_len=10");
  CHECK(d.size() == 99);
  const Fixture f = fixture("i32");
  DynamicDataset m = reg.create("megatron", "prefix=" + f.prefix + ",seq_len=32,packed=1,out_dtype=int32");
  WorkerInfo w;
  SampleContext ctx(0, 0, 0, w);
  const auto s = m.get(3, ctx);
  REQUIRE(s.size() == 4);
  CHECK(s[0].dtype() == DType::Int32);
  CHECK(s[3].shape() == Shape{33});
  CHECK_THROWS_WITH(reg.create("tokens", "path=" + (dir / "t.bin") + ",dtype=float32"), Catch::Contains("option 'dtype'"));
  CHECK_THROWS_WITH(reg.create("tokens", "path=" + (dir / "t.bin") + ",dtype=uint16,seq=10"),
                    Catch::Contains("unknown option 'seq'"));
  CHECK_THROWS_WITH(reg.create("megatron", "prefix=" + f.prefix + ",out_dtype=int16"), Catch::Contains("out_dtype"));
}
