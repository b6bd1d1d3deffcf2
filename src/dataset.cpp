#include "ferry/core/dataset.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "ferry/core/sampler.h"

namespace ferry {

std::pair<std::size_t, std::size_t> shard_range(std::size_t n, int id, int count) {
  if (count < 1 || id < 0 || id >= count)
    throw Error("shard_range: worker " + std::to_string(id) + " of " + std::to_string(count) + " is not valid");
  const auto c = static_cast<std::size_t>(count), i = static_cast<std::size_t>(id);
  const std::size_t base = n / c, extra = n % c;
  const std::size_t begin = i * base + std::min(i, extra);
  return {begin, begin + base + (i < extra ? 1 : 0)};
}

const char* stage_name(Stage stage) noexcept {
  switch (stage) {
    case Stage::Idle: return "idle";
    case Stage::Fetch: return "fetch";
    case Stage::Transform: return "transform";
    case Stage::Collate: return "collate";
    case Stage::WorkerInit: return "worker_init_fn";
    case Stage::Pin: return "pin";
    case Stage::Copy: return "copy";
  }
  return "?";
}

TensorDataset::TensorDataset(std::vector<Tensor> tensors) : tensors_(std::move(tensors)) {
  if (tensors_.empty()) throw Error("TensorDataset: needs at least one tensor");
  for (std::size_t k = 0; k < tensors_.size(); ++k) {
    const Tensor& t = tensors_[k];
    if (!t.defined() || t.dim() == 0)
      throw Error("TensorDataset: tensor " + std::to_string(k) + " must have at least one dimension, got " + t.str());
    if (!t.device().is_host()) throw Error("TensorDataset: tensor " + std::to_string(k) + " is not in host memory: " + t.str());
    if (t.size(0) != tensors_[0].size(0))
      throw Error("TensorDataset: tensor " + std::to_string(k) + " has " + std::to_string(t.size(0)) + " rows but tensor 0 has " +
                  std::to_string(tensors_[0].size(0)));
  }
  size_ = static_cast<std::size_t>(tensors_[0].size(0));
}

std::vector<Tensor> TensorDataset::get(std::size_t i) const {
  if (i >= size_) throw Error("TensorDataset: index " + std::to_string(i) + " out of range for size " + std::to_string(size_));
  std::vector<Tensor> out;
  out.reserve(tensors_.size());
  for (const Tensor& t : tensors_) out.push_back(t.select(static_cast<std::int64_t>(i)));
  return out;
}

std::vector<HostRows> TensorDataset::host_rows(std::string& why) const {
  (void)why;
  std::vector<HostRows> out;
  for (std::size_t k = 0; k < tensors_.size(); ++k) {
    const Tensor& t = tensors_[k];
    out.push_back({t.raw(), t.size(0), t.nbytes() / static_cast<std::size_t>(std::max<std::int64_t>(t.size(0), 1)), t.dtype(),
                   Shape(t.shape().begin() + 1, t.shape().end()), "TensorDataset's tensor " + std::to_string(k), false,
                   std::nullopt, std::nullopt});
  }
  return out;
}

std::vector<Tensor> TensorDataset::make_batch(std::size_t rows, BatchAllocator& allocator) const {
  std::vector<Tensor> out;
  out.reserve(tensors_.size());
  for (const Tensor& t : tensors_) {
    Shape s = t.shape();
    s[0] = static_cast<std::int64_t>(rows);
    out.push_back(empty(t.dtype(), std::move(s), allocator));
  }
  return out;
}

void TensorDataset::get_into(std::size_t i, std::vector<Tensor>& batch, std::size_t row, SampleContext&) const {
  if (i >= size_) throw Error("TensorDataset: index " + std::to_string(i) + " out of range for size " + std::to_string(size_));
  for (std::size_t k = 0; k < tensors_.size(); ++k) {
    const Tensor& src = tensors_[k];
    const std::size_t row_bytes = src.nbytes() / size_;  // no views: this runs once per sample
    if (row >= static_cast<std::size_t>(batch[k].size(0)) ||
        batch[k].nbytes() / static_cast<std::size_t>(batch[k].size(0)) != row_bytes)
      throw Error("TensorDataset::get_into: batch tensor " + std::to_string(k) + " (" + batch[k].str() + ") has no row " +
                  std::to_string(row) + " of " + std::to_string(row_bytes) + " bytes");
    std::memcpy(static_cast<std::byte*>(batch[k].raw()) + row * row_bytes,
                static_cast<const std::byte*>(src.raw()) + i * row_bytes, row_bytes);
  }
}

std::vector<std::vector<std::size_t>> random_split_indices(std::size_t n, std::span<const double> lengths, std::uint64_t seed) {
  if (lengths.empty()) throw Error("random_split: no lengths given");
  std::vector<std::size_t> counts;
  double sum = 0;
  for (double l : lengths) {
    if (!(l >= 0) || !std::isfinite(l)) throw Error("random_split: lengths must be finite and non-negative");
    sum += l;
  }
  const bool fractions = std::abs(sum - 1.0) < 1e-9 && sum <= 1.0 + 1e-9 && n != 1;
  if (fractions) {
    std::size_t assigned = 0;
    for (double f : lengths) {
      counts.push_back(static_cast<std::size_t>(std::floor(f * static_cast<double>(n))));
      assigned += counts.back();
    }
    for (std::size_t k = 0; assigned < n; k = (k + 1) % counts.size(), ++assigned) ++counts[k];
  } else {
    std::size_t total = 0;
    for (double l : lengths) {
      if (l != std::floor(l)) throw Error("random_split: lengths must be whole counts or fractions summing to 1");
      counts.push_back(static_cast<std::size_t>(l));
      total += counts.back();
    }
    if (total != n)
      throw Error("random_split: lengths sum to " + std::to_string(total) + " but the dataset has " + std::to_string(n) +
                  " samples");
  }
  const std::vector<std::size_t> perm = RandomSampler(n, seed).indices(0);
  std::vector<std::vector<std::size_t>> out;
  std::size_t pos = 0;
  for (std::size_t c : counts) {
    out.emplace_back(perm.begin() + static_cast<std::ptrdiff_t>(pos), perm.begin() + static_cast<std::ptrdiff_t>(pos + c));
    pos += c;
  }
  return out;
}

}  // namespace ferry
