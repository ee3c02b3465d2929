// Test support: a TCP relay on 127.0.0.1 in front of one address, which a test can cut and
// mend. Cut, it takes every new connection and closes it at once and closes the ones it relays,
// as a link that is down does to an HTTP client (the call fails as unavailable); mended, it
// relays bytes both ways again. Integration tests put one process's view of the lighthouse
// behind it, to take that process alone off the network for a while.
// Thread-safety: Cut and Mend from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lk::test {

class TcpRelay {
 public:
  // Relays to `upstream`, "IPV4:PORT".
  explicit TcpRelay(std::string upstream);
  ~TcpRelay();
  TcpRelay(const TcpRelay&) = delete;
  TcpRelay& operator=(const TcpRelay&) = delete;

  // "127.0.0.1:PORT" of the relay's own listening socket.
  std::string address() const;
  void Cut();
  void Mend();

 private:
  void AcceptLoop();
  void Pump(int client, int up);
  void CloseRelayed();

  std::string upstream_;
  int listen_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> cut_{false};
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<int> relayed_;  // both ends of every relayed connection, until closed
  std::vector<std::thread> pumps_;
};

}  // namespace lk::test
