// ferry/loaders/registry.h — datasets by name, configured by "key=value" strings, and plugins
// loaded at run time.
//
//   auto& reg = ferry::DatasetRegistry::global();
//   reg.load_plugin("build/examples/plugin/libferry_ramp_plugin.so");    // registers "ramp"
//   ferry::DynamicDataset ds = reg.create("ramp", "n=1000,dim=16");
//   ferry::DataLoader loader(ds, {.batch_size = 64});                    // batches: std::vector<Tensor>
//
// Built in: "idx" (images=, labels=), "npy" (path=), "image_folder" (root=, size=, channels=,
// random_crop=0|1, float=, mean=, std=, dct_scaling=, decode=cpu|gpu), "tar_index" (dir= or
// shards=, and image_folder's image keys), "synthetic" (n=, shape=3x224x224, dtype=uint8). Every dataset made here yields
// samples as std::vector<Tensor> (one tensor per field; labels as int64 scalars). An unknown name,
// an unknown or malformed option, a plugin file that cannot be loaded, a library without the
// entry point, or a plugin built for another ABI version is a ferry::Error saying which.
//
// Plugins stay loaded until the process exits (datasets made from them may outlive anything
// else). Thread safety: the registry is internally locked; datasets are safe to read from many
// threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "ferry/core/dataset.h"
#include "ferry/core/tensor.h"
#include "ferry/loaders/image.h"
#include "ferry/loaders/tar.h"
#include "ferry/loaders/tokens.h"

namespace ferry {

/// Parsed "key=value,key=value" options. Getters throw ferry::Error naming the dataset, the key and
/// the bad value; finish() throws for keys nobody asked for (a typo shows up at once). A backslash
/// escapes the character after it, so a value may hold any: "\," "\=" "\:" and "\\" stand for
/// ',' '=' ':' and a backslash (a key with a timestamp: "shards=s3://b/2024-01-01T00\:00.tar");
/// values() and str() give them unescaped.
/// Front-ends that hold typed values (the Python package) pass them as `Values` instead: each key's
/// items as they are, nothing escaped or split (a path is a path, whatever characters it holds).
class DatasetConfig {
 public:
  /// Each key's value as a list of items: one item for a scalar, several for a list.
  using Values = std::map<std::string, std::vector<std::string>>;
  DatasetConfig(std::string dataset, const std::string& text);
  DatasetConfig(std::string dataset, const Values& values);
  /// Required. A list given as Values of other than one item is an Error here (items() reads it).
  std::string str(const std::string& key) const;
  /// A required list: the value split at each ':' that is not escaped and not a URL's "://".
  std::vector<std::string> items(const std::string& key) const;
  std::string str(const std::string& key, const std::string& fallback) const;
  std::int64_t integer(const std::string& key) const;
  std::int64_t integer(const std::string& key, std::int64_t fallback) const;
  bool has(const std::string& key) const { return values_.count(key) != 0; }
  void finish() const;
  const std::map<std::string, std::string>& values() const noexcept { return values_; }
  const std::string& dataset() const noexcept { return dataset_; }
  /// The options as "key=value,..." text, escaped: DatasetConfig(dataset(), text()) reads the same.
  std::string text() const;

