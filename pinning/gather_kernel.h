// pinning/gather_kernel.h — the device gather's kernel (Note [Device gather], ferry/pinning/gather.h).
// Private to ferry_pinning; built where CMake finds nvcc (gather.cu), else a stub (gather_none.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ferry::detail {

/// Fields one launch gathers at most (several batches' fields when a launch carries several).
constexpr int kMaxGatherFields = 32;
/// Rows whose indices travel in the launch's own parameters (CUDA takes 32 KB of them on Volta
/// and later): no copy of the index, no pinned block to fence. A batch's, and a launch's where
/// an index's row needs more than 31 bits.
constexpr std::int64_t kGatherIndexInLaunch = 3072;
/// A launch's rows where every row fits 31 bits: the indices then travel as 32-bit words (the
/// row, and the flip in the top bit), twice as many in the same parameters.
constexpr std::int64_t kGatherNarrowIndexInLaunch = 6144;
/// The largest row a 32-bit index word holds.
constexpr std::int64_t kGatherNarrowRowMax = (std::int64_t{1} << 31) - 1;

/// Set in a row's index: the sample draws a flip (fields with `flip` mirror that row). The rest
/// of the word is the row.
constexpr std::int64_t kGatherFlipBit = std::int64_t{1} << 62;

/// Whether every row of `n` index words fits a 32-bit index word (at most kGatherNarrowRowMax).
inline bool narrow_rows(const std::int64_t* index, std::int64_t n) noexcept {
  std::uint64_t rows = 0;
  for (std::int64_t i = 0; i < n; ++i) rows |= static_cast<std::uint64_t>(index[i] & ~kGatherFlipBit);
  return rows <= static_cast<std::uint64_t>(kGatherNarrowRowMax);
}

struct GatherField {
  const void* src = nullptr;  ///< a device-mapped host address: row 0 of the array
  void* dst = nullptr;        ///< device memory: row 0 of the batch's field
  std::size_t row_bytes = 0;  ///< a source row's bytes
  std::int64_t rows = 0;      ///< the field's rows: its batch's
  /// Where the field's indices are: device memory (its batch's index moved to the device), or,
  /// when null, the launch's own host indices from `index_offset` on.
  const std::int64_t* index_dev = nullptr;
  std::int64_t index_offset = 0;
  /// The row transform (ferry::RowTransform, pass_math.h's row_out_index and pass_store): source
  /// rows are uint8 HWC images of height x width x channels, written as `out_kind` (PassOutput)
  /// into rows of `out_row_bytes`. out_kind < 0: rows are copied as they are.
  int out_kind = -1;
  int chw = 0, flip = 0;
  std::int64_t height = 0, width = 0, channels = 1;
  std::size_t out_row_bytes = 0;
  float a[4] = {1, 1, 1, 1}, b[4] = {0, 0, 0, 0};
  /// Windows (ferry::RowWindow): > 0, row i is `window` elements of `row_bytes` (1, 2, 4 or 8)
  /// each from element index[i] + `shift` of src, written as integers of `out_elem_bytes` (1, 2,
  /// 4 or 8, at least row_bytes), sign-extended where `src_signed`. out_kind and the transform are
  /// unused.
  std::int64_t window = 0, shift = 0;
  int out_elem_bytes = 8;
  int src_signed = 1;
};

/// Whether this build has the gather kernel.
bool gather_built() noexcept;
/// On `stream` (a cudaStream_t), one kernel: for each field, dst row i = src row index[i] &
/// ~kGatherFlipBit, i < field.rows (transformed where the field says so), index being the field's
/// index_dev, or `host_index` + field.index_offset when index_dev is null. `host_index` (host
/// memory, read at the call) travels in the launch's parameters: host_rows <=
/// kGatherNarrowIndexInLaunch where every row is at most kGatherNarrowRowMax, else <=
/// kGatherIndexInLaunch. Throws CudaError on a failed launch.
void launch_gather(const std::int64_t* host_index, std::int64_t host_rows, const GatherField* fields, int nfields, void* stream);

}  // namespace ferry::detail
