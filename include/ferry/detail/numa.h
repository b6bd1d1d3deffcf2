// ferry/detail/numa.h — where a loader's threads and pinned pages sit (internal).
//
// Note [NUMA placement]
// On a host with more than one NUMA node, a GPU hangs off one node's PCIe root; pinned pages on
// the other node cross the socket link on every copy, and worker threads there fill remote
// memory. With DataLoaderOptions::numa_placement (on by default) a loader with a device:
//   * finds the device's node from its PCI address (/sys/bus/pci/devices/<addr>/numa_node);
//   * runs its workers, pin thread, pin-copy and intra-batch threads on that node's CPUs
//     (intersected with the CPUs the process may use: taskset, cgroups, a launcher's binding),
//     each with a preferred memory policy for the node, so what they allocate is local;
//   * allocates the pinned pool's blocks under that policy (cudaHostAlloc places and locks the
//     pages in the calling thread, so they land on the node; PinnedPoolOptions::numa_node).
// A one-node host, a device whose node the kernel does not know (-1), or an empty intersection
// places nothing, and the loader says why in its debug log and LoaderStats::numa_node = -1.
// Only system calls are used (no libnuma).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ferry::detail {

struct Placement {
  std::uint64_t id = 0;   ///< distinct for every placement made (apply_placement's once-per-thread test)
  int node = -1;          ///< NUMA node; -1: nothing placed
  std::vector<int> cpus;  ///< the CPUs the loader's threads run on (empty: not placed)
  std::string reason;     ///< why (or why not): "GPU 0000:41:00.0 is on node 1 (CPUs 16-31)"
  bool placed() const noexcept { return node >= 0 && !cpus.empty(); }
};

/// "0-3,8,10-11" -> {0,1,2,3,8,10,11}; throws ferry::Error naming the text when malformed.
std::vector<int> parse_cpu_list(std::string_view text);
/// The inverse, with ranges: {0,1,2,5} -> "0-2,5".
std::string format_cpu_list(const std::vector<int>& cpus);
/// The CPUs the calling thread may run on (sched_getaffinity).
std::vector<int> allowed_cpus();
/// Normalizes a PCI address ("00000000:41:00.0", "0000:41:00.0") to sysfs's "0000:41:00.0";
/// empty when it is not one.
std::string normalize_pci_address(std::string_view address);
/// Where a loader feeding the PCI device at `address` should run, read from `sysfs` (a root
/// holding bus/pci/devices and devices/system/node; tests pass a fake tree). `allowed`: the CPUs
/// the process may use (empty: allowed_cpus()).
Placement placement_for_pci(std::string_view address, const std::string& sysfs = "/sys", std::vector<int> allowed = {});
/// placement_for_pci of CUDA device `device` (defined in the pinning library; nothing without CUDA).
Placement placement_for_device(int device);
/// Binds the calling thread to p's CPUs and prefers p's node for its allocations; once per
/// thread and placement (later calls are free). Does nothing when !p.placed(); never throws.
void apply_placement(const Placement& p) noexcept;
/// For threads ferry does not own (TBB's, entering a loader's arena): applies p until
/// leave_placement() on the same thread, which restores the thread's CPUs and memory policy.
void enter_placement(const Placement& p) noexcept;
void leave_placement() noexcept;
/// The NUMA node holding the page at `p` (touched already), or -1 when unknown.
int page_node(const void* p) noexcept;

/// Prefers `node` for the calling thread's allocations for its lifetime, then restores the
/// thread's previous policy. node < 0: does nothing.
class ScopedMemoryNode {
 public:
  explicit ScopedMemoryNode(int node) noexcept;
  ~ScopedMemoryNode();
  ScopedMemoryNode(const ScopedMemoryNode&) = delete;
  ScopedMemoryNode& operator=(const ScopedMemoryNode&) = delete;

 private:
  bool active_ = false;
  int mode_ = 0;
  unsigned long mask_[16] = {};
};

}  // namespace ferry::detail
