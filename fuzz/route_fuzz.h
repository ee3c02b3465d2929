// What the route fuzzers share: an input decoded into a whole request (method, path with query,
// headers, body) in a structured way, so that coverage goes past the route table, and a driver
// that hands the request to a listener's handler without a socket and runs the io_context until
// it is answered. Invariants every target checks: each request is answered exactly once, with a
// status in 200..599, and never 500 (a handler that threw: the barrier answered for it, and the
// fuzzer aborts on it as a finding).
//
// Input layout:
//   byte 0  bits 0-2 method (GET POST PUT DELETE HEAD OPTIONS PATCH, 7: empty)
//           bits 3-5 Authorization (the target's token table)
//           bits 6-7 Content-Type (JSON, protobuf, none, text/plain)
//   byte 1  bits 0-5 path from the target's table; bits 6-7 Accept (none, protobuf, JSON, */*)
//   then    line 1: appended to the path (percent-decoded, as the server does)
//           line 2: the query string; the rest: the body
// Thread-safety: one fuzzing thread.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include <chrono>
#include <mutex>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <lightkeeper/check.h>
#include "common/http/codec.h"
#include "common/http/http.h"
#include "common/http/server.h"

namespace lk::fuzz {

struct RouteTables {
  std::vector<std::string> paths;   // up to 64
  std::vector<std::string> tokens;  // 8 Authorization header values ("" for none)
};

inline http::Request DecodeRequest(const uint8_t* data, size_t size, const RouteTables& t) {
  static const char* kMethods[8] = {"GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", ""};
  static const char* kTypes[4] = {"application/json", "application/x-protobuf", "", "text/plain"};
  static const char* kAccepts[4] = {"", "application/x-protobuf", "application/json", "*/*"};
  http::Request req;
  uint8_t b0 = size > 0 ? data[0] : 0, b1 = size > 1 ? data[1] : 0;
  std::string_view rest(reinterpret_cast<const char*>(data) + std::min<size_t>(size, 2),
                        size > 2 ? size - 2 : 0);
  req.method = kMethods[b0 & 7];
  req.authorization = t.tokens[(b0 >> 3) & 7];
  req.content_type = kTypes[b0 >> 6];
  req.accept = kAccepts[b1 >> 6];
  auto line = [&rest] {
    auto nl = rest.find('\n');
    std::string_view l = rest.substr(0, nl);
    rest.remove_prefix(nl == std::string_view::npos ? rest.size() : nl + 1);
    return l;
  };
  std::string_view suffix = line(), query = line();
  req.path = t.paths[(b1 & 63) % t.paths.size()] + http::PercentDecode(suffix);
  req.query = http::ParseQuery(query);
  req.body = std::string(rest);
  req.peer = "fuzz";
  return req;
}

// One request's answer, written by whichever thread answers (the agent answers KV and checkpoint
// calls from its workers), read by the fuzzing thread.
struct Answer {
  std::mutex mu;
  int calls = 0;
  http::Response response;
};

// Checks an answer's status: 200..599 and never 500 (a handler threw: the barrier answered).
inline void CheckStatus(const http::Response& r, const std::string& what) {
  LK_CHECK(r.status >= 200 && r.status <= 599) << "status " << r.status << ": " << what;
  LK_CHECK(r.status != 500) << "500 (a handler threw or failed inside): " << what << " -> "
                            << r.body;
}

// Checks that a refusal (4xx/5xx) carries its reason code in an ErrorResponse body: the code is
// what clients branch on.
inline void CheckReasonCode(const http::Response& r, const std::string& what) {
  if (r.status < 400) return;
  Status st = http::StatusFromErrorBody(r.status, r.body, r.content_type);
  LK_CHECK(st.reason() != Reason::kUnspecified)
      << "refused " << r.status << " without a reason code: " << what << " -> " << r.body;
}

// Hands `req` to `handler` behind the server's barrier and runs `ioc` (whose work never runs
// out: a listener or a work guard keeps it) until the answer came, for at most `wait`, or at
// once when `may_hold` (a long-poll may keep its responder: it is then answered in a later
// input, and checked then). Returns the answer record; every call of the responder is checked
// (exactly one, whenever it comes).
inline std::shared_ptr<Answer> Drive(boost::asio::io_context& ioc, const http::Handler& handler,
                                     http::Request req,
                                     std::chrono::milliseconds wait = std::chrono::seconds(5),
                                     bool may_hold = false) {
  auto answer = std::make_shared<Answer>();
  std::string what = req.method + " " + req.path;
  std::thread::id driver = std::this_thread::get_id();
  http::CallHandler(handler, std::move(req), [answer, what, &ioc, driver](http::Response r) {
    {
      std::lock_guard<std::mutex> lock(answer->mu);
      // The barrier drops second answers; the route code must not give them either, and a
      // responder kept past its request (a waiter) must not answer it twice.
      ++answer->calls;
      LK_CHECK(answer->calls == 1) << "answered twice: " << what;
      CheckStatus(r, what);
      answer->response = std::move(r);
    }
    // An answer from another thread (the agent's workers) would otherwise be seen only when
    // the wait below times out: waking the io_context ends that wait as soon as it comes.
    // Every responder is called before its io_context is destroyed (the agent joins the
    // threads that hold them first). An answer on this thread needs no wake-up.
    if (std::this_thread::get_id() != driver) boost::asio::post(ioc, [] {});
  });
  auto answered = [&answer] {
    std::lock_guard<std::mutex> lock(answer->mu);
    return answer->calls > 0;
  };
  auto deadline = std::chrono::steady_clock::now() + wait;
  while (!ioc.stopped()) {
    ioc.poll();
    if (answered() || may_hold || std::chrono::steady_clock::now() > deadline) break;
    ioc.run_one_for(std::chrono::milliseconds(1));
  }
  LK_CHECK(answered() || may_hold || ioc.stopped()) << "not answered: " << what;
  return answer;
}

}  // namespace lk::fuzz
