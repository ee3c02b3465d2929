// The gateway backend: the cross-group collective of a trainer whose site reaches the other
// sites only through its lk_gateway. Every member sends its buffer to its own site's gateway in
// chunks (POST /v1/exchange, gateway/exchange.h has the wire format); the gateway sums its
// site's members, swaps one partial sum per site with the other gateways over the WAN, adds the
// partials in one order common to every gateway and answers each chunk with the total. So the
// WAN carries one contribution per site, not one per group, and every member receives the same
// bytes.
//
// The members learn which site each of them is in at Reconfigure through the rendezvous store
// (each publishes the site its gateway names at GET /v1/site) and send that list with every
// chunk: each gateway then knows which members are its own and which sites it must hear from.
//
// Abort: every chunk in flight is an HTTP request on a client of this communicator; failing the
// communicator cancels them (Client::Cancel), so a blocked AllReduce returns at once. The
// gateway fails the round of a member that disappears at its deadline, and the other members'
// requests with it.
#include <cstring>
#include <thread>

#include "comm/backends.h"
#include "comm/reduce.h"
#include "common/http/client.h"
#include "common/log.h"

namespace lk::comm {
namespace {

// Elements per chunk: 2 MiB of float32, under the gateway listener's default body limit
// (4 MiB), large enough that a request's fixed cost is small beside its transfer.
constexpr size_t kChunkElems = size_t{1} << 19;
// Chunks in flight at once per member: the site's link stays busy while the gateway sums and
// swaps the previous ones.
constexpr size_t kInflight = 4;

std::string SiteKey(uint32_t slot, uint32_t rank) {
  return fmt::format("gw-site/{}/{}", slot, rank);
}

class GatewayCommManager final : public CommManager, private CommLifecycle {
 public:
  GatewayCommManager(RendezvousStore* store, CommOptions options)
      : CommLifecycle("gateway", options.slot), store_(store), options_(std::move(options)) {}
  ~GatewayCommManager() override {
    std::lock_guard lock(mu_);
    FailLocked(Error(Code::kAborted, "communicator shut down"), LogLevel::kDebug);
  }

  Status Reconfigure(uint32_t quorum_id, uint32_t replica_rank, uint32_t world_size) override;
  Status AllReduce(void* data, size_t count, DType dtype, ReduceOp op) override {
    return Exchange(data, count, dtype, op, "none");
  }
  // Each member's contribution is what its encoding decodes to (`sent`, its error feedback, as
  // with the other backends); the sums travel in float32, so the result is exact and
  // result_feedback stays as it is. The gateways swap their partial sums encoded by the codec
  // (each adds every partial as decoded, its own too), so the WAN leg is compressed.
  Status AllReduceEncoded(std::span<float> data, const ChunkCodec& codec, ReduceOp op,
                          std::span<float> sent, std::span<float> result_feedback) override;
  void Abort(const std::string& reason) override { AbortAll(reason); }
  void AbortQuorum(uint32_t quorum_id, const std::string& reason) override {
    AbortUpTo(quorum_id, reason);
  }
  void Close(const std::string& reason) override { CloseAll(reason); }
  uint32_t quorum_id() const override { return quorum_id_.load(); }
  Backend backend() const override { return Backend::kGateway; }

 private:
  // A client of this communicator's (cancelled when it fails); null once it has failed.
  std::unique_ptr<http::Client> NewClient();
  void OnFailedLocked() override {
    for (http::Client* c : live_) c->Cancel();
  }
  std::string FailDetailLocked() const override {
    return fmt::format(" gateway={} seq={}", options_.gateway_url, seq_);
  }
  Result<std::string> OwnSite(TimePoint deadline);
  // The collective; `codec` names the encoding of the partial sums between the gateways.
  Status Exchange(void* data, size_t count, DType dtype, ReduceOp op, std::string_view codec);
  // One chunk's round trip: sends `in` (float32) and writes the total into `out`.
  Status Chunk(http::Client& client, uint64_t seq, size_t chunk, size_t chunks,
               const float* in, float* out, size_t count, TimePoint deadline,
               std::string_view codec);

