// The gateway's shell: the listener, the edge checks (relay_rules.h) on the io thread, and the
// relays, each on a thread of a bounded set with its own keep-alive clients to the lighthouse.
#include "gateway/gateway.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "common/flags.h"
#include "common/http/auth.h"
#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/http/head.h"
#include "common/http/tokens.h"
#include "common/log.h"
#include "gateway/exchange.h"
#include "gateway/relay_rules.h"

#include <boost/asio/steady_timer.hpp>

namespace lk::gateway {

using http::Request;
using http::Responder;
using http::Response;

// Answer headers a relay passes back besides the status, type and body; the framing ones
// (length, connection) are the gateway's own connection's.
constexpr std::string_view kPassedHeaders[] = {"retry-after", "content-range", "accept-ranges",
                                               "www-authenticate"};

// How long a dialed gateway that refused a job's round (or could not be reached) while not
// known to be of the round is left out of that job's rounds.
constexpr Millis kPeerBackoff{10'000};

struct Gateway::Impl : std::enable_shared_from_this<Gateway::Impl> {
  // A relay thread's clients to the lighthouse, one per token it forwarded (each sends its own
  // Authorization), kept alive between calls.
  using Clients = std::map<std::string, std::unique_ptr<http::Client>>;
  using Task = std::function<void(Clients&)>;

  Impl(boost::asio::io_context& ioc, GatewayOptions o) : ioc(ioc), options(std::move(o)) {}

  boost::asio::io_context& ioc;
  GatewayOptions options;
  http::Tokens tokens;
  http::ClientOptions client_options;  // the CA and proxy; the token is each call's own
  std::unique_ptr<http::Server> server;
  std::unique_ptr<http::Server> wan_server;  // --wan-listen: the other gateways only

  std::mutex mu;  // guards everything below
  std::condition_variable cv;
  std::deque<Task> queue;
  std::vector<std::thread> threads;
  uint32_t idle = 0;
  bool stopping = false;
  std::set<http::Client*> clients;  // every relay thread's, to cancel them at Stop
  bool unreachable = false;         // the lighthouse's last relay failed in transport

  // The outer exchange (exchange.h): its rounds, the gateways this one dials, what each of them
  // answered as (its site), and the timer that fails rounds past their deadline.
  std::unique_ptr<Exchange> exchange;
  std::vector<std::string> wan_peers;           // URLs
  std::map<std::string, std::string> peer_site;  // URL -> site (guarded by mu)
  // (URL, job) -> until when that gateway is not dialed for that job: it refused or could not
  // be reached while not known to be of the round (guarded by mu).
  std::map<std::pair<std::string, std::string>, TimePoint> peer_backoff;
  std::unique_ptr<boost::asio::steady_timer> sweep_timer;
  std::atomic<uint64_t> wan_sent{0};      // partial sums sent to other gateways, bytes
  std::atomic<uint64_t> wan_received{0};  // and received from them

  void Route(Request&& req, Responder respond);
  void RouteWan(Request&& req, Responder respond);
  // The exchange routes' common edge: the job's token, as the relays check it.
  bool AuthorizeExchange(const Request& req, const Responder& respond);
  void Dial(const RoundKey& key, const RoundSpec& spec, std::shared_ptr<const std::string> partial);
  std::string TokenFor(const std::string& job) const;
  void ArmSweep();
  bool Submit(Task task);
  void RelayLoop();
  void Relay(Clients& clients, const Request& req, Millis timeout, const Responder& respond);
  http::Client* ClientFor(Clients& clients, const std::string& token,
                          const std::string& url = "");
  void NoteReachable(bool ok, const Status& error);
};

void Gateway::Impl::Route(Request&& req, Responder respond) {
  http::Format f = http::ReplyFormat(req);
  if (req.path == "/healthz") {
    if (req.method != "GET") {
      return respond(http::ErrorReply(Refuse(Code::kInvalidArgument, Reason::kMethodNotAllowed,
                                             "/healthz does not accept {}", req.method),
                                      f));
    }
    return respond(http::TextReply(200, "text/plain", "ok\n"));
  }
  if (req.path == "/v1/exchange" || req.path == "/v1/site") {
    const char* method = req.path == "/v1/site" ? "GET" : "POST";
    if (req.method != method) {
      return respond(http::ErrorReply(Refuse(Code::kInvalidArgument, Reason::kMethodNotAllowed,
                                             "{} takes {}, not {}", req.path, method, req.method),
                                      f));
    }
    if (!AuthorizeExchange(req, respond)) return;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) {
        return respond(http::ErrorReply(
            Status(Code::kUnavailable, "gateway shutting down", Reason::kShuttingDown), f));
      }
    }
    if (req.path == "/v1/site") return respond(http::TextReply(200, "text/plain", options.site));
    return exchange->Contribute(req, std::move(respond));
  }
  auto call = ClassifyCall(req, Millis(30'000));
  Status st = call.ok() ? AuthorizeCall(tokens, req, call->job) : call.status();
  if (!st.ok()) {
    LK_LOG_INFO("relay_refused peer={} method={} path={} code={} reason={}", req.peer, req.method,
                Q(req.path), ReasonName(st.reason()), Q(st.message()));
    return respond(http::ErrorReply(st, f));
  }
  Millis timeout = std::min(call->long_poll, options.long_poll_max) + options.upstream_timeout;
  auto shared = std::make_shared<Request>(std::move(req));
  bool taken = Submit([self = shared_from_this(), shared, timeout, respond](Clients& c) {
    self->Relay(c, *shared, timeout, respond);
  });
  if (!taken) {
    std::lock_guard<std::mutex> lock(mu);
    Status busy =
        stopping ? Status(Code::kUnavailable, "gateway shutting down", Reason::kShuttingDown)
                 : Refuse(Code::kUnavailable, Reason::kWorkersBusy,
                          "{} relays in flight (--relays-max); retry later", options.relays_max);
    respond(http::ErrorReply(busy, f));
  }
}

bool Gateway::Impl::AuthorizeExchange(const Request& req, const Responder& respond) {
  auto it = req.query.find("job");
  std::string job = it == req.query.end() ? "" : it->second;
  Status st = http::ValidName("job", job);
  if (st.ok()) st = AuthorizeCall(tokens, req, job);
  if (st.ok()) return true;
  LK_LOG_INFO("exchange_refused peer={} method={} path={} code={} reason={}", req.peer,
              req.method, Q(req.path), ReasonName(st.reason()), Q(st.message()));
  respond(http::ErrorReply(st.reason() == Reason::kUnspecified ? st.WithReason(Reason::kBadRequest)
                                                               : st,
                           http::ReplyFormat(req)));
  return false;
}

// The other gateways' side: only the exchange between gateways, nothing of the relays.
void Gateway::Impl::RouteWan(Request&& req, Responder respond) {
  http::Format f = http::ReplyFormat(req);
  if (req.path == "/healthz" && req.method == "GET") {
    return respond(http::TextReply(200, "text/plain", "ok\n"));
  }
  if (req.path != "/v1/wan/exchange") {
    return respond(http::ErrorReply(
        Refuse(Code::kNotFound, Reason::kNoEndpoint, "no {} on the gateways' listener", req.path),
        f));
  }
  if (req.method != "POST") {
    return respond(http::ErrorReply(Refuse(Code::kInvalidArgument, Reason::kMethodNotAllowed,
                                           "{} takes POST, not {}", req.path, req.method),
                                    f));
  }
  if (!AuthorizeExchange(req, respond)) return;
  exchange->FromPeer(req, [self = shared_from_this(), respond,
                           size = req.body.size()](Response r) {
    // Counted once taken: a refused request carried no partial.
    if (r.status == 200 && r.body_tail) {
      self->wan_received += size;
      self->wan_sent += r.body_tail->size();
    }
    respond(std::move(r));
  });
}

// The token this gateway holds for `job`: the job's own, else an all-jobs one; empty with
// tokens off (the other gateway then needs none either).
std::string Gateway::Impl::TokenFor(const std::string& job) const {
  auto it = tokens.per_job.find(job);
  if (it != tokens.per_job.end() && !it->second.empty()) return it->second.front();
  return tokens.any_job.empty() ? "" : tokens.any_job.front();
}

// Swaps this site's partial with each dialed gateway: one request each, on a relay thread; the
// answer carries the other site's partial (or NOT_IN_ROUND when it has no part in the round).
void Gateway::Impl::Dial(const RoundKey& key, const RoundSpec& spec,
                         std::shared_ptr<const std::string> partial) {
  std::string sites;
  for (const std::string& s : spec.sites) sites += (sites.empty() ? "" : ",") + s;
  const std::string target = fmt::format(
      "/v1/wan/exchange?job={}&slot={}&quorum={}&seq={}&chunk={}&chunks={}&world={}&sites={}&"
      "timeout_ms={}&codec={}&count={}&from={}",
      http::PercentEncode(key.job), key.slot, key.quorum, key.seq, key.chunk, spec.chunks,
      spec.world, http::PercentEncode(sites), std::max<int64_t>(1, spec.timeout.count()),
      comm::CodecName(spec.codec), spec.count, http::PercentEncode(options.site));
  const std::string token = TokenFor(key.job);
  for (const std::string& url : wan_peers) {
    {
      // A gateway known to be of a site outside the round is not asked, nor one that refused
      // this job lately.
      std::lock_guard<std::mutex> lock(mu);
      auto known = peer_site.find(url);
      if (known != peer_site.end() &&
          std::find(spec.sites.begin(), spec.sites.end(), known->second) == spec.sites.end()) {
        continue;
      }
      auto backoff = peer_backoff.find({url, key.job});
      if (backoff != peer_backoff.end() && std::chrono::steady_clock::now() < backoff->second) {
        continue;
      }
    }
    bool taken = Submit([self = shared_from_this(), key, spec, partial, target, token,
                         url](Clients& c) {
      http::Client* client = self->ClientFor(c, token, url);
      self->wan_sent += partial->size();
      auto r = client->Do("POST", target, *partial, "application/octet-stream",
                          spec.timeout + Millis(2'000));
      if (r.ok() && r->status == 200) self->wan_received += r->body.size();
      std::string site;
      if (r.ok()) {
        for (auto& [k, v] : r->headers) {
          if (http::IEquals(k, "lk-site")) site = v;
        }
      }
      if (!site.empty()) {
        std::lock_guard<std::mutex> lock(self->mu);
        self->peer_site[url] = site;
      }
      if (!r.ok() || r->status / 100 != 2) {
        Status st = r.ok() ? http::StatusFromResponse(*r) : r.status();
        std::string known;
        {
          std::lock_guard<std::mutex> lock(self->mu);
          auto it = self->peer_site.find(url);
          if (it != self->peer_site.end()) known = it->second;
        }
        // A gateway not known to be in the round fails nothing, whatever it answered: it may
        // be down, or serve other jobs only (401 for this job's token). If it is in the round
        // after all, the round fails at its deadline.
        const bool in_round = !known.empty() && std::find(spec.sites.begin(), spec.sites.end(),
                                                          known) != spec.sites.end();
        if (st.reason() == Reason::kNotInRound) return;
        if (!in_round) {
          // Not asked again for this job for a while: a partial sent to a gateway that
          // refuses it is WAN bandwidth lost.
          bool first = false;
          {
            std::lock_guard<std::mutex> lock(self->mu);
            auto& until = self->peer_backoff[{url, key.job}];
            first = until < std::chrono::steady_clock::now();
            until = std::chrono::steady_clock::now() + kPeerBackoff;
          }
          if (first) {
            LK_LOG_INFO("wan_peer_skipped peer={} job={} for_ms={} code={} reason={}", url,
                        key.job, kPeerBackoff.count(), ReasonName(st.reason()),
                        Q(st.message()));
          }
          return;
        }
        LK_LOG_INFO("wan_exchange_failed peer={} site={} code={} reason={}", url, known,
                    ReasonName(st.reason()), Q(st.message()));
        return self->exchange->OnPeerAnswer(
            key, st.WithContext(fmt::format("gateway {} ({})", url, known)));
      }
      self->exchange->OnPeerAnswer(key, std::make_pair(site, std::move(r->body)));
    });
    if (!taken) {
      exchange->OnPeerAnswer(key, Refuse(Code::kUnavailable, Reason::kWorkersBusy,
                                         "no relay thread free to dial {} (--relays-max)", url));
    }
  }
}

void Gateway::Impl::ArmSweep() {
  sweep_timer->expires_after(options.exchange_sweep);
  sweep_timer->async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec) return;
    {
      std::lock_guard<std::mutex> lock(self->mu);
      if (self->stopping) return;
    }
    self->exchange->Sweep(std::chrono::steady_clock::now());
    self->ArmSweep();
  });
}

// A thread idle for the call, else a new one up to relays_max: a call never queues behind long
// polls (a heartbeat behind a watch would lapse), it is refused instead.
bool Gateway::Impl::Submit(Task task) {
  std::lock_guard<std::mutex> lock(mu);
  if (stopping) return false;
  if (queue.size() < idle) {
    queue.push_back(std::move(task));
    cv.notify_one();
    return true;
  }
  if (threads.size() >= options.relays_max) return false;
  queue.push_back(std::move(task));
  threads.emplace_back([self = shared_from_this()] { self->RelayLoop(); });
  return true;
}

void Gateway::Impl::RelayLoop() {
  Clients mine;
  std::unique_lock<std::mutex> lock(mu);
  while (true) {
    ++idle;
    cv.wait(lock, [&] { return stopping || !queue.empty(); });
    --idle;
    if (queue.empty()) break;  // stopping, nothing left
    Task task = std::move(queue.front());
    queue.pop_front();
    lock.unlock();
    task(mine);
    lock.lock();
  }
  for (auto& [key, c] : mine) clients.erase(c.get());
}

http::Client* Gateway::Impl::ClientFor(Clients& mine, const std::string& token,
                                       const std::string& url) {
  // The lighthouse's clients are keyed by token, another gateway's by its URL and the token.
  const std::string key = url.empty() ? token : url + "\n" + token;
  auto it = mine.find(key);
  if (it != mine.end()) return it->second.get();
  http::ClientOptions o = client_options;
  o.token = token;
  if (!url.empty()) {
    o.headers.clear();  // the Lk-Gateway credential is for the lighthouse only
    o.ca_file = options.wan_ca_file;
    o.proxy = http::ProxyFromEnv(url);
    if (!options.proxy.empty()) o.proxy = options.proxy;
  }
  auto c = http::Client::Create(url.empty() ? options.lighthouse : url, o);
  LK_CHECK(c.ok()) << c.status().ToString();  // the URL and CA were checked at Start
  http::Client* raw = c->get();
  {
    std::lock_guard<std::mutex> lock(mu);
    if (stopping) raw->Cancel();
    clients.insert(raw);
  }
  mine.emplace(key, std::move(*c));
  return raw;
}

void Gateway::Impl::Relay(Clients& mine, const Request& req, Millis timeout,
                          const Responder& respond) {
  http::Client* client = ClientFor(mine, std::string(http::BearerToken(req.authorization)));
  // Accept travels as the extra header where it differs from the body's type (Do sends the
  // content type as both).
  std::string_view accept_name;
  if (!req.accept.empty() && req.accept != req.content_type) accept_name = "Accept";
  auto r = client->Do(req.method, UpstreamTarget(req), req.body, req.content_type, timeout,
                      accept_name, req.accept);
  if (!r.ok()) {
    Status st = r.status();
    Status out = st.code() == Code::kAborted
                     ? Status(Code::kUnavailable, "gateway shutting down", Reason::kShuttingDown)
                     : Refuse(Code::kUnavailable, Reason::kLighthouseUnreachable,
                              "lk_gateway site {} cannot reach the lighthouse: {}", options.site,
                              st.message());
    if (st.code() != Code::kAborted) NoteReachable(false, st);
    return respond(http::ErrorReply(out, http::ReplyFormat(req)));
  }
  NoteReachable(true, Status::Ok());
  Response out;
  out.status = r->status;
  out.content_type = r->content_type;
  out.body = std::move(r->body);
  for (auto& [k, v] : r->headers) {
    std::string low = k;
    for (char& ch : low) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    for (std::string_view pass : kPassedHeaders) {
      if (low == pass) out.headers.emplace_back(k, v);
    }
  }
  respond(std::move(out));
}

// Logs the lighthouse's state changes only: the first failure of an outage and the first
// success after it.
void Gateway::Impl::NoteReachable(bool ok, const Status& error) {
  std::lock_guard<std::mutex> lock(mu);
  if (ok == !unreachable) return;
  unreachable = !ok;
  if (ok) {
    LK_LOG_INFO("lighthouse_reachable site={} lighthouse={}", options.site, options.lighthouse);
  } else {
    LK_LOG_WARN("lighthouse_unreachable site={} lighthouse={} error={}", options.site,
                options.lighthouse, Q(error.ToString()));
  }
}

Gateway::Gateway(boost::asio::io_context& ioc, GatewayOptions options)
    : impl_(std::make_shared<Impl>(ioc, std::move(options))) {}

Gateway::~Gateway() { Join(); }

Status Gateway::Start() {
  Impl& s = *impl_;
  LK_RETURN_IF_ERROR(s.options.Validate());
  LK_ASSIGN_OR_RETURN(s.tokens, http::LoadTokens(s.options.token_file, ""));
  s.client_options.ca_file = s.options.ca_file;
  if (!s.options.gateway_token_file.empty()) {
    // The agents' own Lk-Gateway headers are never passed on (Relay forwards named fields
    // only): this is the only one the lighthouse sees from here.
    LK_ASSIGN_OR_RETURN(std::string credential, ReadTokenFile(s.options.gateway_token_file));
    s.client_options.headers.emplace_back("Lk-Gateway", credential + " " + s.options.site);
  }
  s.client_options.proxy =
      s.options.proxy.empty() ? http::ProxyFromEnv(s.options.lighthouse) : s.options.proxy;
  // A bad URL or an unreadable CA file is an error now, not in a relay later.
  LK_RETURN_IF_ERROR(http::Client::Create(s.options.lighthouse, s.client_options).status());
  for (size_t begin = 0; begin < s.options.wan_connect.size();) {
    size_t end = s.options.wan_connect.find(',', begin);
    if (end == std::string::npos) end = s.options.wan_connect.size();
    std::string peer = s.options.wan_connect.substr(begin, end - begin);
    begin = end + 1;
    if (peer.empty()) continue;
    if (peer.find("://") == std::string::npos) peer = "http://" + peer;
    http::ClientOptions check;
    check.ca_file = s.options.wan_ca_file;
    LK_RETURN_IF_ERROR(http::Client::Create(peer, check).status().WithContext("--wan-connect"));
    s.wan_peers.push_back(peer);
  }
  ExchangeOptions eo;
  eo.site = s.options.site;
  eo.bytes_max = s.options.exchange_bytes_max;
  eo.timeout_max = s.options.exchange_timeout_max;
  std::weak_ptr<Impl> weak = impl_;
  s.exchange = std::make_unique<Exchange>(
      eo, Exchange::Hooks{
              [weak](std::function<void()> task) {
                auto self = weak.lock();
                return self && self->Submit([task = std::move(task)](Impl::Clients&) { task(); });
              },
              [weak](const RoundKey& key, const RoundSpec& spec,
                     std::shared_ptr<const std::string> partial) {
                if (auto self = weak.lock()) self->Dial(key, spec, std::move(partial));
              }});
  http::ServerOptions so = s.options.http;
  s.server = std::make_unique<http::Server>(s.ioc, so, handler());
  LK_RETURN_IF_ERROR(s.server->Listen(s.options.listen));
  if (!s.options.wan_listen.empty()) {
    s.wan_server = std::make_unique<http::Server>(s.ioc, so, wan_handler());
    LK_RETURN_IF_ERROR(s.wan_server->Listen(s.options.wan_listen));
  }
  s.sweep_timer = std::make_unique<boost::asio::steady_timer>(s.ioc);
  s.ArmSweep();
  if (!s.tokens.enabled) {
    LK_LOG_WARN("gateway_open reason=no_token_file detail={}",
                Q("without --token-file, every call that reaches --listen is relayed"));
  }
  LK_LOG_INFO(
      "gateway_listening site={} listen={} lighthouse={} proxy={} tls={} jobs={} "
      "vouches={}",
      s.options.site, s.server->LocalAddress(), s.options.lighthouse,
      http::WithoutUserinfo(s.client_options.proxy), !s.options.http.tls_cert_file.empty(),
      s.tokens.enabled
          ? std::to_string(s.tokens.per_job.size()) + (s.tokens.any_job.empty() ? "" : "+all")
          : "any",
      !s.client_options.headers.empty());
  if (!s.options.wan_listen.empty() || !s.wan_peers.empty()) {
    LK_LOG_INFO("gateway_wan site={} wan_listen={} wan_advertise={} wan_connect={}",
                s.options.site, s.wan_server ? s.wan_server->LocalAddress() : "",
                s.options.wan_advertise, s.options.wan_connect);
  }
  return Status::Ok();
}

std::string Gateway::address() const { return impl_->server ? impl_->server->LocalAddress() : ""; }

std::string Gateway::wan_address() const {
  return impl_->wan_server ? impl_->wan_server->LocalAddress() : "";
}

void Gateway::Stop() {
  Impl& s = *impl_;
  if (s.server) s.server->Stop();
  if (s.wan_server) s.wan_server->Stop();
  if (s.sweep_timer) s.sweep_timer->cancel();
  if (s.exchange) {
    s.exchange->FailAll(Status(Code::kUnavailable, "gateway shutting down", Reason::kShuttingDown));
    Exchange::Totals t = s.exchange->totals();
    LK_LOG_INFO(
        "gateway_exchange_totals site={} rounds={} rounds_failed={} member_bytes={} "
        "wan_sent_bytes={} wan_received_bytes={}",
        s.options.site, t.rounds_done, t.rounds_failed, t.member_bytes, s.wan_sent.load(),
        s.wan_received.load());
  }
  std::lock_guard<std::mutex> lock(s.mu);
  s.stopping = true;
  for (http::Client* c : s.clients) c->Cancel();
  s.cv.notify_all();
}

void Gateway::Join() {
  Impl& s = *impl_;
  std::vector<std::thread> batch;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stopping = true;
    for (http::Client* c : s.clients) c->Cancel();
    s.cv.notify_all();
    batch.swap(s.threads);
  }
  for (auto& t : batch) t.join();
}

http::Handler Gateway::wan_handler() const {
  return [self = impl_](Request&& r, Responder w) { self->RouteWan(std::move(r), std::move(w)); };
}

http::Handler Gateway::handler() const {
  return [self = impl_](Request&& r, Responder w) { self->Route(std::move(r), std::move(w)); };
}

}  // namespace lk::gateway
