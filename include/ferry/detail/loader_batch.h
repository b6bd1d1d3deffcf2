// ferry/detail/loader_batch.h — the batch type a DataLoader<Dataset, CollateFn> delivers, and
// whether the device gather can make it. Not for direct use (ferry/core/dataloader.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/collate/collate.h"
#include "ferry/core/dataset.h"
#include "ferry/core/options.h"
#include "ferry/core/rows.h"
#include "ferry/core/tensor.h"
#include "ferry/pinning/device.h"

namespace ferry::detail {
template <class D, class C, bool Streaming, bool Direct, bool Default>
struct LoaderBatch;
template <class D, class C, bool S>
struct LoaderBatch<D, C, S, true, true> {
  using type = std::decay_t<decltype(std::declval<const D&>().make_batch(std::size_t{}, std::declval<BatchAllocator&>()))>;
};
template <class D, class C, bool S>
struct LoaderBatch<D, C, S, false, true> {
  static_assert(Collatable<sample_t<D>>,
                "ferry: no collate rule for this dataset's sample type; specialize ferry::CollateFields<Sample> "
                "(see ferry/collate/collate.h) or pass a collate_fn");
  using type = typename Collate<sample_t<D>>::Batch;
};
template <class D, class C, bool S>
struct LoaderBatch<D, C, S, false, false> {
  using type = std::decay_t<std::invoke_result_t<C&, std::vector<sample_t<D>>&&>>;
};

/// Direct mode with on_error = Skip: a batch made for n rows keeps its first `rows`.
template <class B>
inline constexpr bool kTruncatable = std::is_same_v<B, Tensor> || std::is_same_v<B, std::vector<Tensor>> ||
                                     requires(B& b, std::size_t n) {
  b.truncate_rows(n);
};
template <class B>
void truncate_rows(B& b, std::size_t rows) {
  if constexpr (std::is_same_v<B, Tensor>) {
    b = b.narrow(0, static_cast<std::int64_t>(rows));
  } else if constexpr (std::is_same_v<B, std::vector<Tensor>>) {
    for (Tensor& t : b) t = t.narrow(0, static_cast<std::int64_t>(rows));
  } else if constexpr (requires { b.truncate_rows(rows); }) {
    b.truncate_rows(rows);
  } else {
    (void)b;
    (void)rows;
  }
}

/// Why the device gather cannot make this loader's batches ("" when it can; then `rows` holds the
/// dataset's fields). Registration, which may fail too, comes after (RowRegistration).
template <class Dataset, class Batch>
std::string gather_unavailable(const DataLoaderOptions& o, bool default_collate, const Dataset& ds, std::vector<HostRows>& rows) {
  if (o.gather == Gather::Host) return "gather = Host";
  if (!o.device) return "it needs DataLoaderOptions::device";
  if constexpr (!RowGatherDataset<Dataset>) {
    (void)default_collate;
    (void)ds;
    (void)rows;
    return "the dataset's samples are not rows of host arrays (it has no host_rows(); TensorDataset, NpyDataset and IdxDataset "
           "do)";
  } else {
    if (!default_collate) return "a collate_fn runs on the host";
    if (o.allocator) return "DataLoaderOptions::allocator is set (batches in your memory)";
    constexpr bool kTensor = std::is_same_v<Batch, Tensor>;
    if constexpr (!GatheredBatch<Batch>) {
      return "the dataset's batch type is neither a Tensor, a std::vector<Tensor> nor a FieldsBatch";
    } else {
      std::string why;
      rows = ds.host_rows(why);
      if (rows.empty()) return why.empty() ? std::string("the dataset has no rows to gather") : why;
      if (kTensor && rows.size() != 1)
        return "the dataset's batch is one Tensor but host_rows() gave " + std::to_string(rows.size()) + " fields";
      if constexpr (FieldsBatch<Batch>)
        if (rows.size() != Batch::kGatheredFields)
          return "the dataset's batch has " + std::to_string(Batch::kGatheredFields) + " fields but host_rows() gave " +
                 std::to_string(rows.size());
      int flipping = 0;
      std::size_t windows = 0;
      for (const HostRows& r : rows) {
        if (r.window) {
          if (std::string bad = row_window_problem(r); !bad.empty()) return bad;
          ++windows;
          continue;
        }
        if (r.rows != static_cast<std::int64_t>(ds.size()))
          return r.name + " has " + std::to_string(r.rows) + " rows for a dataset of " + std::to_string(ds.size()) + " samples";
        if (std::string bad = row_transform_problem(r); !bad.empty()) return bad;
        flipping += r.transform && r.transform->flip_p > 0;
      }
      // A batch's index words are rows or window starts, one kind for all its fields.
      if (windows && windows != rows.size()) return "the dataset's fields mix windows and rows";
      if (flipping > 1) return "more than one field's row transform flips (a sample draws one flip)";
      if (o.gather == Gather::Auto)
        for (const HostRows& r : rows)
          if (r.mapped_file)
            return r.name +
                   " is a memory-mapped file, which gather = Auto leaves to the host path (gather = Device "
                   "gathers it from a copy in page-locked memory: Note [Device gather])";
      if (!DeviceStage::can_gather()) return "this build of ferry has no gather kernel (CMake found no CUDA compiler)";
      return "";
    }
  }
}

}  // namespace ferry::detail
