// Prometheus text exposition of the lighthouse: request counts by endpoint and code, the quorum
// formation latency histogram, and per-job gauges computed from the core's view on each scrape.
// Thread-safety: none; used from the service strand.
#pragma once

#include <array>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <lightkeeper/clock.h>
#include "lighthouse/lighthouse_core.h"

namespace lk::lighthouse {

class Metrics {
 public:
  void CountRequest(const std::string& endpoint, int code);
  void ObserveFormation(Duration d);
  void CountQuorum(const std::string& job, bool changed);
  void CountDivergence(const std::string& job);
  // Drops the job's series (a forgotten job leaves no labels behind).
  void ForgetJob(const std::string& job);
  std::string Render(const std::vector<JobView>& jobs, double uptime_s, uint64_t connections) const;

 private:
  static constexpr std::array<double, 14> kBucketsS = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30};
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  std::array<uint64_t, kBucketsS.size()> buckets_{};
  uint64_t formation_count_ = 0;
  double formation_sum_s_ = 0;
  std::map<std::string, uint64_t> quorums_issued_;
  std::map<std::string, uint64_t> divergences_;
};

}  // namespace lk::lighthouse
