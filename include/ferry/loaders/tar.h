// ferry/loaders/tar.h — tar archives and WebDataset-style shards as a stream.
//
// A shard is a tar file whose members are grouped by key: "n01440764/0001.jpg" and
// "n01440764/0001.cls" form one record with key "n01440764/0001" and fields "jpg" and "cls" (the
// key is the member path up to the first dot of its file name; the field is the rest). Members
// of one record must be adjacent, as WebDataset writes them.
//
//   ferry::TarShards shards({"train-000.tar", "train-001.tar", ...}, {.rank = rank, .world_size = world});
//   ferry::TarRecordDecodeOptions img{.transform = ferry::ImageTransform().random_resized_crop(224, 224).to_float()};
//   auto train = shards.map([img](ferry::TarRecord r, ferry::SampleContext& ctx) {
//     return ferry::decode_labeled_image(r, img, ctx.rng());
//   });
//   ferry::DataLoader loader(train, {.batch_size = 256, .num_workers = 8});
//
// Splitting: each epoch the shard list is (optionally) shuffled with (seed, epoch), and shard k of
// that order goes to rank k mod world_size. In a loader, a rank's shards are read once, front to
// back, by the stream's own reader threads (up to 4 shards at a time, each read ahead up to a
// batch), and their records are dealt to the workers in one order, shard after shard, record after
// record: record p goes to batch p / batch_size, and batch b is made by whichever worker is free
// (Note [One batcher across workers], ferry/detail/batch_feed.h). So every worker decodes whatever
// the number of shards, every batch
// is full but the epoch's last (with drop_last, at most batch_size - 1 records unseen an epoch),
// and the batches, and the generators a mapped transform draws from (ctx.rng() keyed by p), are
// the same for any number of workers, on resume too. A local shard read whole without an error
// leaves its records' offsets with the dataset (about 80 bytes a two-member record and its key); in later
// epochs the reader threads deal those records without reading them, and each worker reads its
// own records' members at their offsets, as the indexed TarImages does (Note [Learned offsets]
// in tar.cpp). A shard whose size, modification time or inode has changed is read as a stream
// again; one changed after an epoch's records were dealt (an epoch made ahead deals them as the
// last one ends) fails that epoch's records of it with a DataError saying so.
//
// Opened outside a loader (WorkerInfo without a share), a stream is one worker's: shard k goes to
// reader slot k mod (world_size * num_workers), where rank r's worker w is slot r * num_workers + w
// (assignment()), and that worker batches its own records.
//
// Archives: POSIX ustar, GNU long names ('L') and pax headers ('x': path and size); directories,
// links and other entries are skipped. A bad header checksum, a truncated member or a header
// that does not parse is a ferry::DataError naming the shard and the byte offset; the stream then
// moves on to its next shard, so the loader stays usable.
//
// Shards may live in S3-compatible storage: "s3://bucket/train-{000..127}.tar" (expand_braces)
// reads each shard front to back in 8 MiB ranged GETs, the next two on their way while one is
// parsed and while the worker waits for its next batch, and the next shard's first two in one GET
// (settings: ferry/loaders/storage.h, read from AWS's environment variables and ~/.aws files).
// Decoded on the GPU, a stream's records are EncodedImages (encode_labeled_image).
//
// Thread safety: TarShards is immutable but for the next epoch's opening reads it keeps for its
// streams (behind a mutex); each stream belongs to one worker. In a loader with
// prefetch_next_epoch, local shards: the next epoch's reading starts once this epoch's last shard
// has been read (its first records are in hand when it opens; it ends with the loader); s3://
// shards: the reader of the epoch's last shard sends the next epoch's first shard's opening read
// (as a worker's stream does), and the next epoch's reader of that shard takes it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "ferry/core/allocator.h"
#include "ferry/core/dataset.h"
#include "ferry/core/random.h"
#include "ferry/loaders/image.h"
#include "ferry/loaders/sample.h"
#include "ferry/loaders/transforms.h"

