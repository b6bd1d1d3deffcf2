// src/thread.h — a named thread that cannot be destroyed unjoined.
//
// std::thread terminates the process when destroyed joinable; ferry's Thread joins instead (and
// the owner is expected to have told it to stop first). Live threads are counted for
// ferry::live_threads(), which tests use to prove nothing leaks: a thread counts until its body
// returns, so a detached (abandoned) thread counts while it is still stuck.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <thread>

namespace ferry::detail {

/// Makes ferry::stop_requested() on this thread read `flag` for the scope's lifetime.
class StopScope {
 public:
  explicit StopScope(const std::atomic<bool>* flag) noexcept;
  ~StopScope();
  StopScope(const StopScope&) = delete;
  StopScope& operator=(const StopScope&) = delete;

 private:
  const std::atomic<bool>* previous_;
};

/// DataLoaderOptions::wait_poll is the consumer's: a thread of the loader's own that waits on the
/// engine (the pin thread) holds this for its lifetime, so WaitPoll::check() does nothing there and
/// the poll never turns into a batch's error (an Interrupted stored at that batch's position would
/// lose it).
class NoWaitPoll {
 public:
  NoWaitPoll() noexcept;
  ~NoWaitPoll();
  NoWaitPoll(const NoWaitPoll&) = delete;
  NoWaitPoll& operator=(const NoWaitPoll&) = delete;

 private:
  bool previous_;
};

/// Names the calling thread (15 characters at most are kept), as `ps -L`, `top -H`, debuggers and
/// profilers show it.
void name_this_thread(const std::string& name) noexcept;

class Thread {
 public:
  Thread() = default;
  Thread(std::string name, std::function<void()> body);
  Thread(Thread&&) noexcept = default;
  Thread& operator=(Thread&& other) noexcept;
  ~Thread() { join(); }
  void join() noexcept;
  /// Lets the thread run on unowned (an abandoned worker: Note [Abandoned workers]).
  void detach() noexcept;
  bool joinable() const noexcept { return t_.joinable(); }

 private:
  std::thread t_;
};

}  // namespace ferry::detail
