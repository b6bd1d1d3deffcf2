// Tests that datasets are created by name from "key=value" options with clear errors for typos,
// and that a plugin library is loaded at run time, feeds the loader, and that a missing file, a
// missing entry point, a wrong ABI version and an unknown name are each a clear error.
#include <catch2/catch.hpp>

#include "ferry/ferry.h"
#include "files.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

using namespace ferry;
using namespace ferry::test;

TEST_CASE("options parse as key=value, and typos are errors", "[unit][registry]") {
  DatasetConfig c("demo", " n = 10, shape=3x4 ,,");
  CHECK(c.integer("n") == 10);
  CHECK(c.str("shape") == "3x4");
  CHECK(c.integer("missing", 5) == 5);
  c.finish();
  CHECK_THROWS_WITH(DatasetConfig("demo", "n"), Catch::Contains("option 'n' is not key=value"));
  CHECK_THROWS_WITH(DatasetConfig("demo", "n=1,n=2"), Catch::Contains("given twice"));
  CHECK_THROWS_WITH(DatasetConfig("demo", "=1"), Catch::Contains("empty key"));
  CHECK_THROWS_WITH(DatasetConfig("demo", "n=ten").integer("n"), Catch::Contains("'n' must be an integer, got 'ten'"));
  CHECK_THROWS_WITH(DatasetConfig("demo", "").str("root"), Catch::Contains("option 'root' is required"));
  // A backslash escapes ',', '=', ':' and itself: a value may hold any character.
  const DatasetConfig esc("demo", R"(path=a\,b\=c\:d\\e, list=x\:1:y::s3://b/z\:2, k\=ey=v)");
  CHECK(esc.str("path") == R"(a,b=c:d\e)");
  CHECK(esc.values().at("k=ey") == "v");
  CHECK(esc.items("list") == std::vector<std::string>{"x:1", "y", "s3://b/z:2"});
  CHECK_THROWS_WITH(DatasetConfig("demo", R"(path=a\)"), Catch::Contains("ends with a lone"));
  CHECK_THROWS_WITH(DatasetConfig("demo", "").items("list"), Catch::Contains("option 'list' is required"));
  DatasetConfig typo("demo", "n=1,sahpe=2");
  typo.integer("n");
  CHECK_THROWS_WITH(typo.finish(), Catch::Contains("unknown option 'sahpe' (it takes: n)"));
}

TEST_CASE("typed options are taken as they are, and read back as text", "[unit][registry]") {
  // What the Python package passes: each key's items, nothing escaped or split.
  const DatasetConfig::Values values{
      {"path", {R"(a,b=c:d\e)"}}, {"shards", {"s3://b/2024-01-01T00:00:00.tar", "s3://b/year=2024/x,y.tar"}}, {"n", {"10"}}};
  const DatasetConfig c("demo", values);
  CHECK(c.str("path") == R"(a,b=c:d\e)");
  CHECK(c.items("shards") == values.at("shards"));
  CHECK(c.integer("n") == 10);
  CHECK(c.items("path") == std::vector<std::string>{R"(a,b=c:d\e)"});  // a scalar is a list of one
  c.finish();
  CHECK_THROWS_WITH(c.str("shards"), Catch::Contains("option 'shards' takes one value, got a list of 2"));
  // text() escapes what the text form would split: the same options read back.
  const DatasetConfig again("demo", c.text());
  CHECK(again.str("path") == c.str("path"));
  CHECK(again.items("shards") == values.at("shards"));
  CHECK(again.integer("n") == 10);
  // A text value keeps its ':' through text() (str() reads it whole).
  const DatasetConfig text("demo", R"(root=s3://b/x\:y)");
  CHECK(DatasetConfig("demo", text.text()).str("root") == "s3://b/x:y");
  CHECK_THROWS_WITH(DatasetConfig("demo", DatasetConfig::Values{{"", {"1"}}}), Catch::Contains("empty key"));
  // The registry opens a dataset from typed options as from text.
  auto& reg = DatasetRegistry::global();
  const DynamicDataset ramp = reg.create(DatasetConfig("synthetic", DatasetConfig::Values{{"n", {"7"}}}));
  CHECK(ramp.size() == 7);
  CHECK_THROWS_WITH(reg.create(DatasetConfig("synthetic", DatasetConfig::Values{{"nn", {"7"}}})),
                    Catch::Contains("unknown option 'nn'"));
}

