#include "ferry/loaders/registry.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "ferry/core/faults.h"
#include "ferry/loaders/idx.h"
#include "ferry/loaders/image.h"
#include "ferry/loaders/npy.h"
#include "ferry/loaders/plugin_abi.h"
#include "io.h"

namespace ferry {

static_assert(FERRY_FLOAT32 == static_cast<int>(DType::Float32) && FERRY_BOOL == static_cast<int>(DType::Bool) &&
              FERRY_FLOAT64 == static_cast<int>(DType::Float64) && FERRY_INT64 == static_cast<int>(DType::Int64));

namespace {

std::string trim(const std::string& s) {
  const std::size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

std::vector<Tensor> labeled(LabeledSample s) { return {std::move(s.image), Tensor::scalar<std::int64_t>(s.label)}; }

Shape parse_shape(const DatasetConfig& c, const std::string& text) {
  Shape shape;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, 'x')) {
    if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos || part.size() > 9)
      throw Error("dataset '" + c.dataset() + "': option 'shape' must look like 3x224x224, got '" + text + "'");
    shape.push_back(std::stoll(part));
  }
  if (shape.empty()) throw Error("dataset '" + c.dataset() + "': option 'shape' is empty");
  return shape;
}

DType parse_dtype(const DatasetConfig& c, const std::string& name) {
  for (DType d : {DType::Bool, DType::UInt8, DType::Int8, DType::Int16, DType::Int32, DType::Int64, DType::Float16,
                  DType::BFloat16, DType::Float32, DType::Float64})
    if (name == dtype_name(d)) return d;
  throw Error("dataset '" + c.dataset() + "': option 'dtype' is not a dtype: '" + name + "'");
}

// A synthetic dataset: sample i is a tensor whose every byte is i mod 251 (one memset: the loader
// is measured, not the pattern), and label i mod 10.
struct Synthetic {
  std::size_t n;
  DType dtype;
  Shape shape;
  std::size_t size() const { return n; }
  std::vector<Tensor> get(std::size_t i) const {
    Tensor t = Tensor::empty(dtype, shape);
    std::memset(t.raw(), static_cast<int>(i % 251), t.nbytes());
    return {t, Tensor::scalar<std::int64_t>(static_cast<std::int64_t>(i % 10))};
  }
};

std::vector<float> parse_floats(const DatasetConfig& c, const std::string& key) {
  std::vector<float> out;
  for (double v : c.numbers(key)) out.push_back(static_cast<float>(v));  // "a:b:c", or typed items
  return out;
}

void add_builtins(DatasetRegistry& r) {
  r.add(
      "idx",
      [](const DatasetConfig& c) {
        IdxDatasetOptions o;
        if (c.flag("flip")) o.transform.horizontal_flip();
        if (c.flag("float") || c.has("mean") || c.has("std")) o.transform.to_float();
        if (c.has("mean") || c.has("std"))
          o.transform.normalize({c.has("mean") ? static_cast<float>(c.number("mean")) : 0.f},
                                {c.has("std") ? static_cast<float>(c.number("std")) : 1.f});
        // Images and labels as two fields, passed on for the device gather (host_rows: the flip and
        // normalize run in its kernel).
        struct IdxRows {
          IdxDataset d;
          std::size_t size() const { return d.size(); }
          std::vector<Tensor> get(std::size_t i, SampleContext& ctx) const { return labeled(d.get(i, ctx)); }
          std::vector<HostRows> host_rows(std::string& why) const { return d.host_rows(why); }
        };
        if (!c.has("images") || !c.has("labels"))
          throw Error(std::string("dataset 'idx': options 'images' and 'labels' are required (") +
                      (c.has("images")   ? "labels="
                       : c.has("labels") ? "images="
                                         : "images= and labels=") +
                      " missing: the IDX images and labels files, raw or .gz)");
        const std::string images = c.str("images"), labels = c.str("labels");
        IdxRows rows{IdxDataset(images, labels, std::move(o))};
        c.finish();
        return DynamicDataset(std::move(rows));
      },
      builtin_schema("idx"));
  r.add(
      "npy",
      [](const DatasetConfig& c) {
        // Rows of one field, passed on for the device gather (host_rows).
        struct NpyRows {
          NpyDataset d;
          std::size_t size() const { return d.size(); }
          std::vector<Tensor> get(std::size_t i) const { return {d.get(i)}; }
          std::vector<HostRows> host_rows(std::string& why) const { return d.host_rows(why); }
        };
        NpyRows rows{NpyDataset(c.str("path"))};
        c.finish();
        return DynamicDataset(std::move(rows));
      },
      builtin_schema("npy"));
  // Image datasets with CPU decode; decode=gpu needs the typed dataset (the loader's direct mode).
  auto images = [](const char* typed, auto make) {
    return [typed, make](const DatasetConfig& c) {
      if (c.str("decode") == "gpu")
        throw Error("dataset '" + c.dataset() +
                    "': decode=gpu needs the loader's direct mode, which a registry dataset "
                    "(std::vector<Tensor> samples) does not have: use ferry::" +
                    typed +
                    "(config) and a DataLoader "
                    "of the dataset it returns, with a device (ferry bench does)");
      return DynamicDataset(ferry::map(make(c), labeled));
    };
  };
  r.add("image_folder", images("make_image_folder", make_image_folder), builtin_schema("image_folder"));
  r.add("tar_index", images("make_tar_index", make_tar_index), builtin_schema("tar_index"));
  r.add(
      "tokens", [](const DatasetConfig& c) { return DynamicDataset(make_token_sequences(c)); }, builtin_schema("tokens"));
  r.add(
      "megatron", [](const DatasetConfig& c) { return DynamicDataset(make_token_sequences(c)); }, builtin_schema("megatron"));
  r.add(
      "synthetic",
      [](const DatasetConfig& c) {
        const std::int64_t n = c.integer("n");
        Synthetic d{static_cast<std::size_t>(n), parse_dtype(c, c.str("dtype")), parse_shape(c, c.str("shape"))};
        FaultOptions f;  // ferry::FaultInjector, to try a pipeline's fault handling from the command line
        f.seed = static_cast<std::uint64_t>(c.integer("fault_seed"));
        f.throw_rate = c.number("throw_rate");
        f.delay_rate = c.number("delay_rate");
        f.delay = std::chrono::milliseconds(c.integer("delay_ms"));
        c.finish();
        if (f.throw_rate > 0 || f.delay_rate > 0) return DynamicDataset(FaultInjector(std::move(d), std::move(f)));
        return DynamicDataset(std::move(d));
      },
      builtin_schema("synthetic"));
}

