#include "ferry/detail/batch_feed.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "ferry/core/error.h"
#include "ferry/detail/io_counters.h"
#include "thread.h"

namespace ferry::detail {

namespace {
// How often a lane waiting for room moves its reader's reads sent ahead along (Sink::on_wait).
constexpr auto kWaitPoll = std::chrono::milliseconds(5);
}  // namespace

struct BatchFeed::Threads {
  std::vector<Thread> lanes;
};

bool BatchFeed::Sink::push(Box record) { return feed_.put(lane_, Item{std::move(record), nullptr, false, 0}, on_wait); }

bool BatchFeed::Sink::fail(std::exception_ptr error) {
  return feed_.put(lane_, Item{nullptr, std::move(error), false, 0}, on_wait);
}

BatchFeed::BatchFeed(Shape shape, ReadUnit read, std::shared_ptr<const std::atomic<bool>> given_up)
    : shape_(shape),
      read_(std::move(read)),
      given_up_(std::move(given_up)),
      lanes_(std::max<std::size_t>(1, std::min(shape.lanes, std::max<std::size_t>(shape.units, 1)))) {
  if (shape_.batch_size == 0) throw Error("BatchFeed: batch_size must be positive");
  if (shape_.first_position % shape_.batch_size != 0) throw Error("BatchFeed: first_position must be whole batches");
  position_ = shape_.first_position;
  first_batch_ = shape_.first_position / shape_.batch_size;
  ended_ = shape_.units == 0;
  threads_ = std::make_unique<Threads>();
  threads_->lanes.reserve(lanes_.size());
  for (std::size_t l = 0; l < lanes_.size() && l < shape_.units; ++l)
    threads_->lanes.emplace_back("ferry-feed", [this, l] { lane_main(l); });
}

BatchFeed::~BatchFeed() {
  {
    std::lock_guard l(mu_);
    stopping_ = true;
    stop_.store(true);
  }
  for (Lane& lane : lanes_) lane.space.notify_all();
  dealt_.notify_all();
  threads_.reset();  // joins
}

void BatchFeed::stop_with(std::shared_ptr<const std::atomic<bool>> given_up) {
  std::lock_guard l(mu_);
  if (also_owned_ || !given_up) return;
  also_owned_ = std::move(given_up);
  also_given_up_.store(also_owned_.get(), std::memory_order_release);
}

std::size_t BatchFeed::room(const Lane& lane) const { return lane.unit == unit_ ? 4 * shape_.lane_records : shape_.lane_records; }

bool BatchFeed::put(std::size_t lane, Item item, const std::function<bool()>& on_wait) {
  std::unique_lock l(mu_);
  Lane& ln = lanes_[lane];
  while (!stopping_ && !stopped() && ln.items.size() >= room(ln) && !item.end_of_unit) {
    if (on_wait) {
      ln.space.wait_for(l, kWaitPoll);
      if (stopping_ || stopped() || ln.items.size() < room(ln)) break;
      l.unlock();
      try {
        on_wait();
      } catch (...) {
        // the reader's next read meets the error and reports it
      }
      l.lock();
    } else {
      ln.space.wait_for(l, kWaitPoll);  // a wake-up now and then: the loader may give up meanwhile
    }
  }
  if (stopping_ || stopped()) return false;
  ln.items.push_back(std::move(item));
  if (waiting_ > 0) dealt_.notify_all();
  return true;
}

void BatchFeed::lane_main(std::size_t lane) {
  // The lane's object-store reads end when the loader gives up on the feed (Note [One batcher
  // across workers], its last paragraph); no counters: the workers count what they take.
  const ScopedIo io(
      nullptr, [](const void* feed) noexcept { return static_cast<const BatchFeed*>(feed)->stopped(); }, this);
  for (std::size_t u = lane; u < shape_.units && !stopped(); u += lanes_.size()) {
    {
      std::lock_guard l(mu_);
      lanes_[lane].unit = u;
    }
    Sink sink(*this, lane);
    std::exception_ptr failed;
    try {
      read_(u, sink);
    } catch (...) {
      failed = std::current_exception();
    }
    // Handed over outside the handler, so that the worker that takes it holds its only reference.
    if (failed && !sink.fail(std::move(failed))) return;
    if (!put(lane, Item{nullptr, nullptr, true, 0}, nullptr)) return;
  }
}

BatchFeed::Box BatchFeed::next(std::uint64_t batch, std::uint64_t& position) {
  const std::uint64_t B = shape_.batch_size;
  std::unique_lock l(mu_);
  bool dealt_other = false;
  for (;;) {
    if (const auto mine = batches_.find(batch); mine != batches_.end() && !mine->second.empty()) {
      Item it = std::move(mine->second.front());
      mine->second.pop_front();
      if (mine->second.empty()) batches_.erase(mine);
      if (dealt_other && waiting_ > 0) dealt_.notify_all();
      l.unlock();
      position = it.position;
      if (it.error) std::rethrow_exception(it.error);
      return std::move(it.record);
    }
    // Nothing of it waits: none left when its records have all been dealt (and taken), or the
    // epoch's records ended, or it comes before the resumed start.
    // Or the loader gave up on the epoch (stopped(): the lanes read no more).
    if (ended_ || stopping_ || stopped() || position_ >= (batch + 1) * B || batch < first_batch_) {
      if (dealt_other && waiting_ > 0) dealt_.notify_all();
      return nullptr;
    }
    Lane& ln = lanes_[unit_ % lanes_.size()];
    if (ln.items.empty()) {
      if (dealt_other) {
        dealt_.notify_all();
        dealt_other = false;
      }
      ++waiting_;
      dealt_.wait_for(l, kWaitPoll);  // a wake-up now and then: the loader may give up meanwhile
      --waiting_;
      continue;
    }
    Item it = std::move(ln.items.front());
    ln.items.pop_front();
    ln.space.notify_one();
    if (it.end_of_unit) {
      if (++unit_ == shape_.units) {
        ended_ = true;
        if (waiting_ > 0) dealt_.notify_all();  // a batch past the end waits no more
      }
      lanes_[unit_ % lanes_.size()].space.notify_one();  // its lane may read further now
      continue;
    }
    it.position = position_++;
    const std::uint64_t owner = it.position / B;
    if (owner < first_batch_) continue;  // before the resumed start
    batches_[owner].push_back(std::move(it));
    if (owner != batch) dealt_other = true;
  }
}

void BatchFeed::skip(std::size_t records) {
  const std::uint64_t batch = records / shape_.batch_size;
  std::lock_guard l(mu_);
  first_batch_ = batch;
  std::erase_if(batches_, [batch](const auto& entry) { return entry.first < batch; });
}

}  // namespace ferry::detail
