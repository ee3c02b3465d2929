#include "replica_agent/worker_pool.h"

namespace lk::agent {

WorkerPool::WorkerPool(uint32_t threads, uint32_t queue_max) : queue_max_(queue_max) {
  for (uint32_t i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

WorkerPool::~WorkerPool() { Stop(); }

bool WorkerPool::Submit(Task& task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || queue_.size() >= queue_max_) return false;
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return true;
}

void WorkerPool::Stop() {
  std::deque<Task> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
    left.swap(queue_);
  }
  cv_.notify_all();
  for (auto& t : left) {
    if (t.refuse) t.refuse();
  }
  for (auto& t : threads_) t.join();
  threads_.clear();
}

void WorkerPool::Loop() {
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task.run();
  }
}

}  // namespace lk::agent
