#include "s3.h"

#include "cache.h"
#include "ferry/detail/io_counters.h"

#include <curl/curl.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "ferry/core/error.h"
#include "ferry/loaders/storage.h"

// Note [S3 settings]
// ~~~~~~~~~~~~~~~~~~
// The settings and their order are documented for users in ferry/loaders/storage.h; read_config
// below is that list in code. They are read at each request (config() caches the files per set of
// variables), never once per process, so that a program (or a test) may change them between
// loaders.

namespace ferry::loaders::s3 {
namespace {

std::atomic<std::uint64_t> g_requests{0}, g_bytes{0}, g_retries{0}, g_hedges{0}, g_hedges_won{0};

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

std::string trim(std::string s) {
  const auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; };
  while (!s.empty() && ws(s.back())) s.pop_back();
  std::size_t i = 0;
  while (i < s.size() && ws(s[i])) ++i;
  return s.substr(i);
}

// The keys of section `section` of an AWS ini file (nested "s3 =" blocks flattened into it).
std::map<std::string, std::string> ini_section(const std::string& path, const std::string& section) {
  std::map<std::string, std::string> out;
  std::ifstream in(path);
  if (!in) return out;
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    const std::string t = trim(line);
    if (t.empty() || t[0] == '#' || t[0] == ';') continue;
    if (t.front() == '[' && t.back() == ']') {
      inside = trim(t.substr(1, t.size() - 2)) == section;
      continue;
    }
    if (!inside) continue;
    const std::size_t eq = t.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = trim(t.substr(0, eq)), value = trim(t.substr(eq + 1));
    if (!value.empty() || !out.count(key)) out[key] = value;
  }
  return out;
}

std::string home_file(const char* variable, const char* name) {
  std::string p = env(variable);
  if (!p.empty()) return p;
  const std::string home = env("HOME");
  return home.empty() ? std::string() : home + "/.aws/" + name;
}

struct Config {
  std::string scheme, host;  // the endpoint: "http", "127.0.0.1:8333"
  bool aws_endpoint = false;
  std::string region;
  std::string key_id, secret, token;  // key_id empty: anonymous
  bool path_style = true;
  int attempts = 5;
  double hedge_after = 1.0;  // < 0: never
  long stall_seconds = 30;
};

Config read_config() {
  Config c;
  const std::string profile = env("AWS_PROFILE").empty() ? "default" : env("AWS_PROFILE");
  const auto creds = ini_section(home_file("AWS_SHARED_CREDENTIALS_FILE", "credentials"), profile);
  const auto conf = ini_section(home_file("AWS_CONFIG_FILE", "config"), profile == "default" ? "default" : "profile " + profile);
  const auto pick = [](std::initializer_list<std::string> values) {
    for (const std::string& v : values)
      if (!v.empty()) return v;
    return std::string();
  };
  const auto at = [](const std::map<std::string, std::string>& m, const char* k) {
    const auto it = m.find(k);
    return it == m.end() ? std::string() : it->second;
  };
  c.region = pick({env("AWS_REGION"), env("AWS_DEFAULT_REGION"), at(conf, "region"), "us-east-1"});
  std::string endpoint = pick({env("AWS_ENDPOINT_URL_S3"), env("AWS_ENDPOINT_URL"), at(conf, "endpoint_url")});
  c.aws_endpoint = endpoint.empty();
  if (endpoint.empty()) endpoint = "https://s3." + c.region + ".amazonaws.com";
  const std::size_t sep = endpoint.find("://");
  if (sep == std::string::npos)
    throw Error("object storage: the endpoint '" + endpoint + "' has no scheme (http:// or https://)");
  c.scheme = endpoint.substr(0, sep);
  c.host = endpoint.substr(sep + 3);
  while (!c.host.empty() && c.host.back() == '/') c.host.pop_back();
  if ((c.scheme != "http" && c.scheme != "https") || c.host.empty() || c.host.find('/') != std::string::npos)
    throw Error("object storage: the endpoint '" + endpoint + "' is not http(s)://host[:port]");
  const std::string no_sign = env("AWS_NO_SIGN_REQUEST");
  if (no_sign != "1" && no_sign != "true") {
    if (!env("AWS_ACCESS_KEY_ID").empty() && !env("AWS_SECRET_ACCESS_KEY").empty()) {
      c.key_id = env("AWS_ACCESS_KEY_ID");
      c.secret = env("AWS_SECRET_ACCESS_KEY");
      c.token = env("AWS_SESSION_TOKEN");
    } else {
      for (const auto* m : {&creds, &conf}) {
        if (!at(*m, "aws_access_key_id").empty() && !at(*m, "aws_secret_access_key").empty()) {
          c.key_id = at(*m, "aws_access_key_id");
          c.secret = at(*m, "aws_secret_access_key");
          c.token = at(*m, "aws_session_token");
          break;
        }
      }
    }
  }
  const std::string style = pick({env("AWS_S3_ADDRESSING_STYLE"), at(conf, "addressing_style")});
  if (style == "path")
    c.path_style = true;
  else if (style == "virtual")
    c.path_style = false;
  else
    c.path_style = !c.aws_endpoint;
  if (const std::string a = env("AWS_MAX_ATTEMPTS"); !a.empty()) {
    char* end = nullptr;
    const long v = std::strtol(a.c_str(), &end, 10);
    if (*end != '\0' || v < 1 || v > 100)
      throw Error("object storage: AWS_MAX_ATTEMPTS must be an integer from 1 to 100, got '" + a + "'");
    c.attempts = static_cast<int>(v);
  }
  if (const std::string h = env("FERRY_S3_HEDGE_AFTER"); !h.empty()) {
    if (h == "off") {
      c.hedge_after = -1;
    } else {
      char* end = nullptr;
      const double v = std::strtod(h.c_str(), &end);
      if (*end != '\0' || !(v >= 0) || v > 3600)
        throw Error("object storage: FERRY_S3_HEDGE_AFTER must be seconds (0 to 3600) or 'off', got '" + h + "'");
      c.hedge_after = v;
    }
  }
  if (const std::string s = env("FERRY_S3_STALL_SECONDS"); !s.empty()) {
    char* end = nullptr;
    const long v = std::strtol(s.c_str(), &end, 10);
    if (*end != '\0' || v < 1 || v > 3600)
      throw Error("object storage: FERRY_S3_STALL_SECONDS must be an integer from 1 to 3600, got '" + s + "'");
    c.stall_seconds = v;
  }
  return c;
}

