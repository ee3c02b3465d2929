// The gateway's shell: the listener, the edge checks (relay_rules.h) on the io thread, and the
// relays, each on a thread of a bounded set with its own keep-alive clients to the lighthouse.
#include "gateway/gateway.h"

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
#include "common/http/tokens.h"
#include "common/log.h"
#include "gateway/relay_rules.h"

namespace lk::gateway {

using http::Request;
using http::Responder;
using http::Response;

// Answer headers a relay passes back besides the status, type and body; the framing ones
// (length, connection) are the gateway's own connection's.
constexpr std::string_view kPassedHeaders[] = {"retry-after", "content-range", "accept-ranges",
                                               "www-authenticate"};

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

  std::mutex mu;  // guards everything below
  std::condition_variable cv;
  std::deque<Task> queue;
  std::vector<std::thread> threads;
  uint32_t idle = 0;
  bool stopping = false;
  std::set<http::Client*> clients;  // every relay thread's, to cancel them at Stop
  bool unreachable = false;         // the lighthouse's last relay failed in transport

  void Route(Request&& req, Responder respond);
  bool Submit(Task task);
  void RelayLoop();
  void Relay(Clients& clients, const Request& req, Millis timeout, const Responder& respond);
  http::Client* ClientFor(Clients& clients, const std::string& token);
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
  for (auto& [token, c] : mine) clients.erase(c.get());
}

http::Client* Gateway::Impl::ClientFor(Clients& mine, const std::string& token) {
  auto it = mine.find(token);
  if (it != mine.end()) return it->second.get();
  http::ClientOptions o = client_options;
  o.token = token;
  auto c = http::Client::Create(options.lighthouse, o);
  LK_CHECK(c.ok()) << c.status().ToString();  // the URL and CA were checked at Start
  http::Client* raw = c->get();
  {
    std::lock_guard<std::mutex> lock(mu);
    if (stopping) raw->Cancel();
    clients.insert(raw);
  }
  mine.emplace(token, std::move(*c));
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
  http::ServerOptions so = s.options.http;
  s.server = std::make_unique<http::Server>(s.ioc, so, handler());
  LK_RETURN_IF_ERROR(s.server->Listen(s.options.listen));
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
  return Status::Ok();
}

std::string Gateway::address() const { return impl_->server ? impl_->server->LocalAddress() : ""; }

void Gateway::Stop() {
  Impl& s = *impl_;
  if (s.server) s.server->Stop();
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

http::Handler Gateway::handler() const {
  return [self = impl_](Request&& r, Responder w) { self->Route(std::move(r), std::move(w)); };
}

}  // namespace lk::gateway
