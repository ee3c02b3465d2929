#include "diloco/core.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <tuple>

#include <lightkeeper/check.h>
#include <xxhash.h>

namespace lk::diloco {

size_t TensorSpec::numel() const {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(std::max<int64_t>(d, 0));
  return n;
}

Status ValidateSpecs(const std::vector<TensorSpec>& specs, size_t* total) {
  size_t at = 0;
  std::set<std::string> names;
  for (const TensorSpec& s : specs) {
    if (s.name.empty()) return InvalidArgument("a tensor has no name");
    if (!names.insert(s.name).second) return InvalidArgument("tensor name '{}' repeats", s.name);
    for (int64_t d : s.shape) {
      if (d <= 0) return InvalidArgument("tensor '{}' has a dimension of {}", s.name, d);
    }
    if (s.offset != at) {
      return InvalidArgument(
          "tensor '{}' starts at element {}, not at {} where the one before "
          "ends (tensors must tile the buffer in order)",
          s.name, s.offset, at);
    }
    at += s.numel();
  }
  *total = at;
  return Status::Ok();
}

std::string_view ShardRuleName(ShardRule rule) {
  switch (rule) {
    case ShardRule::kEven:
      return "even";
    case ShardRule::kChunk:
      return "chunk";
  }
  return "unknown";
}

bool ParseShardRule(std::string_view name, ShardRule* out) {
  if (name == "even") {
    *out = ShardRule::kEven;
  } else if (name == "chunk") {
    *out = ShardRule::kChunk;
  } else {
    return false;
  }
  return true;
}

RowRange ShardRows(const TensorSpec& s, uint32_t ranks, uint32_t rank, ShardRule rule) {
  LK_CHECK(ranks > 0 && rank < ranks) << "rank " << rank << " of " << ranks;
  if (s.shape.empty()) return RowRange{0, rank == 0 ? 1 : 0};
  const int64_t rows = s.shape[0];
  if (rule == ShardRule::kChunk) {
    const int64_t per = (rows + ranks - 1) / ranks;
    const int64_t begin = std::min<int64_t>(rows, rank * per);
    return RowRange{begin, std::min<int64_t>(rows, begin + per)};
  }
  const int64_t base = rows / ranks, extra = rows % ranks;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return RowRange{begin, begin + base + (rank < extra ? 1 : 0)};
}

ShardLayout MakeShardLayout(const std::vector<TensorSpec>& specs, uint32_t ranks, uint32_t rank,
                            ShardRule rule) {
  LK_CHECK(ranks > 0 && rank < ranks) << "rank " << rank << " of " << ranks;
  std::vector<RowRange> rows;
  rows.reserve(specs.size());
  for (const TensorSpec& s : specs) rows.push_back(ShardRows(s, ranks, rank, rule));
  return MakeShardLayout(specs, rows);
}

namespace {

int64_t RowsOf(const TensorSpec& s) { return s.shape.empty() ? 1 : s.shape[0]; }

// Per tensor: the trainers that hold rows under a table, as (begin, end, rank) in row order.
using Holders = std::vector<std::tuple<int64_t, int64_t, uint32_t>>;
Holders HoldersOf(const RowTable& table, size_t spec) {
  Holders h;
  for (uint32_t k = 0; k < table.size(); ++k) {
    const RowRange r = table[k][spec];
    if (r.end > r.begin) h.emplace_back(r.begin, r.end, k);
  }
  std::sort(h.begin(), h.end());
  return h;
}

// The trainer holding `row` (the table tiles the tensor, so exactly one does).
uint32_t HolderOfRow(const Holders& h, int64_t row) {
  auto it = std::upper_bound(h.begin(), h.end(), row,
                             [](int64_t r, const auto& x) { return r < std::get<0>(x); });
  LK_CHECK(it != h.begin()) << "row " << row << " held by nobody";
  return std::get<2>(*std::prev(it));
}

// Numbers of a row table travel as 24-bit limbs: each place is written by one trainer only and
// the others add zeros, so every limb is exact in the float sum.
constexpr int64_t kLimb = int64_t{1} << 24;

constexpr char kTilingRule[] =
    "the group's trainers must tile every tensor's rows, each row held once";

}  // namespace

ShardLayout MakeShardLayout(const std::vector<TensorSpec>& specs,
                            const std::vector<RowRange>& rows) {
  LK_CHECK(rows.size() == specs.size())
      << rows.size() << " row ranges for " << specs.size() << " tensors";
  ShardLayout out;
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    const size_t numel = s.numel();
    out.total = std::max(out.total, s.offset + numel);
    const auto [begin, end] = rows[i];
    LK_CHECK(0 <= begin && begin <= end && end <= RowsOf(s))
        << "rows [" << begin << ", " << end << ") of " << s.name;
    if (end <= begin) continue;
    const size_t row_numel = numel / static_cast<size_t>(RowsOf(s));
    ShardPiece p{i,
                 begin,
                 end,
                 s.offset + static_cast<size_t>(begin) * row_numel,
                 out.shard_numel,
                 static_cast<size_t>(end - begin) * row_numel};
    out.shard_numel += p.count;
    out.pieces.push_back(p);
  }
  return out;
}

