// The cross-group communicator of one trainer slot. For each quorum_id, the members of a slot
// (one trainer per replica group, ranked by replica_rank) rendezvous through the lighthouse KV
// scoped to that quorum_id and build a communicator; a new quorum_id aborts the old one first.
// Backends: Gloo over TCP on CPU buffers (always built) and NCCL on device buffers (built when
// CUDA and NCCL are found). This header pulls in neither Gloo nor CUDA.
//
// Thread-safety: Reconfigure and AllReduce are called by one thread at a time (the trainer's);
// Abort, AbortQuorum and the accessors may be called from any thread at any time, in particular
// from the failure-notice callback while an AllReduce is blocked. A RendezvousStore must be safe
// to call from the thread that calls Reconfigure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <lightkeeper/clock.h>
#include <lightkeeper/status.h>

namespace lk::comm {

// Rendezvous scoped to one quorum_id: the lighthouse KV (PUT/GET /v1/kv/JOB/QUORUM_ID/KEY).
class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  virtual Status Put(uint32_t quorum_id, const std::string& key, const std::string& value) = 0;
  // Waits up to `timeout` for the key; kDeadlineExceeded when it did not appear, kConflict when
  // the quorum_id is superseded.
  virtual Result<std::string> Get(uint32_t quorum_id, const std::string& key, Millis timeout) = 0;
};

// A lossy encoding of float32 values for AllReduceEncoded (comm/compress.h has the codecs).
// Encodings are blockwise: a run of elements that starts at a multiple of block_elems() encodes
// on its own, so a chunk of whole blocks is encoded and decoded apart from the rest. Decode must
// be a pure function of the bytes, so that every member that decodes them gets the same bits.
// Thread-safety: const methods, called from the trainer's thread.
class ChunkCodec {
 public:
  virtual ~ChunkCodec() = default;
  virtual uint32_t id() const = 0;  // names the encoding on the wire; never 0
  virtual std::string_view name() const = 0;
  virtual size_t block_elems() const = 0;
  virtual size_t EncodedBytes(size_t count) const = 0;
  // The largest EncodedBytes of any codec a peer may use: receives are posted this large, so a
  // peer with another codec is refused by name instead of overrunning a buffer.
  virtual size_t MaxEncodedBytes(size_t count) const = 0;
  virtual void Encode(const float* in, size_t count, uint8_t* out) const = 0;
  virtual void Decode(const uint8_t* in, size_t count, float* out) const = 0;
};

// One run of AllReduceRuns: elements [offset, offset + count) of this member's buffer.
struct ReduceRun {
  size_t offset = 0;
  size_t count = 0;
  std::vector<uint32_t> holders;  // communicator ranks holding the run, ascending: the sum order
  uint32_t owner = 0;             // one of holders: sums the copies and sends the result
};

// kGateway: through the site's lk_gateway (comm/gateway_comm.cc), for sites whose nodes reach
// the other sites only through it: float32/bfloat16 AllReduce on host buffers.
enum class Backend { kGloo, kNccl, kGateway };
enum class DType { kFloat32, kBFloat16 };
enum class ReduceOp { kSum, kAvg };

std::string_view BackendName(Backend backend);
bool ParseBackend(std::string_view name, Backend* out);
size_t DTypeBytes(DType dtype);
// True when this build has the backend (NCCL needs CUDA and NCCL at build time).
bool BackendBuilt(Backend backend);

// The address `bind_host` stands for: the IPv4 address of the network interface of that name
// when this host has one (an error when it has no IPv4 address), else `bind_host` as it is (an
// address or a host name). A cluster's nodes share interface names, not addresses, so one
// command line serves every node.
Result<std::string> ResolveBindHost(const std::string& bind_host);

