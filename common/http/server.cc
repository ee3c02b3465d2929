#include "common/http/server.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/http/status.hpp>
#include <sys/sendfile.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <list>
#include <mutex>

#include "common/http/codec.h"
#include "common/http/head.h"
#include "common/log.h"
#include "common/sigpipe.h"

namespace lk::http {
namespace {

namespace asio = boost::asio;
namespace bhttp = boost::beast::http;
using ErrorCode = boost::system::error_code;
using tcp = asio::ip::tcp;
using unix_proto = asio::local::stream_protocol;
using SteadyClock = std::chrono::steady_clock;

constexpr size_t kHeaderBytesMax = 16 * 1024;
constexpr size_t kReadBytes = 16 * 1024;  // room asked of the kernel per read, at least
constexpr size_t kKeepBufferBytes = 64 * 1024;  // a connection's buffer shrinks back to this

class SessionBase {
 public:
  virtual ~SessionBase() = default;
  virtual void CloseIfIdle() = 0;
  // Called by the server's sweeper (any thread): closes the connection if its deadline passed.
  virtual void CheckDeadline(int64_t now_ns) = 0;
};

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch())
      .count();
}

}  // namespace

struct Server::Impl {
  asio::io_context& ioc;
  ServerOptions options;
  Handler handler;
  std::unique_ptr<asio::ssl::context> ssl;
  std::vector<std::function<void()>> closers;  // close each acceptor
  std::string local_address;
  std::atomic<uint64_t> connections{0};
  std::atomic<uint64_t> buffer_bytes{0};  // all connections' request buffers together

  // Takes `n` bytes of the request-buffer budget; false (nothing taken) when it has not them.
  bool ChargeBuffer(uint64_t n) {
    uint64_t held = buffer_bytes.fetch_add(n, std::memory_order_relaxed) + n;
    if (held <= options.request_buffer_bytes_max) return true;
    buffer_bytes.fetch_sub(n, std::memory_order_relaxed);
    return false;
  }
  std::atomic<bool> stopping{false};
  std::mutex sessions_mu;
  std::list<std::weak_ptr<SessionBase>> sessions;
  // On a strand of its own: Stop may cancel it while another thread runs its handler.
  asio::steady_timer sweeper;
  bool sweeping = false;

  Impl(asio::io_context& c, ServerOptions o, Handler h)
      : ioc(c), options(std::move(o)), handler(std::move(h)), sweeper(asio::make_strand(c)) {}

  void Track(const std::shared_ptr<SessionBase>& s) {
    // Closed connections' entries are dropped by the next sweep.
    std::lock_guard<std::mutex> lock(sessions_mu);
    sessions.push_back(s);
  }

  // Deadlines are enforced by one sweep over the connections every so often instead of a timer
  // per connection re-armed around every read and write: arming and cancelling those timers
  // (and the type-erased handlers around them) cost more than parsing a small request. A
  // deadline is therefore late by up to one sweep period, a quarter of the shortest timeout.
  Millis SweepPeriod() const {
    auto shortest = std::min({options.idle_timeout, options.request_timeout, options.write_timeout});
    return std::clamp(Millis(shortest.count() / 4), Millis(5), Millis(250));
  }

  static void Sweep(const std::shared_ptr<Impl>& self) {
    self->sweeper.expires_after(self->SweepPeriod());
    self->sweeper.async_wait([weak = std::weak_ptr<Impl>(self)](ErrorCode ec) {
      auto impl = weak.lock();
      if (ec || !impl || impl->stopping) return;
      int64_t now = NowNs();
      {
        std::lock_guard<std::mutex> lock(impl->sessions_mu);
        for (auto it = impl->sessions.begin(); it != impl->sessions.end();) {
          if (auto s = it->lock()) {
            s->CheckDeadline(now);
            ++it;
          } else {
            it = impl->sessions.erase(it);
          }
        }
      }
      Sweep(impl);
    });
  }
};