// --- plugins ------------------------------------------------------------------------------------

// One plugin instance; destroyed (ops->destroy) with the last copy of the dataset holding it.
struct PluginInstance {
  std::string plugin, name;
  const ferry_dataset_ops* ops;
  void* self = nullptr;
  std::vector<ferry_field> fields;
  ~PluginInstance() {
    if (self) ops->destroy(self);
  }
};

struct PluginDataset {
  std::shared_ptr<const PluginInstance> p;
  std::size_t size() const { return static_cast<std::size_t>(p->ops->size(p->self)); }
  std::vector<Tensor> get(std::size_t i) const {
    std::vector<Tensor> out;
    std::vector<void*> ptrs;
    out.reserve(p->fields.size());
    for (const ferry_field& f : p->fields) {
      out.push_back(Tensor::empty(static_cast<DType>(f.dtype), Shape(f.shape, f.shape + f.ndim)));
      ptrs.push_back(out.back().raw());
    }
    char err[512] = {0};
    if (p->ops->get(p->self, i, ptrs.data(), err, sizeof err) != 0)
      throw DataError(p->plugin, DataError::kNoOffset,
                      "dataset '" + p->name + "', sample " + std::to_string(i) + ": " +
                          (err[0] ? std::string(err, strnlen(err, sizeof err)) : "get() failed"));
    return out;
  }
};

struct Staging {
  std::string path;
  std::vector<std::pair<std::string, const ferry_dataset_ops*>> datasets;
  std::string error;
};

int stage_dataset(void* context, const char* name, const ferry_dataset_ops* ops) {
  auto* s = static_cast<Staging*>(context);
  if (!name || !*name || !ops) {
    s->error = "registered a dataset with no name or no ops table";
    return 1;
  }
  if (ops->abi_version != FERRY_PLUGIN_ABI_VERSION || ops->struct_size < sizeof(ferry_dataset_ops)) {
    s->error = "dataset '" + std::string(name) + "' was built for plugin ABI version " + std::to_string(ops->abi_version) +
               ", this ferry speaks version " + std::to_string(FERRY_PLUGIN_ABI_VERSION);
    return 1;
  }
  if (!ops->create || !ops->destroy || !ops->size || !ops->fields || !ops->get) {
    s->error = "dataset '" + std::string(name) + "' has a null function in its ops table";
    return 1;
  }
  s->datasets.emplace_back(name, ops);
  return 0;
}

