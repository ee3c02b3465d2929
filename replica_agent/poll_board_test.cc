// The poll board between real processes: the agent's side here, trainers' sides in this process
// and in forked children that map the same file.
#include "client/poll_board_reader.h"
#include "replica_agent/poll_board_writer.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <random>
#include <thread>

#include "common/log.h"
#include "tests/support/process.h"
#include "tests/support/thread_state.h"
#include "tests/support/wait.h"

namespace lk::board {
namespace {

using namespace std::chrono_literals;

Answer Make(uint32_t step, uint32_t quorum_id, std::string reason = "unchanged") {
  Answer a;
  a.step = step;
  a.quorum_id = quorum_id;
  a.replica_rank = quorum_id % 7;
  a.replica_world_size = 8;
  a.max_step = step + 1;
  a.reason = std::move(reason);
  return a;
}

TEST_CASE("an answer on the board is taken once per trainer, for its step only") {
  auto dir = test::TempDir("board");
  auto b = Board::Create(dir + "/a.sock.board");
  REQUIRE(b.ok());
  auto t0 = View::Open((*b)->path(), 0);
  auto t1 = View::Open((*b)->path(), 1);
  REQUIRE(t0.ok());
  REQUIRE(t1.ok());
  CHECK_FALSE((*t0)->Take(0).has_value());  // nothing up yet

  std::string long_reason(400, 'x');
  (*b)->Publish(Make(5, 9, long_reason));
  CHECK((*b)->Ready().has_value());
  CHECK_FALSE((*t0)->Take(4).has_value());  // another step: over the socket
  auto a = (*t0)->Take(5);
  REQUIRE(a.has_value());
  CHECK(a->step == 5);
  CHECK(a->quorum_id == 9);
  CHECK(a->replica_rank == 2);
  CHECK(a->replica_world_size == 8);
  CHECK(a->max_step == 6);
  CHECK(a->reason == long_reason.substr(0, kMaxReason));
  // Taken, it stands: the agent cannot withdraw it, and the other trainer gets the same answer.
  auto taken = (*b)->Taken();
  REQUIRE(taken.has_value());
  CHECK(taken->step == 5);
  CHECK_FALSE((*b)->Withdraw());
  CHECK((*b)->Taken().has_value());
  auto other = (*t1)->Take(5);
  REQUIRE(other.has_value());
  CHECK(other->quorum_id == 9);
  CHECK((*b)->Consumed(0) == taken->gen);
  CHECK((*b)->Consumed(1) == taken->gen);
  // A second poll of the same step (the first one's step failed) needs a new round.
  CHECK_FALSE((*t0)->Take(5).has_value());

  // The next step: withdrawn before anyone took it, it is gone for every trainer.
  (*b)->Publish(Make(6, 9));
  CHECK((*b)->Withdraw());
  CHECK_FALSE((*b)->Ready().has_value());
  CHECK_FALSE((*t0)->Take(6).has_value());
  CHECK((*b)->Taken() == std::nullopt);
  // Published again with a new quorum, the agent can take it for a trainer on the socket.
  (*b)->Publish(Make(6, 10));
  auto by_agent = (*b)->TakeFor(6);
  REQUIRE(by_agent.has_value());
  auto late = (*t1)->Take(6);
  REQUIRE(late.has_value());
  CHECK(late->quorum_id == 10);

  // Closed (the agent drains): every poll goes over the socket.
  (*b)->Publish(Make(7, 10));
  (*b)->Close();
  CHECK_FALSE((*t0)->Take(7).has_value());
  CHECK_FALSE((*b)->Ready().has_value());
}

TEST_CASE("a file that is not a board of this version is refused with the reason") {
  auto dir = test::TempDir("board-bad");
  std::ofstream(dir + "/short") << "not a board";
  auto r = View::Open(dir + "/short", 0);
  CHECK_FALSE(r.ok());
  CHECK(r.status().message().find("is not a poll board") != std::string::npos);
  CHECK_FALSE(View::Open(dir + "/missing", 0).ok());
  auto b = Board::Create(dir + "/b.board");
  REQUIRE(b.ok());
  auto out_of_range = View::Open((*b)->path(), kMaxSlots);
  CHECK_FALSE(out_of_range.ok());
  CHECK(out_of_range.status().message().find("slot") != std::string::npos);
  // The right size with another magic: a file of something else.
  {
    std::ifstream in((*b)->path(), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    bytes[0] ^= 0x55;
    std::ofstream(dir + "/forged", std::ios::binary) << bytes;
  }
  CHECK_FALSE(View::Open(dir + "/forged", 0).ok());
}

TEST_CASE("a new board replaces an old one at the same path - the old one's unlink spares it") {
  auto dir = test::TempDir("board-replace");
  std::ofstream(dir + "/s.board") << "left over by a crashed agent";
  auto old_board = Board::Create(dir + "/s.board");
  REQUIRE(old_board.ok());
  auto old_view = View::Open(dir + "/s.board", 0);
  REQUIRE(old_view.ok());
  auto new_board = Board::Create(dir + "/s.board");
  REQUIRE(new_board.ok());
  (*old_board)->Unlink();
  CHECK(access((dir + "/s.board").c_str(), F_OK) == 0);
  // The old trainer's mapping is the old board: nothing the new agent publishes reaches it.
  (*new_board)->Publish(Make(1, 3));
  CHECK_FALSE((*old_view)->Take(1).has_value());
  (*new_board)->Unlink();
  CHECK(access((dir + "/s.board").c_str(), F_OK) != 0);
}

TEST_CASE("a commit left in a slot wakes the agent - the board refuses what the socket would") {
  auto dir = test::TempDir("board-commit");
  auto b = Board::Create(dir + "/c.board");
  REQUIRE(b.ok());
  CHECK_FALSE((*b)->CommitOf(3).has_value());
  uint32_t seen = (*b)->Doorbell();
  const pid_t agent = ::getpid(), waiter = test::CurrentTid();
  pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // A trainer in slot 3, after the agent went to sleep on the doorbell (its thread asleep in
    // the futex wait); it commits anyway when that never shows, and says so in its exit code.
    auto v = View::Open(dir + "/c.board", 3);
    if (!v.ok()) _exit(2);
    bool ordered = test::WaitUntil([&] { return test::ThreadAsleep(agent, waiter, SYS_futex); },
                                   30s, "the agent asleep on the doorbell");
    bool refused = !(*v)->Commit(0, "h") && !(*v)->Commit(9, std::string(kMaxStateHash + 1, 'x'));
    bool done = (*v)->Commit(7, std::string(kMaxStateHash, 'h'));
    _exit(!(refused && done) ? 3 : ordered ? 0 : 4);
  }
  auto t0 = std::chrono::steady_clock::now();
  while ((*b)->Doorbell() == seen && std::chrono::steady_clock::now() - t0 < 30s) {
    (*b)->WaitDoorbell(seen, 60s);  // woken by the commit, not by the timeout (a hang bound only)
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 30s);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WEXITSTATUS(status) == 0);
  auto c = (*b)->CommitOf(3);
  REQUIRE(c.has_value());
  CHECK(c->step == 7);
  CHECK(c->state_hash == std::string(kMaxStateHash, 'h'));
  CHECK_FALSE((*b)->CommitOf(2).has_value());
  // The agent's own ring (how it stops its waiting thread) wakes a waiter too.
  seen = (*b)->Doorbell();
  bool ordered = false;
  std::thread ring([&] {
    ordered = test::WaitUntil([&] { return test::ThreadAsleep(agent, waiter, SYS_futex); }, 30s,
                              "the waiter asleep on the doorbell");
    (*b)->RingDoorbell();
  });
  t0 = std::chrono::steady_clock::now();
  (*b)->WaitDoorbell(seen, 60s);
  ring.join();
  CHECK(ordered);
  CHECK((*b)->Doorbell() != seen);
  CHECK(std::chrono::steady_clock::now() - t0 < 30s);
}

// The property the board exists for, between two processes: for every publication exactly one
// of "the agent withdrew it" and "a trainer took it" happens, and what the trainer took is the
// whole answer the agent published, never a mix of two.
TEST_CASE("publish, take and withdraw racing across processes: exactly one wins - never a torn answer") {
  auto dir = test::TempDir("board-race");
  auto b = Board::Create(dir + "/r.board");
  REQUIRE(b.ok());
  constexpr uint32_t kSteps = 3000;
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  auto reason_of = [](uint32_t q) { return std::string(100 + q % 97, static_cast<char>('a' + q % 26)); };
  pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // A trainer: takes the answer of every step in turn and reports which quorum it got.
    close(fds[0]);
    auto v = View::Open(dir + "/r.board", 0);
    if (!v.ok()) _exit(2);
    auto deadline = std::chrono::steady_clock::now() + 60s;
    for (uint32_t s = 0; s < kSteps; ++s) {
      std::optional<Answer> a;
      while (!(a = (*v)->Take(s))) {
        if (std::chrono::steady_clock::now() > deadline) _exit(3);
      }
      bool whole = a->reason == reason_of(a->quorum_id) && a->replica_rank == a->quorum_id % 7 &&
                   a->max_step == s + 1;
      uint32_t rec[2] = {a->quorum_id, whole ? 1u : 0u};
      if (write(fds[1], rec, sizeof(rec)) != sizeof(rec)) _exit(4);
    }
    _exit(0);
  }
  close(fds[1]);
  std::mt19937 rng(7);
  std::vector<uint32_t> expected(kSteps);
  auto deadline = std::chrono::steady_clock::now() + 60s;
  for (uint32_t s = 0; s < kSteps && std::chrono::steady_clock::now() < deadline; ++s) {
    // Publish, wait a random moment, then try to withdraw; if the withdrawal wins, the step's
    // answer is published again with another quorum, which the trainer must be the one to get.
    (*b)->Publish(Make(s, 2 * s, reason_of(2 * s)));
    for (uint32_t spin = rng() % 4000; spin > 0; --spin) asm volatile("" ::: "memory");
    if ((*b)->Withdraw()) {
      (*b)->Publish(Make(s, 2 * s + 1, reason_of(2 * s + 1)));
      expected[s] = 2 * s + 1;
    } else {
      expected[s] = 2 * s;
    }
    while (!(*b)->Taken() || (*b)->Taken()->step != s) {
      if (std::chrono::steady_clock::now() > deadline) break;
    }
  }
  uint32_t withdrawn = 0, torn = 0, wrong = 0;
  for (uint32_t s = 0; s < kSteps; ++s) {
    uint32_t rec[2];
    REQUIRE(read(fds[0], rec, sizeof(rec)) == sizeof(rec));
    withdrawn += expected[s] % 2;
    torn += rec[1] == 0;
    wrong += rec[0] != expected[s];
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(torn == 0);
  CHECK(wrong == 0);
  MESSAGE(fmt::format("{} of {} publications withdrawn before the trainer took them", withdrawn, kSteps));
}

}  // namespace
}  // namespace lk::board