namespace {

enum class Wait : int { kNone, kIdle, kRequest, kWrite };

template <class T>
struct IsTls : std::false_type {};
template <class S>
struct IsTls<asio::ssl::stream<S>> : std::true_type {};

// One connection. Stream is a socket (TCP or Unix) or a TLS stream over a TCP socket, all on a
// concrete executor type (the io_context's, or a strand of it when several threads run it).
// The request head is parsed by hand in the connection's own buffer, which is reused from one
// request to the next; bytes that follow a request (a pipelined one) stay in it.
template <class Stream>
class Session : public SessionBase, public std::enable_shared_from_this<Session<Stream>> {
 public:
  static constexpr bool kTls = IsTls<Stream>::value;

  template <class... Args>
  Session(std::shared_ptr<Server::Impl> server, std::shared_ptr<const Handler> handler,
          std::string peer, std::optional<PeerCredentials> credentials, Args&&... stream_args)
      : server_(std::move(server)),
        handler_(std::move(handler)),
        stream_(std::forward<Args>(stream_args)...),
        peer_(std::move(peer)),
        credentials_(credentials) {
    ++server_->connections;
  }
  ~Session() override {
    server_->buffer_bytes.fetch_sub(charged_, std::memory_order_relaxed);
    --server_->connections;
  }

