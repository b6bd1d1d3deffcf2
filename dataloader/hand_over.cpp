// The consumer's end of a route with a device stage (hand_over.h; Note [Device stage]).
#include "hand_over.h"

#include <string>
#include <utility>

namespace ferry::detail {

void DeviceHandOver::clear() noexcept {
  queue_.clear();
  awaiting_ = Payload();
  end_ = false;
}

Payload DeviceHandOver::next_issued(std::int64_t batch) {
  if (!awaiting_) {
    awaiting_ = pin_.next();
    if (!awaiting_) return {};
  }
  if (const auto& copied = awaiting_.get<DeviceBatch>().copied)
    await_issued(*copied, batch);  // an interruption keeps it
  else if (fenced_) {
    awaiting_ = Payload();
    throw Error("DataLoader: a gathered batch reached the consumer without its fence");
  }
  Payload p = std::move(awaiting_);  // leaves `awaiting_` empty
  DeviceBatch& d = p.get<DeviceBatch>();
  if (d.copied) device_.deliver(*d.copied);  // rethrows a decode's error, at the batch's position
  return std::move(d.batch);
}

Payload DeviceHandOver::next_copied() {
  while (queue_.size() < static_cast<std::size_t>(prefetch_) && !end_) {
    Item item;
    try {
      Payload p = pin_.next();
      if (!p) {
        end_ = true;
        break;
      }
      PinContext ctx(device_);
      typed_.walk(p, ctx);
      item.copied = ctx.device_copy();
      item.batch = std::move(p);
    } catch (const Interrupted&) {
      if (queue_.empty()) throw;  // nothing to hand over yet; nothing taken
      break;                      // hand over the batch already issued
    } catch (...) {
      item.error = std::current_exception();
    }
    queue_.push_back(std::move(item));
  }
  if (queue_.empty()) return {};
  Item item = std::move(queue_.front());
  queue_.pop_front();
  if (item.error) std::rethrow_exception(item.error);
  if (item.copied) device_.deliver(*item.copied);  // order the consumer after this copy only
  return std::move(item.batch);
}

void DeviceHandOver::await_issued(const EventFence& copied, std::int64_t batch) {
  if (!poll_ && timeout_.count() == 0) return;  // deliver() waits, unbounded
  const std::chrono::microseconds limit = stage_timeout(timeout_);
  // Interrupted (the poll) propagates: the batch stays in `awaiting_` for the next call.
  if (wait_polled(poll_, limit, [&copied](std::chrono::microseconds slice) { return copied.wait_recorded(slice); })) return;
  TimeoutError error("DataLoader timed out after " +
                     std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(limit).count()) +
                     " ms waiting for the GPU decode of batch " + std::to_string(batch) +
                     ": a decode thread has not come back from nvJPEG (gpu_decode_threads = 1 avoids the known two-thread "
                     "stall; see DataLoaderOptions::gpu_decode_threads)");
  // The batch fails at its position (`awaiting_` left empty); the next call takes the next one.
  timed_out_.push_back(std::move(awaiting_));
  throw error;
}

}  // namespace ferry::detail
