#include "bench/lighthouse_bench_net.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

namespace lk::bench {

std::string RequestBytes(std::string_view method, std::string_view target, std::string_view body,
                         std::string_view content_type) {
  // The header set of lk::http::Client, so the servers parse what agents really send.
  return fmt::format(
      "{} {} HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: lightkeeper\r\nContent-Type: {}\r\n"
      "Accept: {}\r\nContent-Length: {}\r\n\r\n{}",
      method, target, content_type, content_type, body.size(), body);
}

tcp::endpoint ParseEndpoint(const std::string& address) {
  auto colon = address.rfind(':');
  return tcp::endpoint(asio::ip::make_address(address.substr(0, colon)),
                       static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
}

void HttpConn::Connect(const tcp::endpoint& ep, std::function<void(bool)> done) {
  socket_.async_connect(ep, [self = shared_from_this(), done = std::move(done)](
                                const boost::system::error_code& ec) {
    if (!ec) {
      boost::system::error_code ignored;
      // Nagle would hold the second small write of a request for up to 40 ms.
      self->socket_.set_option(tcp::no_delay(true), ignored);
    }
    done(!ec);
  });
}

void HttpConn::Send(std::shared_ptr<const std::string> request, Callback done, bool want_body) {
  request_ = std::move(request);
  done_ = std::move(done);
  want_body_ = want_body;
  if (!socket_.is_open()) return Fail("connection closed");
  asio::async_write(socket_, asio::buffer(*request_),
                    [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                      if (ec) return self->Fail("write: " + ec.message());
                      // A whole response may already be buffered (never with one request in
                      // flight, but cheap to check).
                      if (!self->TryDeliver()) self->DoRead();
                    });
}

void HttpConn::DoRead() {
  if (in_.size() - in_len_ < 4096) in_.resize(in_.size() * 2);
  socket_.async_read_some(
      asio::buffer(in_.data() + in_len_, in_.size() - in_len_),
      [self = shared_from_this()](const boost::system::error_code& ec, size_t n) {
        if (ec) return self->Fail("read: " + ec.message());
        self->in_len_ += n;
        if (!self->TryDeliver()) self->DoRead();
      });
}

namespace {

// Case-insensitive search for a header name at the start of a line; the value as a number.
int64_t HeaderNumber(std::string_view head, std::string_view name) {
  for (size_t pos = head.find("\r\n"); pos != std::string_view::npos;
       pos = head.find("\r\n", pos + 2)) {
    std::string_view line = head.substr(pos + 2);
    if (line.size() <= name.size() || line[name.size()] != ':') continue;
    bool same = true;
    for (size_t i = 0; i < name.size() && same; ++i) {
      same = std::tolower(static_cast<unsigned char>(line[i])) == name[i];
    }
    if (same) return std::strtoll(line.data() + name.size() + 1, nullptr, 10);
  }
  return -1;
}

}  // namespace

bool HttpConn::TryDeliver() {
  if (!done_) return false;
  std::string_view data(in_.data(), in_len_);
  size_t head_end = data.find("\r\n\r\n");
  if (head_end == std::string_view::npos) return false;
  std::string_view head = data.substr(0, head_end);
  if (head.size() < 12 || head.substr(0, 5) != "HTTP/") {
    Fail("bad status line");
    return true;
  }
  int status = std::atoi(head.data() + 9);
  int64_t length = HeaderNumber(head, "content-length");
  if (length < 0) {
    if (status != 204 && status != 304) {
      Fail("response without Content-Length");
      return true;
    }
    length = 0;
  }
  size_t total = head_end + 4 + static_cast<size_t>(length);
  if (in_len_ < total) return false;
  HttpResult r;
  r.status = status;
  r.done = SteadyClock::now();
  if (want_body_) r.body.assign(in_.data() + head_end + 4, static_cast<size_t>(length));
  std::memmove(in_.data(), in_.data() + total, in_len_ - total);
  in_len_ -= total;
  Callback cb = std::move(done_);
  done_ = nullptr;
  cb(std::move(r));
  return true;
}

void HttpConn::Fail(const std::string& why) {
  boost::system::error_code ignored;
  socket_.close(ignored);
  in_len_ = 0;
  if (!done_) return;
  Callback cb = std::move(done_);
  done_ = nullptr;
  HttpResult r;
  r.done = SteadyClock::now();
  r.error = why;
  cb(std::move(r));
}

void HttpConn::Close() {
  boost::system::error_code ignored;
  socket_.close(ignored);
}

bool Loop::RunUntil(const std::function<bool()>& pred, std::chrono::milliseconds bound) {
  auto deadline = SteadyClock::now() + bound;
  while (!pred()) {
    auto now = SteadyClock::now();
    if (now >= deadline) return false;
    // Wake at least every millisecond: some conditions (the barrier's count) change on another
    // thread, without a handler here.
    ioc_.run_one_until(std::min(deadline, now + std::chrono::milliseconds(1)));
  }
  return true;
}

void Loop::RunFor(std::chrono::milliseconds d) {
  auto deadline = SteadyClock::now() + d;
  while (SteadyClock::now() < deadline) ioc_.run_one_until(deadline);
}

std::vector<ConnPtr> ConnectAll(Loop& loop, const tcp::endpoint& ep, size_t n, size_t parallel,
                                std::chrono::milliseconds bound) {
  std::vector<ConnPtr> all(n);
  std::vector<char> ok(n, 0);
  size_t started = 0, finished = 0;
  std::function<void()> start_next = [&] {
    if (started >= n) return;
    size_t i = started++;
    all[i] = std::make_shared<HttpConn>(loop.ioc());
    all[i]->Connect(ep, [&, i](bool good) {
      ok[i] = good;
      ++finished;
      start_next();
    });
  };
  for (size_t i = 0; i < std::min(n, parallel); ++i) start_next();
  loop.RunUntil([&] { return finished == started && started == n; }, bound);
  std::vector<ConnPtr> out;
  for (size_t i = 0; i < n; ++i) {
    if (all[i] && ok[i]) out.push_back(all[i]);
  }
  if (finished != started) {
    // Connects still in flight reference this frame: close them and let their handlers run.
    for (auto& c : all) {
      if (c) c->Close();
    }
    loop.RunUntil([&] { return finished == started; }, std::chrono::seconds(5));
    return {};
  }
  return out;
}

void CloseAll(Loop& loop, std::vector<ConnPtr>& conns) {
  for (auto& c : conns) c->Close();
  // Aborted operations still hold references; give them a moment to run and release.
  loop.RunUntil([&] { return std::none_of(conns.begin(), conns.end(),
                                          [](const ConnPtr& c) { return c->busy(); }); },
                std::chrono::seconds(5));
  conns.clear();
}

std::vector<HttpResult> SendAll(Loop& loop, const std::vector<ConnPtr>& conns,
                                const std::vector<std::shared_ptr<const std::string>>& requests,
                                std::chrono::milliseconds bound, bool want_body) {
  auto results = std::make_shared<std::vector<HttpResult>>(conns.size());
  auto left = std::make_shared<size_t>(conns.size());
  for (size_t i = 0; i < conns.size(); ++i) {
    conns[i]->Send(requests[i], [results, left, i](HttpResult&& r) {
      (*results)[i] = std::move(r);
      --*left;
    }, want_body);
  }
  if (!loop.RunUntil([&] { return *left == 0; }, bound)) {
    for (auto& r : *results) {
      if (r.status == 0 && r.error.empty()) r.error = "no answer";
    }
  }
  return *results;
}

// ---- raw TCP barrier ----

struct BarrierServer::Impl : std::enable_shared_from_this<BarrierServer::Impl> {
  asio::io_context ioc{1};
  tcp::acceptor acceptor{ioc};
  std::atomic<size_t> waiting_count{0};
  std::vector<std::shared_ptr<tcp::socket>> waiting;
  uint32_t round_size = 0;
  const char reply = 'r';

  void Accept() {
    acceptor.async_accept([self = shared_from_this()](const boost::system::error_code& ec,
                                                      tcp::socket s) {
      if (ec) return;
      boost::system::error_code ignored;
      s.set_option(tcp::no_delay(true), ignored);
      self->Read(std::make_shared<tcp::socket>(std::move(s)));
      self->Accept();
    });
  }

  void Read(std::shared_ptr<tcp::socket> s) {
    auto buf = std::make_shared<uint32_t>(0);
    asio::async_read(*s, asio::buffer(buf.get(), 4),
                     [self = shared_from_this(), s, buf](const boost::system::error_code& ec,
                                                         size_t) {
                       if (ec) return;
                       self->round_size = *buf;
                       self->waiting.push_back(s);
                       self->waiting_count = self->waiting.size();
                       if (self->waiting.size() >= self->round_size) self->Release();
                     });
  }

  void Release() {
    auto round = std::move(waiting);
    waiting.clear();
    waiting_count = 0;
    for (auto& s : round) {
      // One byte into an empty socket buffer: the synchronous write never blocks.
      boost::system::error_code ec;
      asio::write(*s, asio::buffer(&reply, 1), ec);
      if (!ec) Read(s);
    }
  }
};

BarrierServer::BarrierServer() : impl_(std::make_shared<Impl>()) {
  tcp::endpoint ep(asio::ip::make_address("127.0.0.1"), 0);
  impl_->acceptor.open(ep.protocol());
  impl_->acceptor.set_option(asio::socket_base::reuse_address(true));
  impl_->acceptor.bind(ep);
  impl_->acceptor.listen(4096);
  port_ = impl_->acceptor.local_endpoint().port();
  impl_->Accept();
  thread_ = std::thread([impl = impl_] { impl->ioc.run(); });
}

BarrierServer::~BarrierServer() {
  impl_->ioc.stop();
  thread_.join();
}

size_t BarrierServer::waiting() const { return impl_->waiting_count.load(); }

// ---- /proc ----

CpuSeconds ProcessCpuSeconds(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The command name may hold spaces; fields are counted after its closing parenthesis.
  auto close = text.rfind(')');
  if (close == std::string::npos) return {};
  std::istringstream fields(text.substr(close + 2));
  std::string f;
  double utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> f; ++i) {
    if (i == 14) utime = std::stod(f);
    if (i == 15) stime = std::stod(f);
  }
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  return {utime / tick, stime / tick};
}

int64_t ProcessRssBytes(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/status", pid));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

double ThreadCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_THREAD, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

double Percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

}  // namespace lk::bench