// The settings for the current environment, the files read once per distinct set of variables.
Config config() {
  static std::mutex mu;
  static std::map<std::string, Config> cache;
  std::string key;
  for (const char* v : {"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID",
                        "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE",
                        "AWS_CONFIG_FILE", "AWS_NO_SIGN_REQUEST", "AWS_S3_ADDRESSING_STYLE", "AWS_MAX_ATTEMPTS",
                        "FERRY_S3_HEDGE_AFTER", "FERRY_S3_STALL_SECONDS", "HOME"}) {
    key += env(v);
    key += '\n';
  }
  std::lock_guard lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() > 64) cache.clear();
    it = cache.emplace(key, read_config()).first;
  }
  return it->second;
}

// RFC 3986 unreserved characters stay; everything else is %XX (S3's rule for SigV4), '/' kept in
// paths.
std::string encode(std::string_view s, bool keep_slash) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

// The request's URL: path-style http://host/bucket/key or virtual-host http://bucket.host/key.
std::string http_url(const Config& c, const std::string& bucket, const std::string& key, const std::string& query) {
  std::string u = c.path_style ? c.scheme + "://" + c.host + "/" + encode(bucket, false) + "/" + encode(key, true)
                               : c.scheme + "://" + bucket + "." + c.host + "/" + encode(key, true);
  if (!query.empty()) u += "?" + query;
  return u;
}

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) throw Error("object storage: libcurl failed to initialize");
  });
}

// A thread's connections: one multi handle (its connection cache is reused by every request the
// thread makes) and the easy handles it has made.
struct Handles {
  CURLM* multi = nullptr;
  std::vector<CURL*> idle;
  Handles() {
    global_init();
    multi = curl_multi_init();
    if (!multi) throw Error("object storage: libcurl could not make a multi handle");
  }
  ~Handles() {
    for (CURL* e : idle) curl_easy_cleanup(e);
    curl_multi_cleanup(multi);
  }
  CURL* take() {
    CURL* e = nullptr;
    if (!idle.empty()) {
      e = idle.back();
      idle.pop_back();
      curl_easy_reset(e);
    } else {
      e = curl_easy_init();
      if (!e) throw Error("object storage: libcurl could not make a handle");
    }
    return e;
  }
  void give(CURL* e) { idle.push_back(e); }
};

Handles& handles() {
  thread_local Handles h;
  return h;
}

constexpr std::size_t kErrorBodyLimit = 64 << 10;
constexpr std::size_t kListLimit = 64 << 20;

// One HTTP request in flight, and where its body goes.
struct Attempt {
  CURL* easy = nullptr;
  curl_slist* headers = nullptr;
  std::byte* dst = nullptr;  // fixed sink (a range): cap bytes
  std::size_t cap = 0, got = 0;
  std::vector<std::byte> own;              // a hedge's fixed sink
  std::vector<std::byte>* grow = nullptr;  // whole-object sink
  std::size_t grow_limit = 0;
  std::string error_body;
  std::string content_range;
  bool overflow = false;
  bool first_byte = false;
  char errbuf[CURL_ERROR_SIZE] = {};
  ~Attempt() {
    if (headers) curl_slist_free_all(headers);
  }
};

