// A bounded pool of worker threads for the agent's calls that wait on the lighthouse on a
// trainer's behalf (rendezvous KV, durable-checkpoint registration): a fixed number of threads
// and a bounded queue, so that a burst of trainer requests cannot start threads without limit,
// and every thread is joined when the agent stops.
// Thread-safety: Submit and Stop from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lk::agent {

class WorkerPool {
 public:
  struct Task {
    std::function<void()> run;
    // Called instead of `run` for a task still queued when the pool stops, so that its
    // requester is answered (503) rather than dropped.
    std::function<void()> refuse;
  };

  WorkerPool(uint32_t threads, uint32_t queue_max);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // False (and the task untouched) when the queue is full or the pool stopped: the caller
  // answers 503 itself.
  bool Submit(Task& task);
  // Refuses what is queued, lets running tasks finish, joins the threads. Idempotent.
  void Stop();
  uint32_t queue_max() const { return queue_max_; }

 private:
  void Loop();

  const uint32_t queue_max_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace lk::agent
