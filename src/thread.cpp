#include "thread.h"

#include <pthread.h>

#include <atomic>

#include "ferry/core/allocator.h"
#include "ferry/core/diagnostics.h"

namespace ferry {
namespace {
std::atomic<std::size_t> g_live_threads{0};
thread_local const std::atomic<bool>* t_stop_flag = nullptr;
}  // namespace

std::size_t live_threads() noexcept { return g_live_threads.load(); }

bool stop_requested() noexcept { return t_stop_flag && t_stop_flag->load(std::memory_order_relaxed); }

namespace detail {

StopScope::StopScope(const std::atomic<bool>* flag) noexcept : previous_(t_stop_flag) { t_stop_flag = flag; }
StopScope::~StopScope() { t_stop_flag = previous_; }

void name_this_thread(const std::string& name) noexcept { pthread_setname_np(pthread_self(), name.substr(0, 15).c_str()); }

Thread::Thread(std::string name, std::function<void()> body) {
  g_live_threads.fetch_add(1);
  try {
    t_ = std::thread([name = std::move(name), body = std::move(body)] {
      name_this_thread(name);
      struct Count {
        ~Count() { g_live_threads.fetch_sub(1); }
      } count;
      body();
    });
  } catch (...) {
    g_live_threads.fetch_sub(1);
    throw;
  }
}

Thread& Thread::operator=(Thread&& other) noexcept {
  if (this != &other) {
    join();
    t_ = std::move(other.t_);
  }
  return *this;
}

void Thread::join() noexcept {
  if (t_.joinable()) t_.join();
}

void Thread::detach() noexcept {
  if (t_.joinable()) t_.detach();
}

}  // namespace detail
}  // namespace ferry
