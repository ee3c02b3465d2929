// The exchange of groups of different sizes (diloco/mixed.h): the plan covers every element
// once with one holder per group, tiles each trainer's shard, and spreads the owners; and the
// allreduce of runs it drives (CommManager::AllReduceRuns), on real Gloo communicators with the
// members as threads over loopback, gives every holder of an element the same bits: the float32
// sum in replica_rank order exactly, and with a codec the owner's decode-sum-encode.
#include "diloco/mixed.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <future>
#include <map>

#include "comm/compress.h"
#include "diloco/fragments.h"
#include "comm/rendezvous_store.h"
#include "comm/runs.h"
#include "comm/test_support.h"

namespace lk::diloco {
namespace {

// Tensors of awkward shapes: rows not divisible by 2 or 3, fewer rows than trainers, a scalar,
// and one large enough to be cut into several runs.
std::vector<TensorSpec> Specs() {
  std::vector<TensorSpec> specs;
  size_t at = 0;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    TensorSpec s{std::move(name), at, std::move(shape)};
    at += s.numel();
    specs.push_back(std::move(s));
  };
  add("embed", {7, 5});
  add("scale", {});
  add("tiny", {2, 3});
  add("big", {3, 100'000});
  add("bias", {11});
  return specs;
}

size_t Total(const std::vector<TensorSpec>& specs) {
  size_t total = 0;
  REQUIRE(ValidateSpecs(specs, &total).ok());
  return total;
}

TEST_CASE("the mixed plan covers every element once, one holder per group, and tiles shards") {
  const auto specs = Specs();
  const size_t total = Total(specs);
  for (std::vector<uint32_t> sizes :
       {std::vector<uint32_t>{1, 2, 3}, {3, 1}, {2, 2, 4}, {4, 1, 3, 2}}) {
    CAPTURE(fmt::format("{}", fmt::join(sizes, ",")));
    MixedPlan p0 = PlanMixed(specs, sizes, 0, 0);
    CHECK(MixedGroupSizes(sizes) == (sizes != std::vector<uint32_t>{2, 2}));
    // The fragments tile [0, total) in order.
    size_t next = 0;
    for (const auto& f : p0.all) {
      CHECK(f.full_begin == next);
      CHECK(f.full_end > f.full_begin);
      CHECK(f.full_end - f.full_begin <= kMaxRunElems);
      CHECK(f.holders.size() == sizes.size());
      CHECK(std::find(f.holders.begin(), f.holders.end(), f.owner) != f.holders.end());
      next = f.full_end;
    }
    CHECK(next == total);
    std::vector<size_t> owned(p0.mesh_world, 0);
    for (const auto& f : p0.all) owned[f.owner] += f.full_end - f.full_begin;
    for (uint32_t q = 0; q < sizes.size(); ++q) {
      for (uint32_t r = 0; r < sizes[q]; ++r) {
        MixedPlan p = PlanMixed(specs, sizes, q, r);
        CHECK(p.mesh_rank == p0.group_base[q] + r);
        CHECK(p.mesh_world == p0.mesh_world);
        CHECK(p.all.size() == p0.all.size());  // every member plans the same fragments
        // Its runs tile its shard, and each is where its layout keeps those elements.
        ShardLayout layout = MakeShardLayout(specs, sizes[q], r);
        std::vector<float> full(total), shard(layout.shard_numel);
        for (size_t i = 0; i < total; ++i) full[i] = static_cast<float>(i);
        layout.Take(full, shard);
        size_t covered = 0, k = 0;
        for (const auto& f : p.all) {
          const bool mine = f.holders[q] == p.mesh_rank;
          if (!mine) continue;
          REQUIRE(k < p.runs.size());
          const comm::ReduceRun& run = p.runs[k++];
          CHECK(run.count == f.full_end - f.full_begin);
          CHECK(run.owner == f.owner);
          CHECK(run.holders == f.holders);
          CHECK(shard[run.offset] == static_cast<float>(f.full_begin));
          CHECK(shard[run.offset + run.count - 1] == static_cast<float>(f.full_end - 1));
          covered += run.count;
        }
        CHECK(k == p.runs.size());
        CHECK(covered == layout.shard_numel);
        CHECK(comm::ValidateRuns(p.runs, layout.shard_numel, p.mesh_rank, p.mesh_world).ok());
      }
    }
  }
}

TEST_CASE("owners spread: no trainer owns more than a run's worth above the least loaded holder") {
  const auto specs = Specs();
  MixedPlan p = PlanMixed(specs, std::vector<uint32_t>{1, 2, 3}, 0, 0);
  std::vector<size_t> owned(p.mesh_world, 0);
  for (const auto& f : p.all) owned[f.owner] += f.full_end - f.full_begin;
  // The trainer of the group of one holds everything; the others share what it does not own.
  size_t most = *std::max_element(owned.begin(), owned.end());
  CHECK(most <= Total(specs) / 2 + kMaxRunElems);
  for (size_t o : owned) CHECK(o > 0);
}

TEST_CASE("a group's state is a step only when all its trainers hold that step") {
  CHECK(GroupState(std::vector<MemberState>{{true, 4}, {true, 4}}).has_state);
  CHECK(GroupState(std::vector<MemberState>{{true, 4}, {true, 4}}).step == 4);
  CHECK_FALSE(GroupState(std::vector<MemberState>{{true, 4}, {false, 0}}).has_state);
  CHECK_FALSE(GroupState(std::vector<MemberState>{{true, 4}, {true, 3}}).has_state);
  CHECK(GroupState(std::vector<MemberState>{{true, 0}, {true, 0, true}}).fresh);
  CHECK_FALSE(GroupState(std::vector<MemberState>{{true, 0}, {true, 0}}).fresh);
}

// Group q's whole model: different in every group, many magnitudes and signs, exact zeros.
std::vector<float> GroupModel(size_t q, size_t total) {
  std::vector<float> v(total);
  for (size_t i = 0; i < total; ++i) {
    v[i] = i % 17 == 0 ? 0.0f
                       : std::ldexp(std::sin(0.29f * static_cast<float>(i) + 1.3f * q),
                                    -static_cast<int>((i + q) % 7));
  }
  return v;
}

struct Trainer {
  uint32_t q = 0, r = 0;
  MixedPlan plan;
  ShardLayout layout;
  std::unique_ptr<comm::CommManager> comm;
  std::vector<float> data, sent;
  std::vector<float> feedback;  // the owner's result feedback, kept across steps when used
};

struct ExchangeOptions {
  uint32_t pieces = 1;
  uint32_t steps = 1;            // exchanges of the same inputs, one after the other
  bool result_feedback = false;  // pass Trainer::feedback as the result_feedback
  std::vector<float> (*model)(size_t q, size_t total) = GroupModel;
};

// Runs one allreduce of runs over the groups `sizes` (in `pieces` fragments, one allreduce of
// runs each, as DiLoCo's exchange in fragments does, then one plain allreduce on the same
// communicator, which pairs up only when every member numbered its collectives alike), `steps`
// times, each from the group's model again; returns every trainer after the last, and in
// `each_step` (when not null) every group's whole model after each step.
std::vector<Trainer> Exchange(const std::vector<uint32_t>& sizes, const comm::ChunkCodec* codec,
                              ExchangeOptions opt = {},
                              std::vector<std::map<uint32_t, std::vector<float>>>* each_step =
                                  nullptr);

std::vector<Trainer> Exchange(const std::vector<uint32_t>& sizes, const comm::ChunkCodec* codec,
                              uint32_t pieces) {
  ExchangeOptions opt;
  opt.pieces = pieces;
  return Exchange(sizes, codec, opt);
}

std::map<uint32_t, std::vector<float>> Gathered(const std::vector<Trainer>& ts, size_t total);

std::vector<Trainer> Exchange(const std::vector<uint32_t>& sizes, const comm::ChunkCodec* codec,
                              ExchangeOptions opt,
                              std::vector<std::map<uint32_t, std::vector<float>>>* each_step) {
  const auto specs = Specs();
  const size_t total = Total(specs);
  comm::FileRendezvousStore store(comm::testing::TempDir("mixed"));
  std::vector<Trainer> ts;
  for (uint32_t q = 0; q < sizes.size(); ++q) {
    for (uint32_t r = 0; r < sizes[q]; ++r) {
      Trainer t;
      t.q = q, t.r = r;
      t.plan = PlanMixed(specs, sizes, q, r);
      t.layout = MakeShardLayout(specs, sizes[q], r);
      t.data.resize(t.layout.shard_numel);
      t.sent.resize(t.layout.shard_numel);
      t.feedback.assign(opt.result_feedback ? t.layout.shard_numel : 0, 0.0f);
      comm::CommOptions o;
      o.full_mesh = true;
      o.op_timeout = Millis(30'000);
      auto c = comm::CommManager::Create(comm::Backend::kGloo, &store, o);
      REQUIRE(c.ok());
      t.comm = std::move(*c);
      ts.push_back(std::move(t));
    }
  }
  for (uint32_t step = 0; step < opt.steps; ++step) {
    std::vector<std::future<Status>> fs;
    for (auto& t : ts) {
      t.layout.Take(opt.model(t.q, total), t.data);
      fs.push_back(std::async(std::launch::async, [&t, codec, opt, total, step] {
        if (step == 0) {
          LK_RETURN_IF_ERROR(t.comm->Reconfigure(1, t.plan.mesh_rank, t.plan.mesh_world));
        }
        if (opt.pieces == 1) {
          return t.comm->AllReduceRuns(t.data, t.plan.runs, codec, t.sent, t.feedback);
        }
        for (const auto& runs :
             SplitRuns(t.plan.runs, t.plan.run_full_begin, total, opt.pieces)) {
          LK_RETURN_IF_ERROR(t.comm->AllReduceRuns(t.data, runs, codec, t.sent, t.feedback));
        }
        float one = 1.0f;
        LK_RETURN_IF_ERROR(
            t.comm->AllReduce(&one, 1, comm::DType::kFloat32, comm::ReduceOp::kSum));
        if (one != static_cast<float>(t.plan.mesh_world)) {
          return Status(Code::kInternal, "barrier");
        }
        return Status::Ok();
      }));
    }
    for (auto& f : fs) REQUIRE(f.get().ok());
    if (each_step != nullptr) each_step->push_back(Gathered(ts, total));
  }
  return ts;
}

// Each group's whole model after the exchange, gathered from its trainers' shards.
std::map<uint32_t, std::vector<float>> Gathered(const std::vector<Trainer>& ts, size_t total) {
  std::map<uint32_t, std::vector<float>> out;
  for (const auto& t : ts) {
    auto& full = out[t.q];
    full.resize(total, 0.0f);
    t.layout.Place(t.data, full);
  }
  return out;
}

TEST_CASE("groups of 1, 2 and 3 trainers: every element is the float32 sum in replica order") {
  const auto specs = Specs();
  const size_t total = Total(specs);
  const std::vector<uint32_t> sizes{1, 2, 3};
  auto ts = Exchange(sizes, nullptr);
  std::vector<float> want = GroupModel(0, total);
  for (uint32_t q = 1; q < sizes.size(); ++q) {
    auto m = GroupModel(q, total);
    for (size_t i = 0; i < total; ++i) want[i] += m[i];
  }
  for (const auto& [q, full] : Gathered(ts, total)) {
    CAPTURE(q);
    CHECK(std::memcmp(full.data(), want.data(), total * sizeof(float)) == 0);
  }
}

TEST_CASE("with int8 on the wire every group ends with the same bits, near the exact sum") {
  const auto specs = Specs();
  const size_t total = Total(specs);
  comm::BlockCodec codec(comm::Codec::kInt8);
  auto ts = Exchange({3, 1, 2}, &codec);
  auto groups = Gathered(ts, total);
  std::vector<float> exact(total, 0.0f);
  for (uint32_t q = 0; q < 3; ++q) {
    auto m = GroupModel(q, total);
    for (size_t i = 0; i < total; ++i) exact[i] += m[i];
  }
  const auto& first = groups.begin()->second;
  for (const auto& [q, full] : groups) {
    CAPTURE(q);
    CHECK(std::memcmp(full.data(), first.data(), total * sizeof(float)) == 0);
  }
  double err = 0, norm = 0;
  for (size_t i = 0; i < total; ++i) {
    err += std::abs(first[i] - exact[i]);
    norm += std::abs(exact[i]);
  }
  CHECK(err / norm < 0.05);
  // `sent` is what each trainer's own encoding decodes to: within int8's error of its input.
  for (const auto& t : ts) {
    std::vector<float> in(t.layout.shard_numel);
    t.layout.Take(GroupModel(t.q, total), in);
    double e = 0, n = 0;
    for (size_t i = 0; i < in.size(); ++i) e += std::abs(t.sent[i] - in[i]), n += std::abs(in[i]);
    CHECK(e / n < 0.02);
  }
}

TEST_CASE("a member that planned other runs is refused by name, not read as garbage") {
  const auto specs = Specs();
  comm::FileRendezvousStore store(comm::testing::TempDir("mixed-bad"));
  const std::vector<uint32_t> sizes{1, 2};
  std::vector<Trainer> ts;
  for (uint32_t q = 0; q < 2; ++q) {
    for (uint32_t r = 0; r < sizes[q]; ++r) {
      Trainer t;
      t.q = q, t.r = r;
      t.plan = PlanMixed(specs, sizes, q, r);
      t.layout = MakeShardLayout(specs, sizes[q], r);
      t.data.assign(t.layout.shard_numel, 1.0f);
      comm::CommOptions o;
      o.op_timeout = Millis(10'000);
      auto c = comm::CommManager::Create(comm::Backend::kGloo, &store, o);
      REQUIRE(c.ok());
      t.comm = std::move(*c);
      ts.push_back(std::move(t));
    }
  }
  // The group of one drops a run that another trainer owns from its plan: its message to that
  // owner is shorter than the owner's plan says. (A longer one would overrun the posted
  // receive; the plans of one quorum agree, since they come from the same specs and sizes.)
  auto& runs = ts[0].plan.runs;
  auto it = std::find_if(runs.begin(), runs.end(),
                         [&](const comm::ReduceRun& r) { return r.owner != ts[0].plan.mesh_rank; });
  REQUIRE(it != runs.end());
  runs.erase(it);
  std::vector<std::future<Status>> fs;
  for (auto& t : ts) {
    fs.push_back(std::async(std::launch::async, [&t] {
      LK_RETURN_IF_ERROR(t.comm->Reconfigure(1, t.plan.mesh_rank, t.plan.mesh_world));
      return t.comm->AllReduceRuns(t.data, t.plan.runs, nullptr, {});
    }));
  }
  bool refused = false;
  for (auto& f : fs) {
    Status st = f.get();
    refused = refused || (st.code() == Code::kConflict &&
                          st.message().find("planned different runs") != std::string::npos);
  }
  CHECK(refused);
}


TEST_CASE("fragment ranges tile the shard in order, on block boundaries, the same for equal n") {
  for (size_t n : {0, 1, 7, 64, 1000, 4097}) {
    for (uint32_t pieces : {1u, 2u, 3u, 8u}) {
      for (size_t align : {1, 64}) {
        CAPTURE(n);
        CAPTURE(pieces);
        CAPTURE(align);
        std::vector<Range> r = FragmentRanges(n, pieces, align);
        REQUIRE(r.size() == pieces);
        CHECK(r.front().begin == 0);
        CHECK(r.back().end == n);
        for (uint32_t k = 0; k < pieces; ++k) {
          CHECK(r[k].begin <= r[k].end);
          if (k > 0) CHECK(r[k].begin == r[k - 1].end);
          if (k + 1 < pieces) CHECK(r[k].end % align == 0);
        }
      }
    }
  }
  // Even cuts: 1000 in 4 is 250 each; aligned to 64 the cuts move down to 192, 448, 704.
  std::vector<Range> even = FragmentRanges(1000, 4, 1);
  CHECK(even[1].begin == 250);
  CHECK(even[3].begin == 750);
  std::vector<Range> aligned = FragmentRanges(1000, 4, 64);
  CHECK(aligned[1].begin == 192);
  CHECK(aligned[2].begin == 448);
  CHECK(aligned[3].begin == 704);
}

TEST_CASE("runs split by their place in the whole model: each run once, pieces in model order") {
  const auto specs = Specs();
  const size_t total = Total(specs);
  for (uint32_t pieces : {1u, 3u, 7u}) {
    for (const std::vector<uint32_t>& sizes : {std::vector<uint32_t>{1, 2, 3}, {2, 2}}) {
      std::map<size_t, uint32_t> piece_of;  // full_begin -> piece, across every trainer
      for (uint32_t q = 0; q < sizes.size(); ++q) {
        for (uint32_t r = 0; r < sizes[q]; ++r) {
          MixedPlan plan = PlanMixed(specs, sizes, q, r);
          REQUIRE(plan.run_full_begin.size() == plan.runs.size());
          auto split = SplitRuns(plan.runs, plan.run_full_begin, total, pieces);
          REQUIRE(split.size() == pieces);
          size_t count = 0, at = 0;
          for (uint32_t k = 0; k < pieces; ++k) {
            for (const comm::ReduceRun& run : split[k]) {
              // The runs keep their order, and a run shared by several members lands in the
              // same piece in each of them.
              CHECK(run.offset == plan.runs[at].offset);
              const size_t place = plan.run_full_begin[at];
              auto [it, fresh] = piece_of.emplace(place, k);
              CHECK(it->second == k);
              CHECK(place * pieces / total == k);
              ++at;
              ++count;
            }
          }
          CHECK(count == plan.runs.size());
        }
      }
    }
  }
}

TEST_CASE("in fragments the allreduce of runs gives the same bits as in one, float32 and int8") {
  const auto specs = Specs();
  const size_t total = Total(specs);
  comm::BlockCodec codec(comm::Codec::kInt8);
  for (const comm::ChunkCodec* c : {static_cast<const comm::ChunkCodec*>(nullptr),
                                    static_cast<const comm::ChunkCodec*>(&codec)}) {
    CAPTURE(c != nullptr);
    auto one = Gathered(Exchange({1, 2, 3}, c), total);
    // Seven pieces: a trainer of the group of 3 holds runs in only some of them.
    auto pieces = Gathered(Exchange({1, 2, 3}, c, 7), total);
    for (const auto& [q, full] : one) {
      CAPTURE(q);
      CHECK(std::memcmp(full.data(), pieces[q].data(), total * sizeof(float)) == 0);
    }
  }
}

// Values int4 encodes exactly in any block: -1, 0 and 1 (a block's absmax is 1 or 0). Their sum
// over three groups, -3..3, is not exact (2 of a block of absmax 3 is 4.67 codes).
std::vector<float> TernaryModel(size_t q, size_t total) {
  std::vector<float> v(total);
  for (size_t i = 0; i < total; ++i) {
    v[i] = static_cast<float>(static_cast<int>((i * (i + q) / 3 + q * i / 5 + q) % 3) - 1);
  }
  return v;
}

TEST_CASE("result feedback: the owners' rounding of the sum reaches the next steps, not lost") {
  const auto specs = Specs();
  const size_t total = Total(specs);
  comm::BlockCodec codec(comm::Codec::kInt4);
  const std::vector<uint32_t> sizes{1, 2, 3};
  std::vector<float> exact(total, 0.0f);
  for (uint32_t q = 0; q < sizes.size(); ++q) {
    auto m = TernaryModel(q, total);
    for (size_t i = 0; i < total; ++i) exact[i] += m[i];
  }
  constexpr uint32_t kSteps = 6;
  // The sum of each step's decoded results against kSteps x the exact sum, with and without it.
  auto drift = [&](bool feedback, std::vector<Trainer>* out) {
    ExchangeOptions opt;
    opt.steps = kSteps;
    opt.result_feedback = feedback;
    opt.model = TernaryModel;
    std::vector<std::map<uint32_t, std::vector<float>>> steps;
    *out = Exchange(sizes, &codec, opt, &steps);
    REQUIRE(steps.size() == kSteps);
    std::vector<double> acc(total, 0.0);
    for (const auto& groups : steps) {
      // Every group holds the same bits at every step.
      const auto& first = groups.begin()->second;
      for (const auto& [q, full] : groups) {
        CAPTURE(q);
        REQUIRE(std::memcmp(full.data(), first.data(), total * sizeof(float)) == 0);
      }
      for (size_t i = 0; i < total; ++i) acc[i] += first[i];
    }
    return acc;
  };
  std::vector<Trainer> with_ts, without_ts;
  const std::vector<double> with = drift(true, &with_ts), without = drift(false, &without_ts);
  // The owners' residuals, placed in the whole model: each element has exactly one owner.
  std::vector<float> residual(total, 0.0f);
  for (const auto& t : with_ts) {
    for (const comm::ReduceRun& run : t.plan.runs) {
      if (run.owner != t.plan.mesh_rank) continue;
      std::vector<float> mine(t.layout.shard_numel, 0.0f);
      std::copy_n(t.feedback.begin() + run.offset, run.count, mine.begin() + run.offset);
      std::vector<float> full(total, 0.0f);
      t.layout.Place(mine, full);
      for (size_t i = 0; i < total; ++i) residual[i] += full[i];
    }
    CHECK(t.feedback.size() == t.layout.shard_numel);
  }
  // The contributions are exact, so sum_t result_t + residual == kSteps x exact, up to the
  // float32 additions of the residual (values here are small multiples of 1/7 of 3); without
  // feedback each step's rounding adds up.
  double worst_with = 0, worst_without = 0;
  for (size_t i = 0; i < total; ++i) {
    const double want = static_cast<double>(kSteps) * exact[i];
    worst_with = std::max(worst_with, std::abs(with[i] + residual[i] - want));
    worst_without = std::max(worst_without, std::abs(without[i] - want));
  }
  CHECK(worst_with < 1e-5);
  CHECK(worst_without > 0.5);  // 6 steps of 1/7 (a third of a code of 3/7)
  for (const auto& t : without_ts) CHECK(t.feedback.empty());
}

}  // namespace
}  // namespace lk::diloco
