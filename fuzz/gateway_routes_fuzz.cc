// lk_gateway's routes, whole requests through the real route table and relay (gateway/gateway.cc
// over relay_rules.cc) as a site's agents and anyone else on the site's network send them, with a
// real lighthouse behind it on loopback: the Service over the in-memory state store, on its own
// thread, reached by the gateway's relay threads over TCP. Between the two sits a counting
// listener, the lighthouse's own handler behind a second http::Server, which records every
// request that reaches the lighthouse and its answer: the only way a call gets there is over
// that socket, so the count is exact, and cheaper than the lighthouse's /status.
//
// The tokens: the job's (j), another job's (k), an all-jobs token, a read-only one, the admin's,
// a wrong one, the gateway's own credential as if an agent sent it, and none. The gateway's token
// file names j, k, the all-jobs, the read-only and the gateway credential; the lighthouse's the
// same, so that the two disagree only when the gateway reads a call's job differently from the
// lighthouse. A query parameter "gateway=" becomes the request's Lk-Gateway header (an agent's
// forgery); a body over the gateway's limit goes to the gateway's real listener instead, whose
// server must refuse it before the handler.
//
// A query parameter "via=" picks another gateway of the fixture (and is dropped from the call):
// "open", one without a token file (it relays every call on a relayed route, whatever its
// token, and the lighthouse judges the token); "busy", one with a single relay thread, handed
// the call twice at once (the second finds the thread taken: 503 WORKERS_BUSY, which never
// reaches the lighthouse); "stopped", one that was stopped (every call it would relay is
// answered 503 SHUTTING_DOWN, and nothing reaches the lighthouse); "wan", the default gateway's
// --wan-listen routes (the other gateways' exchange: nothing there reaches the lighthouse).
//
// Invariants (besides route_fuzz.h's): a refusal carries its reason code; at most one request
// reaches the lighthouse per call; a call without a token that relays (none, wrong, read-only,
// admin, the gateway credential), on a route the gateway does not relay, or with an oversized
// body never reaches it, and is refused 4xx (a refusal thus changes nothing behind the gateway);
// a call that reaches it arrives unchanged (method, path, query, body, content type, the agent's
// token) with the gateway's own Lk-Gateway and never the agent's, the lighthouse does not refuse
// it for its token (the gateway read the same job), and its answer comes back unchanged; no
// call but /healthz and the exchange's own routes (/v1/site, /v1/exchange, with a token of
// their job) is answered 2xx without reaching the lighthouse, and those never reach it; the
// lighthouse, which is up, is never reported unreachable.
#include <sanitizer/lsan_interface.h>
#include <stdlib.h>
#include <unistd.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>

#include "common/http/auth.h"
#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/log.h"
#include "fuzz/lighthouse_options.h"
#include "fuzz/route_fuzz.h"
#include "gateway/gateway.h"
#include "gateway/relay_rules.h"
#include "lighthouse/memory_state_store.h"
#include "lighthouse/service.h"

