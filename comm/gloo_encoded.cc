// The Gloo backend's encoded allreduce (CommManager::AllReduceEncoded): two all-to-all phases
// on the communicator's pairs, with the ring's abort, deadline and failure handling.
#include <algorithm>

#include "comm/encoded.h"
#include "comm/gloo_comm_impl.h"
#include "common/sigpipe.h"

namespace lk::comm::gloo_backend {

Status GlooCommManager::AllReduceEncoded(std::span<float> data, const ChunkCodec& codec,
                                         ReduceOp op, std::span<float> sent,
                                         std::span<float> result_feedback) {
  LK_RETURN_IF_ERROR(CheckFeedbackSpans(data.size(), sent, result_feedback));
  ScopedSigpipeBlock no_sigpipe;  // Gloo writes on this thread
  OpStart start;
  {
    std::lock_guard lock(mu_);
    LK_RETURN_IF_ERROR(UsableLocked());
    LK_RETURN_IF_ERROR(FullMeshLocked("encoded allreduce"));
    start = StartLocked(data.size(), "encoded allreduce");
  }
  if (data.empty()) return Status::Ok();
  const size_t world = start.world;
  Status st;
  try {
    st = Exchange(world > 1 ? start.ctx.get() : nullptr, data, codec, op, sent, result_feedback,
                  start.rank, world);
  } catch (const std::exception& e) {
    st = Error(Code::kAborted, "peer failure: {}", e.what());
  }
  if (world == 1) return st;
  return EndOp(st);
}

// Phase 1 (reduce-scatter): every member sends its encoding of chunk p to member p, which
// decodes the world's contributions in replica_rank order and sums them in float32. Phase 2
// (allgather): each owner encodes its chunk of the result once and sends the same bytes to
// everyone. Every member, the owner too, decodes the result from those bytes, so all hold the
// same bits. With result_feedback, the owner encodes its result plus the feedback's elements of
// its chunk, and keeps what that encoding dropped once it decoded the bytes. All receives are
// posted before the first send, each large enough for any codec (MaxEncodedBytes), and checked by
// header before a byte of them is decoded. Each phase has its own slot and every pair carries one
// message per slot, so completions need no ordering.
Status GlooCommManager::Exchange(GlooContext* ctx, std::span<float> data, const ChunkCodec& codec,
                                 ReduceOp op, std::span<float> sent,
                                 std::span<float> result_feedback, size_t rank, size_t world) {
  const size_t count = data.size();
  const size_t block = std::max<size_t>(1, codec.block_elems());
  const size_t hdr = kEncodedHeaderBytes;
  std::vector<Chunk> chunks(world);
  std::vector<size_t> send_at(world + 1, 0), result_at(world + 1, 0);
  for (size_t c = 0; c < world; ++c) {
    chunks[c] = EncodedChunk(count, block, world, c);
    send_at[c + 1] = send_at[c] + hdr + codec.EncodedBytes(chunks[c].size);
    result_at[c + 1] = result_at[c] + hdr + codec.MaxEncodedBytes(chunks[c].size);
  }
  const Chunk mine = chunks[rank];
  const size_t stage_bytes = hdr + codec.MaxEncodedBytes(mine.size);
  enc_send_.resize(send_at[world]);
  enc_result_.resize(result_at[world]);
  enc_stage_.resize(stage_bytes * world);
  for (size_t c = 0; c < world; ++c) {
    WriteEncodedHeader(codec, count, enc_send_.data() + send_at[c]);
    codec.Encode(data.data() + chunks[c].begin, chunks[c].size,
                 enc_send_.data() + send_at[c] + hdr);
    if (!sent.empty()) {
      codec.Decode(enc_send_.data() + send_at[c] + hdr, chunks[c].size,
                   sent.data() + chunks[c].begin);
    }
  }
  std::unique_ptr<GlooBuffer> sbuf, stage, rbuf;
  if (world > 1) {
    sbuf = ctx->createUnboundBuffer(enc_send_.data(), enc_send_.size());
    stage = ctx->createUnboundBuffer(enc_stage_.data(), enc_stage_.size());
    rbuf = ctx->createUnboundBuffer(enc_result_.data(), enc_result_.size());
    std::lock_guard lock(mu_);
    if (phase_ == Phase::kFailed) return status_;
    inflight_ = {sbuf.get(), stage.get(), rbuf.get()};
  }
  InflightGuard unregister{this};  // after the buffers: see InflightGuard

  const uint64_t slot = kEncodedSlots | ((++op_seq_) << 1);
  for (size_t p = 0; p < world; ++p) {
    if (p == rank) continue;
    const int peer = static_cast<int>(p);
    stage->recv(peer, slot, p * stage_bytes, stage_bytes);
    rbuf->recv(peer, slot + 1, result_at[p], result_at[p + 1] - result_at[p]);
  }
  for (size_t p = 0; p < world; ++p) {
    if (p != rank) sbuf->send(static_cast<int>(p), slot, send_at[p], send_at[p + 1] - send_at[p]);
  }
  for (size_t i = 0; i + 1 < world; ++i) LK_RETURN_IF_ERROR(WaitRecv(*stage));
  std::vector<const uint8_t*> contributions(world);
  for (size_t p = 0; p < world; ++p) {
    if (p == rank) {
      contributions[p] = enc_send_.data() + send_at[rank] + hdr;
    } else {
      LK_RETURN_IF_ERROR(CheckEncodedHeader(codec, count, enc_stage_.data() + p * stage_bytes, p));
      contributions[p] = enc_stage_.data() + p * stage_bytes + hdr;
    }
  }
  enc_sum_.resize(mine.size);
  enc_scratch_.resize(mine.size);
  ReduceEncoded(codec, contributions, mine.size, op, enc_sum_.data(), enc_scratch_.data());
  uint8_t* own = enc_result_.data() + result_at[rank];
  WriteEncodedHeader(codec, count, own);
  if (!result_feedback.empty()) {
    AddFeedback(enc_sum_.data(), result_feedback.data() + mine.begin, mine.size);
  }
  codec.Encode(enc_sum_.data(), mine.size, own + hdr);
  for (size_t p = 0; p < world; ++p) {
    if (p == rank) continue;
    rbuf->send(static_cast<int>(p), slot + 1, result_at[rank], hdr + codec.EncodedBytes(mine.size));
  }
  for (size_t i = 0; i + 1 < world; ++i) LK_RETURN_IF_ERROR(WaitRecv(*rbuf));
  for (size_t p = 0; p < world; ++p) {
    if (p != rank) {
      LK_RETURN_IF_ERROR(CheckEncodedHeader(codec, count, enc_result_.data() + result_at[p], p));
    }
  }
  for (size_t i = 0; i + 1 < world; ++i) {
    LK_RETURN_IF_ERROR(WaitSend(*sbuf));
    LK_RETURN_IF_ERROR(WaitSend(*rbuf));
  }
  for (size_t c = 0; c < world; ++c) {
    codec.Decode(enc_result_.data() + result_at[c] + hdr, chunks[c].size,
                 data.data() + chunks[c].begin);
  }
  if (!result_feedback.empty()) {
    KeepFeedback(enc_sum_.data(), data.data() + mine.begin, result_feedback.data() + mine.begin,
                 mine.size);
  }
  return Status::Ok();
}

}  // namespace lk::comm::gloo_backend
