// Test support: start real binaries as child processes, send them signals, wait for them with a
// bound, and read their logs. Integration tests use it to kill, pause and restart processes.
// Thread-safety: one Process per thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lk::test {

// The directory of the built binaries (LK_BIN_DIR, set by CTest) and of the sources.
std::string BinDir();
std::string SourceDir();
// A fresh empty directory under /tmp for this test.
std::string TempDir(const std::string& tag);
// The raw text of "key":VALUE in a one-line JSON object (numbers, booleans, strings unquoted);
// empty when the key is missing. For the JSON-lines logs of trainers and tests.
std::string JsonField(const std::string& line, const std::string& key);
// A blocking TCP connection to "IPV4:PORT"; -1 when it cannot be made.
int ConnectTcp(const std::string& hostport);

class Process {
 public:
  // Starts `argv` with `env` added to this process's environment; stdout and stderr go to
  // `log_path` (appended).
  Process(std::vector<std::string> argv, std::string log_path,
          std::map<std::string, std::string> env = {});
  ~Process();  // SIGKILLs the child if it still runs
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  void Signal(int sig);
  // Waits for the exit; nullopt when it did not exit within `timeout`. The value is the exit
  // code, or 128+signal when killed by a signal.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  bool Running();
  std::string Log() const;
  // Waits until the log has a line containing `needle`; returns the line (or empty on timeout).
  std::string WaitForLog(const std::string& needle, std::chrono::milliseconds timeout,
                         size_t occurrence = 1) const;
  const std::string& log_path() const { return log_path_; }

 private:
  pid_t pid_ = -1;
  std::string log_path_;
  std::optional<int> exit_code_;
};

// Starts the lighthouse on 127.0.0.1:0 with the given data dir and extra flags and returns the
// address it logged ("127.0.0.1:PORT").
struct Lighthouse {
  std::unique_ptr<Process> process;
  std::string address;
  std::string url() const { return "http://" + address; }
};
Lighthouse StartLighthouse(const std::string& data_dir, const std::vector<std::string>& extra,
                           const std::string& log_path, const std::string& bind = "127.0.0.1:0");

}  // namespace lk::test