std::size_t on_data(char* p, std::size_t size, std::size_t n, void* user) {
  Attempt& a = *static_cast<Attempt*>(user);
  const std::size_t len = size * n;
  a.first_byte = true;
  long code = 0;
  curl_easy_getinfo(a.easy, CURLINFO_RESPONSE_CODE, &code);
  g_bytes.fetch_add(len, std::memory_order_relaxed);
  detail::count_io(&detail::IoCounters::bytes, len);
  if (code >= 300) {
    a.error_body.append(p, std::min(len, kErrorBodyLimit - std::min(kErrorBodyLimit, a.error_body.size())));
    return len;
  }
  if (a.grow) {
    if (a.grow->size() + len > a.grow_limit) {
      a.overflow = true;
      return 0;
    }
    const std::size_t at = a.grow->size();
    a.grow->resize(at + len);
    std::memcpy(a.grow->data() + at, p, len);
    return len;
  }
  if (a.got + len > a.cap) {
    a.overflow = true;
    return 0;
  }
  std::memcpy(a.dst + a.got, p, len);
  a.got += len;
  return len;
}

std::size_t on_header(char* p, std::size_t size, std::size_t n, void* user) {
  Attempt& a = *static_cast<Attempt*>(user);
  const std::string_view line(p, size * n);
  constexpr std::string_view name = "content-range:";
  if (line.size() > name.size()) {
    std::string head(line.substr(0, name.size()));
    for (char& ch : head) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (head == name) a.content_range = trim(std::string(line.substr(name.size())));
  }
  return size * n;
}

struct Request {
  std::string url;    // http(s)://...
  std::string range;  // "0-99" or empty
  std::byte* dst = nullptr;
  std::size_t cap = 0;
  std::vector<std::byte>* grow = nullptr;
  std::size_t grow_limit = 0;
  bool short_ok = false;  // a range at an object's start whose size is unknown: fewer bytes may be all there is
};

void setup(const Config& c, const Request& r, Attempt& a, bool hedge) {
  CURL* e = a.easy;
  curl_easy_setopt(e, CURLOPT_URL, r.url.c_str());
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, &on_data);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, &a);
  curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, &on_header);
  curl_easy_setopt(e, CURLOPT_HEADERDATA, &a);
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, a.errbuf);
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT, 10L);
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, c.stall_seconds);
  curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);
  if (!r.range.empty()) curl_easy_setopt(e, CURLOPT_RANGE, r.range.c_str());
  if (!c.key_id.empty()) {
    const std::string sigv4 = "aws:amz:" + c.region + ":s3";
    curl_easy_setopt(e, CURLOPT_AWS_SIGV4, sigv4.c_str());
    curl_easy_setopt(e, CURLOPT_USERNAME, c.key_id.c_str());
    curl_easy_setopt(e, CURLOPT_PASSWORD, c.secret.c_str());
    if (!c.token.empty()) a.headers = curl_slist_append(a.headers, ("x-amz-security-token: " + c.token).c_str());
  }
  if (a.headers) curl_easy_setopt(e, CURLOPT_HTTPHEADER, a.headers);
  if (hedge && r.dst) {
    a.own.resize(r.cap);
    a.dst = a.own.data();
    a.cap = r.cap;
  } else {
    a.dst = r.dst;
    a.cap = r.cap;
  }
  if (r.grow) {
    a.grow = hedge ? &a.own : r.grow;
    a.grow->clear();
    a.grow_limit = r.grow_limit;
  }
}

// A ranged GET of `n` bytes at `offset` into `dst`.
Request ranged(const Config& c, const Url& url, std::uint64_t offset, std::size_t n, std::byte* dst) {
  Request r;
  r.url = http_url(c, url.bucket, url.key, "");
  r.range = std::to_string(offset) + "-" + std::to_string(offset + n - 1);
  r.dst = dst;
  r.cap = n;
  return r;
}

// What one try of a request ended with.
struct Outcome {
  enum Kind { Ok, Retry, Fail } kind = Fail;
  long status = 0;
  std::string why;  // for Retry and Fail
  Attempt* winner = nullptr;
};

// Thrown by try_once when the loader has given up on the calling thread's work (io_cancelled).
struct Cancelled {};

bool transient_status(long s) { return s == 408 || s == 429 || s == 500 || s == 502 || s == 503 || s == 504; }

