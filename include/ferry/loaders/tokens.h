// ferry/loaders/tokens.h — language-model data: token files, Megatron-LM indexed datasets,
// fixed-length sequences (windows, or packed documents with their boundaries) and weighted
// mixtures of sources, every sample a pure function of (seed, epoch, index) found in O(1) or
// O(log documents): no pass over the corpus before the first batch, and a loader state of a few
// numbers (ferry/core/state.h) that resumes at any worker count or world size.
//
//   auto corpus = ferry::open_token_file("train.bin", {.type = ferry::TokenType::UInt16});  // nanoGPT
//   ferry::TokenSequences seqs(corpus, {.seq_len = 1024});
//   ferry::DataLoader loader(seqs, {.batch_size = 64, .shuffle = true, .num_workers = 4});
//   for (auto& batch : loader) { batch[0];  /* input_ids [64, 1024] int64 */  batch[1]; /* labels */ }
//
//   auto web = ferry::open_megatron("s3://corpus/web_text_document");        // prefix.bin + prefix.idx
//   auto code = ferry::open_megatron("/data/code_text_document");
//   ferry::Mixture mix({ferry::TokenSequences(web, {.seq_len = 2048, .packed = true}),
//                       ferry::TokenSequences(code, {.seq_len = 2048, .packed = true})},
//                      {0.7, 0.3}, {.seed = 1234});
//
// Token sources (TokenCorpus: one stream of token ids, cut into documents):
// * open_token_file: a flat file of token ids: raw (nanoGPT's .bin: no header, the type given),
//   llm.c's .bin (a 1024-byte header of 256 int32: magic 20240520, version 1 for uint16 or 2 for
//   uint32 tokens, the token count), or a 1-D .npy (its dtype from the header). Documents are the
//   runs ended by an end-of-document token id when one is given (TokenFileOptions::eod).
// * open_megatron: a Megatron-LM indexed dataset (prefix.idx: "MMIDIDX\0\0", version 1, a dtype
//   code, the sequence and document counts, then int32 sequence lengths, int64 byte pointers into
//   prefix.bin, int64 document indices), read from that published layout; each of its sequences is
//   a document. Only the index's header is checked at open (O(1)); the lengths and pointers a
//   sample touches are checked when it reads them, so opening a corpus of any size is immediate.
// Local files are memory-mapped; an "s3://bucket/key" object is read by ranged GETs, one a sample,
// a batch's sent together (ferry/loaders/storage.h: credentials, retries, the disk cache). Bad input (a truncated file, a
// wrong magic, version or dtype, counts that overflow or pointers that run past the .bin, a token
// id at or past TokenFileOptions::vocab_size) is a DataError naming the file and the byte offset.
//
// Sequences (TokenSequences: a map-style dataset; the loader's sampler shuffles them):
// * windows: the corpus cut into size() = (tokens - 1) / seq_len windows, window w covering tokens
//   [w * seq_len, w * seq_len + seq_len + 1): input_ids are its first seq_len tokens, labels its
//   last seq_len (shifted by one), so every token is an input of exactly one window an epoch.
// * random_offset: nanoGPT's get_batch, each sample a window at an offset drawn from the sample's
//   generator (seed, epoch, index): the same for any worker count and on resume.
// * shuffle_documents (an indexed corpus): the stream cut into windows is the documents in an order
//   shuffled each epoch (within blocks of document_block documents), not the corpus order.
// * packed: the windows carry their documents' boundaries: position_ids that restart at 0 at the
//   window's first token and at each document's first token (as Megatron-LM's reset_position_ids),
//   and cu_seqlens, the offsets in the sequence where its documents start,
//   then seq_len (FlashAttention's varlen layout for one sequence), padded to seq_len + 1 entries
//   by repeating seq_len (empty sequences, which varlen kernels skip). Documents stay in corpus
//   order inside a window; the sampler shuffles the windows.
// * best-fit packing (packed, best_fit_group = G > 0, an indexed corpus): documents placed whole
//   where they fit (Note [Best-fit packing], below).
// labels are the next token everywhere, across a document's end too (as Megatron-LM's without
// eod_mask_loss); a loss that should not cross documents masks labels[k] where
// position_ids[k + 1] == 0.
// Samples are std::vector<Tensor>: input_ids, labels [seq_len] (int64, or int32 with
// TokenSequenceOptions::dtype), and when packed position_ids [seq_len] (same dtype) and
// cu_seqlens [seq_len + 1] (int32); field_names() names them.
//
// Note [Best-fit packing]
// Group g of G sequences takes the stream's tokens [g * G * seq_len, (g + 1) * G * seq_len), cut
// at its documents' boundaries and into pieces of at most seq_len; the pieces are placed whole by
// best fit decreasing (the longest first, each into the sequence whose room it fills most
// closely), and the few that fit nowhere fill the rooms left, cut to fit. Every sequence is full
// (no padding), every token is an input once an epoch, and a document of at most seq_len tokens
// is cut only where the group's range cuts it or where it is left over; windows cut about one
// document a sequence. A sample is its group's packing (the documents' lengths from the index, no
// tokens read), found in O(pieces log G) from (seed, epoch, index); the last group a thread packed
// is kept, so sequences read in order pack each group once. A piece's last label is the token
// after it in the corpus (the document's next token, or the next document's first where the piece
// ends its document, as windows' labels), and position_ids and cu_seqlens restart at every piece.
//
// Note [Token windows on the GPU]
// With DataLoaderOptions::device and gather = Device, windows of a token file or a Megatron .bin
// in this process's memory (a local file's mapping; TokenCorpus::in_memory) are made by the GPU:
// the loader copies the file's tokens once into page-locked memory the GPU can read
// (RowRegistration; a mapping is not registered in place: Note [Device gather] in
// ferry/pinning/gather.h), the pin thread writes each batch's window starts (window_start's rule,
// no worker starts), and one kernel a launch reads each window's tokens from that copy and
// writes input_ids and labels (the same tokens one later) widened to TokenSequenceOptions::dtype
// (uint ids zero-extended) straight into the batch's device buffer (HostRows::window). Only the
// file's tokens cross the link (2 bytes a token of a uint16 file, read twice), and no CPU touches
// them. The batches equal the host path's. Packed and shuffled-document windows, objects in
// storage and a vocab_size check take the host path (gather = Auto) or are an Error naming the
// reason (gather = Device). gather = Auto leaves a mapped file to the host path, as for a .npy.
//
// Mixture (weighted sources, each any map-style dataset of std::vector<Tensor> samples): which
// source global sample g = epoch * size() + index comes from is a pure function of (seed, g): in
// each block of `block` samples a source has its weight's share by largest remainder (so the
// realized proportions are within one sample a block of the weights), the slots shuffled within
// the block. A source's k-th sample is its own shuffle of its epoch k / source.size(): a source
// that runs out starts its next epoch on its own. reweighted(w, from) keeps every sample before
// global index `from` and applies new weights from there (a run that resumes with new weights).
// Use the loader with shuffle = false over a mixture: its order is already random.
//
// Thread safety: everything here is immutable after construction and safe to read from many
// threads (the loader's workers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ferry/core/allocator.h"
#include "ferry/core/dataset.h"
#include "ferry/core/sampler.h"
#include "ferry/core/rows.h"
#include "ferry/core/tensor.h"