  void Start() {
    if constexpr (kTls) {
      SetDeadline(Wait::kRequest);
      stream_.async_handshake(asio::ssl::stream_base::server,
                              [self = this->shared_from_this()](ErrorCode ec) {
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

  void CheckDeadline(int64_t now_ns) override {
    int64_t d = deadline_ns_.load(std::memory_order_relaxed);
    if (d == 0 || now_ns < d) return;
    asio::post(stream_.get_executor(), [self = this->shared_from_this()] {
      int64_t d = self->deadline_ns_.load(std::memory_order_relaxed);
      if (d == 0 || NowNs() < d) return;  // it moved on meanwhile
      if (self->wait_ == Wait::kRequest) LK_LOG_WARN("http_request_timeout peer={}", self->peer_);
      if (self->wait_ == Wait::kWrite) LK_LOG_WARN("http_write_timeout peer={}", self->peer_);
      self->Close();
    });
  }

 private:
  using Socket = typename Stream::lowest_layer_type;
  Socket& Lowest() { return stream_.lowest_layer(); }

  void SetDeadline(Wait w) {
    wait_ = w;
    Millis t = w == Wait::kIdle      ? server_->options.idle_timeout
               : w == Wait::kRequest ? server_->options.request_timeout
                                     : server_->options.write_timeout;
    deadline_ns_.store(w == Wait::kNone ? 0 : NowNs() + std::chrono::nanoseconds(t).count(),
                       std::memory_order_relaxed);
  }

  // Parses what the buffer holds; reads more while a request is incomplete. An idle connection
  // (nothing of the next request yet) has idle_timeout; once its first byte came, the rest has
  // request_timeout, so a client that stalls mid-request is cut off sooner than an idle one.
  void WaitForRequest() {
    if (server_->stopping) return Close();
    if (Parse()) return;
    SetDeadline(end_ == begin_ ? Wait::kIdle : Wait::kRequest);
    ReadMore();
  }

  void ReadMore() {
    // A large request body grew the buffer: give the memory back rather than keep megabytes per
    // idle keep-alive connection.
    bool shrink = buf_.size() > kKeepBufferBytes && end_ - begin_ <= kKeepBufferBytes / 2;
    if (begin_ > 0 && (shrink || begin_ == end_ || buf_.size() - end_ < kReadBytes)) {
      // Move what is left of the buffer to its front before reading behind it.
      std::memmove(buf_.data(), buf_.data() + begin_, end_ - begin_);
      end_ -= begin_;
      begin_ = 0;
      scanned_ = 0;
    }
    size_t want = shrink ? kKeepBufferBytes : buf_.size();
    if (want - end_ < kReadBytes) want = std::max(want * 2, end_ + kReadBytes);
    // Growth is paid for from the server-wide budget first; the buffer shrinks after a large
    // request, and what it gives back returns to the budget.
    if (want > charged_) {
      if (!server_->ChargeBuffer(want - charged_)) {
        LK_LOG_WARN("http_buffer_budget peer={} want_bytes={} budget_bytes={}", peer_, want,
                    server_->options.request_buffer_bytes_max);
        Fail(503, Status(Code::kUnavailable,
                         fmt::format("the server's request buffers are full ({} bytes); retry "
                                     "later",
                                     server_->options.request_buffer_bytes_max),
                         Reason::kBufferBudget));
        return;
      }
      charged_ = want;
    }
    if (shrink) {
      buf_.resize(kKeepBufferBytes);
      buf_.shrink_to_fit();
    }
    if (buf_.size() != want) buf_.resize(want);
    if (charged_ > buf_.size()) {
      server_->buffer_bytes.fetch_sub(charged_ - buf_.size(), std::memory_order_relaxed);
      charged_ = buf_.size();
    }
    stream_.async_read_some(
        asio::buffer(buf_.data() + end_, buf_.size() - end_),
        [self = this->shared_from_this()](ErrorCode ec, size_t n) {
          if (ec) return self->Close();
          self->end_ += n;
          self->WaitForRequest();
        });
  }

  // True when it handled something (a request went to the handler, or an error answer went
  // out); false when more bytes are needed.
  bool Parse() {
    std::string_view data(buf_.data() + begin_, end_ - begin_);
    if (head_bytes_ == 0) {
      // Lenient about empty lines between requests, as RFC 9112 asks.
      while (data.substr(0, 2) == "\r\n") {
        begin_ += 2;
        data.remove_prefix(2);
      }
      auto end = data.find("\r\n\r\n", scanned_ > 3 ? scanned_ - 3 : 0);
      if (end != std::string_view::npos) {
        head_bytes_ = end + 4;
      } else if (data.size() <= kHeaderBytesMax) {
        scanned_ = data.size();
        return false;
      }
    }
    // No blank line within the limit (head_bytes_ still 0), or one beyond it.
    if (head_bytes_ == 0 || head_bytes_ > kHeaderBytesMax) {
      Fail(431, InvalidArgument("request head over {} bytes", kHeaderBytesMax));
      return true;
    }
    // Parsed again whenever more of the body arrived: the views point into buf_, which moves.
    Head h;
    std::string why = ParseHead(data.substr(0, head_bytes_), &h);
    if (!why.empty()) {
      LK_LOG_WARN("http_bad_request peer={} error={}", peer_, Q(why));
      Fail(400, InvalidArgument("malformed HTTP request: {}", why));
      return true;
    }
    if (h.content_length > server_->options.body_bytes_max) {
      LK_LOG_WARN("http_body_too_large peer={} limit_bytes={}", peer_, server_->options.body_bytes_max);
      Fail(413, Error(Code::kTooLarge, "request body over {} bytes", server_->options.body_bytes_max));
      return true;
    }
    if (data.size() < head_bytes_ + h.content_length) {
      if (h.expect_continue && !continue_sent_) {
        // The client waits for this before it sends the body (curl does for larger ones).
        continue_sent_ = true;
        SendContinue();
        return true;
      }
      return false;
    }
    Dispatch(data, h);
    return true;
  }

  void SendContinue() {
    static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
    SetDeadline(Wait::kWrite);
    asio::async_write(stream_, asio::buffer(kContinue.data(), kContinue.size()),
                      [self = this->shared_from_this()](ErrorCode ec, size_t) {
                        if (ec) return self->Close();
                        self->WaitForRequest();
                      });
  }

  void Dispatch(std::string_view data, const Head& h) {
    Request req;
    req.method = std::string(h.method);
    auto q = h.target.find('?');
    req.path = PercentDecode(h.target.substr(0, q));
    if (q != std::string_view::npos) req.query = ParseQuery(h.target.substr(q + 1));
    req.content_type = std::string(h.content_type);
    req.accept = std::string(h.accept);
    req.authorization = std::string(h.authorization);
    req.range = std::string(h.range);
    req.gateway = std::string(h.gateway);
    req.body = std::string(data.substr(head_bytes_, h.content_length));
    req.peer = peer_;
    req.credentials = credentials_;
    req.file_body_ok = !kTls;
    version_ = h.version;
    keep_alive_ = h.keep_alive;
    head_only_ = h.method == "HEAD";
    begin_ += head_bytes_ + h.content_length;
    head_bytes_ = 0;
    scanned_ = 0;
    continue_sent_ = false;
    busy_ = true;
    // A handler may hold the request for a long-poll: no deadline while it does.
    SetDeadline(Wait::kNone);
    auto self = this->shared_from_this();
    auto answered = std::make_shared<std::atomic<bool>>(false);
    auto answer = [self, answered](Response r) {
      if (answered->exchange(true)) return;
      // dispatch, not post: a handler that answers on the connection's own executor (most do)
      // writes at once instead of paying for a trip through the executor's queue.
      asio::dispatch(self->stream_.get_executor(),
                     [self, r = std::move(r)]() mutable { self->Write(std::move(r)); });
    };
    // The barrier of CallHandler, inline: `answered` makes its answer a no-op when the handler
    // answered before it threw. The method and path are kept for the log line (the request is
    // the handler's); the barrier's own responder is made only when it is needed.
    std::string method = req.method, path = req.path;
    try {
      (*handler_)(std::move(req), Responder(answer));
    } catch (const std::exception& e) {
      answer(HandlerThrew(method, path, e.what()));
    } catch (...) {
      answer(HandlerThrew(method, path, "unknown exception"));
    }
  }

  // An answer to a request that could not be parsed; the connection closes after it.
  void Fail(int status, const Status& st) {
    keep_alive_ = false;
    version_ = 11;
    head_only_ = false;
    Response r = ErrorReply(st, Format::kJson);
    r.status = status;
    Write(std::move(r));
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
    if (out_.body_file && kTls && !head_only_) {
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
    SetDeadline(Wait::kWrite);
    asio::async_write(stream_, buffers,
                      [self = this->shared_from_this(), keep](ErrorCode ec, size_t) {
                        if (ec || !self->out_.body_file) return self->FinishWrite(ec, keep);
                        self->StartSendFile(keep);
                      });
  }

  void FinishWrite(ErrorCode ec, bool keep) {
    busy_ = false;
    out_ = Response();
    file_copy_ = std::string();
    if (ec || !keep) return Close();
    WaitForRequest();
  }

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
  // calls; the whole response keeps the one write deadline set in Write.
  void StartSendFile(bool keep) {
    file_sent_ = 0;
    ErrorCode ec;
    Lowest().native_non_blocking(true, ec);
    if (ec) return FinishWrite(ec, keep);
    SendFileSome(keep);
  }

  void SendFileSome(bool keep) {
    if constexpr (!kTls) {
      auto& sock = Lowest();
      const FileBody& f = *out_.body_file;
      // sendfile(2) has no MSG_NOSIGNAL: a client gone in the middle of a body would raise
      // SIGPIPE, whose default kills the process (possibly a user's trainer).
      ScopedSigpipeBlock no_sigpipe;
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
          sock.async_wait(Socket::wait_write,
                          [self = this->shared_from_this(), keep](ErrorCode ec) {
                            if (ec) return self->FinishWrite(ec, keep);
                            self->SendFileSome(keep);
                          });
          return;
        }
        // The file ended early (truncated under us) or the peer went away: the body cannot be
        // completed, so the connection goes.
        if (n == 0) LK_LOG_WARN("http_file_body_failed peer={} error=\"file ends early\"", peer_);
        return FinishWrite(ErrorCode(n == 0 ? EIO : errno, boost::system::system_category()), keep);
      }
    }
    FinishWrite({}, keep);
  }

  void Close() {
    SetDeadline(Wait::kNone);
    ErrorCode ec;
    Lowest().shutdown(asio::socket_base::shutdown_both, ec);
    Lowest().close(ec);
  }

  std::shared_ptr<Server::Impl> server_;
  std::shared_ptr<const Handler> handler_;  // this connection's listener's routes
  Stream stream_;
  std::string peer_;
  std::optional<PeerCredentials> credentials_;
  // Received bytes live in buf_[begin_, end_); the head being parsed starts at begin_.
  std::vector<char> buf_;
  size_t charged_ = 0;  // bytes of the server's buffer budget this connection holds
  size_t begin_ = 0, end_ = 0;
  size_t scanned_ = 0;     // bytes after begin_ already searched for the blank line
  size_t head_bytes_ = 0;  // the current request's head length, once its blank line came
  bool continue_sent_ = false;
  std::atomic<int64_t> deadline_ns_{0};
  Wait wait_ = Wait::kNone;
  Response out_;      // the response being written; its buffers must live until the write ends
  std::string head_;  // its status line and headers
  std::string file_copy_;  // a file body read into memory where sendfile cannot be used
  uint64_t file_sent_ = 0;
  bool head_only_ = false;
  unsigned version_ = 11;
  bool keep_alive_ = true;
  bool busy_ = false;
};

template <class Protocol>
class Listener : public std::enable_shared_from_this<Listener<Protocol>> {
 public:
  Listener(std::shared_ptr<Server::Impl> server, std::shared_ptr<const Handler> handler,
           typename Protocol::acceptor acceptor)
      : server_(std::move(server)), handler_(std::move(handler)), acceptor_(std::move(acceptor)) {}

  void Accept() {
    // One strand per connection when several threads run the io_context; with one thread the
    // io_context's own executor already serialises everything. Either way the connection's
    // socket has a concrete executor type: a type-erased one was copied and destroyed around
    // every operation, a measurable part of a small request.
    if (server_->options.single_thread) {
      AcceptWith(server_->ioc.get_executor());
    } else {
      AcceptWith(asio::make_strand(server_->ioc));
    }
  }

  void Close() {
    asio::post(acceptor_.get_executor(), [self = this->shared_from_this()] {
      ErrorCode ec;
      self->acceptor_.close(ec);
    });
  }

 private:
  template <class Executor>
  void AcceptWith(Executor ex) {
    acceptor_.async_accept(ex, [self = this->shared_from_this()](ErrorCode ec, auto sock) {
      if (ec == asio::error::operation_aborted || !self->acceptor_.is_open()) return;
      if (!ec) self->Serve(std::move(sock));
      else LK_LOG_WARN("http_accept_failed error={}", Q(ec.message()));
      self->Accept();
    });
  }

  template <class Socket>
  void Serve(Socket sock) {
    if (server_->connections.load() >= server_->options.connections_max) {
      LK_LOG_WARN("http_connection_refused reason=connections_max limit={}",
                  server_->options.connections_max);
      ErrorCode ec;
      sock.close(ec);
      return;
    }
    std::shared_ptr<SessionBase> session;
    if constexpr (std::is_same_v<Protocol, tcp>) {
      ErrorCode ec;
      sock.set_option(tcp::no_delay(true), ec);
      auto ep = sock.remote_endpoint(ec);
      std::string peer = ec ? "?" : fmt::format("{}:{}", ep.address().to_string(), ep.port());
      if (server_->ssl) {
        auto s = std::make_shared<Session<asio::ssl::stream<Socket>>>(
            server_, handler_, peer, std::nullopt, std::move(sock), *server_->ssl);
        s->Start();
        session = s;
      } else {
        auto s = std::make_shared<Session<Socket>>(server_, handler_, peer, std::nullopt,
                                                   std::move(sock));
        s->Start();
        session = s;
      }
    } else {
      // The kernel's record of who connected; a connection without one is refused rather than
      // served as nobody in particular.
      ucred cred{};
      socklen_t len = sizeof cred;
      if (::getsockopt(sock.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
        LK_LOG_WARN("http_connection_refused reason=no_peer_credentials error={}",
                    Q(std::strerror(errno)));
        ErrorCode ec;
        sock.close(ec);
        return;
      }
      PeerCredentials pc{cred.pid, static_cast<uint32_t>(cred.uid),
                         static_cast<uint32_t>(cred.gid)};
      auto s = std::make_shared<Session<Socket>>(
          server_, handler_, fmt::format("unix:pid={}", cred.pid), pc, std::move(sock));
      s->Start();
      session = s;
    }
    server_->Track(session);
  }

  std::shared_ptr<Server::Impl> server_;
  std::shared_ptr<const Handler> handler_;
  typename Protocol::acceptor acceptor_;
};

// Binds a Unix socket at `path` that nobody but this user can connect to at any moment: bound
// in a fresh directory of mode 0700, made 0600, listening, and only then renamed into place
// (which also replaces an old socket file atomically). Binding at the path itself would leave
// the file at the umask's mode until a chmod, and changing the umask affects every thread.
Status BindPrivateUnix(const std::string& path, unix_proto::acceptor* acc) {
  std::filesystem::path target(path);
  std::string parent = target.parent_path().empty() ? "." : target.parent_path().string();
  std::string dir = parent + "/.lk-sock-XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) {
    return Error(Code::kUnavailable, "listen on unix:{}: mkdtemp in {}: {}", path, parent,
                 std::strerror(errno));
  }
  std::string tmp = dir + "/s";
  ErrorCode ec;
  acc->open(unix_proto(), ec);
  if (!ec) acc->bind(unix_proto::endpoint(tmp), ec);
  std::string why = ec ? ec.message() : "";
  if (!ec && ::chmod(tmp.c_str(), 0600) != 0) why = fmt::format("chmod: {}", std::strerror(errno));
  if (why.empty()) acc->listen(asio::socket_base::max_listen_connections, ec);
  if (why.empty() && ec) why = ec.message();
  if (why.empty() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    why = fmt::format("rename into place: {}", std::strerror(errno));
  }
  ::unlink(tmp.c_str());  // gone already after a rename
  ::rmdir(dir.c_str());
  if (!why.empty()) {
    acc->close(ec);
    return Error(Code::kUnavailable, "listen on unix:{}: {}", path, why);
  }
  return Status::Ok();
}

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

bool ListensOnLoopback(const std::string& address) {
  if (address.rfind("unix:", 0) == 0) return true;
  std::string host;
  uint16_t port = 0;
  if (!SplitHostPort(address, &host, &port).ok() || host.empty()) return false;
  ErrorCode ec;
  auto addr = asio::ip::make_address(host, ec);
  return !ec && addr.is_loopback();
}

bool ListensOnUnspecified(const std::string& address) {
  if (address.rfind("unix:", 0) == 0) return false;
  std::string host;
  uint16_t port = 0;
  if (!SplitHostPort(address, &host, &port).ok()) return false;
  if (host.empty()) return true;
  ErrorCode ec;
  auto addr = asio::ip::make_address(host, ec);
  return !ec && addr.is_unspecified();
}

Result<std::string> InterfaceIPv4(const std::string& name) {
  struct ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) {
    return Error(Code::kUnavailable, "getifaddrs: {}", std::strerror(errno));
  }
  std::string found;
  bool exists = false;
  for (struct ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_name == nullptr || name != i->ifa_name) continue;
    exists = true;
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* in = reinterpret_cast<const struct sockaddr_in*>(i->ifa_addr);
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) != nullptr) {
      found = text;
      break;
    }
  }
  ::freeifaddrs(list);
  if (found.empty()) {
    return Error(Code::kNotFound, "interface {}: {}", name,
                 exists ? "no IPv4 address" : "no such interface");
  }
  return found;
}

