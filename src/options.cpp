#include <cstring>
#include <sstream>

#include "ferry/core/error.h"
#include "ferry/core/options.h"
#include "ferry/core/random.h"
#include "ferry/core/rows.h"
#include "ferry/detail/pass_math.h"
#include "text.h"

namespace ferry {

OnError parse_on_error(const std::string& text, const std::string& what) {
  if (text == "raise") return OnError::Raise;
  if (text == "skip") return OnError::Skip;
  if (text == "replace") return OnError::Replace;
  throw OptionError(what + " must be raise, skip or replace, got '" + text + "'");
}

Gather parse_gather(const std::string& text, const std::string& what) {
  if (text == "auto") return Gather::Auto;
  if (text == "host") return Gather::Host;
  if (text == "device") return Gather::Device;
  throw OptionError(what + " must be auto, host or device, got '" + text + "'");
}

}  // namespace ferry

namespace ferry::detail {

void validate_options(const DataLoaderOptions& o, bool streaming) {
  auto fail = [](const std::string& m) { throw OptionError("DataLoaderOptions: " + m); };
  if (o.batch_size == 0) fail("batch_size must be >= 1, got 0");
  if (o.num_workers < 0) fail("num_workers must be >= 0, got " + std::to_string(o.num_workers));
  if (o.prefetch_factor < 1) fail("prefetch_factor must be >= 1, got " + std::to_string(o.prefetch_factor));
  if (o.timeout.count() < 0) fail("timeout must be >= 0 ms, got " + std::to_string(o.timeout.count()));
  if (!(o.max_error_fraction >= 0 && o.max_error_fraction <= 1))
    fail("max_error_fraction must be in [0, 1], got " + shortest(o.max_error_fraction));
  if (o.io_retries < 0) fail("io_retries must be >= 0, got " + std::to_string(o.io_retries));
  if (o.io_retry_backoff.count() < 0) fail("io_retry_backoff must be >= 0 ms");
  if (o.persistent_workers && o.num_workers == 0) fail("persistent_workers=true needs num_workers > 0, got 0");
  if (o.intra_batch_threads < 1) fail("intra_batch_threads must be >= 1, got " + std::to_string(o.intra_batch_threads));
  if (o.sampler && o.shuffle) fail("sampler and shuffle=true are mutually exclusive (shuffle inside the sampler)");
  if (o.batch_sampler && (o.batch_size != 1 || o.shuffle || o.sampler || o.drop_last))
    fail("batch_sampler is mutually exclusive with batch_size, shuffle, sampler and drop_last");
  if (streaming && o.gather == Gather::Device)
    fail("gather=Device needs a map-style dataset of rows (TensorDataset, NpyDataset); an iterable dataset has none");
  if (streaming && (o.sampler || o.batch_sampler || o.shuffle))
    fail("an iterable dataset takes no sampler, batch_sampler or shuffle (it decides its own order)");
  if (o.pin_threads < 1) fail("pin_threads must be >= 1, got " + std::to_string(o.pin_threads));
  if (o.pin_depth < 1) fail("pin_depth must be >= 1, got " + std::to_string(o.pin_depth));
  if (o.pinned_memory_limit && *o.pinned_memory_limit == 0)
    fail("pinned_memory_limit must be > 0 bytes (leave it unset for a budget that fits the pipeline)");
  if (o.device && *o.device < 0)
    fail("device=" + std::to_string(*o.device) + " is not a CUDA device index; leave device unset for batches on the host");
  if (o.device_prefetch < 1) fail("device_prefetch must be >= 1, got " + std::to_string(o.device_prefetch));
  if (o.gpu_decode_threads < 0)
    fail("gpu_decode_threads must be >= 0 (0: chosen from the hardware), got " + std::to_string(o.gpu_decode_threads));
  if (o.wait_poll_period.count() < 0) fail("wait_poll_period must be >= 0 ms");
}

DataLoaderOptions normalize_options(DataLoaderOptions o, bool streaming) {
  validate_options(o, streaming);
  if (o.device) o.pin_memory = true;  // a device batch is copied from pinned memory
  return o;
}

std::string describe_options(const DataLoaderOptions& o, bool streaming) {
  std::ostringstream os;
  os << "DataLoader: " << (streaming ? "iterable" : "map-style") << " dataset, batch_size=" << o.batch_size
     << " num_workers=" << o.num_workers << " prefetch_factor=" << o.prefetch_factor
     << " max_in_flight=" << static_cast<long>(o.prefetch_factor) * o.num_workers << " in_order=" << o.in_order
     << " round_robin=" << o.round_robin << " persistent_workers=" << o.persistent_workers << " timeout_ms=" << o.timeout.count()
     << " seed=" << o.seed << " intra_batch_threads=" << o.intra_batch_threads << " gather="
     << (o.gather == Gather::Auto   ? "auto"
         : o.gather == Gather::Host ? "host"
                                    : "device");
  return os.str();
}

Tensor gather_index(std::span<const std::size_t> indices, std::size_t n, BatchAllocator& allocator, const RowFlips& flips) {
  Tensor index = empty(DType::Int64, {static_cast<std::int64_t>(indices.size())}, allocator);
  std::int64_t* out = index.data<std::int64_t>();
  const std::size_t* in = indices.data();
  const std::size_t m = indices.size();
  // The range check first, four independent lanes (no branch a row), then the words: a plain
  // copy where no flip is drawn (size_t and int64 share their representation).
  std::size_t bad0 = 0, bad1 = 0, bad2 = 0, bad3 = 0, k = 0;
  for (; k + 4 <= m; k += 4) {
    bad0 |= static_cast<std::size_t>(in[k] >= n);
    bad1 |= static_cast<std::size_t>(in[k + 1] >= n);
    bad2 |= static_cast<std::size_t>(in[k + 2] >= n);
    bad3 |= static_cast<std::size_t>(in[k + 3] >= n);
  }
  for (; k < m; ++k) bad0 |= static_cast<std::size_t>(in[k] >= n);
  if (bad0 | bad1 | bad2 | bad3) {
    for (k = 0; k < m && in[k] < n; ++k) {
    }
    throw Error("device gather: index " + std::to_string(in[k]) + " out of range for a dataset of " + std::to_string(n) +
                " samples (at position " + std::to_string(k) + " of the batch)");
  }
  static_assert(sizeof(std::size_t) == sizeof(std::int64_t));
  if (m) std::memcpy(out, in, m * sizeof(std::int64_t));
  if (flips.p > 0)
    for (k = 0; k < m; ++k)
      if (Generator(flips.seed, flips.epoch, in[k]).bernoulli(flips.p)) out[k] |= kRowFlipBit;
  return index;
}

std::string row_transform_problem(const HostRows& r) {
  return r.transform ? row_transform_problem(*r.transform, r.dtype, r.row_bytes, r.name) : std::string();
}

std::string row_transform_problem(const RowTransform& t, DType dtype, std::size_t row_bytes, const std::string& name) {
  auto problem = [&](const std::string& what) { return name + "'s row transform: " + what; };
  if (dtype != DType::UInt8) return problem("its rows are " + std::string(dtype_name(dtype)) + ", not uint8 images");
  if (t.channels < 1 || t.channels > RowTransform::kMaxChannels || t.height < 1 || t.width < 1)
    return problem("an image of " + std::to_string(t.height) + "x" + std::to_string(t.width) + "x" + std::to_string(t.channels) +
                   " (1 to " + std::to_string(RowTransform::kMaxChannels) + " channels)");
  const std::int64_t elements = t.height * t.width * t.channels;
  if (static_cast<std::size_t>(elements) != row_bytes)
    return problem("an image of " + std::to_string(elements) + " bytes in rows of " + std::to_string(row_bytes));
  if (elements >= (std::int64_t{1} << 31)) return problem("an image of 2^31 bytes or more");
  if (t.dtype != DType::UInt8 && t.dtype != DType::Float32 && t.dtype != DType::Float16 && t.dtype != DType::BFloat16)
    return problem("it writes " + std::string(dtype_name(t.dtype)) + " (uint8, float32, float16 or bfloat16)");
  std::int64_t shaped = 1;
  for (std::int64_t d : t.shape) shaped *= d;
  if (shaped != elements) return problem("its shape does not hold the image's " + std::to_string(elements) + " values");
  if (!(t.flip_p >= 0 && t.flip_p <= 1)) return problem("a flip probability outside [0, 1]");
  return "";
}

std::size_t gathered_row_bytes(const HostRows& r) noexcept {
  if (r.window) return static_cast<std::size_t>(r.window->length) * itemsize(r.window->dtype);
  if (r.transform) return r.row_bytes * itemsize(r.transform->dtype);
  return r.row_bytes;
}

std::string row_window_problem(const HostRows& r) {
  if (!r.window) return "";
  if (r.transform) return r.name + "'s windows: a row transform and windows together";
  if (!r.window->start) return r.name + "'s windows: no start function";
  return row_window_problem(*r.window, r.dtype, r.row_bytes, r.rows, r.name);
}

std::string row_window_problem(const RowWindow& w, DType dtype, std::size_t row_bytes, std::int64_t elements,
                               const std::string& name) {
  auto problem = [&](const std::string& what) { return name + "'s windows: " + what; };
  auto integer = [](DType d) {
    return d == DType::UInt8 || d == DType::Int8 || d == DType::Int16 || d == DType::Int32 || d == DType::Int64;
  };
  if (!integer(dtype) || row_bytes != itemsize(dtype)) return problem("the array must be of integers, row_bytes one element's");
  if (!integer(w.dtype) || itemsize(w.dtype) < itemsize(dtype))
    return problem("they are written as " + std::string(dtype_name(w.dtype)) +
                   ", which must be an integer type at least as wide as the array's " + dtype_name(dtype));
  if (w.length < 1 || w.shift < 0 || w.length + w.shift > elements)
    return problem("a window of " + std::to_string(w.length) + " elements at shift " + std::to_string(w.shift) +
                   " in an array of " + std::to_string(elements));
  return "";
}

int pass_output_of(DType dtype) noexcept {
  switch (dtype) {
    case DType::Float32: return kPassFloat32;
    case DType::Float16: return kPassFloat16;
    case DType::BFloat16: return kPassBFloat16;
    default: return kPassUInt8;
  }
}

}  // namespace ferry::detail
