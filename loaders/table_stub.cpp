// table_stub.cpp — ParquetFiles where ferry was built without Apache Arrow (FERRY_WITH_ARROW off,
// or Arrow's libraries not found): open() says so.
#include "ferry/core/error.h"
#include "ferry/loaders/table.h"

namespace ferry {

std::shared_ptr<const ParquetFiles> ParquetFiles::open(std::vector<std::string> paths, const ParquetOpenOptions&) {
  throw Error("ParquetFiles: ferry was built without Apache Arrow's C++ libraries (" +
              (paths.empty() ? std::string("no files") : paths.front()) +
              "); scripts/install-deps.sh installs them into /opt/ferry-arrow, where CMake finds them");
}

}  // namespace ferry