DynamicDataset create_plugin_dataset(const std::string& plugin, const std::string& name, const ferry_dataset_ops* ops,
                                     const DatasetConfig& c) {
  std::vector<ferry_kv> kv;
  for (auto& [k, v] : c.values()) kv.push_back({k.c_str(), v.c_str()});
  auto d = std::make_shared<PluginInstance>();
  d->plugin = plugin;
  d->name = name;
  d->ops = ops;
  char err[512] = {0};
  d->self = ops->create(kv.data(), kv.size(), err, sizeof err);
  if (!d->self)
    throw Error("plugin dataset '" + name + "' (" + plugin +
                "): " + (err[0] ? std::string(err, strnlen(err, sizeof err)) : "create() failed"));
  const std::size_t n = ops->fields(d->self, nullptr, 0);
  if (n == 0 || n > 64)
    throw Error("plugin dataset '" + name + "' (" + plugin + "): declares " + std::to_string(n) + " fields (1 to 64 allowed)");
  d->fields.resize(n);
  ops->fields(d->self, d->fields.data(), n);
  for (const ferry_field& f : d->fields) {
    const bool ok =
        f.dtype >= FERRY_BOOL && f.dtype <= FERRY_FLOAT64 && f.ndim >= 0 && f.ndim <= FERRY_PLUGIN_MAX_DIMS &&
        std::all_of(f.shape, f.shape + std::max(f.ndim, 0), [](std::int64_t x) { return x >= 0 && x < (std::int64_t{1} << 40); });
    if (!ok)
      throw Error("plugin dataset '" + name + "' (" + plugin + "): field '" +
                  std::string(f.name, strnlen(f.name, sizeof f.name)) + "' has an invalid dtype or shape");
  }
  return DynamicDataset(PluginDataset{std::move(d)});
}

}  // namespace

namespace {
// image_folder's and tar_index's image options (all but root= / dir= / shards=).
ImageFolderOptions image_options(const DatasetConfig& c) {
  ImageFolderOptions o;
  o.channels = static_cast<int>(c.integer("channels"));
  const int n = static_cast<int>(c.integer("size"));
  if (c.flag("random_crop"))
    o.transform.random_resized_crop(n, n).horizontal_flip();
  else
    o.transform.resize_shorter(n).center_crop(n, n);
  const bool normalize = c.has("mean") || c.has("std");
  if (c.flag("float") || normalize) o.transform.to_float();
  if (normalize) {
    std::vector<float> mean = c.has("mean") ? parse_floats(c, "mean") : std::vector<float>{0.f};
    std::vector<float> std = c.has("std") ? parse_floats(c, "std") : std::vector<float>{1.f};
    if (mean.size() != std.size() && mean.size() != 1 && std.size() != 1)
      throw Error("dataset '" + c.dataset() + "': options 'mean' and 'std' must have one value or one per channel each");
    if (mean.size() == 1) mean.resize(std.size(), mean[0]);  // one value applies to every channel
    if (std.size() == 1) std.resize(mean.size(), std[0]);
    o.transform.normalize(std::move(mean), std::move(std));
  }
  o.dct_scaling = c.flag("dct_scaling");
  const std::string decode = c.str("decode");
  o.decode = decode == "gpu" ? ImageFolderOptions::Decode::Gpu : ImageFolderOptions::Decode::Cpu;
  return o;
}
}  // namespace

ImageFolder make_image_folder(const DatasetConfig& config) {
  const DatasetConfig c = with_builtin_schema(config, "image_folder");
  ImageFolderOptions o = image_options(c);
  const std::string root = c.str("root");
  c.finish();
  return ImageFolder(root, std::move(o));
}

TokenSequences make_token_sequences(const DatasetConfig& config) {
  const bool megatron = config.dataset() == "megatron";
  const DatasetConfig c = with_builtin_schema(config, megatron ? "megatron" : "tokens");
  TokenSequenceOptions o;
  o.seq_len = static_cast<std::size_t>(c.integer("seq_len"));
  o.packed = c.flag("packed");
  o.random_offset = c.flag("random_offset");
  o.raw = c.flag("raw");
  if (megatron) {
    o.shuffle_documents = c.flag("shuffle_documents");
    o.document_block = static_cast<std::size_t>(c.integer("document_block"));
    o.best_fit_group = static_cast<std::size_t>(c.integer("best_fit_group"));
  }
  if (c.has("num_samples")) o.num_samples = static_cast<std::size_t>(c.integer("num_samples"));
  o.dtype = c.str("out_dtype") == "int64" ? DType::Int64 : DType::Int32;
  std::optional<std::int64_t> vocab;
  if (c.has("vocab")) vocab = c.integer("vocab");
  std::shared_ptr<const TokenCorpus> corpus;
  if (megatron) {
    const std::string prefix = c.str("prefix");
    c.finish();
    corpus = open_megatron(prefix, {.vocab_size = vocab});
  } else {
    TokenFileOptions f;
    f.vocab_size = vocab;
    if (c.has("dtype")) f.type = parse_token_type(c.str("dtype"));  // one of the schema's choices
    if (c.has("eod")) f.eod = c.integer("eod");
    const std::string format = c.str("format");
    if (format == "raw")
      f.format = TokenFileOptions::Format::Raw;
    else if (format == "llmc")
      f.format = TokenFileOptions::Format::LlmC;
    else if (format == "npy")
      f.format = TokenFileOptions::Format::Npy;
    const std::string path = c.str("path");
    c.finish();
    corpus = open_token_file(path, f);
  }
  return TokenSequences(std::move(corpus), o);
}

