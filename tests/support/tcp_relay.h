// Test support: a TCP relay on 127.0.0.1 in front of one address, which a test can cut and
// mend. Cut, it takes every new connection and closes it at once and closes the ones it relays,
// as a link that is down does to an HTTP client (the call fails as unavailable); mended, it
// relays bytes both ways again. Integration tests put one process's view of the lighthouse
// behind it, to take that process alone off the network for a while.
// It can also be an HTTP CONNECT proxy (the kind a site's compute nodes reach the outside
// through): each connection's first request names its upstream.
// Thread-safety: Cut, Mend and Targets from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace lk::test {

class TcpRelay {
 public:
  // Relays to `upstream`, "IPV4:PORT".
  explicit TcpRelay(std::string upstream);
  // A CONNECT proxy: a connection's request "CONNECT HOST:PORT" gets "200" and is relayed to
  // HOST:PORT from then on. `names` maps host names only the proxy can resolve to IPv4
  // addresses (other hosts must be IPv4 literals; anything else gets 502). When `auth` is not
  // empty, a CONNECT without "Proxy-Authorization: AUTH" gets 407.
  struct ConnectProxy {
    std::map<std::string, std::string> names;
    std::string auth;
  };
  explicit TcpRelay(ConnectProxy proxy);
  ~TcpRelay();
  TcpRelay(const TcpRelay&) = delete;
  TcpRelay& operator=(const TcpRelay&) = delete;

  // "127.0.0.1:PORT" of the relay's own listening socket.
  std::string address() const;
  void Cut();
  void Mend();
  // A proxy's CONNECT targets so far, in order, as requested ("HOST:PORT"), refused ones
  // included.
  std::vector<std::string> Targets() const;

 private:
  void AcceptLoop();
  void Listen();
  void Pump(int client, int up);
  // Reads the CONNECT request on `client`, answers it and returns the upstream connection (-1
  // after a refusal, which it has answered).
  int OpenTunnel(int client);
  void CloseRelayed();

  std::string upstream_;
  std::optional<ConnectProxy> proxy_;
  int listen_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> cut_{false};
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  mutable std::mutex mu_;
  std::vector<std::string> targets_;
  std::vector<int> relayed_;  // both ends of every relayed connection, until closed
  std::vector<std::thread> pumps_;
};

}  // namespace lk::test
