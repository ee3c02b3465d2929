#include "lighthouse/state_store.h"

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <algorithm>
#include <charconv>

#include "common/log.h"
#include "common/proto/lightkeeper.pb.h"
#include "lighthouse/convert.h"

namespace lk::lighthouse {
namespace {

namespace pb = lightkeeper::v1;

// Key layout. Numbers are zero-padded so that RocksDB's byte order is numeric order.
//   job/<job>                      -> JobRecord
//   group/<job>/<group_id>         -> GroupRecord
//   ckpt/<job>/<step:010>          -> CheckpointInfo
//   kv/<job>/<quorum_id:010>/<key> -> raw bytes
// Job names cannot contain '/', which the service checks at the edge.
std::string JobKey(const std::string& job) { return "job/" + job; }
std::string GroupPrefix(const std::string& job) { return "group/" + job + "/"; }
std::string GroupKey(const std::string& job, const std::string& group) {
  return GroupPrefix(job) + group;
}
std::string CkptPrefix(const std::string& job) { return "ckpt/" + job + "/"; }
std::string CkptKey(const std::string& job, uint32_t step) {
  return fmt::format("ckpt/{}/{:010}", job, step);
}
std::string KvPrefix(const std::string& job) { return "kv/" + job + "/"; }
std::string KvKey(const std::string& job, uint32_t qid, const std::string& key) {
  return fmt::format("kv/{}/{:010}/{}", job, qid, key);
}

bool PlainJobName(std::string_view job) {
  return !job.empty() && job.find('/') == std::string_view::npos;
}

// Parses kv/<job>/<quorum_id:010>/<key> (the job has no '/', the id is exactly 10 digits, the key
// is the rest) into `e`. Every byte is checked: the key came from disk and may be anything.
bool ParseKvKey(std::string_view k, KvEntry* e) {
  constexpr std::string_view kPrefix = "kv/";
  if (k.substr(0, kPrefix.size()) != kPrefix) return false;
  k.remove_prefix(kPrefix.size());
  auto slash = k.find('/');
  if (slash == std::string_view::npos || slash == 0 || k.size() < slash + 12 ||
      k[slash + 11] != '/') {
    return false;
  }
  std::string_view digits = k.substr(slash + 1, 10);
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  uint64_t qid = 0;
  auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), qid);
  if (ec != std::errc() || p != digits.data() + digits.size() || qid > UINT32_MAX) return false;
  e->job = std::string(k.substr(0, slash));
  e->quorum_id = static_cast<uint32_t>(qid);
  e->key = std::string(k.substr(slash + 12));
  return true;
}

Status FromRocks(const rocksdb::Status& st, std::string_view what) {
  if (st.ok()) return Status::Ok();
  Code code = st.IsNoSpace()      ? Code::kResourceExhausted
              : st.IsCorruption() ? Code::kDataLoss
                                  : Code::kUnavailable;
  return Status(code, fmt::format("rocksdb {}: {}", what, st.ToString()));
}

class RocksDbStore final : public StateStore {
 public:
  explicit RocksDbStore(std::unique_ptr<rocksdb::DB> db) : db_(std::move(db)) {}

