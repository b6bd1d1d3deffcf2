// A minimal ustar writer for the benchmarks' shards (regular files only, names under 100 bytes).
#pragma once

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

namespace ferry::bench {

class TarWriter {
 public:
  explicit TarWriter(const std::string& path) : out_(path, std::ios::binary) {}
  /// Ends the archive with its two zero blocks.
  ~TarWriter() { out_.write(std::string(1024, '\0').data(), 1024); }
  void member(const std::string& name, const std::string& data) {
    char h[512] = {};
    std::snprintf(h, 100, "%s", name.c_str());
    std::snprintf(h + 100, 8, "%07o", 0644);
    std::snprintf(h + 108, 8, "%07o", 0);
    std::snprintf(h + 116, 8, "%07o", 0);
    std::snprintf(h + 124, 12, "%011llo", static_cast<unsigned long long>(data.size()));
    std::snprintf(h + 136, 12, "%011o", 0);
    h[156] = '0';
    std::memcpy(h + 257, "ustar", 6);
    std::memcpy(h + 263, "00", 2);
    std::memset(h + 148, ' ', 8);
    unsigned sum = 0;
    for (unsigned char c : h) sum += c;
    std::snprintf(h + 148, 8, "%06o", sum);
    out_.write(h, 512);
    out_.write(data.data(), static_cast<std::streamsize>(data.size()));
    const std::size_t pad = (512 - data.size() % 512) % 512;
    out_.write(std::string(pad, '\0').data(), static_cast<std::streamsize>(pad));
  }

 private:
  std::ofstream out_;
};

}  // namespace ferry::bench