TarRecordDecodeOptions tar_stream_decode(const DatasetConfig& config) {
  ImageFolderOptions f = image_options(with_builtin_schema(config, "tar"));
  TarRecordDecodeOptions o;
  o.channels = f.channels;
  o.transform = std::move(f.transform);
  o.dct_scaling = f.dct_scaling;
  return o;
}

TarImages make_tar_index(const DatasetConfig& config) {
  const DatasetConfig c = with_builtin_schema(config, "tar_index");
  ImageFolderOptions f = image_options(c);
  TarImagesOptions o;
  o.channels = f.channels;
  o.transform = std::move(f.transform);
  o.dct_scaling = f.dct_scaling;
  o.decode = f.decode;
  std::vector<std::string> shards = tar_shard_paths(c);
  c.finish();
  return TarImages(std::move(shards), std::move(o));
}

namespace {
// The places in `text` where `sep` stands unescaped (a backslash escapes the character after it).
// With `url_scheme`, a ':' followed by "//" (a URL's scheme, "s3://") is no separator.
std::vector<std::string> split_unescaped(const std::string& text, char sep, bool url_scheme = false) {
  std::vector<std::string> out(1);
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\\' && i + 1 < text.size()) {
      out.back() += text.substr(i, 2);
      ++i;
    } else if (c == sep && !(url_scheme && text.compare(i, 3, "://") == 0)) {
      out.emplace_back();
    } else {
      out.back() += c;
    }
  }
  return out;
}
// The first unescaped '=' of `item`, or npos.
std::size_t unescaped_eq(const std::string& item) {
  for (std::size_t i = 0; i < item.size(); ++i) {
    if (item[i] == '\\') {
      ++i;
    } else if (item[i] == '=') {
      return i;
    }
  }
  return std::string::npos;
}
}  // namespace

std::string DatasetConfig::unescape(const std::string& text) const {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\\') {
      out += text[i];
      continue;
    }
    if (i + 1 == text.size()) throw Error("dataset '" + dataset_ + "': '" + text + "' ends with a lone '\\' (write '\\\\')");
    out += text[++i];
  }
  return out;
}

DatasetConfig::DatasetConfig(std::string dataset, const std::string& text) : dataset_(std::move(dataset)) {
  for (const std::string& item : split_unescaped(text, ',')) {
    if (trim(item).empty()) continue;
    const std::size_t eq = unescaped_eq(item);
    if (eq == std::string::npos) throw Error("dataset '" + dataset_ + "': option '" + trim(item) + "' is not key=value");
    const std::string key = unescape(trim(item.substr(0, eq))), raw = trim(item.substr(eq + 1));
    if (key.empty()) throw Error("dataset '" + dataset_ + "': option '" + trim(item) + "' has an empty key");
    if (!values_.emplace(key, unescape(raw)).second)
      throw Error("dataset '" + dataset_ + "': option '" + key + "' is given twice");
    std::vector<std::string>& items = items_[key];
    for (const std::string& piece : split_unescaped(raw, ':', true))
      if (!piece.empty()) items.push_back(unescape(piece));
    scalar_[key] = true;
  }
}

DatasetConfig::DatasetConfig(std::string dataset, const Values& values) : dataset_(std::move(dataset)) {
  for (const auto& [key, items] : values) {
    if (key.empty()) throw Error("dataset '" + dataset_ + "': an option has an empty key");
    std::string joined;
    for (std::size_t k = 0; k < items.size(); ++k) joined += (k ? ":" : "") + items[k];
    values_.emplace(key, std::move(joined));
    items_.emplace(key, items);
    scalar_[key] = items.size() == 1;
  }
}