Outcome judge(Attempt& a, CURLcode rc) {
  Outcome o;
  long status = 0;
  curl_easy_getinfo(a.easy, CURLINFO_RESPONSE_CODE, &status);
  o.status = status;
  if (rc != CURLE_OK) {
    if (a.overflow) {
      o.kind = Outcome::Fail;
      o.why = "the server sent more bytes than were asked for";
      return o;
    }
    o.kind = Outcome::Retry;
    o.why = std::string(a.errbuf[0] ? a.errbuf : curl_easy_strerror(rc));
    return o;
  }
  if (status >= 200 && status < 300) {
    o.kind = Outcome::Ok;
    o.winner = &a;
    return o;
  }
  const ErrorBody body = parse_error(a.error_body);
  o.why = "HTTP " + std::to_string(status) + (body.code.empty() ? "" : " " + body.code) +
          (body.message.empty() ? "" : ": " + body.message);
  o.kind = transient_status(status) ? Outcome::Retry : Outcome::Fail;
  return o;
}

// One try: the request, and a hedge when its first byte is late; the first good answer wins and
// the other is cancelled.
Outcome try_once(const Config& c, const Request& r, Attempt& primary, Attempt& hedge) {
  Handles& h = handles();
  std::vector<Attempt*> live;
  const auto start = [&](Attempt& a, bool is_hedge) {
    a.easy = h.take();
    setup(c, r, a, is_hedge);
    if (curl_multi_add_handle(h.multi, a.easy) != CURLM_OK) {
      h.give(a.easy);
      a.easy = nullptr;
      throw Error("object storage: libcurl refused a request");
    }
    g_requests.fetch_add(1, std::memory_order_relaxed);
    detail::count_io(&detail::IoCounters::requests, 1);
    live.push_back(&a);
  };
  const auto finish = [&](Attempt& a) {
    curl_multi_remove_handle(h.multi, a.easy);
    live.erase(std::remove(live.begin(), live.end(), &a), live.end());
  };
  struct Cleanup {  // every handle back to the thread's pool, whatever happens
    Handles& h;
    std::vector<Attempt*>& live;
    Attempt& p;
    Attempt& q;
    ~Cleanup() {
      for (Attempt* a : live) curl_multi_remove_handle(h.multi, a->easy);
      for (Attempt* a : {&p, &q})
        if (a->easy) h.give(std::exchange(a->easy, nullptr));
    }
  } cleanup{h, live, primary, hedge};
  start(primary, false);
  const auto t0 = std::chrono::steady_clock::now();
  bool hedged = false;
  Outcome last;
  int done = 0;
  while (!live.empty()) {
    if (detail::io_cancelled()) throw Cancelled{};  // Cleanup stops the transfers (their connections close)
    int running = 0;
    if (curl_multi_perform(h.multi, &running) != CURLM_OK) throw Error("object storage: libcurl's transfer loop failed");
    int left = 0;
    while (CURLMsg* m = curl_multi_info_read(h.multi, &left)) {
      if (m->msg != CURLMSG_DONE) continue;
      Attempt& a = m->easy_handle == primary.easy ? primary : hedge;
      const CURLcode rc = m->data.result;
      finish(a);
      ++done;
      Outcome o = judge(a, rc);
      if (o.kind == Outcome::Ok && r.dst && a.got != r.cap && !r.short_ok) {  // a range answered short: read it again
        o.kind = Outcome::Retry;
        o.why = "the answer held " + std::to_string(a.got) + " of the " + std::to_string(r.cap) + " bytes asked for";
      }
      if (o.kind == Outcome::Ok) {
        if (&a == &hedge) g_hedges_won.fetch_add(1, std::memory_order_relaxed);
        return o;  // Cleanup cancels the other
      }
      if (o.kind == Outcome::Fail) return o;
      last = std::move(o);
    }
    if (live.empty()) break;
    if (!hedged && c.hedge_after >= 0 && !primary.first_byte && done == 0 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >= c.hedge_after) {
      hedged = true;
      g_hedges.fetch_add(1, std::memory_order_relaxed);
      detail::count_io(&detail::IoCounters::hedges, 1);
      start(hedge, true);
      continue;
    }
    int wait_ms = 100;
    if (!hedged && c.hedge_after >= 0) {
      const double left_s = c.hedge_after - std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      wait_ms = std::clamp(static_cast<int>(left_s * 1000) + 1, 0, 100);
    }
    curl_multi_poll(h.multi, nullptr, 0, wait_ms, nullptr);
  }
  return last;
}

// What a request ended with: its body's length (in the request's sink), its Content-Range, or,
// when it failed for good, the HTTP status and why.
struct Answer {
  bool ok = false;
  long status = 0;
  std::string why;
  std::size_t got = 0;
  std::string content_range;
};

