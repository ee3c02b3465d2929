// The Gloo backend's allreduce of runs (CommManager::AllReduceRuns): each run's holders send
// their copy to its owner, which sums and sends the result back; two phases on the
// communicator's pairs, with the ring's abort, deadline and failure handling.
#include <algorithm>
#include <cstring>

#include "comm/encoded.h"
#include "comm/gloo_comm_impl.h"
#include "comm/reduce.h"
#include "comm/runs.h"
#include "common/sigpipe.h"

namespace lk::comm::gloo_backend {

Status GlooCommManager::AllReduceRuns(std::span<float> data, std::span<const ReduceRun> runs,
                                      const ChunkCodec* codec, std::span<float> sent,
                                      std::span<float> result_feedback) {
  LK_RETURN_IF_ERROR(CheckFeedbackSpans(data.size(), sent, result_feedback));
  ScopedSigpipeBlock no_sigpipe;  // Gloo writes on this thread
  OpStart start;
  {
    std::lock_guard lock(mu_);
    LK_RETURN_IF_ERROR(UsableLocked());
    LK_RETURN_IF_ERROR(FullMeshLocked("allreduce of runs"));
    LK_RETURN_IF_ERROR(ValidateRuns(runs, data.size(), rank_, world_));
    start = StartLocked(runs.empty() ? 0 : data.size(), "allreduce of runs");
  }
  if (runs.empty()) {
    // Every call takes one sequence number whether or not this member holds runs, so that the
    // slots of the next collectives still pair up with members that held some this time (a
    // member may hold none of the runs of one fragment of the exchange).
    ++op_seq_;
    return Status::Ok();
  }
  Status st;
  try {
    st = ExchangeRuns(start.world > 1 ? start.ctx.get() : nullptr, data, runs, codec, sent,
                      result_feedback, start.rank, start.world);
  } catch (const std::exception& e) {
    st = Error(Code::kAborted, "peer failure: {}", e.what());
  }
  if (start.world == 1) return st;
  return EndOp(st);
}

// Phase 1: every holder sends its copies of the runs that a peer owns to that peer, one
// message per pair; the owner decodes them with its own copy in holders order and sums them in
// float32. Phase 2: the owner sends the result (encoded once per run) to the run's other
// holders, one message per pair. Every holder, the owner too, takes the result from the same
// bytes, so all hold the same bits; with result_feedback the owner encodes each result it owns
// plus that feedback and keeps what the encoding dropped. All receives are posted before the
// first send, large enough for any codec, and checked by header before a byte of them is read.
// Each phase has its own slot and every pair carries at most one message per slot.
Status GlooCommManager::ExchangeRuns(GlooContext* ctx, std::span<float> data,
                                     std::span<const ReduceRun> runs, const ChunkCodec* codec,
                                     std::span<float> sent, std::span<float> result_feedback,
                                     size_t rank, size_t world) {
  const uint32_t codec_id = codec ? codec->id() : 0;
  const std::string_view codec_name = codec ? codec->name() : std::string_view("float32");
  auto bytes = [&](size_t n) { return codec ? codec->EncodedBytes(n) : n * sizeof(float); };
  auto max_bytes = [&](size_t n) { return codec ? codec->MaxEncodedBytes(n) : n * sizeof(float); };
  auto encode = [&](const float* in, size_t n, uint8_t* out) {
    if (codec) {
      codec->Encode(in, n, out);
    } else {
      std::memcpy(out, in, n * sizeof(float));
    }
  };
  auto decode = [&](const uint8_t* in, size_t n, float* out) {
    if (codec) {
      codec->Decode(in, n, out);
    } else {
      std::memcpy(out, in, n * sizeof(float));
    }
  };
  const RunPlan plan = PlanRuns(runs, static_cast<uint32_t>(rank), static_cast<uint32_t>(world));
  // Four areas, each one message per peer: this member's copies going to owners (send), copies
  // coming in for its own runs (stage), its results going out (result), results coming in (in).
  // `*_at[p]` is peer p's message; `run_at[i]` is run i's payload inside its message.
  std::vector<size_t> send_at(world + 1, 0), stage_at(world + 1, 0), out_at(world + 1, 0),
      in_at(world + 1, 0);
  for (size_t p = 0; p < world; ++p) {
    size_t s = 0, st = 0, o = 0, in = 0;
    if (!plan.to_owner[p].empty()) {
      s = kRunHeaderBytes, in = kRunHeaderBytes;
      for (size_t i : plan.to_owner[p]) s += bytes(runs[i].count), in += max_bytes(runs[i].count);
    }
    if (!plan.owned_with[p].empty()) {
      st = kRunHeaderBytes, o = kRunHeaderBytes;
      for (size_t i : plan.owned_with[p]) {
        st += max_bytes(runs[i].count), o += bytes(runs[i].count);
      }
    }
    send_at[p + 1] = send_at[p] + s;
    stage_at[p + 1] = stage_at[p] + st;
    out_at[p + 1] = out_at[p] + o;
    in_at[p + 1] = in_at[p] + in;
  }
  // This member's own encoding of each run it owns (its contribution to the sum), and where in
  // the send area the others go.
  std::vector<size_t> own_at(runs.size(), 0);
  size_t own_bytes = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].owner == rank) own_at[i] = own_bytes, own_bytes += bytes(runs[i].count);
  }
  runs_send_.resize(send_at[world]);
  runs_stage_.resize(stage_at[world]);
  runs_out_.resize(out_at[world]);
  runs_in_.resize(in_at[world]);
  runs_own_.resize(own_bytes);
  for (size_t p = 0; p < world; ++p) {
    if (plan.to_owner[p].empty()) continue;
    uint8_t* at = runs_send_.data() + send_at[p];
    WriteRunHeader(codec_id, RunElements(runs, plan.to_owner[p]), at);
    at += kRunHeaderBytes;
    for (size_t i : plan.to_owner[p]) {
      const ReduceRun& r = runs[i];
      encode(data.data() + r.offset, r.count, at);
      if (!sent.empty()) decode(at, r.count, sent.data() + r.offset);
      at += bytes(r.count);
    }
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    const ReduceRun& r = runs[i];
    if (r.owner != rank) continue;
    encode(data.data() + r.offset, r.count, runs_own_.data() + own_at[i]);
    if (!sent.empty()) decode(runs_own_.data() + own_at[i], r.count, sent.data() + r.offset);
  }

  std::unique_ptr<GlooBuffer> sbuf, stage, obuf, ibuf;
  if (ctx != nullptr) {
    // Gloo refuses buffers of no bytes; an area with no messages gets one it never uses.
    auto make = [&](std::vector<uint8_t>& v) {
      if (v.empty()) v.resize(1);
      return ctx->createUnboundBuffer(v.data(), v.size());
    };
    sbuf = make(runs_send_);
    stage = make(runs_stage_);
    obuf = make(runs_out_);
    ibuf = make(runs_in_);
    std::lock_guard lock(mu_);
    if (phase_ == Phase::kFailed) return status_;
    inflight_ = {sbuf.get(), stage.get(), obuf.get(), ibuf.get()};
  }
  InflightGuard unregister{this};  // after the buffers: see InflightGuard

  const uint64_t slot = kRunSlots | ((++op_seq_) << 1);
  size_t stage_msgs = 0, in_msgs = 0, sends = 0, out_sends = 0;
  for (size_t p = 0; p < world; ++p) {
    const int peer = static_cast<int>(p);
    if (!plan.owned_with[p].empty()) {
      stage->recv(peer, slot, stage_at[p], stage_at[p + 1] - stage_at[p]);
      ++stage_msgs;
    }
    if (!plan.to_owner[p].empty()) {
      ibuf->recv(peer, slot + 1, in_at[p], in_at[p + 1] - in_at[p]);
      ++in_msgs;
    }
  }
  for (size_t p = 0; p < world; ++p) {
    if (plan.to_owner[p].empty()) continue;
    sbuf->send(static_cast<int>(p), slot, send_at[p], send_at[p + 1] - send_at[p]);
    ++sends;
  }
  for (size_t k = 0; k < stage_msgs; ++k) LK_RETURN_IF_ERROR(WaitRecv(*stage));
  // Where run i's copy from peer p sits in the stage area.
  std::vector<std::vector<std::pair<size_t, size_t>>> copy_at(runs.size());  // (peer, offset)
  for (size_t p = 0; p < world; ++p) {
    if (plan.owned_with[p].empty()) continue;
    const uint8_t* msg = runs_stage_.data() + stage_at[p];
    LK_RETURN_IF_ERROR(
        CheckRunHeader(codec_id, codec_name, RunElements(runs, plan.owned_with[p]), msg, p));
    size_t off = stage_at[p] + kRunHeaderBytes;
    for (size_t i : plan.owned_with[p]) {
      copy_at[i].emplace_back(p, off);
      off += bytes(runs[i].count);
    }
  }
  // The owner's sums, in holders order, and the result messages.
  std::vector<size_t> out_fill(world, 0);
  for (size_t p = 0; p < world; ++p) {
    if (!plan.owned_with[p].empty()) {
      WriteRunHeader(codec_id, RunElements(runs, plan.owned_with[p]), runs_out_.data() + out_at[p]);
      out_fill[p] = out_at[p] + kRunHeaderBytes;
    }
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    const ReduceRun& r = runs[i];
    if (r.owner != rank) continue;
    std::vector<const uint8_t*> contributions;
    for (uint32_t h : r.holders) {
      if (h == rank) {
        contributions.push_back(runs_own_.data() + own_at[i]);
        continue;
      }
      auto it = std::find_if(copy_at[i].begin(), copy_at[i].end(),
                             [h](const auto& c) { return c.first == h; });
      contributions.push_back(runs_stage_.data() + it->second);
    }
    runs_sum_.resize(r.count);
    runs_scratch_.resize(r.count);
    float* sum = runs_sum_.data();
    if (codec) {
      ReduceEncoded(*codec, contributions, r.count, ReduceOp::kSum, sum, runs_scratch_.data());
    } else {
      std::memcpy(sum, contributions[0], r.count * sizeof(float));
      for (size_t k = 1; k < contributions.size(); ++k) {
        std::memcpy(runs_scratch_.data(), contributions[k], r.count * sizeof(float));
        AddInto(sum, runs_scratch_.data(), r.count);
      }
    }
    // Encoded once; every other holder gets these bytes, and this member decodes them too.
    // The float32 path drops nothing, so only a codec's result takes the owner's feedback.
    const bool feedback = codec != nullptr && !result_feedback.empty();
    if (feedback) AddFeedback(sum, result_feedback.data() + r.offset, r.count);
    runs_result_.resize(bytes(r.count));
    encode(sum, r.count, runs_result_.data());
    for (uint32_t h : r.holders) {
      if (h == rank) continue;
      std::memcpy(runs_out_.data() + out_fill[h], runs_result_.data(), runs_result_.size());
      out_fill[h] += runs_result_.size();
    }
    decode(runs_result_.data(), r.count, data.data() + r.offset);
    if (feedback) {
      KeepFeedback(sum, data.data() + r.offset, result_feedback.data() + r.offset, r.count);
    }
  }
  for (size_t p = 0; p < world; ++p) {
    if (plan.owned_with[p].empty()) continue;
    obuf->send(static_cast<int>(p), slot + 1, out_at[p], out_at[p + 1] - out_at[p]);
    ++out_sends;
  }
  for (size_t k = 0; k < in_msgs; ++k) LK_RETURN_IF_ERROR(WaitRecv(*ibuf));
  for (size_t p = 0; p < world; ++p) {
    if (plan.to_owner[p].empty()) continue;
    const uint8_t* msg = runs_in_.data() + in_at[p];
    LK_RETURN_IF_ERROR(
        CheckRunHeader(codec_id, codec_name, RunElements(runs, plan.to_owner[p]), msg, p));
  }
  for (size_t k = 0; k < sends; ++k) LK_RETURN_IF_ERROR(WaitSend(*sbuf));
  for (size_t k = 0; k < out_sends; ++k) LK_RETURN_IF_ERROR(WaitSend(*obuf));
  for (size_t p = 0; p < world; ++p) {
    if (plan.to_owner[p].empty()) continue;
    size_t off = in_at[p] + kRunHeaderBytes;
    for (size_t i : plan.to_owner[p]) {
      decode(runs_in_.data() + off, runs[i].count, data.data() + runs[i].offset);
      off += bytes(runs[i].count);
    }
  }
  return Status::Ok();
}

}  // namespace lk::comm::gloo_backend
