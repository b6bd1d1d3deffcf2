// Tests that .npy files map into tensors of the right dtype and shape, that unsupported or damaged
// files are DataErrors naming the file, and that NpyDataset's rows reach the loader intact.
#include <catch2/catch.hpp>

#include "ferry/ferry.h"
#include "files.h"

using namespace ferry;
using namespace ferry::test;

TEST_CASE(".npy files of the common dtypes read as mapped tensors", "[unit][npy]") {
  TempDir dir;
  std::vector<float> f(15);
  for (std::size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(i) * 0.5f;
  write_file(dir / "f.npy", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (5, 3), }", raw_bytes(f)));
  Tensor t = read_npy(dir / "f.npy");
  CHECK(t.dtype() == DType::Float32);
  CHECK(t.shape() == Shape{5, 3});
  CHECK(t.item<float>(7) == 3.5f);
  write_file(dir / "v2.npy", npy_bytes("{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }",
                                       raw_bytes(std::vector<std::int64_t>{-1, 1LL << 40}), 2));
  Tensor v2 = read_npy(dir / "v2.npy");
  CHECK(v2.shape() == Shape{2});
  CHECK(v2.item<std::int64_t>(1) == (1LL << 40));
  struct D {
    const char* descr;
    DType dtype;
  };
  for (D d : {D{"|b1", DType::Bool}, D{"|u1", DType::UInt8}, D{"|i1", DType::Int8}, D{"<i2", DType::Int16},
              D{"<i4", DType::Int32}, D{"<f2", DType::Float16}, D{"<f8", DType::Float64}}) {
    INFO(d.descr);
    Bytes data(itemsize(d.dtype) * 4);
    Tensor x =
        parse_npy(npy_bytes(std::string("{'descr': '") + d.descr + "', 'fortran_order': False, 'shape': (4,), }", data), "mem");
    CHECK(x.dtype() == d.dtype);
  }
  Tensor scalar =
      parse_npy(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (), }", raw_bytes(std::vector<float>{2.f})), "mem");
  CHECK(scalar.dim() == 0);
  CHECK_THROWS_WITH(NpyDataset(scalar), Catch::Contains("at least one dimension"));
}

TEST_CASE("unsupported and damaged .npy files are DataErrors naming the file", "[errors][npy]") {
  TempDir dir;
  const Bytes four(16);
  struct Case {
    const char* name;
    Bytes bytes;
    const char* message;
  };
  Bytes truncated = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", four);
  truncated.resize(truncated.size() - 3);
  std::vector<Case> cases{
      {"big", npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }", four), "big-endian"},
      {"fortran", npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", four), "Fortran-order"},
      {"struct", npy_bytes("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (4,), }", four), "structured"},
      {"object", npy_bytes("{'descr': '|O', 'fortran_order': False, 'shape': (4,), }", four), "unsupported dtype"},
      {"complex", npy_bytes("{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }", four), "unsupported dtype"},
      {"truncated", truncated, "(truncated)"},
      {"trailing", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", four), "(trailing bytes)"},
      {"magic", bytes_of("not a numpy file at all"), "not a .npy file"},
      {"syntax", npy_bytes("{'descr' '<f4', 'fortran_order': False, 'shape': (4,), }", four), "expected ':'"},
      {"missing", npy_bytes("{'descr': '<f4', 'shape': (4,), }", four), "missing one of"},
      {"version",
       [] {
         Bytes b = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", Bytes(16));
         b[6] = std::byte{9};
         return b;
       }(),
       "format version 9"},
      {"header-len",
       [] {
         Bytes b = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", Bytes(16));
         b[8] = std::byte{0xff};
         b[9] = std::byte{0xff};
         return b;
       }(),
       "truncated .npy header"},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    write_file(dir / c.name, c.bytes);
    CHECK_THROWS_MATCHES(read_npy(dir / c.name), DataError,
                         Catch::Matchers::Predicate<DataError>(
                             [&](const DataError& e) {
                               return std::string(e.what()).find(dir / c.name) != std::string::npos &&
                                      std::string(e.what()).find(c.message) != std::string::npos;
                             },
                             c.message));
  }
}

TEST_CASE("NpyDataset rows reach the loader intact, in direct mode", "[loader][npy]") {
  TempDir dir;
  std::vector<std::int32_t> v(40 * 3);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::int32_t>(i);
  write_file(dir / "x.npy", npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (40, 3), }", raw_bytes(v)));
  NpyDataset ds(dir / "x.npy");
  CHECK(ds.size() == 40);
  DataLoaderOptions o;
  o.batch_size = 16;
  o.num_workers = 2;
  o.shuffle = true;
  std::int64_t total = 0, rows = 0;
  for (Tensor& b : DataLoader(ds, o)) {
    for (std::int64_t r = 0; r < b.size(0); ++r) {
      const std::int32_t* row = b.data<std::int32_t>() + r * 3;
      CHECK(row[1] == row[0] + 1);
      CHECK(row[0] % 3 == 0);
      total += row[0] / 3;
      ++rows;
    }
  }
  CHECK(rows == 40);
  CHECK(total == 40 * 39 / 2);
}
