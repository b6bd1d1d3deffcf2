// Tests that each public name renamed keeps its old name as a deprecated alias (CHANGELOG.md): a
// program written against the old name still compiles, to the same entity, and the compiler says
// what to write instead (the CTest deprecated_aliases_warn checks the warning).
#include <type_traits>

#include "ferry/ferry.h"

static_assert(std::is_same_v<ferry::TarImageOptions, ferry::TarRecordDecodeOptions>);
[[maybe_unused]] static auto(*const old_make_tar)(const ferry::DatasetConfig&) = &ferry::make_tar_images;

int main() {
  ferry::TarImageOptions o;  // the old name, as a client wrote it
  o.channels = 1;
  return o.channels == 1 ? 0 : 1;
}