namespace ferry {

namespace loaders {
class OpenAhead;  // the next shard's opening read, sent ahead (loaders/io.h)
}

/// One regular file of a tar archive.
struct TarMember {
  std::string path;
  std::vector<std::byte> data;
  std::uint64_t offset = 0;       ///< byte offset of the member's header in the archive
  std::uint64_t data_offset = 0;  ///< byte offset of its data
  std::uint64_t size = 0;         ///< bytes of data (also when next(false) left `data` empty)
};

/// Reads the members of a tar archive one at a time (from a file, buffered, or from memory).
class TarReader {
 public:
  /// Opens a tar file; DataError when it cannot be opened.
  explicit TarReader(const std::string& path);
  /// Reads an archive held in memory (which must outlive the reader).
  TarReader(std::span<const std::byte> bytes, std::string name);
  ~TarReader();
  TarReader(TarReader&&) noexcept;
  TarReader& operator=(TarReader&&) noexcept;
  /// The next regular file, or nullopt at the end of the archive. DataError on damage.
  std::optional<TarMember> next();
  /// The same; without read_data the member's data is skipped (seeked past) and left empty.
  std::optional<TarMember> next(bool read_data);
  /// An object's reads sent ahead (its next pieces, the next shard's open) moved along without
  /// waiting, as next() does before it reads: true while some are still on their way. False for
  /// a file or an archive in memory.
  bool progress();
  /// The path named by the last header read, or empty when next() failed before it could read
  /// one (a damaged header): after a DataError, which member was damaged, if known.
  const std::string& last_path() const noexcept;
  const std::string& name() const noexcept;

 private:
  friend class TarShards;
  friend class TarImages;
  // Opens `path` taking `ahead`'s read when it was sent for it; the blob moves `ahead` along
  // while it waits and sends one asked for later (`ahead` must outlive the reader).
  TarReader(const std::string& path, loaders::OpenAhead* ahead);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// A group of adjacent members sharing a key.
struct TarRecord {
  std::string key;    ///< "dir/0001"
  std::string shard;  ///< the archive it came from
  std::uint64_t offset = 0;
  std::map<std::string, std::vector<std::byte>> fields;  ///< "jpg" -> bytes
  /// The field's bytes; DataError naming the shard, record and present fields when missing.
  const std::vector<std::byte>& field(const std::string& name) const;
};

struct DistributedEnv;

struct TarShardsOptions {
  int rank = 0;        ///< this process's rank
  int world_size = 1;  ///< number of ranks
  /// rank and world_size from the launcher's environment (ferry/core/distributed.h).
  static TarShardsOptions for_rank(const DistributedEnv& env);
  /// Shuffle the shard order each epoch with (seed, epoch) (records within a shard keep their order).
  bool shuffle = true;
};

/// A stream of TarRecords over a list of shards, split across workers and ranks.
class TarShards : public DatasetBase<TarShards> {
 public:
  static constexpr bool kFillsAcrossWorkers = true;  ///< in a loader (above)
  /// Error when the list is empty or the rank does not fit the world size. Files are opened lazily,
  /// by the worker that reads them.
  explicit TarShards(std::vector<std::string> shards, TarShardsOptions options = {});

  struct Held;  // opening reads sent for the next epoch, by worker (tar.cpp)
  class Stream {
   public:
    std::optional<TarRecord> next();
    /// Skips n records reading only their headers (a resumed epoch); returns how many it skipped.
    /// In a loader, the epoch's first n records (whole batches).
    std::size_t skip(std::size_t n);
    /// In a loader: the batch of the epoch the next records are for (the loader tells each
    /// worker's stream as the worker starts a batch; Note [One batcher across workers]).
    void begin_batch(std::uint64_t batch) { batch_ = batch; }
    /// TarReader::progress() of the shard being read, and the next epoch's opening reads sent as
    /// streams ended (the loader calls it while the worker waits).
    bool progress();
    /// In a loader: the epoch-wide position of the record next() last returned (a mapped
    /// transform's ctx.index()); nullopt for a worker's own stream.
    std::optional<std::uint64_t> position() const;

