// The agent's drain on its own io_context, without a lighthouse: what a drain holds is freed
// once it is done.
#include <doctest/doctest.h>

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

}  // namespace
}  // namespace lk::agent
