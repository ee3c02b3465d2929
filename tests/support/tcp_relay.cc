#include "tests/support/tcp_relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <stdexcept>

#include "tests/support/process.h"

namespace lk::test {

TcpRelay::TcpRelay(std::string upstream) : upstream_(std::move(upstream)) {
  listen_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_ < 0) throw std::runtime_error("relay: socket");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::listen(listen_, 64) != 0 ||
      ::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(listen_);
    throw std::runtime_error("relay: bind");
  }
  port_ = ntohs(a.sin_port);
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

TcpRelay::~TcpRelay() {
  stopping_ = true;
  ::shutdown(listen_, SHUT_RDWR);  // wakes accept(2)
  acceptor_.join();
  CloseRelayed();
  std::vector<std::thread> pumps;
  {
    std::lock_guard lock(mu_);
    pumps.swap(pumps_);
  }
  for (auto& t : pumps) t.join();
  ::close(listen_);
}

std::string TcpRelay::address() const { return "127.0.0.1:" + std::to_string(port_); }

void TcpRelay::Cut() {
  cut_ = true;
  CloseRelayed();
}

void TcpRelay::Mend() { cut_ = false; }

void TcpRelay::CloseRelayed() {
  std::lock_guard lock(mu_);
  // shutdown, not close: the pump owns the descriptors and closes them when it sees the end.
  for (int fd : relayed_) ::shutdown(fd, SHUT_RDWR);
}

void TcpRelay::AcceptLoop() {
  while (!stopping_) {
    int client = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return;
    }
    int up = cut_ ? -1 : ConnectTcp(upstream_);
    if (up < 0) {
      ::close(client);
      continue;
    }
    std::lock_guard lock(mu_);
    relayed_.push_back(client);
    relayed_.push_back(up);
    pumps_.emplace_back([this, client, up] { Pump(client, up); });
  }
}

void TcpRelay::Pump(int client, int up) {
  pollfd fds[2] = {{client, POLLIN, 0}, {up, POLLIN, 0}};
  char buf[65536];
  bool open = true;
  while (open) {
    if (::poll(fds, 2, 200) < 0 && errno != EINTR) break;
    for (int i = 0; i < 2 && open; ++i) {
      if (fds[i].revents == 0) continue;
      ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n <= 0) {
        open = false;
        break;
      }
      for (ssize_t sent = 0; sent < n;) {
        ssize_t w = ::send(fds[1 - i].fd, buf + sent, static_cast<size_t>(n - sent), MSG_NOSIGNAL);
        if (w <= 0) {
          open = false;
          break;
        }
        sent += w;
      }
    }
  }
  std::lock_guard lock(mu_);
  for (int fd : {client, up}) {
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
    relayed_.erase(std::remove(relayed_.begin(), relayed_.end(), fd), relayed_.end());
  }
}

}  // namespace lk::test