   private:
    friend class TarShards;
    friend class TarDecodeStream;
    // The next record in a buffer of this stream's, valid until the next call (TarDecodeStream).
    const TarRecord* next_reused();
    void read_learned(const void* dealt, TarRecord& rec);
    std::optional<TarRecord> advance(bool read_data);
    std::shared_ptr<detail::BatchFeed> feed_;  // in a loader: the epoch's reader, shared by the workers
    std::uint64_t batch_ = 0;                  // in a loader: the batch being made
    std::uint64_t position_ = 0;
    std::vector<std::string> shards_;  // this reader's shards, in order
    std::size_t current_ = 0;
    // The next shard's opening read: the stream's own, or its lane's (a loader's reader of one
    // shard a stream: the read of the lane's next shard is sent while this one is read). Declared
    // before reader_, whose blob points to it.
    std::shared_ptr<loaders::OpenAhead> ahead_;
    std::optional<TarReader> reader_;
    std::optional<TarMember> pending_;  // first member of the next record
    std::exception_ptr deferred_;       // a damaged member met after a complete record: thrown next
    std::shared_ptr<Held> held_;        // the dataset's (null without next_epoch_ahead)
    int worker_ = 0;
    bool started_ = false;
    std::string next_first_;  // the worker's first shard of the next epoch (sent for as the last is read)
    struct Direct;            // a lane's record offsets being learned, or a worker's reads at learned offsets (tar.cpp)
    std::shared_ptr<Direct> direct_;
  };
  /// In a loader (WorkerInfo::share and batch_size set), the worker's records of the rank's one
  /// reading of the epoch (above). Otherwise the stream of `worker`'s shards for this rank and the
  /// worker's epoch. Over s3://, with
  /// WorkerInfo::next_epoch_ahead, the opening read of the worker's first shard of the next epoch
  /// (its first 16 MiB) is sent once the stream's last shard has asked for all its pieces, and kept
  /// by the dataset for the next epoch's stream of that worker, on whichever thread (one read a
  /// worker; it is dropped unused when the next epoch opens another shard first). The dataset and
  /// its copies share what they keep: after the last epoch, up to one 16 MiB read and its
  /// connection a worker, until the last copy of the dataset is destroyed.
  Stream open(const WorkerInfo& worker) const;
  /// The shard indices read by (rank, worker) in `epoch` by a worker's own stream.
  std::vector<std::size_t> assignment(int worker, int num_workers, std::uint64_t seed, std::uint64_t epoch) const;
  /// The shard indices this rank reads in `epoch` in a loader, in the order their records are dealt.
  std::vector<std::size_t> rank_shards(std::uint64_t seed, std::uint64_t epoch) const;
  const std::vector<std::string>& shards() const noexcept { return shards_; }
  /// How many local shards have their record offsets learned (above): a loader's later epochs
  /// read their records at those offsets. Shared by the dataset and its copies.
  std::size_t learned_shards() const;

