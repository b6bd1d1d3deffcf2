// A fault-injecting HTTP proxy on loopback, between ferry's S3 client and the real server: it
// forwards each request as it came (the signature stays valid) and, as told, answers it with a
// 503, resets the connection, cuts the body short, delays the answer, or never answers; "down"
// refuses every connection, as a stopped server would. A delayed answer that passes is relayed
// as it arrives, its first byte held (a store's first-byte latency, not a wait for the whole
// body). Each client connection gets a thread; all end when the proxy is destroyed.
#pragma once

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ferry::test {

class FaultProxy {
 public:
  enum class Fault { None, Status503, Reset, CutShort, Hang };

  explicit FaultProxy(int upstream_port) : upstream_(upstream_port) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (::bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(listener_, 64) != 0 ||
        ::getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      throw std::runtime_error("FaultProxy: cannot listen on loopback");
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
  }

  ~FaultProxy() {
    stopping_ = true;
    acceptor_.join();
    ::close(listener_);
    std::vector<std::thread> threads;
    {
      std::lock_guard lock(mu_);
      threads.swap(threads_);
    }
    for (std::thread& t : threads) t.join();
  }

  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }

  /// The next requests meet these faults, one each, in order; then requests pass.
  void inject(std::initializer_list<Fault> faults) {
    std::lock_guard lock(mu_);
    faults_.insert(faults_.end(), faults);
  }
  /// Every answer waits this long before its first byte (0: none); `first_only`: only the next
  /// request's.
  void delay(std::chrono::milliseconds d, bool first_only = false) {
    std::lock_guard lock(mu_);
    delay_ = d;
    delay_once_ = first_only;
  }
  /// Down: connections are accepted and closed at once, as by a server that is not there.
  void down(bool is_down) { down_ = is_down; }
  /// Requests seen (forwarded or faulted).
  int requests() const { return requests_.load(); }
  /// Hung requests whose client closed the connection (gave up on the answer).
  int hangs_ended_by_client() const { return hangs_ended_by_client_.load(); }
  /// Client connections open now (counted while they are open, not when they end).
  int open_connections() const { return open_.load(); }

  FaultProxy(const FaultProxy&) = delete;
  FaultProxy& operator=(const FaultProxy&) = delete;

 private:
  void accept_loop() {
    while (!stopping_) {
      pollfd p{listener_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int c = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      if (down_) {
        reset(c);
        continue;
      }
      std::lock_guard lock(mu_);
      threads_.emplace_back([this, c] { serve(c); });
    }
  }

  static void reset(int fd) {
    linger l{1, 0};  // close with a RST
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    ::close(fd);
  }

  // Reads until `until` appears in `buf` or the socket ends; false on end, error or stop.
  bool read_until(int fd, std::string& buf, const std::string& until) {
    while (buf.find(until) == std::string::npos) {
      if (!read_some(fd, buf)) return false;
    }
    return true;
  }
  bool read_some(int fd, std::string& buf) {
    for (;;) {
      if (stopping_) return false;
      pollfd p{fd, POLLIN, 0};
      const int r = ::poll(&p, 1, 50);
      if (r == 0) continue;
      char tmp[65536];
      const ssize_t n = ::recv(fd, tmp, sizeof tmp, 0);
      if (n <= 0) return false;
      buf.append(tmp, static_cast<std::size_t>(n));
      return true;
    }
  }
  static bool send_all(int fd, const char* p, std::size_t n) {
    while (n > 0) {
      const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
      if (k <= 0) return false;
      p += k;
      n -= static_cast<std::size_t>(k);
    }
    return true;
  }
  static std::size_t content_length(const std::string& head) {
    std::string lower = head;
    for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    const std::size_t at = lower.find("\r\ncontent-length:");
    return at == std::string::npos ? 0 : std::stoull(head.substr(at + 17));
  }

  // One client connection: request after request (keep-alive), each forwarded on a fresh
  // upstream connection.
  void serve(int client) {
    ++open_;
    struct Closed {
      std::atomic<int>& open;
      ~Closed() { --open; }
    } closed{open_};
    std::string in;
    while (!stopping_) {
      if (!read_until(client, in, "\r\n\r\n")) break;
      const std::size_t head_end = in.find("\r\n\r\n") + 4;
      const std::size_t body = content_length(in.substr(0, head_end));
      while (in.size() < head_end + body)
        if (!read_some(client, in)) goto done;
      {
        const std::string request = in.substr(0, head_end + body);
        in.erase(0, head_end + body);
        ++requests_;
        Fault fault = Fault::None;
        std::chrono::milliseconds wait{0};
        {
          std::lock_guard lock(mu_);
          if (!faults_.empty()) {
            fault = faults_.front();
            faults_.pop_front();
          }
          wait = delay_;
          if (delay_once_) delay_ = std::chrono::milliseconds(0);
        }
        if (fault == Fault::Reset) break;  // reset below
        if (fault == Fault::Hang) {        // no answer, until the client gives up (or the proxy stops)
          while (!stopping_) {
            pollfd p{client, POLLIN, 0};
            if (::poll(&p, 1, 20) <= 0) continue;
            char byte;
            if (::recv(client, &byte, 1, MSG_PEEK) <= 0) {
              ++hangs_ended_by_client_;
              break;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
          break;
        }
        if (fault == Fault::Status503) {
          const std::string text =
              "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate."
              "</Message></Error>";
          const std::string answer = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nContent-Length: " +
                                     std::to_string(text.size()) + "\r\n\r\n" + text;
          if (!send_all(client, answer.data(), answer.size())) break;
          continue;
        }
        const auto first_byte = std::chrono::steady_clock::now() + wait;
        if (fault == Fault::None) {  // the answer's bytes pass on as they come, the first held until `first_byte`
          if (!relay(client, request, first_byte)) break;
          continue;
        }
        std::string answer;
        if (!forward(request, answer)) break;
        hold_until(first_byte);
        if (fault == Fault::CutShort) {  // the headers and half the body, then the connection ends
          const std::size_t head = answer.find("\r\n\r\n") + 4;
          send_all(client, answer.data(), head + (answer.size() - head) / 2);
          ::close(client);
          return;
        }
        if (!send_all(client, answer.data(), answer.size())) break;
      }
    }
  done:
    reset(client);
  }

  void hold_until(std::chrono::steady_clock::time_point t) const {
    while (!stopping_ && std::chrono::steady_clock::now() < t) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }

  // Sends `request` upstream on a fresh connection and reads the answer's head (and what came
  // with it); `want` is the answer's whole length. False on a failed connection or read.
  bool send_upstream(const std::string& request, int& s, std::string& answer, std::size_t& want) {
    s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(upstream_));
    bool ok = ::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && send_all(s, request.data(), request.size());
    if (ok) ok = read_until(s, answer, "\r\n\r\n");
    if (ok) {
      const std::size_t head = answer.find("\r\n\r\n") + 4;
      const bool no_body = request.compare(0, 5, "HEAD ") == 0;
      want = head + (no_body ? 0 : content_length(answer.substr(0, head)));
    }
    return ok;
  }

  // The whole answer to `request`, read before any of it is passed on (for faults that need it).
  bool forward(const std::string& request, std::string& answer) {
    int s = -1;
    std::size_t want = 0;
    bool ok = send_upstream(request, s, answer, want);
    while (ok && answer.size() < want) ok = read_some(s, answer);
    if (ok) answer.resize(want);
    ::close(s);
    return ok;
  }

  // The answer to `request` passed on as it arrives, its first byte not before `first_byte`: a
  // store's first-byte latency, then its bytes at the rate they come.
  bool relay(int client, const std::string& request, std::chrono::steady_clock::time_point first_byte) {
    int s = -1;
    std::size_t want = 0;
    std::string head;
    bool ok = send_upstream(request, s, head, want);
    hold_until(first_byte);
    std::size_t sent = std::min(head.size(), want);
    ok = ok && !stopping_ && send_all(client, head.data(), sent);
    std::vector<char> buf(std::size_t{1} << 20);
    while (ok && sent < want) {
      pollfd p{s, POLLIN, 0};
      const int r = ::poll(&p, 1, 50);
      if (stopping_) ok = false;
      if (r <= 0 || !ok) continue;
      const ssize_t n = ::recv(s, buf.data(), std::min(buf.size(), want - sent), 0);
      if (n <= 0)
        ok = false;
      else
        ok = send_all(client, buf.data(), static_cast<std::size_t>(n)), sent += static_cast<std::size_t>(n);
    }
    ::close(s);
    return ok;
  }

  int upstream_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false}, down_{false};
  std::atomic<int> requests_{0};
  std::atomic<int> hangs_ended_by_client_{0};
  std::atomic<int> open_{0};
  std::mutex mu_;
  std::deque<Fault> faults_;
  std::chrono::milliseconds delay_{0};
  bool delay_once_ = false;
  std::vector<std::thread> threads_;
  std::thread acceptor_;
};

}  // namespace ferry::test
