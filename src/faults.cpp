// Fault policies and the fault injector: see ferry/core/faults.h.
#include "ferry/core/faults.h"

#include <cerrno>
#include <thread>

namespace ferry {

bool IoError::transient() const noexcept {
  return errno_ == EINTR || errno_ == EAGAIN || errno_ == EWOULDBLOCK || errno_ == EIO || errno_ == ETIMEDOUT;
}

const char* kind_name(SampleError::Kind kind) noexcept {
  switch (kind) {
    case SampleError::Kind::Data: return "data";
    case SampleError::Kind::Io: return "io";
    case SampleError::Kind::Timeout: return "timeout";
  }
  return "?";
}

std::string SampleError::describe() const {
  std::string s = (stream ? "stream position " : "sample ") + std::to_string(index) + " of " +
                  (stream ? "stream batch " : "batch ") + std::to_string(batch) + " (epoch " + std::to_string(epoch) +
                  ", worker " + std::to_string(worker) + ") ";
  if (action == Action::Replaced)
    s += replacement ? "replaced by sample " + std::to_string(*replacement) : "replaced by the next record";
  else
    s += "skipped";
  return s + " [" + kind_name(kind) + "]: " + message;
}

std::size_t replacement_position(std::uint64_t seed, std::uint64_t epoch, std::size_t index, unsigned t,
                                 std::size_t epoch_size) noexcept {
  if (epoch_size == 0) return 0;
  // A stream of its own under the seed (the sample generators use (seed, epoch, index)).
  Generator g(mix_seed(seed, 0x7265706c61636521ull), epoch, index);
  std::size_t pos = 0;
  for (unsigned k = 0; k <= t; ++k) pos = static_cast<std::size_t>(g.randint(epoch_size));
  return pos;
}

namespace detail {

Fault fault_for(const FaultOptions& o, std::uint64_t key) noexcept {
  for (std::size_t h : o.hang_indices)
    if (h == key) return Fault::Hang;
  const double u = Generator(mix_seed(o.seed, 0x6661756c74ull), key).uniform();
  double edge = o.throw_rate;
  if (u < edge) return Fault::Throw;
  if (u < (edge += o.transient_rate)) return Fault::Transient;
  if (u < (edge += o.delay_rate)) return Fault::Delay;
  if (u < (edge += o.hang_rate)) return Fault::Hang;
  return Fault::None;
}

Fault FaultState::fault(std::uint64_t key) const noexcept { return fault_for(opt, key); }

void FaultState::apply(std::uint64_t key, const char* what) {
  switch (fault(key)) {
    case Fault::None: return;
    case Fault::Throw:
      throw DataError(what, DataError::kNoOffset, "injected fault: sample " + std::to_string(key) + " is damaged");
    case Fault::Transient: {
      std::lock_guard lock(mu_);
      if (transient_seen_[key]++ < opt.transient_failures)
        throw IoError(what, DataError::kNoOffset, "injected transient I/O error on sample " + std::to_string(key), EIO);
      return;
    }
    case Fault::Delay: std::this_thread::sleep_for(opt.delay); return;
    case Fault::Hang: {
      std::unique_lock lock(mu_);
      ++hanging_;
      cv_.wait(lock, [&] { return released_; });
      --hanging_;
      return;
    }
  }
}

void FaultState::release() {
  std::lock_guard lock(mu_);
  released_ = true;
  cv_.notify_all();
}

std::size_t FaultState::hanging() const {
  std::lock_guard lock(mu_);
  return hanging_;
}

}  // namespace detail
}  // namespace ferry

// --- the loader's fault log (ferry/detail/fault_log.h) ------------------------------------------

#include <system_error>

#include "ferry/detail/fault_log.h"
#include "text.h"

namespace ferry::detail {

void FaultLog::begin_epoch(std::uint64_t epoch, std::size_t samples) {
  std::lock_guard lock(mu_);
  epoch_ = epoch;
  epoch_samples_ = samples;
  for (auto it = tallies_.begin(); it != tallies_.end();) it = it->first == epoch ? std::next(it) : tallies_.erase(it);
}

void FaultLog::report(const SampleError& e) {
  std::lock_guard lock(mu_);
  Tally& tally = tallies_[e.epoch];
  if (!e.stream && !tally.reported.emplace(e.batch, e.index).second) return;
  (e.action == SampleError::Action::Replaced ? counts_.replaced : counts_.skipped) += 1;
  switch (e.kind) {
    case SampleError::Kind::Data: ++counts_.data; break;
    case SampleError::Kind::Io: ++counts_.io; break;
    case SampleError::Kind::Timeout: ++counts_.timeout; break;
  }
  if (first_.size() < kFirst) first_.push_back(e.describe());
  const std::size_t errors = ++tally.errors;
  if (callback_) callback_(e);
  const bool over_count = limits_.max_errors > 0 && errors > limits_.max_errors;
  const bool over_fraction = limits_.max_error_fraction > 0 && epoch_samples_ > 0 &&
                             static_cast<double>(errors) > limits_.max_error_fraction * static_cast<double>(epoch_samples_);
  if (over_count || over_fraction) {
    std::string m = "DataLoader: " + std::to_string(errors) + " bad samples in epoch " + std::to_string(e.epoch) + " exceed ";
    if (over_count)
      m += "max_errors=" + std::to_string(limits_.max_errors);
    else
      m +=
          "max_error_fraction=" + shortest(limits_.max_error_fraction) + " of its " + std::to_string(epoch_samples_) + " samples";
    throw Error(m + "; the last: " + e.describe());
  }
}

bool FaultLog::is_stuck(std::size_t index) const {
  if (!any_stuck_.load(std::memory_order_relaxed)) return false;
  std::lock_guard lock(mu_);
  return stuck_.count(index) != 0;
}

void FaultLog::mark_stuck(std::size_t index) {
  std::lock_guard lock(mu_);
  stuck_.insert(index);
  any_stuck_.store(true, std::memory_order_relaxed);
}

FaultCounts FaultLog::counts() const {
  std::lock_guard lock(mu_);
  FaultCounts c = counts_;
  c.retries = retries_.load(std::memory_order_relaxed);
  return c;
}

std::vector<std::string> FaultLog::first_errors() const {
  std::lock_guard lock(mu_);
  return first_;
}

bool is_transient(const std::exception_ptr& e) noexcept {
  try {
    std::rethrow_exception(e);
  } catch (const IoError& io) {
    return io.transient();
  } catch (const std::system_error& se) {
    const int c = se.code().value();
    return se.code().category() == std::generic_category() || se.code().category() == std::system_category()
               ? (c == EINTR || c == EAGAIN || c == EWOULDBLOCK || c == EIO || c == ETIMEDOUT)
               : false;
  } catch (...) {
  }
  return false;
}

bool is_io_error(const std::exception_ptr& e) noexcept {
  try {
    std::rethrow_exception(e);
  } catch (const IoError&) {
    return true;
  } catch (const std::system_error&) {
    return true;
  } catch (...) {
  }
  return false;
}

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
  }
  return "an exception of unknown type";
}

}  // namespace ferry::detail
