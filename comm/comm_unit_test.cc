// Unit tests of the communicator's pure parts (bfloat16 rounding, the ring schedule), of the
// file store, and of the Gloo backend in one process (threads as members) for quick checks.
// The multi-process tests against the real lighthouse are in comm_test.cc.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <thread>

#include "comm/comm.h"
#include "comm/reduce.h"
#include "comm/rendezvous_store.h"
#include "comm/test_support.h"
#include "tests/support/thread_state.h"
#include "tests/support/wait.h"

namespace lk::comm {
namespace {

using namespace std::chrono_literals;
using test::CurrentTid;
using test::ThreadAsleep;
using test::WaitUntil;

TEST_CASE("bfloat16 rounds to nearest even and keeps NaN and infinities") {
  CHECK(FloatToBf16(1.0f) == 0x3f80);
  CHECK(Bf16ToFloat(0x3f80) == 1.0f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  CHECK(FloatToBf16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  CHECK(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);
  CHECK(FloatToBf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -12)) == 0x3f81);
  CHECK(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::infinity()))));
  CHECK(Bf16ToFloat(FloatToBf16(-2.5f)) == -2.5f);
}

// The ring sets each bfloat16 member's accumulator segment to its own input plus what arrived
// (bfloat16 at the first step, float32 partial sums later); that must be the very same float32
// arithmetic as widening first and adding into it. Odd lengths cover the vector loop's tail.
TEST_CASE("SumBf16 and SumBf16Float equal widening then AddInto, bit for bit") {
  for (size_t count : {1, 7, 64, 1001}) {
    std::vector<uint16_t> mine(count), in(count);
    std::vector<float> in_f(count);
    for (size_t i = 0; i < count; ++i) {
      mine[i] = FloatToBf16(static_cast<float>(i) * 0.37f - 11.0f);
      in[i] = FloatToBf16(static_cast<float>(i % 13) * 1.7f - 3.3f);
      in_f[i] = static_cast<float>(i % 11) * 0.013f - 0.05f;
    }
    mine[0] = 0xffc1;  // NaNs stay NaNs, with the payload of the first operand
    in[0] = 0xffc2;
    std::vector<float> want(count), want_f(count), widened_in(count);
    WidenBf16(mine.data(), want.data(), count);
    WidenBf16(mine.data(), want_f.data(), count);
    WidenBf16(in.data(), widened_in.data(), count);
    AddInto(want.data(), widened_in.data(), count);
    AddInto(want_f.data(), in_f.data(), count);
    std::vector<float> got(count), got_f(count);
    SumBf16(mine.data(), in.data(), got.data(), count);
    SumBf16Float(mine.data(), in_f.data(), got_f.data(), count);
    CHECK(std::memcmp(want.data(), got.data(), count * sizeof(float)) == 0);
    CHECK(std::memcmp(want_f.data(), got_f.data(), count * sizeof(float)) == 0);
  }
}

TEST_CASE("ring chunks cover every element once and sizes differ by at most one") {
  for (size_t count : {0, 1, 5, 7, 64, 1001}) {
    for (size_t parts : {1, 2, 3, 4, 8}) {
      size_t next = 0, smallest = count, largest = 0;
      for (size_t i = 0; i < parts; ++i) {
        Chunk c = RingChunk(count, parts, i);
        CHECK(c.begin == next);
        next += c.size;
        smallest = std::min(smallest, c.size);
        largest = std::max(largest, c.size);
      }
      CHECK(next == count);
      CHECK(largest - smallest <= 1);
    }
  }
}