TEST_CASE("every built-in option is declared once, in its dataset's schema", "[unit][registry]") {
  auto& reg = DatasetRegistry::global();
  std::vector<std::string> names = reg.names();
  names.push_back("tar");  // a stream: open()'s, with a schema of its own
  for (const std::string& name : names) {
    const DatasetSchema* schema = reg.schema(name);
    if (!schema) continue;  // a plugin's (another test may have loaded one)
    INFO("dataset " << name);
    CHECK(reg.help(name) == (name == "tar" ? std::string() : schema->help()));
    std::vector<std::string> keys;
    for (const DatasetOption& o : schema->options) {
      INFO("option " << o.key);
      CHECK(std::find(keys.begin(), keys.end(), o.key) == keys.end());  // one declaration a key
      keys.push_back(o.key);
      CHECK(!(o.required && !o.fallback.empty()));
      CHECK(schema->help().find("\n  " + o.key + "=" + o.fallback + " ") != std::string::npos);
      // An option not given reads as its default, which lies in its own range.
      const DatasetConfig none = DatasetConfig(name, "").with_schema(*schema);
      using Kind = DatasetOption::Kind;
      if (o.fallback.empty()) {
        CHECK_THROWS_WITH(none.str(o.key), Catch::Contains("option '" + o.key + "' is required"));
      } else if (o.kind == Kind::Integer) {
        CHECK(std::to_string(none.integer(o.key)) == o.fallback);
      } else if (o.kind == Kind::Flag) {
        CHECK(none.flag(o.key) == (o.fallback == "1"));
      } else if (o.kind == Kind::Number) {
        CHECK(none.number(o.key) == std::stod(o.fallback));
      } else {
        CHECK(none.str(o.key) == o.fallback);
      }
      // A getter with a default of its own may not read a declared key: it would be stated twice.
      CHECK_THROWS_WITH(none.str(o.key, "x"), Catch::Contains("has its default in the dataset's schema"));
      // A bad value's error names the dataset, the option and its range.
      auto bad = [&](const std::string& value) { return DatasetConfig(name, o.key + "=" + value).with_schema(*schema); };
      const std::string named = "dataset '" + name + "': option '" + o.key + "' must be ";
      if (o.kind == Kind::Integer) {
        CHECK_THROWS_WITH(bad("ten").integer(o.key), Catch::Contains(named + "an integer, got 'ten'"));
        if (o.min)
          CHECK_THROWS_WITH(bad(std::to_string(static_cast<std::int64_t>(*o.min) - 1)).integer(o.key),
                            Catch::Contains(named + "an integer " + o.range()));
        if (o.max)
          CHECK_THROWS_WITH(bad(std::to_string(static_cast<std::int64_t>(*o.max) + 1)).integer(o.key),
                            Catch::Contains(named + "an integer " + o.range()));
      } else if (o.kind == Kind::Flag) {
        CHECK_THROWS_WITH(bad("2").flag(o.key), Catch::Contains(named + "0 or 1 (or false, true), got '2'"));
      } else if (o.kind == Kind::Choice) {
        CHECK_THROWS_WITH(bad("nosuch").str(o.key), Catch::Contains(named + o.range() + ", got 'nosuch'"));
      } else if (o.kind == Kind::Number && o.min) {
        CHECK_THROWS_WITH(bad(std::to_string(*o.min - 1)).number(o.key), Catch::Contains(named + "a number " + o.range()));
      }
    }
    // A key the schema does not declare fails at once, naming those it does.
    CHECK_THROWS_WITH(DatasetConfig(name, "nosuch=1").with_schema(*schema),
                      Catch::Contains("unknown option 'nosuch' (it takes: " + keys.front()));
  }
  // Defaults an options struct holds are the struct's: the C++ constructors and the registry agree.
  CHECK(reg.schema("tokens")->find("seq_len")->fallback == std::to_string(TokenSequenceOptions{}.seq_len));
  CHECK(reg.schema("megatron")->find("document_block")->fallback == std::to_string(TokenSequenceOptions{}.document_block));
  CHECK(reg.schema("image_folder")->find("channels")->fallback == std::to_string(ImageFolderOptions{}.channels));
  CHECK(reg.schema("nosuch") == nullptr);
  // Through the registry: a value out of range, and a key that applies to another dataset.
  CHECK_THROWS_WITH(reg.create("synthetic", "throw_rate=2"),
                    Catch::Contains("option 'throw_rate' must be a number in [0, 1], got '2'"));
  CHECK_THROWS_WITH(reg.create("tokens", "path=x.bin,shuffle_documents=1"),
                    Catch::Contains("unknown option 'shuffle_documents'"));
}

