// table.cpp — ParquetFiles on Apache Arrow's C++ Parquet reader (ferry/loaders/table.h), built as
// the module libferry_parquet.so that ParquetFiles::open loads on first use (table_open.cpp).
// Arrow's types stay in this file.
#include <parquet/column_reader.h>
#include <parquet/exception.h>
#include <parquet/file_reader.h>
#include <parquet/metadata.h>
#include <parquet/schema.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <new>
#include <thread>

#include "ferry/core/error.h"
#include "ferry/loaders/table.h"

namespace ferry {
namespace {

constexpr std::size_t kFooterThreads = 16;

// A top-level column of a string type (Parquet's BYTE_ARRAY as UTF-8 text, or no logical type).
bool is_text(const parquet::ColumnDescriptor& c) {
  if (c.physical_type() != parquet::Type::BYTE_ARRAY) return false;
  const auto& logical = c.logical_type();
  return !logical || logical->is_none() || logical->is_string();
}

}  // namespace

class ArrowParquetFiles final : public ParquetFiles {
 public:
  ArrowParquetFiles(std::vector<std::string> paths, const ParquetOpenOptions& options) {
    paths_ = std::move(paths);
    meta_.resize(paths_.size());
    std::vector<std::exception_ptr> errors(paths_.size());
    std::atomic<std::size_t> next{0};
    {
      std::vector<std::jthread> threads;
      const std::size_t n = std::min(kFooterThreads, paths_.size());
      for (std::size_t t = 0; t < n; ++t)
        threads.emplace_back([&] {
          for (std::size_t i; (i = next.fetch_add(1)) < paths_.size();) {
            try {
              meta_[i] = read_footer(paths_[i], options);
            } catch (...) {
              errors[i] = std::current_exception();
            }
          }
        });
    }
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);  // the first file's error, in the list's order
    for (std::size_t f = 0; f < paths_.size(); ++f) {
      std::uint64_t first = 0;
      for (int g = 0; g < meta_[f]->num_row_groups(); ++g) {
        const auto rows = static_cast<std::uint64_t>(meta_[f]->RowGroup(g)->num_rows());
        if (rows > 0) units_.push_back({f, static_cast<std::size_t>(g), first, rows});
        first += rows;
      }
      rows_ += first;
    }
  }

