// rendezvous.h — hands NCCL's unique id from rank 0 to the other ranks over one TCP socket, so a
// C++ program started by torchrun (--no-python), mpirun or srun needs no MPI library and no
// shared file system. Rank 0 listens on MASTER_ADDR:port, where port is FERRY_NCCL_PORT or
// MASTER_PORT + 1 (torchrun's own store holds MASTER_PORT), default 29501; the others connect,
// retrying for up to 60 s, and read the id's bytes. Example code, POSIX only.
#pragma once

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

namespace ddp {

inline std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

inline int rendezvous_port() {
  if (const char* p = std::getenv("FERRY_NCCL_PORT")) return std::atoi(p);
  return std::atoi(env_or("MASTER_PORT", "29500").c_str()) + 1;
}

/// Rank 0: sends `size` bytes at `data` to each of the world_size - 1 others. Others: receives
/// them. Throws std::runtime_error naming the address and what failed.
inline void exchange(void* data, std::size_t size, int rank, int world_size) {
  if (world_size <= 1) return;
  const std::string host = env_or("MASTER_ADDR", "127.0.0.1");
  const int port = rendezvous_port();
  const std::string where = host + ":" + std::to_string(port);
  auto fail = [&](const std::string& what) {
    return std::runtime_error("rendezvous at " + where + ": " + what + ": " + std::strerror(errno));
  };
  auto full = [](int fd, char* p, std::size_t n, bool send_it) {
    while (n) {
      const ssize_t k = send_it ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
      if (k <= 0) return false;
      p += k;
      n -= static_cast<std::size_t>(k);
    }
    return true;
  };
  if (rank == 0) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) throw fail("socket");
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, world_size) != 0) {
      ::close(fd);
      throw fail("bind/listen (set FERRY_NCCL_PORT to a free port)");
    }
    for (int served = 1; served < world_size; ++served) {
      const int c = ::accept(fd, nullptr, nullptr);
      if (c < 0 || !full(c, static_cast<char*>(data), size, true)) {
        if (c >= 0) ::close(c);
        ::close(fd);
        throw fail("accept/send");
      }
      ::close(c);
    }
    ::close(fd);
    return;
  }
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) throw fail("cannot resolve");
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      const bool ok = full(fd, static_cast<char*>(data), size, false);
      ::close(fd);
      ::freeaddrinfo(res);
      if (!ok) throw fail("receive");
      return;
    }
    if (fd >= 0) ::close(fd);
    if (std::chrono::steady_clock::now() > give_up) {
      ::freeaddrinfo(res);
      throw fail("rank 0 did not answer in 60 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace ddp
