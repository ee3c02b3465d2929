#include "common/http/server.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <sys/sendfile.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <array>
#include <atomic>
#include <list>
#include <mutex>
#include <optional>

#include "common/http/codec.h"
#include "common/log.h"

namespace lk::http {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = asio::ip::tcp;
using unix_proto = asio::local::stream_protocol;
using UnixStream = beast::basic_stream<unix_proto, asio::any_io_executor, beast::unlimited_rate_policy>;
using TlsStream = beast::ssl_stream<beast::tcp_stream>;

constexpr size_t kHeaderBytesMax = 16 * 1024;

class SessionBase {
 public:
  virtual ~SessionBase() = default;
  virtual void CloseIfIdle() = 0;
};

}  // namespace

struct Server::Impl {
  asio::io_context& ioc;
  ServerOptions options;
  Handler handler;
  std::unique_ptr<asio::ssl::context> ssl;
  std::vector<std::function<void()>> closers;  // close each acceptor
  std::string local_address;
  std::atomic<uint64_t> connections{0};
  std::atomic<bool> stopping{false};
  std::mutex sessions_mu;
  std::list<std::weak_ptr<SessionBase>> sessions;

  Impl(asio::io_context& c, ServerOptions o, Handler h)
      : ioc(c), options(std::move(o)), handler(std::move(h)) {}

  void Track(const std::shared_ptr<SessionBase>& s) {
    std::lock_guard<std::mutex> lock(sessions_mu);
    // Drop expired entries as we go so that the list stays bounded by live connections.
    if (sessions.size() > 64 && sessions.size() > 2 * connections.load()) {
      sessions.remove_if([](const std::weak_ptr<SessionBase>& w) { return w.expired(); });
    }
    sessions.push_back(s);
  }
};

namespace {

template <class Stream>
auto& Lowest(Stream& s) {
  return beast::get_lowest_layer(s);
}

template <class Stream>
class Session : public SessionBase, public std::enable_shared_from_this<Session<Stream>> {
 public:
  Session(std::shared_ptr<Server::Impl> server, Stream stream, std::string peer)
      : server_(std::move(server)), stream_(std::move(stream)), peer_(std::move(peer)) {
    ++server_->connections;
  }
  ~Session() override { --server_->connections; }

  void Start() {
    if constexpr (std::is_same_v<Stream, TlsStream>) {
      Lowest(stream_).expires_after(server_->options.request_timeout);
      stream_.async_handshake(asio::ssl::stream_base::server,
                              [self = this->shared_from_this()](beast::error_code ec) {
                                if (ec) return self->Close();
                                self->WaitForRequest();
                              });
    } else {
      WaitForRequest();
    }
  }

  void CloseIfIdle() override {
    asio::post(stream_.get_executor(), [self = this->shared_from_this()] {
      if (!self->busy_) self->Close();
    });
  }

 private:
  // Waits for the first byte of the next request under the idle timeout; the rest of the request
  // then has request_timeout to arrive, so a stalled client is cut off sooner than an idle one.
  void WaitForRequest() {
    if (server_->stopping) return Close();
    if (buffer_.size() > 0) return ReadRequest();
    Lowest(stream_).expires_after(server_->options.idle_timeout);
    stream_.async_read_some(
        buffer_.prepare(4096),
        [self = this->shared_from_this()](beast::error_code ec, size_t n) {
          if (ec) return self->Close();
          self->buffer_.commit(n);
          self->ReadRequest();
        });
  }

  void ReadRequest() {
    head_only_ = false;
    parser_.emplace();
    parser_->body_limit(server_->options.body_bytes_max);
    parser_->header_limit(kHeaderBytesMax);
    Lowest(stream_).expires_after(server_->options.request_timeout);
    bhttp::async_read(stream_, buffer_, *parser_,
                      [self = this->shared_from_this()](beast::error_code ec, size_t) {
                        self->OnRead(ec);
                      });
  }