namespace ferry {

/// How token ids are stored in a file.
enum class TokenType : std::uint8_t { UInt8, Int8, Int16, UInt16, Int32, UInt32, Int64 };
/// Bytes per token.
std::size_t token_size(TokenType type) noexcept;
/// "uint16", ...
const char* token_type_name(TokenType type) noexcept;
/// The type named `name` ("uint16", "uint32", "int32", ...); ferry::Error otherwise.
TokenType parse_token_type(const std::string& name);

/// A stream of token ids cut into documents (open_token_file, open_megatron).
class TokenCorpus {
 public:
  virtual ~TokenCorpus() = default;
  /// Tokens in the stream.
  virtual std::uint64_t size() const noexcept = 0;
  virtual TokenType type() const noexcept = 0;
  /// The file (or the Megatron prefix), for errors and reports.
  virtual const std::string& name() const noexcept = 0;
  /// Tokens [begin, begin + out.size()) widened into `out`. DataError naming the file and offset
  /// for a token at or past the vocabulary size, a range past the end, or a failed read.
  virtual void read(std::uint64_t begin, std::span<std::int64_t> out) const = 0;
  /// Appends to `out` the positions p in (begin, begin + tokens.size()) where a document starts
  /// (tokens are the stream's from `begin`, as read()). Nothing when the corpus has no documents.
  virtual void document_starts(std::uint64_t begin, std::span<const std::int64_t> tokens,
                               std::vector<std::uint64_t>& out) const = 0;
  /// True when the corpus knows its documents (an end-of-document id, or a Megatron index).
  virtual bool has_documents() const noexcept = 0;
  /// Sends the reads of these token ranges ([begin, begin + count) each) ahead, all at once, for
  /// read() calls on this thread to take (an object in S3-compatible storage; nothing locally).
  virtual void prefetch(std::span<const std::pair<std::uint64_t, std::uint64_t>> ranges) const { (void)ranges; }
  /// Documents in the corpus when known without reading it (a Megatron index), else 0.
  virtual std::uint64_t documents() const noexcept { return 0; }
  /// The stream position where document `d` starts (d == documents(): size()), for a corpus whose
  /// documents() is not 0; DataError for a damaged index entry.
  virtual std::uint64_t document_offset(std::uint64_t d) const;
  /// The stream as one array of type() in this process's memory, stream position p at element p
  /// (a local file's mapping: `mapped_file`), for the device gather (Note [Token windows on the
  /// GPU]); `data` null with `why` set where it is not (an object in storage) or where reading
  /// must check each id (a vocab_size).
  struct Array {
    const void* data = nullptr;
    bool mapped_file = false;
  };
  virtual Array in_memory(std::string& why) const;
};

/// Options of open_token_file.
struct TokenFileOptions {
  enum class Format : std::uint8_t { Auto, Raw, LlmC, Npy };
  /// Auto: a .npy by its magic string, an llm.c file by its magic number, else raw.
  Format format = Format::Auto;
  /// The token type of a raw file (required there); for a headed file, when given, it must match
  /// the header's (a DataError otherwise).
  std::optional<TokenType> type;
  /// The end-of-document token id: a document ends after each such token.
  std::optional<std::int64_t> eod;
  /// Token ids must be below this (checked as samples read them); unset: not checked.
  std::optional<std::int64_t> vocab_size;
};

/// Opens a flat token file (local or s3://). DataError for a missing, empty or malformed file.
std::shared_ptr<const TokenCorpus> open_token_file(const std::string& path, const TokenFileOptions& options = {});

/// Options of open_megatron.
struct MegatronOptions {
  std::optional<std::int64_t> vocab_size;  ///< as TokenFileOptions::vocab_size
};

/// Opens a Megatron-LM indexed dataset: `prefix`.idx and `prefix`.bin (local or s3://).
std::shared_ptr<const TokenCorpus> open_megatron(const std::string& prefix, const MegatronOptions& options = {});

/// The same over bytes in memory (tests, fuzzing); both spans must outlive the corpus.
std::shared_ptr<const TokenCorpus> megatron_from_memory(std::span<const std::byte> idx, std::span<const std::byte> bin,
                                                        const std::string& name, const MegatronOptions& options = {});

/// The token type and count in an llm.c header (its first 1024 bytes); DataError otherwise.
struct LlmcHeader {
  TokenType type;
  std::uint64_t tokens;
};
LlmcHeader parse_llmc_header(std::span<const std::byte> header, const std::string& name);

/// Options of TokenSequences.
struct TokenSequenceOptions {
  /// Tokens a sample's input_ids hold, in [1, kMaxSeqLen].
  std::size_t seq_len = 1024;
  static constexpr std::size_t kMaxSeqLen = std::size_t{1} << 30;
  /// nanoGPT's random windows instead of the corpus cut in order (size() stays the same unless
  /// num_samples says otherwise).
  bool random_offset = false;
  /// Windows with their documents' position_ids and cu_seqlens (the corpus must know its
  /// documents: an eod id, or a Megatron index).
  bool packed = false;
  /// With an indexed corpus (a Megatron index): the stream is the documents in a shuffled order,
  /// each epoch another, instead of the corpus order. The documents are shuffled within blocks of
  /// `document_block` (consecutive in the index; the loader's sampler shuffles the windows across
  /// the whole corpus), so a window's place costs a binary search and one block's walk, and no
  /// pass over the corpus is made.
  bool shuffle_documents = false;
  std::size_t document_block = 256;
  /// Int64 (torch's token dtype) or Int32.
  DType dtype = DType::Int64;
  /// random_offset only: samples an epoch (default: as many as windows).
  std::optional<std::size_t> num_samples;
  /// The window's seq_len + 1 tokens as the file stores them, in one field "tokens" (raw_dtype():
  /// uint16 and uint32 ids keep their bits in an int16 / int32 tensor), for a consumer that widens
  /// them where they are used (the Python loader does on the GPU, with device=): 2 bytes a token of
  /// a uint16 file cross the link instead of 16 for int64 input_ids and labels. Packed: position_ids
  /// as int32, and cu_seqlens, beside it.
  bool raw = false;
  /// packed, an indexed corpus (a Megatron index): best-fit packing in groups of this many
  /// sequences (0: off; Note [Best-fit packing]). Documents are placed whole where they fit,
  /// instead of cut wherever a window ends; no token is dropped and no sequence padded.
  std::size_t best_fit_group = 0;
};

/// Fixed-length sequences over a TokenCorpus (see the top of this file).
class TokenSequences : public DatasetBase<TokenSequences> {
 public:
  TokenSequences(std::shared_ptr<const TokenCorpus> corpus, TokenSequenceOptions options = {});
  std::size_t size() const noexcept { return size_; }
  std::vector<Tensor> get(std::size_t index, SampleContext& ctx) const;
  /// Over s3://: the batch's windows are requested together before they are read (ordered windows
  /// of a corpus in its own order; random and shuffled-document windows read one at a time).
  void prefetch(std::span<const std::size_t> indices) const;
  /// Direct mode (the loader writes each sample into its batch's rows: no collate copy).
  std::vector<Tensor> make_batch(std::size_t rows, BatchAllocator& allocator) const;
  void get_into(std::size_t index, std::vector<Tensor>& batch, std::size_t row, SampleContext& ctx) const;
  /// For the device gather (Note [Token windows on the GPU]): input_ids and labels (raw: tokens)
  /// as windows of the corpus's array; none, with `why` set, for packed or shuffled-document
  /// windows and for a corpus not in memory as one array (TokenCorpus::in_memory).
  std::vector<HostRows> host_rows(std::string& why) const;
  /// The first stream position of sample `index`'s window (its input_ids; labels start one after).
  std::uint64_t window_start(std::size_t index, SampleContext& ctx) const;
  /// "input_ids", "labels" (raw: "tokens"), and when packed "position_ids", "cu_seqlens".
  std::vector<std::string> field_names() const;
  /// The dtype of a raw window's field: the file's token type, unsigned ids in the signed type of
  /// their width (their bits unchanged).
  DType raw_dtype() const noexcept;
  const TokenCorpus& corpus() const noexcept { return *corpus_; }
  /// The corpus, shared: more sequences over it (other options) open nothing again.
  const std::shared_ptr<const TokenCorpus>& shared_corpus() const noexcept { return corpus_; }
  const TokenSequenceOptions& options() const noexcept { return options_; }

