#include "log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

#include "ferry/core/diagnostics.h"
#include "ferry/core/error.h"
#include "ferry/detail/engine.h"

namespace ferry {
namespace detail {

spdlog::logger& logger() {
  // A logger of our own, never registered as the default: the application's logging is its own.
  static std::shared_ptr<spdlog::logger> log = [] {
    auto existing = spdlog::get("ferry");
    if (existing) return existing;
    auto l = std::make_shared<spdlog::logger>("ferry", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    l->set_level(spdlog::level::warn);
    if (const char* env = std::getenv("FERRY_LOG_LEVEL")) {
      auto level = spdlog::level::from_str(env);
      // from_str maps unknown names to "off"; only accept "off" when it was asked for.
      if (level != spdlog::level::off || std::string(env) == "off")
        l->set_level(level);
      else
        l->warn("FERRY_LOG_LEVEL='{}' is not a level (trace, debug, info, warn, error, critical, off)", env);
    }
    return l;
  }();
  return *log;
}

void warn_once(const char* key, const std::string& message) {
  static std::mutex mu;
  static std::set<std::string> seen;  // guarded by mu
  {
    std::lock_guard lock(mu);
    if (!seen.insert(key).second) return;
  }
  logger().warn("{}", message);
}

void log_debug(const std::string& message) { logger().debug("{}", message); }
void log_info(const std::string& message) { logger().info("{}", message); }

}  // namespace detail

void set_log_level(std::string_view level) {
  const std::string s(level);
  auto l = spdlog::level::from_str(s);
  if (l == spdlog::level::off && s != "off")
    throw Error("set_log_level: '" + s + "' is not one of trace, debug, info, warn, error, critical, off");
  detail::logger().set_level(l);
}

}  // namespace ferry