  void OnRead(beast::error_code ec) {
    if (ec == bhttp::error::end_of_stream || ec == asio::error::eof) return Close();
    if (ec == beast::error::timeout) {
      LK_LOG_WARN("http_request_timeout peer={}", peer_);
      return Close();
    }
    if (ec == bhttp::error::body_limit) {
      LK_LOG_WARN("http_body_too_large peer={} limit_bytes={}", peer_,
                  server_->options.body_bytes_max);
      keep_alive_ = false;
      return Write(ErrorReply(Error(Code::kTooLarge, "request body over {} bytes",
                                    server_->options.body_bytes_max),
                              Format::kJson));
    }
    if (ec) {
      if (ec.category() == bhttp::make_error_code(bhttp::error::bad_target).category()) {
        LK_LOG_WARN("http_bad_request peer={} error={}", peer_, Q(ec.message()));
        keep_alive_ = false;
        return Write(ErrorReply(InvalidArgument("malformed HTTP request: {}", ec.message()),
                                Format::kJson));
      }
      return Close();
    }
    auto& msg = parser_->get();
    Request req;
    req.method = std::string(msg.method_string());
    std::string_view target(msg.target().data(), msg.target().size());
    auto q = target.find('?');
    req.path = PercentDecode(target.substr(0, q));
    if (q != std::string_view::npos) req.query = ParseQuery(target.substr(q + 1));
    req.content_type = std::string(msg[bhttp::field::content_type]);
    req.accept = std::string(msg[bhttp::field::accept]);
    req.authorization = std::string(msg[bhttp::field::authorization]);
    req.range = std::string(msg[bhttp::field::range]);
    req.body = std::move(msg.body());
    req.peer = peer_;
    req.file_body_ok = kCanSendFile;
    version_ = msg.version();
    keep_alive_ = msg.keep_alive();
    head_only_ = msg.method() == bhttp::verb::head;
    busy_ = true;
    // A handler may hold the request for a long-poll: no read deadline while it does.
    Lowest(stream_).expires_never();
    auto self = this->shared_from_this();
    auto answered = std::make_shared<std::atomic<bool>>(false);
    Responder respond = [self, answered](Response r) {
      if (answered->exchange(true)) return;
      // dispatch, not post: a handler that answers on the connection's own strand (most do)
      // writes at once instead of paying for a trip through the executor's queue.
      asio::dispatch(self->stream_.get_executor(),
                     [self, r = std::move(r)]() mutable { self->Write(std::move(r)); });
    };
    server_->handler(std::move(req), std::move(respond));
  }

