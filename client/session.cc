#include <lightkeeper/session.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <thread>

#include "client/poll_board_reader.h"
#include "client/session_store.h"
#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/log.h"
#include "common/proto/lightkeeper.pb.h"

namespace lk::client {

namespace pb = lightkeeper::v1;

namespace {
// How long Connect retries a hello that nothing answers (the agent not listening yet).
constexpr Millis kAgentWait{30'000};
}  // namespace

Session::Session(std::string socket, uint32_t group_rank, uint32_t group_size)
    : socket_(std::move(socket)),
      group_rank_(group_rank),
      group_size_(group_size),
      notice_(std::make_shared<NoticeState>()) {
  notice_->socket = socket_;
}

Result<std::unique_ptr<Session>> Session::Connect(const std::string& socket_path,
                                                  uint32_t group_rank, uint32_t group_size) {
  std::unique_ptr<Session> s(new Session(socket_path, group_rank, group_size));
  LK_ASSIGN_OR_RETURN(s->client_, http::Client::Create("unix:" + socket_path));
  pb::TrainerHelloRequest hello;
  hello.set_group_rank(group_rank);
  hello.set_group_size(group_size);
  hello.set_pid(static_cast<uint32_t>(getpid()));
  pb::TrainerHelloResponse welcome;
  // A trainer may start before its agent listens (both steps of a Slurm job start together; a
  // socket file left by an earlier job of the same id refuses connections until the new agent
  // replaces it): the hello is retried while nothing listens, up to kAgentWait. An answer of
  // the agent, a refusal with its reason included, is final, and so is a socket in a directory
  // that does not exist (a mistyped path: no agent is coming there).
  const auto parent = std::filesystem::path(socket_path).parent_path();
  std::error_code ec;
  const bool may_come = parent.empty() || std::filesystem::is_directory(parent, ec);
  const auto until = std::chrono::steady_clock::now() + (may_come ? kAgentWait : Millis(0));
  Status st;
  for (;;) {
    st = s->client_->Call("POST", "/v1/trainer/hello", hello, &welcome, Millis(10'000));
    const bool nobody_listens =
        st.code() == Code::kUnavailable && st.reason() == Reason::kUnspecified;
    if (!nobody_listens || std::chrono::steady_clock::now() >= until) break;
    std::this_thread::sleep_for(Millis(100));
  }
  LK_RETURN_IF_ERROR(st.WithContext("hello to agent at " + socket_path));
  s->incarnation_ = welcome.incarnation();
  s->gateway_ = GatewayLink{welcome.gateway(), welcome.gateway_token(), welcome.job(),
                            welcome.gateway_ca_file()};
  if (!welcome.poll_board().empty()) {
    // Without the board (another version, a file this process cannot map) every poll goes over
    // the socket: slower, same answers.
    auto view = board::View::Open(welcome.poll_board(), welcome.poll_slot());
    if (view.ok()) {
      s->board_ = std::move(*view);
    } else {
      LK_LOG_WARN("poll_board_unused error={}", Q(view.status().ToString()));
    }
  }
  return s;
}

Result<std::unique_ptr<Session>> Session::FromEnv(uint32_t group_rank, uint32_t group_size) {
  const char* path = std::getenv("LK_AGENT_SOCKET");
  if (path == nullptr || *path == '\0') {
    return InvalidArgument("LK_AGENT_SOCKET is not set: start the replica_agent first");
  }
  return Connect(path, group_rank, group_size);
}

Session::~Session() {
  {
    std::lock_guard<std::mutex> lock(notice_->mu);
    notice_->stop = true;
    if (notice_->client != nullptr) notice_->client->Cancel();  // it may sit in a long-poll
  }
  notice_->cv.notify_all();
  if (!notice_thread_.joinable()) return;
  if (notice_thread_.get_id() == std::this_thread::get_id()) {
    // Destroyed from its own callback (which the header forbids): the thread cannot join
    // itself. It owns the state it shares, and returns as soon as the callback does.
    notice_thread_.detach();
    return;
  }
  notice_thread_.join();
}

void Session::Watch(uint32_t quorum_id) {
  {
    std::lock_guard<std::mutex> lock(notice_->mu);
    if (notice_->watched_quorum_id == quorum_id) return;
    notice_->watched_quorum_id = quorum_id;
  }
  notice_->cv.notify_all();
}

Result<PollResult> Session::Poll(uint32_t step, Millis timeout) {
  if (board_) {
    if (auto a = board_->Take(step)) {
      PollResult r;
      r.quorum_id = a->quorum_id;
      r.replica_rank = a->replica_rank;
      r.replica_world_size = a->replica_world_size;
      r.max_step = a->max_step;
      r.reason = std::move(a->reason);
      r.from_board = true;
      Watch(r.quorum_id);
      polled_ = true;
      return r;
    }
  }
  pb::TrainerPollRequest req;
  req.set_group_rank(group_rank_);
  req.set_group_size(group_size_);
  req.set_step(step);
  req.set_mixed_group_sizes(mixed_group_sizes_);
  req.set_resumed(timed_out_step_ == step);
  pb::TrainerPollResponse resp;
  Status called = client_->Call("POST", "/v1/trainer/poll", req, &resp, timeout);
  timed_out_step_.reset();
  if (called.code() == Code::kDeadlineExceeded) timed_out_step_ = step;
  LK_RETURN_IF_ERROR(called);
  if (!incarnation_.empty() && !resp.incarnation().empty() && resp.incarnation() != incarnation_) {
    // A new agent on the same socket: this process's state, pid watch and board slot belong
    // to the group life that ended. Going on would commit into a board nobody reads.
    return Error(Code::kConflict,
                 "the agent was restarted (group life {} is now {}): this trainer belongs to the "
                 "ended life and must be restarted with its group",
                 incarnation_, resp.incarnation());
  }
  PollResult r;
  r.quorum_id = resp.quorum_id();
  r.replica_rank = resp.replica_rank();
  r.replica_world_size = resp.replica_world_size();
  r.max_step = resp.max_step();
  r.reconfigure = resp.reconfigure();
  r.heal = resp.heal();
  r.drain = resp.drain();
  r.checkpoint_now = resp.checkpoint_now();
  r.initial = resp.initial();
  r.heal_sources.assign(resp.heal_sources().begin(), resp.heal_sources().end());
  if (resp.has_restore_checkpoint()) {
    r.restore_location = resp.restore_checkpoint().location();
    r.restore_step = resp.restore_checkpoint().step();
  }
  r.reason = resp.reason();
  r.group_sizes.assign(resp.group_sizes().begin(), resp.group_sizes().end());
  if (!r.drain) Watch(r.quorum_id);
  polled_ = true;
  if (r.heal) last_heal_ = r;
  return r;
}

Status Session::Commit(uint32_t step, bool ok, const std::string& state_hash, uint64_t tokens) {
  // A successful step after a poll goes on the board: the agent takes it from this trainer's
  // slot. What the agent would refuse is refused here the same way; a failed step, and one
  // before any poll, go over the socket.
  if (board_ && ok && polled_ && state_hash.size() <= board::kMaxStateHash) {
    if (committed_ && step <= *committed_) {
      return Error(Code::kConflict, "step {} is not after the committed step {}", step,
                   *committed_);
    }
    if (board_->Commit(step, state_hash, tokens)) {
      committed_ = step;
      return Status::Ok();
    }
  }
  pb::TrainerCommitRequest req;
  req.set_group_rank(group_rank_);
  req.set_step(step);
  req.set_failed(!ok);
  req.set_state_hash(state_hash);
  req.set_tokens(tokens);
  Status st = client_->Call("POST", "/v1/trainer/commit", req, nullptr, Millis(30'000));
  if (st.ok() && ok) committed_ = step;
  return st;
}

Status Session::ReportFailed(uint32_t step, uint32_t quorum_id) {
  pb::TrainerCommitRequest req;
  req.set_group_rank(group_rank_);
  req.set_step(step);
  req.set_failed(true);
  req.set_quorum_id(quorum_id);
  return client_->Call("POST", "/v1/trainer/commit", req, nullptr, Millis(30'000));
}

Status Session::Finish() {
  pb::TrainerHelloRequest req;
  req.set_group_rank(group_rank_);
  req.set_group_size(group_size_);
  req.set_pid(static_cast<uint32_t>(getpid()));
  return client_->Call("POST", "/v1/trainer/goodbye", req, nullptr, Millis(10'000));
}

// Keys are percent-encoded (their '/' kept): the agent decodes the path, so a raw '?', '#', '%',
// '+' or space would otherwise cut, change or break the key.
Status TrainerKvPut(http::Client& agent, uint32_t quorum_id, const std::string& key,
                    const std::string& value) {
  LK_ASSIGN_OR_RETURN(
      http::Response r,
      agent.Do("PUT", fmt::format("/v1/trainer/kv/{}/{}", quorum_id, http::PercentEncodePath(key)),
               value, "application/octet-stream", Millis(30'000)));
  return http::StatusFromResponse(r);
}

Result<std::string> TrainerKvGet(http::Client& agent, uint32_t quorum_id, const std::string& key,
                                 Millis timeout) {
  LK_ASSIGN_OR_RETURN(http::Response r,
                      agent.Do("GET",
                               fmt::format("/v1/trainer/kv/{}/{}?timeout_ms={}", quorum_id,
                                           http::PercentEncodePath(key), timeout.count()),
                               "", "application/octet-stream", timeout + Millis(5000)));
  LK_RETURN_IF_ERROR(http::StatusFromResponse(r));
  return std::move(r.body);
}

Status Session::KvPut(uint32_t quorum_id, const std::string& key, const std::string& value) {
  return TrainerKvPut(*client_, quorum_id, key, value);
}

Result<std::string> Session::KvGet(uint32_t quorum_id, const std::string& key, Millis timeout) {
  return TrainerKvGet(*client_, quorum_id, key, timeout);
}

Status Session::SetPeerWait(bool waiting) {
  if (board_) {
    board_->SetPeerWait(waiting);
    return Status::Ok();
  }
  pb::TrainerPhaseRequest req;
  req.set_group_rank(group_rank_);
  req.set_peer_wait(waiting);
  return client_->Call("POST", "/v1/trainer/phase", req, nullptr, Millis(10'000));
}

Status Session::RegisterCheckpoint(uint32_t step, const std::string& location,
                                   const std::string& manifest_digest) {
  pb::CheckpointInfo req;
  req.set_step(step);
  req.set_location(location);
  req.set_manifest_digest(manifest_digest);
  // The lighthouse registers a checkpoint only at a step the job committed, and this node's
  // commit of `step` may still be on its way there (the agent sends commits on their own
  // thread, and the node commits once all its trainers did): wait for it a few seconds.
  Status st;
  for (int attempt = 0; attempt < 12; ++attempt) {
    st = client_->Call("POST", "/v1/trainer/checkpoint", req, nullptr, Millis(30'000));
    if (st.reason() != Reason::kCheckpointNotCommitted) return st;
    std::this_thread::sleep_for(Millis(10 << std::min(attempt, 6)));
  }
  return st;
}

void Session::OnNotice(std::function<void(const Notice&)> cb) {
  {
    std::lock_guard<std::mutex> lock(notice_->mu);
    notice_->cb = std::move(cb);
  }
  if (!notice_thread_.joinable()) {
    notice_thread_ = std::thread([state = notice_] { NoticeLoop(state); });
  }
}

void Session::NoticeLoop(std::shared_ptr<NoticeState> st) {
  auto client = http::Client::Create("unix:" + st->socket);
  if (!client.ok()) return;
  {
    std::lock_guard<std::mutex> lock(st->mu);
    if (st->stop) return;
    st->client = client->get();
  }
  struct Unregister {
    NoticeState* st;
    ~Unregister() {
      std::lock_guard<std::mutex> lock(st->mu);
      st->client = nullptr;
    }
  } unregister{st.get()};
  auto deliver = [&](const Notice& n) {
    std::function<void(const Notice&)> cb;
    {
      std::lock_guard<std::mutex> lock(st->mu);
      cb = st->cb;
    }
    if (cb && !st->stop) cb(n);
  };
  uint32_t handled = 0;  // the last quorum id a notice was delivered for
  while (!st->stop) {
    uint32_t qid;
    {
      std::unique_lock<std::mutex> lock(st->mu);
      st->cv.wait(lock, [&] {
        return st->stop || (st->watched_quorum_id != 0 && st->watched_quorum_id != handled);
      });
      if (st->stop) return;
      qid = st->watched_quorum_id;
    }
    auto r =
        (*client)->Do("GET", fmt::format("/v1/trainer/notice?quorum_id={}&timeout_ms=30000", qid),
                      "", http::kProtoType, Millis(35'000));
    pb::TrainerNoticeResponse n;
    if (!r.ok() || !http::StatusFromResponse(*r).ok() ||
        !http::Decode(r->body, http::BodyFormat(r->content_type), &n).ok()) {
      // The agent is gone: that is a drain for this trainer.
      deliver(Notice{qid, true, true, false, r.ok() ? "agent error" : r.status().message()});
      return;
    }
    if (!n.lost() && !n.drain()) continue;
    handled = qid;
    deliver(Notice{qid, n.lost(), n.drain(), n.checkpoint_now(), n.reason()});
    if (n.drain()) return;
  }
}

}  // namespace lk::client