std::string DatasetConfig::text() const {
  auto escaped = [](const std::string& v) {
    std::string out;
    for (char c : v) {
      if (c == '\\' || c == ',' || c == '=' || c == ':') out += '\\';
      out += c;
    }
    return out;
  };
  std::string out;
  for (const auto& [key, items] : items_) {
    out += (out.empty() ? "" : ",") + escaped(key) + "=";
    if (scalar_.at(key) && items.size() == 1) {
      out += escaped(values_.at(key));  // a text value read whole (its ':' included)
      continue;
    }
    for (std::size_t k = 0; k < items.size(); ++k) out += (k ? ":" : "") + escaped(items[k]);
  }
  return out;
}

namespace {
std::string number_text(double v) {
  if (v == std::floor(v) && std::fabs(v) < 9.0e15) return std::to_string(static_cast<std::int64_t>(v));
  std::ostringstream ss;
  ss << v;
  return ss.str();
}
}  // namespace

const char* DatasetOption::kind_name(Kind kind) noexcept {
  switch (kind) {
    case Kind::Integer: return "int";
    case Kind::Flag: return "flag";
    case Kind::Number: return "number";
    case Kind::Numbers: return "numbers";
    case Kind::Text: return "text";
    case Kind::Choice: return "choice";
    case Kind::Path: return "path";
    case Kind::Paths: return "paths";
  }
  return "text";
}

std::string DatasetOption::range() const {
  if (kind == Kind::Choice) {
    std::string out;
    for (const std::string& c : choices) out += (out.empty() ? "" : ", ") + c;
    return "one of " + out;
  }
  if (kind == Kind::Flag) return "0 or 1";
  if (min && max) return "in [" + number_text(*min) + ", " + number_text(*max) + "]";
  if (min) return ">= " + number_text(*min);
  if (max) return "<= " + number_text(*max);
  return {};
}

const DatasetOption* DatasetSchema::find(const std::string& key) const noexcept {
  for (const DatasetOption& o : options)
    if (o.key == key) return &o;
  return nullptr;
}

std::string DatasetSchema::help() const {
  std::string out = summary;
  std::size_t width = 0;
  for (const DatasetOption& o : options) width = std::max(width, o.key.size() + 1 + o.fallback.size());
  for (const DatasetOption& o : options) {
    std::string head = o.key + "=" + o.fallback;
    head.resize(width, ' ');
    std::string tail = o.doc;
    const std::string r = o.range();
    if (o.required) tail += " (required)";
    if (!r.empty() && o.kind != DatasetOption::Kind::Flag) tail += " (" + r + ")";
    out += "\n  " + head + "  " + tail;
  }
  return out;
}

DatasetConfig DatasetConfig::with_schema(const DatasetSchema& schema) const {
  DatasetConfig c(*this);
  c.schema_ = &schema;
  for (const auto& [key, value] : values_) c.declared(key);  // an undeclared key fails here
  return c;
}

const DatasetOption* DatasetConfig::declared(const std::string& key) const {
  if (!schema_) return nullptr;
  if (const DatasetOption* o = schema_->find(key)) return o;
  std::string known;
  for (const DatasetOption& o : schema_->options) known += (known.empty() ? "" : ", ") + o.key;
  throw Error("dataset '" + dataset_ + "': unknown option '" + key + "' (it takes: " + known + ")");
}

void DatasetConfig::bad_value(const std::string& key, const std::string& what, const std::string& value) const {
  throw Error("dataset '" + dataset_ + "': option '" + key + "' must be " + what + ", got '" + value + "'");
}

std::vector<std::string> DatasetConfig::items(const std::string& key) const {
  declared(key);
  auto it = items_.find(key);
  if (it == items_.end()) throw Error("dataset '" + dataset_ + "': option '" + key + "' is required");
  read_->push_back(key);
  return it->second;
}

