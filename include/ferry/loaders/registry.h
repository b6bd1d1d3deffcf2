// ferry/loaders/registry.h — datasets by name, configured by "key=value" strings, and plugins
// loaded at run time.
//
//   auto& reg = ferry::DatasetRegistry::global();
//   reg.load_plugin("build/examples/plugin/libferry_ramp_plugin.so");    // registers "ramp"
//   ferry::DynamicDataset ds = reg.create("ramp", "n=1000,dim=16");
//   ferry::DataLoader loader(ds, {.batch_size = 64});                    // batches: std::vector<Tensor>
//
// Built in: "idx", "npy", "image_folder", "tar_index", "tar" (a stream: open()'s), "tokens",
// "megatron" and "synthetic", each with its options' schema (DatasetSchema: every key, default,
// range and doc declared once; `ferry list` prints them, schema(name) gives them). Every dataset made here yields
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
#include "ferry/loaders/table.h"
#include "ferry/loaders/tar.h"
#include "ferry/loaders/tokens.h"

namespace ferry {

/// One option of a dataset's schema (DatasetSchema): its key, what kind of value it takes, its
/// default and range, and what it does. The one place each built-in option is declared: the
/// registry's parsing and checks, `ferry list` and the Python package's keyword defaults read it.
struct DatasetOption {
  enum class Kind : std::uint8_t {
    Integer,  ///< a whole number, within [min, max]
    Flag,     ///< 0 or 1 (also true/false)
    Number,   ///< a real number, within [min, max]
    Numbers,  ///< one number or a list ("0.485:0.456:0.406")
    Text,     ///< any text (a shape "3x224x224", a dtype name)
    Choice,   ///< one of `choices`
    Path,     ///< a file, folder or s3:// URL
    Paths,    ///< a list of paths ("a.tar:b.tar", brace patterns)
  };
  std::string key;
  Kind kind = Kind::Text;
  /// The value taken when the key is not given, as text ("1024", "0", "cpu"). Empty: none, and the
  /// dataset decides from the other keys, as `doc` says (unless `required`).
  std::string fallback;
  bool required = false;
  /// Integer and Number: the range a value must lie in (inclusive); unset: unbounded.
  std::optional<double> min, max;
  /// Choice: the values it takes.
  std::vector<std::string> choices;
  std::string doc;
  /// "int", "flag", "number", "numbers", "text", "choice", "path" or "paths".
  static const char* kind_name(Kind kind) noexcept;
  /// The range or choices as the errors and help say them ("in [1, 32768]", "one of cpu, gpu"); empty when free.
  std::string range() const;
};

/// A registered dataset's options, in the order help lists them.
struct DatasetSchema {
  /// What the dataset reads and yields, in a sentence.
  std::string summary;
  std::vector<DatasetOption> options;
  /// The option `key`, or nullptr.
  const DatasetOption* find(const std::string& key) const noexcept;
  /// The summary, then each option on a line: "key=default  doc (range)".
  std::string help() const;
};

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
  /// The same options read by `schema` (not copied: it must outlive this config): a key it does not
  /// declare is an Error at once, naming the keys it does; str(), integer(), flag() and number()
  /// of a declared key take its default when the key is not given and check its range or choices;
  /// the getters that take a fallback refuse a declared key (its default is the schema's).
  DatasetConfig with_schema(const DatasetSchema& schema) const;
  const DatasetSchema* schema() const noexcept { return schema_; }
  /// Required (or the schema's default). A list given as Values of other than one item is an Error
  /// here (items() reads it).
  std::string str(const std::string& key) const;
  /// A required list: the value split at each ':' that is not escaped and not a URL's "://".
  std::vector<std::string> items(const std::string& key) const;
  std::string str(const std::string& key, const std::string& fallback) const;
  std::int64_t integer(const std::string& key) const;
  std::int64_t integer(const std::string& key, std::int64_t fallback) const;
  /// A Flag: 0, 1, false or true (or the schema's default).
  bool flag(const std::string& key) const;
  /// A Number (or the schema's default).
  double number(const std::string& key) const;
  /// A Numbers list: each item a number, at least one.
  std::vector<double> numbers(const std::string& key) const;
  bool has(const std::string& key) const { return values_.count(key) != 0; }
  void finish() const;
  const std::map<std::string, std::string>& values() const noexcept { return values_; }
  const std::string& dataset() const noexcept { return dataset_; }
  /// The options as "key=value,..." text, escaped: DatasetConfig(dataset(), text()) reads the same.
  std::string text() const;

 private:
  std::string unescape(const std::string& text) const;
  // The declared option `key` of the schema (nullptr without one); fails for an undeclared key.
  const DatasetOption* declared(const std::string& key) const;
  [[noreturn]] void bad_value(const std::string& key, const std::string& what, const std::string& value) const;
  const DatasetSchema* schema_ = nullptr;
  std::string dataset_;
  std::map<std::string, std::string> values_;              // unescaped (a Values list: its items joined by ':')
  std::map<std::string, std::vector<std::string>> items_;  // each value's items, unescaped
  std::map<std::string, bool> scalar_;                     // whether str() may read it
  // The keys read, for finish(): shared by copies (with_schema's and the make_* functions'), so
  // that what any of them reads counts.
  std::shared_ptr<std::vector<std::string>> read_ = std::make_shared<std::vector<std::string>>();
};

