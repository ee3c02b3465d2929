#include "tests/support/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace lk::test {

std::string BinDir() {
  const char* d = std::getenv("LK_BIN_DIR");
  return d ? d : "./bin";
}

std::string SourceDir() {
  const char* d = std::getenv("LK_SOURCE_DIR");
  return d ? d : ".";
}

std::string TempDir(const std::string& tag) {
  static int n = 0;
  auto dir = std::filesystem::temp_directory_path() /
             ("lk-test-" + tag + "-" + std::to_string(getpid()) + "-" + std::to_string(n++));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

Process::Process(std::vector<std::string> argv, std::string log_path,
                 std::map<std::string, std::string> env)
    : log_path_(std::move(log_path)) {
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos && env.count(kv.substr(0, eq))) continue;
    envs.push_back(kv);
  }
  for (auto& [k, v] : env) envs.push_back(k + "=" + v);
  std::vector<char*> cargv, cenv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  for (auto& e : envs) cenv.push_back(e.data());
  cenv.push_back(nullptr);
  int fd = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot open log " + log_path_);
  pid_ = ::fork();
  if (pid_ == 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::setpgid(0, 0);
    ::execve(cargv[0], cargv.data(), cenv.data());
    std::fprintf(stderr, "exec %s failed\n", cargv[0]);
    ::_exit(127);
  }
  ::close(fd);
  if (pid_ < 0) throw std::runtime_error("fork failed");
}

Process::~Process() {
  if (Running()) {
    ::kill(pid_, SIGKILL);
    Wait(std::chrono::seconds(10));
  }
}

void Process::Signal(int sig) {
  if (!exit_code_) ::kill(pid_, sig);
}

std::optional<int> Process::Wait(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!exit_code_) {
    int status = 0;
    pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return exit_code_;
}

bool Process::Running() { return !Wait(std::chrono::milliseconds(0)).has_value(); }

std::string Process::Log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Process::WaitForLog(const std::string& needle, std::chrono::milliseconds timeout,
                                size_t occurrence) const {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    std::string log = Log();
    size_t pos = 0, seen = 0;
    while ((pos = log.find(needle, pos)) != std::string::npos) {
      if (++seen == occurrence) {
        auto start = log.rfind('\n', pos);
        start = start == std::string::npos ? 0 : start + 1;
        return log.substr(start, log.find('\n', pos) - start);
      }
      pos += needle.size();
    }
    if (std::chrono::steady_clock::now() >= deadline) return "";
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

Lighthouse StartLighthouse(const std::string& data_dir, const std::vector<std::string>& extra,
                           const std::string& log_path, const std::string& bind) {
  // Count earlier starts in this log, so a restart waits for its own "listening" line.
  size_t before = 0;
  {
    std::ifstream in(log_path);
    std::string line;
    while (std::getline(in, line)) before += line.find("listening address=") != std::string::npos;
  }
  std::vector<std::string> argv = {BinDir() + "/lighthouse", "--bind", bind, "--data-dir",
                                   data_dir};
  argv.insert(argv.end(), extra.begin(), extra.end());
  Lighthouse lh;
  lh.process = std::make_unique<Process>(argv, log_path);
  std::string line = lh.process->WaitForLog("listening address=", std::chrono::seconds(20),
                                            before + 1);
  if (line.empty()) throw std::runtime_error("lighthouse did not start: " + lh.process->Log());
  auto pos = line.find("listening address=") + std::string("listening address=").size();
  lh.address = line.substr(pos, line.find(' ', pos) - pos);
  return lh;
}

std::string JsonField(const std::string& line, const std::string& key) {
  auto pos = line.find("\"" + key + "\":");
  if (pos == std::string::npos) return "";
  pos += key.size() + 3;
  if (line[pos] == '"') return line.substr(pos + 1, line.find('"', pos + 1) - pos - 1);
  auto end = line.find_first_of(",}", pos);
  return line.substr(pos, end - pos);
}

int ConnectTcp(const std::string& hostport) {
  auto colon = hostport.rfind(':');
  if (colon == std::string::npos) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(hostport.substr(colon + 1))));
  if (inet_pton(AF_INET, hostport.substr(0, colon).c_str(), &addr.sin_addr) != 1) return -1;
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace lk::test
