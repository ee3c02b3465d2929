// The gateway-reduced outer exchange: the rounds of the cross-group allreduce that a site's
// gateway runs for its trainers (comm/gateway_comm.cc is their side).
//
// Wire format (float32, little-endian, as the trainers' buffers):
//   POST /v1/exchange?job=J&slot=S&quorum=Q&seq=K&chunk=C&chunks=N&rank=R&world=W&sites=A,B,..
//        &timeout_ms=T        (on --listen, from a trainer; bearer: J's token)
//     body: member R's elements of chunk C of collective K; answer: the sum over all W members.
//   (both may add &codec=none|bf16|int8|int4, the encoding of the partial sums on the WAN)
//   POST /v1/wan/exchange?job=..&slot=..&quorum=..&seq=..&chunk=..&chunks=..&world=..&sites=..
//        &timeout_ms=..&codec=..&count=N&from=SITE   (on --wan-listen, from another gateway;
//        bearer: J's token)
//     body: the partial sum of SITE's members, N elements encoded by the codec; answer: this
//     site's partial sum, encoded the same way (header Lk-Site), or 404 NOT_IN_ROUND when no
//     member of the round is at this site.
//   GET /v1/site?job=J   (on --listen; bearer: J's token): this gateway's site name.
// `sites` lists each member's site in rank order, the same for every member (they learn it at
// the rendezvous); a round is one (job, slot, quorum, seq, chunk).
//
// A round: the site's members' contributions are summed in rank order (the site's partial);
// the partial goes to every other site of the round (each pair of gateways swaps partials in
// one request: the side that dials sends its own and gets the other's in the answer), and once
// every site's partial is in, the total is the partials added in the order of the site names,
// the same operands in the same order on every gateway, so every member gets the same bits.
// A round fails as a whole (ROUND_FAILED to everyone waiting on it, trainers and gateways) at
// its deadline, when a dial to another gateway fails, when its (job, slot) moves on to a newer
// quorum, or at Stop; a contribution that disagrees with its round (another member count, sites
// list or size, a member that is not at this site, a member twice) is refused ROUND_MISMATCH
// and fails the round too, so nobody waits for a round that cannot finish.
// Thread-safety: every method may be called from any thread; callbacks (responders, hooks) run
// outside the lock.
#pragma once

#include <lightkeeper/clock.h>
#include <lightkeeper/status.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "comm/compress.h"
#include "common/http/http.h"

namespace lk::gateway {

struct RoundKey {
  std::string job;
  uint32_t slot = 0;
  uint32_t quorum = 0;
  uint64_t seq = 0;
  uint32_t chunk = 0;
  auto operator<=>(const RoundKey&) const = default;
};

// What every party of a round must agree on.
struct RoundSpec {
  uint32_t chunks = 1;
  uint32_t world = 0;
  std::vector<std::string> sites;  // per rank
  size_t count = 0;                // elements of this chunk
  Millis timeout{0};
  // The encoding of the partial sums on the WAN ("none", "bf16", "int8", "int4": the job's
  // --outer-compress). Each gateway adds the partials as every gateway decodes them, its own
  // too, so the total is the same everywhere.
  comm::Codec codec = comm::Codec::kNone;
};

// A trainer's or a gateway's request, parsed: kInvalidArgument (BAD_REQUEST) naming the field.
struct ParsedContribution {
  RoundKey key;
  RoundSpec spec;
  uint32_t rank = 0;   // trainers only
  std::string from;    // gateways only
};
Result<ParsedContribution> ParseContribution(const http::Request& req, bool from_gateway,
                                             Millis timeout_max);

struct ExchangeOptions {
  std::string site;
  // Bytes of contributions and partials held at once, all rounds together; beyond it a
  // contribution is refused 503 BUFFER_BUDGET (the member retries nothing: its collective fails
  // and the next quorum starts over).
  uint64_t bytes_max = 4ull << 30;
  Millis timeout_max{600'000};
};

class Exchange {
 public:
  struct Hooks {
    // Runs `task` away from the io thread (a sum of many megabytes); false when it cannot (the
    // gateway is stopping or at --relays-max), which fails the round.
    std::function<bool(std::function<void()>)> run;
    // Hands this site's partial of a round to the gateways this one dials; each answer comes
    // back through OnPeerAnswer.
    std::function<void(const RoundKey&, const RoundSpec&, std::shared_ptr<const std::string>)>
        dial;
  };

  Exchange(ExchangeOptions options, Hooks hooks);
  ~Exchange();

  // A trainer's contribution (authorized already): answered with the total, or the refusal.
  void Contribute(const http::Request& req, http::Responder respond);
  // Another gateway's partial (authorized already): answered with this site's partial.
  void FromPeer(const http::Request& req, http::Responder respond);
  // A dialed gateway's answer: its site and partial, or a failure that fails the round. A
  // NOT_IN_ROUND answer is no failure: that gateway has no member in the round.
  void OnPeerAnswer(const RoundKey& key, Result<std::pair<std::string, std::string>> answer);
  // Fails the rounds past their deadline; the gateway calls it about once a second.
  void Sweep(TimePoint now);
  // Fails every round, and every later contribution (the gateway stops).
  void FailAll(const Status& why);

  // For /status-like views and tests.
  size_t rounds() const;
  uint64_t bytes_held() const;
  // Since start: rounds finished, and the bytes of this site's members' contributions.
  struct Totals {
    uint64_t rounds_done = 0;
    uint64_t rounds_failed = 0;
    uint64_t member_bytes = 0;
  };
  Totals totals() const;

 private:
  struct Round;
  using Reply = std::function<void()>;
  // Under mu_: the round of `key` for `spec`, created if new; null with *refusal set when the
  // spec disagrees or the (job, slot) has moved past its quorum.
  Round* FindOrCreateLocked(const RoundKey& key, const RoundSpec& spec, Status* refusal,
                            std::vector<Reply>* out);
  void FailLocked(const RoundKey& key, const Status& why, std::vector<Reply>* out);
  // Under mu_: starts the next step a round is ready for (its partial, its total).
  void AdvanceLocked(const RoundKey& key, std::vector<Reply>* out);
  void SumPartial(const RoundKey& key, const std::shared_ptr<Round>& round);
  void SumTotal(const RoundKey& key, const std::shared_ptr<Round>& round);

  const ExchangeOptions options_;
  const Hooks hooks_;
  mutable std::mutex mu_;
  std::map<RoundKey, std::shared_ptr<Round>> rounds_;
  // The newest quorum seen per (job, slot): older rounds are superseded.
  std::map<std::pair<std::string, uint32_t>, uint32_t> newest_;
  uint64_t bytes_ = 0;
  bool stopped_ = false;  // FailAll was called: no round starts any more
  Totals totals_;
};

}  // namespace lk::gateway
