// libFuzzer targets for the loaders' parsers: one binary per format, chosen at compile time
// (FERRY_FUZZ_IDX, _NPY, _TOKENS (a Megatron index and an llm.c header), _S3 (an object store's XML answers), _TAR (the reader, and TarImages' index over the same bytes), _TAR_STREAM (TarShards' record assembly, skip and a loader's reading), _IMAGE (full and region decode), _STATE (a loader state), _TOKENIZER (text through a tokenizer.json, and tokenizer.json files), _PLAN: GPU decode's worker side, the JPEG header and the
// transform plan whose every tap must lie inside the image). Any input must either parse or raise ferry::DataError
// (a clear error); anything else (a crash, an ASan/UBSan report, another exception) is a finding.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "ferry/detail/pass_math.h"
#include "ferry/ferry.h"
#if defined(FERRY_FUZZ_S3)
#include "s3_xml.h"  // loaders/: compiled into this target (the parsers are private to the library)
#endif

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
#if defined(FERRY_FUZZ_IDX)
    (void)ferry::parse_idx(bytes, "fuzz.idx");
#elif defined(FERRY_FUZZ_STATE)
    // A loader state's text (ferry/core/state.h): parses, and reads back the same, or is an Error.
    try {
      const ferry::LoaderState s = ferry::LoaderState::from_string(std::string_view(reinterpret_cast<const char*>(data), size));
      if (!(ferry::LoaderState::from_string(s.to_string()) == s)) __builtin_trap();
    } catch (const ferry::Error&) {
      // the expected outcome for a damaged state
    }
#elif defined(FERRY_FUZZ_S3)
    // An object store's answers: a Content-Range, a ListObjectsV2 page and an error body. A page either parses into
    // keys that are not empty and a token when truncated, or is a DataError.
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    {
      // A Content-Range header's value: a total of digits after the last '/', or nothing.
      std::string why;
      const auto total = ferry::loaders::s3::content_range_total(text, size, size / 2, why);
      if (total.has_value() != why.empty()) __builtin_trap();
      if (total && text.find('/') == std::string_view::npos && (*total != size || !text.empty())) __builtin_trap();
    }
    (void)ferry::loaders::s3::parse_error(text);
    const ferry::loaders::s3::ListPage page = ferry::loaders::s3::parse_list(text, "s3://fuzz/prefix/");
    for (const auto& o : page.objects)
      if (o.key.empty()) __builtin_trap();
    if (page.truncated && page.next_token.empty()) __builtin_trap();
#elif defined(FERRY_FUZZ_TOKENS)
    // A Megatron index (ferry/loaders/tokens.h) over a .bin of the size its first 4 bytes say (the
    // rest is the .idx), every token and document boundary read back; and the same bytes as an
    // llm.c header. The index is checked where samples read it, so every window is read.
    try {
      const ferry::LlmcHeader h = ferry::parse_llmc_header(bytes, "fuzz.bin");
      if (h.type != ferry::TokenType::UInt16 && h.type != ferry::TokenType::UInt32) __builtin_trap();
    } catch (const ferry::DataError&) {
    }
    if (size < 4) return 0;
    std::uint32_t bin_size = 0;
    std::memcpy(&bin_size, data, 4);
    static std::vector<std::byte> bin;
    bin.assign(bin_size % (1u << 16), std::byte{1});
    const auto corpus = ferry::megatron_from_memory(bytes.subspan(4), bin, "fuzz");
    if (corpus->size() < 8) return 0;  // fewer tokens than one window: TokenSequences refuses it (not a data error)
    const ferry::TokenSequences seqs(corpus, {.seq_len = 7, .packed = true});
    ferry::SampleContext ctx(0, 1, 0, ferry::WorkerInfo{});
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const std::vector<ferry::Tensor> s = seqs.get(i, ctx);
      if (s.size() != 4 || s[3].numel() != 8) __builtin_trap();
    }
#elif defined(FERRY_FUZZ_TOKENIZER)
    // Text through a byte-level BPE tokenizer.json with a regex split, an added token and byte
    // fallback (every UTF-8 text encodes; anything else is a DataError naming the byte), and, for
    // an input that opens with '{', the input itself as a tokenizer.json (an Error, or a tokenizer
    // that encodes a text).
    static const auto tok = ferry::tokenizer_from_json(R"({"added_tokens": [{"id": 9, "content": "<|e|>", "special": true}],
      "normalizer": null, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}| ?\\p{L}+|\\s+(?!\\S)|\\s+|[^\\s\\p{L}\\p{N}]+"}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]},
      "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "Ġ": 3, "Ġab": 4, "c": 5}, "merges": [["a", "b"], ["Ġ", "ab"]]}})",
                                                       "fuzz.json");
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    if (!text.empty() && text.front() == '{') {
      try {
        const auto t = ferry::tokenizer_from_json(text, "fuzz-input.json");
        (void)t->encode("some text 123, and more");
      } catch (const ferry::DataError&) {
      } catch (const ferry::Error&) {
      }
    }
    const auto ids = tok->encode(text);
    for (std::int32_t id : ids)
      if (id < 0 || static_cast<std::size_t>(id) >= tok->vocab_size()) __builtin_trap();
#elif defined(FERRY_FUZZ_NPY)
    (void)ferry::parse_npy(bytes, "fuzz.npy");
