// The exchange's rounds without sockets: three sites' Exchanges wired to each other in process
// (a dial is the dialed site's FromPeer, its answer the dialer's OnPeerAnswer), each round's
// total checked against the sum in the documented order, bit for bit, and every refusal and
// failure of a round answered to everyone waiting on it.
#include "gateway/exchange.h"

#include <doctest/doctest.h>

#include <cstring>
#include <deque>
#include <optional>

#include "comm/compress.h"
#include "common/http/codec.h"

namespace lk::gateway {
namespace {

using Sites = std::vector<std::string>;

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

std::vector<float> Floats(const http::Response& r) {
  const std::string& b = r.body_tail ? *r.body_tail : r.body;
  std::vector<float> v(b.size() / sizeof(float));
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

std::string SitesParam(const Sites& sites) {
  std::string s;
  for (const auto& x : sites) s += (s.empty() ? "" : ",") + x;
  return s;
}

http::Request Contribution(const Sites& sites, uint32_t rank, const std::vector<float>& v,
                           uint32_t quorum = 1, uint32_t seq = 0,
                           const std::string& codec = "") {
  http::Request r;
  r.method = "POST";
  r.path = "/v1/exchange";
  r.query = {{"job", "j"},         {"slot", "0"},
             {"quorum", std::to_string(quorum)},
             {"seq", std::to_string(seq)},
             {"chunk", "0"},       {"chunks", "1"},
             {"rank", std::to_string(rank)},
             {"world", std::to_string(sites.size())},
             {"sites", SitesParam(sites)},
             {"timeout_ms", "60000"}};
  if (!codec.empty()) r.query["codec"] = codec;
  r.body = Bytes(v);
  return r;
}

// Sites in one process. Tasks queue up and run when the test says (Drain), so that the test
// decides the interleaving; dials go to every other site, as a fully dialed mesh would.
struct World {
  std::map<std::string, std::unique_ptr<Exchange>> sites;
  std::deque<std::function<void()>> tasks;
  std::map<std::string, std::string> down;  // site -> why its dials fail
  int dials = 0;

  explicit World(const Sites& names) {
    for (const std::string& name : names) {
      ExchangeOptions o;
      o.site = name;
      o.bytes_max = 1 << 20;
      sites[name] = std::make_unique<Exchange>(
          o, Exchange::Hooks{[this](std::function<void()> t) {
                               tasks.push_back(std::move(t));
                               return true;
                             },
                             [this, name](const RoundKey& key, const RoundSpec& spec,
                                          std::shared_ptr<const std::string> partial) {
                               Dial(name, key, spec, partial);
                             }});
    }
  }

  // Only sites whose name sorts after the dialer's are dialed: one way per pair, as the
  // gateways are configured (one side's --wan-connect names the other).
  void Dial(const std::string& from, const RoundKey& key, const RoundSpec& spec,
            std::shared_ptr<const std::string> partial) {
    for (auto& [name, ex] : sites) {
      if (name <= from) continue;
      ++dials;
      http::Request r;
      r.method = "POST";
      r.path = "/v1/wan/exchange";
      r.query = {{"job", key.job},
                 {"slot", std::to_string(key.slot)},
                 {"quorum", std::to_string(key.quorum)},
                 {"seq", std::to_string(key.seq)},
                 {"chunk", std::to_string(key.chunk)},
                 {"chunks", std::to_string(spec.chunks)},
                 {"world", std::to_string(spec.world)},
                 {"sites", SitesParam(spec.sites)},
                 {"timeout_ms", "60000"},
                 {"codec", std::string(comm::CodecName(spec.codec))},
                 {"count", std::to_string(spec.count)},
                 {"from", from}};
      r.body = *partial;
      Exchange* dialer = sites.at(from).get();
      if (down.count(name)) {
        tasks.push_back([dialer, key, why = down.at(name)] {
          dialer->OnPeerAnswer(key, Status(Code::kUnavailable, why));
        });
        continue;
      }
      tasks.push_back([dialer, key, target = ex.get(), r] {
        target->FromPeer(r, [dialer, key](http::Response resp) {
          std::string site;
          for (auto& [k, v] : resp.headers) {
            if (k == "Lk-Site") site = v;
          }
          if (resp.status != 200) {
            dialer->OnPeerAnswer(key, http::StatusFromErrorBody(resp.status, resp.body,
                                                                resp.content_type));
          } else {
            dialer->OnPeerAnswer(key, std::make_pair(site, *resp.body_tail));
          }
        });
      });
    }
  }

  void Drain() {
    while (!tasks.empty()) {
      auto t = std::move(tasks.front());
      tasks.pop_front();
      t();
    }
  }
};

struct Waiter {
  std::optional<http::Response> response;
  http::Responder responder() {
    return [this](http::Response r) {
      CHECK_FALSE(response.has_value());  // answered once
      response = std::move(r);
    };
  }
};

TEST_CASE("exchange: five members at three sites get one total, the site partials added in "
          "site-name order, bit for bit") {
  const Sites sites = {"b", "a", "c", "b", "a"};  // rank -> site
  World w({"a", "b", "c"});
  // Values whose float32 sums depend on the order of the additions.
  std::vector<std::vector<float>> v = {{1e8f, 1.0f, 0.1f},
                                       {-1e8f, 3.0f, 0.2f},
                                       {1.0f, 1e-8f, 0.3f},
                                       {0.5f, -1.0f, 1e7f},
                                       {0.25f, 7.0f, -1e7f}};
  std::vector<Waiter> members(sites.size());
  for (uint32_t r = 0; r < sites.size(); ++r) {
    w.sites.at(sites[r])->Contribute(Contribution(sites, r, v[r]), members[r].responder());
    w.Drain();
  }
  // The documented order: each site's members in rank order, then the sites by name.
  auto site_sum = [&](const std::string& s) {
    std::optional<std::vector<float>> acc;
    for (uint32_t r = 0; r < sites.size(); ++r) {
      if (sites[r] != s) continue;
      if (!acc) {
        acc = v[r];
      } else {
        for (size_t i = 0; i < 3; ++i) (*acc)[i] += v[r][i];
      }
    }
    return *acc;
  };
  std::vector<float> expect = site_sum("a");
  for (const char* s : {"b", "c"}) {
    auto p = site_sum(s);
    for (size_t i = 0; i < 3; ++i) expect[i] += p[i];
  }
  for (uint32_t r = 0; r < sites.size(); ++r) {
    REQUIRE(members[r].response.has_value());
    CHECK(members[r].response->status == 200);
    auto got = Floats(*members[r].response);
    REQUIRE(got.size() == 3);
    CHECK(std::memcmp(got.data(), expect.data(), sizeof(float) * 3) == 0);
  }
  // One swap per pair of sites: a dials b and c, b dials c.
  CHECK(w.dials == 3);
  for (auto& [name, ex] : w.sites) {
    CHECK(ex->rounds() == 0);
    CHECK(ex->bytes_held() == 0);
  }
}

TEST_CASE("exchange: with a codec the partials cross encoded, and every gateway adds them as "
          "decoded, its own too: one total everywhere") {
  const Sites sites = {"a", "b", "a", "b"};
  for (const char* name : {"bf16", "int8", "int4"}) {
    comm::Codec codec;
    REQUIRE(comm::ParseCodec(name, &codec));
    World w({"a", "b"});
    const size_t n = 300;  // more than two blocks of 128, the last one short
    std::vector<std::vector<float>> v(sites.size(), std::vector<float>(n));
    for (size_t r = 0; r < sites.size(); ++r) {
      for (size_t i = 0; i < n; ++i) v[r][i] = std::sin(0.37f * (i + 1) * (r + 2)) * (1 + r);
    }
    std::vector<Waiter> members(sites.size());
    for (uint32_t r = 0; r < sites.size(); ++r) {
      w.sites.at(sites[r])->Contribute(Contribution(sites, r, v[r], 1, 0, name),
                                       members[r].responder());
    }
    w.Drain();
    auto site_partial = [&](uint32_t r0, uint32_t r1) {
      std::vector<float> p = v[r0];
      for (size_t i = 0; i < n; ++i) p[i] += v[r1][i];
      std::vector<uint8_t> wire(comm::EncodedBytes(codec, n));
      comm::Encode(codec, p, wire);
      comm::Decode(codec, wire, p);
      return p;
    };
    std::vector<float> expect = site_partial(0, 2);
    const std::vector<float> b = site_partial(1, 3);
    for (size_t i = 0; i < n; ++i) expect[i] += b[i];
    INFO(name);
    for (auto& m : members) {
      REQUIRE(m.response.has_value());
      REQUIRE(m.response->status == 200);
      auto got = Floats(*m.response);
      REQUIRE(got.size() == n);
      CHECK(std::memcmp(got.data(), expect.data(), n * sizeof(float)) == 0);
    }
  }
  // A codec the gateway does not know, or a WAN body that is not the codec's size, is refused.
  World w({"a", "b"});
  Waiter bad;
  w.sites.at("a")->Contribute(Contribution(sites, 0, {1.0f}, 1, 0, "zip"), bad.responder());
  REQUIRE(bad.response.has_value());
  CHECK(bad.response->status == 400);
}

TEST_CASE("exchange: a site whose members are all in waits for the others; a late site's "
          "partial finishes the round on both sides") {
  const Sites sites = {"a", "b"};
  World w({"a", "b"});
  Waiter m0, m1;
  w.sites.at("b")->Contribute(Contribution(sites, 1, {2.0f}), m1.responder());
  w.Drain();
  CHECK_FALSE(m1.response.has_value());  // b's partial waits for a's dial
  CHECK(w.sites.at("b")->rounds() == 1);
  w.sites.at("a")->Contribute(Contribution(sites, 0, {1.0f}), m0.responder());
  w.Drain();
  REQUIRE(m0.response.has_value());
  REQUIRE(m1.response.has_value());
  CHECK(Floats(*m0.response) == std::vector<float>{3.0f});
  CHECK(Floats(*m1.response) == std::vector<float>{3.0f});
}

TEST_CASE("exchange: refusals name their reason and fail the round for everyone waiting") {
  const Sites sites = {"a", "a", "b"};
  World w({"a", "b"});
  Waiter first, twice, elsewhere, bad;
  w.sites.at("a")->Contribute(Contribution(sites, 2, {1.0f}), elsewhere.responder());
  REQUIRE(elsewhere.response.has_value());
  CHECK(elsewhere.response->status == 409);
  CHECK(elsewhere.response->body.find("ROUND_MISMATCH") != std::string::npos);
  CHECK(w.sites.at("a")->rounds() == 0);  // nothing was taken

  http::Request garbage = Contribution(sites, 0, {1.0f});
  garbage.body = "abc";  // no whole float
  w.sites.at("a")->Contribute(garbage, bad.responder());
  REQUIRE(bad.response.has_value());
  CHECK(bad.response->status == 400);
  CHECK(bad.response->body.find("BAD_REQUEST") != std::string::npos);
  for (auto [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"world", "0"}, {"world", "2"}, {"sites", "a,,b"}, {"rank", "3"}, {"chunk", "1"},
           {"timeout_ms", ""}, {"job", "a/b"}, {"quorum", "-1"}}) {
    Waiter w2;
    http::Request r = Contribution(sites, 0, {1.0f});
    r.query[key] = value;
    w.sites.at("a")->Contribute(r, w2.responder());
    INFO(key << "=" << value);
    REQUIRE(w2.response.has_value());
    CHECK(w2.response->status == 400);
  }
  CHECK(w.sites.at("a")->rounds() == 0);

  // The same member twice fails the round: its first request is answered too.
  w.sites.at("a")->Contribute(Contribution(sites, 0, {1.0f}), first.responder());
  w.sites.at("a")->Contribute(Contribution(sites, 0, {1.0f}), twice.responder());
  REQUIRE(first.response.has_value());
  REQUIRE(twice.response.has_value());
  CHECK(first.response->body.find("ROUND_MISMATCH") != std::string::npos);
  CHECK(twice.response->status == 409);
  CHECK(w.sites.at("a")->rounds() == 0);
  CHECK(w.sites.at("a")->bytes_held() == 0);

  // A contribution of another size than the round's fails it the same way.
  Waiter x, y;
  w.sites.at("a")->Contribute(Contribution(sites, 0, {1.0f}), x.responder());
  w.sites.at("a")->Contribute(Contribution(sites, 1, {1.0f, 2.0f}), y.responder());
  REQUIRE(x.response.has_value());
  CHECK(x.response->status == 409);
  CHECK(w.sites.at("a")->rounds() == 0);
}

TEST_CASE("exchange: a gateway outside the round answers NOT_IN_ROUND with its site, and the "
          "round goes on without it") {
  const Sites sites = {"a", "c"};
  World w({"a", "b", "c"});  // a dials b (not in the round) and c
  Waiter m0, m1;
  w.sites.at("c")->Contribute(Contribution(sites, 1, {5.0f}), m1.responder());
  w.sites.at("a")->Contribute(Contribution(sites, 0, {1.0f}), m0.responder());
  w.Drain();
  REQUIRE(m0.response.has_value());
  REQUIRE(m1.response.has_value());
  CHECK(Floats(*m0.response) == std::vector<float>{6.0f});
  CHECK(w.sites.at("b")->rounds() == 0);
}

TEST_CASE("exchange: a dial that fails, a deadline and a newer quorum each fail the round for "
          "everyone waiting on it") {
  const Sites sites = {"a", "b"};
  SUBCASE("the other site's gateway is down") {
    World w({"a", "b"});
    w.down["b"] = "connection refused";
    Waiter m0;
    w.sites.at("a")->Contribute(Contribution(sites, 0, {1.0f}), m0.responder());
    w.Drain();
    REQUIRE(m0.response.has_value());
    CHECK(m0.response->status == 503);
    CHECK(w.sites.at("a")->rounds() == 0);
  }
  SUBCASE("the deadline passes with a member missing") {
    World w({"a", "b"});
    Waiter m1;
    w.sites.at("b")->Contribute(Contribution(sites, 1, {1.0f}), m1.responder());
    w.Drain();
    w.sites.at("b")->Sweep(std::chrono::steady_clock::now() + std::chrono::seconds(30));
    CHECK_FALSE(m1.response.has_value());
    w.sites.at("b")->Sweep(std::chrono::steady_clock::now() + std::chrono::seconds(61));
    REQUIRE(m1.response.has_value());
    CHECK(m1.response->status == 504);
    CHECK(m1.response->body.find("ROUND_FAILED") != std::string::npos);
  }
  SUBCASE("a newer quorum supersedes the rounds of the older one, and the older one is "
          "refused from then on") {
    World w({"a", "b"});
    Waiter old_round, new_round, late;
    w.sites.at("b")->Contribute(Contribution(sites, 1, {1.0f}, 1), old_round.responder());
    w.sites.at("b")->Contribute(Contribution(sites, 1, {1.0f}, 2), new_round.responder());
    REQUIRE(old_round.response.has_value());
    CHECK(old_round.response->status == 409);
    CHECK(old_round.response->body.find("ROUND_FAILED") != std::string::npos);
    CHECK_FALSE(new_round.response.has_value());
    w.sites.at("b")->Contribute(Contribution(sites, 1, {1.0f}, 1, 3), late.responder());
    REQUIRE(late.response.has_value());
    CHECK(late.response->status == 409);
    w.sites.at("b")->FailAll(Status(Code::kUnavailable, "stopping", Reason::kShuttingDown));
    REQUIRE(new_round.response.has_value());
    CHECK(new_round.response->status == 503);
  }
}

TEST_CASE("exchange: contributions beyond the byte bound are refused BUFFER_BUDGET") {
  ExchangeOptions o;
  o.site = "a";
  o.bytes_max = 4096 + 16;  // one round's overhead and 16 bytes
  Exchange ex(o, Exchange::Hooks{[](std::function<void()>) { return true; },
                                 [](const RoundKey&, const RoundSpec&,
                                    std::shared_ptr<const std::string>) {}});
  Waiter a, b;
  ex.Contribute(Contribution({"a", "a", "b"}, 0, {1, 2, 3}), a.responder());
  CHECK_FALSE(a.response.has_value());
  ex.Contribute(Contribution({"a", "a", "b"}, 1, {1, 2, 3}), b.responder());
  REQUIRE(b.response.has_value());
  CHECK(b.response->status == 503);
  CHECK(b.response->body.find("BUFFER_BUDGET") != std::string::npos);
  // Many tiny rounds: each is charged its overhead, so the bound holds their count too.
  o.bytes_max = 3 * 4096 + 100;
  Exchange tiny(o, Exchange::Hooks{[](std::function<void()>) { return true; },
                                   [](const RoundKey&, const RoundSpec&,
                                      std::shared_ptr<const std::string>) {}});
  std::vector<Waiter> waiters(4);
  for (uint32_t seq = 0; seq < 4; ++seq) {
    tiny.Contribute(Contribution({"a", "b"}, 0, {1.0f}, 1, seq), waiters[seq].responder());
  }
  CHECK(tiny.rounds() == 3);
  REQUIRE(waiters[3].response.has_value());
  CHECK(waiters[3].response->status == 503);
}

}  // namespace
}  // namespace lk::gateway
