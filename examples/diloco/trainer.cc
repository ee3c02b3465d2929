#include "examples/diloco/trainer.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <optional>
#include <thread>

#include "common/log.h"
#include "examples/diloco/net_bytes.h"
#include "examples/diloco/prefixed_store.h"
#include "examples/diloco/state_io.h"
#include "replica_agent/client/session.h"
#include "replica_agent/client/session_store.h"
#include "replica_agent/comm/comm.h"

namespace lk::diloco {

namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Where the wall time and the bytes of one committed outer step went, from the commit before
// (or the start of the process) to this one, retries of a failed attempt included. Logged with
// the step, for bench/diloco_bench.sh: coordination (poll, join, commit) against training.
struct StepStats {
  double poll_ms = 0;       // in Session::Poll, waiting for the quorum
  double join_ms = 0;       // joining a new quorum: communicator rebuild, heal, state sync
  double inner_ms = 0;      // the H inner steps, with the intra-group gradient allreduces
  double discarded_ms = 0;  // inner steps whose pseudo-gradient a heal threw away
  double allreduce_ms = 0;  // the cross-group pseudo-gradient allreduce (all attempts)
  double gather_ms = 0;     // outer update and the intra-group all-gather of the new weights
  double publish_ms = 0;    // live state for healing peers
  double commit_ms = 0;     // Session::Commit
  double eval_ms = 0;       // --eval-batches
  uint64_t cross_bytes = 0;  // TCP bytes sent by the cross-group allreduce
  uint64_t sync_bytes = 0;   // TCP bytes sent while joining a quorum
  uint64_t group_bytes = 0;  // TCP bytes sent inside the group (gradients, all-gather)
};

// The notice callback runs on the session's thread and may outlive the trainer's objects (the
// session detaches that thread), so it reaches the communicator only through this holder.
struct NoticeSink {
  std::mutex mu;
  comm::CommManager* slot = nullptr;  // guarded by mu; cleared before the comm goes away
  std::atomic<bool> drain{false};
};

class Trainer {
 public:
  explicit Trainer(const TrainerOptions& o) : o_(o), sink_(std::make_shared<NoticeSink>()) {}
  ~Trainer() {
    std::lock_guard lock(sink_->mu);
    sink_->slot = nullptr;
  }
  int Run();

 private:
  Status Init();
  Status JoinQuorum(const client::PollResult& pr);
  Status Heal(const client::PollResult& pr);
  Status SyncSlot(const client::PollResult& pr);
  // Sums `v` over the group's trainers (identity for a group of one). A failure here means a
  // trainer of this group is gone, so the group as a whole is failing.
  Status GroupSum(std::span<float> v);
  // True when every trainer of the group reports ok.
  Result<bool> GroupAgree(bool ok);
  Result<bool> OuterStep(const client::PollResult& pr);
  // The inner steps of the next outer step; the pseudo-gradient is left in pending_delta_.
  // False when a drain, seen by any trainer of the group, stopped them.
  Result<bool> InnerSteps();
  Status LoadGlobalIntoModel();
  void RegisterDurable();
  void WriteLogLine(const client::PollResult& pr, float loss, Millis outer_ms);