  // The response goes out as one gather write of up to four buffers (head, body, shared tail,
  // a file range read into memory) built here by hand: Beast's serializer spent about a third of
  // a small request's CPU in its buffer-sequence adaptors, and would need the tail copied into
  // the body. A file range goes after them with sendfile(2) where the stream allows it.
  void Write(Response r) {
    busy_ = true;
    out_ = std::move(r);
    bool keep = keep_alive_ && !server_->stopping;
    file_copy_.clear();
    // The length promised is the file range's even if reading it fails below: the client then
    // sees the connection close before the body ends, never a short body taken for whole.
    uint64_t file_length = out_.body_file ? out_.body_file->length : 0;
    if (out_.body_file && !kCanSendFile && !head_only_) {
      // TLS encrypts in user space, so the range is read here; handlers offer file bodies only
      // when the request says file_body_ok, which TLS connections never do.
      if (!ReadFileRange(*out_.body_file, &file_copy_)) keep = false;
      out_.body_file.reset();
    }
    size_t length = out_.body.size() + (out_.body_tail ? out_.body_tail->size() : 0) + file_length;
    head_.clear();
    auto reason = bhttp::obsolete_reason(static_cast<bhttp::status>(out_.status));
    fmt::format_to(std::back_inserter(head_),
                   "HTTP/1.{} {} {}\r\nServer: lightkeeper\r\nContent-Type: {}\r\n"
                   "Content-Length: {}\r\n",
                   version_ == 10 ? 0 : 1, out_.status,
                   std::string_view(reason.data(), reason.size()), out_.content_type, length);
    for (const auto& [k, v] : out_.headers) fmt::format_to(std::back_inserter(head_), "{}: {}\r\n", k, v);
    // HTTP/1.1 keeps the connection unless told; HTTP/1.0 closes it unless told.
    if (!keep && version_ != 10) head_ += "Connection: close\r\n";
    if (keep && version_ == 10) head_ += "Connection: keep-alive\r\n";
    head_ += "\r\n";
    std::array<asio::const_buffer, 4> buffers{asio::buffer(head_), asio::buffer(out_.body),
                                              asio::const_buffer(), asio::buffer(file_copy_)};
    if (out_.body_tail) buffers[2] = asio::buffer(*out_.body_tail);
    if (head_only_) {
      buffers[1] = buffers[2] = buffers[3] = asio::const_buffer();
      out_.body_file.reset();
    }
    Lowest(stream_).expires_after(server_->options.write_timeout);
    asio::async_write(stream_, buffers,
                      [self = this->shared_from_this(), keep](beast::error_code ec, size_t) {
                        if (ec || !self->out_.body_file) return self->FinishWrite(ec, keep);
                        self->StartSendFile(keep);
                      });
  }

  void FinishWrite(beast::error_code ec, bool keep) {
    busy_ = false;
    out_ = Response();
    file_copy_ = std::string();
    if (ec || !keep) return Close();
    WaitForRequest();
  }

  static constexpr bool kCanSendFile = !std::is_same_v<Stream, TlsStream>;

  static bool ReadFileRange(const FileBody& f, std::string* out) {
    out->resize(f.length);
    uint64_t done = 0;
    while (done < f.length) {
      ssize_t n = ::pread(f.fd, out->data() + done, f.length - done, static_cast<off_t>(f.offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        LK_LOG_WARN("http_file_body_failed error={}", Q(n < 0 ? std::strerror(errno) : "file ends early"));
        out->resize(done);  // the peer sees a short body and drops the connection
        return false;
      }
      done += static_cast<uint64_t>(n);
    }
    return true;
  }

  // sendfile(2) on the non-blocking socket until the range is out, waiting for room between
  // calls; the whole write keeps the one write_timeout deadline, enforced by a timer because
  // the wait bypasses Beast's stream.
  void StartSendFile(bool keep) {
    file_sent_ = 0;
    Lowest(stream_).expires_never();
    if (!file_timer_) file_timer_.emplace(stream_.get_executor());
    file_timer_->expires_after(server_->options.write_timeout);
    file_timer_->async_wait([weak = this->weak_from_this()](beast::error_code ec) {
      if (ec) return;
      if (auto self = weak.lock()) {
        LK_LOG_WARN("http_write_timeout peer={}", self->peer_);
        self->Close();
      }
    });
    beast::error_code ec;
    Lowest(stream_).socket().native_non_blocking(true, ec);
    if (ec) return EndSendFile(ec, keep);
    SendFileSome(keep);
  }

  void SendFileSome(bool keep) {
    if constexpr (kCanSendFile) {
      auto& sock = Lowest(stream_).socket();
      const FileBody& f = *out_.body_file;
      while (file_sent_ < f.length) {
        off_t off = static_cast<off_t>(f.offset + file_sent_);
        ssize_t n = ::sendfile(sock.native_handle(), f.fd, &off,
                               std::min<uint64_t>(f.length - file_sent_, uint64_t{1} << 30));
        if (n > 0) {
          file_sent_ += static_cast<uint64_t>(n);
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
          sock.async_wait(asio::socket_base::wait_write,
                          [self = this->shared_from_this(), keep](beast::error_code ec) {
                            if (ec) return self->EndSendFile(ec, keep);
                            self->SendFileSome(keep);
                          });
          return;
        }
        // The file ended early (truncated under us) or the peer went away: the body cannot be
        // completed, so the connection goes.
        if (n == 0) LK_LOG_WARN("http_file_body_failed peer={} error=\"file ends early\"", peer_);
        return EndSendFile(beast::error_code(n == 0 ? EIO : errno, beast::system_category()), keep);
      }
    }
    EndSendFile({}, keep);
  }

  void EndSendFile(beast::error_code ec, bool keep) {
    if (file_timer_) file_timer_->cancel();
    FinishWrite(ec, keep);
  }

  void Close() {
    beast::error_code ec;
    Lowest(stream_).socket().shutdown(asio::socket_base::shutdown_both, ec);
    Lowest(stream_).socket().close(ec);
  }

  std::shared_ptr<Server::Impl> server_;
  Stream stream_;
  std::string peer_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  Response out_;      // the response being written; its buffers must live until the write ends
  std::string head_;  // its status line and headers
  std::string file_copy_;  // a file body read into memory where sendfile cannot be used
  uint64_t file_sent_ = 0;
  std::optional<asio::steady_timer> file_timer_;
  bool head_only_ = false;
  unsigned version_ = 11;
  bool keep_alive_ = true;
  bool busy_ = false;
};

template <class Protocol>
class Listener : public std::enable_shared_from_this<Listener<Protocol>> {
 public:
  Listener(std::shared_ptr<Server::Impl> server, typename Protocol::acceptor acceptor)
      : server_(std::move(server)), acceptor_(std::move(acceptor)) {}