TEST_CASE("built-in datasets by name", "[unit][registry]") {
  auto& reg = DatasetRegistry::global();
  for (const char* name : {"idx", "npy", "image_folder", "synthetic"}) CHECK(reg.contains(name));
  DynamicDataset syn = reg.create("synthetic", "n=20,shape=2x3,dtype=float32");
  CHECK(syn.size() == 20);
  // idx's two required files are named together, whichever is missing.
  CHECK_THROWS_WITH(reg.create("idx", ""), Catch::Contains("images= and labels= missing"));
  CHECK_THROWS_WITH(reg.create("idx", "images=a.idx"), Catch::Contains("(labels= missing"));
  CHECK_THROWS_WITH(reg.create("idx", "labels=b.idx"), Catch::Contains("(images= missing"));
  DataLoaderOptions o;
  o.batch_size = 8;
  o.num_workers = 2;
  std::size_t rows = 0;
  for (std::vector<Tensor>& b : DataLoader(syn, o)) {
    CHECK(b[0].shape() == Shape{b[0].size(0), 2, 3});
    CHECK(b[1].dtype() == DType::Int64);
    rows += static_cast<std::size_t>(b[0].size(0));
  }
  CHECK(rows == 20);
  CHECK_THROWS_WITH(reg.create("synthetic", "shape=3xx"), Catch::Contains("must look like 3x224x224"));
  CHECK_THROWS_WITH(reg.create("synthetic", "dtype=float128"), Catch::Contains("option 'dtype' must be one of bool, uint8"));
  CHECK_THROWS_WITH(reg.create("synthetic", "colour=red"), Catch::Contains("unknown option 'colour'"));
  CHECK_THROWS_WITH(reg.create("imagenet"), Catch::Contains("no dataset named 'imagenet'") && Catch::Contains("synthetic"));
  // open() (the CLI's way in) names the tar stream it makes beside the registered datasets.
  CHECK_THROWS_WITH(reg.open("imagenet"), Catch::Contains("no dataset named 'imagenet'") && Catch::Contains("synthetic, tar"));
  CHECK_THROWS_AS(reg.create("npy", "path=/nonexistent.npy"), DataError);
  CHECK_THROWS_WITH(reg.add("npy", [](const DatasetConfig&) -> DynamicDataset { throw Error("unused"); }),
                    Catch::Contains("already registered"));
}