namespace {

using namespace lk;

// The gateway's body limit in this target: larger bodies take the socket path.
constexpr uint64_t kBodyBytesMax = 2048;
constexpr char kCredential[] = "gw-cred";
constexpr char kSite[] = "site-a";

// The paths 0..17 are lighthouse_routes' in its order, so that its recorded seeds keep their
// meaning here (fuzz/gateway_seeds.py); the tokens 0..5 likewise.
const fuzz::RouteTables& Tables() {
  static const fuzz::RouteTables t{
      {"/v1/heartbeat",
       "/v1/quorum",
       "/v1/leave",
       "/v1/commit",
       "/v1/watch",
       "/v1/kv/j/",
       "/v1/kv/",
       "/v1/kv",
       "/v1/checkpoints",
       "/status",
       "/metrics",
       "/healthz",
       "/",
       "/v1/admin/drain",
       "/v1/admin/forget",
       "",
       "/v1/kv/j/1/",
       "/v1/kv/k/0/",
       "/v1/event",
       "/v1/kv/k/",
       "/v1/kv/j",
       "/v1/admin/",
       "/v1/heartbeat/",
       "/v1/trainer/hello",
       "/v1/exchange",
       "/v1/site",
       "/v1/wan/exchange"},
      {"", "Bearer secret-j", "Bearer prom", "Bearer all-jobs", "Bearer root-token", "Bearer wrong",
       "Bearer secret-k", "Bearer gw-cred"}};
  return t;
}

// The tokens the gateway relays for (a job's, or every job's).
bool RelayingToken(const std::string& authorization) {
  return authorization == "Bearer secret-j" || authorization == "Bearer secret-k" ||
         authorization == "Bearer all-jobs";
}

// The routes the gateway relays, as its README lists them (an oracle apart from relay_rules.cc).
bool RelayedRoute(const http::Request& r) {
  const std::string& p = r.path;
  if (p == "/v1/heartbeat" || p == "/v1/quorum" || p == "/v1/leave" || p == "/v1/commit" ||
      p == "/v1/event") {
    return r.method == "POST";
  }
  if (p == "/v1/watch") return r.method == "GET";
  if (p == "/v1/checkpoints") return r.method == "GET" || r.method == "POST";
  if (p.rfind("/v1/kv/", 0) == 0) return r.method == "GET" || r.method == "PUT";
  return false;
}

// What the lighthouse last received and answered, as the counting listener saw it.
struct Seen {
  std::mutex mu;
  uint64_t requests = 0;
  http::Request request;
  http::Response response;  // body_tail folded into body: what goes on the wire
};

class GatewayFixture {
 public:
  GatewayFixture() {
    // The fixture lives for the whole run: its threads and clients are no input's leaks.
    __lsan::ScopedDisabler no_leak_checks;
    SetLogLevel(LogLevel::kError);
    const char* tmp = getenv("TMPDIR");
    dir_ = std::string(tmp ? tmp : "/tmp") + "/lk-fuzz-gw-XXXXXX";
    LK_CHECK(mkdtemp(dir_.data()) != nullptr);
    const std::string common = std::string("j secret-j\nk secret-k\nall-jobs\n") +
                               "role=read-only prom\nrole=gateway " + kCredential + "\n";
    std::ofstream(dir_ + "/lh-tokens") << common;
    std::ofstream(dir_ + "/admin") << "root-token\n";
    std::ofstream(dir_ + "/gw-tokens") << common;
    std::ofstream(dir_ + "/credential") << kCredential << "\n";
    StartLighthouse();
    gw_ = StartGateway(dir_ + "/gw-tokens", 4);
    // No token file: the open mode an operator chooses on a trusted network.
    open_ = StartGateway("", 4);
    busy_ = StartGateway(dir_ + "/gw-tokens", 1);
    stopped_ = StartGateway(dir_ + "/gw-tokens", 4);
    bool stopped = false;
    boost::asio::post(gw_ioc_, [this, &stopped] {
      stopped_->Stop();
      stopped = true;
    });
    while (!stopped) gw_ioc_.run_one_for(std::chrono::milliseconds(1));
  }

  static GatewayFixture& Get() {
    static std::unique_ptr<GatewayFixture> f;
    if (!f) {
      f = std::make_unique<GatewayFixture>();
      std::atexit([] { f.reset(); });
    }
    return *f;
  }