#elif defined(FERRY_FUZZ_TAR)
    {
      ferry::TarReader reader(bytes, "fuzz.tar");
      while (reader.next()) {
      }
    }
    // The same bytes as a file, indexed by TarImages (headers read, data seeked past), and each
    // record's image and label read back at the indexed offsets.
    static const int fd = memfd_create("fuzz.tar", 0);
    if (fd < 0 || ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) __builtin_trap();
    ferry::TarImagesOptions o;
    o.transform = ferry::ImageTransform().resize(4, 4);
    o.max_pixels = 1 << 16;
    const ferry::TarImages images({"/proc/self/fd/" + std::to_string(fd)}, o);
    for (std::size_t i = 0; i < images.size() && i < 16; ++i) {
      ferry::SampleContext ctx(0, 1, i, ferry::WorkerInfo{});
      try {
        (void)images.get(i, ctx);
      } catch (const ferry::DataError&) {
      }
    }
#elif defined(FERRY_FUZZ_TAR_STREAM)
    // The tar stream's record assembly over the bytes as a file (TarShards: members grouped into
    // records by key, a damaged member after a complete record deferred to the next call, skip()
    // by headers alone, a loader's one reading of the epoch and its second epoch at the learned
    // offsets). Read whole by a worker's own stream, then checked against it where that read
    // succeeded: the same stream after skip(k) gives the records after the first k, and a loader
    // gives every record once, in order, in both epochs.
    static const int fd = memfd_create("fuzz-stream.tar", 0);
    if (fd < 0 || ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) __builtin_trap();
    const ferry::TarShards shards({"/proc/self/fd/" + std::to_string(fd)}, {.shuffle = false});
    std::vector<std::uint64_t> whole;  // each record's offset
    bool whole_read = false;
    try {
      ferry::TarShards::Stream s = shards.open(ferry::WorkerInfo{});
      while (const auto r = s.next()) {
        std::size_t bytes = 0;
        for (const auto& [name, field] : r->fields) bytes += field.size();
        if (r->fields.empty() || bytes > size || r->offset >= size) __builtin_trap();
        if (!whole.empty() && r->offset <= whole.back()) __builtin_trap();
        whole.push_back(r->offset);
      }
      whole_read = true;
    } catch (const ferry::DataError&) {
    }
    if (!whole_read) return 0;
    const std::size_t k = size == 0 ? 0 : data[size - 1] % (whole.size() + 1);
    ferry::TarShards::Stream s = shards.open(ferry::WorkerInfo{});
    if (s.skip(k) != k) __builtin_trap();
    std::size_t at = k;
    while (const auto r = s.next())
      if (at >= whole.size() || r->offset != whole[at++]) __builtin_trap();
    if (at != whole.size()) __builtin_trap();
    ferry::DataLoaderOptions o;
    o.batch_size = 3;
    ferry::DataLoader loader(shards.map([](ferry::TarRecord r) { return static_cast<std::int64_t>(r.offset); }), o);
    for (int epoch = 0; epoch < 2; ++epoch) {
      std::vector<std::uint64_t> got;
      for (const auto& batch : loader)
        for (std::int64_t i = 0; i < batch.numel(); ++i) got.push_back(static_cast<std::uint64_t>(batch.item<std::int64_t>(i)));
      if (got != whole) __builtin_trap();
    }
#elif defined(FERRY_FUZZ_IMAGE)
    // Small pixel limit: the fuzzer looks for crashes, not for large images.
    // Region decode (only the crop's rows and columns, Note [Region decode]) and DCT scaling first:
    // the same bytes through libjpeg's skip and crop paths.
    const auto crop = ferry::ImageTransform().random_resized_crop(16, 16).horizontal_flip().to_float();
    ferry::Tensor out = ferry::Tensor::empty(ferry::DType::Float32, {3, 16, 16});
    for (bool scaled : {false, true}) {
      try {
        ferry::Generator g(size);
        ferry::decode_transformed_into(bytes, "fuzz.img", crop, g, out,
                                       {.channels = 3, .max_pixels = 1 << 20, .dct_scaling = scaled});
      } catch (const ferry::DataError&) {
      }
    }
    ferry::Tensor t = ferry::decode_image(bytes, "fuzz.img", {.channels = 3, .max_pixels = 1 << 20});
    ferry::Generator g(size);
    (void)crop(t, g);
#elif defined(FERRY_FUZZ_PLAN)
    ferry::Generator g(size);
    const auto t = ferry::ImageTransform().random_resized_crop(16, 12).horizontal_flip().to_float().normalize({0.5f}, {0.25f});
    const ferry::JpegPlan jp = ferry::plan_jpeg(bytes, "fuzz.jpg", t, g, 1 << 20);
    std::vector<std::uint8_t> pixels(static_cast<std::size_t>(jp.height) * static_cast<std::size_t>(jp.width) * 3, 7);
    const ferry::detail::PassAxis ay{jp.plan.y.c0, jp.plan.y.L0,      jp.plan.y.R,   jp.plan.y.c1,
                                     jp.plan.y.N,  jp.plan.y.resized, jp.plan.y.flip};
    const ferry::detail::PassAxis ax{jp.plan.x.c0, jp.plan.x.L0,      jp.plan.x.R,   jp.plan.x.c1,
                                     jp.plan.x.N,  jp.plan.x.resized, jp.plan.x.flip};
    float sum = 0;  // as the device kernel reads: a tap outside `pixels` is an ASan report
    for (std::int64_t y = 0; y < ay.N; ++y)
      for (std::int64_t x = 0; x < ax.N; ++x)
        for (int c = 0; c < 3; ++c)
          sum += ferry::detail::pass_value(pixels.data(), jp.width * 3, 3, ferry::detail::pass_tap(ay, y),
                                           ferry::detail::pass_tap(ax, x), c, jp.plan.round);
    if (!(sum >= 0)) __builtin_trap();
#endif
  } catch (const ferry::DataError&) {
    // the expected outcome for malformed input
  }
  return 0;
}
