#include "common/http/client.h"

#include <sys/socket.h>

#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "common/flags.h"
#include "common/http/codec.h"
#include "common/proto/lightkeeper.pb.h"

namespace lk::http {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = asio::ip::tcp;
using unix_proto = asio::local::stream_protocol;
using UnixStream = beast::basic_stream<unix_proto, asio::any_io_executor, beast::unlimited_rate_policy>;
using TlsStream = beast::ssl_stream<beast::tcp_stream>;

constexpr uint64_t kResponseBodyBytesMax = uint64_t{8} << 30;
// Beast sizes each socket read by the buffer's free capacity (at least 512 bytes, at most 64 KiB);
// a buffer that is consumed as it is filled never grows, so without this reserve every read of a
// large body would take 512 bytes: 12x slower than curl on a 16 MiB shard.
constexpr size_t kReadBufferBytes = 1 << 20;
// The most one read of a body straight into the caller's buffer (GetInto) asks for.
constexpr uint64_t kBodyReadBytes = 1 << 20;
// How many body bytes GetInto lets queue up before it is woken to read them (SO_RCVLOWAT).
constexpr uint64_t kBodyWakeBytes = 256 << 10;

Status FromEc(const beast::error_code& ec, std::string_view what, const std::string& url) {
  if (ec == beast::error::timeout) {
    return Error(Code::kDeadlineExceeded, "{} {}: deadline exceeded", what, url);
  }
  return Error(Code::kUnavailable, "{} {}: {}", what, url, ec.message());
}

template <class Stream>
class ClientImpl final : public Client {
 public:
  ClientImpl(std::string url, ClientOptions options, std::string host, std::string port,
             std::string unix_path)
      : options_(std::move(options)),
        host_(std::move(host)),
        port_(std::move(port)),
        unix_path_(std::move(unix_path)) {
    url_ = std::move(url);
  }

  // Connections go through the CONNECT proxy at proxy_host:proxy_port (auth: the base64 of
  // USER:PASSWORD, or empty).
  void SetProxy(std::string proxy_host, std::string proxy_port, std::string auth) {
    proxy_host_ = std::move(proxy_host);
    proxy_port_ = std::move(proxy_port);
    proxy_auth_ = std::move(auth);
  }

  Status InitTls() {
    ssl_.emplace(asio::ssl::context::tls_client);
    beast::error_code ec;
    if (options_.ca_file.empty()) ssl_->set_default_verify_paths(ec);
    else ssl_->load_verify_file(options_.ca_file, ec);
    if (ec) return InvalidArgument("TLS CA {}: {}", options_.ca_file, ec.message());
    ssl_->set_verify_mode(options_.tls_verify ? asio::ssl::verify_peer : asio::ssl::verify_none);
    return Status::Ok();
  }

  Result<Response> Do(std::string_view method, std::string_view target, std::string_view body,
                      std::string_view content_type, Millis timeout,
                      std::string_view extra_name, std::string_view extra_value) override {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int attempt = 0; attempt < 2; ++attempt) {
      if (cancelled_) return Cancelled();
      bool fresh = !stream_.has_value();
      if (fresh) LK_RETURN_IF_ERROR(Connect(deadline));
      auto r = RoundTrip(method, target, body, content_type, extra_name, extra_value, deadline);
      if (r.ok()) return r;
      Close();
      if (cancelled_) return Cancelled();
      // A reused keep-alive connection may have been closed by the server while idle: retry
      // once on a fresh one. A fresh connection that fails, or a deadline, is final.
      if (fresh || r.status().code() == Code::kDeadlineExceeded) return r;
    }
    return Error(Code::kUnavailable, "request to {} failed", url_);
  }

