#include "slurm/command.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

extern char** environ;

namespace lk::slurm {
namespace {

// Outputs larger than this are cut: the commands run here answer in a few lines, and an
// unbounded read would let a misbehaving binary exhaust memory.
constexpr size_t kOutputBytesMax = 1 << 20;

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { Close(); }
  void Reset(int fd) {
    Close();
    fd_ = fd;
  }
  int get() const { return fd_; }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

Status MakePipe(Fd* read_end, Fd* write_end) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    return Error(Code::kInternal, "pipe: {}", std::strerror(errno));
  }
  read_end->Reset(fds[0]);
  write_end->Reset(fds[1]);
  return Status::Ok();
}

std::vector<std::string> ChildEnvironment(const std::map<std::string, std::string>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string_view entry(*e);
    std::string name(entry.substr(0, entry.find('=')));
    if (!extra.contains(name)) env.emplace_back(entry);
  }
  for (const auto& [name, value] : extra) env.push_back(name + "=" + value);
  return env;
}

// Feeds stdin and drains stdout/stderr until both close or the deadline passes.
Status Pump(Fd& in, Fd& out, Fd& err, const std::string& stdin_text,
            std::chrono::steady_clock::time_point deadline, CommandResult* result) {
  size_t written = 0;
  if (stdin_text.empty()) in.Close();
  char buf[4096];
  while (out.get() >= 0 || err.get() >= 0) {
    pollfd fds[3];
    int n = 0;
    Fd* owners[3];
    for (Fd* fd : {&out, &err}) {
      if (fd->get() >= 0) {
        owners[n] = fd;
        fds[n++] = {fd->get(), POLLIN, 0};
      }
    }
    if (in.get() >= 0) {
      owners[n] = &in;
      fds[n++] = {in.get(), POLLOUT, 0};
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return Error(Code::kDeadlineExceeded, "timed out");
    int ready = ::poll(fds, n, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return Error(Code::kInternal, "poll: {}", std::strerror(errno));
    for (int i = 0; i < n; ++i) {
      if (fds[i].revents == 0) continue;
      Fd* fd = owners[i];
      if (fd == &in) {
        ssize_t w = ::write(in.get(), stdin_text.data() + written, stdin_text.size() - written);
        if (w > 0) written += static_cast<size_t>(w);
        if (w < 0 && errno != EINTR && errno != EAGAIN) in.Close();  // child closed stdin
        if (written == stdin_text.size()) in.Close();
        continue;
      }
      ssize_t r = ::read(fd->get(), buf, sizeof(buf));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        fd->Close();
        continue;
      }
      std::string& sink = fd == &out ? result->out : result->err;
      if (sink.size() < kOutputBytesMax) sink.append(buf, static_cast<size_t>(r));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<CommandResult> SubprocessRunner::Run(const Command& command) {
  if (command.argv.empty()) return InvalidArgument("empty command");
  const std::string& program = command.argv[0];
  Fd in_r, in_w, out_r, out_w, err_r, err_w;
  LK_RETURN_IF_ERROR(MakePipe(&in_r, &in_w));
  LK_RETURN_IF_ERROR(MakePipe(&out_r, &out_w));
  LK_RETURN_IF_ERROR(MakePipe(&err_r, &err_w));

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in_r.get(), 0);
  posix_spawn_file_actions_adddup2(&actions, out_w.get(), 1);
  posix_spawn_file_actions_adddup2(&actions, err_w.get(), 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  // The child starts with default dispositions and an empty mask, or with the job signals
  // blocked when it asked (see Command::block_job_signals). The timeout's SIGKILL ends it either
  // way.
  sigset_t blocked, all;
  sigemptyset(&blocked);
  if (command.block_job_signals) {
    for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2}) sigaddset(&blocked, sig);
  }
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &blocked);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);

  std::vector<std::string> env = ChildEnvironment(command.env);
  std::vector<char*> argv_c, env_c;
  for (const auto& a : command.argv) argv_c.push_back(const_cast<char*>(a.c_str()));
  argv_c.push_back(nullptr);
  for (const auto& e : env) env_c.push_back(const_cast<char*>(e.c_str()));
  env_c.push_back(nullptr);

  // posix_spawnp looks argv[0] up in this process's PATH, not in command.env's.
  pid_t pid = -1;
  int rc = posix_spawnp(&pid, program.c_str(), &actions, &attr, argv_c.data(), env_c.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc == ENOENT) return Error(Code::kNotFound, "{}: not found in PATH", program);
  if (rc != 0) return Error(Code::kInternal, "start {}: {}", program, std::strerror(rc));
  in_r.Close();
  out_w.Close();
  err_w.Close();

  CommandResult result;
  auto deadline = std::chrono::steady_clock::now() + command.timeout;
  // A child that exits before reading its stdin would raise SIGPIPE in this process, whose
  // default action kills it: block it in this thread while writing, and drop one left pending.
  sigset_t pipe_set, old_set;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old_set);
  Status pumped = Pump(in_w, out_r, err_r, command.stdin_text, deadline, &result);
  in_w.Close();
  timespec zero{0, 0};
  while (sigtimedwait(&pipe_set, nullptr, &zero) == SIGPIPE) {
  }
  pthread_sigmask(SIG_SETMASK, &old_set, nullptr);
  if (!pumped.ok()) ::kill(pid, SIGKILL);
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  if (!pumped.ok()) {
    return pumped.WithContext(
        fmt::format("{} (after {} ms)", program, command.timeout.count()));
  }
  result.exit_code = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
  return result;
}

}  // namespace lk::slurm
