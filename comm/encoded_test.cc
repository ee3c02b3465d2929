// The encoded allreduce (CommManager::AllReduceEncoded) on the Gloo backend, members as threads
// of this process over loopback: every member ends with the same bits, and they are the bits of
// the reference computed here from the pure parts (each owner's decode-sum-encode); the float32
// "none" codec gives the exact sum; an abort or a missing member ends the collective at once or
// at its deadline; a member of another codec is refused by name. Multi-process runs against a
// real lighthouse are in comm_test.cc.
#include "comm/encoded.h"

#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <future>
#include <thread>

#include "comm/compress.h"
#include "comm/comm.h"
#include "comm/rendezvous_store.h"
#include "comm/test_support.h"
#include "tests/support/thread_state.h"
#include "tests/support/wait.h"

namespace lk::comm {
namespace {

using namespace std::chrono_literals;
using comm::BlockCodec;
using comm::Codec;

constexpr Codec kAll[] = {Codec::kNone, Codec::kBf16, Codec::kInt8,
                                  Codec::kInt4};

struct Members {
  FileRendezvousStore store{testing::TempDir("encoded")};
  std::vector<std::unique_ptr<CommManager>> comms;
  Members(size_t world, Millis op_timeout = Millis(20'000), bool full_mesh = true) {
    for (size_t r = 0; r < world; ++r) {
      CommOptions o;
      o.op_timeout = op_timeout;
      o.init_timeout = Millis(10'000);
      o.full_mesh = full_mesh;
      auto c = CommManager::Create(Backend::kGloo, &store, o);
      REQUIRE(c.ok());
      comms.push_back(std::move(*c));
    }
  }
  void Reconfigure(uint32_t q) {
    std::vector<std::future<Status>> fs;
    for (size_t r = 0; r < comms.size(); ++r) {
      fs.push_back(std::async(std::launch::async, [this, q, r] {
        return comms[r]->Reconfigure(q, static_cast<uint32_t>(r),
                                     static_cast<uint32_t>(comms.size()));
      }));
    }
    for (auto& f : fs) REQUIRE(f.get().ok());
  }
};

// Member r's input: many magnitudes, both signs, exact zeros, different per member.
std::vector<float> Input(size_t r, size_t count) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) {
    v[i] = i % 13 == 0 ? 0.0f
                       : std::ldexp(std::sin(0.37f * static_cast<float>(i) + static_cast<float>(r)),
                                    -static_cast<int>((i + r) % 9));
  }
  return v;
}

std::vector<float> RoundTrip(const ChunkCodec& codec, const float* in, size_t n) {
  std::vector<uint8_t> bytes(codec.EncodedBytes(n));
  std::vector<float> out(n);
  codec.Encode(in, n, bytes.data());
  codec.Decode(bytes.data(), n, out.data());
  return out;
}

// What every member must hold: per owner's chunk, the decoded contributions summed in rank
// order (divided for avg), encoded once and decoded.
std::vector<float> Reference(const ChunkCodec& codec, size_t world, size_t count, ReduceOp op) {
  std::vector<float> out(count);
  for (size_t c = 0; c < world; ++c) {
    Chunk ch = EncodedChunk(count, codec.block_elems(), world, c);
    std::vector<std::vector<uint8_t>> enc(world);
    std::vector<const uint8_t*> ptrs;
    for (size_t r = 0; r < world; ++r) {
      auto in = Input(r, count);
      enc[r].resize(codec.EncodedBytes(ch.size));
      codec.Encode(in.data() + ch.begin, ch.size, enc[r].data());
      ptrs.push_back(enc[r].data());
    }
    std::vector<float> sum(ch.size), scratch(ch.size);
    ReduceEncoded(codec, ptrs, ch.size, op, sum.data(), scratch.data());
    auto back = RoundTrip(codec, sum.data(), ch.size);
    std::copy(back.begin(), back.end(), out.begin() + ch.begin);
  }
  return out;
}

struct Outcome {
  Status status;
  std::vector<float> data, sent;
};

std::vector<Outcome> RunAll(Members& m, const ChunkCodec& codec, size_t count, ReduceOp op) {
  std::vector<std::future<Outcome>> fs;
  for (size_t r = 0; r < m.comms.size(); ++r) {
    fs.push_back(std::async(std::launch::async, [&, r] {
      Outcome o{Status::Ok(), Input(r, count), std::vector<float>(count)};
      o.status = m.comms[r]->AllReduceEncoded(o.data, codec, op, o.sent);
      return o;
    }));
  }
  std::vector<Outcome> out;
  for (auto& f : fs) out.push_back(f.get());
  return out;
}

TEST_CASE("chunks of the encoded allreduce are whole blocks that cover every element once") {
  for (size_t count : {0, 1, 127, 128, 129, 1000, 4097}) {
    for (size_t world : {1, 2, 3, 5, 8}) {
      size_t next = 0;
      for (size_t c = 0; c < world; ++c) {
        Chunk ch = EncodedChunk(count, 128, world, c);
        CHECK(ch.begin == next);
        CHECK((ch.size == 0 || ch.begin % 128 == 0));  // empty chunks sit at the end
        next += ch.size;
      }
      CHECK(next == count);
    }
  }
}

TEST_CASE("a header of another codec or size is refused as a conflict naming both") {
  BlockCodec int8(Codec::kInt8), int4(Codec::kInt4);
  uint8_t h[kEncodedHeaderBytes];
  WriteEncodedHeader(int4, 1000, h);
  CHECK(CheckEncodedHeader(int4, 1000, h, 2).ok());
  Status st = CheckEncodedHeader(int8, 1000, h, 2);
  CHECK(st.code() == Code::kConflict);
  CHECK(st.message().find("int8") != std::string::npos);
  CHECK(st.message().find("replica_rank 2") != std::string::npos);
  CHECK(CheckEncodedHeader(int4, 999, h, 2).code() == Code::kConflict);
  std::memset(h, 0, sizeof(h));
  CHECK(CheckEncodedHeader(int4, 1000, h, 2).code() == Code::kConflict);
}

TEST_CASE("encoded allreduce: 1 to 5 members hold identical bits, the reference's, every codec") {
  for (size_t world : {1, 2, 3, 4, 5}) {
    Members m(world);
    m.Reconfigure(1);
    for (Codec oc : kAll) {
      BlockCodec codec(oc);
      // Fewer elements than members, one short block, several blocks per member.
      for (size_t count : {3, 129, 5000}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          CAPTURE(world);
          CAPTURE(codec.name());
          CAPTURE(count);
          auto got = RunAll(m, codec, count, op);
          auto want = Reference(codec, world, count, op);
          for (size_t r = 0; r < world; ++r) {
            REQUIRE(got[r].status.ok());
            CHECK(std::memcmp(got[r].data.data(), want.data(), count * sizeof(float)) == 0);
            auto in = Input(r, count);
            auto mine = RoundTrip(codec, in.data(), count);  // chunks cut no block
            CHECK(std::memcmp(got[r].sent.data(), mine.data(), count * sizeof(float)) == 0);
          }
          if (oc == Codec::kNone && op == ReduceOp::kSum) {
            // float32 on the wire: the plain sum in rank order.
            for (size_t i = 0; i < count; ++i) {
              float sum = Input(0, count)[i];
              for (size_t r = 1; r < world; ++r) sum += Input(r, count)[i];
              REQUIRE(got[0].data[i] == sum);
            }
          }
        }
      }
    }
  }
}

// Steps of the encoded allreduce of the same inputs with result_feedback: each owner encodes
// its chunk's sum plus its residual, every member decodes the same bytes, and the owner keeps
// what its encoding dropped; a member's residual outside its own chunk is never touched.
TEST_CASE("encoded allreduce with result_feedback: the owner's rounding is kept for the next") {
  constexpr size_t kWorld = 3, kCount = 5000, kSteps = 3;
  Members m(kWorld);
  m.Reconfigure(1);
  for (Codec oc : {Codec::kInt4, Codec::kInt8, Codec::kBf16}) {
    BlockCodec codec(oc);
    CAPTURE(codec.name());
    // Each member's residual starts with a pattern of its own, so that "left as they are"
    // outside its chunk is seen, and its own chunk's start is carried into the first result.
    std::vector<std::vector<float>> fb(kWorld), want_fb(kWorld);
    for (size_t r = 0; r < kWorld; ++r) {
      fb[r].resize(kCount);
      for (size_t i = 0; i < kCount; ++i) fb[r][i] = 0.01f * static_cast<float>((i + r) % 5);
      want_fb[r] = fb[r];
    }
    for (size_t step = 0; step < kSteps; ++step) {
      CAPTURE(step);
      // The reference: per owner c, y = decode-sum of the contributions + c's residual, encoded
      // once; the members hold decode(y) and c keeps y - decode(y).
      std::vector<float> want(kCount);
      for (size_t c = 0; c < kWorld; ++c) {
        Chunk ch = EncodedChunk(kCount, codec.block_elems(), kWorld, c);
        std::vector<std::vector<uint8_t>> enc(kWorld);
        std::vector<const uint8_t*> ptrs;
        for (size_t r = 0; r < kWorld; ++r) {
          auto in = Input(r, kCount);
          enc[r].resize(codec.EncodedBytes(ch.size));
          codec.Encode(in.data() + ch.begin, ch.size, enc[r].data());
          ptrs.push_back(enc[r].data());
        }
        std::vector<float> y(ch.size), scratch(ch.size);
        ReduceEncoded(codec, ptrs, ch.size, ReduceOp::kSum, y.data(), scratch.data());
        for (size_t i = 0; i < ch.size; ++i) y[i] += want_fb[c][ch.begin + i];
        auto back = RoundTrip(codec, y.data(), ch.size);
        for (size_t i = 0; i < ch.size; ++i) {
          want[ch.begin + i] = back[i];
          want_fb[c][ch.begin + i] = y[i] - back[i];
        }
      }
      std::vector<std::future<Outcome>> fs;
      for (size_t r = 0; r < kWorld; ++r) {
        fs.push_back(std::async(std::launch::async, [&, r] {
          Outcome o{Status::Ok(), Input(r, kCount), {}};
          o.status = m.comms[r]->AllReduceEncoded(o.data, codec, ReduceOp::kSum, {}, fb[r]);
          return o;
        }));
      }
      for (size_t r = 0; r < kWorld; ++r) {
        Outcome o = fs[r].get();
        REQUIRE(o.status.ok());
        CHECK(std::memcmp(o.data.data(), want.data(), kCount * sizeof(float)) == 0);
        CHECK(std::memcmp(fb[r].data(), want_fb[r].data(), kCount * sizeof(float)) == 0);
      }
    }
  }
  // A residual of another length is refused before anything is sent.
  std::vector<float> v(10, 1.0f), short_fb(9, 0.0f);
  BlockCodec int8(Codec::kInt8);
  Status st = m.comms[0]->AllReduceEncoded(v, int8, ReduceOp::kSum, {}, short_fb);
  CHECK(st.code() == Code::kInvalidArgument);
  CHECK(st.message().find("result_feedback") != std::string::npos);
}

TEST_CASE("encoded allreduce of four members needs full_mesh, and says so") {
  Members m(4, Millis(20'000), /*full_mesh=*/false);
  m.Reconfigure(1);
  std::vector<float> v(10, 1.0f);
  BlockCodec codec(Codec::kInt8);
  Status st = m.comms[0]->AllReduceEncoded(v, codec, ReduceOp::kSum);
  CHECK(st.code() == Code::kInvalidArgument);
  CHECK(st.message().find("full_mesh") != std::string::npos);
  // The communicator is not failed by a refused call: the float32 ring still works.
  std::vector<std::future<Status>> fs;
  std::vector<std::vector<float>> bufs(4, std::vector<float>(10, 1.0f));
  for (size_t r = 0; r < 4; ++r) {
    fs.push_back(std::async(std::launch::async, [&, r] {
      return m.comms[r]->AllReduce(bufs[r].data(), 10, DType::kFloat32, ReduceOp::kSum);
    }));
  }
  for (auto& f : fs) CHECK(f.get().ok());
  CHECK(bufs[3][9] == 4.0f);
}

TEST_CASE("encoded allreduce: Abort wakes a blocked member at once and its peers fail too") {
  Members m(3);
  m.Reconfigure(5);
  BlockCodec codec(Codec::kInt8);
  std::vector<float> v0(100'000, 1.0f), v1(100'000, 2.0f), v2(100'000, 3.0f);
  // Members 0 and 1 enter; member 2 never does, so both block until the notice, which comes
  // once both threads are asleep in their wait.
  auto start = std::chrono::steady_clock::now();
  const pid_t member0 = test::CurrentTid();
  std::atomic<pid_t> member1{0};
  bool ordered = false;
  std::thread notice([&] {
    ordered = test::WaitUntil(
        [&] {
          return member1.load() != 0 && test::ThreadAsleep(::getpid(), member0) &&
                 test::ThreadAsleep(::getpid(), member1.load());
        },
        10s, "members 0 and 1 blocked in the encoded allreduce");
    m.comms[0]->Abort("failure notice");
  });
  auto peer1 = std::async(std::launch::async, [&] {
    member1 = test::CurrentTid();
    return m.comms[1]->AllReduceEncoded(v1, codec, ReduceOp::kAvg);
  });
  Status st = m.comms[0]->AllReduceEncoded(v0, codec, ReduceOp::kAvg);
  auto waited = std::chrono::steady_clock::now() - start;
  notice.join();
  CHECK(ordered);
  CHECK(st.code() == Code::kAborted);
  CHECK(st.message().find("failure notice") != std::string::npos);
  CHECK(waited < 10s);  // the op timeout is 20 s: only a hang gets here
  Status st1 = peer1.get();
  CHECK(st1.code() == Code::kAborted);
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  // Failed until a newer quorum, which then works.
  CHECK(m.comms[0]->AllReduceEncoded(v0, codec, ReduceOp::kAvg).code() == Code::kAborted);
  CHECK(m.comms[2]->AllReduceEncoded(v2, codec, ReduceOp::kAvg).code() == Code::kAborted);
  m.Reconfigure(6);
  auto got = RunAll(m, codec, 1000, ReduceOp::kAvg);
  for (auto& o : got) CHECK(o.status.ok());
  CHECK(std::memcmp(got[0].data.data(), got[2].data.data(), 1000 * sizeof(float)) == 0);
}

TEST_CASE("encoded allreduce past op_timeout is DeadlineExceeded for every member that entered") {
  Members m(3, Millis(400));
  m.Reconfigure(1);
  BlockCodec codec(Codec::kInt4);
  std::vector<float> v0(1000, 1.0f), v1(1000, 1.0f);
  auto start = std::chrono::steady_clock::now();
  auto peer1 = std::async(std::launch::async,
                          [&] { return m.comms[1]->AllReduceEncoded(v1, codec, ReduceOp::kSum); });
  Status st = m.comms[0]->AllReduceEncoded(v0, codec, ReduceOp::kSum);
  Status st1 = peer1.get();
  // Whichever deadline fires first resets the connections; the other may see the reset first.
  CHECK((st.code() == Code::kDeadlineExceeded || st.code() == Code::kAborted));
  CHECK((st1.code() == Code::kDeadlineExceeded || st1.code() == Code::kAborted));
  CHECK((st.code() == Code::kDeadlineExceeded || st1.code() == Code::kDeadlineExceeded));
  CHECK(std::chrono::steady_clock::now() - start < 10s);
}

TEST_CASE("a member with another codec makes the collective fail with a conflict, not a hang") {
  Members m(2);
  m.Reconfigure(1);
  BlockCodec int8(Codec::kInt8), bf16(Codec::kBf16);
  std::vector<float> v0(5000, 1.0f), v1(5000, 1.0f);
  auto start = std::chrono::steady_clock::now();
  auto peer1 = std::async(std::launch::async,
                          [&] { return m.comms[1]->AllReduceEncoded(v1, bf16, ReduceOp::kAvg); });
  Status st = m.comms[0]->AllReduceEncoded(v0, int8, ReduceOp::kAvg);
  Status st1 = peer1.get();
  // Each receives the other's phase-1 chunk first: both see the conflict, or one sees it and
  // the other the reset it causes.
  CHECK((st.code() == Code::kConflict || st1.code() == Code::kConflict));
  CHECK_FALSE(st.ok());
  CHECK_FALSE(st1.ok());
  CHECK(std::chrono::steady_clock::now() - start < 10s);
}

// A group left on float32 (the ring) while another runs the encoded exchange: the two use
// separate Gloo slots, so nobody receives a message of the wrong shape; both run out at the op
// deadline (or see the reset of the other's deadline) instead of crashing or hanging.
TEST_CASE("a ring allreduce against an encoded one ends at the deadline, not in a crash") {
  Members m(2, Millis(500));
  m.Reconfigure(1);
  BlockCodec int8(Codec::kInt8);
  std::vector<float> v0(5000, 1.0f), v1(5000, 1.0f);
  auto start = std::chrono::steady_clock::now();
  auto peer1 = std::async(std::launch::async,
                          [&] { return m.comms[1]->AllReduceEncoded(v1, int8, ReduceOp::kAvg); });
  Status st = m.comms[0]->AllReduce(v0.data(), v0.size(), DType::kFloat32, ReduceOp::kAvg);
  Status st1 = peer1.get();
  CHECK((st.code() == Code::kDeadlineExceeded || st.code() == Code::kAborted));
  CHECK((st1.code() == Code::kDeadlineExceeded || st1.code() == Code::kAborted));
  CHECK((st.code() == Code::kDeadlineExceeded || st1.code() == Code::kDeadlineExceeded));
  CHECK(std::chrono::steady_clock::now() - start < 10s);
}

}  // namespace
}  // namespace lk::comm
