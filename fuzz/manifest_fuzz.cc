// The checkpoint manifest parser (protobuf bytes -> Manifest), its validation and the restore
// planner that trusts a validated manifest. Invariants: a parse either fails with kDataLoss or
// round-trips (serialize, parse again: the same manifest); a manifest that validates plans a
// restore onto 1 and 3 ranks whose reads lie inside their files, whose checksums cover each read
// exactly and whose copies land inside the target tensors.
#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "checkpoint/manifest.h"
#include "checkpoint/manifest_proto.h"
#include "checkpoint/planner.h"
#include <lightkeeper/check.h>

namespace {

using namespace lk::ckpt;

void CheckPlan(const Manifest& m, TargetLayout layout) {
  auto plan = PlanRestore(m, layout);
  if (!plan.ok()) return;  // e.g. a partial manifest
  for (const auto& r : plan->reads) {
    LK_CHECK(r.file < m.files.size()) << "read of file #" << r.file;
    const auto& f = m.files[r.file];
    LK_CHECK(r.offset >= f.header_bytes && r.length <= f.size_bytes &&
             r.offset <= f.size_bytes - r.length)
        << "read of " << r.length << " bytes at " << r.offset << " outside " << f.name;
    uint64_t covered = 0;
    for (const auto& c : r.checks) {
      LK_CHECK(c.offset == covered && c.length > 0) << "checksums leave a gap in a read";
      covered += c.length;
    }
    LK_CHECK(covered == r.length) << "checksums cover " << covered << " of " << r.length;
    for (const auto& c : r.copies) {
      LK_CHECK(c.tensor < plan->tensors.size()) << "copy to tensor #" << c.tensor;
      LK_CHECK(c.length <= r.length && c.src_offset <= r.length - c.length)
          << "copy outside its read";
      uint64_t dest = plan->tensors[c.tensor].bytes;
      LK_CHECK(c.length <= dest && c.dst_offset <= dest - c.length) << "copy outside its tensor";
    }
  }
}

}  // namespace

// libprotobuf logs every string field with invalid UTF-8 it refuses: at fuzzing rates that is
// most of the time spent, and none of it is a finding.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto m = ParseManifest(bytes);
  if (!m.ok()) {
    LK_CHECK(m.status().code() == lk::Code::kDataLoss) << m.status().ToString();
    return 0;
  }
  auto again = ParseManifest(SerializeManifest(*m));
  LK_CHECK(again.ok()) << "a serialized manifest does not parse: " << again.status().ToString();
  LK_CHECK(*again == *m) << "the manifest changed in a round trip";
  if (!ValidateManifest(*m).ok()) return 0;
  CheckPlan(*m, TargetLayout{1, 0});
  CheckPlan(*m, TargetLayout{3, 1});
  (void)ManifestToJson(*m);
  return 0;
}
