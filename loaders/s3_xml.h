// loaders/s3_xml.h — private: the parts of S3's answers ferry reads (ListObjectsV2 pages, error
// bodies, the Content-Range header). No network here, so the fuzz target exercises exactly what the client parses.
//
// S3's answers are flat and machine-written; this reads only the elements it needs, by name, and
// decodes the five predefined entities and numeric character references. Anything it cannot read
// is a ferry::DataError naming `where` (the bucket and prefix), never a crash or an endless loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ferry::loaders::s3 {

/// One object of a listing.
struct Object {
  std::string key;
  std::uint64_t size = 0;
};

/// One page of a ListObjectsV2 answer.
struct ListPage {
  std::vector<Object> objects;
  bool truncated = false;
  std::string next_token;  ///< NextContinuationToken, when truncated
};

/// Parses a ListObjectsV2 answer; DataError naming `where` when it is not one (no
/// ListBucketResult, a Contents without Key or with a Size that is not a number, a truncated page
/// without a continuation token).
ListPage parse_list(std::string_view xml, const std::string& where);

/// An S3 error body's Code and Message (empty when absent or not XML); never throws.
struct ErrorBody {
  std::string code;
  std::string message;
};
ErrorBody parse_error(std::string_view xml) noexcept;

/// The object's size from a ranged answer: the total of its Content-Range header's value
/// ("bytes 0-0/1234"), or, from a server that ignored the range and sent the whole object (no
/// Content-Range), the `got` bytes it sent, which must be at most the `asked`. nullopt, with what
/// is wrong in `why`, for anything else (an unknown total "*", not a number, past 2^64).
std::optional<std::uint64_t> content_range_total(std::string_view content_range, std::size_t got, std::size_t asked,
                                                 std::string& why);

/// XML character data with its entities decoded (&amp; &lt; &gt; &quot; &apos; &#N; &#xN;);
/// false for a malformed or unknown entity.
bool xml_unescape(std::string_view raw, std::string& out);

}  // namespace ferry::loaders::s3