struct CommOptions {
  // The cross-group slot (usually the trainer's group_rank). Every KV key carries it, so the
  // slots of one quorum rendezvous independently.
  uint32_t slot = 0;
  // Gloo: the address this member listens on and publishes to its peers: an address, a host
  // name, or the name of one of this host's network interfaces (ib0), which stands for its
  // IPv4 address (ResolveBindHost).
  std::string bind_host = "127.0.0.1";
  // Reconfigure: the whole rendezvous + connect must finish within this, or the attempt is
  // aborted with kDeadlineExceeded.
  Millis init_timeout{30'000};
  // AllReduce: one collective must finish within this, or it is aborted with kDeadlineExceeded.
  Millis op_timeout{60'000};
  // NCCL: the CUDA device of this trainer.
  int device_index = 0;
  // Gloo: the ring moves each chunk in segments of this size so that the reduction of one
  // segment overlaps the transfer of the next.
  size_t segment_bytes = 1 << 20;
  // Gloo: reduce-scatter receives kept posted ahead, in bytes (at least four segments). A link
  // carries at most this much of the ring at a time, so it must cover the link's bandwidth
  // times its round trip: with four 1 MiB segments a 4-member ring on 2-4 Gbit/s links with a
  // few milliseconds of queueing ran at 0.8x of iperf3, with 16 MiB at 0.98x (bench/comm.md).
  size_t inflight_bytes = 16 << 20;
  // Gloo: connect every pair of members, not only ring neighbours. AllReduceEncoded sends each
  // chunk straight to its owner and from it to everyone, so it needs this with more than three
  // members (with two or three, the neighbours are everyone).
  bool full_mesh = false;
  // Gateway: the site's lk_gateway as its trainers reach it ("http://HOST:PORT" or https://),
  // the job's bearer token and name (the gateway relays only for jobs whose token it holds), and
  // the CA of an https gateway.
  std::string gateway_url;
  std::string gateway_token;
  std::string gateway_ca_file;
  std::string job;

  Status Validate() const;
};

class CommManager {
 public:
  static Result<std::unique_ptr<CommManager>> Create(Backend backend, RendezvousStore* store,
                                                     CommOptions options);
  virtual ~CommManager() = default;

  // On a new quorum_id: aborts the old communicator, rendezvous under `quorum_id` (keys carry
  // the slot) and initialises the new one within init_timeout. Calling it again with the
  // current quorum_id returns the outcome of the first call without doing anything; a
  // communicator that failed or was aborted stays failed until a newer quorum_id. A quorum_id
  // below the current one is kInvalidArgument (ids only go up).
  virtual Status Reconfigure(uint32_t quorum_id, uint32_t replica_rank, uint32_t world_size) = 0;

  // In-place allreduce of `count` elements at `data` (host memory for Gloo, device memory for
  // NCCL). bfloat16 is summed in float32 and rounded once at the end (Gloo). Returns kAborted
  // when Abort is called during it or a peer fails, kDeadlineExceeded past op_timeout; it never
  // hangs. After an error the buffer's content is unspecified and the communicator is failed.
  virtual Status AllReduce(void* data, size_t count, DType dtype, ReduceOp op) = 0;

  // In-place allreduce of float32 host values that travel encoded by `codec`: the elements are
  // cut into one chunk per member (whole blocks), every member sends its encoding of chunk c to
  // member c, which decodes the contributions, sums them in float32 in replica_rank order,
  // divides by the world size for kAvg, encodes the result and sends it to every member; every
  // member then decodes all chunks of the result from the same bytes, so `data` holds the same
  // bits everywhere. Each member sends about 2 (W-1)/W x EncodedBytes(count) bytes. `sent`, when
  // not empty (count elements), gets what this member's own encoding decodes to: the caller's
  // error feedback. `result_feedback`, when not empty (count elements), is the owner's error
  // feedback on the result (two-way error feedback): before encoding the result of the chunk it
  // owns, a member adds that chunk's elements of result_feedback to it, and afterwards stores
  // there what the encoding dropped (the value it encoded minus what its bytes decode to, 0 where
  // that is not finite); elements of chunks it does not own are left as they are. A caller that
  // keeps it from step to step delivers the rounding of one step's result in the next ones
  // instead of losing it. The encoding of a member that used another codec fails the collective
  // with kConflict. Failures, abort and op_timeout as AllReduce. Backends without it:
  // kUnavailable.
  virtual Status AllReduceEncoded(std::span<float> data, const ChunkCodec& codec, ReduceOp op,
                                  std::span<float> sent = {},
                                  std::span<float> result_feedback = {});

  // In-place sum of runs of elements that only some members hold, for members whose buffers
  // are laid out differently (DiLoCo groups of different sizes: each element of the model lives
  // in one trainer of every group, at a place that depends on the group's layout). Each run of
  // `runs` is a stretch of this member's `data` whose elements the members `holders` hold too,
  // each at a place of its own; the run's `owner` (one of the holders) receives the other
  // holders' copies, sums them in float32 in `holders` order, and sends the result back, so
  // every holder ends with the same bits. Members pass only the runs they hold, all in one
  // order common to every member (e.g. by position in the whole model), since each pair's
  // messages are their shared runs in that order. With `codec` (not null) every contribution
  // and result travels encoded, run by run, and `sent` (data.size() elements, when not empty)
  // gets what this member's own encoding decodes to (its error feedback); the owner decodes,
  // sums and encodes the result once, and every holder, the owner too, decodes those bytes.
  // `result_feedback` (data.size() elements, when not empty, with a codec) is the owner's error
  // feedback on the result as in AllReduceEncoded, for the runs this member owns.
  // Failures, abort and op_timeout as AllReduce; needs CommOptions::full_mesh beyond three
  // members. Backends without it: kUnavailable.
  virtual Status AllReduceRuns(std::span<float> data, std::span<const ReduceRun> runs,
                               const ChunkCodec* codec, std::span<float> sent = {},
                               std::span<float> result_feedback = {});

  // Aborts the current communicator (or the one being initialised): a collective in flight
  // returns kAborted at once, later ones too, until Reconfigure with a newer quorum_id.
  virtual void Abort(const std::string& reason) = 0;
  // Like Abort, but only when the communicator belongs to `quorum_id` or an older one, so that a
  // late failure notice about an old quorum cannot abort its successor. A notice about a quorum
  // newer than the current communicator (it arrived between the poll and the rendezvous) is kept:
  // a later Reconfigure of that quorum_id or an older one fails at once with kAborted.
  virtual void AbortQuorum(uint32_t quorum_id, const std::string& reason) = 0;
  // Abort, and every later Reconfigure fails at once with kAborted and `reason`: the owner is
  // leaving (a drain) and must not wait in a rendezvous for anyone.
  virtual void Close(const std::string& reason) = 0;

  // The quorum_id of the last Reconfigure (0 before the first).
  virtual uint32_t quorum_id() const = 0;
  virtual Backend backend() const = 0;
};

}  // namespace lk::comm