// Runs `r`, retrying what may pass with jittered backoff; IoError (EIO, transient) naming `where`
// after the last attempt. A permanent failure comes back as an Answer for the caller to name.
Answer run(const Config& c, const Request& r, const std::string& where, std::uint64_t offset) {
  thread_local std::minstd_rand rng(static_cast<unsigned>(std::hash<std::thread::id>{}(std::this_thread::get_id())));
  const auto given_up = [&]() -> std::exception_ptr {
    if (detail::io_deadline_passed())  // ferry::ReadDeadline (a dataset being built), not a loader
      return std::make_exception_ptr(TimeoutError(where + ": object storage: no answer within the read deadline of " +
                                                  std::to_string(detail::io_deadline_ms()) + " ms"));
    return std::make_exception_ptr(IoError(where, offset,
                                           "object storage: the loader gave up on this read (its worker was abandoned "
                                           "at the timeout, or the epoch ended)",
                                           ECANCELED));
  };
  std::string why;
  for (int attempt = 1;; ++attempt) {
    Attempt p, q;
    Outcome o;
    try {
      o = try_once(c, r, p, q);
    } catch (const Cancelled&) {
      std::rethrow_exception(given_up());
    }
    if (o.kind == Outcome::Ok) {
      Attempt& w = *o.winner;
      if (&w == &q) {  // the hedge answered first: its bytes into the caller's sink
        if (r.dst) std::memcpy(r.dst, q.own.data(), q.got);
        if (r.grow) r.grow->swap(q.own);
      }
      return {true, o.status, {}, r.grow ? r.grow->size() : w.got, w.content_range};
    }
    if (o.kind == Outcome::Fail) return {false, o.status, o.why, 0, {}};
    why = o.why;
    if (attempt >= c.attempts) break;
    g_retries.fetch_add(1, std::memory_order_relaxed);
    detail::count_io(&detail::IoCounters::retries, 1);
    // Full jitter: a uniform wait in [0, min(2 s, 50 ms * 2^attempt)].
    const double cap = std::min(2.0, 0.05 * static_cast<double>(1u << std::min(attempt, 10)));
    // Slept in steps of 0.1 s at most, so that a loader giving up or a read deadline ends it soon.
    const auto wake = std::chrono::steady_clock::now() +
                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                          std::chrono::duration<double>(std::uniform_real_distribution<double>(0, cap)(rng)));
    for (auto now = std::chrono::steady_clock::now(); now < wake; now = std::chrono::steady_clock::now()) {
      if (detail::io_cancelled()) std::rethrow_exception(given_up());
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(wake - now, std::chrono::milliseconds(100)));
    }
    if (detail::io_cancelled()) std::rethrow_exception(given_up());
  }
  throw IoError(where, offset, "object storage: " + why + " (after " + std::to_string(c.attempts) + " attempts)", EIO);
}

// A permanent failure as the DataError a user can act on.
[[noreturn]] void fail(const Config& c, const Answer& a, const std::string& where, std::uint64_t offset) {
  if (a.status == 404 && a.why.find("NoSuchBucket") != std::string::npos)
    throw DataError(where, DataError::kNoOffset, "the bucket does not exist (" + a.why + ")");
  if (a.status == 404) throw DataError(where, DataError::kNoOffset, "does not exist (" + a.why + ")");
  if (a.status == 403)
    throw DataError(where, DataError::kNoOffset,
                    "access denied (" + a.why +
                        "); check the credentials and the region (AWS_ACCESS_KEY_ID, AWS_PROFILE, AWS_REGION)" +
                        (c.key_id.empty() ? "; the request was anonymous: no credentials were found" : ""));
  if (a.status == 301 || a.status == 307 || (a.status == 400 && a.why.find("Region") != std::string::npos))
    throw DataError(where, DataError::kNoOffset,
                    "the bucket is in another region or behind another endpoint (" + a.why + "); set AWS_REGION");
  throw DataError(where, offset, a.why.empty() ? "the request failed" : a.why);
}

}  // namespace

bool is_url(std::string_view path) noexcept { return path.substr(0, 5) == "s3://"; }

Url parse(const std::string& url) {
  if (!is_url(url)) throw Error("object storage: '" + url + "' is not an s3:// URL");
  const std::string rest = url.substr(5);
  const std::size_t slash = rest.find('/');
  Url u{rest.substr(0, slash), slash == std::string::npos ? std::string() : rest.substr(slash + 1)};
  if (u.bucket.empty()) throw Error("object storage: '" + url + "' names no bucket (s3://bucket/key)");
  return u;
}

