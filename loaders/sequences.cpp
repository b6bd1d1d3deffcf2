// Token files, Megatron-LM indexed datasets, sequences and mixtures (ferry/loaders/tokens.h).
//
// Note [Token positions in O(1)]
// Nothing here reads a corpus before its first sample: a flat file's windows are arithmetic on
// the token count, a Megatron corpus's document boundaries come from a binary search of its
// pointer array (memory-mapped), and a mixture's source for a global index comes from the block's
// counts (largest remainder) and a permutation evaluated at one position (IndexPermutation). So
// the first batch costs what one batch costs whatever the corpus size, and a resume is the same
// arithmetic from another index. The index is checked where it is read: a sample that touches a
// pointer checks it against its neighbour and the .bin's size, so a damaged index is a DataError
// naming the .idx and the entry's byte offset, found when a sample reaches it (fuzzed: FERRY_FUZZ_TOKENS).
//
// This file: the sequences cut from a corpus (TokenSequences: windows, packing, best fit).
#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>

#include "ferry/loaders/tokens.h"
#include "io.h"

namespace ferry {

// --- sequences ----------------------------------------------------------------------------------

TokenSequences::TokenSequences(std::shared_ptr<const TokenCorpus> corpus, TokenSequenceOptions options)
    : corpus_(std::move(corpus)), options_(options) {
  if (!corpus_) throw Error("TokenSequences: no corpus");
  const std::string& n = corpus_->name();
  if (options_.seq_len < 1 || options_.seq_len > TokenSequenceOptions::kMaxSeqLen)
    throw Error("TokenSequences(" + n + "): seq_len must be in [1, 2^30], got " + std::to_string(options_.seq_len));
  if (options_.dtype != DType::Int64 && options_.dtype != DType::Int32)
    throw Error("TokenSequences(" + n + "): dtype must be int64 or int32, got " + dtype_name(options_.dtype));
  if (options_.packed && !corpus_->has_documents())
    throw Error(
        "TokenSequences(" + n +
        "): packed sequences need the corpus's documents: give the end-of-document token id (eod), or read a Megatron index");
  if (options_.shuffle_documents && corpus_->documents() == 0)
    throw Error("TokenSequences(" + n +
                "): shuffle_documents needs an indexed corpus (a Megatron index): a flat file's documents are "
                "found only by reading it");
  if (options_.shuffle_documents && options_.random_offset)
    throw Error("TokenSequences(" + n +
                "): shuffle_documents and random_offset do not go together (random windows have no order)");
  if (options_.shuffle_documents && options_.document_block < 1)
    throw Error("TokenSequences(" + n + "): document_block must be >= 1");
  if (options_.best_fit_group > 0) {
    if (!options_.packed) throw Error("TokenSequences(" + n + "): best_fit_group is for packed sequences (packed = true)");
    if (corpus_->documents() == 0)
      throw Error("TokenSequences(" + n +
                  "): best-fit packing needs an indexed corpus (a Megatron index): it places documents by "
                  "their lengths, which a flat file gives only when read");
    if (options_.random_offset || options_.raw)
      throw Error("TokenSequences(" + n + "): best-fit packing does not go with random_offset or raw windows");
    if (options_.best_fit_group > 65536)
      throw Error("TokenSequences(" + n + "): best_fit_group must be at most 65536, got " +
                  std::to_string(options_.best_fit_group));
  }
  if (options_.num_samples && !options_.random_offset)
    throw Error("TokenSequences(" + n +
                "): num_samples is for random_offset windows (ordered windows are as many as the corpus holds)");
  if (corpus_->size() < options_.seq_len + 1)
    throw Error("TokenSequences(" + n + "): the corpus has " + std::to_string(corpus_->size()) +
                " tokens, fewer than one window of seq_len + 1 = " + std::to_string(options_.seq_len + 1));
  size_ = static_cast<std::size_t>((corpus_->size() - 1) / options_.seq_len);
  if (options_.num_samples) size_ = *options_.num_samples;
  static std::atomic<std::uint64_t> ids{0};
  id_ = ++ids;
}

std::uint64_t TokenSequences::window_start(std::size_t index, SampleContext& ctx) const {
  if (index >= size_)
    throw Error(corpus_->name() + ": window " + std::to_string(index) + " out of range for " + std::to_string(size_));
  return start_of(options_, corpus_->size(), index, [&]() -> Generator& { return ctx.rng(); });
}

// Note [Token windows on the GPU] (ferry/loaders/tokens.h): input_ids and labels are two windows
// of the corpus's one array, at shift 0 and 1, from the sample's window_start.
std::vector<HostRows> TokenSequences::host_rows(std::string& why) const {
  if (options_.packed) {
    why = "packed windows' position_ids and cu_seqlens are made on the host";
    return {};
  }
  if (options_.shuffle_documents) {
    why = "a window of shuffled documents is not one run of the file";
    return {};
  }
  const TokenCorpus::Array array = corpus_->in_memory(why);
  if (!array.data) return {};
  const TokenType type = corpus_->type();
  HostRows base;
  base.data = array.data;
  base.rows = static_cast<std::int64_t>(corpus_->size());
  base.row_bytes = token_size(type);
  base.dtype = raw_dtype();
  base.name = corpus_->name();
  base.mapped_file = array.mapped_file;
  RowWindow w;
  w.is_unsigned = type == TokenType::UInt8 || type == TokenType::UInt16 || type == TokenType::UInt32;
  const std::uint64_t seq = options_.seq_len, tokens = corpus_->size();
  // window_start's rule, without a SampleContext (the same generator: Generator(seed, epoch, index)).
  w.start = [o = options_, tokens](std::size_t i, std::uint64_t seed, std::uint64_t epoch) {
    return start_of(o, tokens, i, [&] { return Generator(seed, epoch, i); });
  };
  std::vector<HostRows> fields;
  if (options_.raw) {
    w.length = static_cast<std::int64_t>(seq + 1);
    w.dtype = raw_dtype();
    fields.push_back(base);
    fields.back().window = w;
    return fields;
  }
  w.length = static_cast<std::int64_t>(seq);
  w.dtype = options_.dtype;
  for (std::int64_t shift : {0, 1}) {
    fields.push_back(base);
    fields.back().window = w;
    fields.back().window->shift = shift;
  }
  return fields;
}

std::vector<std::string> TokenSequences::field_names() const {
  std::vector<std::string> names =
      options_.raw ? std::vector<std::string>{"tokens"} : std::vector<std::string>{"input_ids", "labels"};
  if (options_.packed) {
    names.emplace_back("position_ids");
    names.emplace_back("cu_seqlens");
  }
  return names;
}

DType TokenSequences::raw_dtype() const noexcept {
  switch (corpus_->type()) {
    case TokenType::UInt8: return DType::UInt8;
    case TokenType::Int8: return DType::Int8;
    case TokenType::Int16:
    case TokenType::UInt16: return DType::Int16;
    case TokenType::Int32:
    case TokenType::UInt32: return DType::Int32;
    case TokenType::Int64: return DType::Int64;
  }
  return DType::Int64;
}

namespace {
template <class T>
void store(const std::int64_t* src, std::size_t n, void* dst) {
  T* d = static_cast<T*>(dst);
  for (std::size_t i = 0; i < n; ++i) d[i] = static_cast<T>(src[i]);
}
}  // namespace

std::vector<Tensor> TokenSequences::make_batch(std::size_t rows, BatchAllocator& allocator) const {
  const auto n = static_cast<std::int64_t>(rows), len = static_cast<std::int64_t>(options_.seq_len);
  std::vector<Tensor> b;
  b.reserve(4);
  if (options_.raw) {
    b.push_back(empty(raw_dtype(), {n, len + 1}, allocator));
  } else {
    b.push_back(empty(options_.dtype, {n, len}, allocator));
    b.push_back(empty(options_.dtype, {n, len}, allocator));
  }
  if (options_.packed) {
    b.push_back(empty(options_.raw ? DType::Int32 : options_.dtype, {n, len}, allocator));
    b.push_back(empty(DType::Int32, {n, len + 1}, allocator));
  }
  return b;
}

void TokenSequences::prefetch(std::span<const std::size_t> indices) const {
  if (options_.random_offset || options_.shuffle_documents) return;
  thread_local std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  ranges.clear();
  for (std::size_t i : indices)
    if (i < size_)  // ordered windows only (above): no generator drawn
      ranges.emplace_back(start_of(options_, corpus_->size(), i, []() -> Generator { return Generator(0, 0, 0); }),
                          options_.seq_len + 1);
  corpus_->prefetch(ranges);
}

std::vector<Tensor> TokenSequences::get(std::size_t index, SampleContext& ctx) const {
  std::vector<Tensor> b = make_batch(1, pageable_allocator());
  get_into(index, b, 0, ctx);
  for (Tensor& t : b) t = t.select(0);
  return b;
}

template <class Fn>
void TokenSequences::for_each_document(std::uint64_t lo, std::uint64_t hi, SampleContext& ctx, Fn&& fn) const {
  const std::uint64_t docs = corpus_->documents();
  if (!options_.shuffle_documents) {
    std::uint64_t a = 0, b = docs;  // the last document whose start <= lo
    while (b - a > 1) {
      const std::uint64_t m = a + (b - a) / 2;
      if (corpus_->document_offset(m) <= lo)
        a = m;
      else
        b = m;
    }
    for (std::uint64_t d = a, off = corpus_->document_offset(d); d < docs && off < hi; ++d) {
      const std::uint64_t end = corpus_->document_offset(d + 1);
      fn(off, end - off, off);
      off = end;
    }
    return;
  }
  // Note [Documents shuffled in blocks].
  const std::uint64_t D = options_.document_block, blocks = (docs + D - 1) / D;
  auto block_start = [&](std::uint64_t b) { return corpus_->document_offset(std::min(b * D, docs)); };
  std::uint64_t a = 0, b = blocks;
  while (b - a > 1) {
    const std::uint64_t m = a + (b - a) / 2;
    if (block_start(m) <= lo)
      a = m;
    else
      b = m;
  }
  std::uint64_t pos = block_start(a);
  for (std::uint64_t blk = a; blk < blocks && pos < hi; ++blk) {
    const std::uint64_t first = blk * D, count = std::min(D, docs - first);
    const IndexPermutation order(count, mix_seed(ctx.seed() ^ 0x646f637368756666ull, ctx.epoch(), blk));
    for (std::uint64_t j = 0; j < count && pos < hi; ++j) {
      const std::uint64_t d = first + order.at(j);
      const std::uint64_t off = corpus_->document_offset(d), len = corpus_->document_offset(d + 1) - off;
      if (pos + len > lo) fn(off, len, pos);
      pos += len;
    }
  }
}

void TokenSequences::read_window(std::size_t index, SampleContext& ctx, std::span<std::int64_t> window,
                                 std::vector<std::size_t>* starts) const {
  const std::size_t seq = options_.seq_len;
  const std::uint64_t start = window_start(index, ctx);
  if (!options_.shuffle_documents) {
    corpus_->read(start, window);
    if (!starts) return;
    thread_local std::vector<std::uint64_t> at;
    at.clear();
    corpus_->document_starts(start, window.first(seq), at);
    for (std::uint64_t p : at) starts->push_back(static_cast<std::size_t>(p - start));
    return;
  }
  // Note [Documents shuffled in blocks]
  // Block b holds documents [b * D, (b + 1) * D) in the
  // order IndexPermutation(D', key(seed, epoch, b)); its tokens start where the corpus order's do
  // (a block's length does not change with its order), so the block holding stream position p is
  // a binary search over block starts, and its documents are walked in their order from there
  // (for_each_document).
  std::size_t filled = 0;
  const std::uint64_t end = start + window.size();
  for_each_document(start, end, ctx, [&](std::uint64_t off, std::uint64_t len, std::uint64_t pos) {
    const std::uint64_t from = std::max(start, pos), to = std::min(end, pos + len);
    if (to <= from) return;  // an empty document
    const auto at = static_cast<std::size_t>(from - start);
    if (starts && pos > start && at < seq) starts->push_back(at);
    corpus_->read(off + (from - pos), window.subspan(at, static_cast<std::size_t>(to - from)));
    filled += static_cast<std::size_t>(to - from);
  });
  if (filled < window.size())
    throw Error(corpus_->name() + ": window " + std::to_string(index) + " runs past the stream's end (the index changed?)");
}

// Best-fit packing (Note [Best-fit packing], ferry/loaders/tokens.h). A group's pieces are known
// from the index alone; the sequences of the last group a thread packed are kept, keyed by
// (sequences, seed, epoch, group), so a sampler that visits a group's sequences together packs it once.
void TokenSequences::read_best_fit(std::size_t index, SampleContext& ctx, std::span<std::int64_t> inputs,
                                   std::span<std::int64_t> labels, std::vector<std::size_t>& starts) const {
  if (index >= size_)
    throw Error(corpus_->name() + ": window " + std::to_string(index) + " out of range for " + std::to_string(size_));
  struct Piece {
    std::uint64_t at;  // corpus offset
    std::uint64_t len;
  };
  struct Packed {
    std::uint64_t id = 0, seed = 0, epoch = 0, group = ~std::uint64_t{0};
    std::vector<std::vector<Piece>> bins;
  };
  thread_local Packed cache;
  const std::uint64_t S = options_.seq_len, G = options_.best_fit_group;
  const std::uint64_t group = index / G;
  if (cache.id != id_ || cache.seed != ctx.seed() || cache.epoch != ctx.epoch() || cache.group != group) {
    const std::uint64_t n = std::min<std::uint64_t>(G, size_ - group * G);  // the group's sequences
    const std::uint64_t lo = group * G * S, hi = lo + n * S;
    std::vector<Piece> pieces;
    for_each_document(lo, hi, ctx, [&](std::uint64_t off, std::uint64_t len, std::uint64_t pos) {
      const std::uint64_t a = std::max(lo, pos), b = std::min(hi, pos + len);
      for (std::uint64_t p = a; p < b; p += S) pieces.push_back({off + (p - pos), std::min(S, b - p)});
    });
    // Best fit decreasing: the longest first (then in stream order), each into the sequence whose
    // room it fills most closely (the first such).
    std::vector<std::size_t> order(pieces.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return pieces[x].len > pieces[y].len; });
    std::vector<std::uint64_t> room(n, S);
    std::vector<std::vector<Piece>> bins(n);
    std::vector<std::size_t> left;
    std::set<std::pair<std::uint64_t, std::size_t>> by_room;  // (room, sequence): the closest fit is a lower_bound
    for (std::size_t b = 0; b < n; ++b) by_room.emplace(S, b);
    for (std::size_t k : order) {
      const auto it = by_room.lower_bound({pieces[k].len, 0});
      if (it == by_room.end()) {
        left.push_back(k);
        continue;
      }
      const std::size_t best = it->second;
      by_room.erase(it);
      bins[best].push_back(pieces[k]);
      room[best] -= pieces[k].len;
      if (room[best] > 0) by_room.emplace(room[best], best);
    }
    // The pieces that fit nowhere fill the rooms left, in stream order, cut to fit (the rooms
    // hold exactly their tokens: the group's pieces are n * S tokens).
    std::sort(left.begin(), left.end());
    std::size_t b = 0;
    for (std::size_t k : left) {
      Piece p = pieces[k];
      while (p.len > 0) {
        while (b < n && room[b] == 0) ++b;
        if (b == n)
          throw Error(corpus_->name() + ": best-fit packing: group " + std::to_string(group) +
                      " has more tokens than its sequences hold (the index changed?)");
        const std::uint64_t take = std::min(p.len, room[b]);
        bins[b].push_back({p.at, take});
        room[b] -= take;
        p.at += take;
        p.len -= take;
      }
    }
    cache.bins = std::move(bins);
    cache.id = id_, cache.seed = ctx.seed(), cache.epoch = ctx.epoch(), cache.group = group;
  }
  const std::vector<Piece>& bin = cache.bins.at(index - group * G);
  const std::uint64_t tokens = corpus_->size();
  thread_local std::vector<std::int64_t> buf;
  std::size_t filled = 0;
  for (const Piece& p : bin) {
    if (filled + p.len > S) throw Error(corpus_->name() + ": best-fit packing: a sequence overflows (the index changed?)");
    const std::uint64_t n = std::min(p.len + 1, tokens - p.at);  // with the token after the piece, where there is one
    buf.resize(n);
    corpus_->read(p.at, buf);
    std::copy_n(buf.begin(), p.len, inputs.begin() + static_cast<std::ptrdiff_t>(filled));
    std::copy_n(buf.begin() + 1, n - 1, labels.begin() + static_cast<std::ptrdiff_t>(filled));
    if (n == p.len) labels[filled + p.len - 1] = buf[p.len - 1];  // the corpus's last token: no next one
    if (filled > 0) starts.push_back(filled);
    filled += p.len;
  }
  if (filled != S)
    throw Error(corpus_->name() + ": best-fit packing: sequence " + std::to_string(index) + " holds " + std::to_string(filled) +
                " tokens, not " + std::to_string(S));
}