TEST_CASE("image_folder's options build the ImageFolder; decode=gpu is the typed dataset's", "[unit][registry][image]") {
  TempDir dir;
  std::filesystem::create_directories(dir / "a");
  write_file(dir / "a/0.jpg", encode_jpeg(textured(40, 30, 3), 40, 30, 3));
  const std::string root = "root=" + dir.path().string();
  auto& reg = DatasetRegistry::global();
  DynamicDataset ds = reg.create("image_folder", root + ",size=8,random_crop=1,mean=0.5:0.4:0.3,std=0.2,dct_scaling=1");
  SampleContext ctx(0, 1, 0, WorkerInfo{});
  const std::vector<Tensor> s = ds.get(0, ctx);
  CHECK(s[0].shape() == Shape{3, 8, 8});
  CHECK(s[0].dtype() == DType::Float32);
  // The same options give the same values through make_image_folder (the typed dataset).
  ImageFolder typed =
      make_image_folder(DatasetConfig("image_folder", root + ",size=8,random_crop=1,mean=0.5:0.4:0.3,std=0.2,dct_scaling=1"));
  SampleContext ctx2(0, 1, 0, WorkerInfo{});
  const LabeledSample t = typed.get(0, ctx2);
  CHECK(std::memcmp(t.image.raw(), s[0].raw(), s[0].nbytes()) == 0);
  CHECK_THROWS_WITH(reg.create("image_folder", root + ",decode=gpu"),
                    Catch::Contains("decode=gpu needs the loader's direct mode") && Catch::Contains("make_image_folder"));
  CHECK_THROWS_WITH(reg.create("image_folder", root + ",decode=fpga"),
                    Catch::Contains("'decode' must be one of cpu, gpu, got 'fpga'"));
  CHECK_THROWS_WITH(reg.create("image_folder", root + ",mean=0.1:0.2,std=0.1:0.2:0.3"),
                    Catch::Contains("one value or one per channel"));
  CHECK_THROWS_WITH(reg.create("image_folder", root + ",mean=0.1:x"), Catch::Contains("'mean' must be a number"));
  CHECK_THROWS_WITH(reg.create("image_folder", root + ",size=0"),
                    Catch::Contains("'size' must be an integer in [1, 32768], got '0'"));
  CHECK(make_image_folder(DatasetConfig("image_folder", root + ",decode=gpu,random_crop=1")).decodes_on_device());
}

TEST_CASE("a plugin is loaded at run time and feeds the loader", "[registry][plugin]") {
  DatasetRegistry reg;
  CHECK(reg.load_plugin(FERRY_TEST_RAMP_PLUGIN) == std::vector<std::string>{"ramp"});
  CHECK(reg.load_plugin(FERRY_TEST_RAMP_PLUGIN) == std::vector<std::string>{"ramp"});  // loading twice is harmless
  DynamicDataset ds = reg.create("ramp", "n=50,dim=4");
  CHECK(ds.size() == 50);
  for (int workers : {0, 3}) {
    DataLoaderOptions o;
    o.batch_size = 16;
    o.shuffle = true;
    o.num_workers = workers;
    std::size_t rows = 0;
    for (std::vector<Tensor>& b : DataLoader(ds, o)) {
      REQUIRE(b.size() == 2);
      for (std::int64_t r = 0; r < b[0].size(0); ++r) {
        const float* x = b[0].data<float>() + r * 4;
        const auto i = static_cast<std::int64_t>(x[0]);
        CHECK(x[3] == Approx(static_cast<float>(i) + 0.003f));
        CHECK(b[1].data<std::int64_t>()[r] == i % 10);
        ++rows;
      }
    }
    CHECK(rows == 50);
  }
  CHECK_THROWS_WITH(reg.create("ramp", "dim=0"),
                    Catch::Contains("option 'dim' must be a positive integer") && Catch::Contains("ramp"));
  CHECK_THROWS_WITH(reg.create("ramp", "speed=2"), Catch::Contains("unknown option 'speed'"));
}