  TrainerOptions o_;
  std::shared_ptr<NoticeSink> sink_;
  std::unique_ptr<client::Session> session_;
  // The lighthouse KV through the agent, on a connection of its own (a KV wait never holds up
  // a Poll); each communicator sees it under its own key prefix.
  std::unique_ptr<client::SessionKvStore> kv_;
  std::unique_ptr<PrefixedStore> slot_store_, group_store_;
  std::unique_ptr<comm::CommManager> slot_comm_, group_comm_;
  bool group_ready_ = false;
  bool group_failed_ = false;  // an intra-group collective failed: the group is going down
  std::unique_ptr<StateIo> state_io_;
  Encoded data_;
  std::unique_ptr<LocalModel> model_;
  std::optional<SplitMix> rng_;
  size_t total_ = 0;
  ShardRange shard_;
  OuterState state_;
  bool has_state_ = false;  // state_ is valid for state_.step
  bool received_ = false;   // state came from elsewhere in the current quorum
  bool healed_ = false;     // ... and it was a heal, not the first start's initial weights
  // The averaged-to-be pseudo-gradient of an outer step whose allreduce was cut short: the
  // retry on the next quorum sends it again instead of redoing the inner steps.
  std::optional<std::vector<float>> pending_delta_;
  float pending_loss_ = 0;
  uint32_t ready_quorum_id_ = 0;  // joined: communicator built, state synced
  uint32_t bad_quorum_id_ = 0;    // failed in this quorum: wait for the next one
  Clock::time_point bad_since_;
  std::FILE* log_ = nullptr;
  StepStats stats_;
  Clock::time_point last_commit_ = Clock::now();
  std::optional<float> eval_loss_;
};

Status Trainer::Init() {
  LK_ASSIGN_OR_RETURN(session_, client::Session::FromEnv(o_.group_rank, o_.group_size));
  comm::CommOptions co;
  co.slot = o_.group_rank;
  co.init_timeout = o_.init_timeout;
  co.op_timeout = o_.op_timeout;
  const char* socket = std::getenv("LK_AGENT_SOCKET");  // FromEnv checked it
  kv_ = std::make_unique<client::SessionKvStore>(socket);
  slot_store_ = std::make_unique<PrefixedStore>(kv_.get(), "diloco/");
  LK_ASSIGN_OR_RETURN(slot_comm_, comm::CommManager::Create(comm::Backend::kGloo, slot_store_.get(), co));
  if (o_.group_size > 1) {
    // The prefix names the group once its replica_rank is known (the first quorum).
    group_store_ = std::make_unique<PrefixedStore>(kv_.get(), "");
    co.slot = 0;
    LK_ASSIGN_OR_RETURN(group_comm_,
                        comm::CommManager::Create(comm::Backend::kGloo, group_store_.get(), co));
  }
  {
    std::lock_guard lock(sink_->mu);
    sink_->slot = slot_comm_.get();
  }
  session_->OnNotice([sink = sink_](const client::Notice& n) {
    if (n.drain) sink->drain = true;
    std::lock_guard lock(sink->mu);
    if (sink->slot == nullptr) return;
    if (n.drain) {
      sink->slot->Abort("drain: " + n.reason);
    } else if (n.lost) {
      sink->slot->AbortQuorum(n.quorum_id, "quorum lost: " + n.reason);
    }
  });
  data_ = Encode(MakeCorpus(o_.corpus_bytes));
  model_ = LocalModel::Create(o_.model, o_.seed, data_);
  total_ = model_->numel();
  shard_ = ShardOf(total_, o_.group_size, o_.group_rank);
  std::vector<float> full(total_);
  model_->Flatten(full);
  CanonicalizeZeros(full);
  model_->Load(full);
  state_.global = TakeShard(full, shard_);
  state_.momentum.assign(shard_.size(), 0.0f);
  state_io_ = MakeCheckpointStateIo(StateIoOptions{o_.ckpt_dir, o_.live_dir, o_.group_rank,
                                                   o_.group_size, total_});
  if (!o_.log_path.empty()) {
    log_ = std::fopen(o_.log_path.c_str(), "a");
    if (log_ == nullptr) return InvalidArgument("cannot open --log {}", o_.log_path);
  }
  LK_LOG_INFO("trainer_start params={} shard_begin={} shard_size={} vocab={} corpus_bytes={}",
              total_, shard_.begin, shard_.size(), data_.vocab.size(), data_.tokens.size());
  return Status::Ok();
}

Status Trainer::GroupSum(std::span<float> v) {
  if (o_.group_size == 1) return Status::Ok();
  Status st = group_comm_->AllReduce(v.data(), v.size(), comm::DType::kFloat32, comm::ReduceOp::kSum);
  if (st.ok()) return st;
  group_failed_ = true;
  return st.WithContext("intra-group allreduce");
}

Result<bool> Trainer::GroupAgree(bool ok) {
  float v = ok ? 1.0f : 0.0f;
  LK_RETURN_IF_ERROR(GroupSum(std::span<float>(&v, 1)));
  return v > static_cast<float>(o_.group_size) - 0.5f;
}

// Pulls this shard from a durable checkpoint or from peers when the plan says so. A failure is
// not fatal: the slot sync then hands this member the donor's state over the communicator.
Status Trainer::Heal(const client::PollResult& pr) {
  Result<OuterState> got = Status(Code::kNotFound, "no source");
  std::string from;
  if (!pr.restore_location.empty()) {
    from = pr.restore_location;
    got = state_io_->Restore(pr.restore_location);
  } else if (!pr.heal_sources.empty() && !pr.initial) {
    from = "peers";
    got = state_io_->FetchFromPeers(pr.heal_sources, pr.max_step);
  }
  if (got.ok() && got->global.size() == shard_.size()) {
    state_ = std::move(*got);
    has_state_ = true;
    received_ = healed_ = true;
    LK_LOG_INFO("heal_fetched from={} step={}", Q(from), state_.step);
    return Status::Ok();
  }
  has_state_ = false;
  if (!from.empty()) {
    LK_LOG_WARN("heal_fetch_failed from={} error={} fallback=communicator", Q(from),
                Q(got.ok() ? std::string("shard size mismatch") : got.status().ToString()));
  }
  return Status::Ok();
}

// Every member of the slot tells the others whether it holds state and for which step; the
// members without it (or behind) get the donor's global weights and momentum by a sum-allreduce
// in which only the donor contributes non-zeros: x + 0 == x, so they arrive bit for bit.
Status Trainer::SyncSlot(const client::PollResult& pr) {
  const uint32_t rank = pr.replica_rank, world = pr.replica_world_size;
  std::vector<float> states = EncodeMemberState({has_state_, state_.step}, rank, world);
  LK_RETURN_IF_ERROR(slot_comm_->AllReduce(states.data(), states.size(), comm::DType::kFloat32,
                                           comm::ReduceOp::kSum));
  SyncPlan plan = PlanStateSync(DecodeMemberStates(states));
  if (!plan.donor) return Status(Code::kUnavailable, "no member of the quorum holds state");
  if (!plan.any_receives()) return Status::Ok();
  const size_t n = shard_.size();
  std::vector<float> buf(2 * n, 0.0f);
  if (rank == *plan.donor) {
    std::copy(state_.global.begin(), state_.global.end(), buf.begin());
    std::copy(state_.momentum.begin(), state_.momentum.end(), buf.begin() + n);
  }
  LK_RETURN_IF_ERROR(
      slot_comm_->AllReduce(buf.data(), buf.size(), comm::DType::kFloat32, comm::ReduceOp::kSum));
  if (plan.receives[rank]) {
    state_.global.assign(buf.begin(), buf.begin() + n);
    state_.momentum.assign(buf.begin() + n, buf.end());
    state_.step = plan.step;
    has_state_ = true;
    received_ = true;
    healed_ = !pr.initial;
    LK_LOG_INFO("heal_received donor_replica_rank={} step={} quorum_id={}", *plan.donor,
                plan.step, pr.quorum_id);
  }
  return Status::Ok();
}

Status Trainer::LoadGlobalIntoModel() {
  std::vector<float> full(total_, 0.0f);
  PlaceShard(state_.global, shard_, full);
  LK_RETURN_IF_ERROR(GroupSum(full));
  model_->Load(full);
  return Status::Ok();
}

// Joins quorum pr.quorum_id: builds the intra-group communicator the first time, rebuilds the
// slot communicator, heals, syncs state across the slot, and agrees with the group's other
// trainers that all of that worked (they must go on, or go back to polling, together).
Status Trainer::JoinQuorum(const client::PollResult& pr) {
  if (o_.group_size > 1 && !group_ready_) {
    // Groups of one quorum have distinct replica_ranks, so the prefix is unique within it.
    group_store_->set_prefix(fmt::format("diloco-group{}/", pr.replica_rank));
    Status st = group_comm_->Reconfigure(pr.quorum_id, o_.group_rank, o_.group_size);
    if (!st.ok()) return st.WithContext("intra-group communicator");
    group_ready_ = true;
  }
  if (!rng_) {
    uint64_t group_key = o_.group_id.empty() ? pr.replica_rank : std::hash<std::string>{}(o_.group_id);
    rng_.emplace(MixSeed({o_.seed, group_key, o_.group_rank}));
  }
  received_ = healed_ = false;
  if (pr.heal) {
    LK_RETURN_IF_ERROR(Heal(pr));
  } else {
    has_state_ = true;  // the plan says this group's state is current (or the initial one)
  }
  Status st = slot_comm_->Reconfigure(pr.quorum_id, pr.replica_rank, pr.replica_world_size);
  if (st.ok()) st = SyncSlot(pr);
  LK_ASSIGN_OR_RETURN(bool all_ok, GroupAgree(st.ok()));
  if (!all_ok) return st.ok() ? Status(Code::kAborted, "another trainer of the group failed") : st;
  // Whether anyone healed, and at which step everyone now is, must agree across the group.
  std::vector<float> v = {received_ ? 1.0f : 0.0f, healed_ ? 1.0f : 0.0f,
                          static_cast<float>(state_.step)};
  LK_RETURN_IF_ERROR(GroupSum(v));
  LK_CHECK(v[2] == static_cast<float>(state_.step) * o_.group_size)
      << "trainers of one group disagree on the step after healing";
  healed_ = v[1] > 0;
  if (v[0] > 0) {
    // Inner work since the last commit went into the pseudo-gradient thrown away here: it is
    // not training that reached the model.
    stats_.discarded_ms += stats_.inner_ms;
    stats_.inner_ms = 0;
    pending_delta_.reset();
    LK_RETURN_IF_ERROR(LoadGlobalIntoModel());
    model_->ResetOptimizer();
  }
  LK_LOG_INFO("quorum_joined quorum_id={} replica_rank={} world={} step={} healed={} reason={}",
              pr.quorum_id, pr.replica_rank, pr.replica_world_size, state_.step, healed_,
              Q(pr.reason));
  return Status::Ok();
}

Result<bool> Trainer::InnerSteps() {
  float loss_sum = 0;
  // A drain seen by any trainer of the group travels in the gradients' collective, so that
  // all of them stop after the same inner step (one stopping alone would leave the others
  // waiting in the next collective).
  bool drain = false;
  GroupAverage average = [this, &drain](std::span<float> v) {
    v.back() = sink_->drain ? 1.0f : 0.0f;
    LK_RETURN_IF_ERROR(GroupSum(v));
    drain = v.back() > 0;
    for (float& x : v) x /= static_cast<float>(o_.group_size);
    return Status::Ok();
  };
  auto inner_t0 = Clock::now();
  TcpSent inner_b0 = SnapshotTcpSent();
  for (uint32_t i = 0; i < o_.inner_steps && !drain; ++i) {
    LK_ASSIGN_OR_RETURN(float loss, model_->InnerStep(*rng_, average));
    loss_sum += loss;
  }
  stats_.group_bytes += TcpSentBetween(inner_b0, SnapshotTcpSent());
  stats_.inner_ms += MsSince(inner_t0);
  if (drain) {
    sink_->drain = true;
    return false;
  }
  std::vector<float> local(total_);
  model_->Flatten(local);
  std::vector<float> delta = TakeShard(local, shard_);
  for (size_t i = 0; i < delta.size(); ++i) delta[i] = state_.global[i] - delta[i];
  pending_delta_ = std::move(delta);
  pending_loss_ = loss_sum / static_cast<float>(std::max(1u, o_.inner_steps));
  return true;
}

// One outer step. Returns false when its allreduce was cut short (the caller polls for the
// next quorum and retries with the same pseudo-gradient), an error when the trainer must stop.
Result<bool> Trainer::OuterStep(const client::PollResult& pr) {
  auto t0 = Clock::now();
  if (!pending_delta_) {
    LK_ASSIGN_OR_RETURN(bool ran, InnerSteps());
    if (!ran) return false;  // poll at once: it answers the drain
  }
  std::vector<float> avg = *pending_delta_;
  auto ar_t0 = Clock::now();
  TcpSent ar_b0 = SnapshotTcpSent();
  // Waiting on the other groups is not this group's stall (the lighthouse's progress timeout).
  (void)session_->SetPeerWait(true);
  Status st = slot_comm_->AllReduce(avg.data(), avg.size(), comm::DType::kFloat32, comm::ReduceOp::kAvg);
  (void)session_->SetPeerWait(false);
  stats_.cross_bytes += TcpSentBetween(ar_b0, SnapshotTcpSent());
  stats_.allreduce_ms += MsSince(ar_t0);
  LK_ASSIGN_OR_RETURN(bool all_ok, GroupAgree(st.ok()));
  if (!all_ok) {
    LK_LOG_WARN("outer_step_aborted step={} quorum_id={} error={}", state_.step + 1, pr.quorum_id,
                Q(st.ok() ? std::string("another trainer of the group failed") : st.ToString()));
    return false;
  }
  auto gather_t0 = Clock::now();
  TcpSent gather_b0 = SnapshotTcpSent();
  OuterNesterovStep(state_.global, state_.momentum, avg, o_.outer);
  LK_RETURN_IF_ERROR(LoadGlobalIntoModel());
  stats_.group_bytes += TcpSentBetween(gather_b0, SnapshotTcpSent());
  stats_.gather_ms += MsSince(gather_t0);
  state_.step += 1;
  pending_delta_.reset();
  auto publish_t0 = Clock::now();
  // Published before the commit: once the lighthouse hears of this step, peers may fetch it.
  if (Status p = state_io_->PublishLive(state_); !p.ok()) {
    LK_LOG_WARN("publish_live_failed step={} error={}", state_.step, Q(p.ToString()));
  }
  stats_.publish_ms += MsSince(publish_t0);
  std::string hash = StateHash(state_.global);
  auto commit_t0 = Clock::now();
  LK_RETURN_IF_ERROR(session_->Commit(state_.step, true, hash).WithContext("commit"));
  stats_.commit_ms += MsSince(commit_t0);
  auto outer_ms = std::chrono::duration_cast<Millis>(Clock::now() - t0);
  eval_loss_.reset();
  if (o_.eval_batches > 0) {
    // After the commit, so that the commit's latency does not include it; the model holds the
    // new global weights now, identical in every member.
    auto eval_t0 = Clock::now();
    SplitMix eval_rng(MixSeed({o_.seed, 0x65766131}));  // the same batches at every step and run
    eval_loss_ = model_->Eval(eval_rng, o_.eval_batches);
    stats_.eval_ms += MsSince(eval_t0);
  }
  WriteLogLine(pr, pending_loss_, outer_ms);
  LK_LOG_INFO("outer_committed step={} quorum_id={} world={} loss={:.4f} hash={} outer_ms={}",
              state_.step, pr.quorum_id, pr.replica_world_size, pending_loss_, hash,
              outer_ms.count());
  healed_ = false;
  if (o_.ckpt_every > 0 && state_.step % o_.ckpt_every == 0) {
    LK_RETURN_IF_ERROR(state_io_->SaveDurable(state_, pr.quorum_id));
    RegisterDurable();
  }
  return true;
}

// Tells the lighthouse (through the agent) where this group's durable checkpoints are, so that
// a job whose groups all lost their live state restores the newest one. Rank 0 speaks for the
// group; the location is the checkpoint root, whose LATEST names the newest complete step.
void Trainer::RegisterDurable() {
  if (o_.group_rank != 0) return;
  std::error_code ec;
  auto root = std::filesystem::absolute(o_.ckpt_dir, ec).string();
  if (Status st = session_->RegisterCheckpoint(state_.step, root, ""); !st.ok()) {
    LK_LOG_WARN("checkpoint_register_failed step={} error={}", state_.step, Q(st.ToString()));
  }
}

void Trainer::WriteLogLine(const client::PollResult& pr, float loss, Millis outer_ms) {
  const StepStats s = stats_;
  const double step_ms = MsSince(last_commit_);
  stats_ = StepStats();
  last_commit_ = Clock::now();
  if (log_ == nullptr) return;
  const int64_t t_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  std::string eval = eval_loss_ ? fmt::format(",\"eval_loss\":{:.6f}", *eval_loss_) : "";
  std::fputs(
      fmt::format("{{\"step\":{},\"quorum_id\":{},\"replica_world_size\":{},\"loss\":{:.6f},"
                  "\"param_hash\":\"{}\",\"healed\":{},\"group_rank\":{},\"outer_ms\":{}{},"
                  "\"t_ms\":{},\"step_ms\":{:.1f},\"poll_ms\":{:.3f},\"join_ms\":{:.3f},"
                  "\"inner_ms\":{:.1f},\"discarded_ms\":{:.1f},\"allreduce_ms\":{:.1f},"
                  "\"gather_ms\":{:.1f},\"publish_ms\":{:.1f},\"commit_ms\":{:.3f},"
                  "\"eval_ms\":{:.1f},"
                  "\"cross_bytes\":{},\"sync_bytes\":{},\"group_bytes\":{},\"params\":{},"
                  "\"shard\":{},\"inner_steps\":{},\"group_size\":{}}}\n",
                  state_.step, pr.quorum_id, pr.replica_world_size, loss,
                  StateHash(state_.global), healed_ ? "true" : "false", o_.group_rank,
                  outer_ms.count(), eval, t_ms, step_ms, s.poll_ms, s.join_ms, s.inner_ms,
                  s.discarded_ms, s.allreduce_ms, s.gather_ms, s.publish_ms, s.commit_ms,
                  s.eval_ms,
                  s.cross_bytes, s.sync_bytes, s.group_bytes, total_, shard_.size(),
                  o_.inner_steps, o_.group_size)
          .c_str(),
      log_);
  std::fflush(log_);
}

int Trainer::Run() {
  if (Status st = Init(); !st.ok()) {
    LK_LOG_ERROR("trainer_init_failed error={}", Q(st.ToString()));
    return 1;
  }
  // How long a failed quorum may last before this trainer gives up: long enough for the
  // lighthouse to notice a dead peer, short enough that a wedged run does not sit forever.
  const Millis stuck_max = o_.op_timeout + Millis(60'000);
  while (state_.step < o_.outer_steps) {
    // With state, the inner steps come before the poll: the agent asked the lighthouse for this
    // step's round as soon as the last step was committed, so the round ran during them and the
    // poll is answered from the agent's memory, with the freshest membership right before the
    // outer sync. (Every trainer of the group takes this branch alike: the flags are agreed in
    // JoinQuorum and OuterStep, and a drain travels inside InnerSteps' collectives.)
    if (has_state_ && ready_quorum_id_ != 0 && !pending_delta_) {
      auto ran = InnerSteps();
      if (!ran.ok()) {
        LK_LOG_ERROR("inner_steps_failed step={} error={}", state_.step + 1, Q(ran.status().ToString()));
        return 1;
      }
    }
    auto poll_t0 = Clock::now();
    auto pr = session_->Poll(state_.step);
    stats_.poll_ms += MsSince(poll_t0);
    if (!pr.ok()) {
      LK_LOG_ERROR("poll_failed step={} error={}", state_.step, Q(pr.status().ToString()));
      return 1;
    }
    if (pr->drain) {
      LK_LOG_INFO("drain step={} checkpoint_now={} reason={}", state_.step, pr->checkpoint_now,
                  Q(pr->reason));
      if (pr->checkpoint_now && has_state_ && !o_.ckpt_dir.empty()) {
        if (Status st = state_io_->SaveDurable(state_, ready_quorum_id_); !st.ok()) {
          LK_LOG_ERROR("drain_save_failed error={}", Q(st.ToString()));
          return 1;
        }
        RegisterDurable();
      }
      return 0;
    }
    if (pr->quorum_id == bad_quorum_id_) {
      if (Clock::now() - bad_since_ > stuck_max) {
        LK_LOG_ERROR("stuck quorum_id={} no new quorum after a failure", pr->quorum_id);
        return 1;
      }
      std::this_thread::sleep_for(Millis(100));
      continue;
    }
    if (pr->quorum_id != ready_quorum_id_) {
      auto join_t0 = Clock::now();
      TcpSent join_b0 = SnapshotTcpSent();
      Status st = JoinQuorum(*pr);
      stats_.sync_bytes += TcpSentBetween(join_b0, SnapshotTcpSent());
      stats_.join_ms += MsSince(join_t0);
      if (!st.ok()) {
        LK_LOG_WARN("quorum_join_failed quorum_id={} error={}", pr->quorum_id, Q(st.ToString()));
        if (group_failed_) return 1;
        bad_quorum_id_ = pr->quorum_id;
        bad_since_ = Clock::now();
        // Tell the lighthouse this quorum failed us, so the next round has a new quorum_id.
        (void)session_->Commit(state_.step + 1, false);
        continue;
      }
      ready_quorum_id_ = pr->quorum_id;
    }
    auto done = OuterStep(*pr);
    if (!done.ok()) {
      LK_LOG_ERROR("outer_step_failed step={} error={}", state_.step + 1, Q(done.status().ToString()));
      return 1;
    }
    if (!*done && sink_->drain) {
      std::this_thread::sleep_for(Millis(50));  // the next poll answers the drain
    } else if (!*done) {
      bad_quorum_id_ = pr->quorum_id;
      bad_since_ = Clock::now();
      (void)session_->Commit(state_.step + 1, false);
    }
  }
  // A finished group's leave is a lost member to the others: were it to leave while another
  // member still waits for the last bytes of the final allreduce, that member's step would be
  // aborted with nobody left to heal from. So no member leaves before all have come out of it.
  float done = 1.0f;
  if (Status st = slot_comm_->AllReduce(&done, 1, comm::DType::kFloat32, comm::ReduceOp::kSum);
      !st.ok()) {
    LK_LOG_WARN("final_barrier_failed error={}", Q(st.ToString()));
  }
  // The run's result is the final weights: they are saved durably (and registered) unless
  // --ckpt-every just did, so that a group coming back after every other group finished
  // restores the final step rather than an older checkpoint, and the user has the model.
  if (!o_.ckpt_dir.empty() && has_state_ && !(o_.ckpt_every > 0 && state_.step % o_.ckpt_every == 0)) {
    if (Status st = state_io_->SaveDurable(state_, ready_quorum_id_); !st.ok()) {
      LK_LOG_ERROR("final_save_failed step={} error={}", state_.step, Q(st.ToString()));
      return 1;
    }
    RegisterDurable();
  }
  LK_LOG_INFO("trainer_done step={} hash={}", state_.step, StateHash(state_.global));
  // Without the goodbye the agent would take this exit for a crash and fail the group.
  if (Status st = session_->Finish(); !st.ok()) {
    LK_LOG_WARN("finish_failed error={}", Q(st.ToString()));
  }
  if (log_ != nullptr) std::fclose(log_);
  return 0;
}

}  // namespace

Status TrainerOptions::Validate() const {
  if (group_size == 0 || group_rank >= group_size) {
    return InvalidArgument("--group-rank {} must be below --group-size {}", group_rank, group_size);
  }
  if (inner_steps == 0) return InvalidArgument("--inner-steps must be at least 1");
  if (outer_steps >= (1u << 24)) return InvalidArgument("--outer-steps must be below 2^24");
  if (ckpt_every > 0 && ckpt_dir.empty()) return InvalidArgument("--ckpt-every needs --ckpt-dir");
  if (corpus_bytes < 4096) return InvalidArgument("--corpus-bytes must be at least 4096");
  if (!(outer.lr > 0) || outer.momentum < 0 || outer.momentum >= 1) {
    return InvalidArgument("--outer-lr must be positive and --outer-momentum in [0, 1)");
  }
  return model.Validate();
}

int RunTrainer(const TrainerOptions& options) {
  Trainer trainer(options);
  return trainer.Run();
}

}  // namespace lk::diloco