  ~GatewayFixture() {
    __lsan::ScopedDisabler no_leak_checks;
    // What the run exercised: a run that relays nothing checks only the refusals.
    fprintf(stderr,
            "gateway_routes: inputs=%llu relayed=%llu oversized=%llu open_relayed=%llu "
            "workers_busy=%llu shutting_down=%llu\n",
            static_cast<unsigned long long>(inputs), static_cast<unsigned long long>(requests()),
            static_cast<unsigned long long>(oversized),
            static_cast<unsigned long long>(open_relayed),
            static_cast<unsigned long long>(workers_busy),
            static_cast<unsigned long long>(shutting_down));
    for (auto* g : {&gw_, &open_, &busy_, &stopped_}) {
      (*g)->Stop();
      (*g)->Join();
      g->reset();
    }
    boost::asio::post(lh_ioc_, [this] {
      counter_->Stop();
      lh_->Shutdown();
    });
    lh_work_.reset();
    lh_thread_.join();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  enum class Via { kDefault, kOpen, kBusy, kStopped, kWan };
  boost::asio::io_context& ioc() { return gw_ioc_; }
  http::Handler handler(Via via) const {
    switch (via) {
      case Via::kOpen: return open_->handler();
      case Via::kBusy: return busy_->handler();
      case Via::kStopped: return stopped_->handler();
      case Via::kWan: return gw_->wan_handler();
      case Via::kDefault: break;
    }
    return gw_->handler();
  }
  Seen& seen() { return seen_; }
  uint64_t requests() {
    std::lock_guard<std::mutex> lock(seen_.mu);
    return seen_.requests;
  }
  // The fuzzing thread's counts, printed at exit.
  uint64_t inputs = 0, oversized = 0, open_relayed = 0, workers_busy = 0, shutting_down = 0;

  // A request with an oversized body, through the gateway's own listener (its server's limit is
  // what refuses it, before any handler). Returns the answer, or nullopt when the connection was
  // cut instead.
  std::optional<http::Response> OverSocket(const http::Request& req, Via via) {
    http::ClientOptions o;
    o.token = std::string(http::BearerToken(req.authorization));
    const gateway::Gateway& g = via == Via::kOpen ? *open_ : via == Via::kBusy ? *busy_ : *gw_;
    auto c = http::Client::Create(
        "http://" + (via == Via::kWan ? gw_->wan_address() : g.address()), o);
    LK_CHECK(c.ok()) << c.status().ToString();
    std::string target = gateway::UpstreamTarget(req);
    auto done = std::async(std::launch::async, [&] {
      return (*c)->Do(req.method.empty() ? "GET" : req.method, target, req.body, req.content_type,
                      std::chrono::seconds(30), req.accept.empty() ? "" : "Accept", req.accept);
    });
    // The gateway's io_context is this thread's to run.
    while (done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      gw_ioc_.run_one_for(std::chrono::milliseconds(1));
    }
    auto r = done.get();
    if (!r.ok()) return std::nullopt;
    return std::move(*r);
  }

 private:
  void StartLighthouse() {
    // Every long poll ends at once, so each relayed call is answered within its input.
    lh_ = std::make_unique<lighthouse::Service>(
        lh_ioc_, fuzz::FuzzedLighthouseOptions(dir_ + "/lh-tokens", dir_ + "/admin"),
        lighthouse::NewMemoryStateStore());
    Status st = lh_->Start();
    LK_CHECK(st.ok()) << st.ToString();
    http::ServerOptions so;
    so.single_thread = true;
    counter_ = std::make_unique<http::Server>(
        lh_ioc_, so, [this, inner = lh_->handler()](http::Request&& req, http::Responder respond) {
          {
            std::lock_guard<std::mutex> lock(seen_.mu);
            ++seen_.requests;
            seen_.request = req;
            seen_.response = http::Response{};
          }
          inner(std::move(req), [this, respond](http::Response r) {
            {
              std::lock_guard<std::mutex> lock(seen_.mu);
              seen_.response.status = r.status;
              seen_.response.content_type = r.content_type;
              seen_.response.body = r.body + (r.body_tail ? *r.body_tail : std::string());
            }
            respond(std::move(r));
          });
        });
    st = counter_->Listen("127.0.0.1:0");
    LK_CHECK(st.ok()) << st.ToString();
    lh_thread_ = std::thread([this] { lh_ioc_.run(); });
  }

  std::unique_ptr<gateway::Gateway> StartGateway(const std::string& token_file,
                                                 uint32_t relays_max) {
    gateway::GatewayOptions o;
    o.site = kSite;
    o.lighthouse = "http://" + counter_->LocalAddress();
    o.listen = "127.0.0.1:0";
    o.token_file = token_file;
    o.gateway_token_file = dir_ + "/credential";
    o.http.single_thread = true;
    o.http.body_bytes_max = kBodyBytesMax;
    // One call is in flight at a time; a second thread covers the moment the last one takes to
    // return to idle after answering (the busy gateway has one on purpose).
    o.relays_max = relays_max;
    // The lighthouse answers at once; a relay that takes this long is a hang, not a slow WAN.
    o.long_poll_max = Millis(0);
    o.upstream_timeout = Millis(20'000);
    // An exchange round waits for members and sites that never come here: it fails at once,
    // at the next sweep, instead of at a member's deadline.
    o.exchange_timeout_max = Millis(0);
    o.exchange_sweep = Millis(5);
    o.exchange_bytes_max = 1 << 20;
    o.wan_listen = "127.0.0.1:0";
    auto g = std::make_unique<gateway::Gateway>(gw_ioc_, o);
    Status st = g->Start();
    LK_CHECK(st.ok()) << st.ToString();
    return g;
  }

  std::string dir_;
  boost::asio::io_context lh_ioc_;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> lh_work_{
      lh_ioc_.get_executor()};
  std::unique_ptr<lighthouse::Service> lh_;
  std::unique_ptr<http::Server> counter_;
  std::thread lh_thread_;
  Seen seen_;
  boost::asio::io_context gw_ioc_;
  std::unique_ptr<gateway::Gateway> gw_, open_, busy_, stopped_;
};

Reason ReasonOf(const http::Response& r) {
  return http::StatusFromErrorBody(r.status, r.body, r.content_type).reason();
}

// A call that reached the lighthouse: it arrived as the agent sent it, with the gateway's own
// Lk-Gateway, was not refused there for its token (unless the gateway is open: then the
// lighthouse is the one that judges it), and its answer came back unchanged.
void CheckRelayed(Seen& seen, const http::Request& sent, const http::Response& got,
                  const std::string& what, bool open, bool same_answer) {
  std::lock_guard<std::mutex> lock(seen.mu);
  const http::Request& in = seen.request;
  LK_CHECK(in.method == sent.method && in.path == sent.path && in.query == sent.query &&
           in.body == sent.body && in.content_type == sent.content_type &&
           in.authorization == sent.authorization)
      << "relayed changed: " << what << " arrived as " << in.method << " " << in.path;
  LK_CHECK(in.gateway == std::string(kCredential) + " " + kSite)
      << "Lk-Gateway at the lighthouse is '" << in.gateway << "': " << what;
  const http::Response& lh = seen.response;
  Reason lh_reason = ReasonOf(lh);
  LK_CHECK(open || !(lh.status == 401 || lh.status == 403) ||
           (lh_reason != Reason::kTokenMissing && lh_reason != Reason::kTokenInvalid &&
            lh_reason != Reason::kRoleForbids))
      << "relayed a call the lighthouse refused for its token (" << ReasonName(lh_reason)
      << "): " << what << " -> " << lh.body;
  LK_CHECK(!same_answer ||
           (got.status == lh.status && got.content_type == lh.content_type && got.body == lh.body))
      << "answer changed on the way back: " << what << ": " << lh.status << " -> " << got.status;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using Via = GatewayFixture::Via;
  GatewayFixture& f = GatewayFixture::Get();
  http::Request req = fuzz::DecodeRequest(data, size, Tables());
  if (auto g = req.query.find("gateway"); g != req.query.end()) {
    req.gateway = g->second;
    req.query.erase(g);
  }
  Via via = Via::kDefault;
  if (auto v = req.query.find("via"); v != req.query.end()) {
    via = v->second == "open"      ? Via::kOpen
          : v->second == "busy"    ? Via::kBusy
          : v->second == "stopped" ? Via::kStopped
          : v->second == "wan"     ? Via::kWan
                                   : Via::kDefault;
    req.query.erase(v);
  }
  const http::Request sent = req;
  // The stopped gateway listens nowhere: an oversized body goes to its handler like any call.
  const bool oversized = req.body.size() > kBodyBytesMax && via != Via::kStopped;
  const bool relaying = via == Via::kOpen || RelayingToken(req.authorization);
  // The WAN listener relays nothing: it has the other gateways' exchange only.
  const bool must_refuse =
      !relaying || !RelayedRoute(req) || oversized || via == Via::kWan;
  // The gateway's own routes (the outer exchange): answered by the gateway alone, 2xx only
  // for a token of the call's job (an exchange of one member, or the site's name).
  const bool own = via == Via::kWan ? req.path == "/v1/wan/exchange"
                                    : req.path == "/v1/site" || req.path == "/v1/exchange";
  const bool healthz = (req.path == "/healthz" && req.method == "GET") ||
                       (own && relaying && via != Via::kStopped);
  ++f.inputs;
  f.oversized += oversized;
  std::string what = req.method + " " + req.path + " auth='" + req.authorization + "' via=" +
                     std::to_string(static_cast<int>(via));
  uint64_t before = f.requests();

  // The answers: one per call (two for the busy gateway), nullopt for a connection cut.
  std::vector<std::optional<http::Response>> answers;
  if (oversized) {
    // A connection cut instead of an answer refuses too; either way nothing may reach the
    // lighthouse (below).
    auto got = f.OverSocket(req, via);
    if (got) {
      fuzz::CheckStatus(*got, what);
      // An answer to HEAD has no body on the wire, so no reason code to read.
      if (req.method != "HEAD") fuzz::CheckReasonCode(*got, what);
    }
    answers.push_back(std::move(got));
  } else {
    std::shared_ptr<fuzz::Answer> first;
    if (via == Via::kBusy) {
      // The first call takes the only relay thread and is not waited for; the second comes
      // while it relays.
      first = fuzz::Drive(f.ioc(), f.handler(via), req, std::chrono::seconds(30), true);
    }
    auto a = fuzz::Drive(f.ioc(), f.handler(via), std::move(req), std::chrono::seconds(30));
    if (first) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (std::chrono::steady_clock::now() < deadline) {
        {
          std::lock_guard<std::mutex> lock(first->mu);
          if (first->calls > 0) break;
        }
        f.ioc().run_one_for(std::chrono::milliseconds(1));
      }
    }
    for (const auto& x : {first, a}) {
      if (!x) continue;
      std::lock_guard<std::mutex> lock(x->mu);
      LK_CHECK(x->calls == 1) << "not answered: " << what;
      fuzz::CheckReasonCode(x->response, what);
      answers.push_back(x->response);
    }
  }
  uint64_t reached = f.requests() - before;
  uint64_t busy = 0;
  for (const auto& r : answers) {
    if (!r) continue;
    const Reason reason = ReasonOf(*r);
    LK_CHECK(!(r->status == 503 && reason == Reason::kLighthouseUnreachable))
        << "the lighthouse, which is up, reported unreachable: " << what << " -> " << r->body;
    // A stopped gateway relays nothing: what it does not refuse for the call itself, it
    // refuses as shutting down.
    LK_CHECK(via != Via::kStopped || healthz || (r->status >= 400 && r->status < 500) ||
             (r->status == 503 && reason == Reason::kShuttingDown))
        << "the stopped gateway answered " << r->status << ": " << what << " -> " << r->body;
    if (r->status == 503 && reason == Reason::kWorkersBusy) {
      LK_CHECK(via == Via::kBusy) << "WORKERS_BUSY with one call in flight: " << what;
      ++busy;
    }
    f.shutting_down += r->status == 503 && reason == Reason::kShuttingDown;
  }
  f.workers_busy += busy;
  if (via == Via::kOpen) f.open_relayed += reached;
  const uint64_t calls = answers.size();
  LK_CHECK(reached <= calls - busy)
      << reached << " requests reached the lighthouse for " << calls << " calls (" << busy
      << " refused busy): " << what;
  if (via == Via::kStopped) LK_CHECK(reached == 0) << "the stopped gateway relayed: " << what;
  if (must_refuse) {
    LK_CHECK(reached == 0) << "a call the gateway must refuse reached the lighthouse: " << what;
  }
  for (const auto& r : answers) {
    if (must_refuse) {
      LK_CHECK(!r || healthz || (r->status >= 400 && r->status < 500))
          << "a call the gateway must refuse was answered " << r->status << ": " << what;
    }
    // Success is the lighthouse's to give: the gateway's own answers are refusals (and health).
    LK_CHECK(reached >= 1 || !r || healthz || r->status >= 400)
        << "answered " << r->status << " without asking the lighthouse: " << what;
    // The busy gateway's two calls are the same request: the counter holds whichever reached
    // the lighthouse last, so an answer is compared with the lighthouse's only when one did.
    if (reached >= 1 && r && !(r->status == 503 && ReasonOf(*r) == Reason::kWorkersBusy)) {
      CheckRelayed(f.seen(), sent, *r, what, via == Via::kOpen, reached == 1);
    }
  }
  return 0;
}
