// table_tokens.cpp — TableTokens: rows of a table tokenized in a loader's reading of the epoch
// and cut into windows (Note [Table windows] in ferry/loaders/table.h). No Arrow here: the rows
// come from ParquetFiles::read_text.
#include <algorithm>
#include <cstring>
#include <mutex>

#include "ferry/core/error.h"
#include "ferry/core/random.h"
#include "ferry/loaders/table.h"
#include "ferry/loaders/tokens.h"

namespace ferry {
namespace {

// A seeded order of [0, n) (Fisher-Yates on ferry's Generator: the same on every platform).
void shuffle_order(std::vector<std::uint32_t>& order, Generator rng) {
  for (std::size_t i = order.size(); i > 1; --i) {
    const auto j = static_cast<std::size_t>(rng.next_u64() % i);
    std::swap(order[i - 1], order[j]);
  }
}

// The generator streams of the table's two shuffles (distinct from the samplers' keys).
constexpr std::uint64_t kUnitOrderStream = 0x7461626c65756e69ULL;  // "tableuni"
constexpr std::uint64_t kRowOrderStream = 0x7461626c65726f77ULL;   // "tablerow"

// Tokens the lanes of a reading hold ahead of the workers, all lanes together (the lane of the row
// group being dealt holds up to 4x its share): 64 MiB of ids.
constexpr std::size_t kReadAheadTokens = std::size_t{1} << 24;

// Reader threads a loader's reading of an epoch uses (at most the units, at least one).
std::size_t lanes_for(int num_workers, std::size_t units) {
  return std::clamp<std::size_t>(static_cast<std::size_t>(std::max(num_workers, 1)), 1, std::max<std::size_t>(units, 1));
}

}  // namespace

// What the loader's readings learn of an epoch: each row group's window count (-1 until read
// through), counted from the row group a reading started at (base_unit, whose first window is
// the epoch's window base_record); and a restored cursor waiting for its epoch's reading.
struct TableTokens::Book {
  struct Epoch {
    std::uint64_t epoch = 0;
    std::size_t base_unit = 0;
    std::uint64_t base_record = 0;
    std::vector<std::int64_t> windows;
  };
  struct Resume {
    std::uint64_t epoch = 0, unit = 0, offset = 0, record = 0;
  };
  std::mutex mu;
  std::vector<Epoch> epochs;  // the latest two readings' (the epoch being consumed, the one ahead)
  std::optional<Resume> resume;
};

TableTokens::TableTokens(std::shared_ptr<const ParquetFiles> files, std::shared_ptr<const Tokenizer> tokenizer,
                         TableTokensOptions options)
    : files_(std::move(files)), tokenizer_(std::move(tokenizer)), options_(std::move(options)), book_(std::make_shared<Book>()) {
  if (!files_) throw Error("TableTokens: no files (ParquetFiles::open)");
  if (!tokenizer_) throw Error("TableTokens: no tokenizer (open_tokenizer)");
  if (options_.seq_len < 1 || options_.seq_len > TokenSequenceOptions::kMaxSeqLen)
    throw Error("TableTokens: seq_len " + std::to_string(options_.seq_len) + " is outside [1, " +
                std::to_string(TokenSequenceOptions::kMaxSeqLen) + "]");
  if (options_.rows_per_read < 1 || options_.rows_per_read > (std::size_t{1} << 20))
    throw Error("TableTokens: rows_per_read " + std::to_string(options_.rows_per_read) + " is outside [1, 1048576]");
  if (options_.world_size < 1 || options_.rank < 0 || options_.rank >= options_.world_size)
    throw Error("TableTokens: rank " + std::to_string(options_.rank) + " is not valid for world_size " +
                std::to_string(options_.world_size));
  for (const auto& [name, id] : {std::pair{"bos", options_.bos}, std::pair{"eos", options_.eos}})
    if (id && (*id < 0 || static_cast<std::size_t>(*id) >= tokenizer_->vocab_size()))
      throw Error(std::string("TableTokens: ") + name + " " + std::to_string(*id) + " is outside the tokenizer's vocabulary (" +
                  std::to_string(tokenizer_->vocab_size()) + " ids)");
  if (options_.text.empty()) throw Error("TableTokens: no text column named");
}

std::vector<std::size_t> TableTokens::rank_units(std::uint64_t seed, std::uint64_t epoch) const {
  const std::size_t n = files_->units().size();
  std::vector<std::uint32_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = static_cast<std::uint32_t>(i);
  if (options_.shuffle) shuffle_order(order, Generator(seed, kUnitOrderStream, epoch));
  std::vector<std::size_t> mine;
  for (std::size_t k = static_cast<std::size_t>(options_.rank); k < n; k += static_cast<std::size_t>(options_.world_size))
    mine.push_back(order[k]);
  return mine;
}

bool TableTokens::read_unit(std::size_t unit, std::uint64_t seed, std::uint64_t epoch,
                            const std::function<bool(TableWindow)>& push) const {
  const TableUnit& u = files_->units()[unit];
  const std::string& path = files_->paths()[u.file];
  const std::size_t len = options_.seq_len;
  std::vector<std::int32_t> ids;    // the row group's ids not yet in a window (the last window's last token first)
  std::vector<std::size_t> starts;  // packed: where rows begin in ids, ascending
  std::size_t at = 0, started = 0;  // ids before `at` are used; starts before `started` too
  std::vector<std::uint32_t> order;
  // What names a row in an error: the prefix once a row group, the row's number put after it.
  std::string where = path + ", row group " + std::to_string(u.row_group) + ", row ";
  const std::size_t where_prefix = where.size();
  bool more = true;
  files_->read_text(
      unit, options_.text, options_.rows_per_read, options_.max_row_bytes, [&](const TextRows& rows, std::uint64_t first) {
        order.resize(rows.size());
        for (std::size_t i = 0; i < rows.size(); ++i) order[i] = static_cast<std::uint32_t>(i);
        if (options_.shuffle)
          shuffle_order(order, Generator(seed, kRowOrderStream ^ (epoch * 0x9E3779B97F4A7C15ULL), unit * 0x100000000ULL + first));
        for (std::uint32_t i : order) {
          if (!rows.valid[i]) continue;
          const std::size_t begin = ids.size();
          if (options_.bos) ids.push_back(*options_.bos);
          where.resize(where_prefix);
          where += std::to_string(first + i);
          tokenizer_->encode(rows.text(i), ids, where);
          if (options_.eos) ids.push_back(*options_.eos);
          if (options_.packed && ids.size() > begin) starts.push_back(begin);
        }
        while (ids.size() - at >= len + 1) {
          TableWindow w;
          w.ids.assign(ids.begin() + static_cast<std::ptrdiff_t>(at), ids.begin() + static_cast<std::ptrdiff_t>(at + len + 1));
          // The rows beginning among this window's inputs, after its first token (which restarts anyway).
          while (started < starts.size() && starts[started] <= at) ++started;
          for (std::size_t k = started; k < starts.size() && starts[k] < at + len; ++k)
            w.starts.push_back(static_cast<std::uint32_t>(starts[k] - at));
          at += len;
          if (!push(std::move(w))) return more = false;
        }
        ids.erase(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(at));  // keeps the overlap token
        while (started < starts.size() && starts[started] < at) ++started;
        starts.erase(starts.begin(), starts.begin() + static_cast<std::ptrdiff_t>(started));
        for (std::size_t& s : starts) s -= at;
        at = 0;
        started = 0;
        return true;
      });
  return more;
}

void TableTokens::save_cursor(LoaderState& state) const {
  if (state.stream_workers == 0 || state.batches == 0) return;  // not a stream's, or at its epoch's start
  const std::uint64_t record = state.batches * state.batch_size;
  // The cursor indexes this rank's row groups: the state names the rank and world size it holds for.
  auto set = [&](std::uint64_t unit, std::uint64_t offset) {
    state.cursor = 1;
    state.cursor_unit = unit;
    state.cursor_offset = offset;
    state.world_size = static_cast<std::uint64_t>(options_.world_size);
    state.rank = static_cast<std::uint64_t>(options_.rank);
  };
  std::lock_guard l(book_->mu);
  if (book_->resume && book_->resume->epoch == state.epoch && book_->resume->record == record)
    return set(book_->resume->unit, book_->resume->offset);                   // restored and not read since
  for (auto it = book_->epochs.rbegin(); it != book_->epochs.rend(); ++it) {  // the latest reading of the epoch
    const Book::Epoch& e = *it;
    if (e.epoch != state.epoch || record < e.base_record) continue;
    std::size_t k = e.base_unit;
    std::uint64_t at = e.base_record;
    while (k < e.windows.size() && e.windows[k] >= 0 && at + static_cast<std::uint64_t>(e.windows[k]) <= record) {
      at += static_cast<std::uint64_t>(e.windows[k]);
      ++k;
    }
    return set(k, record - at);
  }
}

void TableTokens::restore_cursor(const LoaderState& state) const {
  std::lock_guard l(book_->mu);
  book_->resume.reset();
  if (!state.cursor || state.batches == 0) return;
  if (state.world_size != static_cast<std::uint64_t>(options_.world_size) ||
      state.rank != static_cast<std::uint64_t>(options_.rank))
    throw Error("TableTokens: the state's cursor is rank " + std::to_string(state.rank) + "'s of world size " +
                std::to_string(state.world_size) + ", this dataset is rank " + std::to_string(options_.rank) + " of " +
                std::to_string(options_.world_size) +
                " (the row groups are dealt to the ranks by the world size; each rank "
                "restores its own state at the same world size)");
  book_->resume = Book::Resume{state.epoch, state.cursor_unit, state.cursor_offset, state.batches * state.batch_size};
}

struct TableTokens::Stream::Own {
  std::shared_ptr<const TableTokens> table;
  std::vector<std::size_t> units;
  std::size_t next_unit = 0;
  std::uint64_t seed = 0, epoch = 0;
  std::vector<std::shared_ptr<const TableWindow>> windows;  // the unit being read's, not yet returned
  std::size_t taken = 0;
};

TableTokens::Stream TableTokens::open(const WorkerInfo& worker) const {
  Stream s;
  s.packed_ = options_.packed;
  if (!worker.share || worker.batch_size == 0) {
    s.own_ = std::make_shared<Stream::Own>();
    s.own_->table = std::make_shared<const TableTokens>(*this);
    s.own_->seed = worker.seed;
    s.own_->epoch = worker.epoch;
    s.own_->units = rank_units(worker.seed, worker.epoch);
    return s;
  }
  s.feed_ = worker.share->get<detail::BatchFeed>(this, [&] {
    std::vector<std::size_t> order = rank_units(worker.seed, worker.epoch);
    std::size_t from = 0;     // the row group the reading starts at (a restored cursor's)
    std::uint64_t drop = 0;   // its windows before the cursor
    std::uint64_t first = 0;  // the epoch's windows before the cursor
    {
      std::lock_guard l(book_->mu);
      if (book_->resume && book_->resume->epoch == worker.epoch) {
        const Book::Resume r = *book_->resume;
        book_->resume.reset();
        if (r.unit > order.size() || r.record % worker.batch_size != 0)
          throw Error("TableTokens: the restored state's cursor (row group " + std::to_string(r.unit) + " of the epoch's " +
                      std::to_string(order.size()) + ") is not this dataset's");
        from = static_cast<std::size_t>(r.unit);
        drop = r.offset;
        first = r.record;
      }
      if (book_->epochs.size() == 2) book_->epochs.erase(book_->epochs.begin());
      book_->epochs.push_back({worker.epoch, from, first - drop, std::vector<std::int64_t>(order.size(), -1)});
    }
    auto units = std::make_shared<const std::vector<std::size_t>>(order.begin() + static_cast<std::ptrdiff_t>(from), order.end());
    detail::BatchFeed::Shape shape;
    shape.units = units->size();
    shape.lanes = lanes_for(worker.num_workers, units->size());
    // Each lane reads ahead up to its share of kReadAheadTokens (a row group or more: the lanes
    // tokenize the next row groups while the one being dealt is taken), at least a batch.
    shape.lane_records = std::max<std::size_t>(worker.batch_size, kReadAheadTokens / shape.lanes / (options_.seq_len + 1));
    shape.batch_size = worker.batch_size;
    shape.first_position = first;
    std::weak_ptr<Book> book = book_;
    auto self = std::make_shared<const TableTokens>(*this);  // the reading keeps the dataset alive (an abandoned worker)
    auto feed = std::make_unique<detail::BatchFeed>(
        shape,
        [self, units, book, from, drop, seed = worker.seed, epoch = worker.epoch](std::size_t k, detail::BatchFeed::Sink& sink) {
          // The row group's last window is pushed once its count is in the book: a state saved
          // after that window finds where the next row group starts.
          std::exception_ptr failed;
          std::int64_t windows = 0;
          std::shared_ptr<TableWindow> held;
          bool whole = false, open = true;
          try {
            whole = self->read_unit((*units)[k], seed, epoch, [&](TableWindow w) {
              if (k == 0 && static_cast<std::uint64_t>(windows) < drop) {  // before the restored cursor
                ++windows;
                return true;
              }
              ++windows;
              if (held && !sink.push(std::move(held))) return open = false;
              held = std::make_shared<TableWindow>(std::move(w));
              return true;
            });
          } catch (...) {
            failed = std::current_exception();
          }
          if (!open) return;
          if (failed) {  // handed over outside the handler; the error takes the next position
            if (held && !sink.push(std::move(held))) return;
            sink.fail(std::move(failed));
            return;
          }
          if (!whole) return;
          if (const std::shared_ptr<Book> b = book.lock()) {
            std::lock_guard l(b->mu);
            for (Book::Epoch& e : b->epochs)
              if (e.epoch == epoch && e.base_unit == from && from + k < e.windows.size()) e.windows[from + k] = windows;
          }
          if (held) sink.push(std::move(held));
        },
        worker.share->cancelled());
    return feed;
  });
  return s;
}

std::shared_ptr<const TableWindow> TableTokens::Stream::next_window() {
  if (feed_) {
    std::shared_ptr<void> box = feed_->next(batch_, position_);
    return std::static_pointer_cast<const TableWindow>(box);
  }
  Own& o = *own_;
  while (o.taken == o.windows.size()) {
    if (o.next_unit == o.units.size()) return nullptr;
    o.windows.clear();
    o.taken = 0;
    o.table->read_unit(o.units[o.next_unit++], o.seed, o.epoch, [&](TableWindow w) {
      o.windows.push_back(std::make_shared<const TableWindow>(std::move(w)));
      return true;
    });
  }
  return std::move(o.windows[o.taken++]);
}

namespace {
// Window `w` (seq_len + 1 ids) as a sample's rows: input_ids its first seq_len ids, labels its
// last; packed (positions and cu not null), position_ids restarting at each row's start and
// cu_seqlens, the starts then seq_len repeated to seq_len + 1 entries.
void write_window(const TableWindow& w, std::int64_t* in, std::int64_t* out, std::int64_t* positions, std::int32_t* cu) {
  const std::size_t len = w.ids.size() - 1;
  for (std::size_t k = 0; k < len; ++k) {
    in[k] = w.ids[k];
    out[k] = w.ids[k + 1];
  }
  if (!positions) return;
  std::size_t docs = 0, next = 0, first = 0;
  cu[docs++] = 0;
  for (std::size_t k = 0; k < len; ++k) {
    if (next < w.starts.size() && w.starts[next] == k) {
      first = k;
      ++next;
      cu[docs++] = static_cast<std::int32_t>(k);
    }
    positions[k] = static_cast<std::int64_t>(k - first);
  }
  while (docs <= len) cu[docs++] = static_cast<std::int32_t>(len);
}
}  // namespace

std::optional<std::vector<Tensor>> TableTokens::Stream::next() {
  const auto w = next_window();
  if (!w) return std::nullopt;
  const auto n = static_cast<std::int64_t>(w->ids.size() - 1);
  std::vector<Tensor> out{Tensor::empty(DType::Int64, {n}), Tensor::empty(DType::Int64, {n})};
  const bool packed = packed_;
  if (packed) {
    out.push_back(Tensor::empty(DType::Int64, {n}));
    out.push_back(Tensor::empty(DType::Int32, {n + 1}));
  }
  write_window(*w, out[0].data<std::int64_t>(), out[1].data<std::int64_t>(), packed ? out[2].data<std::int64_t>() : nullptr,
               packed ? out[3].data<std::int32_t>() : nullptr);
  return out;
}

bool TableTokens::Stream::next_into(std::vector<Tensor>& batch, std::size_t row) {
  const auto w = next_window();
  if (!w) return false;
  const std::size_t len = w->ids.size() - 1;
  const bool packed = packed_;
  write_window(*w, batch.at(0).data<std::int64_t>() + row * len, batch.at(1).data<std::int64_t>() + row * len,
               packed ? batch.at(2).data<std::int64_t>() + row * len : nullptr,
               packed ? batch.at(3).data<std::int32_t>() + row * (len + 1) : nullptr);
  return true;
}

std::vector<std::string> TableTokens::field_names() const {
  if (options_.packed) return {"input_ids", "labels", "position_ids", "cu_seqlens"};
  return {"input_ids", "labels"};
}

std::vector<Tensor> TableTokens::make_batch(std::size_t n, BatchAllocator& allocator) const {
  const auto rows = static_cast<std::int64_t>(n), len = static_cast<std::int64_t>(options_.seq_len);
  std::vector<Tensor> b{empty(DType::Int64, {rows, len}, allocator), empty(DType::Int64, {rows, len}, allocator)};
  if (options_.packed) {
    b.push_back(empty(DType::Int64, {rows, len}, allocator));
    b.push_back(empty(DType::Int32, {rows, len + 1}, allocator));
  }
  return b;
}

std::size_t TableTokens::Stream::skip(std::size_t n) {
  if (feed_) {
    feed_->skip(n);
    return n;
  }
  std::size_t k = 0;
  while (k < n && next()) ++k;
  return k;
}

std::optional<std::uint64_t> TableTokens::Stream::position() const {
  if (!feed_) return std::nullopt;
  return position_;
}

}  // namespace ferry
