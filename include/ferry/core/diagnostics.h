// ferry/core/diagnostics.h — process-wide counters that show nothing leaks, and the log level.
//
// Thread safety: all functions may be called from any thread.
#pragma once

#include <cstddef>
#include <string_view>

namespace ferry {

/// Threads ferry has started and not yet joined (workers, pin threads), across all loaders.
std::size_t live_threads() noexcept;

/// Sets the level of ferry's "ferry" spdlog logger: "trace", "debug", "info", "warn", "error",
/// "critical" or "off" (ferry::Error otherwise). The FERRY_LOG_LEVEL environment variable sets the
/// initial level; the default is "warn".
void set_log_level(std::string_view level);

}  // namespace ferry