// Runs the ring schedule on in-memory members: what each sends at a step is what its right
// neighbour receives, so the schedule alone must produce the full sum everywhere.
TEST_CASE("the ring schedule yields the full sum on every member") {
  for (size_t world : {2, 3, 4, 5, 8}) {
    const size_t count = 23;
    std::vector<std::vector<float>> data(world, std::vector<float>(count));
    for (size_t r = 0; r < world; ++r) {
      for (size_t i = 0; i < count; ++i) data[r][i] = static_cast<float>((r + 1) * 100 + i);
    }
    for (size_t step = 0; step + 1 < world; ++step) {
      auto before = data;
      for (size_t r = 0; r < world; ++r) {
        size_t left = (r + world - 1) % world;
        size_t c = ReduceScatterRecvChunk(r, world, step);
        REQUIRE(c == ReduceScatterSendChunk(left, world, step));
        Chunk ch = RingChunk(count, world, c);
        AddInto(data[r].data() + ch.begin, before[left].data() + ch.begin, ch.size);
      }
    }
    for (size_t step = 0; step + 1 < world; ++step) {
      auto before = data;
      for (size_t r = 0; r < world; ++r) {
        size_t left = (r + world - 1) % world;
        size_t c = AllGatherRecvChunk(r, world, step);
        REQUIRE(c == AllGatherSendChunk(left, world, step));
        Chunk ch = RingChunk(count, world, c);
        std::copy_n(before[left].data() + ch.begin, ch.size, data[r].data() + ch.begin);
      }
    }
    for (size_t r = 0; r < world; ++r) {
      for (size_t i = 0; i < count; ++i) {
        float want = 0;
        for (size_t k = 0; k < world; ++k) want += static_cast<float>((k + 1) * 100 + i);
        REQUIRE(data[r][i] == want);
      }
    }
  }
}

// The Gloo ring forwards each segment at step s+1 as soon as it arrived at step s; that is only
// right if the chunk received at s is the chunk sent at s+1, and if what a member sends at s is
// what its right neighbour expects at s.
TEST_CASE("the pipelined ring forwards at step s+1 exactly the chunk received at step s") {
  CHECK(RingSteps(1) == 0);
  for (size_t world = 2; world <= 8; ++world) {
    CAPTURE(world);
    REQUIRE(RingSteps(world) == 2 * (world - 1));
    for (size_t r = 0; r < world; ++r) {
      CAPTURE(r);
      std::vector<size_t> reduced_into;
      for (size_t s = 0; s < RingSteps(world); ++s) {
        CAPTURE(s);
        CHECK(RingSendChunk(r, world, s) == RingRecvChunk((r + 1) % world, world, s));
        if (s + 1 < RingSteps(world)) {
          CHECK(RingRecvChunk(r, world, s) == RingSendChunk(r, world, s + 1));
        }
        if (RingStepReduces(world, s)) reduced_into.push_back(RingRecvChunk(r, world, s));
      }
      // The reduce-scatter adds into every chunk but the member's own, once each, and the
      // allgather never writes the chunk the member finished itself (r + 1).
      std::sort(reduced_into.begin(), reduced_into.end());
      CHECK(std::adjacent_find(reduced_into.begin(), reduced_into.end()) == reduced_into.end());
      CHECK(reduced_into.size() == world - 1);
      CHECK(std::find(reduced_into.begin(), reduced_into.end(), r) == reduced_into.end());
      for (size_t s = world - 1; s < RingSteps(world); ++s) {
        CHECK(RingRecvChunk(r, world, s) != (r + 1) % world);
      }
    }
  }
}

TEST_CASE("options: bad values are refused with the field named") {
  CommOptions o;
  CHECK(o.Validate().ok());
  o.op_timeout = Millis(0);
  CHECK(o.Validate().message().find("op_timeout") != std::string::npos);
  o = CommOptions();
  o.bind_host = "";
  CHECK(!o.Validate().ok());
  // "Every address" is no address a peer can be given.
  for (const char* any : {"0.0.0.0", "::", "[::]"}) {
    o.bind_host = any;
    CHECK(o.Validate().message().find("cannot be given to peers") != std::string::npos);
  }
  FileRendezvousStore store(testing::TempDir("opts"));
  CHECK(!CommManager::Create(Backend::kGloo, nullptr, CommOptions()).ok());
  o = CommOptions();
  o.segment_bytes = 1;
  CHECK(CommManager::Create(Backend::kGloo, &store, o).status().code() == Code::kInvalidArgument);
}

