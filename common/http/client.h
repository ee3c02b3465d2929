// A blocking HTTP/1.1 client with keep-alive and a deadline on every request, for agents,
// trainers, lkctl and tests. URLs: "http://HOST:PORT", "https://HOST:PORT", "unix:/path".
// A broken connection is reopened once on the next request. Nagle is off. Over https the server's
// certificate must chain to the CA (ca_file, else the system's) and name the URL's host (a DNS
// name, or an IP address in its IP SANs); the host name also goes out as SNI.
// Thread-safety: one Client per thread; it is not safe to share, except Cancel.
#pragma once

#include <google/protobuf/message.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <lightkeeper/clock.h>
#include "common/http/http.h"
#include <lightkeeper/status.h>

namespace lk::http {

struct ClientOptions {
  std::string token;     // sent as "Authorization: Bearer TOKEN" when not empty
  std::string ca_file;   // for https: the CA to verify the server against (system CAs if empty)
  bool tls_verify = true;  // chain and host name; false only for tests of the refusal itself
  // An HTTP CONNECT proxy, "http://[USER:PASSWORD@]HOST:PORT": every TCP connection is a
  // tunnel through it (TLS stays end to end inside), and this process never connects to the
  // server itself nor resolves its name. Empty: direct. Ignored for unix: URLs.
  std::string proxy;
  // Headers sent with every request (lk_gateway's Lk-Gateway credential).
  std::vector<std::pair<std::string, std::string>> headers;
};

// The proxy for `url` from the environment, as curl reads it: LK_PROXY, else https_proxy or
// HTTPS_PROXY for an https URL, http_proxy or HTTP_PROXY for an http one; empty (direct) when
// no_proxy or NO_PROXY names the host ("*", a host, ".domain" or "domain" for its subdomains, an
// exact address, a network "10.0.0.0/8"), when the host is loopback (127.0.0.0/8, ::1, localhost: a proxy never serves
// those) and for unix: URLs.
std::string ProxyFromEnv(const std::string& url);
// `url` with its USER:PASSWORD@ (if any) replaced by "***@", for logs.
std::string WithoutUserinfo(const std::string& url);

// Fills `options` from the environment a trainer or a CLI gets: LK_CA_FILE (the CA for https)
// and LK_TOKEN_FILE (the job's bearer token, read from that file), each only where set and the
// field is still empty. An unreadable token file is an error, not a silent anonymous client.
Status ClientOptionsFromEnv(ClientOptions* options);

class Client {
 public:
  static Result<std::unique_ptr<Client>> Create(const std::string& url, ClientOptions options = {});
  virtual ~Client() = default;

  // Sends one request and waits for the whole answer, at most `timeout` in all (connect included).
  // A non-2xx answer is still a Response; only transport failures are errors.
  // `body` is read while the call runs (and sent again as it is if the request is retried on a
  // fresh connection): it is never copied, so a large body costs no copy here.
  virtual Result<Response> Do(std::string_view method, std::string_view target,
                              std::string_view body = {}, std::string_view content_type = "",
                              Millis timeout = Millis(10'000),
                              std::string_view extra_header_name = "",
                              std::string_view extra_header_value = "") = 0;
  // A GET whose 2xx body is read straight into dst[0, capacity), for large binary bodies such
  // as checkpoint shards: after the header, the body goes from the socket into dst in large
  // reads, with no intermediate buffer or string (Do copies every byte twice more). On success
  // *body_bytes is the body's length and the returned Response carries the status and headers
  // with an empty body; a non-2xx answer (an error text) comes back in Response::body as with Do
  // and dst is untouched. A 2xx body longer than capacity is a kDataLoss error (the connection is
  // closed, not drained); a body cut short by the peer is a transport error (kUnavailable).
  // `landed`, when set, is called on this thread after each read from the socket with the
  // number of body bytes in dst so far, so that the caller can work on them while in cache. A
  // retry on a fresh connection (see Do) rewrites dst and counts again from the start.
  virtual Result<Response> GetInto(std::string_view target, uint8_t* dst, uint64_t capacity,
                                   uint64_t* body_bytes, Millis timeout = Millis(10'000),
                                   std::string_view extra_header_name = "",
                                   std::string_view extra_header_value = "",
                                   const std::function<void(uint64_t)>& landed = nullptr) = 0;
  virtual void Close() = 0;
  // Safe from any thread: the request in progress (and every later one) ends at once with
  // kAborted, so that an owner can stop a thread that waits in a long-poll and join it.
  virtual void Cancel() = 0;
  const std::string& url() const { return url_; }

  // Sends `req` as binary protobuf and parses the answer into `resp`. A non-2xx answer becomes a
  // Status with the code of the HTTP status and the server's reason.
  Status Call(std::string_view method, std::string_view target,
              const google::protobuf::Message& req, google::protobuf::Message* resp,
              Millis timeout = Millis(10'000));

 protected:
  std::string url_;
};

// Turns a non-2xx response into a Status carrying the server's reason.
Status StatusFromResponse(const Response& r);

}  // namespace lk::http
