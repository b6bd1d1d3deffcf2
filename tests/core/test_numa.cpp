// NUMA placement (Note [NUMA placement] in ferry/detail/numa.h): CPU lists, PCI addresses, the
// placement read from a fake sysfs tree, and binding a thread; no GPU or second node needed.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "ferry/detail/numa.h"
#include "ferry/ferry.h"

namespace fs = std::filesystem;
using ferry::detail::Placement;

namespace {

void write(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text << "\n";
}

// A sysfs tree: `online` nodes, each node's cpulist, one GPU at 0000:41:00.0 on `gpu_node`.
fs::path fake_sysfs(const std::string& name, const std::string& online, const std::vector<std::string>& cpulists,
                    const std::string& gpu_node) {
  const fs::path root = fs::temp_directory_path() / ("ferry-numa-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(root);
  write(root / "devices/system/node/online", online);
  for (std::size_t n = 0; n < cpulists.size(); ++n)
    write(root / ("devices/system/node/node" + std::to_string(n)) / "cpulist", cpulists[n]);
  write(root / "bus/pci/devices/0000:41:00.0/numa_node", gpu_node);
  return root;
}

}  // namespace

TEST_CASE("CPU lists parse and print as the kernel writes them", "[unit][numa]") {
  using ferry::detail::format_cpu_list;
  using ferry::detail::parse_cpu_list;
  CHECK(parse_cpu_list("0-3,8,10-11") == std::vector<int>{0, 1, 2, 3, 8, 10, 11});
  CHECK(parse_cpu_list("5\n") == std::vector<int>{5});
  CHECK(parse_cpu_list("").empty());
  CHECK(parse_cpu_list("3,1-2,2") == std::vector<int>{1, 2, 3});
  CHECK(format_cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11");
  CHECK(format_cpu_list({7}) == "7");
  CHECK(format_cpu_list({}) == "");
  for (const char* bad : {"a", "1-", "3-1", "1,,2", "1;2", "-1", "99999999"})
    CHECK_THROWS_WITH(parse_cpu_list(bad), Catch::Contains("CPU list \"" + std::string(bad) + "\""));
}

TEST_CASE("PCI addresses normalize to sysfs's form", "[unit][numa]") {
  using ferry::detail::normalize_pci_address;
  CHECK(normalize_pci_address("00000000:41:00.0") == "0000:41:00.0");
  CHECK(normalize_pci_address("0000:C1:00.0") == "0000:c1:00.0");
  CHECK(normalize_pci_address("0001:3b:1f.7") == "0001:3b:1f.7");
  CHECK(normalize_pci_address("41:00.0").empty());
  CHECK(normalize_pci_address("0000:41:00.0x").empty());
  CHECK(normalize_pci_address("").empty());
}

TEST_CASE("a device's placement is its node's CPUs that the process may use", "[unit][numa]") {
  using ferry::detail::placement_for_pci;
  const fs::path two = fake_sysfs("two", "0-1", {"0-1,4-5", "2-3,6-7"}, "1");
  Placement p = placement_for_pci("00000000:41:00.0", two.string(), {0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(p.placed());
  CHECK(p.node == 1);
  CHECK(p.cpus == std::vector<int>{2, 3, 6, 7});
  CHECK_THAT(p.reason, Catch::Contains("node 1") && Catch::Contains("2-3,6-7"));
  // A launcher bound the process to some CPUs: only those of the node.
  p = placement_for_pci("0000:41:00.0", two.string(), {3, 4});
  CHECK(p.cpus == std::vector<int>{3});
  // ... to none of the node's: nothing placed, and the reason names both sets.
  p = placement_for_pci("0000:41:00.0", two.string(), {0, 1});
  CHECK_FALSE(p.placed());
  CHECK_THAT(p.reason, Catch::Contains("none of node 1's CPUs (2-3,6-7)") && Catch::Contains("(0-1)"));
  // Two placements are told apart (apply_placement's once-per-thread test).
  CHECK(placement_for_pci("0000:41:00.0", two.string(), {2}).id != placement_for_pci("0000:41:00.0", two.string(), {2}).id);
  fs::remove_all(two);

  const fs::path one = fake_sysfs("one", "0", {"0-7"}, "0");
  p = placement_for_pci("0000:41:00.0", one.string(), {0, 1});
  CHECK_FALSE(p.placed());
  CHECK_THAT(p.reason, Catch::Contains("one NUMA node"));
  fs::remove_all(one);

  const fs::path unknown = fake_sysfs("unknown", "0-1", {"0-1", "2-3"}, "-1");
  p = placement_for_pci("0000:41:00.0", unknown.string(), {0, 1, 2, 3});
  CHECK_FALSE(p.placed());
  CHECK_THAT(p.reason, Catch::Contains("does not know the NUMA node of PCI device 0000:41:00.0"));
  // A device the tree does not have reads the same way; an address that is not one says so.
  CHECK_FALSE(placement_for_pci("0000:42:00.0", unknown.string(), {0}).placed());
  CHECK_THAT(placement_for_pci("gpu0", unknown.string(), {0}).reason, Catch::Contains("\"gpu0\" is not a PCI address"));
  fs::remove_all(unknown);

  CHECK_THAT(placement_for_pci("0000:41:00.0", "/nonexistent-sysfs", {0}).reason, Catch::Contains("no NUMA information"));
}

TEST_CASE("a placed thread runs on the placement's CPUs; a borrowed one gets its own back", "[unit][numa]") {
  const std::vector<int> all = ferry::detail::allowed_cpus();
  REQUIRE_FALSE(all.empty());
  Placement p;
  p.id = 424242;
  p.node = 0;
  p.cpus = {all.back()};
  std::vector<int> inside, after_leave, owned;
  int page = -2;
  std::thread([&] {
    ferry::detail::enter_placement(p);
    inside = ferry::detail::allowed_cpus();
    std::vector<char> buf(1 << 16, 1);  // touched under the node-0 preference
    page = ferry::detail::page_node(buf.data());
    ferry::detail::leave_placement();
    after_leave = ferry::detail::allowed_cpus();
    ferry::detail::apply_placement(p);  // a thread of ferry's own: for good
    owned = ferry::detail::allowed_cpus();
  }).join();
  CHECK(inside == std::vector<int>{all.back()});
  CHECK(after_leave == all);
  CHECK(owned == std::vector<int>{all.back()});
  CHECK((page == 0 || page == -1));  // node 0 where the kernel reports it
  // Not placed: nothing changes.
  std::vector<int> untouched;
  std::thread([&] {
    ferry::detail::apply_placement(Placement{});
    untouched = ferry::detail::allowed_cpus();
  }).join();
  CHECK(untouched == all);
}

TEST_CASE("a pool on a NUMA node allocates under that node's policy and restores the thread's", "[unit][numa]") {
  ferry::PinnedPoolOptions o;
  o.backend = ferry::pageable_backend_for_tests();
  o.limit_bytes = 1 << 22;
  o.numa_node = 0;
  ferry::PinnedPool pool(o);
  ferry::Storage s = pool.allocate(1 << 20);
  std::memset(s.data(), 1, s.nbytes());
  const int node = ferry::detail::page_node(s.data());
  CHECK((node == 0 || node == -1));
  // A loader without a device places nothing.
  ferry::DataLoaderOptions lo;
  lo.batch_size = 4;
  ferry::DataLoader loader(ferry::TensorDataset({ferry::Tensor::empty(ferry::DType::Float32, {8, 2})}), lo);
  for (auto& b : loader) (void)b;
  CHECK(loader.stats().numa_node == -1);
}
