// Plain request/response values shared by the HTTP server, client and codec. Handlers see these,
// never Beast types, so that the services stay small and testable.
// Thread-safety: plain values.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lk::http {

// Who is at the other end of a Unix-socket connection, as the kernel recorded it at connect
// (SO_PEERCRED): the peer cannot choose these, unlike anything in a request body.
struct PeerCredentials {
  int pid = 0;
  uint32_t uid = 0;
  uint32_t gid = 0;
};

struct Request {
  std::string method;  // "GET", "POST", "PUT", ...
  std::string path;    // the target without its query string, percent-decoded
  std::map<std::string, std::string> query;
  std::string content_type;
  std::string accept;
  std::string authorization;
  std::string range;  // the Range header, for shard transfers
  // The Lk-Gateway header, "TOKEN SITE": an lk_gateway's own credential (a role=gateway token
  // of the lighthouse) and the site it relays for. Only the lighthouse reads it, and believes
  // the site only with a valid credential; a gateway never passes its agents' one on.
  std::string gateway;
  std::string body;
  std::string peer;  // remote address, for logs
  // Set on Unix-socket connections only.
  std::optional<PeerCredentials> credentials;
  // Set by the server when it can send a file-backed body (FileBody) with sendfile(2): plain TCP
  // and Unix sockets, not TLS. A handler that serves files offers one only then.
  bool file_body_ok = false;
};

// A byte range of an open file sent as (the end of) a response body with sendfile(2): the kernel
// hands the file's pages to the socket, and on loopback the receiver's copy is the only one.
// `owner` keeps whatever owns the descriptor alive until the write ends.
struct FileBody {
  std::shared_ptr<const void> owner;
  int fd = -1;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  // Sent right after body, not copied: many answers can share one large tail (every member of
  // a quorum receives the same member list).
  std::shared_ptr<const std::string> body_tail;
  // Sent after body_tail; only when the request said file_body_ok.
  std::optional<FileBody> body_file;
};

// Answers one request. It may be called from any thread, at most once; the server writes the
// response on the connection's own strand. Dropping it without a call closes the connection.
using Responder = std::function<void(Response)>;
using Handler = std::function<void(Request&&, Responder)>;

// Splits "a=1&b=x%20y" into a map, percent-decoding keys and values.
std::map<std::string, std::string> ParseQuery(std::string_view query);
std::string PercentDecode(std::string_view s);
std::string PercentEncode(std::string_view s);
// PercentEncode of each '/'-separated segment, the slashes kept: a decoded path (a key with '?',
// '#', '%', spaces or control bytes) made fit to be sent on as a request target.
std::string PercentEncodePath(std::string_view path);

}  // namespace lk::http
