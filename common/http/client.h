// A blocking HTTP/1.1 client with keep-alive and a deadline on every request, for agents,
// trainers, lkctl and tests. URLs: "http://HOST:PORT", "https://HOST:PORT", "unix:/path".
// A broken connection is reopened once on the next request. Nagle is off.
// Thread-safety: one Client per thread; it is not safe to share.
#pragma once

#include <google/protobuf/message.h>

#include <memory>
#include <string>

#include "common/clock.h"
#include "common/http/http.h"
#include "common/status.h"

namespace lk::http {

struct ClientOptions {
  std::string token;     // sent as "Authorization: Bearer TOKEN" when not empty
  std::string ca_file;   // for https: the CA to verify the server against (system CAs if empty)
  bool tls_verify = true;
};

class Client {
 public:
  static Result<std::unique_ptr<Client>> Create(const std::string& url, ClientOptions options = {});
  virtual ~Client() = default;

  // Sends one request and waits for the whole answer, at most `timeout` in all (connect included).
  // A non-2xx answer is still a Response; only transport failures are errors.
  virtual Result<Response> Do(std::string_view method, std::string_view target,
                              std::string body = "", std::string_view content_type = "",
                              Millis timeout = Millis(10'000),
                              std::string_view extra_header_name = "",
                              std::string_view extra_header_value = "") = 0;
  virtual void Close() = 0;
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
