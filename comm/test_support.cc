#include "comm/test_support.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/http/client.h"

extern char** environ;

namespace lk::comm::testing {

using SteadyClock = std::chrono::steady_clock;

std::string BinDir() {
  const char* d = std::getenv("LK_BIN_DIR");
  return d ? d : "./bin";
}

std::string TempDir(const std::string& tag) {
  static std::atomic<int> n{0};
  auto dir =
      std::filesystem::temp_directory_path() / fmt::format("lk-comm-{}-{}-{}", tag, getpid(), n++);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

Child::Child(const std::vector<std::string>& argv, const std::string& log_path,
             const std::map<std::string, std::string>& env)
    : log_path_(log_path) {
  // Everything is prepared before fork(): the child only dups and execs.
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    if (env.count(kv.substr(0, kv.find('=')))) continue;
    envs.push_back(kv);
  }
  for (const auto& [k, v] : env) envs.push_back(k + "=" + v);
  std::vector<std::string> args = argv;
  std::vector<char*> cargv, cenv;
  for (auto& a : args) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  for (auto& e : envs) cenv.push_back(e.data());
  cenv.push_back(nullptr);
  int in_pipe[2], out_pipe[2];
  LK_CHECK(pipe2(in_pipe, O_CLOEXEC) == 0 && pipe2(out_pipe, O_CLOEXEC) == 0) << "pipe";
  int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  LK_CHECK(log_fd >= 0) << "open " << log_path;
  pid_ = ::fork();
  LK_CHECK(pid_ >= 0) << "fork";
  if (pid_ == 0) {
    ::dup2(in_pipe[0], 0);
    ::dup2(out_pipe[1], 1);
    ::dup2(log_fd, 2);
    ::execve(cargv[0], cargv.data(), cenv.data());
    ::_exit(127);
  }
  ::close(in_pipe[0]);
  ::close(out_pipe[1]);
  ::close(log_fd);
  in_fd_ = in_pipe[1];
  out_fd_ = out_pipe[0];
}

Child::~Child() {
  if (!exit_code_) {
    Signal(SIGKILL);
    (void)Wait(std::chrono::seconds(10));
  }
  ::close(in_fd_);
  ::close(out_fd_);
}

bool Child::Send(const std::string& line) {
  std::string data = line + "\n";
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::write(in_fd_, data.data() + off, data.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

std::optional<std::string> Child::ReadLine(std::chrono::milliseconds timeout) {
  auto deadline = SteadyClock::now() + timeout;
  for (;;) {
    if (auto nl = buffered_.find('\n'); nl != std::string::npos) {
      std::string line = buffered_.substr(0, nl);
      buffered_.erase(0, nl + 1);
      return line;
    }
    auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now());
    if (left.count() <= 0) return std::nullopt;
    pollfd p{out_fd_, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return std::nullopt;
    char buf[4096];
    ssize_t n = ::read(out_fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::nullopt;
    buffered_.append(buf, static_cast<size_t>(n));
  }
}

void Child::Signal(int sig) {
  if (!exit_code_) ::kill(pid_, sig);
}

std::optional<int> Child::Wait(std::chrono::milliseconds timeout) {
  if (exit_code_) return exit_code_;
  auto deadline = SteadyClock::now() + timeout;
  for (;;) {
    int status = 0;
    pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    if (SteadyClock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::string Child::Log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Result<Lighthouse> StartLighthouse(const std::string& dir, const std::string& bind) {
  Lighthouse lh;
  std::string log = dir + "/lighthouse.log";
  lh.process = std::make_unique<Child>(
      std::vector<std::string>{BinDir() + "/lighthouse", "--bind", bind, "--data-dir",
                               dir + "/lh-data"},
      log);
  auto deadline = SteadyClock::now() + std::chrono::seconds(20);
  while (SteadyClock::now() < deadline) {
    std::string text = lh.process->Log();
    if (auto at = text.find("listening address="); at != std::string::npos) {
      auto begin = at + std::string("listening address=").size();
      auto end = text.find_first_of(" \n", begin);
      if (end != std::string::npos) {
        lh.address = text.substr(begin, end - begin);
        return lh;
      }
    }
    if (lh.process->Wait(std::chrono::milliseconds(0))) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return Error(Code::kUnavailable, "lighthouse did not start; log:\n{}", lh.process->Log());
}

Result<uint32_t> NewQuorum(const std::string& url, const std::string& job) {
  static std::atomic<int> incarnation{0};
  LK_ASSIGN_OR_RETURN(auto client, http::Client::Create(url));
  std::string body = fmt::format(
      R"({{"job":"{}","group_id":"g0","incarnation":"i{}-{}","nodes":1,"step":0,"timeout_ms":5000}})",
      job, getpid(), incarnation++);
  LK_ASSIGN_OR_RETURN(http::Response r,
                      client->Do("POST", "/v1/quorum", body, "application/json", Millis(10'000)));
  LK_RETURN_IF_ERROR(http::StatusFromResponse(r));
  // The answer is JSON; quorum_id is a plain number field in it.
  auto at = r.body.find("\"quorum_id\"");
  if (at == std::string::npos) return Error(Code::kInternal, "no quorum_id in {}", r.body);
  at = r.body.find(':', at);
  return static_cast<uint32_t>(std::strtoul(r.body.c_str() + at + 1, nullptr, 10));
}

}  // namespace lk::comm::testing
