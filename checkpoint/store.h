// The on-disk layout of a checkpoint root, and reading it back:
//   ROOT/step-000000000042/          a committed checkpoint (only ever appears by rename)
//       MANIFEST                     the manifest (protobuf) + an 8-byte XXH3 of it
//       shard-00000-of-00004.safetensors ...
//   ROOT/LATEST                      "step-000000000042\n", moved by rename after each commit
//   ROOT/.tmp-step-...-ATTEMPT/      a save in progress (never read by restore)
//   ROOT/.trash-...                  a checkpoint being deleted by retention
// Thread-safety: plain functions over an Env; safe from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "checkpoint/env.h"
#include "checkpoint/manifest.h"
#include <lightkeeper/status.h>

namespace lk::ckpt {

inline constexpr char kManifestFile[] = "MANIFEST";
inline constexpr char kLatestFile[] = "LATEST";

struct CheckpointRef {
  int64_t step = 0;
  std::string name;  // "step-000000000042"
  std::string dir;   // the full path
};

std::string EncodeManifestFile(const Manifest& m);
// Fails with kDataLoss naming `what` when the trailer checksum or the proto is bad; validates.
Result<Manifest> DecodeManifestFile(std::string_view bytes, const std::string& what);

// Committed checkpoint directories in `root`, newest first. Temp and trash entries are skipped.
Result<std::vector<CheckpointRef>> ListCommitted(Env* env, const std::string& root);
// Reads and validates DIR/MANIFEST.
Result<Manifest> LoadManifest(Env* env, const std::string& dir);
// Cheap check: every shard file exists with the size the manifest says.
Status CheckFiles(Env* env, const std::string& dir, const Manifest& m);
// The newest committed checkpoint whose manifest loads and whose files pass CheckFiles. Damaged
// newer ones are skipped; `skipped` (optional) gets one reason per skipped checkpoint.
Result<CheckpointRef> FindLatest(Env* env, const std::string& root,
                                 std::vector<std::string>* skipped = nullptr);

struct VerifyOptions {
  // Called for each file as it is verified, for progress output.
  std::function<void(const std::string& file, const Status&)> on_file;
};
// Full check of a checkpoint directory: the manifest, each shard's safetensors header against
// the manifest (names, dtypes, shapes, rows, offsets), the header checksum and every chunk
// checksum. The first damage found is returned, naming the file.
Status VerifyCheckpoint(Env* env, const std::string& dir, VerifyOptions options = {});

}  // namespace lk::ckpt
