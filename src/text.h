// src/text.h — numbers as messages show them.
#pragma once

#include <cstdio>
#include <string>

namespace ferry::detail {

/// A double as a person writes it (0.1, not std::to_string's 0.100000).
inline std::string shortest(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

}  // namespace ferry::detail
