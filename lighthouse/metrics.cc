#include "lighthouse/metrics.h"

#include <fmt/format.h>

namespace lk::lighthouse {
namespace {

// Label values are escaped as the exposition format asks.
std::string Esc(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

}  // namespace

void Metrics::CountRequest(const std::string& endpoint, int code) {
  ++requests_[{endpoint, code}];
}

void Metrics::ObserveFormation(Duration d) {
  double s = std::chrono::duration<double>(d).count();
  for (size_t i = 0; i < kBucketsS.size(); ++i) {
    if (s <= kBucketsS[i]) ++buckets_[i];
  }
  ++formation_count_;
  formation_sum_s_ += s;
}

void Metrics::CountQuorum(const std::string& job, bool changed) {
  if (changed) ++quorums_issued_[job];
}

void Metrics::CountDivergence(const std::string& job) { ++divergences_[job]; }

void Metrics::ForgetJob(const std::string& job) {
  quorums_issued_.erase(job);
  divergences_.erase(job);
}

std::string Metrics::Render(const std::vector<JobView>& jobs, double uptime_s,
                            uint64_t connections) const {
  std::string o;
  auto out = std::back_inserter(o);
  fmt::format_to(out, "# HELP lk_uptime_seconds Seconds since the lighthouse started.\n"
                      "# TYPE lk_uptime_seconds gauge\nlk_uptime_seconds {:.3f}\n", uptime_s);
  fmt::format_to(out, "# HELP lk_http_connections Open HTTP connections.\n"
                      "# TYPE lk_http_connections gauge\nlk_http_connections {}\n", connections);
  o += "# HELP lk_requests_total Requests by endpoint and HTTP status code.\n"
       "# TYPE lk_requests_total counter\n";
  for (const auto& [k, v] : requests_) {
    fmt::format_to(out, "lk_requests_total{{endpoint=\"{}\",code=\"{}\"}} {}\n", Esc(k.first),
                   k.second, v);
  }
  o += "# HELP lk_quorum_formation_seconds Time from a round's first ask to the quorum issued.\n"
       "# TYPE lk_quorum_formation_seconds histogram\n";
  for (size_t i = 0; i < kBucketsS.size(); ++i) {
    fmt::format_to(out, "lk_quorum_formation_seconds_bucket{{le=\"{}\"}} {}\n", kBucketsS[i],
                   buckets_[i]);
  }
  fmt::format_to(out, "lk_quorum_formation_seconds_bucket{{le=\"+Inf\"}} {}\n", formation_count_);
  fmt::format_to(out, "lk_quorum_formation_seconds_sum {:.6f}\n", formation_sum_s_);
  fmt::format_to(out, "lk_quorum_formation_seconds_count {}\n", formation_count_);
  o += "# HELP lk_quorum_changes_total Quorums issued with a new membership, per job.\n"
       "# TYPE lk_quorum_changes_total counter\n";
  for (const auto& j : jobs) {
    fmt::format_to(out, "lk_quorum_changes_total{{job=\"{}\"}} {}\n", Esc(j.job), j.quorum_changes);
  }
  o += "# HELP lk_quorum_id Current quorum id per job.\n# TYPE lk_quorum_id gauge\n";
  for (const auto& j : jobs) {
    fmt::format_to(out, "lk_quorum_id{{job=\"{}\"}} {}\n", Esc(j.job), j.quorum_id);
  }
  o += "# HELP lk_quorum_members Groups in the current quorum per job.\n"
       "# TYPE lk_quorum_members gauge\n";
  for (const auto& j : jobs) {
    fmt::format_to(out, "lk_quorum_members{{job=\"{}\"}} {}\n", Esc(j.job), j.members.size());
  }
  o += "# HELP lk_committed_step Highest committed outer step per job.\n"
       "# TYPE lk_committed_step gauge\n";
  for (const auto& j : jobs) {
    fmt::format_to(out, "lk_committed_step{{job=\"{}\"}} {}\n", Esc(j.job), j.committed_step);
  }
  o += "# HELP lk_groups Tracked groups per job and state.\n# TYPE lk_groups gauge\n";
  for (const auto& j : jobs) {
    std::map<std::string, int> by_state;
    for (const auto& g : j.groups) ++by_state[g.state];
    for (const auto& [state, n] : by_state) {
      fmt::format_to(out, "lk_groups{{job=\"{}\",state=\"{}\"}} {}\n", Esc(j.job), Esc(state), n);
    }
  }
  o += "# HELP lk_heartbeat_age_seconds Age of the oldest agent heartbeat per group.\n"
       "# TYPE lk_heartbeat_age_seconds gauge\n";
  for (const auto& j : jobs) {
    for (const auto& g : j.groups) {
      fmt::format_to(out, "lk_heartbeat_age_seconds{{job=\"{}\",group=\"{}\"}} {:.3f}\n",
                     Esc(j.job), Esc(g.group_id), g.heartbeat_age.count() / 1000.0);
    }
  }
  o += "# HELP lk_group_diverged 1 when a group's state hash differs from the other members'.\n"
       "# TYPE lk_group_diverged gauge\n";
  for (const auto& j : jobs) {
    for (const auto& g : j.groups) {
      fmt::format_to(out, "lk_group_diverged{{job=\"{}\",group=\"{}\"}} {}\n", Esc(j.job),
                     Esc(g.group_id), g.diverged ? 1 : 0);
    }
  }
  o += "# HELP lk_group_tokens_total Tokens (samples) a group processed in the outer steps it "
       "committed.\n# TYPE lk_group_tokens_total counter\n";
  for (const auto& j : jobs) {
    for (const auto& g : j.groups) {
      if (g.tokens_step == 0) continue;
      fmt::format_to(out, "lk_group_tokens_total{{job=\"{}\",group=\"{}\"}} {}\n", Esc(j.job),
                     Esc(g.group_id), g.tokens_total);
    }
  }
  o += "# HELP lk_group_token_share A group's share of the tokens of its last committed step.\n"
       "# TYPE lk_group_token_share gauge\n";
  for (const auto& j : jobs) {
    for (const auto& g : j.groups) {
      if (g.tokens_step == 0) continue;
      fmt::format_to(out, "lk_group_token_share{{job=\"{}\",group=\"{}\"}} {:.6f}\n", Esc(j.job),
                     Esc(g.group_id), g.share);
    }
  }
  o += "# HELP lk_divergences_total Times a group's committed state hash was found off its "
       "quorum's reference state (the majority; on a tie, the lowest replica_rank's).\n"
       "# TYPE lk_divergences_total counter\n";
  for (const auto& [job, n] : divergences_) {
    fmt::format_to(out, "lk_divergences_total{{job=\"{}\"}} {}\n", Esc(job), n);
  }
  return o;
}

}  // namespace lk::lighthouse