 private:
  std::vector<std::string> shards_;
  TarShardsOptions options_;
  std::shared_ptr<Held> held_;
  std::vector<std::size_t> epoch_order(std::uint64_t seed, std::uint64_t epoch) const;
};

/// A shard pattern expanded as WebDataset writes them: "train-{000..127}.tar" gives 128 names
/// (numeric ranges keep the endpoints' zero padding; descending ranges count down), "{a,b}" one
/// name per alternative; several groups multiply. A pattern without braces is itself. ferry::Error
/// naming the pattern for an unclosed brace, an empty group, a range that is not numeric, or more
/// than 10^6 names. Works for paths and s3:// URLs alike.
std::vector<std::string> expand_braces(const std::string& pattern);

/// How decode_labeled_image reads one record of a tar stream (TarImagesOptions is the indexed
/// dataset's).
struct TarRecordDecodeOptions {
  std::vector<std::string> image_fields{"jpg", "jpeg", "png"};  ///< the first present is decoded
  std::string label_field = "cls";                              ///< decimal class index
  int channels = 3;
  ImageTransform transform;
  bool dct_scaling = false;  ///< DecodeOptions::dct_scaling
};

/// The name TarRecordDecodeOptions had before 0.2.0 (CHANGELOG.md); kept for one minor version at
/// least. Not TarImagesOptions, which is the indexed dataset's options.
using TarImageOptions [[deprecated("renamed ferry::TarRecordDecodeOptions in 0.2.0 (TarImagesOptions is another type)")]] =
    TarRecordDecodeOptions;

/// Decodes a record's image (and transform) and its integer label. DataError names the shard and
/// the record when a field is missing or malformed.
LabeledSample decode_labeled_image(const TarRecord& record, const TarRecordDecodeOptions& options, Generator& rng);
/// GPU decode from a stream: the record's JPEG left compressed, with its label and its transform's
/// plan drawn from `rng` as decode_labeled_image would draw it (plan_jpeg). The loader's device
/// stage decodes a batch of them with nvJPEG (needs `device`; the transform must run as one pass
/// to a fixed size, as ImageFolderOptions::decode = Gpu requires):
///
///   auto train = shards.map([img](ferry::TarRecord r, ferry::SampleContext& ctx) {
///     return ferry::encode_labeled_image(std::move(r), img, ctx.rng());
///   });
///   ferry::DataLoader loader(train, {.batch_size = 256, .num_workers = 4, .device = 0});
///
/// The record is taken (its image's bytes move into the sample). Errors as decode_labeled_image's:
/// a DataError naming the shard and the record for a missing field, a label that does not parse,
/// a file that is not a JPEG or whose header does not read; ferry::Error for channels other than 3
/// or a transform that is not one pass.
EncodedImage encode_labeled_image(TarRecord record, const TarRecordDecodeOptions& options, Generator& rng);

/// A tar stream's records decoded as labeled images straight into the batch's rows (direct mode:
/// no tensor a sample and no collate copy), as
///
///   shards.map([o](ferry::TarRecord r, ferry::SampleContext& ctx) { return ferry::decode_labeled_image(r, o, ctx.rng()); })
///
/// gives them, image for image and label for label (the same records, positions and generators);
/// LabeledBatch batches. The transform must end in a fixed size (make_batch's Error says so
/// otherwise). Everything else is the TarShards stream's: shards split across ranks, records
/// dealt to the workers in one order, resume at any worker count, learned offsets.
class TarDecodeStream : public DatasetBase<TarDecodeStream> {
 public:
  static constexpr bool kFillsAcrossWorkers = true;
  TarDecodeStream(TarShards shards, TarRecordDecodeOptions options);
  class Stream {
   public:
    /// The next record decoded as a sample of its own (outside direct mode).
    std::optional<LabeledSample> next();
    /// The next record decoded into row `row` of a batch made by make_batch; false at the end.
    /// DataError (naming the shard and record) for a record that does not decode.
    bool next_into(LabeledBatch& batch, std::size_t row);
    /// Skips n records without decoding them (a resumed epoch); later records keep their generators.
    std::size_t skip(std::size_t n) {
      const std::size_t k = inner_.skip(n);
      local_ += k;
      return k;
    }
    bool progress() { return inner_.progress(); }
    std::optional<std::uint64_t> position() const { return inner_.position(); }
    void begin_batch(std::uint64_t batch) { inner_.begin_batch(batch); }

   private:
    friend class TarDecodeStream;
    Stream(const TarDecodeStream& owner, const WorkerInfo& worker)
        : owner_(&owner), worker_(worker), inner_(owner.shards_.open(worker)) {}
    SampleContext context();
    const TarDecodeStream* owner_;
    WorkerInfo worker_;
    TarShards::Stream inner_;
    std::size_t local_ = 0;  // samples read, for a worker's own stream's generators
  };
  Stream open(const WorkerInfo& worker) const { return Stream(*this, worker); }
  /// A batch of n rows; ferry::Error unless the transform fixes the output size.
  LabeledBatch make_batch(std::size_t n, BatchAllocator& allocator) const;
  const TarShards& shards() const noexcept { return shards_; }
  const TarRecordDecodeOptions& options() const noexcept { return options_; }