RowTable RuleTable(const std::vector<TensorSpec>& specs, uint32_t ranks, ShardRule rule) {
  RowTable t(ranks);
  for (uint32_t k = 0; k < ranks; ++k) {
    for (const TensorSpec& s : specs) t[k].push_back(ShardRows(s, ranks, k, rule));
  }
  return t;
}

Status CheckRowsWithin(const std::vector<TensorSpec>& specs, const std::vector<RowRange>& rows) {
  if (rows.size() != specs.size()) {
    return InvalidArgument("{} row ranges for {} tensors (one per tensor, in order)",
                           rows.size(), specs.size());
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    const RowRange r = rows[i];
    if (r.begin < 0 || r.end < r.begin || r.end > RowsOf(specs[i])) {
      return InvalidArgument("tensor '{}': rows [{}, {}) are not rows of its {}", specs[i].name,
                             r.begin, r.end, RowsOf(specs[i]));
    }
  }
  return Status::Ok();
}

Status CheckTiling(const std::vector<TensorSpec>& specs, const RowTable& table) {
  for (uint32_t k = 0; k < table.size(); ++k) {
    LK_RETURN_IF_ERROR(
        CheckRowsWithin(specs, table[k]).WithContext(fmt::format("group rank {}", k)));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    int64_t at = 0;
    uint32_t last = 0;
    for (const auto& [b, e, k] : HoldersOf(table, i)) {
      if (b < at) {
        return InvalidArgument(
            "tensor '{}': rows [{}, {}) of group rank {} overlap rows up to {} of group rank {} "
            "({})",
            specs[i].name, b, e, k, at, last, kTilingRule);
      }
      if (b > at) {
        return InvalidArgument(
            "tensor '{}': rows [{}, {}) are held by no trainer of the group ({})", specs[i].name,
            at, b, kTilingRule);
      }
      at = e;
      last = k;
    }
    if (at < RowsOf(specs[i])) {
      return InvalidArgument("tensor '{}': rows [{}, {}) are held by no trainer of the group ({})",
                             specs[i].name, at, RowsOf(specs[i]), kTilingRule);
    }
  }
  return Status::Ok();
}

std::string_view TableKind(const std::vector<TensorSpec>& specs, const RowTable& table) {
  const auto ranks = static_cast<uint32_t>(table.size());
  if (table == RuleTable(specs, ranks, ShardRule::kEven)) return "even";
  if (table == RuleTable(specs, ranks, ShardRule::kChunk)) return "chunk";
  return "explicit";
}

void EncodeRows(const std::vector<RowRange>& rows, uint32_t rank, std::span<float> out) {
  const size_t base = static_cast<size_t>(rank) * rows.size() * kRowTableFloatsPerRange;
  LK_CHECK(base + rows.size() * kRowTableFloatsPerRange <= out.size())
      << "rank " << rank << " past the table";
  for (size_t i = 0; i < rows.size(); ++i) {
    float* at = out.data() + base + i * kRowTableFloatsPerRange;
    at[0] = static_cast<float>(rows[i].begin % kLimb);
    at[1] = static_cast<float>(rows[i].begin / kLimb);
    at[2] = static_cast<float>(rows[i].end % kLimb);
    at[3] = static_cast<float>(rows[i].end / kLimb);
  }
}