std::string DatasetConfig::str(const std::string& key) const {
  const DatasetOption* o = declared(key);
  auto it = values_.find(key);
  if (it == values_.end()) {
    if (o && !o->fallback.empty()) {
      read_->push_back(key);
      return o->fallback;
    }
    throw Error("dataset '" + dataset_ + "': option '" + key + "' is required" + (o ? " (" + o->doc + ")" : std::string()));
  }
  if (!scalar_.at(key))
    throw Error("dataset '" + dataset_ + "': option '" + key + "' takes one value, got a list of " +
                std::to_string(items_.at(key).size()));
  read_->push_back(key);
  if (o && o->kind == DatasetOption::Kind::Choice &&
      std::find(o->choices.begin(), o->choices.end(), it->second) == o->choices.end())
    bad_value(key, o->range(), it->second);
  return it->second;
}
namespace {
// A getter with a fallback of its own for a key the schema declares: the default would be stated twice.
[[noreturn]] void default_twice(const std::string& dataset, const std::string& key) {
  throw Error("dataset '" + dataset + "': option '" + key +
              "' has its default in the dataset's schema; a getter with a fallback of its own may not read it");
}
}  // namespace
std::string DatasetConfig::str(const std::string& key, const std::string& fallback) const {
  if (declared(key)) default_twice(dataset_, key);
  if (has(key)) return str(key);
  read_->push_back(key);  // a known option, for finish()'s list
  return fallback;
}
std::int64_t DatasetConfig::integer(const std::string& key) const {
  const std::string v = str(key);
  std::size_t used = 0;
  std::int64_t out = 0;
  try {
    out = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (v.empty() || used != v.size()) bad_value(key, "an integer", v);
  if (const DatasetOption* o = declared(key))
    if ((o->min && static_cast<double>(out) < *o->min) || (o->max && static_cast<double>(out) > *o->max))
      bad_value(key, "an integer " + o->range(), v);
  return out;
}
std::int64_t DatasetConfig::integer(const std::string& key, std::int64_t fallback) const {
  if (declared(key)) default_twice(dataset_, key);
  if (has(key)) return integer(key);
  read_->push_back(key);
  return fallback;
}
bool DatasetConfig::flag(const std::string& key) const {
  const std::string v = str(key);
  if (v == "1" || v == "true") return true;
  if (v == "0" || v == "false") return false;
  bad_value(key, "0 or 1 (or false, true)", v);
}
namespace {
std::optional<double> parse_number(const std::string& text) {
  try {
    std::size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size() && std::isfinite(v)) return v;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}
}  // namespace
double DatasetConfig::number(const std::string& key) const {
  const std::string v = str(key);
  const std::optional<double> x = parse_number(v);
  if (!x) bad_value(key, "a number", v);
  if (const DatasetOption* o = declared(key))
    if ((o->min && *x < *o->min) || (o->max && *x > *o->max)) bad_value(key, "a number " + o->range(), v);
  return *x;
}
std::vector<double> DatasetConfig::numbers(const std::string& key) const {
  std::vector<double> out;
  const DatasetOption* o = declared(key);
  for (const std::string& item : items(key)) {
    const std::optional<double> x = parse_number(item);
    if (!x) bad_value(key, "a number or a list of numbers (a:b:c)", item);
    if (o && ((o->min && *x < *o->min) || (o->max && *x > *o->max))) bad_value(key, "numbers " + o->range(), item);
    out.push_back(*x);
  }
  if (out.empty()) throw Error("dataset '" + dataset_ + "': option '" + key + "' has no value");
  return out;
}
void DatasetConfig::finish() const {
  for (auto& [k, v] : values_)
    if (std::find(read_->begin(), read_->end(), k) == read_->end()) {
      std::string known;
      if (schema_) {
        for (const DatasetOption& o : schema_->options) known += (known.empty() ? "" : ", ") + o.key;
        throw Error("dataset '" + dataset_ + "': option '" + k + "' does not apply here (it takes: " + known + ")");
      }
      for (const std::string& r : *read_) known += (known.empty() ? "" : ", ") + r;
      throw Error("dataset '" + dataset_ + "': unknown option '" + k + "' (it takes: " + known + ")");
    }
}

DatasetRegistry& DatasetRegistry::global() {
  static DatasetRegistry* r = [] {
    auto* reg = new DatasetRegistry();  // never destroyed: plugin datasets may outlive static destruction
    add_builtins(*reg);
    return reg;
  }();
  return *r;
}

void DatasetRegistry::add(const std::string& name, Factory factory, std::string help) {
  if (name.empty()) throw Error("DatasetRegistry: a dataset name must not be empty");
  std::lock_guard lock(mu_);
  if (!entries_.emplace(name, Entry{std::move(factory), std::move(help), nullptr}).second)
    throw Error("DatasetRegistry: a dataset named '" + name + "' is already registered");
}

void DatasetRegistry::add(const std::string& name, Factory factory, DatasetSchema schema) {
  if (name.empty()) throw Error("DatasetRegistry: a dataset name must not be empty");
  auto shared = std::make_shared<const DatasetSchema>(std::move(schema));
  std::string help = shared->help();
  std::lock_guard lock(mu_);
  if (!entries_.emplace(name, Entry{std::move(factory), std::move(help), std::move(shared)}).second)
    throw Error("DatasetRegistry: a dataset named '" + name + "' is already registered");
}

namespace {
// The error for a name no dataset has, listing `known` in order.
[[noreturn]] void no_dataset_named(const std::string& name, std::vector<std::string> known) {
  std::sort(known.begin(), known.end());
  std::string list;
  for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
  throw Error("DatasetRegistry: no dataset named '" + name + "' (registered: " + list + ")");
}
}  // namespace

OpenedDataset DatasetRegistry::open(const std::string& name, const std::string& config, std::vector<std::string>* classes) const {
  return open(DatasetConfig(name, config), classes);
}

OpenedDataset DatasetRegistry::open(const DatasetConfig& config, std::vector<std::string>* classes) const {
  if (classes) classes->clear();
  const std::string& name = config.dataset();
  if (name == "tokens" || name == "megatron") return make_token_sequences(DatasetConfig(config));
  if (name == "image_folder" && classes) {  // the registry's own image_folder, its classes kept
    const DatasetConfig c = with_builtin_schema(config, name);
    ImageFolder folder = make_image_folder(c);
    *classes = folder.classes();
    if (c.str("decode") == "gpu") return folder;
    return DynamicDataset(ferry::map(std::move(folder), labeled));
  }
  if (name == "parquet") return make_table_tokens(config);
  if (name == "tar") {
    const DatasetConfig c = with_builtin_schema(config, name);
    if (c.str("decode") == "gpu") return make_tar_gpu_stream(c);
    return make_tar_stream(c);  // names any other value but cpu
  }
  if (name == "image_folder" || name == "tar_index") {
    const DatasetConfig c = with_builtin_schema(config, name);
    if (c.str("decode") == "gpu") {
      if (name == "image_folder") return make_image_folder(c);
      return make_tar_index(c);
    }
  }
  if (!contains(name)) {  // what open() knows: the registered names and the streams
    std::vector<std::string> known = names();
    known.push_back("tar");
    known.push_back("parquet");
    no_dataset_named(name, std::move(known));
  }
  return create(config);
}

DynamicDataset DatasetRegistry::create(const std::string& name, const std::string& config) const {
  return create(DatasetConfig(name, config));
}

DynamicDataset DatasetRegistry::create(const DatasetConfig& config) const {
  const std::string& name = config.dataset();
  Factory f;
  std::shared_ptr<const DatasetSchema> schema;
  {
    std::lock_guard lock(mu_);
    auto it = entries_.find(name);
    if (it == entries_.end()) {
      std::vector<std::string> known;
      for (auto& [k, v] : entries_) known.push_back(k);
      no_dataset_named(name, std::move(known));
    }
    f = it->second.factory;
    schema = it->second.schema;
  }
  // A copy: what this factory reads, finish() checks. The schema outlives it (the entry's, held).
  if (schema && config.schema() != schema.get()) return f(config.with_schema(*schema));
  return f(DatasetConfig(config));
}

bool DatasetRegistry::contains(const std::string& name) const {
  std::lock_guard lock(mu_);
  return entries_.count(name) != 0;
}

std::vector<std::string> DatasetRegistry::names() const {
  std::lock_guard lock(mu_);
  std::vector<std::string> out;
  for (auto& [k, v] : entries_) out.push_back(k);
  return out;
}

std::string DatasetRegistry::help(const std::string& name) const {
  std::lock_guard lock(mu_);
  auto it = entries_.find(name);
  return it == entries_.end() ? std::string() : it->second.help;
}

const DatasetSchema* DatasetRegistry::schema(const std::string& name) const {
  {
    std::lock_guard lock(mu_);
    auto it = entries_.find(name);
    if (it != entries_.end()) return it->second.schema.get();
  }
  if (name == "tar" || name == "parquet") return &builtin_schema(name);  // streams: open()'s, not entries
  return nullptr;
}

std::vector<std::string> DatasetRegistry::load_plugin(const std::string& path) {
  // Loaded for good: RTLD_NODELETE keeps the code mapped even if the handle were closed.
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (!handle) {
    const char* e = ::dlerror();
    throw Error("load_plugin: cannot load '" + path + "': " + (e ? e : "unknown error"));
  }
  std::lock_guard lock(mu_);
  if (auto it = plugins_.find(handle); it != plugins_.end()) return it->second;
  ::dlerror();
  auto init = reinterpret_cast<ferry_plugin_init_fn>(::dlsym(handle, FERRY_PLUGIN_ENTRY));
  if (!init) throw Error("load_plugin: '" + path + "' does not export " FERRY_PLUGIN_ENTRY "() (is it a ferry plugin?)");
  Staging staging{path, {}, {}};
  const ferry_plugin_host host{FERRY_PLUGIN_ABI_VERSION, &staging, &stage_dataset};
  const std::uint32_t version = init(&host);
  if (version != FERRY_PLUGIN_ABI_VERSION)
    throw Error("load_plugin: '" + path + "' was built for plugin ABI version " + std::to_string(version) +
                ", this ferry speaks version " + std::to_string(FERRY_PLUGIN_ABI_VERSION) + "; rebuild the plugin");
  if (!staging.error.empty()) throw Error("load_plugin: '" + path + "': " + staging.error);
  if (staging.datasets.empty()) throw Error("load_plugin: '" + path + "' registered no datasets");
  for (auto& [name, ops] : staging.datasets)
    if (entries_.count(name)) throw Error("load_plugin: '" + path + "' registers '" + name + "', which is already registered");
  std::vector<std::string> names;
  for (auto& [name, ops] : staging.datasets) {
    entries_.emplace(
        name, Entry{[path, name = name, ops = ops](const DatasetConfig& c) { return create_plugin_dataset(path, name, ops, c); },
                    "plugin dataset from " + path, nullptr});
    names.push_back(name);
  }
  plugins_.emplace(handle, names);
  return names;
}

std::vector<std::string> tar_shard_paths(const DatasetConfig& c) {
  std::vector<std::string> shards;
  if (c.has("dir")) {
    const std::string dir = c.str("dir");
    if (loaders::is_remote(dir)) {
      const std::string base = dir.back() == '/' ? dir : dir + "/";
      for (const loaders::ListedFile& f : loaders::list_prefix(dir)) {
        const std::string name = f.path.substr(base.size());
        if (name.find('/') == std::string::npos && name.size() > 4 && name.compare(name.size() - 4, 4, ".tar") == 0)
          shards.push_back(f.path);
      }
    } else {
      if (!std::filesystem::is_directory(dir)) throw Error("dataset '" + c.dataset() + "': dir '" + dir + "' is not a directory");
      for (const auto& e : std::filesystem::directory_iterator(dir))
        if (e.path().extension() == ".tar") shards.push_back(e.path().string());
    }
    std::sort(shards.begin(), shards.end());
    if (shards.empty()) throw Error("dataset '" + c.dataset() + "': no .tar files in '" + dir + "'");
  } else {
    // Names separated by ':' (a ':' before "//" belongs to a URL's scheme; "\:" is a ':' of a
    // name), each a brace pattern.
    for (const std::string& name : c.items("shards"))
      for (std::string& s : expand_braces(name)) shards.push_back(std::move(s));
    if (shards.empty()) throw Error("dataset '" + c.dataset() + "': option 'shards' names no file");
  }
  return shards;
}

namespace {
// A token given by its text or its id (digits).
std::optional<std::int32_t> token_option(const DatasetConfig& c, const std::string& key, const Tokenizer& tok) {
  if (!c.has(key)) return std::nullopt;
  const std::string v = c.str(key);
  if (!v.empty() && std::all_of(v.begin(), v.end(), [](unsigned char ch) { return std::isdigit(ch); })) {
    const std::int64_t id = c.integer(key);
    if (id < 0 || id > INT32_MAX) throw Error("dataset 'parquet': option '" + key + "' id " + v + " is not a token id");
    return static_cast<std::int32_t>(id);
  }
  const std::optional<std::int32_t> id = tok.token_id(v);
  if (!id) throw Error("dataset 'parquet': option '" + key + "': the tokenizer " + tok.name() + " has no token '" + v + "'");
  return id;
}
}  // namespace

TableTokens make_table_tokens(const DatasetConfig& config) {
  const DatasetConfig c = with_builtin_schema(config, "parquet");
  std::vector<std::string> files;
  if (c.has("dir")) {
    const std::string dir = c.str("dir");
    if (!std::filesystem::is_directory(dir)) throw Error("dataset 'parquet': dir '" + dir + "' is not a directory");
    for (const auto& e : std::filesystem::directory_iterator(dir))
      if (e.path().extension() == ".parquet") files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    if (files.empty()) throw Error("dataset 'parquet': no .parquet files in '" + dir + "'");
  } else {
    for (const std::string& name : c.items("files"))
      for (std::string& f : expand_braces(name)) files.push_back(std::move(f));
    if (files.empty()) throw Error("dataset 'parquet': option 'files' (or dir) names no file");
  }
  TableTokensOptions o;
  o.text = c.str("text");
  o.seq_len = static_cast<std::size_t>(c.integer("seq_len"));
  o.shuffle = c.flag("shuffle");
  o.packed = c.flag("packed");
  o.rows_per_read = static_cast<std::size_t>(c.integer("rows_per_read"));
  auto tok = open_tokenizer(c.str("tokenizer"));
  o.bos = token_option(c, "bos", *tok);
  o.eos = token_option(c, "eos", *tok);
  c.finish();
  auto opened = ParquetFiles::open(std::move(files), {.columns = {o.text}});
  return TableTokens(std::move(opened), std::move(tok), std::move(o));
}

}  // namespace ferry