  Status Apply(const std::vector<JobRecordData>& jobs,
               const std::vector<CheckpointData>& checkpoints,
               const std::vector<std::string>& forget_jobs,
               const std::vector<GroupRecordData>& groups,
               const std::vector<std::pair<std::string, std::string>>& drop_groups,
               bool sync) override {
    rocksdb::WriteBatch batch;
    for (const auto& job : forget_jobs) {
      batch.Delete(JobKey(job));
      LK_RETURN_IF_ERROR(DeletePrefix(GroupPrefix(job), &batch));
      LK_RETURN_IF_ERROR(DeletePrefix(CkptPrefix(job), &batch));
      LK_RETURN_IF_ERROR(DeletePrefix(KvPrefix(job), &batch));
    }
    for (const auto& j : jobs) {
      pb::JobRecord rec;
      rec.set_job(j.job);
      rec.set_quorum_id(j.quorum_id);
      rec.set_committed_step(j.committed_step);
      rec.set_quorum_changes(j.quorum_changes);
      rec.set_quorum_id_reserved(j.quorum_id_reserved);
      rec.set_generation_last(j.generation_last);
      rec.set_finished_step(j.finished_step);
      rec.set_catch_up(j.catch_up);
      rec.set_quorum_lost(j.lost);
      rec.set_quorum_force_new(j.force_new);
      for (const auto& m : j.members) ToProto(m, rec.add_members());
      for (const auto& t : j.tokens) {
        auto* out = rec.add_tokens();
        out->set_group_id(t.group_id);
        out->set_step(t.step);
        out->set_tokens(t.tokens);
        out->set_total(t.total);
      }
      for (const auto& l : j.lives) {
        auto* out = rec.add_lives();
        out->set_group_id(l.group_id);
        out->set_crashes(l.crashes);
        out->set_requeue_refusals(l.requeue_refusals);
        for (const auto& c : l.crashed_incarnations) out->add_crashed_incarnations(c);
        out->set_last_event(l.last_event);
      }
      batch.Put(JobKey(j.job), rec.SerializeAsString());
    }
    for (const auto& g : groups) {
      pb::GroupRecord rec;
      rec.set_job(g.job);
      rec.set_group_id(g.group_id);
      rec.set_incarnation(g.incarnation);
      rec.set_generation(g.generation);
      rec.set_nodes(g.nodes);
      rec.set_left(g.left);
      rec.set_reason(g.reason);
      for (const auto& r : g.retired) {
        auto* out = rec.add_retired();
        out->set_incarnation(r.incarnation);
        out->set_generation(r.generation);
      }
      batch.Put(GroupKey(g.job, g.group_id), rec.SerializeAsString());
    }
    for (const auto& [job, group] : drop_groups) batch.Delete(GroupKey(job, group));
    for (const auto& c : checkpoints) {
      pb::CheckpointInfo info;
      ToProto(c, &info);
      batch.Put(CkptKey(c.job, c.step), info.SerializeAsString());
    }
    rocksdb::WriteOptions wo;
    wo.sync = sync;
    return FromRocks(db_->Write(wo, &batch), "write");
  }

  Result<std::vector<JobRecordData>> LoadJobs() override {
    std::vector<JobRecordData> out;
    Status st = Scan("job/", [&](const rocksdb::Slice& key, const rocksdb::Slice& value) {
      pb::JobRecord rec;
      if (!rec.ParseFromArray(value.data(), static_cast<int>(value.size()))) {
        return Error(Code::kDataLoss, "corrupt job record {}", Q(key.ToString()));
      }
      // The key names the job too: a record under another job's key is not this job's state.
      if (key.ToString() != JobKey(rec.job()) || !PlainJobName(rec.job())) {
        return Error(Code::kDataLoss, "job record {} holds job {}", Q(key.ToString()),
                     Q(rec.job()));
      }
      JobRecordData j;
      j.job = rec.job();
      j.quorum_id = rec.quorum_id();
      j.committed_step = rec.committed_step();
      j.quorum_changes = rec.quorum_changes();
      j.quorum_id_reserved = rec.quorum_id_reserved();
      j.generation_last = rec.generation_last();
      j.finished_step = rec.finished_step();
      j.catch_up = rec.catch_up();
      j.lost = rec.quorum_lost();
      j.force_new = rec.quorum_force_new();
      for (const auto& m : rec.members()) j.members.push_back(FromProto(m));
      for (const auto& t : rec.tokens()) {
        j.tokens.push_back(GroupTokensData{t.group_id(), t.step(), t.tokens(), t.total()});
      }
      for (const auto& l : rec.lives()) {
        j.lives.push_back(
            GroupLivesData{l.group_id(),
                           l.crashes(),
                           l.requeue_refusals(),
                           {l.crashed_incarnations().begin(), l.crashed_incarnations().end()},
                           l.last_event()});
      }
      out.push_back(std::move(j));
      return Status::Ok();
    });
    if (!st.ok()) return st;
    return out;
  }

  Result<std::vector<GroupRecordData>> LoadGroups() override {
    std::vector<GroupRecordData> out;
    Status st = Scan("group/", [&](const rocksdb::Slice& key, const rocksdb::Slice& value) {
      pb::GroupRecord rec;
      if (!rec.ParseFromArray(value.data(), static_cast<int>(value.size()))) {
        return Error(Code::kDataLoss, "corrupt group record {}", key.ToString());
      }
      GroupRecordData g;
      g.job = rec.job();
      g.group_id = rec.group_id();
      g.incarnation = rec.incarnation();
      g.generation = rec.generation();
      g.nodes = rec.nodes();
      g.left = rec.left();
      g.reason = rec.reason();
      for (const auto& r : rec.retired()) g.retired.push_back({r.incarnation(), r.generation()});
      out.push_back(std::move(g));
      return Status::Ok();
    });
    if (!st.ok()) return st;
    return out;
  }

