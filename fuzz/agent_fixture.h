// The replica agent for the route fuzzers, as in production but in process: a real lighthouse
// (Service over the in-memory state store, on its own thread, on loopback), and an Agent started
// against it with a job token, a Unix socket, --serve on loopback and a served directory that
// holds a real committed checkpoint, so that the shard reads reach a file. The agent's own
// threads (heartbeat, quorum, watch, commit, workers) run for real; its io_context is run by the
// fuzzing thread (route_fuzz.h's Drive) instead of Agent::Run. An agent that finished (a drain:
// every trainer said goodbye, or the group failed) is joined and replaced by a fresh one.
// The trainer is a child process that only waits (its pid is what requests' credentials carry):
// the agent watches it and may signal it when the group fails, as it would a real trainer, and
// it is started again when it died.
// Thread-safety: the fuzzing thread only.
#pragma once

#include <sanitizer/lsan_interface.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <filesystem>
#include <fstream>
#include <cstdlib>
#include <memory>
#include <optional>
#include <thread>

#include "checkpoint/writer.h"
#include "common/log.h"
#include "lighthouse/memory_state_store.h"
#include "lighthouse/service.h"
#include "replica_agent/agent.h"

namespace lk::fuzz {

class AgentFixture {
 public:
  AgentFixture() {
    // The fixture lives for the whole run, and an agent's threads, listeners and the cycles
    // between its state and its handlers outlive any one input: not leaks of an input.
    __lsan::ScopedDisabler no_leak_checks;
    SetLogLevel(LogLevel::kError);
    const char* tmp = getenv("TMPDIR");
    dir_ = std::string(tmp ? tmp : "/tmp") + "/lk-fuzz-agent-XXXXXX";
    LK_CHECK(mkdtemp(dir_.data()) != nullptr);
    std::ofstream(dir_ + "/tokens") << "j secret-j\n";
    std::ofstream(dir_ + "/job-token") << "secret-j\n";
    WriteCheckpoint();
    lighthouse::ServiceOptions lo;
    lo.bind = "127.0.0.1:0";
    lo.token_file = dir_ + "/tokens";
    lo.http.single_thread = true;
    // Every long-poll the lighthouse holds ends within 10 ms: a trainer's KV read of a key
    // nobody put (common in fuzzed paths) waits that long for it, and at 50 ms such reads were
    // half of agent_socket_routes' time. The agent's own watch and quorum asks poll again.
    lo.long_poll_max = Millis(10);
    lo.core.min_replicas = 1;
    lo.core.jobs_max = 4;
    lo.kv_keys_per_job_max = 64;
    lh_ = std::make_unique<lighthouse::Service>(lh_ioc_, lo, lighthouse::NewMemoryStateStore());
    Status st = lh_->Start();
    LK_CHECK(st.ok()) << st.ToString();
    lh_thread_ = std::thread([this] { lh_ioc_.run(); });
    StartAgent();
  }

  // The one fixture of the process, stopped (agent drained and joined, lighthouse shut down)
  // at exit before static objects are destroyed: the agent's threads must not outlive what they
  // use. libFuzzer may also leave by abort; then nothing is stopped, and nothing needs to be.
  static AgentFixture& Get() {
    static std::unique_ptr<AgentFixture> f;
    if (!f) {
      f = std::make_unique<AgentFixture>();
      std::atexit([] { f.reset(); });
    }
    return *f;
  }

  ~AgentFixture() {
    __lsan::ScopedDisabler no_leak_checks;
    StopAgent();
    boost::asio::post(lh_ioc_, [this] { lh_->Shutdown(); });
    lh_work_.reset();
    lh_thread_.join();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  boost::asio::io_context& ioc() { return agent_->io_context(); }

  // Credentials of the trainer process, as the kernel would report them on the socket.
  http::PeerCredentials TrainerCredentials() {
    if (trainer_pid_ <= 0 || waitpid(trainer_pid_, nullptr, WNOHANG) != 0) {
      pid_t pid = fork();
      LK_CHECK(pid >= 0) << "fork failed";
      if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        while (true) pause();
      }
      trainer_pid_ = pid;
    }
    return {static_cast<int>(trainer_pid_), static_cast<uint32_t>(geteuid()),
            static_cast<uint32_t>(getegid())};
  }
  const http::Handler& trainer() const { return trainer_; }
  const http::Handler& peer() const { return peer_; }

  // After each input: an agent that finished is joined (every answer it owed is given by then)
  // and replaced.
  void ReplaceIfFinished() {
    if (!agent_->io_context().stopped()) return;
    __lsan::ScopedDisabler no_leak_checks;
    StopAgent();
    StartAgent();
  }

 private:
  void WriteCheckpoint() {
    std::vector<float> w(64);
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.25f;
    ckpt::WriterOptions o;
    o.root = dir_ + "/live/rank-00000";
    ckpt::CheckpointWriter writer(o);
    ckpt::Snapshot s;
    s.step = 3;
    s.Add("w", ckpt::DType::kF32, {16, 4}, ckpt::ConstBytes::Own(w));
    auto r = writer.Save(s);
    LK_CHECK(r.ok() && r->committed) << r.status().ToString();
  }

  void StartAgent() {
    agent::AgentOptions o;
    o.lighthouse = "http://" + lh_->address();
    o.job = "j";
    o.group_id = "g" + std::to_string(++agents_);
    o.incarnation = o.group_id + "-1";
    o.socket = dir_ + "/agent.sock";
    o.token_file = dir_ + "/job-token";
    o.serve = "127.0.0.1:0";
    o.serve_dir = dir_ + "/live";
    o.heartbeat_interval = Millis(100);
    o.quorum_timeout = Millis(200);
    o.backoff_max = Millis(100);
    o.drain_timeout = Millis(50);
    o.workers = 2;
    o.worker_queue_max = 8;
    agent_ = std::make_unique<agent::Agent>(o);
    Status st = agent_->Start();
    LK_CHECK(st.ok()) << st.ToString();
    trainer_ = agent_->trainer_handler();
    peer_ = agent_->peer_handler();
  }

  void StopAgent() {
    if (!agent_->io_context().stopped()) agent_->Drain("fuzz_done");
    // Run returns once the drain finished the agent (its io_context stops), then joins its
    // threads and refuses what its workers still had queued.
    (void)agent_->Run();
    agent_.reset();
  }

  std::string dir_;
  boost::asio::io_context lh_ioc_;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> lh_work_{
      lh_ioc_.get_executor()};
  std::unique_ptr<lighthouse::Service> lh_;
  std::thread lh_thread_;
  std::unique_ptr<agent::Agent> agent_;
  http::Handler trainer_, peer_;
  uint32_t agents_ = 0;
  pid_t trainer_pid_ = 0;
};

}  // namespace lk::fuzz