/// The schema of built-in dataset `name` ("idx", "npy", "image_folder", "tar_index", "tar",
/// "tokens", "megatron", "synthetic"); ferry::Error for another name.
const DatasetSchema& builtin_schema(const std::string& name);
/// `config` read by built-in dataset `name`'s schema (DatasetConfig::with_schema), unless it has a
/// schema already: what each make_* function below reads its options through.
inline DatasetConfig with_builtin_schema(const DatasetConfig& config, const std::string& name) {
  return config.schema() ? config : config.with_schema(builtin_schema(name));
}

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
  const DatasetConfig c = with_builtin_schema(config, "tar");
  TarShardsOptions so;
  so.shuffle = c.flag("shuffle");
  return TarShards(tar_shard_paths(c), so);
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
  const DatasetConfig c = with_builtin_schema(config, "tar");
  if (c.str("decode") == "gpu") throw Error("dataset 'tar': decode=gpu is make_tar_gpu_stream's stream");
  const TarRecordDecodeOptions o = tar_stream_decode(c);
  TarShards shards = tar_stream_shards(c);
  c.finish();
  return TarRowsStream(TarDecodeStream(std::move(shards), o));
}
/// The name make_tar_stream had before 0.2.0 (CHANGELOG.md); kept for one minor version at least.
[[deprecated("renamed ferry::make_tar_stream in 0.2.0")]] inline auto make_tar_images(const DatasetConfig& config) {
  return make_tar_stream(config);
}
/// The same stream with decode=gpu: each record's JPEG left compressed (encode_labeled_image) for
/// the loader's device stage to decode; LabeledBatch batches. ferry::Error unless channels=3.
inline auto make_tar_gpu_stream(const DatasetConfig& config) {
  const DatasetConfig c = with_builtin_schema(config, "tar");
  if (c.has("decode") && c.str("decode") != "gpu")  // a decode= not given is gpu here
    throw Error("dataset 'tar': make_tar_gpu_stream is decode=gpu, got decode='" + c.str("decode") + "'");
  const TarRecordDecodeOptions o = tar_stream_decode(c);
  if (o.channels != 3)
    throw Error("dataset 'tar': decode=gpu produces RGB: channels must be 3, got " + std::to_string(o.channels));
  TarShards shards = tar_stream_shards(c);
  c.finish();
  return shards.map([o](TarRecord r, SampleContext& ctx) { return encode_labeled_image(std::move(r), o, ctx.rng()); });
}

/// "parquet"'s windows (ferry/loaders/table.h): the files of dir= or files=, the tokenizer's file,
/// the options of TableTokensOptions. Error for a bad option; DataError for a file that does not
/// open or lacks the text column.
TableTokens make_table_tokens(const DatasetConfig& config);

/// The streams "tar" opens (make_tar_stream, and make_tar_gpu_stream with decode=gpu).
using TarImageStream = decltype(make_tar_stream(std::declval<const DatasetConfig&>()));
using TarGpuStream = decltype(make_tar_gpu_stream(std::declval<const DatasetConfig&>()));

/// A named dataset as the loader takes it: a map-style DynamicDataset (every registered name), the
/// tokenized windows of "parquet" (TableTokens, a stream), the
/// labeled-image streams of "tar" (decoded on the CPU, or on the device with decode=gpu), or, with
/// decode=gpu, the typed ImageFolder ("image_folder") or TarImages ("tar_index") whose batches the
/// device decodes (the loader's direct mode), or the typed TokenSequences of "tokens" and
/// "megatron" (direct mode: each window written into its batch row, no collate copy). Use with
/// std::visit: `std::visit([&](auto& ds) { ferry::DataLoader loader(std::move(ds), options); ... }, opened)`.
using OpenedDataset =
    std::variant<DynamicDataset, TarImageStream, TarGpuStream, ImageFolder, TarImages, TokenSequences, TableTokens>;

class DatasetRegistry {
 public:
  using Factory = std::function<DynamicDataset(const DatasetConfig&)>;
  /// The process-wide registry, with the built-in datasets.
  static DatasetRegistry& global();
  /// An empty registry (tests).
  DatasetRegistry() = default;

  /// Registers `name`; ferry::Error when the name is taken.
  void add(const std::string& name, Factory factory, std::string help = {});
  /// Registers `name` with its options' schema: the factory's DatasetConfig reads by it
  /// (DatasetConfig::with_schema), and help(name) is schema.help().
  void add(const std::string& name, Factory factory, DatasetSchema schema);
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
  /// The schema `name` was registered with (every built-in dataset's, "tar" included), or nullptr
  /// (a plugin's, or an unknown name). Valid as long as the registry.
  const DatasetSchema* schema(const std::string& name) const;
  /// Loads a plugin library and returns the names it registered (the same names again when the
  /// library was loaded before).
  std::vector<std::string> load_plugin(const std::string& path);

 private:
  struct Entry {
    Factory factory;
    std::string help;
    std::shared_ptr<const DatasetSchema> schema;  // null: none declared
  };
  mutable std::mutex mu_;
  std::map<std::string, Entry> entries_;               // guarded by mu_
  std::map<void*, std::vector<std::string>> plugins_;  // guarded by mu_: dlopen handle -> names
};

}  // namespace ferry
