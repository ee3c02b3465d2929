// The agent's side of the trust boundary, on the real binaries: the trainer API is on the Unix
// socket only (mode 0600, peers of the agent's uid, pids from the kernel), --serve carries health,
// status and token-protected shard reads only, and every client verifies a TLS server's name
// and chain against a private CA made here with openssl. Each refused request is checked to
// leave the agent up and its group, as the agent and the lighthouse report it, unchanged.
#include <doctest/doctest.h>
#include <grp.h>
#include <lightkeeper/session.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <thread>

#include "checkpoint/live.h"
#include "checkpoint/test_util.h"
#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/proto/lightkeeper.pb.h"
#include "tests/support/process.h"
#include "tests/support/wait.h"

namespace lk::test {
namespace {

using namespace std::chrono_literals;
namespace pb = lightkeeper::v1;

constexpr const char* kToken = "job-token-3f9a1c";

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

// Runs a shell command (openssl) and requires it to succeed.
void Sh(const std::string& cmd) {
  int rc = std::system((cmd + " >/dev/null 2>&1").c_str());
  REQUIRE_MESSAGE(rc == 0, cmd);
}

// A private CA and server certificates signed by it, made with the openssl commands the README
// shows. Every certificate is for 127.0.0.1 (IP SAN) and localhost unless said otherwise.
struct Pki {
  std::string dir;
  explicit Pki(const std::string& d) : dir(d) {
    MakeCa("ca");
    MakeCa("other-ca");
    Issue("good", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost", 30);
    Issue("wrong-host", "ca", "subjectAltName=DNS:other.example,IP:10.9.9.9", 30);
    Issue("expired", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost", -1);
    Issue("unknown-ca", "other-ca", "subjectAltName=IP:127.0.0.1,DNS:localhost", 30);
  }
  std::string Ca() const { return dir + "/ca.pem"; }
  std::string Cert(const std::string& name) const { return dir + "/" + name + ".pem"; }
  std::string Key(const std::string& name) const { return dir + "/" + name + ".key"; }

 private:
  void MakeCa(const std::string& name) {
    Sh(
        fmt::format("openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj /CN=lk-test-{0} "
                    "-keyout {1}/{0}.key -out {1}/{0}.pem",
                    name, dir));
  }
  void Issue(const std::string& name, const std::string& ca, const std::string& san, int days) {
    WriteFile(dir + "/" + name + ".ext", san + "\n");
    Sh(
        fmt::format("openssl req -newkey rsa:2048 -nodes -subj /CN={0} -keyout {1}/{0}.key "
                    "-out {1}/{0}.csr",
                    name, dir));
    // -days -1 makes a certificate whose notAfter is already past: an expired one.
    Sh(
        fmt::format("openssl x509 -req -in {1}/{0}.csr -CA {1}/{2}.pem -CAkey {1}/{2}.key "
                    "-CAcreateserial -days {3} -extfile {1}/{0}.ext -out {1}/{0}.pem",
                    name, dir, ca, days));
  }
};

struct Agent {
  std::unique_ptr<Process> process;
  std::string socket;
  std::string serve;  // HOST:PORT of --serve
};

Agent StartAgent(const std::string& dir, const std::string& lighthouse, const std::string& name,
                 std::vector<std::string> extra) {
  Agent a;
  a.socket = dir + "/" + name + ".sock";
  std::vector<std::string> argv{BinDir() + "/replica_agent",
                                "--lighthouse",
                                lighthouse,
                                "--job",
                                "t",
                                "--group-id",
                                name,
                                "--socket",
                                a.socket,
                                "--serve",
                                "127.0.0.1:0",
                                "--heartbeat-interval-ms",
                                "100",
                                "--backoff-max-ms",
                                "200",
                                "--drain-timeout-ms",
                                "2000"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  a.process = std::make_unique<Process>(argv, dir + "/agent-" + name + ".log");
  std::string line = a.process->WaitForLog("agent_listening", 10s);
  REQUIRE_MESSAGE(!line.empty(), a.process->Log());
  auto at = line.find("serve=");
  REQUIRE(at != std::string::npos);
  a.serve = line.substr(at + 6, line.find(' ', at) - at - 6);
  return a;
}

// One request with a fresh client; `token` empty sends none.
http::Response Ask(const std::string& url, const std::string& method, const std::string& target,
                   const std::string& body = "", const std::string& token = "",
                   const std::string& ca = "") {
  http::ClientOptions o;
  o.token = token;
  o.ca_file = ca;
  auto c = http::Client::Create(url, o);
  REQUIRE(c.ok());
  auto r = (*c)->Do(method, target, body, body.empty() ? "" : http::kJsonType, Millis(5000));
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  return *r;
}

// The job as the lighthouse reports it; `verify` false reads a lighthouse whose certificate is
// the one under test.
pb::JobStatus JobStatus(const std::string& url, const std::string& ca = "", bool verify = true) {
  http::ClientOptions o;
  o.token = kToken;
  o.ca_file = ca;
  o.tls_verify = verify;
  auto c = http::Client::Create(url, o);
  REQUIRE(c.ok());
  auto r = (*c)->Do("GET", "/status?job=t", "", "", Millis(3000));
  pb::StatusResponse st;
  if (r.ok() && r->status == 200) REQUIRE(http::Decode(r->body, http::Format::kJson, &st).ok());
  return st.jobs().empty() ? pb::JobStatus() : st.jobs(0);
}

// What of a job must not change when a request is refused: its quorum, its members, its
// groups' lives and states, and its durable checkpoints (heartbeat ages and steps move on).
std::string Fingerprint(const pb::JobStatus& j) {
  std::string out =
      fmt::format("quorum_id={} changes={} members=", j.quorum_id(), j.quorum_changes());
  for (const auto& m : j.members()) out += m.group_id() + "/" + m.incarnation() + ",";
  out += " groups=";
  for (const auto& g : j.groups()) {
    out += fmt::format("{}/{}/{}/{},", g.group_id(), g.incarnation(), g.state(), g.draining());
  }
  out += " checkpoints=";
  for (const auto& c : j.checkpoints()) out += fmt::format("{}@{},", c.location(), c.step());
  return out;
}

void WaitForGroup(const std::string& lh_url, const std::string& group) {
  bool seen = WaitUntil(
      [&] {
        pb::JobStatus j = JobStatus(lh_url);
        for (const auto& g : j.groups()) {
          if (g.group_id() == group) return true;
        }
        return false;
      },
      20s, "the group in /status");
  if (!seen) FAIL("group " << group << " never heartbeated");
}

struct Secured {
  std::string dir;
  std::string token_file;
  Lighthouse lh;
  explicit Secured(const std::string& tag) : dir(TempDir(tag)) {
    token_file = dir + "/token";
    WriteFile(token_file, std::string(kToken) + "\n");
    lh = StartLighthouse(dir + "/data", {"--token-file", token_file}, dir + "/lighthouse.log");
  }
};

TEST_CASE(
    "--serve carries no trainer API: hello, checkpoint, kv, goodbye over TCP are 404 and change "
    "nothing") {
  Secured s("sec-serve");
  Agent a = StartAgent(s.dir, s.lh.url(), "g0", {"--token-file", s.token_file});
  WaitForGroup(s.lh.url(), "g0");
  std::string peer = "http://" + a.serve;
  std::string status_before = Ask(peer, "GET", "/v1/agent/status", "", kToken).body;
  std::string job_before = Fingerprint(JobStatus(s.lh.url()));
  Process bystander({"/bin/sleep", "60"}, s.dir + "/sleep.log");
  std::string hello = fmt::format(R"({{"group_rank":0,"group_size":1,"pid":{}}})", bystander.pid());
  struct Attempt {
    std::string method, target, body;
  };
  std::vector<Attempt> attempts{
      {"POST", "/v1/trainer/hello", hello},
      {"POST", "/v1/trainer/checkpoint",
       R"({"step":4294967295,"location":"/evil","manifest_digest":"x"})"},
      {"PUT", "/v1/trainer/kv/1/nccl_id", "forged"},
      {"GET", "/v1/trainer/kv/1/nccl_id?timeout_ms=0", ""},
      {"POST", "/v1/trainer/poll", R"({"group_rank":0,"group_size":1,"step":0})"},
      {"POST", "/v1/trainer/commit", R"({"group_rank":0,"step":1})"},
      {"POST", "/v1/trainer/goodbye", R"({"group_rank":0})"},
      {"GET", "/v1/trainer/notice?quorum_id=1&timeout_ms=0", ""},
      {"POST", "/v1/heartbeat", "{}"},
  };
  for (const auto& at : attempts) {
    // With the job's token too: the trainer API is not on this listener at all.
    for (const std::string& token : {std::string(), std::string(kToken)}) {
      auto r = Ask(peer, at.method, at.target, at.body, token);
      CHECK_MESSAGE(r.status == 404, at.method << " " << at.target << " -> " << r.status);
      CHECK_MESSAGE(r.body.find("not_on_this_listener") != std::string::npos, r.body);
      CHECK_MESSAGE(r.body.find("NOT_ON_THIS_LISTENER") != std::string::npos, r.body);
    }
  }
  // The process a forged hello named exits: the agent never watched it.
  bystander.Signal(SIGKILL);
  REQUIRE(bystander.Wait(5s).has_value());
  // Kept: the sleep is what is under test (nothing happens for a while after the exit).
  std::this_thread::sleep_for(1s);
  CHECK(a.process->Running());
  CHECK(a.process->WaitForLog("trainer_crashed", 10ms).empty());
  CHECK(a.process->WaitForLog("group_failed", 10ms).empty());
  CHECK(Ask(peer, "GET", "/v1/agent/status", "", kToken).body == status_before);
  CHECK(Fingerprint(JobStatus(s.lh.url())) == job_before);
  // The forged key never reached the lighthouse's rendezvous store.
  auto kv = Ask(s.lh.url(), "GET", "/v1/kv/t/1/nccl_id?timeout_ms=0", "", kToken);
  CHECK(kv.status != 200);
  // What --serve does carry: health for anyone, status for the token holder only.
  CHECK(Ask(peer, "GET", "/healthz").status == 200);
  auto no_token = Ask(peer, "GET", "/v1/agent/status");
  CHECK(no_token.status == 401);
  CHECK(no_token.body.find("token_missing") != std::string::npos);
  CHECK(no_token.body.find("TOKEN_MISSING") != std::string::npos);
  auto wrong = Ask(peer, "GET", "/v1/agent/status", "", "not-the-token");
  CHECK(wrong.status == 403);
  CHECK(wrong.body.find("token_wrong") != std::string::npos);
  CHECK(wrong.body.find("TOKEN_INVALID") != std::string::npos);
}

TEST_CASE(
    "a hello naming another pid takes the peer's real pid: the named process's exit is no crash") {
  Secured s("sec-pid");
  Agent a = StartAgent(s.dir, s.lh.url(), "g0", {"--token-file", s.token_file});
  Process bystander({"/bin/sleep", "60"}, s.dir + "/sleep.log");
  // This test process is the trainer; it names the bystander.
  auto c = http::Client::Create("unix:" + a.socket);
  REQUIRE(c.ok());
  auto r = (*c)->Do("POST", "/v1/trainer/hello",
                    fmt::format(R"({{"group_rank":0,"group_size":1,"pid":{}}})", bystander.pid()),
                    http::kJsonType, Millis(5000));
  REQUIRE(r.ok());
  REQUIRE(r->status == 200);
  std::string line = a.process->WaitForLog("trainer_pid_claim_ignored", 5s);
  CHECK(line.find(fmt::format("claimed_pid={}", bystander.pid())) != std::string::npos);
  CHECK(line.find(fmt::format("peer_pid={}", ::getpid())) != std::string::npos);
  bystander.Signal(SIGKILL);
  REQUIRE(bystander.Wait(5s).has_value());
  // Kept: the sleep is what is under test (nothing happens for a while after the exit).
  std::this_thread::sleep_for(1s);
  CHECK(a.process->Running());
  CHECK(a.process->WaitForLog("trainer_exited", 10ms).empty());
  CHECK(a.process->WaitForLog("trainer_crashed", 10ms).empty());
  auto st = Ask("http://" + a.serve, "GET", "/v1/agent/status", "", kToken);
  CHECK(JsonField(st.body, "trainers") == "1");
  CHECK(JsonField(st.body, "draining") == "false");
}

// In a forked child: becomes `nobody`, connects to `socket` and sends `request`; writes what
// happened to `out` ("connect errno=N" or the answer's first line). Only system calls after the
// fork: the parent has threads.
[[noreturn]] void AsNobody(const std::string& socket, const std::string& request, int out) {
  auto say = [out](const char* text, size_t n) { (void)!::write(out, text, n); };
  if (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0) {
    say("setuid failed", 13);
    ::_exit(1);
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket.c_str(), std::min(socket.size(), sizeof(addr.sun_path) - 1));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    char buf[64];
    int n = std::snprintf(buf, sizeof buf, "connect errno=%d", errno);
    say(buf, static_cast<size_t>(n));
    ::_exit(0);
  }
  (void)!::write(fd, request.data(), request.size());
  char buf[4096];
  ssize_t n = ::read(fd, buf, sizeof buf);
  if (n > 0) say(buf, static_cast<size_t>(n));
  ::_exit(0);
}

std::string RunAsNobody(const std::string& socket, const std::string& request) {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(p[0]);
    AsNobody(socket, request, p[1]);
  }
  ::close(p[1]);
  std::string got;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(p[0], buf, sizeof buf)) > 0) got.append(buf, static_cast<size_t>(n));
  ::close(p[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return got;
}

// Issue 30: an agent serving peers beyond loopback needs a token (or says it runs open on
// purpose), and never hands peers an unspecified address: --advertise takes an interface name.
TEST_CASE("an agent's --serve beyond loopback needs a token, and 0.0.0.0 is never advertised") {
  auto dir = TempDir("agent-open");
  auto lh = StartLighthouse(dir + "/lh", {}, dir + "/lh.log");
  auto run = [&](const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> argv{BinDir() + "/replica_agent",
                                  "--lighthouse",
                                  lh.url(),
                                  "--job",
                                  "t",
                                  "--group-id",
                                  name,
                                  "--socket",
                                  dir + "/" + name + ".sock"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<Process>(argv, dir + "/" + name + ".log");
  };
  auto no_token = run("a", {"--serve", "0.0.0.0:0"});
  REQUIRE(no_token->Wait(10s).has_value());
  CHECK(no_token->Log().find("--serve 0.0.0.0:0 reaches beyond this host and there is no "
                             "--token-file") != std::string::npos);
  auto no_advertise = run("b", {"--serve", "0.0.0.0:0", "--insecure-no-auth"});
  REQUIRE(no_advertise->Wait(10s).has_value());
  CHECK(no_advertise->Log().find("listens on every address of the host, which cannot be given "
                                 "to peers") != std::string::npos);
  auto no_iface =
      run("c", {"--serve", "0.0.0.0:0", "--insecure-no-auth", "--advertise", "lk-none0"});
  REQUIRE(no_iface->Wait(10s).has_value());
  CHECK(no_iface->Log().find("interface lk-none0: no such interface") != std::string::npos);
  // An interface name: its address and the bound port are what peers are given.
  auto by_iface = run("d", {"--serve", "0.0.0.0:0", "--insecure-no-auth", "--advertise", "lo"});
  const std::string line = by_iface->WaitForLog("agent_listening", 10s);
  REQUIRE_FALSE(line.empty());
  const std::string bound = line.substr(line.find("serve=0.0.0.0:") + 14);
  const std::string port = bound.substr(0, bound.find(' '));
  CHECK(line.find("advertise=127.0.0.1:" + port + " ") != std::string::npos);
  by_iface->Signal(SIGTERM);
  (void)by_iface->Wait(10s);
}

TEST_CASE("the trainer socket is mode 0600 and a peer of another uid is refused") {
  if (::geteuid() != 0) {
    // A second uid needs root here (setuid to nobody); CTest counts this exit as skipped.
    MESSAGE("skipped: not root, cannot connect as another uid");
    std::fflush(stdout);
    std::_Exit(77);
  }
  Secured s("sec-uid");
  Agent a = StartAgent(s.dir, s.lh.url(), "g0", {"--token-file", s.token_file});
  WaitForGroup(s.lh.url(), "g0");
  std::string status_before = Ask("http://" + a.serve, "GET", "/v1/agent/status", "", kToken).body;
  std::string job_before = Fingerprint(JobStatus(s.lh.url()));
  struct stat st {};
  REQUIRE(::stat(a.socket.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  CHECK(st.st_uid == ::geteuid());
  std::string hello_body = R"({"group_rank":0,"group_size":1})";
  std::string hello = fmt::format(
      "POST /v1/trainer/hello HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: {}\r\nConnection: close\r\n\r\n{}",
      hello_body.size(), hello_body);
  // The file's mode keeps another user out before any byte is read.
  CHECK(RunAsNobody(a.socket, hello) == fmt::format("connect errno={}", EACCES));
  // Widened by someone (or a descriptor handed on): the agent still checks the peer's uid.
  REQUIRE(::chmod(a.socket.c_str(), 0666) == 0);
  std::string answer = RunAsNobody(a.socket, hello);
  CHECK_MESSAGE(answer.rfind("HTTP/1.1 403", 0) == 0, answer);
  CHECK_MESSAGE(answer.find("peer_uid_mismatch") != std::string::npos, answer);
  CHECK_MESSAGE(answer.find("PEER_UID_MISMATCH") != std::string::npos, answer);
  CHECK_FALSE(a.process->WaitForLog("reason=peer_uid_mismatch peer_uid=65534", 5s).empty());
  CHECK(a.process->Running());
  CHECK(Ask("http://" + a.serve, "GET", "/v1/agent/status", "", kToken).body == status_before);
  CHECK(Fingerprint(JobStatus(s.lh.url())) == job_before);
}

// Publishes rank 0 of a one-rank live state at `step` where an agent's --serve-dir points.
std::vector<ckpt::testing::TensorSpec> PublishLive(const std::string& dir, int64_t step) {
  auto model = ckpt::testing::SmallModel();
  ckpt::LivePublisherOptions o;
  o.base_dir = dir;
  auto res = ckpt::LiveStatePublisher(o).Publish(ckpt::testing::MakeSnapshot(model, step, 0, 1));
  REQUIRE_MESSAGE(res.ok(), res.status().ToString());
  return model;
}

ckpt::PeerRecoveryOptions Recovery(const std::string& token, const std::string& ca) {
  ckpt::PeerRecoveryOptions o;
  o.layout = ckpt::TargetLayout{1, 0};
  o.step = 5;
  o.peer.client.token = token;
  o.peer.client.ca_file = ca;
  o.peer.request_timeout = Millis(5000);
  return o;
}

TEST_CASE(
    "shard reads need the job's token: none is 401, a wrong one 403, the right one is served") {
  Secured s("sec-shards");
  std::string live = s.dir + "/live";
  auto model = PublishLive(live, 5);
  Agent a =
      StartAgent(s.dir, s.lh.url(), "g0", {"--token-file", s.token_file, "--serve-dir", live});
  std::string peer = "http://" + a.serve;
  auto none = Ask(peer, "GET", "/v1/shards/checkpoints");
  CHECK(none.status == 401);
  CHECK(none.body.find("token_missing") != std::string::npos);
  CHECK(Ask(peer, "GET", "/v1/shards/checkpoints", "", "wrong").status == 403);
  // The fetcher a healing trainer uses: refused without the token, served with it.
  CHECK(ckpt::ListPeer(peer, Recovery("", "").peer).status().code() == Code::kUnauthenticated);
  CHECK(ckpt::ListPeer(peer, Recovery("wrong", "").peer).status().code() ==
        Code::kPermissionDenied);
  CHECK_FALSE(ckpt::RecoverFromPeers({peer}, Recovery("wrong", "")).ok());
  auto state = ckpt::RecoverFromPeers({peer}, Recovery(kToken, ""));
  REQUIRE_MESSAGE(state.ok(), state.status().ToString());
  ckpt::testing::CheckState(*state, model, 5);
  // The trainer side takes the token from LK_TOKEN_FILE.
  setenv("LK_TOKEN_FILE", s.token_file.c_str(), 1);
  http::ClientOptions from_env;
  REQUIRE(http::ClientOptionsFromEnv(&from_env).ok());
  unsetenv("LK_TOKEN_FILE");
  CHECK(from_env.token == kToken);
  CHECK(a.process->Running());
}

TEST_CASE(
    "TLS: an agent and lkctl with the private CA work against a TLS lighthouse - so does https "
    "--serve") {
  Secured plain("sec-tls");
  Pki pki(plain.dir);
  Lighthouse lh = StartLighthouse(plain.dir + "/data-tls",
                                  {"--token-file", plain.token_file, "--tls-cert-file",
                                   pki.Cert("good"), "--tls-key-file", pki.Key("good")},
                                  plain.dir + "/lighthouse-tls.log");
  std::string url = "https://" + lh.address;
  std::string live = plain.dir + "/live";
  auto model = PublishLive(live, 5);
  Agent a =
      StartAgent(plain.dir, url, "g0",
                 {"--token-file", plain.token_file, "--ca-file", pki.Ca(), "--serve-dir", live,
                  "--tls-cert-file", pki.Cert("good"), "--tls-key-file", pki.Key("good")});
  CHECK(WaitUntil(
      [&] {
        pb::JobStatus j = JobStatus(url, pki.Ca());
        for (const auto& g : j.groups()) {
          if (g.group_id() == "g0") return true;
        }
        return false;
      },
      20s, "g0 in the TLS lighthouse's /status"));
  // The name is checked too: localhost is in the certificate as well.
  auto port = lh.address.substr(lh.address.rfind(':') + 1);
  CHECK(JobStatus("https://localhost:" + port, pki.Ca()).groups_size() == 1);
  std::string out = plain.dir + "/lkctl.out";
  int rc = std::system(fmt::format("{}/lkctl --lighthouse {} --token-file {} --ca-file {} status "
                                   "--job t > {} 2>&1",
                                   BinDir(), url, plain.token_file, pki.Ca(), out)
                           .c_str());
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK_MESSAGE(rc == 0, text);
  CHECK(text.find("g0") != std::string::npos);
  // --serve with TLS advertises https, and a healing trainer fetches over it with the CA.
  CHECK_FALSE(a.process->WaitForLog("advertise=https://127.0.0.1:", 1s).empty());
  std::string peer = "https://" + a.serve;
  auto state = ckpt::RecoverFromPeers({peer}, Recovery(kToken, pki.Ca()));
  REQUIRE_MESSAGE(state.ok(), state.status().ToString());
  ckpt::testing::CheckState(*state, model, 5);
  // Without the CA (the system's do not know it) the agent's certificate is refused.
  auto untrusting = ckpt::ListPeer(peer, Recovery(kToken, "").peer);
  CHECK_FALSE(untrusting.ok());
  CHECK(untrusting.status().message().find("certificate refused") != std::string::npos);
}

TEST_CASE(
    "TLS: another host's, an expired and an unknown CA's certificate are each refused - the agent "
    "retries, never joins") {
  Secured plain("sec-tls-bad");
  Pki pki(plain.dir);
  struct Case {
    std::string cert;
    std::string error;  // what OpenSSL says, in the agent's log and lkctl's error
  };
  std::vector<Case> cases{{"wrong-host", "IP address mismatch"},
                          {"expired", "certificate has expired"},
                          {"unknown-ca", "unable to get local issuer certificate"}};
  for (const auto& c : cases) {
    CAPTURE(c.cert);
    Lighthouse lh = StartLighthouse(plain.dir + "/data-" + c.cert,
                                    {"--token-file", plain.token_file, "--tls-cert-file",
                                     pki.Cert(c.cert), "--tls-key-file", pki.Key(c.cert)},
                                    plain.dir + "/lighthouse-" + c.cert + ".log");
    std::string url = "https://" + lh.address;
    Agent a = StartAgent(plain.dir, url, "g-" + c.cert,
                         {"--token-file", plain.token_file, "--ca-file", pki.Ca()});
    std::string line = a.process->WaitForLog("heartbeat_failed", 10s);
    CHECK_MESSAGE(line.find(c.error) != std::string::npos, line);
    CHECK(line.find("certificate refused") != std::string::npos);
    // It keeps trying (the lighthouse may get a good certificate), stays up, and never joins.
    // Kept: the sleep is what is under test (no join for a while).
    std::this_thread::sleep_for(1500ms);
    CHECK(a.process->Running());
    CHECK(a.process->WaitForLog("lighthouse_reachable", 10ms).empty());
    CHECK(JobStatus(url, "", /*verify=*/false).groups_size() == 0);
    std::string out = plain.dir + "/lkctl-" + c.cert + ".out";
    int rc = std::system(fmt::format("{}/lkctl --lighthouse {} --token-file {} --ca-file {} status "
                                     "> {} 2>&1",
                                     BinDir(), url, plain.token_file, pki.Ca(), out)
                             .c_str());
    std::ifstream in(out);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK(rc != 0);
    CHECK_MESSAGE(text.find(c.error) != std::string::npos, text);
  }
}

// A local e2e run failed on it: a socket file left by an earlier job of the same Slurm job id
// refused the trainer's hello (the trainer steps wait for the file, which was there already),
// and the trainer exited before its agent replaced the file.
TEST_CASE("a trainer that starts before its agent listens waits for it: a stale socket file too") {
  std::string dir = TempDir("sec-early");
  Lighthouse lh = StartLighthouse(dir + "/data", {}, dir + "/lighthouse.log");
  const std::string socket = dir + "/g0.sock";
  {
    // What an agent that died leaves: a socket file nobody listens on.
    int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", socket.c_str());
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    ::close(fd);
  }
  auto early =
      std::async(std::launch::async, [&] { return client::Session::Connect(socket, 0, 1); });
  // The hello is being refused, and retried, before the agent starts.
  REQUIRE(early.wait_for(300ms) == std::future_status::timeout);
  Agent a = StartAgent(dir, lh.url(), "g0", {});
  REQUIRE(a.socket == socket);
  REQUIRE(early.wait_for(20s) == std::future_status::ready);
  auto session = early.get();
  REQUIRE_MESSAGE(session.ok(), session.status().ToString());
  // Registered with the new agent: its first poll is answered.
  auto poll = (*session)->Poll(0, Millis(20'000));
  CHECK_MESSAGE(poll.ok(), poll.status().ToString());
}

TEST_CASE("~Session joins its notice thread: a callback in progress has finished when it returns") {
  std::string dir = TempDir("sec-session");
  Lighthouse lh = StartLighthouse(dir + "/data", {}, dir + "/lighthouse.log");
  Agent a = StartAgent(dir, lh.url(), "g0", {});
  auto session = client::Session::Connect(a.socket, 0, 1);
  REQUIRE_MESSAGE(session.ok(), session.status().ToString());
  auto poll = (*session)->Poll(0, Millis(20'000));
  REQUIRE_MESSAGE(poll.ok(), poll.status().ToString());
  std::atomic<bool> in_callback{false}, finished{false};
  (*session)->OnNotice([&](const client::Notice&) {
    in_callback = true;
    // Kept: a slow callback is what is under test (reset waits for it), not an order.
    std::this_thread::sleep_for(500ms);
    finished = true;
    in_callback = false;
  });
  // A drain reaches every trainer's notice; the agent then waits for this process to exit.
  a.process->Signal(SIGTERM);
  REQUIRE(WaitUntil([&] { return in_callback.load(); }, 10s, "the notice callback running", 1ms));
  session->reset();
  CHECK_FALSE(in_callback.load());
  CHECK(finished.load());
}

}  // namespace
}  // namespace lk::test
