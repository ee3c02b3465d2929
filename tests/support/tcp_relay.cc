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

TcpRelay::TcpRelay(std::string upstream) : upstream_(std::move(upstream)) { Listen(); }

TcpRelay::TcpRelay(ConnectProxy proxy) : proxy_(std::move(proxy)) { Listen(); }

void TcpRelay::Listen() {
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

std::vector<std::string> TcpRelay::Targets() const {
  std::lock_guard lock(mu_);
  return targets_;
}

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
    if (cut_) {
      ::close(client);
      continue;
    }
    std::lock_guard lock(mu_);
    relayed_.push_back(client);
    pumps_.emplace_back([this, client] {
      int up = proxy_ ? OpenTunnel(client) : ConnectTcp(upstream_);
      if (up >= 0) {
        std::lock_guard lock(mu_);
        relayed_.push_back(up);
      }
      Pump(client, up);
    });
  }
}

int TcpRelay::OpenTunnel(int client) {
  // The request head, up to its blank line; a proxy reads no further before it answers.
  std::string head;
  char c;
  while (head.size() < 8192 && head.find("\r\n\r\n") == std::string::npos) {
    pollfd p{client, POLLIN, 0};
    if (::poll(&p, 1, 5000) <= 0 || ::read(client, &c, 1) != 1) return -1;
    head += c;
  }
  auto answer = [&](const char* status) {
    std::string a = std::string("HTTP/1.1 ") + status + "\r\n\r\n";
    (void)::send(client, a.data(), a.size(), MSG_NOSIGNAL);
  };
  if (head.rfind("CONNECT ", 0) != 0) {
    answer("405 Method Not Allowed");
    return -1;
  }
  const size_t end = head.find(' ', 8);
  const std::string target = head.substr(8, end == std::string::npos ? 0 : end - 8);
  {
    std::lock_guard lock(mu_);
    targets_.push_back(target);
  }
  if (!proxy_->auth.empty() &&
      head.find("\r\nProxy-Authorization: " + proxy_->auth + "\r\n") == std::string::npos) {
    answer("407 Proxy Authentication Required");
    return -1;
  }
  const size_t colon = target.rfind(':');
  std::string host = target.substr(0, colon == std::string::npos ? 0 : colon);
  if (auto it = proxy_->names.find(host); it != proxy_->names.end()) host = it->second;
  int up = colon == std::string::npos ? -1 : ConnectTcp(host + target.substr(colon));
  if (up < 0) {
    answer("502 Bad Gateway");
    return -1;
  }
  answer("200 Connection established");
  return up;
}

void TcpRelay::Pump(int client, int up) {
  pollfd fds[2] = {{client, POLLIN, 0}, {up, POLLIN, 0}};
  char buf[65536];
  bool open = up >= 0;
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
    if (fd < 0) continue;
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
    relayed_.erase(std::remove(relayed_.begin(), relayed_.end(), fd), relayed_.end());
  }
}

}  // namespace lk::test
