// table_open.cpp — ParquetFiles::open: Arrow's reader lives in the module libferry_parquet.so
// beside this library (loaders/CMakeLists.txt says why), loaded here on the first call.
#include <dlfcn.h>

#include <filesystem>
#include <mutex>

#include "ferry/core/error.h"
#include "ferry/loaders/table.h"

namespace ferry {
namespace {

using OpenFn = void (*)(std::vector<std::string>*, const ParquetOpenOptions*, std::shared_ptr<const ParquetFiles>*);

// The module's entry, or the reason it is not there.
OpenFn parquet_module(std::string& why) {
  static std::once_flag once;
  static OpenFn fn = nullptr;
  static std::string reason;
  std::call_once(once, [] {
    Dl_info info{};
    if (!::dladdr(reinterpret_cast<void*>(&parquet_module), &info) || !info.dli_fname) {
      reason = "cannot find where libferry_loaders is";
      return;
    }
    const std::string path = (std::filesystem::path(info.dli_fname).parent_path() / "libferry_parquet.so").string();
    if (!std::filesystem::exists(path)) {
      reason = "ferry was built without Apache Arrow's C++ libraries (no " + path +
               "); scripts/install-deps.sh installs them into /opt/ferry-arrow, where CMake finds them";
      return;
    }
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (!handle) {
      const char* e = ::dlerror();
      reason = "cannot load " + path + ": " + (e ? e : "unknown error");
      return;
    }
    fn = reinterpret_cast<OpenFn>(::dlsym(handle, "ferry_parquet_open"));
    if (!fn) reason = path + " has no ferry_parquet_open";
  });
  why = reason;
  return fn;
}

}  // namespace

std::shared_ptr<const ParquetFiles> ParquetFiles::open(std::vector<std::string> paths, const ParquetOpenOptions& options) {
  if (paths.empty()) throw Error("ParquetFiles: no files given");
  std::string why;
  const OpenFn fn = parquet_module(why);
  if (!fn) throw Error("ParquetFiles (" + paths.front() + "): " + why);
  std::shared_ptr<const ParquetFiles> out;
  fn(&paths, &options, &out);
  return out;
}

}  // namespace ferry