  Result<std::vector<CheckpointData>> LoadCheckpoints() override {
    std::vector<CheckpointData> out;
    Status st = Scan("ckpt/", [&](const rocksdb::Slice& key, const rocksdb::Slice& value) {
      pb::CheckpointInfo info;
      if (!info.ParseFromArray(value.data(), static_cast<int>(value.size()))) {
        return Error(Code::kDataLoss, "corrupt checkpoint record {}", Q(key.ToString()));
      }
      if (key.ToString() != CkptKey(info.job(), info.step()) || !PlainJobName(info.job())) {
        return Error(Code::kDataLoss, "checkpoint record {} holds job {} step {}",
                     Q(key.ToString()), Q(info.job()), info.step());
      }
      out.push_back(FromProto(info));
      return Status::Ok();
    });
    if (!st.ok()) return st;
    return out;
  }

  Status PutKv(const KvEntry& e) override {
    return FromRocks(db_->Put(rocksdb::WriteOptions(), KvKey(e.job, e.quorum_id, e.key), e.value),
                     "put kv");
  }

  Result<std::vector<KvEntry>> LoadKv() override {
    std::vector<KvEntry> out;
    Status st = Scan("kv/", [&](const rocksdb::Slice& key, const rocksdb::Slice& value) {
      KvEntry e;
      if (!ParseKvKey(std::string_view(key.data(), key.size()), &e)) {
        return Error(Code::kDataLoss, "corrupt kv key {}", Q(key.ToString()));
      }
      e.value = value.ToString();
      out.push_back(std::move(e));
      return Status::Ok();
    });
    if (!st.ok()) return st;
    return out;
  }

  Status DeleteKvBelow(const std::string& job, uint32_t keep_from) override {
    if (keep_from == 0) return Status::Ok();
    rocksdb::WriteBatch batch;
    batch.DeleteRange(KvPrefix(job), fmt::format("kv/{}/{:010}", job, keep_from));
    return FromRocks(db_->Write(rocksdb::WriteOptions(), &batch), "delete kv");
  }

  Status DeleteCheckpoint(const std::string& job, uint32_t step) override {
    return FromRocks(db_->Delete(rocksdb::WriteOptions(), CkptKey(job, step)), "delete checkpoint");
  }

 private:
  template <class F>
  Status Scan(const std::string& prefix, F f) {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
      LK_RETURN_IF_ERROR(f(it->key(), it->value()));
    }
    return FromRocks(it->status(), "scan " + prefix);
  }

  Status DeletePrefix(const std::string& prefix, rocksdb::WriteBatch* batch) {
    std::string end = prefix;
    end.back() = static_cast<char>(end.back() + 1);
    batch->DeleteRange(prefix, end);
    return Status::Ok();
  }

  std::unique_ptr<rocksdb::DB> db_;
};

}  // namespace

Result<std::unique_ptr<StateStore>> OpenRocksDbStore(const std::string& dir) {
  rocksdb::Options options;
  options.create_if_missing = true;
  // The state is small (a few KiB per job); keep RocksDB's own footprint and start-up small.
  options.max_open_files = 64;
  options.keep_log_file_num = 4;
  options.IncreaseParallelism(1);
  // RocksDB preallocates each write-ahead log at 1.1x the memtable size: 70 MB of disk per
  // lighthouse with the 64 MB default, for state that fits in a few MB. 4 MB memtables keep the
  // log near 4.4 MB and flush to sorted files often enough for a restart to replay little.
  options.write_buffer_size = 4 << 20;
  rocksdb::DB* raw = nullptr;
  auto st = rocksdb::DB::Open(options, dir, &raw);
  if (!st.ok()) return FromRocks(st, "open " + dir);
  return std::unique_ptr<StateStore>(
      std::make_unique<RocksDbStore>(std::unique_ptr<rocksdb::DB>(raw)));
}

}  // namespace lk::lighthouse