 private:
  std::string unescape(const std::string& text) const;
  std::string dataset_;
  std::map<std::string, std::string> values_;              // unescaped (a Values list: its items joined by ':')
  std::map<std::string, std::vector<std::string>> items_;  // each value's items, unescaped
  std::map<std::string, bool> scalar_;                     // whether str() may read it
  mutable std::vector<std::string> read_;
};

/// A map-style dataset of std::vector<Tensor> samples, of any registered kind (one tensor per
/// field; labels as int64 scalars). Copies share it.
using DynamicDataset = AnyDataset<std::vector<Tensor>>;

/// The ImageFolder that "image_folder" makes from `config` (registry().help("image_folder") lists
/// the keys), as the typed dataset: GPU decode (decode=gpu) needs the loader's direct mode, which
/// a DynamicDataset does not have, so the registry refuses decode=gpu and this makes it.
ImageFolder make_image_folder(const DatasetConfig& config);

/// The TarImages that "tar_index" makes from `config` (WebDataset shards indexed as a map-style
/// dataset; registry().help("tar_index") lists the keys), as the typed dataset, for decode=gpu as
/// make_image_folder.
TarImages make_tar_index(const DatasetConfig& config);

/// The token sequences "tokens" (a flat token file: path=, dtype= for a raw file, format=, eod=)
/// or "megatron" (prefix=) make from `config`, as the typed dataset (its field_names()); both take
/// seq_len=1024, packed=0|1, random_offset=0|1, num_samples= (random_offset), vocab=, and
/// out_dtype=int64|int32 (registry().help(name) lists the keys).
TokenSequences make_token_sequences(const DatasetConfig& config);

/// The shards a "tar" or "tar_index" configuration names: dir=<folder> (its .tar files, sorted) or
/// shards=a.tar:b.tar. ferry::Error for a missing folder or an empty list.
std::vector<std::string> tar_shard_paths(const DatasetConfig& config);

/// The labeled-image stream "tar" names (the `ferry` tool's and the Python module's): WebDataset
/// shards (tar_shard_paths), each record's image decoded and transformed as image_folder's (size=224;
/// random_crop=1: random_resized_crop + flip, else resize_shorter + center_crop; channels=3;
/// float=0|1, mean=, std= (normalize; implies float), dct_scaling=0|1) and its label, as
/// {image, int64 label} std::vector<Tensor>; shuffle=1 shuffles the shard order per epoch. A
/// stream: the loader takes no shuffle or sampler for it; its batches are filled across the
/// workers (TarShards), each record decoded into its batch row (TarDecodeStream). decode=gpu is
/// make_tar_gpu_stream's.
TarRecordDecodeOptions tar_stream_decode(const DatasetConfig& config);
inline TarShards tar_stream_shards(const DatasetConfig& config) {
  TarShardsOptions so;
  so.shuffle = config.integer("shuffle", 1) != 0;
  return TarShards(tar_shard_paths(config), so);
}
/// make_tar_stream's dataset: a TarDecodeStream (each record decoded into its batch row) whose
/// samples and batches are {image, int64 label} std::vector<Tensor>.
class TarRowsStream : public DatasetBase<TarRowsStream> {
 public:
  static constexpr bool kFillsAcrossWorkers = true;
  explicit TarRowsStream(TarDecodeStream inner) : inner_(std::move(inner)) {}
  class Stream {
   public:
    std::optional<std::vector<Tensor>> next() {
      std::optional<LabeledSample> s = inner_.next();
      if (!s) return std::nullopt;
      return std::vector<Tensor>{std::move(s->image), Tensor::scalar(s->label)};
    }
    bool next_into(std::vector<Tensor>& batch, std::size_t row) {
      LabeledBatch view{batch.at(0), batch.at(1)};
      return inner_.next_into(view, row);
    }
    std::size_t skip(std::size_t n) { return inner_.skip(n); }
    bool progress() { return inner_.progress(); }
    std::optional<std::uint64_t> position() const { return inner_.position(); }
    void begin_batch(std::uint64_t batch) { inner_.begin_batch(batch); }

   private:
    friend class TarRowsStream;
    explicit Stream(TarDecodeStream::Stream inner) : inner_(std::move(inner)) {}
    TarDecodeStream::Stream inner_;
  };
  Stream open(const WorkerInfo& worker) const { return Stream(inner_.open(worker)); }
  std::vector<Tensor> make_batch(std::size_t n, BatchAllocator& allocator) const {
    LabeledBatch b = inner_.make_batch(n, allocator);
    return {std::move(b.image), std::move(b.label)};
  }