 private:
  TarShards shards_;
  TarRecordDecodeOptions options_;
};

struct TarImagesOptions {
  std::vector<std::string> image_fields{"jpg", "jpeg", "png"};  ///< the first present is decoded
  std::string label_field = "cls";                              ///< decimal class index
  int channels = 3;
  ImageTransform transform;
  std::int64_t max_pixels = std::int64_t{1} << 28;
  bool dct_scaling = false;  ///< DecodeOptions::dct_scaling
  /// As ImageFolderOptions::decode: Gpu leaves each record's JPEG compressed for the device stage.
  ImageFolderOptions::Decode decode = ImageFolderOptions::Decode::Cpu;
};

/// Tar shards as a map-style dataset of labeled images: the records of every shard, indexed once.
///
///   ferry::TarImages train(ferry::tar_shard_paths(...), {.transform = ..., .decode = ferry::ImageFolderOptions::Decode::Gpu});
///   ferry::DataLoader loader(train, {.batch_size = 256, .shuffle = true, .num_workers = 2, .device = 0});
///
/// The constructor reads every member's header (not its data) and every record's label, and records
/// where each record's image is; a sample is then one read at a known offset. So the loader shuffles
/// records across all shards, resumes mid-epoch at once, splits them over ranks with a
/// DistributedSampler, and runs in direct mode, none of which a stream (TarShards) can; both decode
/// on the GPU (decode = Gpu here, encode_labeled_image for a stream). The price is random reads: on
/// storage that wants shards read front to back (object stores, network file systems), stream them
/// with TarShards instead.
///
/// Records are indexed as TarShards groups them (adjacent members sharing a key; members without
/// a field are ignored). A damaged archive (a bad header, a truncated member) is a DataError at
/// construction naming the shard and the offset: the records after it cannot be found. A record
/// without an image or a label field, or with a label that is not a non-negative integer, is a
/// DataError for that sample, at its batch's position. Indices follow the shard list's order,
/// then the order within each shard.
class TarImages : public DatasetBase<TarImages> {
 public:
  explicit TarImages(std::vector<std::string> shards, TarImagesOptions options = {});

  std::size_t size() const noexcept { return index_->records.size(); }
  LabeledSample get(std::size_t i, SampleContext& ctx) const;
  /// Direct mode; ferry::Error unless the transform fixes the output size.
  LabeledBatch make_batch(std::size_t rows, BatchAllocator& allocator) const;
  void get_into(std::size_t i, LabeledBatch& batch, std::size_t row, SampleContext& ctx) const;
  /// Whether batches hold compressed JPEGs that the device stage decodes (decode = Gpu).
  bool decodes_on_device() const noexcept { return options_.decode == ImageFolderOptions::Decode::Gpu; }
  /// For shards in s3://, requests a batch's images together (one ranged GET each, at once) on the
  /// calling worker's connections (the loader calls it before the batch's samples); nothing for
  /// local shards.
  void prefetch(std::span<const std::size_t> indices) const;

  /// Record i's shard and key ("dir/0001").
  const std::string& shard(std::size_t i) const { return index_->shards.at(index_->records.at(i).shard); }
  const std::string& key(std::size_t i) const { return index_->records.at(i).key; }
  const std::vector<std::string>& shards() const noexcept { return index_->shards; }

 private:
  struct Record {
    static constexpr std::int64_t kNoLabel = -1, kBadLabel = -2;
    std::string key;
    std::uint32_t shard = 0;
    std::int32_t image_field = -1;  // index into options_.image_fields; -1: none
    std::uint64_t offset = 0;       // the record's first header
    std::uint64_t image_offset = 0, image_size = 0;
    std::int64_t label = kNoLabel;  // the class index, read at indexing; kBadLabel: see label_errors
  };
  struct Index {
    std::vector<std::string> shards;
    std::vector<Record> records;
    std::unordered_map<std::size_t, std::string> label_errors;  // record -> why its label is not a class index
  };
  std::shared_ptr<const Index> index_;  // shared by copies (a loader takes one): built once, never copied
  TarImagesOptions options_;
  std::size_t slot_ = 0;  // decode = Gpu: bytes per image in a batch's encoded block
  struct Rows;
  Rows rows() const;
  struct Read;
  Read read(std::size_t i) const;
};

}  // namespace ferry
