// NUMA placement: see Note [NUMA placement] in include/ferry/detail/numa.h.
#include "ferry/detail/numa.h"

#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "ferry/core/error.h"

namespace ferry::detail {
namespace {

// From <linux/mempolicy.h>; spelled here so that no kernel header is needed.
constexpr int kMpolDefault = 0, kMpolPreferred = 1;
constexpr unsigned long kMpolFNode = 1, kMpolFAddr = 2;
constexpr unsigned long kMaskBits = 16 * 8 * sizeof(unsigned long);

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (!f || !std::getline(f, s)) return {};
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

long set_policy(int mode, const unsigned long* mask, unsigned long bits) { return syscall(SYS_set_mempolicy, mode, mask, bits); }

}  // namespace

std::vector<int> parse_cpu_list(std::string_view text) {
  std::vector<int> out;
  auto bad = [&](const char* what) {
    return Error("CPU list \"" + std::string(text) + "\": " + what + " (expected e.g. \"0-3,8,10-11\")");
  };
  std::size_t i = 0;
  auto number = [&]() -> long {
    if (i >= text.size() || !std::isdigit(static_cast<unsigned char>(text[i]))) throw bad("a CPU number is missing");
    long v = 0;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
      v = v * 10 + (text[i++] - '0');
      if (v > 1 << 20) throw bad("a CPU number is too large");
    }
    return v;
  };
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i == text.size()) return out;
  for (;;) {
    const long lo = number();
    long hi = lo;
    if (i < text.size() && text[i] == '-') {
      ++i;
      hi = number();
      if (hi < lo) throw bad("a range ends below its start");
    }
    for (long c = lo; c <= hi; ++c) out.push_back(static_cast<int>(c));
    if (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) {
      while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
      if (i != text.size()) throw bad("text after the list");
      break;
    }
    if (i == text.size()) break;
    if (text[i] != ',') throw bad("expected ',' or '-'");
    ++i;
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::vector<int> c = cpus;
  std::sort(c.begin(), c.end());
  c.erase(std::unique(c.begin(), c.end()), c.end());
  std::string s;
  for (std::size_t i = 0; i < c.size();) {
    std::size_t j = i;
    while (j + 1 < c.size() && c[j + 1] == c[j] + 1) ++j;
    if (!s.empty()) s += ',';
    s += std::to_string(c[i]);
    if (j > i) s += '-' + std::to_string(c[j]);
    i = j + 1;
  }
  return s;
}

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

std::string normalize_pci_address(std::string_view a) {
  unsigned domain = 0, bus = 0, dev = 0, fn = 0;
  const std::string s(a);
  for (char c : s)
    if (!std::isxdigit(static_cast<unsigned char>(c)) && c != ':' && c != '.') return {};
  int used = 0;
  if (std::sscanf(s.c_str(), "%x:%x:%x.%x%n", &domain, &bus, &dev, &fn, &used) != 4 || used != static_cast<int>(s.size()) ||
      bus > 0xff || dev > 0x1f || fn > 7)
    return {};
  char out[32];
  std::snprintf(out, sizeof out, "%04x:%02x:%02x.%x", domain & 0xffff, bus, dev, fn);
  return out;
}