 private:
  TarDecodeStream inner_;
};

inline TarRowsStream make_tar_stream(const DatasetConfig& config) {
  const std::string decode = config.str("decode", "cpu");
  if (decode == "gpu") throw Error("dataset 'tar': decode=gpu is make_tar_gpu_stream's stream");
  if (decode != "cpu") throw Error("dataset 'tar': option 'decode' must be cpu or gpu, got '" + decode + "'");
  const TarRecordDecodeOptions o = tar_stream_decode(config);
  TarShards shards = tar_stream_shards(config);
  config.finish();
  return TarRowsStream(TarDecodeStream(std::move(shards), o));
}
/// The name make_tar_stream had before 0.2.0 (CHANGELOG.md); kept for one minor version at least.
[[deprecated("renamed ferry::make_tar_stream in 0.2.0")]] inline auto make_tar_images(const DatasetConfig& config) {
  return make_tar_stream(config);
}
/// The same stream with decode=gpu: each record's JPEG left compressed (encode_labeled_image) for
/// the loader's device stage to decode; LabeledBatch batches. ferry::Error unless channels=3.
inline auto make_tar_gpu_stream(const DatasetConfig& config) {
  if (config.str("decode", "gpu") != "gpu")
    throw Error("dataset 'tar': make_tar_gpu_stream is decode=gpu, got decode='" + config.str("decode") + "'");
  const TarRecordDecodeOptions o = tar_stream_decode(config);
  if (o.channels != 3)
    throw Error("dataset 'tar': decode=gpu produces RGB: channels must be 3, got " + std::to_string(o.channels));
  TarShards shards = tar_stream_shards(config);
  config.finish();
  return shards.map([o](TarRecord r, SampleContext& ctx) { return encode_labeled_image(std::move(r), o, ctx.rng()); });
}

/// The streams "tar" opens (make_tar_stream, and make_tar_gpu_stream with decode=gpu).
using TarImageStream = decltype(make_tar_stream(std::declval<const DatasetConfig&>()));
using TarGpuStream = decltype(make_tar_gpu_stream(std::declval<const DatasetConfig&>()));

/// A named dataset as the loader takes it: a map-style DynamicDataset (every registered name), the
/// labeled-image streams of "tar" (decoded on the CPU, or on the device with decode=gpu), or, with
/// decode=gpu, the typed ImageFolder ("image_folder") or TarImages ("tar_index") whose batches the
/// device decodes (the loader's direct mode), or the typed TokenSequences of "tokens" and
/// "megatron" (direct mode: each window written into its batch row, no collate copy). Use with
/// std::visit: `std::visit([&](auto& ds) { ferry::DataLoader loader(std::move(ds), options); ... }, opened)`.
using OpenedDataset = std::variant<DynamicDataset, TarImageStream, TarGpuStream, ImageFolder, TarImages, TokenSequences>;

class DatasetRegistry {
 public:
  using Factory = std::function<DynamicDataset(const DatasetConfig&)>;
  /// The process-wide registry, with the built-in datasets.
  static DatasetRegistry& global();
  /// An empty registry (tests).
  DatasetRegistry() = default;

  /// Registers `name`; ferry::Error when the name is taken.
  void add(const std::string& name, Factory factory, std::string help = {});
  /// Creates dataset `name` from a "key=value,..." string, or from typed values
  /// (DatasetConfig(name, values)).
  DynamicDataset create(const std::string& name, const std::string& config = {}) const;
  DynamicDataset create(const DatasetConfig& config) const;
  /// Opens dataset `name` the way the loader takes it (OpenedDataset): what the `ferry` tool and
  /// the Python module call, so that neither dispatches by hand. `classes`, where given, receives
  /// an image folder's class names (its label i is classes[i]); other datasets leave it empty.
  OpenedDataset open(const std::string& name, const std::string& config = {}, std::vector<std::string>* classes = nullptr) const;
  /// The same from typed values: DatasetConfig(name, values), its dataset() the name.
  OpenedDataset open(const DatasetConfig& config, std::vector<std::string>* classes = nullptr) const;
  bool contains(const std::string& name) const;
  /// Registered names, sorted.
  std::vector<std::string> names() const;
  std::string help(const std::string& name) const;
  /// Loads a plugin library and returns the names it registered (the same names again when the
  /// library was loaded before).
  std::vector<std::string> load_plugin(const std::string& path);

 private:
  struct Entry {
    Factory factory;
    std::string help;
  };
  mutable std::mutex mu_;
  std::map<std::string, Entry> entries_;               // guarded by mu_
  std::map<void*, std::vector<std::string>> plugins_;  // guarded by mu_: dlopen handle -> names
};

}  // namespace ferry
