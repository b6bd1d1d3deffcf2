// TableTokens over Parquet files written here with Arrow's writer (python/tests/test_tables.py
// compares whole corpora with `tokenizers`): a character tokenizer whose ids the test computes, so
// the windows are checked exactly; the same batches for 0, 1, 4 and 16 workers; a resume from the
// state's cursor at other worker counts equal to the uninterrupted run; a damaged file a DataError.
// Under ThreadSanitizer and AddressSanitizer in CI: the feed's lanes read and tokenize at once.
#include <arrow/api.h>
#include <arrow/io/file.h>
#include <parquet/arrow/writer.h>

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ferry/core/dataloader.h"
#include "ferry/loaders/table.h"
#include "ferry/loaders/tokenizer.h"

// Options as designated initializers, the fields not named left at their defaults.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace fs = std::filesystem;
using Catch::Contains;
using Window = std::vector<std::int64_t>;

namespace {

// Characters ' '..'~' as ids 0..94, no merges: a row's ids are its bytes less 32.
std::shared_ptr<const ferry::Tokenizer> char_tokenizer() {
  std::string vocab;
  for (int c = 32; c < 127; ++c) {
    std::string key(1, static_cast<char>(c));
    if (c == '"' || c == '\\') key = "\\" + key;
    vocab += (vocab.empty() ? "" : ", ") + ("\"" + key + "\": " + std::to_string(c - 32));
  }
  return ferry::tokenizer_from_json(R"({"added_tokens": [{"id": 95, "content": "<eos>", "special": true}],
    "model": {"type": "BPE", "vocab": {)" +
                                        vocab + R"(}, "merges": []}})",
                                    "chars.json");
}

std::string row_text(std::size_t file, std::size_t i) {
  std::string s = "file " + std::to_string(file) + " row " + std::to_string(i) + ":";
  for (std::size_t k = 0; k < (i * 7 + file * 3) % 40; ++k) s += " w" + std::to_string(k);
  return s;
}

struct Files {
  fs::path dir;
  std::vector<std::string> paths;
  std::vector<std::vector<std::string>> rows;
  static constexpr std::int64_t kRowGroup = 5;
  explicit Files(const std::vector<std::size_t>& sizes) {
    dir = fs::temp_directory_path() / ("ferry-table-" + std::to_string(::getpid()));
    fs::create_directories(dir);
    for (std::size_t f = 0; f < sizes.size(); ++f) {
      arrow::StringBuilder b;
      rows.emplace_back();
      for (std::size_t i = 0; i < sizes[f]; ++i) {
        rows.back().push_back(row_text(f, i));
        REQUIRE(b.Append(rows.back().back()).ok());
      }
      std::shared_ptr<arrow::Array> text;
      REQUIRE(b.Finish(&text).ok());
      auto table = arrow::Table::Make(arrow::schema({arrow::field("text", arrow::utf8())}), {text});
      paths.push_back((dir / ("part-" + std::to_string(f) + ".parquet")).string());
      auto out = arrow::io::FileOutputStream::Open(paths.back()).ValueOrDie();
      REQUIRE(parquet::arrow::WriteTable(*table, arrow::default_memory_pool(), out, kRowGroup).ok());
      REQUIRE(out->Close().ok());
    }
  }
  ~Files() { fs::remove_all(dir); }
};

std::vector<Window> epoch_windows(ferry::DataLoader<ferry::TableTokens>& loader, std::size_t limit = SIZE_MAX) {
  std::vector<Window> out;
  std::size_t batches = 0;
  for (auto& b : loader) {
    const auto n = static_cast<std::size_t>(b[0].size(0)), len = static_cast<std::size_t>(b[0].size(1));
    for (std::size_t r = 0; r < n; ++r) {
      Window w(b[0].data<std::int64_t>() + r * len, b[0].data<std::int64_t>() + (r + 1) * len);
      w.push_back(b[1].data<std::int64_t>()[(r + 1) * len - 1]);
      out.push_back(std::move(w));
    }
    if (++batches == limit) break;
  }
  return out;
}

}  // namespace

TEST_CASE("TableTokens cuts each row group's ids into windows, the same for any worker count", "[table]") {
  Files files({7, 23, 51});
  auto opened = ferry::ParquetFiles::open(files.paths, {.columns = {"text"}});
  REQUIRE(opened->units().size() == 2 + 5 + 11);
  CHECK(opened->rows() == 81);
  const auto tok = char_tokenizer();
  ferry::TableTokens ordered(opened, tok, {.seq_len = 16, .eos = 95, .shuffle = false, .rows_per_read = 3});
  // The reference: row group by row group, rows in order, eos after each, cut with overlap one.
  std::vector<Window> want;
  for (std::size_t f = 0; f < files.rows.size(); ++f)
    for (std::size_t g = 0; g < files.rows[f].size(); g += Files::kRowGroup) {
      std::vector<std::int64_t> ids;
      for (std::size_t i = g; i < std::min(files.rows[f].size(), g + Files::kRowGroup); ++i) {
        for (char c : files.rows[f][i]) ids.push_back(c - 32);
        ids.push_back(95);
      }
      for (std::size_t w = 0; ids.size() > 16 && w < (ids.size() - 1) / 16; ++w)
        want.emplace_back(ids.begin() + static_cast<std::ptrdiff_t>(w * 16),
                          ids.begin() + static_cast<std::ptrdiff_t>(w * 16 + 17));
    }
  REQUIRE(want.size() > 40);
  for (int workers : {0, 1, 4}) {
    ferry::DataLoader loader(ordered, {.batch_size = 4, .num_workers = workers});
    CHECK(epoch_windows(loader) == want);
  }
  ferry::TableTokens shuffled(opened, tok, {.seq_len = 16, .eos = 95, .shuffle = true, .rows_per_read = 3});
  ferry::DataLoader base(shuffled, {.batch_size = 4, .num_workers = 0, .seed = 5});
  const std::vector<Window> first = epoch_windows(base), second = epoch_windows(base);
  CHECK(first != second);
  for (int workers : {1, 4, 16}) {
    ferry::DataLoader loader(shuffled, {.batch_size = 4, .num_workers = workers, .seed = 5});
    CHECK(epoch_windows(loader) == first);
    CHECK(epoch_windows(loader) == second);
  }
}

TEST_CASE("TableTokens resumes from the state's cursor at other worker counts", "[table]") {
  Files files({12, 30, 9});
  auto opened = ferry::ParquetFiles::open(files.paths, {.columns = {"text"}});
  ferry::TableTokens ds(opened, char_tokenizer(), {.seq_len = 8, .eos = 95, .shuffle = true, .rows_per_read = 4});
  ferry::DataLoader full(ds, {.batch_size = 3, .num_workers = 2, .seed = 9});
  const std::vector<Window> want = epoch_windows(full);
  REQUIRE(want.size() > 30);
  for (std::size_t stop : {std::size_t{1}, std::size_t{4}, want.size() / 6}) {
    ferry::DataLoader first(ds, {.batch_size = 3, .num_workers = 3, .seed = 9});
    std::vector<Window> got = epoch_windows(first, stop);
    const ferry::LoaderState state = first.state();
    REQUIRE(state.cursor == 1);
    REQUIRE(state.batches == stop);
    const std::string text = state.to_string();
    CHECK_THAT(text, Contains("cursor 1"));
    for (int workers : {0, 1, 5}) {
      ferry::DataLoader resumed(ds, {.batch_size = 3, .num_workers = workers, .seed = 9});
      resumed.restore(ferry::LoaderState::from_string(text));
      const ferry::LoaderState pending = resumed.state();  // restored, not read since: the same cursor
      CHECK(pending.batches == state.batches);
      CHECK((pending.cursor == 1 && pending.cursor_unit == state.cursor_unit && pending.cursor_offset == state.cursor_offset));
      std::vector<Window> all = got;
      for (Window& w : epoch_windows(resumed)) all.push_back(std::move(w));
      CHECK(all == want);
    }
  }
}

TEST_CASE("Packed table windows restart their positions at each row's bos, at any worker count", "[table]") {
  Files files({12, 30, 9});
  auto opened = ferry::ParquetFiles::open(files.paths, {.columns = {"text"}});
  ferry::TableTokens ds(opened, char_tokenizer(),
                        {.seq_len = 24, .bos = 94, .eos = 95, .shuffle = true, .packed = true, .rows_per_read = 4});
  CHECK(ds.field_names() == std::vector<std::string>{"input_ids", "labels", "position_ids", "cu_seqlens"});
  // Each row is its bos (94, '~', which no row's text holds), its characters, eos: a row starts
  // exactly where a bos is.
  auto check = [](std::vector<ferry::Tensor>& b, std::size_t& rows_inside) {
    REQUIRE(b.size() == 4);
    const auto n = static_cast<std::size_t>(b[0].size(0)), len = static_cast<std::size_t>(b[0].size(1));
    REQUIRE(b[2].dtype() == ferry::DType::Int64);
    REQUIRE(b[3].dtype() == ferry::DType::Int32);
    REQUIRE(static_cast<std::size_t>(b[3].size(1)) == len + 1);
    for (std::size_t r = 0; r < n; ++r) {
      const std::int64_t* ids = b[0].data<std::int64_t>() + r * len;
      const std::int64_t* pos = b[2].data<std::int64_t>() + r * len;
      const std::int32_t* cu = b[3].data<std::int32_t>() + r * (len + 1);
      std::vector<std::int32_t> want_cu{0};
      for (std::size_t k = 0; k < len; ++k) {
        if (k > 0 && ids[k] == 94) {
          want_cu.push_back(static_cast<std::int32_t>(k));
          ++rows_inside;
        }
        CHECK(pos[k] == (k == 0 || ids[k] == 94 ? 0 : pos[k - 1] + 1));
      }
      while (want_cu.size() < len + 1) want_cu.push_back(static_cast<std::int32_t>(len));
      CHECK(std::vector<std::int32_t>(cu, cu + len + 1) == want_cu);
    }
  };
  std::vector<Window> runs[2];
  for (int w = 0; w < 2; ++w) {
    ferry::DataLoader loader(ds, {.batch_size = 3, .num_workers = w == 0 ? 0 : 4, .seed = 2});
    std::size_t rows_inside = 0;
    for (auto& b : loader) {
      check(b, rows_inside);
      const auto n = static_cast<std::size_t>(b[0].size(0)), len = static_cast<std::size_t>(b[0].size(1));
      for (std::size_t r = 0; r < n; ++r)
        runs[w].emplace_back(b[2].data<std::int64_t>() + r * len, b[2].data<std::int64_t>() + (r + 1) * len);
    }
    CHECK(rows_inside > 10);  // rows begin inside windows, not only at their starts
  }
  CHECK(runs[0] == runs[1]);
  // The tokens are the unpacked windows'.
  ferry::TableTokens plain(opened, char_tokenizer(), {.seq_len = 24, .bos = 94, .eos = 95, .shuffle = true, .rows_per_read = 4});
  ferry::DataLoader a(ds, {.batch_size = 3, .num_workers = 2, .seed = 2}),
      b(plain, {.batch_size = 3, .num_workers = 2, .seed = 2});
  CHECK(epoch_windows(a) == epoch_windows(b));
}

TEST_CASE("A table's cursor restores only at its rank and world size", "[table]") {
  Files files({12, 30});
  auto opened = ferry::ParquetFiles::open(files.paths, {.columns = {"text"}});
  ferry::TableTokens rank1(opened, char_tokenizer(), {.seq_len = 8, .rank = 1, .world_size = 2});
  ferry::DataLoader first(rank1, {.batch_size = 2, .num_workers = 2, .seed = 3});
  (void)epoch_windows(first, 2);
  const ferry::LoaderState state = first.state();
  REQUIRE(state.cursor == 1);
  CHECK((state.world_size == 2 && state.rank == 1));
  ferry::TableTokens alone(opened, char_tokenizer(), {.seq_len = 8});
  ferry::DataLoader other(alone, {.batch_size = 2, .num_workers = 2, .seed = 3});
  CHECK_THROWS_WITH(other.restore(state), Contains("rank 1's of world size 2, this dataset is rank 0 of 1"));
  ferry::DataLoader same(rank1, {.batch_size = 2, .num_workers = 1, .seed = 3});
  CHECK_NOTHROW(same.restore(ferry::LoaderState::from_string(state.to_string())));
}

TEST_CASE("A damaged Parquet file is a DataError naming it", "[table]") {
  Files files({6});
  const std::string path = (files.dir / "cut.parquet").string();
  {
    std::ifstream in(files.paths[0], std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(path, std::ios::binary) << bytes.substr(0, bytes.size() - 9);
  }
  CHECK_THROWS_WITH(ferry::ParquetFiles::open({path}), Contains("cut.parquet") && Contains("not a readable Parquet file"));
  CHECK_THROWS_WITH(ferry::ParquetFiles::open(files.paths, {.columns = {"body"}}),
                    Contains("no column 'body' (its columns: text)"));
  CHECK_THROWS_AS(ferry::ParquetFiles::open({}), ferry::Error);
  auto opened = ferry::ParquetFiles::open(files.paths);
  CHECK_THROWS_WITH(ferry::TableTokens(opened, char_tokenizer(), {.seq_len = 0}), Contains("seq_len 0"));
  CHECK_THROWS_WITH(ferry::TableTokens(opened, char_tokenizer(), {.eos = 96}), Contains("eos 96 is outside"));
  CHECK_THROWS_WITH(ferry::TableTokens(opened, char_tokenizer(), {.rank = 2, .world_size = 2}), Contains("rank 2"));
}
