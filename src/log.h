// src/log.h — ferry's logger: a spdlog logger named "ferry", level from FERRY_LOG_LEVEL
// (trace, debug, info, warn, error, critical, off; default warn). ferry never touches the
// application's default logger. This is the only header that includes spdlog.
#pragma once

#include <spdlog/spdlog.h>

namespace ferry::detail {
spdlog::logger& logger();
}  // namespace ferry::detail