  Result<Response> GetInto(std::string_view target, uint8_t* dst, uint64_t capacity,
                           uint64_t* body_bytes, Millis timeout, std::string_view extra_name,
                           std::string_view extra_value,
                           const std::function<void(uint64_t)>& landed) override {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int attempt = 0; attempt < 2; ++attempt) {
      if (cancelled_) return Cancelled();
      bool fresh = !stream_.has_value();
      if (fresh) LK_RETURN_IF_ERROR(Connect(deadline));
      auto r = RoundTripInto(target, dst, capacity, body_bytes, extra_name, extra_value, landed,
                             deadline);
      if (r.ok()) return r;
      Close();
      if (cancelled_) return Cancelled();
      // As in Do, a reused keep-alive connection the server closed while idle gets one retry;
      // an answer that was wrong (kDataLoss) would be just as wrong again.
      if (fresh || r.status().code() != Code::kUnavailable) return r;
    }
    return Error(Code::kUnavailable, "request to {} failed", url_);
  }

  void Cancel() override {
    // Set before the stop: Run checks it after restarting the io_context, so a stop that the
    // restart undid is still seen.
    cancelled_ = true;
    ioc_.stop();
  }

  void Close() override {
    if (!stream_) return;
    beast::error_code ec;
    beast::get_lowest_layer(*stream_).socket().shutdown(asio::socket_base::shutdown_both, ec);
    beast::get_lowest_layer(*stream_).socket().close(ec);
    stream_.reset();
    buffer_.clear();
    rcvlowat_ = 1;
  }

 private:
  // Runs the async operations started by `start` until they finish; the stream's own expiry
  // (set by the caller) turns a stalled peer into beast::error::timeout.
  template <class Start>
  beast::error_code Run(Start start) {
    if (cancelled_) return asio::error::operation_aborted;
    beast::error_code result;
    bool done = false;
    start([&](beast::error_code ec, auto&&...) {
      result = ec;
      done = true;
    });
    ioc_.restart();
    if (!cancelled_) ioc_.run();
    if (!done) {
      // Cancelled: the operation still refers to this frame. Closing the socket makes it
      // complete (aborted), and it must have before the frame goes.
      beast::error_code ignored;
      if (stream_) beast::get_lowest_layer(*stream_).socket().close(ignored);
      while (!done) {
        ioc_.restart();
        ioc_.run_one();
      }
      result = asio::error::operation_aborted;
    }
    return result;
  }

  Status Cancelled() const { return Error(Code::kAborted, "request to {} cancelled", url_); }

  // Host-name (or IP SAN) verification and SNI for one connection. A chain that verifies says
  // only that some holder of a certificate from the CA answers; the name says it is this host.
  Status SetPeerName(SSL* ssl) {
    if (!options_.tls_verify) return Status::Ok();
    X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
    X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    beast::error_code ec;
    asio::ip::make_address(host_, ec);
    if (!ec) {
      // An IP address is matched against the certificate's IP SANs and is not sent as SNI
      // (RFC 6066 allows host names only).
      if (X509_VERIFY_PARAM_set1_ip_asc(param, host_.c_str()) != 1) {
        return Error(Code::kInvalidArgument, "TLS: bad IP address {}", host_);
      }
      return Status::Ok();
    }
    if (X509_VERIFY_PARAM_set1_host(param, host_.c_str(), host_.size()) != 1 ||
        SSL_set_tlsext_host_name(ssl, host_.c_str()) != 1) {
      return Error(Code::kInvalidArgument, "TLS: bad host name {}", host_);
    }
    return Status::Ok();
  }

  Status Connect(std::chrono::steady_clock::time_point deadline) {
    if constexpr (std::is_same_v<Stream, UnixStream>) {
      stream_.emplace(ioc_);
      stream_->expires_at(deadline);
      auto ec = Run([&](auto h) { stream_->async_connect(unix_proto::endpoint(unix_path_), h); });
      if (ec) {
        stream_.reset();
        return cancelled_ ? Cancelled() : FromEc(ec, "connect", url_);
      }
    } else {
      tcp::resolver resolver(ioc_);
      beast::error_code ec;
      // Through a proxy the proxy resolves the server's name: this host may have no route (or
      // no DNS) to it at all.
      const bool proxied = !proxy_host_.empty();
      auto results = resolver.resolve(proxied ? proxy_host_ : host_, proxied ? proxy_port_ : port_,
                                      ec);
      if (ec) {
        return Error(Code::kUnavailable, "resolve {}: {}", proxied ? ProxyName() : url_,
                     ec.message());
      }
      if constexpr (std::is_same_v<Stream, TlsStream>) {
        stream_.emplace(ioc_, *ssl_);
        if (Status st = SetPeerName(stream_->native_handle()); !st.ok()) {
          stream_.reset();
          return st;
        }
      } else {
        stream_.emplace(ioc_);
      }
      auto& low = beast::get_lowest_layer(*stream_);
      low.expires_at(deadline);
      ec = Run([&](auto h) { low.async_connect(results, h); });
      if (ec) {
        stream_.reset();
        return cancelled_ ? Cancelled() : FromEc(ec, "connect", proxied ? ProxyName() : url_);
      }
      low.socket().set_option(tcp::no_delay(true), ec);
      if (proxied) {
        if (Status st = Tunnel(low); !st.ok()) {
          stream_.reset();
          return cancelled_ ? Cancelled() : st;
        }
      }
      if constexpr (std::is_same_v<Stream, TlsStream>) {
        ec = Run([&](auto h) { stream_->async_handshake(asio::ssl::stream_base::client, h); });
        if (ec) {
          // Say why the certificate was refused (wrong host, expired, unknown CA), not only
          // that the handshake failed.
          long verify = SSL_get_verify_result(stream_->native_handle());
          stream_.reset();
          if (cancelled_) return Cancelled();
          if (verify != X509_V_OK) {
            return Error(Code::kUnavailable,
                         "TLS handshake with {}: server certificate refused: {} (CA {})", url_,
                         X509_verify_cert_error_string(verify),
                         options_.ca_file.empty() ? "the system's" : options_.ca_file);
          }
          return FromEc(ec, "TLS handshake", url_);
        }
      }
    }
    return Status::Ok();
  }

  std::string ProxyName() const { return fmt::format("proxy {}:{}", proxy_host_, proxy_port_); }

  // CONNECT HOST:PORT on the fresh connection to the proxy; on 200 the connection is a byte
  // pipe to the server, and the request (or the TLS handshake) goes on as if direct.
  Status Tunnel(beast::tcp_stream& low) {
    const std::string authority =
        host_.find(':') != std::string::npos ? fmt::format("[{}]:{}", host_, port_)
                                             : fmt::format("{}:{}", host_, port_);
    bhttp::request<bhttp::empty_body> req{bhttp::verb::connect, authority, 11};
    req.set(bhttp::field::host, authority);
    if (!proxy_auth_.empty()) req.set(bhttp::field::proxy_authorization, "Basic " + proxy_auth_);
    auto ec = Run([&](auto h) { bhttp::async_write(low, req, h); });
    if (ec) return FromEc(ec, "CONNECT " + authority + " via", ProxyName());
    beast::flat_buffer buf;
    bhttp::response_parser<bhttp::empty_body> parser;
    parser.skip(true);  // a CONNECT's answer has no body, whatever its headers say
    ec = Run([&](auto h) { bhttp::async_read(low, buf, parser, h); });
    if (ec) return FromEc(ec, "CONNECT " + authority + " via", ProxyName());
    const unsigned status = parser.get().result_int();
    if (status != 200) {
      return Error(Code::kUnavailable, "{} refused CONNECT {}: {} {}", ProxyName(), authority,
                   status, std::string(parser.get().reason()));
    }
    // The server speaks only after the request (HTTP) or the client's hello (TLS): bytes here
    // came from the proxy, and would be taken for the server's.
    if (buf.size() != 0) {
      return Error(Code::kUnavailable, "{} sent {} bytes after its CONNECT answer", ProxyName(),
                   buf.size());
    }
    return Status::Ok();
  }

  Status SendRequest(std::string_view method, std::string_view target, std::string_view body,
                     std::string_view content_type, std::string_view extra_name,
                     std::string_view extra_value, std::chrono::steady_clock::time_point deadline) {
    // The body goes out from the caller's memory (a span), not from a copy of it.
    bhttp::request<bhttp::span_body<const char>> req;
    req.method_string(beast::string_view(method.data(), method.size()));
    req.target(beast::string_view(target.data(), target.size()));
    req.version(11);
    req.set(bhttp::field::host, host_.empty() ? "localhost" : host_);
    req.set(bhttp::field::user_agent, "lightkeeper");
    req.keep_alive(true);
    if (!options_.token.empty()) req.set(bhttp::field::authorization, "Bearer " + options_.token);
    if (!content_type.empty()) {
      req.set(bhttp::field::content_type, beast::string_view(content_type.data(), content_type.size()));
      req.set(bhttp::field::accept, beast::string_view(content_type.data(), content_type.size()));
    }
    for (const auto& [name, value] : options_.headers) req.set(name, value);
    if (!extra_name.empty()) {
      req.set(beast::string_view(extra_name.data(), extra_name.size()),
              beast::string_view(extra_value.data(), extra_value.size()));
    }
    req.body() = bhttp::span_body<const char>::value_type(body.data(), body.size());
    req.prepare_payload();
    auto& low = beast::get_lowest_layer(*stream_);
    low.expires_at(deadline);
    auto ec = Run([&](auto h) { bhttp::async_write(*stream_, req, h); });
    if (ec) return FromEc(ec, "send to", url_);
    return Status::Ok();
  }

  template <class Message>
  static Response HeadOf(const Message& msg) {
    Response r;
    r.status = static_cast<int>(msg.result_int());
    r.content_type = std::string(msg[bhttp::field::content_type]);
    for (auto& f : msg) {
      r.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
    }
    return r;
  }

  // Reads the rest of an answer whose header `head` already parsed, whole, through Beast.
  Result<Response> ReadWhole(bhttp::response_parser<bhttp::empty_body>&& head) {
    bhttp::response_parser<bhttp::string_body> parser(std::move(head));
    parser.body_limit(kResponseBodyBytesMax);
    auto ec = Run([&](auto h) { bhttp::async_read(*stream_, buffer_, parser, h); });
    if (ec) return FromEc(ec, "read from", url_);
    Response r = HeadOf(parser.get());
    r.body = std::move(parser.get().body());
    if (!parser.get().keep_alive()) Close();
    return r;
  }

  Result<Response> RoundTrip(std::string_view method, std::string_view target, std::string_view body,
                             std::string_view content_type, std::string_view extra_name,
                             std::string_view extra_value,
                             std::chrono::steady_clock::time_point deadline) {
    LK_RETURN_IF_ERROR(
        SendRequest(method, target, body, content_type, extra_name, extra_value, deadline));
    bhttp::response_parser<bhttp::string_body> parser;
    parser.body_limit(kResponseBodyBytesMax);
    buffer_.reserve(kReadBufferBytes);
    auto ec = Run([&](auto h) { bhttp::async_read(*stream_, buffer_, parser, h); });
    if (ec) return FromEc(ec, "read from", url_);
    auto& msg = parser.get();
    Response r = HeadOf(msg);
    r.body = std::move(msg.body());
    if (!msg.keep_alive()) Close();
    return r;
  }

  // Beast parses the header only; the body then goes from the socket straight into dst. Through
  // a parser it would land in the read buffer, be copied into a string, and the caller would
  // copy it again: three passes over every byte where one is needed.
  Result<Response> RoundTripInto(std::string_view target, uint8_t* dst, uint64_t capacity,
                                 uint64_t* body_bytes, std::string_view extra_name,
                                 std::string_view extra_value,
                                 const std::function<void(uint64_t)>& landed,
                                 std::chrono::steady_clock::time_point deadline) {
    std::string no_body;
    LK_RETURN_IF_ERROR(SendRequest("GET", target, no_body, "", extra_name, extra_value, deadline));
    bhttp::response_parser<bhttp::empty_body> head;
    head.body_limit(kResponseBodyBytesMax);
    buffer_.reserve(kReadBufferBytes);
    auto ec = Run([&](auto h) { bhttp::async_read_header(*stream_, buffer_, head, h); });
    if (ec) return FromEc(ec, "read from", url_);
    int status = static_cast<int>(head.get().result_int());
    auto length = head.content_length();
    bool chunked = head.chunked();
    if (status < 200 || status >= 300 || chunked || !length) {
      // Error texts are short, and a body without a length is not what a shard server sends:
      // both are read whole through Beast, and a 2xx one is then copied out.
      LK_ASSIGN_OR_RETURN(Response r, ReadWhole(std::move(head)));
      if (r.status < 200 || r.status >= 300) return r;
      if (r.body.size() > capacity) {
        return Error(Code::kDataLoss, "{}{}: body of {} bytes, more than the {} expected", url_,
                     target, r.body.size(), capacity);
      }
      std::memcpy(dst, r.body.data(), r.body.size());
      *body_bytes = r.body.size();
      r.body.clear();
      return r;
    }
    uint64_t n = *length;
    if (n > capacity) {
      Close();  // the body is left unread, so the connection cannot be reused
      return Error(Code::kDataLoss, "{}{}: body of {} bytes, more than the {} expected", url_,
                   target, n, capacity);
    }
    Response r = HeadOf(head.get());
    bool keep = head.keep_alive();
    // The header read may have pulled in the first bytes of the body.
    uint64_t got = asio::buffer_copy(asio::buffer(dst, n), buffer_.data());
    buffer_.consume(got);
    // Each read takes what the socket holds, up to kBodyReadBytes: large enough for few system
    // calls, small enough that `landed` sees the bytes while they are still in cache.
    while (got < n) {
      if (landed) landed(got);
      WakeAfter(std::min<uint64_t>(n - got, kBodyWakeBytes));
      size_t k = 0;
      ec = Run([&](auto h) {
        stream_->async_read_some(
            asio::buffer(dst + got, std::min<uint64_t>(n - got, kBodyReadBytes)),
            [&k, h](beast::error_code e, size_t m) mutable {
              k = m;
              h(e);
            });
      });
      got += k;
      if (ec) {
        bool late = ec == beast::error::timeout;
        return Error(late ? Code::kDeadlineExceeded : Code::kUnavailable,
                     "read body from {}{}: {} of {} bytes, then {}", url_, target, got, n,
                     late ? "deadline exceeded" : ec.message());
      }
    }
    WakeAfter(1);  // the next answer's header must not wait for a body's worth of bytes
    if (landed) landed(n);
    *body_bytes = n;
    if (!keep) Close();
    return r;
  }

  // SO_RCVLOWAT on plain TCP: the socket reports readable only once `bytes` are queued (or the
  // peer closed), so a large body is read in a few large pieces instead of being woken for every
  // segment (most reads found one 64 KiB send, then waited again). Callers never ask for more
  // than the rest of the body, so the wait always ends. Not for TLS, whose engine may already
  // hold bytes of the rest, nor Unix sockets.
  void WakeAfter(uint64_t bytes) {
    if constexpr (std::is_same_v<Stream, beast::tcp_stream>) {
      int v = static_cast<int>(std::max<uint64_t>(bytes, 1));
      if (v == rcvlowat_ || !stream_) return;
      int fd = beast::get_lowest_layer(*stream_).socket().native_handle();
      if (::setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v) == 0) rcvlowat_ = v;
    }
  }

  ClientOptions options_;
  std::string host_;
  std::string port_;
  std::string unix_path_;
  asio::io_context ioc_;
  std::optional<asio::ssl::context> ssl_;
  std::optional<Stream> stream_;
  std::string proxy_host_, proxy_port_, proxy_auth_;
  beast::flat_buffer buffer_;
  int rcvlowat_ = 1;  // SO_RCVLOWAT of the open connection (WakeAfter)
  std::atomic<bool> cancelled_{false};
};

}  // namespace

