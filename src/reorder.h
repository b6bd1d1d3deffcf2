// src/reorder.h — restores sequence order among results that complete out of order.
//
// A ring of `capacity` slots indexed by key % capacity. The engine dispatches key k only while
// k < next() + capacity, so every key that can arrive has a free slot; put() of a key outside
// [next(), next() + capacity) is a logic error and throws.
//
// Thread safety: none; owned by the consumer thread.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace ferry::detail {

template <class T>
class ReorderWindow {
 public:
  /// `start`: the first key the consumer waits for (a resumed epoch starts past 0).
  explicit ReorderWindow(std::size_t capacity, std::uint64_t start = 0) : slots_(capacity ? capacity : 1), next_(start) {}

  std::size_t capacity() const noexcept { return slots_.size(); }
  /// The key the consumer waits for.
  std::uint64_t next() const noexcept { return next_; }
  /// Number of results held.
  std::size_t held() const noexcept { return held_; }

  /// Stores the result for `key`.
  void put(std::uint64_t key, T value) {
    if (key < next_ || key >= next_ + slots_.size())
      throw std::logic_error("ReorderWindow: key " + std::to_string(key) + " outside [" + std::to_string(next_) + ", " +
                             std::to_string(next_ + slots_.size()) + ")");
    auto& slot = slots_[key % slots_.size()];
    if (slot) throw std::logic_error("ReorderWindow: key " + std::to_string(key) + " delivered twice");
    slot.emplace(std::move(value));
    ++held_;
  }
  /// True when the result for next() is present.
  bool ready() const noexcept { return slots_[next_ % slots_.size()].has_value(); }
  /// Takes the result for next() (which must be ready()) and advances.
  T take() {
    auto& slot = slots_[next_ % slots_.size()];
    T value = std::move(*slot);
    slot.reset();
    --held_;
    ++next_;
    return value;
  }
  /// Advances past next() without a result (a key that will never come). Must not be ready().
  void skip() { ++next_; }

 private:
  std::vector<std::optional<T>> slots_;
  std::uint64_t next_ = 0;
  std::size_t held_ = 0;
};

}  // namespace ferry::detail
