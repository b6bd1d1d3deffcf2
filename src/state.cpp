// LoaderState's text format: see include/ferry/core/state.h.
#include "ferry/core/state.h"

#include <array>
#include <charconv>
#include <cstdio>
#include <utility>

#include "ferry/core/error.h"

namespace ferry {

namespace {

constexpr std::string_view kMagic = "ferry.LoaderState";
constexpr std::size_t kMaxText = 1 << 16;

struct Field {
  const char* name;
  std::uint64_t LoaderState::*member;
  bool hex;
  bool optional = false;  // written only when not 0; 0 when missing (fields added within version 1)
};
constexpr std::array<Field, 16> kFields{{{"seed", &LoaderState::seed, false},
                                         {"epoch", &LoaderState::epoch, false},
                                         {"batches", &LoaderState::batches, false},
                                         {"batches_per_epoch", &LoaderState::batches_per_epoch, false},
                                         {"samples_per_epoch", &LoaderState::samples_per_epoch, false},
                                         {"dataset_size", &LoaderState::dataset_size, false},
                                         {"plan_hash", &LoaderState::plan_hash, true},
                                         {"world_size", &LoaderState::world_size, false},
                                         {"rank", &LoaderState::rank, false},
                                         {"segment_start", &LoaderState::segment_start, false},
                                         {"position", &LoaderState::position, false},
                                         {"batch_size", &LoaderState::batch_size, false},
                                         {"stream_workers", &LoaderState::stream_workers, false},
                                         {"cursor", &LoaderState::cursor, false, true},
                                         {"cursor_unit", &LoaderState::cursor_unit, false, true},
                                         {"cursor_offset", &LoaderState::cursor_offset, false, true}}};

[[noreturn]] void bad(std::size_t line, const std::string& what) {
  throw Error("LoaderState: line " + std::to_string(line) + ": " + what);
}

std::string shown(std::string_view s) {  // a field as it appears in an error: printable, short
  std::string out;
  for (char c : s.substr(0, 40)) out += (c >= 32 && c < 127) ? c : '?';
  return out + (s.size() > 40 ? "..." : "");
}

}  // namespace

std::string LoaderState::to_string() const {
  std::string out = std::string(kMagic) + " " + std::to_string(kFormatVersion) + "\n";
  for (const Field& f : kFields) {
    if (f.optional && this->*f.member == 0) continue;
    char value[32];
    if (f.hex)
      std::snprintf(value, sizeof value, "%016llx", static_cast<unsigned long long>(this->*f.member));
    else
      std::snprintf(value, sizeof value, "%llu", static_cast<unsigned long long>(this->*f.member));
    out += std::string(f.name) + " " + value + "\n";
  }
  return out;
}

LoaderState LoaderState::from_string(std::string_view text) {
  if (text.size() > kMaxText)
    throw Error("LoaderState: " + std::to_string(text.size()) + " bytes is not a loader state (at most " +
                std::to_string(kMaxText) + ")");
  LoaderState s;
  std::array<bool, kFields.size()> seen{};
  std::size_t line_no = 0, pos = 0;
  bool header = false;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const std::size_t space = line.find(' ');
    if (space == std::string_view::npos || space == 0 || space + 1 >= line.size())
      bad(line_no, "expected 'key value', got '" + shown(line) + "'");
    const std::string_view key = line.substr(0, space), value = line.substr(space + 1);
    if (!header) {
      if (key != kMagic) bad(line_no, "not a ferry loader state (it starts with '" + shown(line) + "')");
      if (value != std::to_string(kFormatVersion))
        bad(line_no, "format version '" + shown(value) + "'; this ferry reads version " + std::to_string(kFormatVersion));
      header = true;
      continue;
    }
    std::size_t k = 0;
    while (k < kFields.size() && key != kFields[k].name) ++k;
    if (k == kFields.size()) continue;  // a later version's field
    if (seen[k]) bad(line_no, "'" + std::string(key) + "' appears twice");
    std::uint64_t v = 0;
    const auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v, kFields[k].hex ? 16 : 10);
    if (ec != std::errc() || ptr != value.data() + value.size())
      bad(line_no, "'" + std::string(key) + "' must be " + (kFields[k].hex ? "hexadecimal" : "a non-negative integer") +
                       ", got '" + shown(value) + "'");
    s.*kFields[k].member = v;
    seen[k] = true;
  }
  if (!header) throw Error("LoaderState: empty text, not a ferry loader state");
  for (std::size_t k = 0; k < kFields.size(); ++k)
    if (!seen[k] && !kFields[k].optional) throw Error(std::string("LoaderState: the field '") + kFields[k].name + "' is missing");
  if (s.cursor > 1) throw Error("LoaderState: cursor must be 0 or 1, got " + std::to_string(s.cursor));
  if (s.world_size && s.rank >= s.world_size)
    throw Error("LoaderState: rank " + std::to_string(s.rank) + " is not in [0, " + std::to_string(s.world_size) + ")");
  if (s.batches > s.batches_per_epoch && s.stream_workers == 0)
    throw Error("LoaderState: " + std::to_string(s.batches) + " batches received of an epoch of " +
                std::to_string(s.batches_per_epoch));
  return s;
}

}  // namespace ferry
