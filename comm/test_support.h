// Test and benchmark support for the communicator: child processes driven over pipes, and a
// real lighthouse on 127.0.0.1:0 to rendezvous through. (tests/support is defined after this
// folder in the build, so these few lines live here.)
// Thread-safety: one Child per thread; the free functions are safe from any thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <lightkeeper/status.h>

namespace lk::comm::testing {

std::string BinDir();                         // LK_BIN_DIR, set by CTest
std::string TempDir(const std::string& tag);  // a fresh empty directory under /tmp

// A child process whose stdin and stdout are pipes to us (one command / one answer per line)
// and whose stderr is appended to `log_path`.
class Child {
 public:
  Child(const std::vector<std::string>& argv, const std::string& log_path,
        const std::map<std::string, std::string>& env = {});
  ~Child();  // SIGKILLs the child if it still runs
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  bool Send(const std::string& line);
  // The next line of stdout, or nullopt when none came within `timeout` or stdout closed.
  std::optional<std::string> ReadLine(std::chrono::milliseconds timeout);
  void Signal(int sig);
  // The exit code (128+signal when killed), or nullopt when it did not exit within `timeout`.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  std::string Log() const;

 private:
  pid_t pid_ = -1;
  int in_fd_ = -1;
  int out_fd_ = -1;
  std::string buffered_;
  std::string log_path_;
  std::optional<int> exit_code_;
};

struct Lighthouse {
  std::unique_ptr<Child> process;
  std::string address;  // "127.0.0.1:PORT"
  std::string url() const { return "http://" + address; }
};
// Starts ${LK_BIN_DIR}/lighthouse on `bind` (port 0: any) and waits for its listening address.
Result<Lighthouse> StartLighthouse(const std::string& dir, const std::string& bind = "127.0.0.1:0");

// Makes the lighthouse issue a new quorum for `job` (one group asking with a fresh incarnation
// each time) and returns its quorum_id: the epoch that the KV then accepts keys under.
Result<uint32_t> NewQuorum(const std::string& url, const std::string& job);

}  // namespace lk::comm::testing
