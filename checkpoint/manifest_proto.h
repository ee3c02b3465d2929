// Converts the manifest between its plain form (manifest.h) and its protobuf wire/disk form, once,
// at the shell edge, so the core never links protobuf.
// Thread-safety: plain functions.
#pragma once

#include <string>
#include <string_view>

#include "checkpoint/checkpoint.pb.h"
#include "checkpoint/manifest.h"
#include <lightkeeper/status.h>

namespace lk::ckpt {

namespace pb = ::lightkeeper::checkpoint::v1;

void ToProto(const Manifest& m, pb::Manifest* out);
// Fails (kDataLoss) on an unknown dtype; does not validate (callers do, with their context).
Result<Manifest> FromProto(const pb::Manifest& p);
std::string SerializeManifest(const Manifest& m);
Result<Manifest> ParseManifest(std::string_view bytes);
// The manifest as JSON, for `checkpoint inspect --json`.
std::string ManifestToJson(const Manifest& m);

}  // namespace lk::ckpt
