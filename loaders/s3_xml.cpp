#include "s3_xml.h"

#include <charconv>

#include "ferry/core/error.h"

namespace ferry::loaders::s3 {
namespace {

// The text between <tag> and </tag> starting the search at `from` and ending before `end`; npos
// in `at` when there is none. Elements of S3's answers carry no attributes except the root's.
struct Found {
  std::size_t at = std::string_view::npos;  // first byte of the content
  std::size_t after = 0;                    // first byte after the closing tag
  std::string_view text;
};

Found element(std::string_view xml, std::string_view tag, std::size_t from, std::size_t end) {
  Found f;
  const std::string open = "<" + std::string(tag) + ">";
  const std::string close = "</" + std::string(tag) + ">";
  const std::size_t a = xml.substr(0, end).find(open, from);
  if (a == std::string_view::npos) return f;
  const std::size_t start = a + open.size();
  const std::size_t b = xml.substr(0, end).find(close, start);
  if (b == std::string_view::npos) return f;
  f.at = start;
  f.after = b + close.size();
  f.text = xml.substr(start, b - start);
  return f;
}

void append_utf8(std::uint32_t c, std::string& out) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

}  // namespace

bool xml_unescape(std::string_view raw, std::string& out) {
  out.clear();
  out.reserve(raw.size());
  for (std::size_t i = 0; i < raw.size();) {
    if (raw[i] != '&') {
      out += raw[i++];
      continue;
    }
    const std::size_t semi = raw.find(';', i);
    if (semi == std::string_view::npos || semi - i > 12) return false;
    const std::string_view name = raw.substr(i + 1, semi - i - 1);
    if (name == "amp")
      out += '&';
    else if (name == "lt")
      out += '<';
    else if (name == "gt")
      out += '>';
    else if (name == "quot")
      out += '"';
    else if (name == "apos")
      out += '\'';
    else if (name.size() >= 2 && name[0] == '#') {
      const bool hex = name[1] == 'x' || name[1] == 'X';
      const std::string_view digits = name.substr(hex ? 2 : 1);
      std::uint32_t c = 0;
      const auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), c, hex ? 16 : 10);
      if (digits.empty() || ec != std::errc() || p != digits.data() + digits.size() || c == 0 || c > 0x10FFFF ||
          (c >= 0xD800 && c <= 0xDFFF))
        return false;
      append_utf8(c, out);
    } else {
      return false;
    }
    i = semi + 1;
  }
  return true;
}

ListPage parse_list(std::string_view xml, const std::string& where) {
  const auto bad = [&](const std::string& what) -> DataError {
    return DataError(where, DataError::kNoOffset, "the object store's listing " + what);
  };
  const std::size_t root = xml.find("<ListBucketResult");
  if (root == std::string_view::npos) throw bad("is not a ListBucketResult");
  ListPage page;
  std::string text;
  std::size_t pos = root;
  for (;;) {
    const Found c = element(xml, "Contents", pos, xml.size());
    if (c.at == std::string_view::npos) break;
    const Found key = element(xml, "Key", c.at, c.after);
    const Found size = element(xml, "Size", c.at, c.after);
    if (key.at == std::string_view::npos) throw bad("has an entry without a Key");
    Object o;
    if (!xml_unescape(key.text, o.key) || o.key.empty()) throw bad("has a Key that is not valid XML text");
    if (size.at != std::string_view::npos) {
      const auto [p, ec] = std::from_chars(size.text.data(), size.text.data() + size.text.size(), o.size);
      if (size.text.empty() || ec != std::errc() || p != size.text.data() + size.text.size())
        throw bad("gives '" + o.key + "' a Size that is not a number");
    }
    page.objects.push_back(std::move(o));
    pos = c.after;
  }
  const Found t = element(xml, "IsTruncated", root, xml.size());
  page.truncated = t.at != std::string_view::npos && t.text == "true";
  if (page.truncated) {
    const Found n = element(xml, "NextContinuationToken", root, xml.size());
    if (n.at == std::string_view::npos || !xml_unescape(n.text, page.next_token) || page.next_token.empty())
      throw bad("is truncated but gives no NextContinuationToken");
  }
  return page;
}

ErrorBody parse_error(std::string_view xml) noexcept {
  ErrorBody e;
  try {
    const std::size_t root = xml.find("<Error>");
    if (root == std::string_view::npos) return e;
    const Found c = element(xml, "Code", root, xml.size());
    const Found m = element(xml, "Message", root, xml.size());
    if (c.at != std::string_view::npos && !xml_unescape(c.text, e.code)) e.code.clear();
    if (m.at != std::string_view::npos && !xml_unescape(m.text, e.message)) e.message.clear();
    if (e.message.size() > 300) e.message.resize(300);
  } catch (...) {
    return {};
  }
  return e;
}

std::optional<std::uint64_t> content_range_total(std::string_view content_range, std::size_t got, std::size_t asked,
                                                 std::string& why) {
  const std::size_t slash = content_range.rfind('/');
  if (slash == std::string_view::npos) {
    if (content_range.empty() && got <= asked) return got;
    why = "the object store answered a ranged read without a Content-Range";
    return std::nullopt;
  }
  const std::string_view total = content_range.substr(slash + 1);
  std::uint64_t v = 0;
  bool ok = !total.empty() && total.size() <= 20;
  for (char c : total) {
    if (!ok) break;
    const unsigned d = static_cast<unsigned>(c) - '0';
    if (d > 9 || v > (UINT64_MAX - d) / 10)
      ok = false;
    else
      v = v * 10 + d;
  }
  if (!ok) {
    why = "the object store gave an unreadable Content-Range";
    return std::nullopt;
  }
  return v;
}

}  // namespace ferry::loaders::s3
