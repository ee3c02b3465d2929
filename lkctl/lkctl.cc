// lkctl: the command line for people. Talks to the lighthouse over the same HTTP API, and hosts
// the checkpoint and Slurm tools when they are built in.
//   lkctl status [--job J] [--json]      jobs, quorums and groups at a glance
//   lkctl watch [--job J]                one line per quorum change, until interrupted
//   lkctl drain JOB GROUP                ask a group to leave at its next outer step (admin)
//   lkctl forget JOB                     drop a finished job's state (admin)
//   lkctl checkpoint ... / lkctl slurm ...
#include <csignal>
#include <cstdio>
#include <thread>

#include "checkpoint/cli.h"
#include "common/flags.h"
#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/proto/lightkeeper.pb.h"
#include "common/log.h"
#include "slurm/cli.h"

namespace lk {
namespace {

namespace pb = lightkeeper::v1;

constexpr const char* kUsage =
    "usage: lkctl [--lighthouse URL] [--token-file F] [--ca-file F] [--proxy URL] COMMAND ...\n\n"
    "commands:\n"
    "  status [--job J] [--json]   jobs, quorums and groups\n"
    "  watch [--job J]             print a line whenever a job's quorum or groups change\n"
    "  drain JOB GROUP             ask GROUP to leave JOB at its next outer step (admin token)\n"
    "  forget JOB                  drop everything the lighthouse knows of JOB (admin token)\n"
    "  event JOB GROUP INCARNATION trainer_crashed|requeue_refused [DETAIL...]\n"
    "                              report a life's crash or refused requeue (job token); prints\n"
    "                              crashes=N requeue_refusals=M, the group's counts over its lives\n"
    "  checkpoint inspect|verify|reshard ...   sharded checkpoint tools (see lkctl checkpoint --help)\n"
    "  slurm script|submit ...     Slurm batch scripts for a replica group (see lkctl slurm --help)\n";

struct Common {
  std::string lighthouse = "http://127.0.0.1:29510";
  std::string token_file;
  std::string ca_file;
  std::string proxy;
  std::string job;
  bool json = false;
  uint32_t interval_ms = 500;
};

Result<std::unique_ptr<http::Client>> Connect(const Common& c) {
  http::ClientOptions o;
  o.ca_file = c.ca_file;
  o.proxy = c.proxy.empty() ? http::ProxyFromEnv(c.lighthouse) : c.proxy;
  if (!c.token_file.empty()) {
    LK_ASSIGN_OR_RETURN(o.token, ReadTokenFile(c.token_file));
  }
  return http::Client::Create(c.lighthouse, o);
}

Result<pb::StatusResponse> FetchStatus(http::Client& client, const std::string& job) {
  std::string target = "/status";
  if (!job.empty()) target += "?job=" + http::PercentEncode(job);
  LK_ASSIGN_OR_RETURN(http::Response r, client.Do("GET", target, "", "", Millis(5000)));
  LK_RETURN_IF_ERROR(http::StatusFromResponse(r));
  pb::StatusResponse st;
  LK_RETURN_IF_ERROR(http::Decode(r.body, http::Format::kJson, &st));
  return st;
}

std::string MemberList(const pb::JobStatus& j) {
  std::string out;
  for (const auto& m : j.members()) out += (out.empty() ? "" : ",") + m.group_id();
  return out;
}

void PrintStatus(const pb::StatusResponse& st) {
  if (st.jobs().empty()) std::printf("no jobs\n");
  for (const auto& j : st.jobs()) {
    std::printf("job %s  quorum_id %u  committed_step %u  members %d [%s]  changes %u\n",
                j.job().c_str(), j.quorum_id(), j.committed_step(), j.members_size(),
                MemberList(j).c_str(), j.quorum_changes());
    if (!j.last_decision().empty()) std::printf("  last decision: %s\n", j.last_decision().c_str());
    std::printf("  %-20s %-9s %7s %5s %10s %-10s %s\n", "GROUP", "STATE", "STEP", "NODES",
                "HEARTBEAT", "PHASE", "INCARNATION");
    for (const auto& g : j.groups()) {
      // The group's contribution (its tokens at its last committed step and their share of
      // that step), and why a refused group is kept out.
      std::string extra;
      if (g.tokens_step() > 0) {
        extra += fmt::format("  tokens {} at step {} (share {:.3f}, total {})", g.tokens(),
                             g.tokens_step(), g.share(), g.tokens_total());
      }
      if (g.state() == "refused") extra += "  " + g.reason();
      if (!g.gateway().empty()) extra += "  via gateway " + g.gateway();
      if (g.crashes() > 0) extra += fmt::format("  crashes {}", g.crashes());
      if (g.requeue_refusals() > 0) {
        extra += fmt::format("  requeue refusals {} ({})", g.requeue_refusals(), g.last_event());
      }
      std::printf("  %-20s %-9s %7u %5u %9.1fs %-10s %s%s%s\n", g.group_id().c_str(),
                  g.state().c_str(), g.step(), g.nodes(), g.heartbeat_age_ms() / 1000.0,
                  g.phase().c_str(), g.incarnation().c_str(), g.diverged() ? "  DIVERGED" : "",
                  extra.c_str());
    }
  }
}

// An error for people, with the lighthouse's reason code when it sent one: scripts that wrap
// lkctl match the code in brackets, never the prose before it.
std::string Describe(const Status& st) {
  if (st.reason() == Reason::kUnspecified) return st.message();
  return fmt::format("{} [{}]", st.message(), ReasonName(st.reason()));
}

volatile std::sig_atomic_t g_stop = 0;

int Watch(http::Client& client, const Common& c) {
  std::signal(SIGINT, [](int) { g_stop = 1; });
  std::signal(SIGTERM, [](int) { g_stop = 1; });
  std::map<std::string, std::string> last;
  while (!g_stop) {
    auto st = FetchStatus(client, c.job);
    if (!st.ok()) {
      std::printf("lighthouse unreachable: %s\n", Describe(st.status()).c_str());
    } else {
      for (const auto& j : st->jobs()) {
        std::string groups;
        for (const auto& g : j.groups()) groups += " " + g.group_id() + ":" + g.state();
        std::string line = fmt::format("job={} quorum_id={} committed_step={} members=[{}]{}",
                                       j.job(), j.quorum_id(), j.committed_step(), MemberList(j),
                                       groups);
        std::string key = fmt::format("{}|{}|{}", j.quorum_id(), MemberList(j), groups);
        if (last[j.job()] != key) {
          last[j.job()] = key;
          std::printf("%s\n", line.c_str());
          std::fflush(stdout);
        }
      }
    }
    std::this_thread::sleep_for(Millis(c.interval_ms));
  }
  return 0;
}

int Admin(http::Client& client, const std::string& target, const google::protobuf::Message& req) {
  pb::Empty resp;
  Status st = client.Call("POST", target, req, &resp, Millis(5000));
  if (!st.ok()) {
    std::fprintf(stderr, "lkctl: %s\n", Describe(st).c_str());
    return 1;
  }
  std::printf("ok\n");
  return 0;
}

int Main(int argc, const char* const* argv) {
  if (argc >= 2 && std::string(argv[1]) == "checkpoint") {
    return ckpt::RunCheckpointCli(argc - 1, argv + 1);
  }
  if (argc >= 2 && std::string(argv[1]) == "slurm") {
    return slurm::RunSlurmCli(argc - 1, argv + 1);
  }
  Common c;
  Flags flags("lkctl", kUsage);
  flags.Add("lighthouse", &c.lighthouse, "lighthouse URL");
  flags.Add("token-file", &c.token_file, "bearer token file (the admin token for drain/forget)");
  flags.Add("ca-file", &c.ca_file,
            "CA (PEM) that an https lighthouse's certificate must chain to; its host name is "
            "checked too (default: the system's CAs)");
  flags.Add("proxy", &c.proxy,
            "HTTP CONNECT proxy to the lighthouse (http://[USER:PASSWORD@]HOST:PORT; TLS stays "
            "end to end); default: LK_PROXY, else https_proxy/http_proxy, except hosts in "
            "no_proxy and loopback");
  flags.MarkSecret("proxy");
  flags.Add("job", &c.job, "only this job", "LKCTL_JOB");
  flags.Add("json", &c.json, "status as JSON", "LKCTL_JSON");
  flags.Add("interval-ms", &c.interval_ms, "watch: how often to look", "LKCTL_INTERVAL_MS");
  const auto& pos = flags.positional();
  auto has_command = [&] {
    return pos.empty() ? InvalidArgument("missing command") : Status::Ok();
  };
  if (auto code = flags.ParseCommandLine(argc, argv, has_command, 1, kUsage)) return *code;
  auto client = Connect(c);
  if (!client.ok()) {
    std::fprintf(stderr, "lkctl: %s\n", client.status().message().c_str());
    return 2;
  }
  const std::string& cmd = pos[0];
  if (cmd == "status" && pos.size() == 1) {
    auto s = FetchStatus(**client, c.job);
    if (!s.ok()) {
      std::fprintf(stderr, "lkctl: %s\n", Describe(s.status()).c_str());
      return 1;
    }
    if (c.json) std::printf("%s\n", http::ToJson(*s, true).c_str());
    else PrintStatus(*s);
    return 0;
  }
  if (cmd == "watch" && pos.size() == 1) return Watch(**client, c);
  if (cmd == "drain" && pos.size() == 3) {
    pb::DrainRequest req;
    req.set_job(pos[1]);
    req.set_group_id(pos[2]);
    return Admin(**client, "/v1/admin/drain", req);
  }
  if (cmd == "forget" && pos.size() == 2) {
    pb::ForgetRequest req;
    req.set_job(pos[1]);
    return Admin(**client, "/v1/admin/forget", req);
  }
  if (cmd == "event" && pos.size() >= 5) {
    pb::GroupEventRequest req;
    req.set_job(pos[1]);
    req.set_group_id(pos[2]);
    req.set_incarnation(pos[3]);
    req.set_event(pos[4]);
    std::string detail;
    for (size_t i = 5; i < pos.size(); ++i) detail += (detail.empty() ? "" : " ") + pos[i];
    req.set_detail(OneLine(detail, 256));  // the lighthouse's bound on a detail
    pb::GroupEventResponse resp;
    Status sent = (*client)->Call("POST", "/v1/event", req, &resp, Millis(10'000));
    if (!sent.ok()) {
      std::fprintf(stderr, "lkctl: %s\n", Describe(sent).c_str());
      return 1;
    }
    std::printf("crashes=%u requeue_refusals=%u\n", resp.crashes(), resp.requeue_refusals());
    return 0;
  }
  std::fprintf(stderr, "lkctl: bad command or arguments: %s\n\n%s", cmd.c_str(), kUsage);
  return 2;
}

}  // namespace
}  // namespace lk

int main(int argc, char** argv) { return lk::Main(argc, argv); }
