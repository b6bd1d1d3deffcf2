// Writes a small seed corpus per fuzz target (valid files of each format), so the fuzzers start
// from real structure: make_seeds <dir> creates <dir>/{idx,npy,tokens,tar,image,state,s3}/.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

#include "../loaders/files.h"

using namespace ferry::test;

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string root = argv[1];
  write_file(root + "/idx/u8", idx_bytes(0x08, {2, 3, 3}, Bytes(18, std::byte{7})));
  write_file(root + "/idx/f32.gz", gzip(idx_bytes(0x0D, {2}, Bytes(8, std::byte{0x3f}))));
  write_file(root + "/npy/f4", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }", Bytes(16)));
  write_file(root + "/npy/v2", npy_bytes("{'descr': '|u1', 'fortran_order': False, 'shape': (3,), }", Bytes(3), 2));
  write_file(root + "/tar/shard", TarBuilder().dir("d/").file("d/a.jpg", "abc").file("d/a.cls", "1").finish());
  write_file(root + "/tar/long",
             TarBuilder().long_file(std::string(120, 'x') + ".txt", bytes_of("y")).pax_file("p.cls", bytes_of("2")).finish());
  write_file(root + "/tar/images", TarBuilder()
                                       .file("k/0.jpg", encode_jpeg(gradient(12, 8, 3), 12, 8, 3, 80))
                                       .file("k/0.cls", "3")
                                       .file("k/1.png", encode_png(gradient(5, 4, 1), 5, 4, 1))
                                       .file("k/1.cls", "4\n")
                                       .finish());
  write_file(root + "/image/rgb.jpg", encode_jpeg(gradient(24, 16, 3), 24, 16, 3, 80));
  write_file(root + "/image/gray.jpg", encode_jpeg(gradient(8, 8, 1), 8, 8, 1, 80));
  write_file(root + "/image/rgba.png", encode_png(gradient(9, 5, 4), 9, 5, 4));
  write_file(root + "/image/gray.png", encode_png(gradient(4, 4, 1), 4, 4, 1));
  // Token data: a Megatron index of 3 documents of 10 uint16 tokens after the .bin's size (60, 4
  // bytes), and an llm.c header.
  {
    const std::uint32_t bin = 60;
    Bytes t(4);
    std::memcpy(t.data(), &bin, 4);
    const Bytes idx = megatron_idx_bytes(8, {10, 10, 10}, {0, 20, 40}, {0, 1, 2, 3});
    t.insert(t.end(), idx.begin(), idx.end());
    write_file(root + "/tokens/megatron", t);
    Bytes h(1024);
    const std::int32_t header[3] = {20240520, 1, 0};
    std::memcpy(h.data(), header, sizeof header);
    write_file(root + "/tokens/llmc", h);
  }
  // A loader state (ferry/core/state.h), in the text format.
  write_file(root + "/state/mid-epoch", bytes_of("ferry.LoaderState 1\nseed 42\nepoch 3\nbatches 17\nbatches_per_epoch 100\n"
                                                 "samples_per_epoch 6400\ndataset_size 6400\nplan_hash 00ff00ff00ff00ff\n"
                                                 "world_size 4\nrank 1\nsegment_start 0\nposition 4352\n"));
  // Text for the tokenizer (UTF-8 of several scripts, an added token, digits, runs of spaces), and
  // a tokenizer.json of its own.
  write_file(root + "/tokenizer/text",
             bytes_of("ab abab  c 12345 <|e|>ab\n\n  \xc3\xa9t\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac\xf0\x9f\x99\x82"));
  write_file(root + "/tokenizer/json",
             bytes_of(R"({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": true}, "model": {"type": "BPE",)"
                      R"( "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"], "ignore_merges": true}})"));
  // An object store's answers (ListObjectsV2 pages, an error body), as SeaweedFS and S3 write them.
  write_file(
      root + "/s3/page",
      bytes_of("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
               "<Name>b</Name><Prefix>train/</Prefix><MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated>"
               "<Contents><Key>train/a/0.jpg</Key><ETag>&#34;b1946ac9&#34;</ETag><Size>6</Size></Contents>"
               "<Contents><Key>train/b/1 &amp; 2.png</Key><Size>1234</Size></Contents>"
               "<NextContinuationToken>dHJhaW4vYi8x</NextContinuationToken><KeyCount>2</KeyCount></ListBucketResult>"));
  write_file(root + "/s3/content-range", bytes_of("bytes 0-8388607/22528000"));
  write_file(root + "/s3/error",
             bytes_of("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>NoSuchKey</Code><Message>The specified key "
                      "does not exist.</Message><Resource>/b/k</Resource><RequestId>18EB</RequestId></Error>"));
  return 0;
}
