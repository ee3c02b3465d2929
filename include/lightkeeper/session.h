// The trainer's side of Lightkeeper: a Session talks to the node's replica agent over its Unix
// socket (LK_AGENT_SOCKET). Call Poll(step) once per outer step, Commit(step, ok) after it, use
// the rendezvous KV to build communicators, and register a notice callback that aborts
// collectives when the quorum loses a member.
// Thread-safety: Poll, Commit and the KV calls from one thread at a time; the notice callback
// runs on the session's own thread, which ~Session stops and joins: once the destructor
// returns the callback is not running and never runs again. The library never changes a
// process-wide signal disposition.
#pragma once

#include <lightkeeper/api.h>
#include <lightkeeper/clock.h>
#include <lightkeeper/status.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

// Declared only: this header is public (liblightkeeper), and the HTTP client (Beast, Asio,
// protobuf) and the poll board stay behind it.
namespace lk::http {
class Client;
}  // namespace lk::http
namespace lk::board {
class View;
}  // namespace lk::board

namespace lk::client {

struct PollResult {
  uint32_t quorum_id = 0;
  uint32_t replica_rank = 0;
  uint32_t replica_world_size = 0;
  uint32_t max_step = 0;
  bool reconfigure = false;  // rebuild the cross-group communicator for quorum_id
  bool heal = false;         // fetch state before the next outer step
  bool drain = false;        // stop now (after a durable save when checkpoint_now)
  bool checkpoint_now = false;
  bool initial = false;                   // first start: take replica_rank 0's initial weights
  std::vector<std::string> heal_sources;  // peers' agent addresses (HOST:PORT)
  std::string restore_location;           // durable checkpoint to restore when no live source
  uint32_t restore_step = 0;
  std::string reason;
  // Every member's group size, index = replica_rank, on the answer that joins a quorum (over
  // the socket) whose groups differ in size (only with SetMixedGroupSizes); empty when they are
  // all equal, on answers from the poll board and from a lighthouse that does not send them.
  // The caller keeps it for that quorum_id.
  std::vector<uint32_t> group_sizes;
  // Read from the agent's poll board (shared memory) instead of asked over the socket: the
  // answer was known before the poll, and nothing changed.
  bool from_board = false;
};

struct Notice {
  uint32_t quorum_id = 0;
  bool lost = false;            // the quorum lost a member: abort collectives in flight
  bool drain = false;           // the agent is draining the group
  bool checkpoint_now = false;  // with drain: save a durable checkpoint before exiting
  std::string reason;
};

class Session {
 public:
  // Connects and registers this process (its pid is watched by the agent). While nothing
  // listens on the socket yet (the agent starting beside the trainer, or a socket file left by
  // an earlier job) the hello is retried for up to 30 s, unless the socket's directory does not
  // exist; an answer of the agent is final.
  LK_API static Result<std::unique_ptr<Session>> Connect(const std::string& socket_path,
                                                         uint32_t group_rank, uint32_t group_size);
  // Socket from LK_AGENT_SOCKET.
  LK_API static Result<std::unique_ptr<Session>> FromEnv(uint32_t group_rank, uint32_t group_size);
  // Cancels the notice thread's long-poll and joins it (waiting for a callback in progress).
  // Do not destroy a Session from its own notice callback.
  LK_API ~Session();