RowTable DecodeRowTable(std::span<const float> summed, uint32_t ranks, size_t specs) {
  LK_CHECK(summed.size() >= ranks * specs * kRowTableFloatsPerRange) << "short table";
  // The sums come from the other trainers: limbs that are not whole numbers in range (a
  // trainer that wrote garbage, or two that wrote one place) decode to -1, which CheckTiling
  // refuses, instead of a float-to-integer conversion out of range.
  auto number = [](float lo, float hi) -> int64_t {
    const auto limb = static_cast<float>(kLimb);
    if (!(lo >= 0.0f && lo < limb && hi >= 0.0f && hi < limb) || lo != std::floor(lo) ||
        hi != std::floor(hi)) {
      return -1;
    }
    return static_cast<int64_t>(lo) + static_cast<int64_t>(hi) * kLimb;
  };
  RowTable t(ranks, std::vector<RowRange>(specs));
  for (uint32_t k = 0; k < ranks; ++k) {
    for (size_t i = 0; i < specs; ++i) {
      const float* at = summed.data() + (k * specs + i) * kRowTableFloatsPerRange;
      t[k][i] = RowRange{number(at[0], at[1]), number(at[2], at[3])};
    }
  }
  return t;
}

RelayoutPlan PlanRelayout(const std::vector<TensorSpec>& specs, uint32_t rank,
                          const RowTable& from, const RowTable& to) {
  LK_CHECK(from.size() == to.size() && rank < from.size())
      << "rank " << rank << " of " << from.size() << " and " << to.size();
  RelayoutPlan plan;
  const ShardLayout from_layout = MakeShardLayout(specs, from[rank]);
  const ShardLayout to_layout = MakeShardLayout(specs, to[rank]);
  plan.from_numel = from_layout.shard_numel;
  plan.to_numel = to_layout.shard_numel;
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    const size_t row_numel = s.numel() / static_cast<size_t>(RowsOf(s));
    const Holders hf = HoldersOf(from, i), ht = HoldersOf(to, i);
    // Every boundary of both layouts: each span between two lies whole in one trainer under
    // each, and every trainer walks the same spans in the same order.
    std::vector<int64_t> cuts = {0, RowsOf(s)};
    for (const Holders* h : {&hf, &ht}) {
      for (const auto& [b, e, k] : *h) {
        cuts.push_back(b);
        cuts.push_back(e);
      }
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    const ShardPiece* mine_from = from_layout.PieceOf(i);
    const ShardPiece* mine_to = to_layout.PieceOf(i);
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      const int64_t a = cuts[c], b = cuts[c + 1];
      const uint32_t src = HolderOfRow(hf, a), dst = HolderOfRow(ht, a);
      const size_t count = static_cast<size_t>(b - a) * row_numel;
      auto at = [&](const ShardPiece* p) {
        return p->shard_offset + static_cast<size_t>(a - p->row_begin) * row_numel;
      };
      if (src == dst) {
        if (src == rank) plan.local.push_back({at(mine_from), at(mine_to), count});
        continue;
      }
      if (src == rank) plan.send.push_back({at(mine_from), plan.moved, count});
      if (dst == rank) plan.receive.push_back({plan.moved, at(mine_to), count});
      plan.moved += count;
    }
  }
  return plan;
}

RelayoutPlan PlanRelayout(const std::vector<TensorSpec>& specs, uint32_t ranks, uint32_t rank,
                          ShardRule from, ShardRule to) {
  return PlanRelayout(specs, rank, RuleTable(specs, ranks, from), RuleTable(specs, ranks, to));
}

const ShardPiece* ShardLayout::PieceOf(size_t spec) const {
  for (const ShardPiece& p : pieces) {
    if (p.spec == spec) return &p;
  }
  return nullptr;
}

void ShardLayout::Take(std::span<const float> full, std::span<float> shard) const {
  LK_CHECK(full.size() == total && shard.size() == shard_numel)
      << "take: full " << full.size() << " of " << total << ", shard " << shard.size() << " of "
      << shard_numel;
  for (const ShardPiece& p : pieces) {
    std::copy_n(full.begin() + p.full_offset, p.count, shard.begin() + p.shard_offset);
  }
}