  RendezvousStore* store_;
  const CommOptions options_;
  // Under mu_ (CommLifecycle's).
  std::vector<http::Client*> live_;
  uint32_t rank_ = 0;
  uint32_t world_ = 1;
  std::string sites_;  // the members' sites in rank order, comma-separated (the query's sites=)
  uint64_t seq_ = 0;   // collectives run on this quorum
  std::string own_site_;  // the gateway's answer, kept: one site per gateway for its life
};

std::unique_ptr<http::Client> GatewayCommManager::NewClient() {
  http::ClientOptions co;
  co.token = options_.gateway_token;
  co.ca_file = options_.gateway_ca_file;
  auto c = http::Client::Create(options_.gateway_url, co);
  if (!c.ok()) return nullptr;
  std::lock_guard lock(mu_);
  live_.push_back(c->get());
  if (phase_ == Phase::kFailed) (*c)->Cancel();
  return std::move(*c);
}

Result<std::string> GatewayCommManager::OwnSite(TimePoint deadline) {
  {
    std::lock_guard lock(mu_);
    if (!own_site_.empty()) return own_site_;
  }
  auto client = NewClient();
  if (!client) return InvalidArgument("gateway url {} does not parse", options_.gateway_url);
  auto left = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
  auto r = client->Do("GET", "/v1/site?job=" + http::PercentEncode(options_.job), "", "",
                      std::max(left, Millis(1)));
  {
    std::lock_guard lock(mu_);
    std::erase(live_, client.get());
  }
  if (!r.ok()) return r.status().WithContext("gateway " + options_.gateway_url);
  if (r->status / 100 != 2) {
    return http::StatusFromResponse(*r).WithContext("gateway " + options_.gateway_url + " site");
  }
  std::string site = r->body;
  while (!site.empty() && (site.back() == '\n' || site.back() == '\r')) site.pop_back();
  if (site.empty() || site.find(',') != std::string::npos) {
    return Error(Code::kInvalidArgument, "gateway {} names no usable site ({:?})",
                 options_.gateway_url, site);
  }
  std::lock_guard lock(mu_);
  own_site_ = site;
  return site;
}

Status GatewayCommManager::Reconfigure(uint32_t quorum_id, uint32_t replica_rank,
                                       uint32_t world_size) {
  if (world_size == 0 || replica_rank >= world_size) {
    return InvalidArgument("replica_rank {} out of world_size {}", replica_rank, world_size);
  }
  const auto start = std::chrono::steady_clock::now();
  const TimePoint deadline = start + options_.init_timeout;
  {
    std::lock_guard lock(mu_);
    if (auto answer = BeginLocked(quorum_id)) return *answer;
    rank_ = replica_rank;
    world_ = world_size;
    seq_ = 0;
    sites_.clear();
  }
  Status st;
  std::string sites;
  auto interrupted = [this] { return Interrupted(); };
  auto site = OwnSite(deadline);
  if (!site.ok()) st = site.status();
  if (st.ok()) st = store_->Put(quorum_id, SiteKey(options_.slot, replica_rank), *site);
  for (uint32_t r = 0; st.ok() && r < world_size; ++r) {
    auto v = r == replica_rank ? Result<std::string>(*site)
                               : WaitForKey(store_, quorum_id, SiteKey(options_.slot, r),
                                            deadline, interrupted);
    if (!v.ok()) {
      st = v.status();
      break;
    }
    if (v->empty() || v->find(',') != std::string::npos || v->size() > 64) {
      st = Error(Code::kInvalidArgument, "member {} published no usable site", r);
      break;
    }
    sites += (r ? "," : "") + *v;
  }
  std::lock_guard lock(mu_);
  if (!st.ok()) FailLocked(st);
  if (phase_ == Phase::kFailed) return status_;
  sites_ = std::move(sites);
  phase_ = Phase::kReady;
  LK_LOG_INFO("comm_ready backend=gateway slot={} quorum_id={} rank={} world={} site={} "
              "sites={} init_ms={}",
              options_.slot, quorum_id, replica_rank, world_size, own_site_, sites_,
              ToMillis(std::chrono::steady_clock::now() - start));
  return Status::Ok();
}

Status GatewayCommManager::Chunk(http::Client& client, uint64_t seq, size_t chunk, size_t chunks,
                                 const float* in, float* out, size_t count, TimePoint deadline,
                                 std::string_view codec) {
  std::string target;
  {
    std::lock_guard lock(mu_);
    target = fmt::format(
        "/v1/exchange?job={}&slot={}&quorum={}&seq={}&chunk={}&chunks={}&rank={}&world={}&"
        "sites={}&timeout_ms={}&codec={}",
        http::PercentEncode(options_.job), options_.slot, quorum_id_.load(), seq, chunk, chunks,
        rank_, world_, http::PercentEncode(sites_),
        std::max<int64_t>(1, ToMillis(deadline - std::chrono::steady_clock::now())), codec);
  }
  const std::string_view body(reinterpret_cast<const char*>(in), count * sizeof(float));
  auto left = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
  if (left <= Millis(0)) {
    return Error(Code::kDeadlineExceeded, "collective {} past op_timeout", seq);
  }
  // A little beyond the gateway's own deadline, so that its ROUND_FAILED answer (which says
  // why) comes back before this side gives up on its own.
  auto r = client.Do("POST", target, body, "application/octet-stream",
                     left + Millis(2'000));
  if (!r.ok()) return r.status().WithContext("gateway " + options_.gateway_url);
  if (r->status / 100 != 2) {
    return http::StatusFromResponse(*r).WithContext(
        fmt::format("gateway {} chunk {} of collective {}", options_.gateway_url, chunk, seq));
  }
  if (r->body.size() != count * sizeof(float)) {
    return Error(Code::kDataLoss, "gateway answered {} bytes for a chunk of {} elements",
                 r->body.size(), count);
  }
  std::memcpy(out, r->body.data(), r->body.size());
  return Status::Ok();
}

Status GatewayCommManager::Exchange(void* data, size_t count, DType dtype, ReduceOp op,
                                    std::string_view codec) {
  uint64_t seq;
  uint32_t world;
  {
    std::lock_guard lock(mu_);
    if (phase_ != Phase::kReady) {
      return phase_ == Phase::kFailed ? status_
                                      : Status(Code::kInvalidArgument, "AllReduce before Reconfigure");
    }
    seq = seq_++;
    world = world_;
  }
  if (count == 0) return Status::Ok();
  const TimePoint deadline = std::chrono::steady_clock::now() + options_.op_timeout;
  // The exchange is in float32: bfloat16 is widened here and rounded once at the end, as the
  // Gloo backend does.
  std::vector<float> wide;
  float* acc = static_cast<float*>(data);
  if (dtype == DType::kBFloat16) {
    wide.resize(count);
    WidenBf16(static_cast<const uint16_t*>(data), wide.data(), count);
    acc = wide.data();
  }
  const size_t chunks = (count + kChunkElems - 1) / kChunkElems;
  std::atomic<size_t> next{0};
  std::mutex first_mu;
  Status first;
  auto worker = [&] {
    auto client = NewClient();
    if (!client) {
      std::lock_guard lock(first_mu);
      if (first.ok()) first = InvalidArgument("gateway url {} does not parse", options_.gateway_url);
      return;
    }
    for (size_t c; (c = next.fetch_add(1)) < chunks;) {
      {
        std::lock_guard lock(first_mu);
        if (!first.ok()) break;
      }
      const size_t begin = c * kChunkElems;
      const size_t n = std::min(kChunkElems, count - begin);
      Status st = Chunk(*client, seq, c, chunks, acc + begin, acc + begin, n, deadline, codec);
      if (!st.ok()) {
        std::lock_guard lock(first_mu);
        if (first.ok()) first = st;
        break;
      }
    }
    std::lock_guard lock(mu_);
    std::erase(live_, client.get());
  };
  const size_t threads = std::min(kInflight, chunks);
  std::vector<std::thread> pool;
  for (size_t i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (!first.ok()) {
    // The first failure of a member fails the communicator, as with a peer lost in a ring: the
    // round is gone on the gateway too.
    Status interrupted = Interrupted();
    return Fail(interrupted.ok() ? first : interrupted);
  }
  if (Status st = Interrupted(); !st.ok()) return st;
  if (op == ReduceOp::kAvg) Divide(acc, count, static_cast<float>(world));
  if (dtype == DType::kBFloat16) NarrowToBf16(acc, static_cast<uint16_t*>(data), count);
  return Status::Ok();
}

Status GatewayCommManager::AllReduceEncoded(std::span<float> data, const ChunkCodec& codec,
                                            ReduceOp op, std::span<float> sent,
                                            std::span<float> /*result_feedback*/) {
  const size_t block = codec.block_elems();
  std::vector<uint8_t> bytes;
  for (size_t begin = 0; begin < data.size();) {
    // Whole blocks at a time, so that the encoding is the one a peer backend would send.
    const size_t n = std::min(data.size() - begin, std::max<size_t>(block, kChunkElems / block * block));
    bytes.resize(codec.EncodedBytes(n));
    codec.Encode(data.data() + begin, n, bytes.data());
    codec.Decode(bytes.data(), n, data.data() + begin);
    begin += n;
  }
  if (!sent.empty()) std::copy(data.begin(), data.end(), sent.begin());
  return Exchange(data.data(), data.size(), DType::kFloat32, op, codec.name());
}

}  // namespace

Result<std::unique_ptr<CommManager>> CreateGatewayCommManager(RendezvousStore* store,
                                                              CommOptions options) {
  if (options.gateway_url.empty()) {
    return InvalidArgument("the gateway backend needs gateway_url (the site's lk_gateway)");
  }
  if (options.job.empty()) return InvalidArgument("the gateway backend needs the job's name");
  return std::unique_ptr<CommManager>(new GatewayCommManager(store, std::move(options)));
}

}  // namespace lk::comm
