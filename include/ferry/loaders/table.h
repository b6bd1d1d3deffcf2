// ferry/loaders/table.h — tables of raw text (Parquet files, as the Hugging Face hub, FineWeb and
// DCLM hold them) tokenized on the fly in the loader's threads and cut into language-model windows.
//
//   auto files = ferry::ParquetFiles::open({"shard-0.parquet", "shard-1.parquet"}, {.columns = {"text"}});
//   ferry::TableTokens ds(files, ferry::open_tokenizer("tokenizer.json"), {.text = "text", .seq_len = 2048, .eos = 50256});
//   ferry::DataLoader loader(ds, {.batch_size = 16, .num_workers = 4});
//   for (auto& batch : loader) { batch[0];  /* input_ids [16, 2048] int64 */  batch[1]; /* labels */ }
//
// Opening reads only the files' footers (in parallel, on up to 16 threads): the row groups, their
// row counts and the schema; a column asked for that a file lacks, or one of another type, is a
// DataError naming the file at open, before any data is read. Local files (s3:// is not read yet).
//
// Note [Table windows]
// The unit of work is a row group. An epoch reads this rank's row groups (row group k of the
// epoch's order goes to rank k % world_size; the order shuffled by (seed, epoch) with shuffle) in
// a loader's one reading of the epoch (Note [One batcher across workers] in
// ferry/detail/batch_feed.h): up to num_workers row groups are read and tokenized at once, on
// threads of their own, however few the files (16 workers over 3 files are all busy), and the
// windows are dealt in the order of the row groups, so the batches are the same for any number of
// workers. Within a row group the rows are read `rows_per_read` at a time and, with shuffle, each
// such block's rows are shuffled by (seed, epoch, row group, block). Each row's text becomes its
// ids (bos before, eos after, where given); a row group's ids in row order are cut into windows of
// seq_len + 1 tokens that overlap by one: window w covers the row group's tokens [w * seq_len,
// w * seq_len + seq_len + 1), input_ids its first seq_len, labels its last seq_len, as
// TokenSequences cuts a token file. A window does not cross row groups: the fewer than seq_len + 1
// tokens left at a row group's end are not used (at most seq_len tokens a row group an epoch).
// Null rows have no text and are skipped; a row longer than max_row_bytes, or text that is not
// UTF-8, is a DataError naming the file, row group and row.
// packed: the windows carry their rows' boundaries, as TokenSequences' packed windows do
// (ferry/loaders/tokens.h): position_ids that restart at 0 at the window's first token and at
// each row's first token (its bos where given), and cu_seqlens, the offsets where the window's
// rows start, then seq_len, padded to seq_len + 1 entries by repeating seq_len. A row with no
// tokens starts nothing. labels run across a row's end (mask labels[k] where position_ids[k + 1]
// == 0 for a loss that should not).
//
// Resume: a loader's state (ferry/core/state.h) holds, beside the batches delivered, the cursor of
// the next window: its row group (an index into the rank's row groups of the epoch) and its
// place there (save_cursor, as the row groups' window counts are learned while they are read).
// A restored epoch starts reading at that row group and drops the windows of it before the
// cursor: one row group is read again, not the epoch; the batches are the uninterrupted run's, at
// any worker count. A state without a cursor (one saved before the epoch's first batch was
// dealt) reads the epoch from its start and drops what came before. Each rank saves its own
// state, and the world size must stay the same: another one deals the row groups to the ranks
// differently (restore() then throws ferry::Error naming both; the state's rank and world_size
// say whose cursor it is).
// Several ranks: each rank's windows are those of its row groups, so the ranks' epochs hold
// different numbers of windows (the row groups' token counts differ) and end at different
// batches; a data-parallel loop that must take the same number of steps on every rank counts its
// steps (and reads on into the next epoch) rather than running each rank's epoch to its end.
//
// Thread safety: immutable after construction; the loader's workers share it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/core/allocator.h"
#include "ferry/core/dataset.h"
#include "ferry/core/state.h"
#include "ferry/core/tensor.h"
#include "ferry/loaders/tokenizer.h"

namespace ferry {

/// One unit of a table's work: a row group of one file.
struct TableUnit {
  std::size_t file = 0;         ///< index into ParquetFiles::paths()
  std::size_t row_group = 0;    ///< within the file
  std::uint64_t first_row = 0;  ///< the row group's first row within its file
  std::uint64_t rows = 0;
};

/// Rows of a string column, read from a row group: row i is text(i), or null.
struct TextRows {
  std::string bytes;                ///< every row's text, back to back
  std::vector<std::uint64_t> ends;  ///< row i is bytes [ends[i - 1], ends[i]) (ends[-1] = 0)
  std::vector<std::uint8_t> valid;  ///< 0 for a null row
  std::size_t size() const noexcept { return ends.size(); }
  std::string_view text(std::size_t i) const noexcept {
    const std::uint64_t begin = i == 0 ? 0 : ends[i - 1];
    return std::string_view(bytes).substr(begin, ends[i] - begin);
  }
  void clear() noexcept {
    bytes.clear();
    ends.clear();
    valid.clear();
  }
};

struct ParquetOpenOptions {
  /// Columns every file must have (a DataError at open naming the file otherwise); string columns.
  std::vector<std::string> columns;
};

/// Parquet files opened by their footers (never their data).
class ParquetFiles {
 public:
  /// DataError naming the file for one that is missing, truncated, not Parquet, or lacks a column
  /// of `options.columns` (or has it as another type than a string); Error when built without
  /// Arrow (FERRY_WITH_ARROW) or for an empty list.
  static std::shared_ptr<const ParquetFiles> open(std::vector<std::string> paths, const ParquetOpenOptions& options = {});
  virtual ~ParquetFiles() = default;
  const std::vector<std::string>& paths() const noexcept { return paths_; }
  /// Every non-empty row group of every file, file by file.
  std::span<const TableUnit> units() const noexcept { return units_; }
  std::uint64_t rows() const noexcept { return rows_; }
  /// Reads string column `column` of unit `unit`, `rows_per_read` rows at a time, calling
  /// block(rows, first) with each block's rows (`first`: its first row within the row group) until
  /// it returns false. DataError naming the file and row group for a damaged page, the column
  /// missing or not a string, or a row longer than `max_row_bytes`.
  virtual void read_text(std::size_t unit, const std::string& column, std::size_t rows_per_read, std::uint64_t max_row_bytes,
                         const std::function<bool(const TextRows& rows, std::uint64_t first)>& block) const = 0;