TEST_CASE("plugin errors name the file and what is wrong", "[errors][plugin]") {
  DatasetRegistry reg;
  CHECK_THROWS_WITH(reg.load_plugin("/nonexistent/libplugin.so"), Catch::Contains("cannot load '/nonexistent/libplugin.so'"));
  CHECK_THROWS_WITH(reg.load_plugin(FERRY_TEST_NOT_A_PLUGIN), Catch::Contains("does not export ferry_plugin_init()"));
  CHECK_THROWS_WITH(reg.load_plugin(FERRY_TEST_WRONG_ABI_PLUGIN),
                    Catch::Contains("plugin ABI version 99") && Catch::Contains("this ferry speaks version 1"));
  CHECK_FALSE(reg.contains("ramp"));  // nothing from the refused plugin was registered
  TempDir dir;
  write_file(dir / "garbage.so", bytes_of("not an ELF file"));
  CHECK_THROWS_WITH(reg.load_plugin(dir / "garbage.so"), Catch::Contains("cannot load"));
}

TEST_CASE("the registry's idx passes its rows and its transform on for the device gather", "[unit][registry][gather]") {
  TempDir dir;
  const std::uint32_t n = 6;
  Bytes pixels(n * 4 * 5), labels(n);
  for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = std::byte(static_cast<unsigned char>(i * 7));
  for (std::size_t i = 0; i < n; ++i) labels[i] = std::byte(static_cast<unsigned char>(i % 3));
  write_file(dir / "img", idx_bytes(0x08, {n, 4, 5}, pixels));
  write_file(dir / "lbl", idx_bytes(0x08, {n}, labels));
  DynamicDataset ds = DatasetRegistry::global().create(
      "idx", "images=" + (dir / "img") + ",labels=" + (dir / "lbl") + ",flip=1,mean=0.5,std=0.25");
  std::string why;
  const std::vector<HostRows> rows = ds.host_rows(why);
  REQUIRE(rows.size() == 2);
  REQUIRE(rows[0].transform);
  CHECK(rows[0].transform->flip_p == 0.5);
  CHECK(rows[0].transform->dtype == DType::Float32);
  CHECK(rows[0].transform->shape == Shape{1, 4, 5});
  CHECK(rows[1].dtype == DType::Int64);
  // The host path's sample has the same fields: the image as the transform makes it, the label.
  WorkerInfo worker;
  SampleContext ctx(2, 0, 0, worker);
  const std::vector<Tensor> s = ds.get(2, ctx);
  REQUIRE(s.size() == 2);
  CHECK(s[0].shape() == Shape{1, 4, 5});
  CHECK(s[1].item<std::int64_t>() == 2);
  DataLoaderOptions o;
  o.device = 0;
  o.gather = Gather::Device;
  std::vector<HostRows> fields;
  const std::string unavailable = detail::gather_unavailable<DynamicDataset, std::vector<Tensor>>(o, true, ds, fields);
  if (DeviceStage::can_gather()) CHECK(unavailable.empty());
}

TEST_CASE("the registry's npy passes its rows on for the device gather", "[unit][registry][gather]") {
  TempDir dir;
  std::vector<float> f(12);
  for (std::size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(i);
  Bytes data(f.size() * sizeof(float));
  std::memcpy(data.data(), f.data(), data.size());
  write_file(dir / "x.npy", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 3), }", data));
  DynamicDataset ds = DatasetRegistry::global().create("npy", "path=" + (dir / "x.npy"));
  std::string why;
  const std::vector<HostRows> rows = ds.host_rows(why);
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].rows == 4);
  CHECK(rows[0].row_bytes == 12);
  CHECK(rows[0].row_shape == Shape{3});
  CHECK(static_cast<const float*>(rows[0].data)[4] == 4.f);
  CHECK(rows[0].mapped_file);
  // gather = Auto leaves a mapped file to the host path and says why; gather = Device takes it.
  DataLoaderOptions o;
  o.device = 0;
  std::vector<HostRows> fields;
  CHECK_THAT((detail::gather_unavailable<DynamicDataset, std::vector<Tensor>>(o, true, ds, fields)),
             Catch::Contains("x.npy is a memory-mapped file, which gather = Auto leaves to the host path"));
  o.gather = Gather::Device;
  CHECK_THAT((detail::gather_unavailable<DynamicDataset, std::vector<Tensor>>(o, true, ds, fields)),
             !Catch::Contains("memory-mapped"));
}
