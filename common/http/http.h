// Plain request/response values shared by the HTTP server, client and codec. Handlers see these,
// never Beast types, so that the services stay small and testable.
// Thread-safety: plain values.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace lk::http {

struct Request {
  std::string method;  // "GET", "POST", "PUT", ...
  std::string path;    // the target without its query string, percent-decoded
  std::map<std::string, std::string> query;
  std::string content_type;
  std::string accept;
  std::string authorization;
  std::string range;  // the Range header, for shard transfers
  std::string body;
  std::string peer;  // remote address, for logs
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  // Sent right after body, not copied: many answers can share one large tail (every member of
  // a quorum receives the same member list).
  std::shared_ptr<const std::string> body_tail;
};

// Answers one request. It may be called from any thread, at most once; the server writes the
// response on the connection's own strand. Dropping it without a call closes the connection.
using Responder = std::function<void(Response)>;
using Handler = std::function<void(Request&&, Responder)>;

// Splits "a=1&b=x%20y" into a map, percent-decoding keys and values.
std::map<std::string, std::string> ParseQuery(std::string_view query);
std::string PercentDecode(std::string_view s);
std::string PercentEncode(std::string_view s);

}  // namespace lk::http
