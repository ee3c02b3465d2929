#include "gateway/exchange.h"

#include <algorithm>
#include <cstring>
#include <set>

#include <fmt/ranges.h>

#include "comm/compress.h"
#include "comm/reduce.h"
#include "common/http/codec.h"
#include "common/http/tokens.h"
#include "common/log.h"

namespace lk::gateway {

namespace {

// More members than any job has groups: a bound on the sites list a request may make us parse.
constexpr uint32_t kWorldMax = 4096;
constexpr uint32_t kChunksMax = 1u << 24;
// What a round costs beside its bytes (its map node, its sites, its waiters), charged to the
// byte bound, so that many tiny rounds cannot take memory the bound does not see.
constexpr uint64_t kRoundOverheadBytes = 4096;
// (job, slot) pairs whose newest quorum is remembered; past it those without a round are
// forgotten (a superseded quorum then fails at its deadline instead of at once).
constexpr size_t kNewestMax = 1 << 16;

Status Mismatch(std::string message) {
  return Status(Code::kConflict, std::move(message), Reason::kRoundMismatch);
}

// Bytes of a round's partial on the WAN.
size_t WireBytes(const RoundSpec& spec) { return comm::EncodedBytes(spec.codec, spec.count); }

// A partial as it came over the WAN (checked to be WireBytes long), as float32.
std::string Decoded(const RoundSpec& spec, const std::string& wire) {
  if (spec.codec == comm::Codec::kNone) return wire;
  std::string floats(spec.count * sizeof(float), '\0');
  comm::Decode(spec.codec, {reinterpret_cast<const uint8_t*>(wire.data()), wire.size()},
               {reinterpret_cast<float*>(floats.data()), spec.count});
  return floats;
}

// Every refusal of a request that does not parse says BAD_REQUEST, whichever parser found it.
Status BadRequest(const Status& st) {
  return st.reason() == Reason::kUnspecified ? st.WithReason(Reason::kBadRequest) : st;
}

http::Response Answer(std::shared_ptr<const std::string> bytes, const std::string& site) {
  http::Response r;
  r.status = 200;
  r.content_type = "application/octet-stream";
  r.body_tail = std::move(bytes);
  if (!site.empty()) r.headers.emplace_back("Lk-Site", site);
  return r;
}

}  // namespace

Result<ParsedContribution> ParseContribution(const http::Request& req, bool from_gateway,
                                             Millis timeout_max) {
  ParsedContribution p;
  auto field = [&](const char* name) -> std::string {
    auto it = req.query.find(name);
    return it == req.query.end() ? std::string() : it->second;
  };
  p.key.job = field("job");
  if (Status st = http::ValidName("job", p.key.job); !st.ok()) return st.WithReason(Reason::kBadRequest);
  LK_ASSIGN_OR_RETURN(p.key.slot, http::ParseU32(req.query, "slot", 0));
  LK_ASSIGN_OR_RETURN(p.key.quorum, http::ParseU32(req.query, "quorum", 0));
  LK_ASSIGN_OR_RETURN(uint32_t seq, http::ParseU32(req.query, "seq", 0));
  p.key.seq = seq;
  LK_ASSIGN_OR_RETURN(p.key.chunk, http::ParseU32(req.query, "chunk", 0));
  LK_ASSIGN_OR_RETURN(p.spec.chunks, http::ParseU32(req.query, "chunks", 0));
  LK_ASSIGN_OR_RETURN(p.spec.world, http::ParseU32(req.query, "world", 0));
  LK_ASSIGN_OR_RETURN(uint32_t timeout_ms, http::ParseU32(req.query, "timeout_ms", 0));
  if (p.spec.chunks == 0 || p.spec.chunks > kChunksMax || p.key.chunk >= p.spec.chunks) {
    return Refuse(Code::kInvalidArgument, Reason::kBadRequest, "chunk {} of chunks {} is out of range", p.key.chunk, p.spec.chunks);
  }
  if (p.spec.world == 0 || p.spec.world > kWorldMax) {
    return Refuse(Code::kInvalidArgument, Reason::kBadRequest, "world {} is not in [1, {}]", p.spec.world, kWorldMax);
  }
  if (timeout_ms == 0) return Refuse(Code::kInvalidArgument, Reason::kBadRequest, "timeout_ms is required (the collective's deadline)");
  p.spec.timeout = std::min(Millis(timeout_ms), timeout_max);
  const std::string sites = field("sites");
  size_t begin = 0;
  while (begin <= sites.size() && p.spec.sites.size() <= kWorldMax) {
    size_t end = sites.find(',', begin);
    if (end == std::string::npos) end = sites.size();
    std::string site = sites.substr(begin, end - begin);
    if (Status st = http::ValidName("site", site); !st.ok()) {
      return st.WithReason(Reason::kBadRequest).WithContext("sites");
    }
    p.spec.sites.push_back(std::move(site));
    begin = end + 1;
  }
  if (p.spec.sites.size() != p.spec.world) {
    return Refuse(Code::kInvalidArgument, Reason::kBadRequest, "sites names {} members, world is {}", p.spec.sites.size(), p.spec.world);
  }
  if (auto it = req.query.find("codec"); it != req.query.end() && !it->second.empty()) {
    if (!comm::ParseCodec(it->second, &p.spec.codec)) {
      return Refuse(Code::kInvalidArgument, Reason::kBadRequest,
                    "codec {:?} is not none, bf16, int8 or int4", it->second);
    }
  }
  if (from_gateway) {
    // A partial on the WAN is `count` elements in the codec's encoding.
    LK_ASSIGN_OR_RETURN(uint32_t count, http::ParseU32(req.query, "count", 0));
    if (count == 0 || req.body.size() != comm::EncodedBytes(p.spec.codec, count)) {
      return Refuse(Code::kInvalidArgument, Reason::kBadRequest,
                    "the body ({} bytes) is not {} elements encoded {}", req.body.size(), count,
                    comm::CodecName(p.spec.codec));
    }
    p.spec.count = count;
  } else {
    if (req.body.size() % sizeof(float) != 0 || req.body.empty()) {
      return Refuse(Code::kInvalidArgument, Reason::kBadRequest,
                    "the body ({} bytes) is no whole number of float32 elements",
                    req.body.size());
    }
    p.spec.count = req.body.size() / sizeof(float);
  }
  if (from_gateway) {
    p.from = field("from");
    if (Status st = http::ValidName("from", p.from); !st.ok()) {
      return st.WithReason(Reason::kBadRequest);
    }
    if (std::find(p.spec.sites.begin(), p.spec.sites.end(), p.from) == p.spec.sites.end()) {
      return Refuse(Code::kInvalidArgument, Reason::kBadRequest, "from {} is not a site of the round", p.from);
    }
  } else {
    LK_ASSIGN_OR_RETURN(p.rank, http::ParseU32(req.query, "rank", 0));
    if (p.rank >= p.spec.world) return Refuse(Code::kInvalidArgument, Reason::kBadRequest, "rank {} out of world {}", p.rank, p.spec.world);
  }
  return p;
}

struct Exchange::Round {
  RoundSpec spec;
  TimePoint deadline;
  uint32_t local_expected = 0;
  std::set<std::string> remote_expected;  // the other sites of the round
  std::map<uint32_t, std::string> local;  // rank -> elements
  std::vector<http::Responder> members;   // the trainers waiting for the total
  bool summing = false;
  std::shared_ptr<const std::string> partial;  // this site's, once summed (float32)
  std::shared_ptr<const std::string> wire;     // the same as the codec encodes it
  std::map<std::string, std::string> remote;   // site -> its partial, decoded (float32)
  std::vector<http::Responder> peers;          // gateways waiting for this site's partial
  bool totalling = false;
  uint64_t bytes = 0;
};

Exchange::Exchange(ExchangeOptions options, Hooks hooks)
    : options_(std::move(options)), hooks_(std::move(hooks)) {}

Exchange::~Exchange() { FailAll(Status(Code::kUnavailable, "gateway shutting down", Reason::kShuttingDown)); }

size_t Exchange::rounds() const {
  std::lock_guard lock(mu_);
  return rounds_.size();
}

Exchange::Totals Exchange::totals() const {
  std::lock_guard lock(mu_);
  return totals_;
}

uint64_t Exchange::bytes_held() const {
  std::lock_guard lock(mu_);
  return bytes_;
}

Exchange::Round* Exchange::FindOrCreateLocked(const RoundKey& key, const RoundSpec& spec,
                                              Status* refusal, std::vector<Reply>* out) {
  if (stopped_) {
    *refusal = Status(Code::kUnavailable, "gateway shutting down", Reason::kShuttingDown);
    return nullptr;
  }
  if (newest_.size() > kNewestMax) {
    std::set<std::pair<std::string, uint32_t>> live;
    for (auto& [k, r] : rounds_) live.emplace(k.job, k.slot);
    std::erase_if(newest_, [&](const auto& e) { return !live.count(e.first); });
  }
  auto slot = std::make_pair(key.job, key.slot);
  auto nit = newest_.find(slot);
  if (nit != newest_.end() && key.quorum < nit->second) {
    *refusal = Refuse(Code::kConflict, Reason::kRoundFailed,
                      "quorum {} of job {} slot {} is superseded by quorum {}", key.quorum,
                      key.job, key.slot, nit->second);
    return nullptr;
  }
  if (nit == newest_.end() || key.quorum > nit->second) {
    // The (job, slot) moved on: its rounds of older quorums can never finish.
    newest_[slot] = key.quorum;
    std::vector<RoundKey> old;
    for (auto& [k, r] : rounds_) {
      if (k.job == key.job && k.slot == key.slot && k.quorum < key.quorum) old.push_back(k);
    }
    for (const RoundKey& k : old) {
      FailLocked(k, Refuse(Code::kConflict, Reason::kRoundFailed, "superseded by quorum {}",
                           key.quorum),
                 out);
    }
  }
  auto it = rounds_.find(key);
  if (it != rounds_.end()) {
    const RoundSpec& have = it->second->spec;
    if (have.world != spec.world || have.sites != spec.sites || have.count != spec.count ||
        have.chunks != spec.chunks || have.codec != spec.codec) {
      *refusal = Mismatch(fmt::format(
          "round (quorum {} collective {} chunk {}) has world {}, {} elements, sites {}; this "
          "contribution says world {}, {} elements",
          key.quorum, key.seq, key.chunk, have.world, have.count, fmt::join(have.sites, ","),
          spec.world, spec.count));
      FailLocked(key, *refusal, out);
      return nullptr;
    }
    return it->second.get();
  }
  if (bytes_ + kRoundOverheadBytes > options_.bytes_max) {
    *refusal = Refuse(Code::kUnavailable, Reason::kBufferBudget,
                      "the exchange holds {} bytes already (its bound is {})", bytes_,
                      options_.bytes_max);
    return nullptr;
  }
  auto round = std::make_shared<Round>();
  round->spec = spec;
  round->bytes = kRoundOverheadBytes;
  bytes_ += kRoundOverheadBytes;
  round->deadline = std::chrono::steady_clock::now() + spec.timeout;
  for (const std::string& s : spec.sites) {
    if (s == options_.site) {
      ++round->local_expected;
    } else {
      round->remote_expected.insert(s);
    }
  }
  return rounds_.emplace(key, std::move(round)).first->second.get();
}

void Exchange::Contribute(const http::Request& req, http::Responder respond) {
  const http::Format f = http::ReplyFormat(req);
  auto parsed = ParseContribution(req, false, options_.timeout_max);
  if (!parsed.ok()) return respond(http::ErrorReply(BadRequest(parsed.status()), f));
  const ParsedContribution& p = *parsed;
  if (p.spec.sites[p.rank] != options_.site) {
    return respond(http::ErrorReply(
        Mismatch(fmt::format("member {} is at site {}, this gateway is site {}", p.rank,
                             p.spec.sites[p.rank], options_.site)),
        f));
  }
  std::vector<Reply> out;
  {
    std::lock_guard lock(mu_);
    if (bytes_ + req.body.size() > options_.bytes_max) {
      Status full = Refuse(Code::kUnavailable, Reason::kBufferBudget,
                           "the exchange holds {} bytes already (its bound is {})", bytes_,
                           options_.bytes_max);
      out.push_back([respond, full, f] { respond(http::ErrorReply(full, f)); });
    } else {
      Status refusal;
      Round* r = FindOrCreateLocked(p.key, p.spec, &refusal, &out);
      if (r != nullptr && (r->local.count(p.rank) || r->partial || r->summing)) {
        refusal = Mismatch(fmt::format("member {} contributed to this round already", p.rank));
        FailLocked(p.key, refusal, &out);
        r = nullptr;
      }
      if (r == nullptr) {
        out.push_back([respond, refusal, f] { respond(http::ErrorReply(refusal, f)); });
      } else {
        r->local.emplace(p.rank, req.body);
        totals_.member_bytes += req.body.size();
        r->bytes += req.body.size();
        bytes_ += req.body.size();
        r->members.push_back(std::move(respond));
        AdvanceLocked(p.key, &out);
      }
    }
  }
  for (auto& reply : out) reply();
}

void Exchange::FromPeer(const http::Request& req, http::Responder respond) {
  const http::Format f = http::ReplyFormat(req);
  auto parsed = ParseContribution(req, true, options_.timeout_max);
  if (!parsed.ok()) return respond(http::ErrorReply(BadRequest(parsed.status()), f));
  const ParsedContribution& p = *parsed;
  if (std::find(p.spec.sites.begin(), p.spec.sites.end(), options_.site) == p.spec.sites.end()) {
    // Answered at once and remembered nowhere: the dialing gateway learns this one's site and
    // that it has no part in the round.
    http::Response r = http::ErrorReply(
        Refuse(Code::kNotFound, Reason::kNotInRound, "site {} has no member in this round",
               options_.site),
        f);
    r.headers.emplace_back("Lk-Site", options_.site);
    return respond(std::move(r));
  }
  if (p.from == options_.site) {
    return respond(http::ErrorReply(
        Mismatch(fmt::format("a gateway of site {} dialed site {} itself", p.from, options_.site)),
        f));
  }
  std::vector<Reply> out;
  {
    std::lock_guard lock(mu_);
    Status refusal;
    Round* r = nullptr;
    if (bytes_ + req.body.size() > options_.bytes_max) {
      refusal = Refuse(Code::kUnavailable, Reason::kBufferBudget,
                       "the exchange holds {} bytes already (its bound is {})", bytes_,
                       options_.bytes_max);
    } else {
      r = FindOrCreateLocked(p.key, p.spec, &refusal, &out);
    }
    if (r == nullptr) {
      out.push_back([respond, refusal, f] { respond(http::ErrorReply(refusal, f)); });
    } else {
      if (!r->remote.count(p.from)) {
        std::string floats = Decoded(r->spec, req.body);
        r->bytes += floats.size();
        bytes_ += floats.size();
        r->remote.emplace(p.from, std::move(floats));
      }
      if (r->wire) {
        out.push_back([respond, bytes = r->wire, site = options_.site] {
          respond(Answer(bytes, site));
        });
      } else {
        r->peers.push_back(std::move(respond));
      }
      AdvanceLocked(p.key, &out);
    }
  }
  for (auto& reply : out) reply();
}

void Exchange::OnPeerAnswer(const RoundKey& key,
                            Result<std::pair<std::string, std::string>> answer) {
  std::vector<Reply> out;
  {
    std::lock_guard lock(mu_);
    auto it = rounds_.find(key);
    if (it == rounds_.end()) return;  // failed or finished meanwhile
    Round& r = *it->second;
    if (!answer.ok()) {
      if (answer.status().reason() == Reason::kNotInRound) return;
      FailLocked(key, answer.status(), &out);
    } else {
      auto& [site, bytes] = *answer;
      if (!r.remote_expected.count(site)) {
        FailLocked(key,
                   Mismatch(fmt::format("a dialed gateway answered as site {}, which has no "
                                        "member in the round",
                                        site)),
                   &out);
      } else if (bytes.size() != WireBytes(r.spec)) {
        FailLocked(key,
                   Mismatch(fmt::format("site {} answered {} bytes for a chunk of {} elements "
                                        "encoded {}",
                                        site, bytes.size(), r.spec.count,
                                        comm::CodecName(r.spec.codec))),
                   &out);
      } else if (!r.remote.count(site)) {
        std::string floats = Decoded(r.spec, bytes);
        r.bytes += floats.size();
        bytes_ += floats.size();
        r.remote.emplace(site, std::move(floats));
        AdvanceLocked(key, &out);
      }
    }
  }
  for (auto& reply : out) reply();
}

void Exchange::AdvanceLocked(const RoundKey& key, std::vector<Reply>* out) {
  std::shared_ptr<Round> held = rounds_.at(key);
  Round& r = *held;
  if (!r.partial && !r.summing && r.local.size() == r.local_expected && r.local_expected > 0) {
    r.summing = true;
    if (!hooks_.run([this, key, held] { SumPartial(key, held); })) {
      FailLocked(key, Refuse(Code::kUnavailable, Reason::kWorkersBusy,
                             "no thread free to sum the round (--relays-max)"),
                 out);
    }
    return;
  }
  if (r.partial && !r.totalling && r.remote.size() == r.remote_expected.size()) {
    r.totalling = true;
    if (!hooks_.run([this, key, held] { SumTotal(key, held); })) {
      FailLocked(key, Refuse(Code::kUnavailable, Reason::kWorkersBusy,
                             "no thread free to sum the round (--relays-max)"),
                 out);
    }
  }
}

void Exchange::SumPartial(const RoundKey& key, const std::shared_ptr<Round>& round) {
  // The round accepts no more contributions once summing is set, and `round` keeps them alive
  // even if the round fails meanwhile: they are read here without the lock.
  std::vector<const std::string*> parts;
  for (auto& [rank, bytes] : round->local) parts.push_back(&bytes);  // rank order
  const size_t count = round->spec.count;
  auto sum = std::make_shared<std::string>(*parts[0]);
  for (size_t i = 1; i < parts.size(); ++i) {
    comm::AddInto(reinterpret_cast<float*>(sum->data()),
                  reinterpret_cast<const float*>(parts[i]->data()), count);
  }
  // What goes on the WAN is the codec's encoding; this site adds its own partial as the others
  // decode it, so that every gateway adds the same operands.
  std::shared_ptr<const std::string> wire = sum;
  const comm::Codec codec = round->spec.codec;
  if (codec != comm::Codec::kNone) {
    auto encoded = std::make_shared<std::string>(comm::EncodedBytes(codec, count), '\0');
    comm::Encode(codec, {reinterpret_cast<const float*>(sum->data()), count},
                 {reinterpret_cast<uint8_t*>(encoded->data()), encoded->size()});
    comm::Decode(codec, {reinterpret_cast<const uint8_t*>(encoded->data()), encoded->size()},
                 {reinterpret_cast<float*>(sum->data()), count});
    wire = encoded;
  }
  std::vector<Reply> out;
  std::shared_ptr<const std::string> partial = sum;
  {
    std::lock_guard lock(mu_);
    auto it = rounds_.find(key);
    if (it == rounds_.end() || it->second != round) return;  // failed meanwhile
    Round& r = *round;
    r.partial = partial;
    r.wire = wire;
    for (auto& [rank, bytes] : r.local) {
      r.bytes -= bytes.size();
      bytes_ -= bytes.size();
    }
    r.local.clear();
    r.bytes += partial->size();
    bytes_ += partial->size();
    for (auto& peer : r.peers) {
      out.push_back([peer = std::move(peer), wire, site = options_.site] {
        peer(Answer(wire, site));
      });
    }
    r.peers.clear();
    if (!r.remote_expected.empty()) {
      out.push_back([this, key, spec = r.spec, wire] { hooks_.dial(key, spec, wire); });
    }
    AdvanceLocked(key, &out);
  }
  for (auto& reply : out) reply();
}

void Exchange::SumTotal(const RoundKey& key, const std::shared_ptr<Round>& round) {
  // Every partial is in and none changes any more (each site's is taken once).
  std::map<std::string, const std::string*> by_site;  // site-name order, this site's among them
  for (auto& [site, bytes] : round->remote) by_site.emplace(site, &bytes);
  by_site.emplace(options_.site, round->partial.get());
  const size_t count = round->spec.count;
  auto it0 = by_site.begin();
  auto total = std::make_shared<std::string>(*it0->second);
  for (auto it = std::next(it0); it != by_site.end(); ++it) {
    comm::AddInto(reinterpret_cast<float*>(total->data()),
                  reinterpret_cast<const float*>(it->second->data()), count);
  }
  std::vector<Reply> out;
  {
    std::lock_guard lock(mu_);
    auto it = rounds_.find(key);
    if (it == rounds_.end() || it->second != round) return;
    std::shared_ptr<const std::string> bytes = total;
    for (auto& member : round->members) {
      out.push_back([member = std::move(member), bytes] { member(Answer(bytes, "")); });
    }
    bytes_ -= round->bytes;
    ++totals_.rounds_done;
    rounds_.erase(it);
  }
  for (auto& reply : out) reply();
}

void Exchange::FailLocked(const RoundKey& key, const Status& why, std::vector<Reply>* out) {
  auto it = rounds_.find(key);
  if (it == rounds_.end()) return;
  Round& r = *it->second;
  Status st = why.reason() == Reason::kUnspecified ? why.WithReason(Reason::kRoundFailed) : why;
  LK_LOG_INFO("exchange_round_failed job={} slot={} quorum={} seq={} chunk={} code={} reason={}",
              key.job, key.slot, key.quorum, key.seq, key.chunk, ReasonName(st.reason()),
              Q(st.message()));
  for (auto& w : r.members) {
    out->push_back([w = std::move(w), st] { w(http::ErrorReply(st, http::Format::kJson)); });
  }
  for (auto& w : r.peers) {
    out->push_back([w = std::move(w), st] { w(http::ErrorReply(st, http::Format::kJson)); });
  }
  bytes_ -= r.bytes;
  ++totals_.rounds_failed;
  rounds_.erase(it);
}

void Exchange::Sweep(TimePoint now) {
  std::vector<Reply> out;
  {
    std::lock_guard lock(mu_);
    std::vector<RoundKey> late;
    for (auto& [k, r] : rounds_) {
      if (r->deadline <= now) late.push_back(k);
    }
    for (const RoundKey& k : late) {
      auto& r = *rounds_.at(k);
      std::string missing;
      for (const std::string& s : r.remote_expected) {
        if (!r.remote.count(s)) missing += (missing.empty() ? "" : ",") + s;
      }
      FailLocked(k,
                 Refuse(Code::kDeadlineExceeded, Reason::kRoundFailed,
                        "the round ran past its deadline with {} of {} members of site {} in "
                        "and the partials of sites [{}] missing",
                        r.partial ? r.local_expected : r.local.size(), r.local_expected,
                        options_.site, missing),
                 &out);
    }
  }
  for (auto& reply : out) reply();
}

void Exchange::FailAll(const Status& why) {
  std::vector<Reply> out;
  {
    std::lock_guard lock(mu_);
    stopped_ = true;
    std::vector<RoundKey> all;
    for (auto& [k, r] : rounds_) all.push_back(k);
    for (const RoundKey& k : all) FailLocked(k, why, &out);
  }
  for (auto& reply : out) reply();
}

}  // namespace lk::gateway