namespace {

// The parts of an http(s) URL (or a bare HOST:PORT, http) a connection needs.
struct UrlParts {
  bool tls = false;
  std::string userinfo;  // USER:PASSWORD before '@', if any
  std::string host;      // without an IPv6 address's brackets
  std::string port;
};

Result<UrlParts> SplitUrl(const std::string& url) {
  UrlParts u;
  std::string rest;
  if (url.rfind("http://", 0) == 0) {
    rest = url.substr(7);
  } else if (url.rfind("https://", 0) == 0) {
    rest = url.substr(8);
    u.tls = true;
  } else if (url.find("://") == std::string::npos && url.find(':') != std::string::npos) {
    rest = url;  // bare HOST:PORT means http
  } else {
    return InvalidArgument("URL '{}' must start with http://, https:// or unix:", url);
  }
  if (auto slash = rest.find('/'); slash != std::string::npos) rest = rest.substr(0, slash);
  if (auto at = rest.rfind('@'); at != std::string::npos) {
    u.userinfo = rest.substr(0, at);
    rest = rest.substr(at + 1);
  }
  auto colon = rest.rfind(':');
  // The colon of an IPv6 address inside brackets is no port separator.
  if (colon != std::string::npos && rest.find(']', colon) != std::string::npos) {
    colon = std::string::npos;
  }
  u.host = colon == std::string::npos ? rest : rest.substr(0, colon);
  u.port = colon == std::string::npos ? (u.tls ? "443" : "80") : rest.substr(colon + 1);
  if (u.host.size() >= 2 && u.host.front() == '[' && u.host.back() == ']') {
    u.host = u.host.substr(1, u.host.size() - 2);
  }
  if (u.host.empty()) return InvalidArgument("URL '{}' has no host", url);
  return u;
}

std::string Base64(std::string_view in) {
  static constexpr char kDigits[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < in.size(); i += 3) {
    uint32_t v = static_cast<uint8_t>(in[i]) << 16;
    if (i + 1 < in.size()) v |= static_cast<uint8_t>(in[i + 1]) << 8;
    if (i + 2 < in.size()) v |= static_cast<uint8_t>(in[i + 2]);
    out += kDigits[(v >> 18) & 63];
    out += kDigits[(v >> 12) & 63];
    out += i + 1 < in.size() ? kDigits[(v >> 6) & 63] : '=';
    out += i + 2 < in.size() ? kDigits[v & 63] : '=';
  }
  return out;
}

template <class Impl>
Result<std::unique_ptr<Client>> WithProxy(std::unique_ptr<Impl> c, const std::string& proxy) {
  if (!proxy.empty()) {
    LK_ASSIGN_OR_RETURN(UrlParts p, SplitUrl(proxy));
    if (p.tls) {
      return InvalidArgument("proxy '{}': only an http:// proxy is supported (CONNECT; TLS to "
                             "the server stays end to end inside the tunnel)",
                             proxy);
    }
    c->SetProxy(p.host, p.port, p.userinfo.empty() ? std::string() : Base64(p.userinfo));
  }
  return std::unique_ptr<Client>(std::move(c));
}

bool IsLoopbackHost(const std::string& host) {
  if (host == "localhost" || host.ends_with(".localhost")) return true;
  boost::system::error_code ec;
  auto a = asio::ip::make_address(host, ec);
  return !ec && a.is_loopback();
}

// Whether `host` is an address inside `cidr` ("10.0.0.0/8", "fd00::/8").
bool InCidr(const std::string& host, const std::string& cidr) {
  const size_t slash = cidr.find('/');
  boost::system::error_code ec1, ec2;
  auto a = asio::ip::make_address(host, ec1);
  auto net = asio::ip::make_address(cidr.substr(0, slash), ec2);
  uint32_t bits = 0;
  const std::string len = cidr.substr(slash + 1);
  if (ec1 || ec2 || a.is_v4() != net.is_v4() || len.empty() || len.size() > 3 ||
      len.find_first_not_of("0123456789") != std::string::npos) {
    return false;
  }
  bits = static_cast<uint32_t>(std::stoul(len));
  auto bytes = [](const asio::ip::address& x) {
    std::vector<uint8_t> b;
    if (x.is_v4()) {
      auto v = x.to_v4().to_bytes();
      b.assign(v.begin(), v.end());
    } else {
      auto v = x.to_v6().to_bytes();
      b.assign(v.begin(), v.end());
    }
    return b;
  };
  const auto ab = bytes(a), nb = bytes(net);
  if (bits > ab.size() * 8) return false;
  for (uint32_t i = 0; i < bits; ++i) {
    const uint8_t mask = static_cast<uint8_t>(0x80u >> (i % 8));
    if ((ab[i / 8] & mask) != (nb[i / 8] & mask)) return false;
  }
  return true;
}

// no_proxy's entries: "*"; a host name, which also covers its subdomains (with or without a
// leading dot); an address, matched exactly; a network ("10.0.0.0/8"), as curl takes it. Ports
// in entries are ignored.
bool NoProxyNames(const std::string& list, const std::string& host) {
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string e = list.substr(start, end - start);
    start = end + 1;
    e.erase(0, e.find_first_not_of(" \t"));
    e.erase(e.find_last_not_of(" \t") + 1);
    if (e.empty()) continue;
    if (e == "*") return true;
    if (e.find('/') != std::string::npos) {
      if (InCidr(host, e)) return true;
      continue;
    }
    if (e.front() == '[') {
      if (auto close = e.find(']'); close != std::string::npos) e = e.substr(1, close - 1);
    } else if (auto colon = e.rfind(':'); colon != std::string::npos && e.find(':') == colon) {
      e = e.substr(0, colon);
    }
    if (!e.empty() && e.front() == '.') e = e.substr(1);
    if (host == e) return true;
    if (host.size() > e.size() && host.ends_with(e) && host[host.size() - e.size() - 1] == '.') {
      return true;
    }
  }
  return false;
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

}  // namespace