  // Blocks until the agent answers for this outer step (at once when nothing changed).
  LK_API Result<PollResult> Poll(uint32_t step, Millis timeout = Millis(3'600'000));
  // `tokens`: what the whole group processed in this outer step (its weight in the average,
  // shown by the lighthouse); 0: not reported.
  LK_API Status Commit(uint32_t step, bool ok, const std::string& state_hash = "",
                       uint64_t tokens = 0);
  // Commit(step, false) about quorum `quorum_id` only: when the agent holds a newer quorum by
  // the time the report arrives, that quorum already replaced the failed one and the report
  // changes nothing (a late report must not fail the quorum that was formed to recover).
  LK_API Status ReportFailed(uint32_t step, uint32_t quorum_id);
  LK_API Status KvPut(uint32_t quorum_id, const std::string& key, const std::string& value);
  LK_API Result<std::string> KvGet(uint32_t quorum_id, const std::string& key, Millis timeout);
  // Tells the agent this trainer is done (its committed step reached the target), so that its
  // exit is not reported as a crash; when every trainer of the node is done the group leaves.
  LK_API Status Finish();
  // Around the cross-group collective: while every trainer of a group waits on the other
  // groups, the lighthouse does not count the time as this group's stall (progress timeout).
  LK_API Status SetPeerWait(bool waiting);
  // Registers a durable checkpoint (a directory every group can read, e.g. on a shared or
  // object filesystem) at the lighthouse, so that a job whose groups all lost their live state
  // restores it. Call it once per committed checkpoint, from one trainer of the group.
  LK_API Status RegisterCheckpoint(uint32_t step, const std::string& location,
                                   const std::string& manifest_digest);
  // This trainer averages across groups of other trainer counts (the DiLoCo library does, by
  // fragments): its group may then share a quorum with groups of other sizes, and the joining
  // poll's PollResult::group_sizes says each member's size. Off by default: a trainer that
  // only knows a collective over equal layouts keeps every quorum to one size. Call it before
  // the first Poll; every trainer of the group must say the same.
  void SetMixedGroupSizes(bool on) { mixed_group_sizes_ = on; }
  bool mixed_group_sizes() const { return mixed_group_sizes_; }

  // The last poll answer that carried a heal (PollResult::heal), whoever polled. The agent hands
  // a quorum's heal out once, to the first answer of that quorum: a caller that polled for
  // another reason first (the Python Manager's poll before its process group, then DiLoCo's
  // join) would otherwise join with no heal, so the DiLoCo join takes the plan from here when
  // its own answer of the same quorum came without it.
  const std::optional<PollResult>& last_heal() const { return last_heal_; }

  // Starts watching the quorum of the last Poll; `cb` runs once per lost quorum and on drain.
  LK_API void OnNotice(std::function<void(const Notice&)> cb);

  uint32_t group_rank() const { return group_rank_; }
  const std::string& socket_path() const { return socket_; }
  uint32_t group_size() const { return group_size_; }
  // The site's lk_gateway when the agent reaches the lighthouse through one (empty otherwise):
  // its URL, the job's token and name, and the CA of an https gateway. The DiLoCo library then
  // runs its cross-group exchange through the gateway.
  struct GatewayLink {
    std::string url;
    std::string token;
    std::string job;
    std::string ca_file;
  };
  const GatewayLink& gateway() const { return gateway_; }

 private:
  // What the notice thread shares with the Session.
  struct NoticeState {
    std::string socket;
    std::mutex mu;
    std::condition_variable cv;
    uint32_t watched_quorum_id = 0;
    std::function<void(const Notice&)> cb;
    std::atomic<bool> stop{false};
    http::Client* client = nullptr;  // the thread's own, while it has one: ~Session cancels it
  };

  Session(std::string socket, uint32_t group_rank, uint32_t group_size);
  static void NoticeLoop(std::shared_ptr<NoticeState> state);

  std::string socket_;
  uint32_t group_rank_;
  uint32_t group_size_;
  bool mixed_group_sizes_ = false;
  // Tells the notice thread which quorum this trainer's step runs on.
  void Watch(uint32_t quorum_id);

  std::unique_ptr<http::Client> client_;
  std::unique_ptr<board::View> board_;  // null: every poll goes over the socket
  bool polled_ = false;                 // a poll was answered: commits may use the board
  // The step whose last poll ended at its timeout: the next poll of it says it resumes that one.
  std::optional<uint32_t> timed_out_step_;
  std::string incarnation_;              // the agent's group life at hello
  GatewayLink gateway_;                  // from the hello
  std::optional<uint32_t> committed_;    // the last step this trainer committed
  std::optional<PollResult> last_heal_;  // see last_heal()
  std::shared_ptr<NoticeState> notice_;
  std::thread notice_thread_;
};

}  // namespace lk::client