std::uint64_t first_piece(const Url& url, std::size_t n, std::vector<std::byte>& out) {
  const Config c = config();
  out.resize(std::max<std::size_t>(n, 1));
  Request r = ranged(c, url, 0, out.size(), out.data());
  r.short_ok = true;
  const Answer a = run(c, r, url.text(), DataError::kNoOffset);
  if (!a.ok && a.status == 416) {  // an empty object has no first byte
    out.clear();
    return 0;
  }
  if (!a.ok) fail(c, a, url.text(), DataError::kNoOffset);
  std::string why;
  const std::optional<std::uint64_t> total = content_range_total(a.content_range, a.got, out.size(), why);
  if (!total) throw DataError(url.text(), DataError::kNoOffset, why);
  const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(*total, n));
  if (a.got < want)  // a cut answer (the retries passed it as short_ok): the object's start is not all here
    throw IoError(
        url.text(), a.got,
        "object storage: the answer held " + std::to_string(a.got) + " of the " + std::to_string(want) + " bytes asked for", EIO);
  out.resize(want);
  return *total;
}

std::uint64_t size(const Url& url) {
  std::vector<std::byte> first;
  return first_piece(url, 1, first);
}

void read(const Url& url, std::uint64_t offset, std::size_t n, std::byte* dst) {
  if (n == 0) return;
  const Config c = config();
  const Answer a = run(c, ranged(c, url, offset, n, dst), url.text(), offset);
  if (!a.ok && a.status == 416)
    throw DataError(url.text(), offset, "the object ends before this byte (" + std::to_string(n) + " bytes asked for)");
  if (!a.ok) fail(c, a, url.text(), offset);
  if (a.got != n)
    throw DataError(url.text(), offset + a.got,
                    "the object ends " + std::to_string(n - a.got) + " bytes before the " + std::to_string(n) + " asked for");
}

void get(const Url& url, std::vector<std::byte>& out) {
  const Config c = config();
  Request r;
  r.url = http_url(c, url.bucket, url.key, "");
  r.grow = &out;
  r.grow_limit = ~std::size_t{0};
  const Answer a = run(c, r, url.text(), DataError::kNoOffset);
  if (!a.ok) fail(c, a, url.text(), DataError::kNoOffset);
}

namespace {

// Reads in flight together on a multi handle and easy handles of their own (so that a read made
// meanwhile on the thread's shared handles, try_once, never receives their completions, and so
// that a Batch may end on another thread than the one that used it): start() sends them, at most
// `in_flight` at a time and the rest as those finish; take() waits for one. Transfers progress
// whenever the owner drives the multi handle; between, the kernel's socket buffers keep receiving.
// A thread's batch (start/take) lives until the thread exits; a ReadAhead's with its reader.
struct Batch {
  struct Item {
    Want want;
    Request request;
    Attempt attempt;
    std::vector<std::byte> out;
    enum State { Queued, Live, Done, Failed, Taken } state = Queued;
    bool sent = false;  // its request went out (a failed one is then sent again by the caller's read)
  };
  Config config;
  std::vector<std::unique_ptr<Item>> items;
  std::size_t next = 0, live = 0, in_flight = 32;
  CURLM* multi = nullptr;
  std::vector<CURL*> idle;  // easy handles between requests (connections stay in the multi handle)

  Batch() {
    global_init();
    multi = curl_multi_init();
    if (!multi) throw Error("object storage: libcurl could not make a multi handle");
  }
  ~Batch() {
    cancel();
    for (CURL* e : idle) curl_easy_cleanup(e);
    curl_multi_cleanup(multi);
  }
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;

  // Every live transfer stopped, its handle kept for the next batch, and the items dropped.
  void cancel() {
    for (auto& it : items) {
      if (!it->attempt.easy) continue;
      if (it->state == Item::Live) curl_multi_remove_handle(multi, it->attempt.easy);
      idle.push_back(std::exchange(it->attempt.easy, nullptr));
    }
    items.clear();
    next = live = 0;
  }

  void start(std::vector<Want> wants, std::size_t max_in_flight) {
    cancel();
    if (wants.empty()) return;
    config = s3::config();
    in_flight = std::max<std::size_t>(1, max_in_flight);
    for (Want& w : wants) {
      items.push_back(std::make_unique<Item>());
      items.back()->want = std::move(w);
    }
    fill();
    drive(0);
  }