void ShardLayout::Place(std::span<const float> shard, std::span<float> full) const {
  LK_CHECK(full.size() == total && shard.size() == shard_numel)
      << "place: full " << full.size() << " of " << total << ", shard " << shard.size() << " of "
      << shard_numel;
  for (const ShardPiece& p : pieces) {
    std::copy_n(shard.begin() + p.shard_offset, p.count, full.begin() + p.full_offset);
  }
}

namespace {

// SplitMix64's finalizer: every input bit reaches every output bit.
uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t RowHashSum(const std::vector<TensorSpec>& specs, const ShardLayout& layout,
                    std::span<const float> shard) {
  LK_CHECK(shard.size() == layout.shard_numel)
      << "row hash: shard " << shard.size() << " of " << layout.shard_numel;
  uint64_t sum = 0;
  for (const ShardPiece& p : layout.pieces) {
    const TensorSpec& s = specs[p.spec];
    const uint64_t seed = XXH3_64bits(s.name.data(), s.name.size());
    const size_t rows = static_cast<size_t>(p.row_end - p.row_begin);
    const size_t row_numel = p.count / rows;
    const float* at = shard.data() + p.shard_offset;
    if (row_numel >= kRowHashMinElems) {
      for (size_t r = 0; r < rows; ++r) {
        const uint64_t row = static_cast<uint64_t>(p.row_begin) + r;
        sum += XXH3_64bits_withSeed(at + r * row_numel, row_numel * sizeof(float),
                                    Mix64(seed + row));
      }
    } else {
      // Short rows (a bias, a norm's scale): one hash per element, seeded by its index in the
      // tensor, costs less than a call of XXH3 per row.
      const uint64_t first = static_cast<uint64_t>(p.row_begin) * row_numel;
      for (size_t i = 0; i < p.count; ++i) {
        uint32_t bits;
        std::memcpy(&bits, at + i, sizeof(bits));
        sum += Mix64(Mix64(seed + first + i) ^ bits);
      }
    }
  }
  return sum;
}

PollDecision DecidePoll(const PollView& poll, const LocalView& local) {
  if (poll.drain) {
    if (poll.checkpoint_now && local.has_state && local.can_save) {
      return {PollAction::kDrainSave, "drain with checkpoint_now: save, then leave"};
    }
    if (poll.checkpoint_now) {
      return {PollAction::kDrain, local.has_state ? "drain with checkpoint_now but no checkpoint "
                                                    "directory: leave without saving"
                                                  : "drain before any state: nothing to save"};
    }
    return {PollAction::kDrain, "drain"};
  }
  if (local.drain_noticed) {
    if (local.drain_wait_for > local.stuck_timeout) {
      return {PollAction::kGiveUp, fmt::format("a drain notice was not followed by a drain in "
                                               "the poll for {} ms",
                                               local.drain_wait_for.count())};
    }
    return {PollAction::kWaitForDrain, "drain noticed: wait for the agent's answer", Millis(50)};
  }
  if (local.bad_quorum_id != 0 && poll.quorum_id == local.bad_quorum_id) {
    if (local.bad_for > local.stuck_timeout) {
      return {PollAction::kGiveUp, fmt::format("no new quorum {} ms after quorum {} failed",
                                               local.bad_for.count(), local.bad_quorum_id)};
    }
    return {PollAction::kWaitNewQuorum, "this quorum failed: wait for the next one",
            Millis(100)};
  }
  if (poll.quorum_id != local.ready_quorum_id) {
    return {PollAction::kJoin,
            fmt::format("new quorum {} (joined: {})", poll.quorum_id, local.ready_quorum_id)};
  }
  return {PollAction::kStep, "joined quorum"};
}

PollDecision OnPoll(ProtocolState& s, const PollView& poll, bool drain_noticed, bool has_state,
                    TimePoint now) {
  if (drain_noticed && !poll.drain && !s.drain_wait_since) s.drain_wait_since = now;
  LocalView local;
  local.ready_quorum_id = s.ready_quorum_id;
  local.bad_quorum_id = s.bad_quorum_id;
  local.bad_for = std::chrono::duration_cast<Millis>(now - s.bad_since);
  local.drain_noticed = drain_noticed;
  local.drain_wait_for = s.drain_wait_since
                             ? std::chrono::duration_cast<Millis>(now - *s.drain_wait_since)
                             : Millis(0);
  local.has_state = has_state;
  local.can_save = s.can_save;
  local.stuck_timeout = s.stuck_timeout;
  return DecidePoll(poll, local);
}

void OnJoined(ProtocolState& s, uint32_t quorum_id) { s.ready_quorum_id = quorum_id; }

void OnAttemptFailed(ProtocolState& s, Code code) { s.conflict_seen |= code == Code::kConflict; }

// Without the backoff a misconfigured job forms and fails a quorum about twenty times a second,
// each a new quorum id, a communicator rebuild and a warning in every trainer, for as long as
// nobody looks. Backing off lets the lighthouse and the logs rest, and lets groups that agree
// form a quorum without the one that backs off when --min-replicas allows.
QuorumFailedDecision OnQuorumFailed(ProtocolState& s, uint32_t quorum_id, bool want_report,
                                    TimePoint now) {
  QuorumFailedDecision d;
  s.bad_quorum_id = quorum_id;
  s.bad_since = now;
  d.report = want_report && OnReport(s, quorum_id);
  if (s.conflict_seen) {
    s.conflict_seen = false;
    const uint32_t doublings = std::min<uint32_t>(s.conflict_streak, 16);
    ++s.conflict_streak;
    d.backoff = std::min(kConflictBackoffMax, kConflictBackoffMin * (int64_t{1} << doublings));
    d.conflict_attempts = s.conflict_streak;
  }
  return d;
}

bool OnReport(ProtocolState& s, uint32_t quorum_id) {
  if (s.reported_quorum_id == quorum_id) return false;
  s.reported_quorum_id = quorum_id;
  return true;
}

void OnCommitted(ProtocolState& s) { s.conflict_streak = 0; }

void OnLandingAgreed(ProtocolState& s, bool drain) { s.drain_agreed = drain; }

bool OnJoinAnswer(ProtocolState& s, uint32_t quorum_id, bool heals,
                  std::optional<uint32_t> earlier_heal_quorum_id) {
  const bool take = !heals && earlier_heal_quorum_id == quorum_id &&
                    s.heal_seen_quorum_id != quorum_id;
  if (heals || take) s.heal_seen_quorum_id = quorum_id;
  return take;
}

bool ReportJoinBeforeAgreement(bool join_ok, uint32_t group_size, bool drain_noticed,
                               uint32_t lost_quorum_id, uint32_t quorum_id) {
  return !join_ok && group_size > 1 && !drain_noticed && lost_quorum_id < quorum_id;
}

bool PollNextOnThread(const ProtocolState& s, bool landed, bool joined_unstepped) {
  return landed && !joined_unstepped && !s.drain_agreed;
}

PollDecision JoinedUnsteppedDecision() { return {PollAction::kStep, "joined in the last call"}; }

std::vector<HealSource> PlanHeal(bool heal, bool initial, const std::vector<std::string>& peers,
                                 uint32_t max_step, const std::string& restore_location) {
  std::vector<HealSource> out;
  if (!heal) return out;
  if (!peers.empty() && !initial) {
    out.push_back(HealSource{HealSourceKind::kPeers, peers, max_step, ""});
  }
  if (!restore_location.empty()) {
    out.push_back(HealSource{HealSourceKind::kDurable, {}, 0, restore_location});
  }
  return out;
}

InnerAction DecideInner(bool received, uint32_t restored_inner, uint32_t group_size) {
  if (!received) return InnerAction::kKeep;
  return restored_inner == group_size ? InnerAction::kRestored : InnerAction::kReset;
}

bool SaveAfterCommit(uint32_t step, uint32_t ckpt_every) {
  return ckpt_every > 0 && step % ckpt_every == 0;
}

bool SaveAtFinish(bool can_save, bool has_state, uint32_t step, uint32_t ckpt_every) {
  return can_save && has_state && !SaveAfterCommit(step, ckpt_every);
}

Millis EffectiveStuckTimeout(Millis stuck_timeout, Millis op_timeout) {
  return stuck_timeout.count() > 0 ? stuck_timeout : op_timeout + Millis(60'000);
}

}  // namespace lk::diloco
