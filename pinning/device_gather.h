// pinning/device_gather.h — the device stage's gather (DeviceStage::gather_rows and
// gather_windows; Note [Device gather] in ferry/pinning/gather.h). Private to ferry_pinning.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "device_buffers.h"
#include "ferry/core/rows.h"
#include "ferry/core/tensor.h"
#include "ferry/pinning/cuda.h"
#include "ferry/pinning/device.h"
#include "ferry/pinning/fence.h"
#include "gather_kernel.h"

namespace ferry::detail {

/// A batch's gathers, placed in the batch's buffer as they are asked for and launched after its
/// copies, one kernel for the fields that share an index; or held, with other small batches', for
/// one launch (DeviceStage::end_held). Used by the stage's one thread.
class GatherStage {
 public:
  explicit GatherStage(int device) noexcept : device_(device) {}

  /// DeviceStage::gather_rows and gather_windows: check the arguments, place the output in the
  /// batch and return it.
  Tensor rows(DeviceBuffers& buffers, const Tensor& index, const void* src, std::size_t row_bytes, DType dtype,
              const Shape& row_shape, const RowTransform* t);
  Tensor windows(DeviceBuffers& buffers, const Tensor& index, const void* src, DType dtype, std::int64_t elements,
                 const RowWindow& w);
  bool pending() const noexcept { return !gathers_.empty(); }

  /// Launches the batch's gathers on `copy` (after its copies) and counts them; throws CudaError
  /// on a failed launch (those before it stay launched). The batch's gathers are forgotten either way.
  void launch(const cuda::Stream& copy, DeviceStageStats& counters);
  /// DeviceStage::end_held for a batch whose `bytes` are gathers alone: joins the held launch and
  /// forgets the batch's gathers, or false, nothing changed, when it cannot.
  bool hold(std::size_t bytes);
  /// Held batches so far.
  std::size_t held() const noexcept { return held_batches_; }
  /// Launches the held batches' gathers on `copy` as one kernel, counts them and returns how
  /// many batches it carried; the held launch is emptied however the launch goes (a failed one,
  /// CudaError, drops its batches).
  std::size_t launch_held(const cuda::Stream& copy, DeviceStageStats& counters);

  /// Before a gather launch: once kLaunchesAhead launches are queued on the copy stream, sleeps
  /// until kLaunchesLeft are (see the .cpp).
  void throttle();
  /// A gather launch's completion, for the throttle: `done`, or an event recorded on `copy` now.
  void mark_launch(std::shared_ptr<const EventFence> done) { launched_.push_back(std::move(done)); }
  void mark_launch(const cuda::Stream& copy);
  /// Forgets the batch's gathers (the batch aborted).
  void clear() noexcept { gathers_.clear(); }

 private:
  void check_index(const Tensor& index, const char* what) const;

  const int device_;
  // The batch's gathers, one launch for the fields that share an index.
  struct Pending {
    Tensor index;  // host (read at launch) or device
    GatherField field;
  };
  std::vector<Pending> gathers_;
  // Batches held (hold): their fields and host indices, for one launch at launch_held(). A held
  // launch writes at most kHeldLaunchBytes (24 batches of 256 rows of 784 float32 take 19.3 MB),
  // and carries twice the indices while every row fits a 32-bit index word (held_wide_ false).
  static constexpr std::size_t kHeldLaunchBytes = std::size_t{32} << 20;
  std::vector<GatherField> held_fields_;
  std::vector<std::int64_t> held_index_;
  std::size_t held_batches_ = 0, held_bytes_ = 0;
  bool held_wide_ = false;
  // Launches issued and maybe not finished, each one's fence (throttle): popped once waited for.
  std::deque<std::shared_ptr<const EventFence>> launched_;
  static constexpr std::size_t kLaunchesAhead = 4, kLaunchesLeft = 2;
};

}  // namespace ferry::detail