std::string WithoutUserinfo(const std::string& url) {
  const size_t scheme = url.find("://");
  const size_t start = scheme == std::string::npos ? 0 : scheme + 3;
  const size_t end = url.find('/', start);
  const size_t at = url.rfind('@', end == std::string::npos ? std::string::npos : end);
  if (at == std::string::npos || at < start) return url;
  return url.substr(0, start) + "***" + url.substr(at);
}

std::string ProxyFromEnv(const std::string& url) {
  if (url.rfind("unix:", 0) == 0) return "";
  auto u = SplitUrl(url);
  if (!u.ok() || IsLoopbackHost(u->host)) return "";
  for (const char* name : {"no_proxy", "NO_PROXY"}) {
    if (NoProxyNames(Env(name), u->host)) return "";
  }
  std::string proxy = Env("LK_PROXY");
  if (proxy.empty()) proxy = Env(u->tls ? "https_proxy" : "http_proxy");
  if (proxy.empty()) proxy = Env(u->tls ? "HTTPS_PROXY" : "HTTP_PROXY");
  return proxy;
}

Result<std::unique_ptr<Client>> Client::Create(const std::string& url, ClientOptions options) {
  if (url.rfind("unix:", 0) == 0) {
    std::string path = url.substr(5);
    if (path.rfind("//", 0) == 0) path = path.substr(2);
    if (path.empty()) return InvalidArgument("URL '{}' has no socket path", url);
    return std::unique_ptr<Client>(
        std::make_unique<ClientImpl<UnixStream>>(url, std::move(options), "localhost", "", path));
  }
  LK_ASSIGN_OR_RETURN(UrlParts u, SplitUrl(url));
  const std::string proxy = options.proxy;
  if (u.tls) {
    auto c = std::make_unique<ClientImpl<TlsStream>>(url, std::move(options), u.host, u.port, "");
    LK_RETURN_IF_ERROR(c->InitTls());
    return WithProxy(std::move(c), proxy);
  }
  return WithProxy(
      std::make_unique<ClientImpl<beast::tcp_stream>>(url, std::move(options), u.host, u.port, ""),
      proxy);
}

Status ClientOptionsFromEnv(ClientOptions* options) {
  const char* ca = std::getenv("LK_CA_FILE");
  if (options->ca_file.empty() && ca != nullptr && *ca != '\0') options->ca_file = ca;
  const char* token_file = std::getenv("LK_TOKEN_FILE");
  if (options->token.empty() && token_file != nullptr && *token_file != '\0') {
    LK_ASSIGN_OR_RETURN(options->token, ReadTokenFile(token_file));
  }
  return Status::Ok();
}

Status StatusFromResponse(const Response& r) {
  if (r.status >= 200 && r.status < 300) return Status::Ok();
  return StatusFromErrorBody(r.status, r.body, r.content_type);
}

Status Client::Call(std::string_view method, std::string_view target,
                    const google::protobuf::Message& req, google::protobuf::Message* resp,
                    Millis timeout) {
  LK_ASSIGN_OR_RETURN(Response r, Do(method, target, req.SerializeAsString(), kProtoType, timeout));
  LK_RETURN_IF_ERROR(StatusFromResponse(r));
  if (resp != nullptr) LK_RETURN_IF_ERROR(Decode(r.body, BodyFormat(r.content_type), resp));
  return Status::Ok();
}

}  // namespace lk::http