  void read_text(std::size_t unit, const std::string& column, std::size_t rows_per_read, std::uint64_t max_row_bytes,
                 const std::function<bool(const TextRows&, std::uint64_t)>& block) const override {
    if (unit >= units_.size()) throw Error("ParquetFiles: unit " + std::to_string(unit) + " of " + std::to_string(units_.size()));
    const TableUnit& u = units_[unit];
    const std::string& path = paths_[u.file];
    const std::string where = "row group " + std::to_string(u.row_group);
    const int col = text_column(path, *meta_[u.file], column);
    auto fail = [&](const std::string& what) -> DataError { return DataError(path, DataError::kNoOffset, where + ": " + what); };
    // Parquet's own column reader (no Arrow arrays, futures or threads): each value a view into
    // the page being read, copied into `rows` before the next batch.
    try {
      const auto reader = parquet::ParquetFileReader::OpenFile(path, false, parquet::default_reader_properties(), meta_[u.file]);
      const std::shared_ptr<parquet::ColumnReader> base = reader->RowGroup(static_cast<int>(u.row_group))->Column(col);
      auto* column = dynamic_cast<parquet::ByteArrayReader*>(base.get());
      if (!column) throw fail("column '" + column_name(col, u.file) + "' is not a byte array column");
      const std::int16_t max_def = meta_[u.file]->schema()->Column(col)->max_definition_level();
      const auto n = static_cast<std::int64_t>(std::max<std::size_t>(rows_per_read, 1));
      std::vector<std::int16_t> def(static_cast<std::size_t>(n));
      std::vector<parquet::ByteArray> values(static_cast<std::size_t>(n));
      TextRows rows;
      std::uint64_t first = 0;
      while (first < u.rows && column->HasNext()) {
        rows.clear();
        std::int64_t got_values = 0;
        const std::int64_t levels = column->ReadBatch(n, max_def > 0 ? def.data() : nullptr, nullptr, values.data(), &got_values);
        if (levels <= 0) break;
        std::int64_t v = 0;
        for (std::int64_t i = 0; i < levels; ++i) {
          const bool present = max_def == 0 || def[static_cast<std::size_t>(i)] == max_def;
          if (present) {
            if (v >= got_values)
              throw fail("at row " + std::to_string(first + static_cast<std::uint64_t>(i)) + ": fewer values than levels");
            const parquet::ByteArray& b = values[static_cast<std::size_t>(v++)];
            if (b.len > max_row_bytes)
              throw fail("row " + std::to_string(first + static_cast<std::uint64_t>(i)) + " holds " + std::to_string(b.len) +
                         " bytes, more than max_row_bytes (" + std::to_string(max_row_bytes) + ")");
            rows.bytes.append(reinterpret_cast<const char*>(b.ptr), b.len);
          }
          rows.ends.push_back(rows.bytes.size());
          rows.valid.push_back(present ? 1 : 0);
        }
        if (!block(rows, first)) return;
        first += static_cast<std::uint64_t>(levels);
      }
      if (first != u.rows) throw fail("has " + std::to_string(first) + " rows, its footer says " + std::to_string(u.rows));
    } catch (const parquet::ParquetException& e) {
      throw fail(e.what());
    } catch (const std::bad_alloc&) {
      throw fail("a page too large to read");
    }
  }

 private:
  static std::shared_ptr<parquet::FileMetaData> read_footer(const std::string& path, const ParquetOpenOptions& options) {
    std::shared_ptr<parquet::FileMetaData> meta;
    try {
      meta = parquet::ParquetFileReader::OpenFile(path)->metadata();
    } catch (const parquet::ParquetException& e) {
      throw DataError(path, DataError::kNoOffset, std::string("not a readable Parquet file: ") + e.what());
    }
    for (const std::string& c : options.columns) (void)text_column(path, *meta, c);
    return meta;
  }

  // The leaf index of top-level string column `name`; DataError naming the file otherwise.
  static int text_column(const std::string& path, const parquet::FileMetaData& meta, const std::string& name) {
    const parquet::SchemaDescriptor& schema = *meta.schema();
    for (int i = 0; i < schema.num_columns(); ++i) {
      const parquet::ColumnDescriptor& c = *schema.Column(i);
      if (c.path()->ToDotString() != name) continue;
      if (!is_text(c) || c.max_repetition_level() != 0)
        throw DataError(path, DataError::kNoOffset,
                        "column '" + name + "' is " + c.logical_type()->ToString() + " (" +
                            parquet::TypeToString(c.physical_type()) + "), not a string column");
      return i;
    }
    std::string names;
    for (int i = 0; i < schema.num_columns() && i < 20; ++i) names += (i ? ", " : "") + schema.Column(i)->path()->ToDotString();
    throw DataError(path, DataError::kNoOffset, "no column '" + name + "' (its columns: " + names + ")");
  }

  std::string column_name(int col, std::size_t file) const { return meta_[file]->schema()->Column(col)->path()->ToDotString(); }

  std::vector<std::shared_ptr<parquet::FileMetaData>> meta_;
};

}  // namespace ferry

// The module's one entry (table_open.cpp declares it): the files opened, or an exception.
extern "C" __attribute__((visibility("default"))) void ferry_parquet_open(std::vector<std::string>* paths,
                                                                          const ferry::ParquetOpenOptions* options,
                                                                          std::shared_ptr<const ferry::ParquetFiles>* out) {
  *out = std::make_shared<ferry::ArrowParquetFiles>(std::move(*paths), *options);
}