  void launch(Item& it) {
    if (it.want.size > 0) {
      it.out.resize(it.want.size);
      it.request = ranged(config, it.want.url, it.want.offset, it.want.size, it.out.data());
      it.request.short_ok = it.want.first;
    } else {
      it.request.url = http_url(config, it.want.url.bucket, it.want.url.key, "");
      it.request.grow = &it.out;
      it.request.grow_limit = ~std::size_t{0};
    }
    Attempt& a = it.attempt;
    if (idle.empty()) {
      a.easy = curl_easy_init();
      if (!a.easy) throw Error("object storage: libcurl could not make a handle");
    } else {
      a.easy = idle.back();
      idle.pop_back();
      curl_easy_reset(a.easy);
    }
    setup(config, it.request, a, false);
    if (curl_multi_add_handle(multi, a.easy) != CURLM_OK) {
      idle.push_back(std::exchange(a.easy, nullptr));
      it.state = Item::Failed;
      return;
    }
    g_requests.fetch_add(1, std::memory_order_relaxed);
    detail::count_io(&detail::IoCounters::requests, 1);
    it.state = Item::Live;
    it.sent = true;
    ++live;
  }

  void fill() {
    while (next < items.size() && live < in_flight) launch(*items[next++]);
  }

  // Drives the transfers once: finished ones are judged, queued ones sent; waits up to
  // `wait_ms` for a socket when `wait_ms` > 0.
  void drive(int wait_ms) {
    int running = 0;
    if (curl_multi_perform(multi, &running) != CURLM_OK) throw Error("object storage: libcurl's transfer loop failed");
    int left = 0;
    while (CURLMsg* m = curl_multi_info_read(multi, &left)) {
      if (m->msg != CURLMSG_DONE) continue;
      for (auto& p : items) {
        Item& it = *p;
        if (it.attempt.easy != m->easy_handle) continue;
        const Outcome o = judge(it.attempt, m->data.result);
        curl_multi_remove_handle(multi, it.attempt.easy);
        idle.push_back(std::exchange(it.attempt.easy, nullptr));
        --live;
        const bool ok = o.kind == Outcome::Ok && (it.want.size == 0 ? !it.out.empty()
                                                  : it.want.first   ? it.attempt.got > 0
                                                                    : it.attempt.got == it.want.size);
        it.state = ok ? Item::Done : Item::Failed;
        if (!ok) it.out.clear();
        break;
      }
    }
    fill();
    if (wait_ms > 0 && live > 0) curl_multi_poll(multi, nullptr, 0, wait_ms, nullptr);
  }

  // A read of the batch that was sent and failed (or was dropped late): the caller's own read sends
  // it again, which the statistics count as a retry (ObjectStoreStats::retries).
  static void count_resent() {
    g_retries.fetch_add(1, std::memory_order_relaxed);
    detail::count_io(&detail::IoCounters::retries, 1);
  }

  // Item k's bytes into `out` once it has arrived; false when it failed or was taken. While it
  // waits, the reader's other reads in `meanwhile` are moved along too (every 2 ms at most), so
  // that their sockets do not fill and stall them behind this one.
  bool take(std::size_t k, std::vector<std::byte>& out, std::span<ReadAhead* const> meanwhile = {}) {
    if (k >= items.size()) return false;
    Item& it = *items[k];
    const auto waiting_since = std::chrono::steady_clock::now();
    while (it.state == Item::Queued || it.state == Item::Live) {
      if (detail::io_cancelled()) {  // the loader gave up: stop every transfer of the batch
        cancel();                    // (drops the items, `it` among them)
        return false;                // the caller's ordinary read then says so
      }
      drive(0);  // what has arrived is taken in first: a read is late only if nothing came
      if (it.state != Item::Queued && it.state != Item::Live) break;
      int wait_ms = 100;
      if (it.state == Item::Live && config.hedge_after >= 0 && !it.attempt.first_byte) {
        // A read sent ahead gets no hedge of its own: one the caller has waited for past the
        // hedge deadline without a first byte is dropped, and the caller's own read (retried,
        // hedged) takes over, rather than waiting out the stall limit.
        const double late =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting_since).count() - config.hedge_after;
        if (late >= 0) {
          curl_multi_remove_handle(multi, it.attempt.easy);
          idle.push_back(std::exchange(it.attempt.easy, nullptr));
          --live;
          it.state = Item::Failed;
          it.out.clear();
          fill();
          count_resent();
          return false;
        }
        wait_ms = std::clamp(static_cast<int>(-late * 1000) + 1, 1, 100);
      }
      bool others = false;
      for (ReadAhead* r : meanwhile)
        if (r && r->progress()) others = true;
      drive(others ? std::min(wait_ms, 2) : wait_ms);
    }
    if (it.state != Item::Done) {
      if (it.sent) count_resent();
      return false;
    }
    out.swap(it.out);
    it.state = Item::Taken;
    drive(0);  // what arrived meanwhile is judged and the queue refilled before the caller decodes
    return true;
  }
};