 protected:
  ParquetFiles() = default;
  std::vector<std::string> paths_;
  std::vector<TableUnit> units_;
  std::uint64_t rows_ = 0;
};

/// A window of a row group (TableTokens::read_unit): its seq_len + 1 ids and, when packed, the
/// offsets in (0, seq_len) where rows begin in it, ascending (the window's first token begins one
/// too, and is not listed).
struct TableWindow {
  std::vector<std::int32_t> ids;
  std::vector<std::uint32_t> starts;
};

/// Options of TableTokens (Note [Table windows]).
struct TableTokensOptions {
  std::string text = "text";  ///< the text column
  /// Tokens a window's input_ids hold, in [1, TokenSequenceOptions::kMaxSeqLen].
  std::size_t seq_len = 1024;
  std::optional<std::int32_t> bos;  ///< an id put before each row's ids
  std::optional<std::int32_t> eos;  ///< an id put after each row's ids (GPT-2's <|endoftext|>)
  bool shuffle = true;              ///< the row groups' order, and the rows within each block, by (seed, epoch)
  /// Windows with their rows' position_ids and cu_seqlens (Note [Table windows]).
  bool packed = false;
  std::size_t rows_per_read = 1024;                       ///< rows read (and shuffled) at a time, in [1, 1 << 20]
  std::uint64_t max_row_bytes = std::uint64_t{64} << 20;  ///< a longer row is a DataError
  int rank = 0;                                           ///< this process's rank
  int world_size = 1;
};

/// Windows of tokenized rows of Parquet files, as a stream that fills batches across a loader's
/// workers. Samples: input_ids and labels [seq_len] int64; packed, position_ids [seq_len] int64 and
/// cu_seqlens [seq_len + 1] int32 beside them.
class TableTokens : public DatasetBase<TableTokens> {
 public:
  static constexpr bool kFillsAcrossWorkers = true;
  /// Error for a null files or tokenizer, an option out of its range, or a rank outside the world
  /// size; DataError naming the file that lacks the text column.
  TableTokens(std::shared_ptr<const ParquetFiles> files, std::shared_ptr<const Tokenizer> tokenizer,
              TableTokensOptions options = {});

  class Stream {
   public:
    std::optional<std::vector<Tensor>> next();
    /// The next window written into row `row` of a batch make_batch made (the loader's direct
    /// mode: no tensor a window, no collate copy); false at the stream's end.
    bool next_into(std::vector<Tensor>& batch, std::size_t row);
    /// Drops the epoch's first n windows (whole batches: a resumed epoch).
    std::size_t skip(std::size_t n);
    /// In a loader: the batch the next windows are for.
    void begin_batch(std::uint64_t batch) { batch_ = batch; }
    /// In a loader: the epoch-wide position of the window next() last returned.
    std::optional<std::uint64_t> position() const;

   private:
    friend class TableTokens;
    std::shared_ptr<const TableWindow> next_window();
    std::shared_ptr<detail::BatchFeed> feed_;
    std::uint64_t batch_ = 0, position_ = 0;
    bool packed_ = false;
    // Outside a loader: this stream's own reading, one row group after another.
    struct Own;
    std::shared_ptr<Own> own_;
  };
  /// In a loader (WorkerInfo::share and batch_size set): the worker's windows of the rank's one
  /// reading of the epoch. Otherwise all of the rank's windows of the worker's epoch, in order.
  Stream open(const WorkerInfo& worker) const;
  /// The row groups (indices into files()->units()) this rank reads in `epoch`, in order.
  std::vector<std::size_t> rank_units(std::uint64_t seed, std::uint64_t epoch) const;
  /// "input_ids", "labels", and when packed "position_ids", "cu_seqlens".
  std::vector<std::string> field_names() const;
  /// A batch of n windows for next_into: input_ids and labels [n, seq_len] int64 (packed: and
  /// position_ids [n, seq_len] int64, cu_seqlens [n, seq_len + 1] int32).
  std::vector<Tensor> make_batch(std::size_t n, BatchAllocator& allocator) const;
  const std::shared_ptr<const ParquetFiles>& files() const noexcept { return files_; }
  const TableTokensOptions& options() const noexcept { return options_; }

  /// The windows of one row group in the epoch (what a loader's reading deals for it), until push
  /// returns false; true when every window was pushed.
  bool read_unit(std::size_t unit, std::uint64_t seed, std::uint64_t epoch,
                 const std::function<bool(TableWindow window)>& push) const;

  /// The loader's hooks (ferry/core/state.h): the next window's cursor into a stream state, and a
  /// restored state's cursor for the next reading of its epoch. The dataset's copies share them.
  void save_cursor(LoaderState& state) const;
  void restore_cursor(const LoaderState& state) const;

 private:
  std::shared_ptr<const ParquetFiles> files_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  TableTokensOptions options_;
  struct Book;  // window counts learned, and a restored cursor (table_tokens.cpp)
  std::shared_ptr<Book> book_;
};

}  // namespace ferry
