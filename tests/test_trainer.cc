// A small trainer for the agent's integration tests: it uses the client library exactly as a
// real trainer does (poll each outer step, rebuild the Gloo communicator on a new quorum, abort
// on a failure notice, commit), but its "training" is an allreduce whose result it can check:
// every member contributes replica_rank + 1, so each element must sum to W(W+1)/2.
// One JSON line per outer step attempt goes to --log.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "common/flags.h"
#include "common/log.h"
#include <lightkeeper/session.h>
#include "client/session_store.h"

int main(int argc, char** argv) {
  using namespace lk;
  uint32_t group_rank = 0, group_size = 1, steps = 10, elements = 4096, step_sleep_ms = 50;
  uint32_t hang_in_allreduce_step = 0;
  bool hung = false;
  std::string log_path = "trainer.log";
  std::string goodbye_after_file;
  Flags flags("test_trainer", "allreduce-checking trainer for integration tests");
  flags.Add("group-rank", &group_rank, "rank in the group", "T_GROUP_RANK");
  flags.Add("group-size", &group_size, "trainers in the group", "T_GROUP_SIZE");
  flags.Add("steps", &steps, "outer steps to commit", "T_STEPS");
  flags.Add("elements", &elements, "float32 elements per allreduce", "T_ELEMENTS");
  flags.Add("step-sleep-ms", &step_sleep_ms, "pause per outer step (the inner steps)", "T_SLEEP");
  flags.Add("log", &log_path, "JSON lines output", "T_LOG");
  flags.Add("hang-in-allreduce-step", &hang_in_allreduce_step,
            "once the first allreduce with a peer at this step or later (>= 1; 0: never) "
            "returns, stop (SIGSTOP) before saying the wait on peers is over: hung inside a "
            "collective its peers finished",
            "T_HANG_IN_ALLREDUCE_STEP");
  flags.Add("goodbye-after-file", &goodbye_after_file,
            "after the last step, say goodbye only once this file exists (at most 60 s): a "
            "trainer still busy at the end (a final save) while the test orders what its agent "
            "hears meanwhile",
            "T_GOODBYE_AFTER_FILE");
  if (Status st = flags.Parse(argc, argv); !st.ok()) {
    std::fprintf(stderr, "%s\n", st.message().c_str());
    return 2;
  }
  std::ofstream log(log_path, std::ios::app);
  auto emit = [&](const std::string& line) {
    log << line << "\n";
    log.flush();
  };
  auto session = client::Session::FromEnv(group_rank, group_size);
  if (!session.ok()) {
    std::fprintf(stderr, "session: %s\n", session.status().ToString().c_str());
    return 1;
  }
  client::SessionKvStore store(std::getenv("LK_AGENT_SOCKET"));
  comm::CommOptions copts;
  copts.slot = group_rank;
  copts.init_timeout = Millis(15'000);
  copts.op_timeout = Millis(30'000);
  auto cm = comm::CommManager::Create(comm::Backend::kGloo, &store, copts);
  if (!cm.ok()) {
    std::fprintf(stderr, "comm: %s\n", cm.status().ToString().c_str());
    return 1;
  }
  (*session)->OnNotice([&](const client::Notice& n) {
    // Abort at once: survivors never wait for a transport timeout.
    (*cm)->AbortQuorum(n.quorum_id, n.reason);
  });
  uint32_t step = 0;
  bool healed = false;
  std::vector<float> buf(elements);
  bool first = true;
  while (step < steps) {
    // The inner steps come before the poll, as in a trainer that polls right before its outer
    // sync: the quorum is then the freshest, and the agent's round (asked ahead, right after
    // the last commit) ran while the inner steps did.
    if (!first) std::this_thread::sleep_for(std::chrono::milliseconds(step_sleep_ms));
    first = false;
    auto p = (*session)->Poll(step);
    if (!p.ok()) {
      std::fprintf(stderr, "poll: %s\n", p.status().ToString().c_str());
      return 1;
    }
    if (p->drain) {
      emit(fmt::format(R"({{"event":"drain","step":{},"reason":"{}"}})", step, p->reason));
      return 0;
    }
    if (p->heal) {
      // A real trainer fetches the state here; the test trainer jumps to the plan's step.
      healed = true;
      step = std::max(step, p->max_step);
      emit(fmt::format(R"({{"event":"heal","step":{},"quorum_id":{},"sources":{}}})", step,
                       p->quorum_id, p->heal_sources.size()));
    }
    if (p->reconfigure || (*cm)->quorum_id() != p->quorum_id) {
      Status st = (*cm)->Reconfigure(p->quorum_id, p->replica_rank, p->replica_world_size);
      if (!st.ok()) {
        emit(fmt::format(R"({{"event":"reconfigure_failed","quorum_id":{},"error":"{}"}})",
                         p->quorum_id, st.code() == Code::kAborted ? "aborted" : "other"));
        // This quorum cannot work for us: say so, so that the next round gets a new quorum_id.
        (void)(*session)->Commit(step + 1, false);
        first = true;
        continue;
      }
    }
    std::fill(buf.begin(), buf.end(), static_cast<float>(p->replica_rank + 1));
    auto t0 = std::chrono::steady_clock::now();
    (void)(*session)->SetPeerWait(true);
    Status st = (*cm)->AllReduce(buf.data(), buf.size(), comm::DType::kFloat32, comm::ReduceOp::kSum);
    // At or after the step: a trainer that joins late heals past the steps before its own.
    if (hang_in_allreduce_step != 0 && step >= hang_in_allreduce_step && st.ok() &&
        p->replica_world_size > 1 && !hung) {
      hung = true;
      emit(fmt::format(R"({{"event":"hanging","step":{}}})", step));
      raise(SIGSTOP);
    }
    (void)(*session)->SetPeerWait(false);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    uint32_t w = p->replica_world_size;
    bool correct = st.ok();
    for (float v : buf) correct &= st.ok() && v == static_cast<float>(w * (w + 1) / 2);
    emit(fmt::format(R"({{"event":"allreduce","step":{},"quorum_id":{},"world":{},"ok":{},)"
                     R"("aborted":{},"correct":{},"ms":{:.2f},"healed":{},"from_board":{},"t_ms":{}}})",
                     step, p->quorum_id, w, st.ok(), st.code() == Code::kAborted, correct, ms,
                     healed, p->from_board,
                     std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::system_clock::now().time_since_epoch()).count()));
    if (!st.ok()) {
      first = true;  // retry at once
      // Aborted by a notice: the next poll brings the new quorum. Failed otherwise: report it,
      // so that the next round is a new quorum rather than this one again. Redo the step.
      if (st.code() != Code::kAborted) (void)(*session)->Commit(step + 1, false);
      continue;
    }
    ++step;
    if (Status c = (*session)->Commit(step, true, fmt::format("h{}", step)); !c.ok()) {
      std::fprintf(stderr, "commit: %s\n", c.ToString().c_str());
      return 1;
    }
  }
  emit(fmt::format(R"({{"event":"done","step":{}}})", step));
  if (!goodbye_after_file.empty()) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!std::filesystem::exists(goodbye_after_file) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  if (Status st = (*session)->Finish(); !st.ok()) {
    std::fprintf(stderr, "finish: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