Batch& batch() {
  thread_local Batch b;
  return b;
}

}  // namespace

void start(std::vector<Want> wants, std::size_t in_flight) { batch().start(std::move(wants), in_flight); }

bool take(std::size_t k, std::vector<std::byte>& out) { return batch().take(k, out); }

struct ReadAhead::Impl {
  Batch batch;  // of one read
  std::vector<std::byte> buf;
};

ReadAhead::ReadAhead() : impl_(std::make_unique<Impl>()) {}
ReadAhead::~ReadAhead() = default;

void ReadAhead::start(const Url& url, std::uint64_t offset, std::size_t n) {
  std::vector<Want> one(1);
  one[0] = Want{url, offset, n};
  impl_->batch.start(std::move(one), 1);
}

bool ReadAhead::take(std::uint64_t offset, std::size_t n, std::byte* dst, std::span<ReadAhead* const> meanwhile) {
  Batch& b = impl_->batch;
  const bool match =
      b.items.size() == 1 && !b.items[0]->want.first && b.items[0]->want.offset == offset && b.items[0]->want.size == n;
  const bool ok = match && b.take(0, impl_->buf, meanwhile);
  b.cancel();
  if (ok) std::memcpy(dst, impl_->buf.data(), n);
  return ok;
}

void ReadAhead::start_first(const Url& url, std::size_t n) {
  std::vector<Want> one(1);
  one[0] = Want{url, 0, std::max<std::size_t>(n, 1), true};
  impl_->batch.start(std::move(one), 1);
}

bool ReadAhead::take_first(const Url& url, std::size_t n, std::vector<std::byte>& out, std::uint64_t& size) {
  Batch& b = impl_->batch;
  const bool match = b.items.size() == 1 && b.items[0]->want.first && b.items[0]->want.url.bucket == url.bucket &&
                     b.items[0]->want.url.key == url.key && b.items[0]->want.size == std::max<std::size_t>(n, 1);
  if (!match || !b.take(0, out)) {
    b.cancel();
    return false;
  }
  const Attempt& a = b.items[0]->attempt;
  std::string why;
  const std::optional<std::uint64_t> total = content_range_total(a.content_range, a.got, b.items[0]->want.size, why);
  const std::size_t got = a.got;
  b.cancel();
  if (!total || got < std::min<std::uint64_t>(*total, n)) return false;  // the caller's own read names what is wrong
  out.resize(static_cast<std::size_t>(std::min<std::uint64_t>(*total, n)));
  size = *total;
  return true;
}

bool ReadAhead::progress() {
  if (impl_->batch.live > 0) impl_->batch.drive(0);
  return impl_->batch.live > 0;
}

void ReadAhead::cancel() { impl_->batch.cancel(); }

std::vector<Object> list(const std::string& bucket, const std::string& prefix) {
  std::vector<Object> all;
  std::string token;
  const std::string where = "s3://" + bucket + "/" + prefix;
  const Config c = config();
  for (int page = 0;; ++page) {
    std::string query;  // SigV4 wants the parameters sorted by name and encoded
    if (!token.empty()) query += "continuation-token=" + encode(token, false) + "&";
    query += "list-type=2&prefix=" + encode(prefix, false);
    Request r;
    r.url = http_url(c, bucket, "", query);
    std::vector<std::byte> body;
    r.grow = &body;
    r.grow_limit = kListLimit;
    const Answer a = run(c, r, where, DataError::kNoOffset);
    if (!a.ok) fail(c, a, where, DataError::kNoOffset);
    ListPage lp = parse_list(std::string_view(reinterpret_cast<const char*>(body.data()), body.size()), where);
    for (Object& o : lp.objects) all.push_back(std::move(o));
    if (!lp.truncated) break;
    if (lp.next_token == token)
      throw DataError(where, DataError::kNoOffset, "the object store's listing repeats its continuation token");
    token = lp.next_token;
  }
  std::sort(all.begin(), all.end(), [](const Object& a, const Object& b) { return a.key < b.key; });
  return all;
}

}  // namespace ferry::loaders::s3

namespace ferry {

ObjectStoreStats object_store_stats() noexcept {
  using namespace loaders::s3;
  ObjectStoreStats s;
  s.requests = g_requests.load(std::memory_order_relaxed);
  s.bytes = g_bytes.load(std::memory_order_relaxed);
  s.retries = g_retries.load(std::memory_order_relaxed);
  s.hedges = g_hedges.load(std::memory_order_relaxed);
  s.hedges_won = g_hedges_won.load(std::memory_order_relaxed);
  s.cache_hits = loaders::cache::hits();
  s.cache_bytes = loaders::cache::hit_bytes();
  return s;
}

}  // namespace ferry
