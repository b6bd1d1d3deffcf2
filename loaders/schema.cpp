// The built-in datasets' option schemas (ferry/loaders/registry.h, DatasetSchema): every key,
// default, range and doc of "idx", "npy", "image_folder", "tar_index", "tar", "tokens",
// "megatron", "parquet" and "synthetic" is declared here once. A default that an options struct holds
// (TokenSequenceOptions, ImageFolderOptions) is read from the struct, so the C++ constructors and
// the registry cannot disagree.
#include "ferry/loaders/registry.h"

#include <map>

#include "ferry/core/error.h"
#include "ferry/loaders/image.h"
#include "ferry/loaders/table.h"
#include "ferry/loaders/tokens.h"

namespace ferry {
namespace {

using Kind = DatasetOption::Kind;

DatasetOption opt(std::string key, Kind kind, std::string fallback, std::string doc) {
  DatasetOption o;
  o.key = std::move(key);
  o.kind = kind;
  o.fallback = std::move(fallback);
  o.doc = std::move(doc);
  return o;
}
DatasetOption required(std::string key, Kind kind, std::string doc) {
  DatasetOption o = opt(std::move(key), kind, "", std::move(doc));
  o.required = true;
  return o;
}
DatasetOption ranged(DatasetOption o, std::optional<double> min, std::optional<double> max = std::nullopt) {
  o.min = min;
  o.max = max;
  return o;
}
DatasetOption choice(std::string key, std::string fallback, std::vector<std::string> choices, std::string doc) {
  DatasetOption o = opt(std::move(key), Kind::Choice, std::move(fallback), std::move(doc));
  o.choices = std::move(choices);
  return o;
}
std::string flag_text(bool b) { return b ? "1" : "0"; }

// image_folder's, tar_index's and the tar stream's image options.
std::vector<DatasetOption> image_options() {
  const ImageFolderOptions d;
  return {
      ranged(opt("size", Kind::Integer, "224", "the output's height and width"), 1, 32768),
      choice("channels", std::to_string(d.channels), {"0", "1", "3", "4"}, "channels of every decoded image (0: as stored)"),
      opt("random_crop", Kind::Flag, "0", "random_resized_crop + horizontal flip; else resize_shorter + center_crop"),
      opt("float", Kind::Flag, "0", "float32 CHW output (implied by mean= or std=)"),
      opt("mean", Kind::Numbers, "", "normalize: one value, or one per channel as 0.485:0.456:0.406 (implies float)"),
      opt("std", Kind::Numbers, "", "normalize: one value, or one per channel (implies float)"),
      opt("dct_scaling", Kind::Flag, flag_text(d.dct_scaling), "decode JPEGs at 1/2, 1/4 or 1/8 scale where the crop allows"),
      choice("decode", "cpu", {"cpu", "gpu"}, "gpu: JPEGs decoded with nvJPEG on the loader's device (direct mode)"),
  };
}

std::vector<DatasetOption> with(std::vector<DatasetOption> a, const std::vector<DatasetOption>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The sequence options "tokens" and "megatron" share (TokenSequenceOptions' defaults).
std::vector<DatasetOption> sequence_options() {
  const TokenSequenceOptions d;
  return {
      ranged(opt("seq_len", Kind::Integer, std::to_string(d.seq_len), "tokens a sequence (its labels shifted by one)"), 1,
             double(TokenSequenceOptions::kMaxSeqLen)),
      opt("packed", Kind::Flag, flag_text(d.packed), "position_ids and cu_seqlens by document"),
      opt("random_offset", Kind::Flag, flag_text(d.random_offset), "nanoGPT's random windows, keyed by (seed, epoch, index)"),
      ranged(opt("num_samples", Kind::Integer, "", "random_offset: windows an epoch (default: as many as windows)"), 0),
      ranged(opt("vocab", Kind::Integer, "", "the vocabulary's size: a token id at or past it is a DataError"), 1),
      choice("out_dtype", d.dtype == DType::Int64 ? "int64" : "int32", {"int64", "int32"}, "the windows' dtype"),
      opt("raw", Kind::Flag, flag_text(d.raw), "one field of the window's seq_len + 1 tokens as stored"),
  };
}

std::map<std::string, DatasetSchema> make_schemas() {
  std::map<std::string, DatasetSchema> s;
  s["idx"] = {
      "IDX images and labels (the MNIST format, raw or .gz) as (image, label)",
      {required("images", Kind::Path, "the IDX images file"), required("labels", Kind::Path, "the IDX labels file"),
       opt("flip", Kind::Flag, "0", "random horizontal flip"),
       opt("float", Kind::Flag, "0", "float32 1x28x28 (implied by mean= or std=)"),
       opt("mean", Kind::Number, "", "normalize (implies float)"), opt("std", Kind::Number, "", "normalize (implies float)")}};
  s["npy"] = {"rows of a .npy array (memory-mapped) as (row,)", {required("path", Kind::Path, "the .npy file")}};
  s["image_folder"] = {"JPEG/PNG images in root/<class>/<image> as (image, label), labels by sorted class folder",
                       with({required("root", Kind::Path, "the folder of class folders")}, image_options())};
  const std::vector<DatasetOption> shards = {
      opt("dir", Kind::Path, "", "a folder of .tar shards (sorted); or shards="),
      opt("shards", Kind::Paths, "", "the shards, as a.tar:b.tar or brace patterns; or dir="),
  };
  s["tar_index"] = {
      "WebDataset shards (<key>.jpg + <key>.cls) indexed once, as a map-style dataset (shuffled across shards, "
      "resumable, GPU decode)",
      with(shards, image_options())};
  s["tar"] = {"WebDataset shards as a stream (read once, front to back; batches filled across the workers)",
              with(with(shards, {opt("shuffle", Kind::Flag, "1", "shuffle the shard order each epoch")}), image_options())};
  s["tokens"] = {
      "a flat token file (nanoGPT's raw .bin, llm.c's .bin, a 1-D .npy) as language-model sequences "
      "(input_ids, labels[, position_ids, cu_seqlens])",
      with({required("path", Kind::Path, "the token file"),
            choice("dtype", "", {"uint8", "int8", "int16", "uint16", "int32", "uint32", "int64"},
                   "a raw file's token type (a headed file's is read from its header)"),
            choice("format", "auto", {"auto", "raw", "llmc", "npy"}, "the file's format"),
            ranged(opt("eod", Kind::Integer, "", "the end-of-document token id (packed= needs it)"), 0)},
           sequence_options())};
  const TokenSequenceOptions d;
  s["megatron"] = {
      "a Megatron-LM indexed dataset (prefix.bin + prefix.idx) as language-model sequences",
      with({required("prefix", Kind::Path, "the path without .bin/.idx")},
           with(sequence_options(),
                {opt("shuffle_documents", Kind::Flag, flag_text(d.shuffle_documents),
                     "the documents in an order shuffled each epoch, within blocks"),
                 ranged(opt("document_block", Kind::Integer, std::to_string(d.document_block), "shuffle_documents' block"), 1),
                 ranged(opt("best_fit_group", Kind::Integer, std::to_string(d.best_fit_group),
                            "packed: documents placed whole by best fit in groups of this many sequences (0: off)"),
                        0)}))};
  const TableTokensOptions t;
  s["parquet"] = {
      "Parquet files of raw text, tokenized on the fly and cut into language-model windows (input_ids, labels); "
      "row groups read across the workers, as a stream",
      {opt("dir", Kind::Path, "", "a folder of .parquet files (sorted); or files="),
       opt("files", Kind::Paths, "", "the files, as a.parquet:b.parquet or brace patterns; or dir="),
       opt("text", Kind::Text, t.text, "the text column"),
       required("tokenizer", Kind::Path, "a tokenizer.json or a SentencePiece .model"),
       ranged(opt("seq_len", Kind::Integer, std::to_string(t.seq_len), "tokens a window (its labels shifted by one)"), 1,
              double(TokenSequenceOptions::kMaxSeqLen)),
       opt("bos", Kind::Text, "", "a token put before each row: its text (<s>) or its id"),
       opt("eos", Kind::Text, "", "a token put after each row: its text (<|endoftext|>) or its id"),
       opt("shuffle", Kind::Flag, flag_text(t.shuffle), "shuffle the row groups each epoch, and the rows within each read"),
       opt("packed", Kind::Flag, flag_text(t.packed), "windows with their rows' position_ids and cu_seqlens"),
       ranged(opt("rows_per_read", Kind::Integer, std::to_string(t.rows_per_read), "rows read (and shuffled) at a time"), 1,
              double(1 << 20))}};
  s["synthetic"] = {
      "in-memory patterns (sample i's bytes all i % 251, label i % 10), with injected faults",
      {ranged(opt("n", Kind::Integer, "10000", "samples"), 0), opt("shape", Kind::Text, "3x224x224", "each sample's shape"),
       choice("dtype", "uint8", {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"},
              "each sample's dtype"),
       ranged(opt("throw_rate", Kind::Number, "0", "the fraction of samples that throw"), 0, 1),
       ranged(opt("delay_rate", Kind::Number, "0", "the fraction of samples delayed"), 0, 1),
       ranged(opt("delay_ms", Kind::Integer, "0", "each delay"), 0), opt("fault_seed", Kind::Integer, "0", "the faults' seed")}};
  return s;
}

}  // namespace

const DatasetSchema& builtin_schema(const std::string& name) {
  static const std::map<std::string, DatasetSchema> schemas = make_schemas();
  auto it = schemas.find(name);
  if (it == schemas.end()) throw Error("no built-in dataset named '" + name + "'");
  return it->second;
}

}  // namespace ferry