TEST_CASE("bind_host: an interface's name stands for its IPv4 address, anything else for itself") {
  CHECK(*ResolveBindHost("lo") == "127.0.0.1");
  CHECK(*ResolveBindHost("127.0.0.7") == "127.0.0.7");
  CHECK(*ResolveBindHost("node17.cluster") == "node17.cluster");
  CHECK(*ResolveBindHost("lk-none0") == "lk-none0");  // no such interface: a host name
  // A ring whose members bind by interface name reaches the same peers.
  FileRendezvousStore store(testing::TempDir("iface"));
  std::vector<std::unique_ptr<CommManager>> members;
  for (int r = 0; r < 2; ++r) {
    CommOptions o;
    o.bind_host = r == 0 ? "lo" : "127.0.0.1";
    o.init_timeout = Millis(10'000);
    auto c = CommManager::Create(Backend::kGloo, &store, o);
    REQUIRE(c.ok());
    members.push_back(std::move(*c));
  }
  std::vector<std::future<float>> fs;
  for (uint32_t r = 0; r < 2; ++r) {
    fs.push_back(std::async(std::launch::async, [&, r] {
      REQUIRE(members[r]->Reconfigure(1, r, 2).ok());
      float v = static_cast<float>(r + 1);
      REQUIRE(members[r]->AllReduce(&v, 1, DType::kFloat32, ReduceOp::kSum).ok());
      return v;
    }));
  }
  for (auto& f : fs) CHECK(f.get() == 3.0f);
}

TEST_CASE("file store: a Get waits for the Put and a missing key times out") {
  FileRendezvousStore store(testing::TempDir("filestore"));
  std::atomic<pid_t> getter_tid{0};
  auto getter = std::async(std::launch::async, [&] {
    getter_tid = CurrentTid();
    return store.Get(3, "a/b", 5000ms);
  });
  // The Get looked once and pauses before the next look (its only sleep): the Put comes after.
  REQUIRE(WaitUntil(
      [&] {
        return getter_tid.load() != 0 &&
               ThreadAsleep(::getpid(), getter_tid.load(), SYS_clock_nanosleep, 0ms);
      },
      10s, "the Get waiting for the key"));
  REQUIRE(store.Put(3, "a/b", std::string("x\0y", 3)).ok());
  auto got = getter.get();
  REQUIRE(got.ok());
  CHECK(*got == std::string("x\0y", 3));
  CHECK(store.Get(4, "a/b", 20ms).status().code() == Code::kDeadlineExceeded);
}

// Members as threads of this process, rendezvousing through a file store.
struct LocalRing {
  FileRendezvousStore store{testing::TempDir("ring")};
  std::vector<std::unique_ptr<CommManager>> members;
  explicit LocalRing(size_t world, Millis op_timeout = Millis(20'000),
                     size_t segment_bytes = CommOptions{}.segment_bytes) {
    for (size_t r = 0; r < world; ++r) {
      CommOptions o;
      o.op_timeout = op_timeout;
      o.segment_bytes = segment_bytes;
      o.init_timeout = Millis(10'000);
      auto c = CommManager::Create(Backend::kGloo, &store, o);
      REQUIRE(c.ok());
      members.push_back(std::move(*c));
    }
  }
  std::vector<Status> Reconfigure(uint32_t q) {
    std::vector<std::future<Status>> fs;
    for (size_t r = 0; r < members.size(); ++r) {
      fs.push_back(std::async(std::launch::async, [this, q, r] {
        return members[r]->Reconfigure(q, static_cast<uint32_t>(r),
                                       static_cast<uint32_t>(members.size()));
      }));
    }
    std::vector<Status> out;
    for (auto& f : fs) out.push_back(f.get());
    return out;
  }
};

TEST_CASE("gloo in one process: sum and avg of float32 and bfloat16 repeated") {
  LocalRing ring(3);
  for (const Status& st : ring.Reconfigure(1)) REQUIRE(st.ok());
  const size_t count = 1000;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    std::vector<std::future<std::vector<float>>> fs;
    for (size_t r = 0; r < 3; ++r) {
      fs.push_back(std::async(std::launch::async, [&, r] {
        std::vector<float> v(count, static_cast<float>(r + 1));
        std::vector<uint16_t> b(count, FloatToBf16(static_cast<float>(r + 1) * 0.5f));
        Status st = ring.members[r]->AllReduce(v.data(), count, DType::kFloat32, op);
        REQUIRE(st.ok());
        st = ring.members[r]->AllReduce(b.data(), count, DType::kBFloat16, op);
        REQUIRE(st.ok());
        v.push_back(Bf16ToFloat(b[count - 1]));
        return v;
      }));
    }
    for (auto& f : fs) {
      auto v = f.get();
      CHECK(v[0] == (op == ReduceOp::kSum ? 6.0f : 2.0f));
      CHECK(v[count - 1] == (op == ReduceOp::kSum ? 6.0f : 2.0f));
      CHECK(v[count] == (op == ReduceOp::kSum ? 3.0f : 1.0f));
    }
  }
  CHECK(ring.members[0]->quorum_id() == 1);
  // Same quorum again: nothing to do, and still usable.
  for (const Status& st : ring.Reconfigure(1)) CHECK(st.ok());
}

// The smallest segments (4 KiB, 1024 floats) make every chunk many segments long, so the staging
// ring (4 segments) wraps many times, segments are forwarded while later ones of the same step are
// still in flight, and sizes below the world size leave chunks empty. Inputs differ per member and
// element and their sums are exact, so every member must hold exactly the same bits.
TEST_CASE("gloo in one process: pipelined ring with small segments, 2 to 5 members, odd sizes") {
  for (size_t world : {2, 3, 5}) {
    LocalRing ring(world, Millis(20'000), /*segment_bytes=*/4096);
    for (const Status& st : ring.Reconfigure(1)) REQUIRE(st.ok());
    for (size_t count : {1, 4, 1025, 30011}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        CAPTURE(world);
        CAPTURE(count);
        std::vector<std::future<std::pair<std::vector<float>, std::vector<uint16_t>>>> fs;
        for (size_t r = 0; r < world; ++r) {
          fs.push_back(std::async(std::launch::async, [&, r] {
            std::vector<float> v(count);
            std::vector<uint16_t> b(count);
            for (size_t i = 0; i < count; ++i) {
              v[i] = static_cast<float>(r + 1) + static_cast<float>(i % 7) * 0.5f;
              b[i] = FloatToBf16(v[i]);
            }
            Status st = ring.members[r]->AllReduce(v.data(), count, DType::kFloat32, op);
            REQUIRE(st.ok());
            st = ring.members[r]->AllReduce(b.data(), count, DType::kBFloat16, op);
            REQUIRE(st.ok());
            return std::make_pair(std::move(v), std::move(b));
          }));
        }
        std::vector<std::pair<std::vector<float>, std::vector<uint16_t>>> got;
        for (auto& f : fs) got.push_back(f.get());
        for (size_t i = 0; i < count; ++i) {
          float want = 0;
          for (size_t r = 0; r < world; ++r) {
            want += static_cast<float>(r + 1) + static_cast<float>(i % 7) * 0.5f;
          }
          if (op == ReduceOp::kAvg) want /= static_cast<float>(world);
          REQUIRE(got[0].first[i] == want);
          REQUIRE(got[0].second[i] == FloatToBf16(want));
        }
        for (size_t r = 1; r < world; ++r) {
          CHECK(std::memcmp(got[r].first.data(), got[0].first.data(), count * 4) == 0);
          CHECK(std::memcmp(got[r].second.data(), got[0].second.data(), count * 2) == 0);
        }
      }
    }
  }
}

TEST_CASE("gloo in one process: Abort wakes a blocked allreduce and the peer fails too") {
  LocalRing ring(2);
  for (const Status& st : ring.Reconfigure(7)) REQUIRE(st.ok());
  std::vector<float> v(1 << 16, 1.0f);
  // Member 1 never joins the collective, so member 0 blocks until the notice.
  auto start = std::chrono::steady_clock::now();
  // The notice comes once member 0 is blocked in the collective (its thread asleep in a wait).
  const pid_t member0 = CurrentTid();
  bool ordered = false;
  std::thread notice([&] {
    ordered = WaitUntil([&] { return ThreadAsleep(::getpid(), member0); }, 10s,
                        "member 0 blocked in its allreduce");
    ring.members[0]->Abort("failure notice");
  });
  Status st = ring.members[0]->AllReduce(v.data(), v.size(), DType::kFloat32, ReduceOp::kSum);
  auto waited = std::chrono::steady_clock::now() - start;
  notice.join();
  CHECK(ordered);
  CHECK(st.code() == Code::kAborted);
  CHECK(st.message().find("failure notice") != std::string::npos);
  CHECK(waited < 10s);  // the op timeout is 20 s: only a hang gets here
  // Later calls answer at once with the same status, until a newer quorum.
  CHECK(ring.members[0]->AllReduce(v.data(), v.size(), DType::kFloat32, ReduceOp::kSum).code() ==
        Code::kAborted);
  CHECK(ring.members[0]->Reconfigure(7, 0, 2).code() == Code::kAborted);
  // Member 0 reset its connection, so member 1's collective fails instead of waiting.
  Status peer = ring.members[1]->AllReduce(v.data(), v.size(), DType::kFloat32, ReduceOp::kSum);
  CHECK(peer.code() == Code::kAborted);
  for (const Status& s : ring.Reconfigure(8)) CHECK(s.ok());
  CHECK(ring.members[1]->Reconfigure(6, 1, 2).code() == Code::kInvalidArgument);
}

// A notice about a quorum that reaches the trainer after its poll and before the rendezvous for
// that quorum has started must still end the rendezvous at once; so must a drain (Close).
TEST_CASE("gloo in one process: an abort for a quorum not yet started refuses its rendezvous") {
  LocalRing ring(2);
  for (const Status& st : ring.Reconfigure(3)) REQUIRE(st.ok());
  ring.members[0]->AbortQuorum(5, "quorum lost: g1 left");
  // The communicator of quorum 3 is older than the notice: it is aborted too.
  std::vector<float> v(16, 1.0f);
  CHECK(ring.members[0]->AllReduce(v.data(), v.size(), DType::kFloat32, ReduceOp::kSum).code() ==
        Code::kAborted);
  auto start = std::chrono::steady_clock::now();
  for (uint32_t q : {4u, 5u}) {
    Status st = ring.members[0]->Reconfigure(q, 0, 2);  // member 1 never comes
    CHECK(st.code() == Code::kAborted);
    CHECK(st.message().find("g1 left") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);  // init_timeout is longer: no wait
  // A newer quorum than the notice named is a fresh start.
  for (const Status& st : ring.Reconfigure(6)) CHECK(st.ok());
  // A late notice about an older quorum changes nothing, before or after.
  ring.members[0]->AbortQuorum(5, "late");
  std::vector<std::future<Status>> fs;
  for (size_t r = 0; r < 2; ++r) {
    fs.push_back(std::async(std::launch::async, [&ring, r] {
      std::vector<float> mine(16, 1.0f);
      return ring.members[r]->AllReduce(mine.data(), mine.size(), DType::kFloat32, ReduceOp::kSum);
    }));
  }
  for (auto& f : fs) CHECK(f.get().ok());
}

TEST_CASE("gloo in one process: Close aborts the communicator and refuses every later rendezvous") {
  LocalRing ring(2);
  for (const Status& st : ring.Reconfigure(3)) REQUIRE(st.ok());
  ring.members[0]->Close("drain: preempted");
  std::vector<float> v(16, 1.0f);
  CHECK(ring.members[0]->AllReduce(v.data(), v.size(), DType::kFloat32, ReduceOp::kSum).code() ==
        Code::kAborted);
  auto start = std::chrono::steady_clock::now();
  for (uint32_t q : {4u, 100u}) {
    Status st = ring.members[0]->Reconfigure(q, 0, 2);
    CHECK(st.code() == Code::kAborted);
    CHECK(st.message().find("preempted") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);
}

// An abort in the middle of the pipeline: members 0 and 1 have exchanged segments and are
// blocked on segments that depend on member 2, which never joins; staging receives, sends from
// the float32 accumulator and from the caller's bfloat16 buffer are all posted. The notice must
// end member 0's wait at once, the reset must fail member 1 and 2, and the next quorum must work.
TEST_CASE("gloo in one process: Abort mid-pipeline of a bfloat16 average fails every member") {
  LocalRing ring(3, Millis(20'000), /*segment_bytes=*/4096);
  for (const Status& st : ring.Reconfigure(3)) REQUIRE(st.ok());
  const size_t count = 300'001;
  std::vector<std::vector<uint16_t>> bufs(3, std::vector<uint16_t>(count, FloatToBf16(1.5f)));
  auto start = std::chrono::steady_clock::now();
  // The notice comes once both members have gone as far as they can (both threads asleep).
  const pid_t member0 = CurrentTid();
  std::atomic<pid_t> member1{0};
  bool ordered = false;
  std::thread notice([&] {
    ordered = WaitUntil(
        [&] {
          return member1.load() != 0 && ThreadAsleep(::getpid(), member0) &&
                 ThreadAsleep(::getpid(), member1.load());
        },
        10s, "members 0 and 1 blocked in their allreduce");
    ring.members[0]->Abort("failure notice");
  });
  auto peer1 = std::async(std::launch::async, [&] {
    member1 = CurrentTid();
    return ring.members[1]->AllReduce(bufs[1].data(), count, DType::kBFloat16, ReduceOp::kAvg);
  });
  Status st = ring.members[0]->AllReduce(bufs[0].data(), count, DType::kBFloat16, ReduceOp::kAvg);
  auto waited = std::chrono::steady_clock::now() - start;
  notice.join();
  CHECK(ordered);
  CHECK(st.code() == Code::kAborted);
  CHECK(waited < 10s);  // the op timeout is 20 s: only a hang gets here
  CHECK(peer1.get().code() == Code::kAborted);
  Status late = ring.members[2]->AllReduce(bufs[2].data(), count, DType::kBFloat16, ReduceOp::kAvg);
  CHECK(late.code() == Code::kAborted);

  for (const Status& s : ring.Reconfigure(4)) REQUIRE(s.ok());
  std::vector<std::future<Status>> fs;
  for (size_t r = 0; r < 3; ++r) {
    bufs[r].assign(count, FloatToBf16(static_cast<float>(r + 1)));
    fs.push_back(std::async(std::launch::async, [&, r] {
      return ring.members[r]->AllReduce(bufs[r].data(), count, DType::kBFloat16, ReduceOp::kAvg);
    }));
  }
  for (auto& f : fs) CHECK(f.get().ok());
  for (size_t r = 0; r < 3; ++r) {
    CHECK(std::count(bufs[r].begin(), bufs[r].end(), FloatToBf16(2.0f)) ==
          static_cast<std::ptrdiff_t>(count));
  }
}

TEST_CASE("gloo in one process: a collective past op_timeout is DeadlineExceeded") {
  LocalRing ring(2, Millis(300));
  for (const Status& st : ring.Reconfigure(1)) REQUIRE(st.ok());
  std::vector<float> v(16, 1.0f);
  auto start = std::chrono::steady_clock::now();
  Status st = ring.members[0]->AllReduce(v.data(), v.size(), DType::kFloat32, ReduceOp::kSum);
  CHECK(st.code() == Code::kDeadlineExceeded);
  CHECK(std::chrono::steady_clock::now() - start < 10s);
}

}  // namespace
}  // namespace lk::comm