Placement placement_for_pci(std::string_view address, const std::string& sysfs, std::vector<int> allowed) {
  Placement p;
  const std::string addr = normalize_pci_address(address);
  if (addr.empty()) {
    p.reason = "not placed: \"" + std::string(address) + "\" is not a PCI address";
    return p;
  }
  const std::string online = read_line(sysfs + "/devices/system/node/online");
  std::vector<int> nodes;
  try {
    nodes = parse_cpu_list(online);  // the same list syntax
  } catch (const Error&) {
  }
  if (nodes.size() <= 1) {
    p.reason = "not placed: the host has " + std::string(nodes.empty() ? "no NUMA information" : "one NUMA node");
    return p;
  }
  const std::string node_text = read_line(sysfs + "/bus/pci/devices/" + addr + "/numa_node");
  int node = -1;
  try {
    node = node_text.empty() ? -1 : std::stoi(node_text);
  } catch (...) {
  }
  if (node < 0) {
    p.reason = "not placed: the kernel does not know the NUMA node of PCI device " + addr;
    return p;
  }
  std::vector<int> cpus;
  try {
    cpus = parse_cpu_list(read_line(sysfs + "/devices/system/node/node" + std::to_string(node) + "/cpulist"));
  } catch (const Error&) {
  }
  if (allowed.empty()) allowed = allowed_cpus();
  std::vector<int> both;
  std::set_intersection(cpus.begin(), cpus.end(), allowed.begin(), allowed.end(), std::back_inserter(both));
  if (both.empty()) {
    p.reason = "not placed: none of node " + std::to_string(node) + "'s CPUs (" + format_cpu_list(cpus) +
               ") are allowed to this process (" + format_cpu_list(allowed) + ")";
    return p;
  }
  static std::atomic<std::uint64_t> next_id{1};
  p.id = next_id.fetch_add(1);
  p.node = node;
  p.cpus = std::move(both);
  p.reason = "PCI device " + addr + " is on NUMA node " + std::to_string(node) + ": threads on CPUs " + format_cpu_list(p.cpus) +
             ", memory preferred on node " + std::to_string(node);
  return p;
}

namespace {
thread_local std::uint64_t t_applied = 0;  // the placement this thread runs under (its id)
struct SavedThread {
  bool saved = false;
  cpu_set_t cpus;
  int mode = 0;
  unsigned long mask[16] = {};
};
thread_local SavedThread t_saved;

void bind(const Placement& p) noexcept {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : p.cpus)
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  if (p.node < static_cast<int>(kMaskBits)) {
    unsigned long mask[16] = {};
    mask[static_cast<std::size_t>(p.node) / (8 * sizeof(unsigned long))] |=
        1UL << (static_cast<std::size_t>(p.node) % (8 * sizeof(unsigned long)));
    set_policy(kMpolPreferred, mask, kMaskBits);
  }
  t_applied = p.id;
}
}  // namespace

void apply_placement(const Placement& p) noexcept {
  if (!p.placed() || t_applied == p.id) return;
  bind(p);
}

void enter_placement(const Placement& p) noexcept {
  if (!p.placed() || t_applied == p.id) return;
  if (!t_saved.saved) {
    CPU_ZERO(&t_saved.cpus);
    if (pthread_getaffinity_np(pthread_self(), sizeof t_saved.cpus, &t_saved.cpus) != 0) return;
    if (syscall(SYS_get_mempolicy, &t_saved.mode, t_saved.mask, kMaskBits, nullptr, 0UL) != 0) t_saved.mode = kMpolDefault;
    t_saved.saved = true;
  }
  bind(p);
}

void leave_placement() noexcept {
  if (!t_saved.saved) return;
  pthread_setaffinity_np(pthread_self(), sizeof t_saved.cpus, &t_saved.cpus);
  const bool dflt = t_saved.mode == kMpolDefault;
  if (set_policy(t_saved.mode, dflt ? nullptr : t_saved.mask, dflt ? 0 : kMaskBits) != 0) set_policy(kMpolDefault, nullptr, 0);
  t_saved.saved = false;
  t_applied = 0;
}

int page_node(const void* p) noexcept {
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0UL, const_cast<void*>(p), kMpolFNode | kMpolFAddr) != 0) return -1;
  return node;
}

ScopedMemoryNode::ScopedMemoryNode(int node) noexcept {
  if (node < 0 || node >= static_cast<int>(kMaskBits)) return;
  if (syscall(SYS_get_mempolicy, &mode_, mask_, kMaskBits, nullptr, 0UL) != 0) return;
  unsigned long mask[16] = {};
  mask[static_cast<std::size_t>(node) / (8 * sizeof(unsigned long))] |=
      1UL << (static_cast<std::size_t>(node) % (8 * sizeof(unsigned long)));
  active_ = set_policy(kMpolPreferred, mask, kMaskBits) == 0;
}

ScopedMemoryNode::~ScopedMemoryNode() {
  if (!active_) return;
  if (set_policy(mode_, mode_ == kMpolDefault ? nullptr : mask_, mode_ == kMpolDefault ? 0 : kMaskBits) != 0)
    set_policy(kMpolDefault, nullptr, 0);
}

}  // namespace ferry::detail
