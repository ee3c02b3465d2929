// The agent's state in process, without a lighthouse: what a drain holds is freed once it is
// done; the trainer API's refusals carry reason codes.
#include <doctest/doctest.h>

#include <unistd.h>

#include <memory>

#include "replica_agent/agent_impl.h"

namespace lk::agent {
namespace {

// Found by the agent_socket_routes fuzzer (LeakSanitizer): the wait for the trainers' exit held
// itself through a shared_ptr cycle, so its callback, and the Impl it captures, were never freed
// after a drain.
TEST_CASE("the wait for trainers frees its callback once it has called it") {
  AgentOptions o;
  o.drain_timeout = Millis(40);
  auto impl = std::make_shared<Agent::Impl>(o);
  // A trainer that stays alive (this process) makes the wait poll until drain_timeout.
  Agent::Impl::Trainer& t = impl->trainers[0];
  t.pid = static_cast<int>(::getpid());
  auto marker = std::make_shared<int>(0);
  std::weak_ptr<int> watch = marker;
  bool called = false, all_exited = true;
  impl->WaitForTrainersThen([marker = std::move(marker), &called, &all_exited](bool exited) {
    called = true;
    all_exited = exited;
  });
  impl->ioc.run();
  CHECK(called);
  CHECK(!all_exited);
  CHECK(watch.expired());
}

// Found by the agent_socket_routes fuzzer: the trainer API's conflicts (a commit before any
// quorum, a step not after the committed one) went out as 409 with no reason code.
TEST_CASE("the trainer API's conflicts carry reason codes") {
  auto impl = std::make_shared<Agent::Impl>(AgentOptions{});
  auto call = [&impl](const std::string& path, const std::string& body) {
    http::Request req;
    req.method = "POST";
    req.path = path;
    req.content_type = http::kJsonType;
    req.body = body;
    req.credentials = http::PeerCredentials{static_cast<int>(::getpid()),
                                            static_cast<uint32_t>(::geteuid()),
                                            static_cast<uint32_t>(::getegid())};
    http::Response got;
    impl->TrainerRoute(std::move(req), [&got](http::Response r) { got = std::move(r); });
    return got;
  };
  // The trainer is known to the agent (its hello), but no quorum was issued yet.
  REQUIRE(call("/v1/trainer/hello", R"({"group_rank":0,"group_size":1})").status == 200);
  auto commit = [&impl](uint32_t step) {
    http::Request req;
    req.method = "POST";
    req.path = "/v1/trainer/commit";
    req.content_type = http::kJsonType;
    req.body = fmt::format(R"({{"group_rank":0,"step":{}}})", step);
    req.credentials = http::PeerCredentials{static_cast<int>(::getpid()),
                                            static_cast<uint32_t>(::geteuid()),
                                            static_cast<uint32_t>(::getegid())};
    http::Response got;
    impl->TrainerRoute(std::move(req), [&got](http::Response r) { got = std::move(r); });
    return got;
  };
  http::Response r = commit(1);
  CHECK(r.status == 409);
  CHECK(http::StatusFromErrorBody(r.status, r.body, r.content_type).reason() ==
        Reason::kQuorumNotIssued);
}

}  // namespace
}  // namespace lk::agent