Response HandlerThrew(std::string_view method, std::string_view path, std::string_view what) {
  LK_LOG_ERROR("handler_threw method={} path={} what={}", Q(method), Q(path), Q(what));
  return ErrorReply(Status(Code::kInternal, fmt::format("internal error in {} {}", method, path),
                           Reason::kInternal),
                    Format::kJson);
}

void CallHandler(const Handler& handler, Request&& req, Responder respond) {
  auto answered = std::make_shared<std::atomic<bool>>(false);
  Responder once = [answered, respond = std::move(respond)](Response r) {
    if (!answered->exchange(true)) respond(std::move(r));
  };
  std::string method = req.method, path = req.path;
  try {
    handler(std::move(req), once);
  } catch (const std::exception& e) {
    once(HandlerThrew(method, path, e.what()));
  } catch (...) {
    once(HandlerThrew(method, path, "unknown exception"));
  }
}

Server::Server(asio::io_context& ioc, ServerOptions options, Handler handler)
    : impl_(std::make_shared<Impl>(ioc, std::move(options), std::move(handler))) {}

Server::~Server() { Stop(); }

Status Server::Listen(const std::string& address) { return Listen(address, impl_->handler); }

Status Server::Listen(const std::string& address, Handler handler) {
  auto routes = std::make_shared<const Handler>(std::move(handler));
  ErrorCode ec;
  if (address.rfind("unix:", 0) == 0) {
    std::string path = address.substr(5);
    if (path.empty()) return InvalidArgument("unix address needs a path");
    unix_proto::acceptor acc(impl_->ioc);
    LK_RETURN_IF_ERROR(BindPrivateUnix(path, &acc));
    auto l = std::make_shared<Listener<unix_proto>>(impl_, routes, std::move(acc));
    l->Accept();
    // The socket file goes with the server, or every life of an agent (one per Slurm job) leaves
    // one behind; only if it is still this server's: a later server may have bound the path.
    struct stat bound {};
    bool have_inode = ::stat(path.c_str(), &bound) == 0;
    impl_->closers.push_back([l, path, have_inode, inode = bound.st_ino] {
      l->Close();
      struct stat now {};
      if (have_inode && ::stat(path.c_str(), &now) == 0 && now.st_ino == inode) ::unlink(path.c_str());
    });
    if (impl_->local_address.empty()) impl_->local_address = address;
    StartSweeping();
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
  auto l = std::make_shared<Listener<tcp>>(impl_, routes, std::move(acc));
  l->Accept();
  impl_->closers.push_back([l] { l->Close(); });
  if (impl_->local_address.empty()) impl_->local_address = bound_text;
  StartSweeping();
  return Status::Ok();
}

void Server::StartSweeping() {
  if (impl_->sweeping) return;
  impl_->sweeping = true;
  asio::post(impl_->sweeper.get_executor(), [impl = impl_] { Impl::Sweep(impl); });
}

std::string Server::LocalAddress() const { return impl_->local_address; }

uint64_t Server::connections() const { return impl_->connections.load(); }

uint64_t Server::buffer_bytes() const { return impl_->buffer_bytes.load(); }

void Server::Stop() {
  if (impl_->stopping.exchange(true)) return;
  for (auto& close : impl_->closers) close();
  asio::post(impl_->sweeper.get_executor(), [impl = impl_] { impl->sweeper.cancel(); });
  std::lock_guard<std::mutex> lock(impl_->sessions_mu);
  for (auto& w : impl_->sessions) {
    if (auto s = w.lock()) s->CloseIfIdle();
  }
  impl_->sessions.clear();
}

}  // namespace lk::http