 private:
  /// Sample `index`'s seq_len + 1 tokens into `window` (seq_len + 1 of them), and with `starts`
  /// the offsets k in (0, seq_len) where a document starts inside its input_ids.
  void read_window(std::size_t index, SampleContext& ctx, std::span<std::int64_t> window, std::vector<std::size_t>* starts) const;
  /// Best-fit packing: sample `index`'s input_ids and labels (seq_len each), and the offsets in
  /// (0, seq_len) where a piece starts.
  void read_best_fit(std::size_t index, SampleContext& ctx, std::span<std::int64_t> inputs, std::span<std::int64_t> labels,
                     std::vector<std::size_t>& starts) const;
  /// The window-start rule, once for every caller (window_start, the device gather's RowWindow,
  /// prefetch): an ordered window `index` starts index * seq_len; a random one at a draw of the
  /// sample's generator, Generator(seed, epoch, index), which `rng()` gives (called only then).
  template <class Rng>
  static std::uint64_t start_of(const TokenSequenceOptions& o, std::uint64_t tokens, std::size_t index, Rng&& rng) {
    if (o.random_offset) return rng().randint(tokens - o.seq_len);
    return static_cast<std::uint64_t>(index) * o.seq_len;
  }
  /// Calls fn(corpus offset, length, stream position) for each document of the stream (corpus
  /// order, or shuffled) that overlaps stream positions [lo, hi), in stream order.
  template <class Fn>
  void for_each_document(std::uint64_t lo, std::uint64_t hi, SampleContext& ctx, Fn&& fn) const;

