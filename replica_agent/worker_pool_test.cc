#include "replica_agent/worker_pool.h"

#include <doctest/doctest.h>

#include <atomic>
#include <future>
#include <thread>

namespace lk::agent {
namespace {

TEST_CASE("worker pool: a full queue refuses - Stop answers what is queued and joins the rest") {
  WorkerPool pool(1, 1);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<void> started;
  std::atomic<int> ran{0}, refused{0};
  WorkerPool::Task busy{[&] {
                          started.set_value();
                          released.wait();
                          ++ran;
                        },
                        [&] { ++refused; }};
  REQUIRE(pool.Submit(busy));
  started.get_future().wait();  // the only worker is busy now
  WorkerPool::Task queued{[&] { ++ran; }, [&] { ++refused; }};
  REQUIRE(pool.Submit(queued));
  WorkerPool::Task beyond{[&] { ++ran; }, [&] { ++refused; }};
  CHECK_FALSE(pool.Submit(beyond));  // the caller answers 503 itself
  CHECK(beyond.run != nullptr);      // and still holds its task
  std::thread stopper([&] { pool.Stop(); });
  // Stop refuses the queued task at once, then waits for the running one.
  while (refused.load() == 0) std::this_thread::yield();
  CHECK(ran.load() == 0);
  release.set_value();
  stopper.join();
  CHECK(ran.load() == 1);
  CHECK(refused.load() == 1);
  WorkerPool::Task late{[&] { ++ran; }, nullptr};
  CHECK_FALSE(pool.Submit(late));
}

}  // namespace
}  // namespace lk::agent
