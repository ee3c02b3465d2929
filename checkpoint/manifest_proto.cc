#include "checkpoint/manifest_proto.h"

#include <climits>

#include <google/protobuf/util/json_util.h>

namespace lk::ckpt {

void ToProto(const Manifest& m, pb::Manifest* out) {
  out->set_format_version(m.format_version);
  out->set_step(m.step);
  out->set_ranks(m.ranks);
  out->set_created_unix_ms(m.created_unix_ms);
  out->set_chunk_bytes(m.chunk_bytes);
  out->set_partial(m.partial);
  for (const auto& f : m.files) {
    auto* pf = out->add_files();
    pf->set_name(f.name);
    pf->set_rank(f.rank);
    pf->set_size_bytes(f.size_bytes);
    pf->set_header_bytes(f.header_bytes);
    pf->set_header_xxh3(f.header_xxh3);
  }
  for (const auto& t : m.tensors) {
    auto* pt = out->add_tensors();
    pt->set_name(t.name);
    pt->set_dtype(std::string(DTypeName(t.dtype)));
    for (int64_t d : t.shape) pt->add_shape(d);
    for (const auto& s : t.slices) {
      auto* ps = pt->add_slices();
      ps->set_file(s.file);
      ps->set_row_begin(s.rows.begin);
      ps->set_row_end(s.rows.end);
      ps->set_offset(s.offset);
      ps->set_length(s.length);
      for (uint64_t h : s.chunk_xxh3) ps->add_chunk_xxh3(h);
    }
  }
  for (const auto& [k, v] : m.metadata) (*out->mutable_metadata())[k] = v;
}

Result<Manifest> FromProto(const pb::Manifest& p) {
  Manifest m;
  m.format_version = p.format_version();
  m.step = p.step();
  m.ranks = p.ranks();
  m.created_unix_ms = p.created_unix_ms();
  m.chunk_bytes = p.chunk_bytes();
  m.partial = p.partial();
  for (const auto& f : p.files()) {
    m.files.push_back(ShardFileInfo{f.name(), f.rank(), f.size_bytes(), f.header_bytes(),
                                    f.header_xxh3()});
  }
  for (const auto& t : p.tensors()) {
    auto dtype = ParseDType(t.dtype());
    if (!dtype) return Error(Code::kDataLoss, "tensor '{}' has unknown dtype '{}'", t.name(), t.dtype());
    TensorInfo ti{t.name(), *dtype, {t.shape().begin(), t.shape().end()}, {}};
    for (const auto& s : t.slices()) {
      ti.slices.push_back(SliceInfo{s.file(), RowRange{s.row_begin(), s.row_end()}, s.offset(),
                                    s.length(), {s.chunk_xxh3().begin(), s.chunk_xxh3().end()}});
    }
    m.tensors.push_back(std::move(ti));
  }
  m.metadata.insert(p.metadata().begin(), p.metadata().end());
  return m;
}

std::string SerializeManifest(const Manifest& m) {
  pb::Manifest p;
  ToProto(m, &p);
  std::string out;
  p.SerializeToString(&out);
  return out;
}

Result<Manifest> ParseManifest(std::string_view bytes) {
  pb::Manifest p;
  // Protobuf takes an int size; a larger one would throw inside it.
  if (bytes.size() > static_cast<size_t>(INT_MAX)) {
    return Error(Code::kDataLoss, "manifest of {} bytes is too large", bytes.size());
  }
  if (!p.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return Error(Code::kDataLoss, "manifest does not parse ({} bytes)", bytes.size());
  }
  return FromProto(p);
}

std::string ManifestToJson(const Manifest& m) {
  pb::Manifest p;
  ToProto(m, &p);
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  auto st = google::protobuf::util::MessageToJsonString(p, &out, o);
  LK_CHECK(st.ok()) << st.ToString();
  return out;
}

}  // namespace lk::ckpt