  void Accept() {
    // One strand per connection when several threads run the io_context; with one thread the
    // io_context's own executor already serialises everything.
    auto executor = server_->options.single_thread ? asio::any_io_executor(server_->ioc.get_executor())
                                                   : asio::any_io_executor(asio::make_strand(server_->ioc));
    acceptor_.async_accept(
        executor,
        [self = this->shared_from_this()](beast::error_code ec, typename Protocol::socket sock) {
          self->OnAccept(ec, std::move(sock));
        });
  }

  void Close() {
    asio::post(acceptor_.get_executor(), [self = this->shared_from_this()] {
      beast::error_code ec;
      self->acceptor_.close(ec);
    });
  }

 private:
  void OnAccept(beast::error_code ec, typename Protocol::socket sock) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (!ec) Serve(std::move(sock));
    else LK_LOG_WARN("http_accept_failed error={}", Q(ec.message()));
    Accept();
  }

  void Serve(typename Protocol::socket sock) {
    if (server_->connections.load() >= server_->options.connections_max) {
      LK_LOG_WARN("http_connection_refused reason=connections_max limit={}",
                  server_->options.connections_max);
      beast::error_code ec;
      sock.close(ec);
      return;
    }
    std::shared_ptr<SessionBase> session;
    if constexpr (std::is_same_v<Protocol, tcp>) {
      beast::error_code ec;
      sock.set_option(tcp::no_delay(true), ec);
      auto ep = sock.remote_endpoint(ec);
      std::string peer = ec ? "?" : fmt::format("{}:{}", ep.address().to_string(), ep.port());
      if (server_->ssl) {
        auto s = std::make_shared<Session<TlsStream>>(
            server_, TlsStream(beast::tcp_stream(std::move(sock)), *server_->ssl), peer);
        s->Start();
        session = s;
      } else {
        auto s = std::make_shared<Session<beast::tcp_stream>>(
            server_, beast::tcp_stream(std::move(sock)), peer);
        s->Start();
        session = s;
      }
    } else {
      auto s = std::make_shared<Session<UnixStream>>(server_, UnixStream(std::move(sock)), "unix");
      s->Start();
      session = s;
    }
    server_->Track(session);
  }