void TokenSequences::get_into(std::size_t index, std::vector<Tensor>& batch, std::size_t row, SampleContext& ctx) const {
  const std::size_t seq = options_.seq_len;
  thread_local std::vector<std::int64_t> window;
  thread_local std::vector<std::size_t> starts;
  window.resize(seq + 1);
  starts.clear();
  thread_local std::vector<std::int64_t> labels;
  if (options_.best_fit_group > 0) {
    labels.resize(seq);
    read_best_fit(index, ctx, std::span(window).first(seq), labels, starts);
  } else {
    read_window(index, ctx, window, options_.packed ? &starts : nullptr);
  }
  const auto r = static_cast<std::int64_t>(row);
  auto field = [&](std::size_t k, const std::int64_t* src, std::size_t n) {
    void* dst = batch[k].select(r).raw();
    switch (batch[k].dtype()) {
      case DType::Int64: std::memcpy(dst, src, n * sizeof(std::int64_t)); break;
      case DType::Int32: store<std::int32_t>(src, n, dst); break;
      case DType::Int16: store<std::int16_t>(src, n, dst); break;  // uint16 ids keep their bits
      case DType::Int8: store<std::int8_t>(src, n, dst); break;
      default: store<std::uint8_t>(src, n, dst); break;
    }
  };
  std::size_t next_field = 2;
  if (options_.raw) {
    field(0, window.data(), seq + 1);
    next_field = 1;
  } else {
    field(0, window.data(), seq);
    field(1, options_.best_fit_group > 0 ? labels.data() : window.data() + 1, seq);
  }
  if (!options_.packed) return;
  thread_local std::vector<std::int64_t> positions;
  positions.resize(seq);
  auto* c = static_cast<std::int32_t*>(batch[next_field + 1].select(r).raw());
  std::size_t docs = 0, next = 0, first = 0;
  c[docs++] = 0;
  for (std::size_t k = 0; k < seq; ++k) {
    if (next < starts.size() && starts[next] == k) {
      first = k;
      ++next;
      c[docs++] = static_cast<std::int32_t>(k);
    }
    positions[k] = static_cast<std::int64_t>(k - first);
  }
  while (docs <= seq) c[docs++] = static_cast<std::int32_t>(seq);
  field(next_field, positions.data(), seq);
}

}  // namespace ferry
