// An iterable (stream) dataset sharded across workers, like a torch IterableDataset that splits
// its work with get_worker_info(): open(worker) is called once per worker and epoch, and each
// worker reads only its contiguous share (ferry::shard_range). The loader interleaves the workers'
// batches round-robin, so every record is delivered exactly once per epoch.
//
//   build/default/examples/iterable_sharded
#include <cstdio>
#include <vector>

#include "ferry/ferry.h"

namespace {

// Stands in for a log file or a table scan of 10,000 records: record r is the value r * r.
struct Records {
  std::size_t size() const { return 10000; }  // optional: lets loader.size() count batches

  struct Stream {
    std::size_t next_record, end;
    std::optional<std::int64_t> next() {
      if (next_record == end) return std::nullopt;
      const auto r = static_cast<std::int64_t>(next_record++);
      return r * r;
    }
  };
  Stream open(const ferry::WorkerInfo& worker) const {
    auto [begin, end] = ferry::shard_range(size(), worker.id, worker.num_workers);
    return Stream{begin, end};
  }
};

}  // namespace

int main() {
  ferry::DataLoaderOptions o;
  o.batch_size = 256;
  o.num_workers = 4;
  ferry::DataLoader loader(Records{}, o);
  std::vector<int> seen(10000, 0);
  std::size_t batches = 0;
  for (ferry::Tensor& batch : loader) {
    for (std::int64_t k = 0; k < batch.numel(); ++k) {
      const std::int64_t v = batch.item<std::int64_t>(k);
      std::int64_t r = 0;
      while (r * r < v) ++r;  // the record this value came from
      ++seen[static_cast<std::size_t>(r)];
    }
    ++batches;
  }
  std::size_t once = 0;
  for (int n : seen) once += n == 1;
  std::printf("%zu batches from 4 workers; %zu of 10000 records delivered exactly once\n", batches, once);
  return once == seen.size() ? 0 : 1;
}