  std::shared_ptr<Server::Impl> server_;
  typename Protocol::acceptor acceptor_;
};

Status SplitHostPort(const std::string& address, std::string* host, uint16_t* port) {
  auto colon = address.rfind(':');
  if (colon == std::string::npos) return InvalidArgument("address '{}' is not HOST:PORT", address);
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  std::string p = address.substr(colon + 1);
  char* end = nullptr;
  long v = std::strtol(p.c_str(), &end, 10);
  if (p.empty() || *end != '\0' || v < 0 || v > 65535) {
    return InvalidArgument("address '{}' has a bad port", address);
  }
  *port = static_cast<uint16_t>(v);
  return Status::Ok();
}

}  // namespace

Server::Server(asio::io_context& ioc, ServerOptions options, Handler handler)
    : impl_(std::make_shared<Impl>(ioc, std::move(options), std::move(handler))) {}

Server::~Server() { Stop(); }

Status Server::Listen(const std::string& address) {
  beast::error_code ec;
  if (address.rfind("unix:", 0) == 0) {
    std::string path = address.substr(5);
    if (path.empty()) return InvalidArgument("unix address needs a path");
    ::unlink(path.c_str());
    unix_proto::acceptor acc(impl_->ioc);
    acc.open(unix_proto(), ec);
    if (!ec) acc.bind(unix_proto::endpoint(path), ec);
    if (!ec) acc.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return Error(Code::kUnavailable, "listen on {}: {}", address, ec.message());
    auto l = std::make_shared<Listener<unix_proto>>(impl_, std::move(acc));
    l->Accept();
    impl_->closers.push_back([l] { l->Close(); });
    if (impl_->local_address.empty()) impl_->local_address = address;
    return Status::Ok();
  }
  std::string host;
  uint16_t port = 0;
  LK_RETURN_IF_ERROR(SplitHostPort(address, &host, &port));
  if (host.empty()) host = "0.0.0.0";
  auto addr = asio::ip::make_address(host, ec);
  if (ec) return InvalidArgument("address '{}': bad host: {}", address, ec.message());
  if (!impl_->options.tls_cert_file.empty() && !impl_->ssl) {
    impl_->ssl = std::make_unique<asio::ssl::context>(asio::ssl::context::tls_server);
    impl_->ssl->use_certificate_chain_file(impl_->options.tls_cert_file, ec);
    if (!ec) impl_->ssl->use_private_key_file(impl_->options.tls_key_file, asio::ssl::context::pem, ec);
    if (ec) {
      impl_->ssl.reset();
      return InvalidArgument("TLS cert/key {} {}: {}", impl_->options.tls_cert_file,
                             impl_->options.tls_key_file, ec.message());
    }
  }
  tcp::acceptor acc(impl_->ioc);
  tcp::endpoint ep(addr, port);
  acc.open(ep.protocol(), ec);
  if (!ec) acc.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acc.bind(ep, ec);
  if (!ec) acc.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Error(Code::kUnavailable, "listen on {}: {}", address, ec.message());
  auto bound = acc.local_endpoint(ec);
  std::string bound_text = addr.is_v6() ? fmt::format("[{}]:{}", host, bound.port())
                                        : fmt::format("{}:{}", host, bound.port());
  auto l = std::make_shared<Listener<tcp>>(impl_, std::move(acc));
  l->Accept();
  impl_->closers.push_back([l] { l->Close(); });
  if (impl_->local_address.empty()) impl_->local_address = bound_text;
  return Status::Ok();
}

std::string Server::LocalAddress() const { return impl_->local_address; }

uint64_t Server::connections() const { return impl_->connections.load(); }

void Server::Stop() {
  if (impl_->stopping.exchange(true)) return;
  for (auto& close : impl_->closers) close();
  std::lock_guard<std::mutex> lock(impl_->sessions_mu);
  for (auto& w : impl_->sessions) {
    if (auto s = w.lock()) s->CloseIfIdle();
  }
  impl_->sessions.clear();
}

}  // namespace lk::http
