// The JSON and protobuf decoding of every message of the wire schema (common/proto/
// lightkeeper.proto: every lighthouse and agent request, and the answers clients decode), as the
// services and clients call it (common/http/codec.h). The first byte picks the message type and
// the format; the rest is the body. Invariants: Decode either fails cleanly or the message
// round-trips: Encode in the same format and in the other one, Decode again, and the message is
// the same.
#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/util/field_comparator.h>
#include <google/protobuf/util/message_differencer.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <lightkeeper/check.h>
#include "common/http/codec.h"
#include "common/proto/lightkeeper.pb.h"

namespace {

namespace gp = google::protobuf;

// Every message type of the schema file, found through its descriptor so that a message added
// later is fuzzed without a change here.
const std::vector<const gp::Message*>& Prototypes() {
  static const std::vector<const gp::Message*> all = [] {
    std::vector<const gp::Message*> out;
    const gp::FileDescriptor* file = lightkeeper::v1::HeartbeatRequest::descriptor()->file();
    for (int i = 0; i < file->message_type_count(); ++i) {
      out.push_back(gp::MessageFactory::generated_factory()->GetPrototype(file->message_type(i)));
    }
    return out;
  }();
  return all;
}

bool Same(const gp::Message& a, const gp::Message& b) {
  // Float fields compare exactly (JSON prints floats the way it reads them back), but NaN never
  // equals itself.
  gp::util::DefaultFieldComparator floats;
  floats.set_float_comparison(gp::util::DefaultFieldComparator::EXACT);
  floats.set_treat_nan_as_equal(true);
  gp::util::MessageDifferencer d;
  d.set_field_comparator(&floats);
  return d.Compare(a, b);
}

void RoundTrip(const gp::Message& msg, lk::http::Format format, const gp::Message& prototype) {
  std::string body = lk::http::Encode(msg, format);
  std::unique_ptr<gp::Message> back(prototype.New());
  lk::Status st = lk::http::Decode(body, format, back.get());
  LK_CHECK(st.ok()) << msg.GetDescriptor()->name()
                    << ": encoded body does not decode: " << st.ToString();
  LK_CHECK(Same(msg, *back)) << msg.GetDescriptor()->name() << " changed in a round trip";
}

}  // namespace

// libprotobuf logs every string field with invalid UTF-8 it refuses: at fuzzing rates that is
// most of the time spent, and none of it is a finding.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const auto& protos = Prototypes();
  const gp::Message& prototype = *protos[(data[0] >> 1) % protos.size()];
  auto format = (data[0] & 1) ? lk::http::Format::kProto : lk::http::Format::kJson;
  std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  std::unique_ptr<gp::Message> msg(prototype.New());
  lk::Status st = lk::http::Decode(body, format, msg.get());
  if (!st.ok()) {
    LK_CHECK(st.code() == lk::Code::kInvalidArgument) << st.ToString();
    return 0;
  }
  // Unknown fields survive binary round trips but not JSON (the mapping drops them): compare
  // without them.
  msg->DiscardUnknownFields();
  RoundTrip(*msg, lk::http::Format::kProto, prototype);
  RoundTrip(*msg, lk::http::Format::kJson, prototype);
  (void)lk::http::ToJson(*msg, /*pretty=*/true);
  return 0;
}