  std::shared_ptr<const TokenCorpus> corpus_;
  TokenSequenceOptions options_;
  std::size_t size_ = 0;
  std::uint64_t id_ = 0;  // keys a thread's cached best-fit group (copies share it: they pack alike)
};

/// Options of Mixture.
struct MixtureOptions {
  /// Keys the slots of each block and each source's shuffle.
  std::uint64_t seed = 0;
  /// Samples a block: the weights are met within one sample per block.
  std::size_t block = 1000;
  /// Samples an epoch; default: the sum of the sources' sizes.
  std::optional<std::size_t> size;
};

/// Weighted sources as one dataset (see the top of this file).
class Mixture : public DatasetBase<Mixture> {
 public:
  /// `weights`: one per source, finite, >= 0, a positive sum (ferry::Error names a bad one);
  /// every source must have at least one sample.
  Mixture(std::vector<AnyDataset<std::vector<Tensor>>> sources, std::vector<double> weights, MixtureOptions options = {});
  /// A mixture that gives the same samples as this one before global index `from` and draws with
  /// `weights` from there (global index: epoch * size() + index in the epoch). `from` must not be
  /// before the start of this mixture's last weights.
  Mixture reweighted(std::vector<double> weights, std::uint64_t from) const;

  std::size_t size() const noexcept { return size_; }
  std::vector<Tensor> get(std::size_t index, SampleContext& ctx) const;

  /// Where global sample `global` comes from.
  struct Pick {
    std::size_t source = 0;  ///< which source
    std::uint64_t draw = 0;  ///< the source's draws before this one (its k-th sample)
    std::size_t sample = 0;  ///< the source's sample index
  };
  Pick pick(std::uint64_t global) const;
  /// Samples each source gives in [0, global) (for reports and tests).
  std::vector<std::uint64_t> counts_before(std::uint64_t global) const;
  std::size_t sources() const noexcept { return sources_.size(); }

 private:
  struct Phase;
  /// A phase with these weights (checked) from global index `start`: its block counts and slots.
  Phase make_phase(const std::vector<double>& weights, std::uint64_t start) const;
  /// The phase global index `global` is drawn in.
  std::size_t phase_of(std::uint64_t global) const noexcept;
  std::vector<AnyDataset<std::vector<Tensor>>> sources_;
  std::vector<std::size_t> source_sizes_;
  std::shared_ptr<const std::vector<Phase>> phases_;
  MixtureOptions options_;
  std::size_t size_ = 0;
};

// IndexPermutation (the mixture's draws) is ferry/core/sampler.h's.

}  // namespace ferry
