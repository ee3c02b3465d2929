#include "common/http/codec.h"

#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/util/json_util.h>

#include <climits>

#include "common/log.h"
#include "common/proto/lightkeeper.pb.h"

namespace lk::http {

namespace {

// libprotobuf writes a line of its own to stderr for some bodies it refuses (a string field
// that is not UTF-8): outside the log's format and at the sender's pace, one line per request a
// stranger sends. Its messages go through the project's log instead, at most one every 10 s
// with the count dropped in between (a FATAL one always: libprotobuf aborts after it).
void ProtobufLog(google::protobuf::LogLevel level, const char* file, int line,
                 const std::string& message) {
  static LineLimiter limiter(std::chrono::seconds(10));
  uint64_t dropped = 0;
  if (level != google::protobuf::LOGLEVEL_FATAL &&
      !limiter.Allow(LineLimiter::Clock::now(), &dropped)) {
    return;
  }
  const char* name = level == google::protobuf::LOGLEVEL_INFO      ? "info"
                     : level == google::protobuf::LOGLEVEL_WARNING ? "warning"
                     : level == google::protobuf::LOGLEVEL_ERROR   ? "error"
                                                                   : "fatal";
  LK_LOG_WARN("protobuf_message level={} at={}:{} text={} dropped_since_last={}", name,
              Q(file != nullptr ? file : ""), line, Q(message), dropped);
}

// Every process that decodes a peer's body links this file, so the handler is in place
// before the first one arrives.
[[maybe_unused]] const bool kProtobufLogRouted = [] {
  google::protobuf::SetLogHandler(&ProtobufLog);
  return true;
}();

}  // namespace

Format BodyFormat(std::string_view content_type) {
  return content_type.find("protobuf") != std::string_view::npos ? Format::kProto : Format::kJson;
}

Format ReplyFormat(const Request& req) {
  if (req.accept.find("protobuf") != std::string::npos) return Format::kProto;
  if (req.accept.find("json") != std::string::npos) return Format::kJson;
  return BodyFormat(req.content_type);
}

Status Decode(std::string_view body, Format format, google::protobuf::Message* msg) {
  msg->Clear();
  if (body.empty()) return Status::Ok();
  if (format == Format::kProto) {
    // Protobuf takes an int size; a larger one would throw (or abort) inside it. Answers are
    // read up to 8 GiB (shard bodies), so a peer can send one this large.
    if (body.size() > static_cast<size_t>(INT_MAX)) {
      return InvalidArgument("body of {} bytes is over the {} a protobuf may have", body.size(),
                             INT_MAX);
    }
    if (!msg->ParseFromArray(body.data(), static_cast<int>(body.size()))) {
      return InvalidArgument("body is not a valid {} protobuf", msg->GetDescriptor()->name());
    }
    return Status::Ok();
  }
  google::protobuf::util::JsonParseOptions opts;
  opts.ignore_unknown_fields = true;
  auto st = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(body.data(), body.size()), msg, opts);
  if (!st.ok()) {
    msg->Clear();
    return InvalidArgument("body is not valid JSON for {}: {}", msg->GetDescriptor()->name(),
                           std::string(st.message()));
  }
  return Status::Ok();
}

std::string ToJson(const google::protobuf::Message& msg, bool pretty) {
  google::protobuf::util::JsonPrintOptions opts;
  opts.preserve_proto_field_names = true;
  opts.always_print_primitive_fields = true;
  opts.add_whitespace = pretty;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(msg, &out, opts);
  return out;
}

std::string Encode(const google::protobuf::Message& msg, Format format) {
  if (format == Format::kProto) return msg.SerializeAsString();
  return ToJson(msg);
}

Response Reply(const google::protobuf::Message& msg, Format format, int status) {
  Response r;
  r.status = status;
  r.content_type = format == Format::kProto ? kProtoType : kJsonType;
  r.body = Encode(msg, format);
  return r;
}

namespace {

// Refusals quote what the caller sent (a path, a name); a string field must be UTF-8, or
// protobuf's JSON printer fails and the answer goes out without its body. Bytes that are not
// part of a valid sequence are written as \xNN.
std::string ValidUtf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  while (!s.empty()) {
    size_t n = Utf8SequenceBytes(s);
    if (n == 0) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(s[0]));
      n = 1;
    } else {
      out.append(s.substr(0, n));
    }
    s.remove_prefix(n);
  }
  return out;
}

}  // namespace

Response ErrorReply(const Status& status, Format format) {
  lightkeeper::v1::ErrorResponse e;
  e.set_error(std::string(CodeName(status.code())));
  e.set_reason(ValidUtf8(status.message()));
  Reason reason = status.reason() == Reason::kUnspecified ? DefaultReason(status.code())
                                                          : status.reason();
  e.set_code(static_cast<lightkeeper::v1::ErrorResponse::Code>(reason));
  return Reply(e, format, HttpStatusFor(status.code()));
}

Status StatusFromErrorBody(int http_status, std::string_view body,
                          std::string_view content_type) {
  lightkeeper::v1::ErrorResponse e;
  std::string text;
  Reason reason = Reason::kUnspecified;
  if (Decode(body, BodyFormat(content_type), &e).ok() && !e.reason().empty()) {
    text = e.reason();
    if (e.code() > 0 && e.code() < kReasonCount) reason = static_cast<Reason>(e.code());
  } else {
    text = std::string(body.substr(0, 200));
  }
  return Status(CodeForHttpStatus(http_status), fmt::format("HTTP {}: {}", http_status, text),
                reason);
}

Response TextReply(int status, std::string content_type, std::string body) {
  Response r;
  r.status = status;
  r.content_type = std::move(content_type);
  r.body = std::move(body);
  return r;
}

int HttpStatusFor(Code code) {
  switch (code) {
    case Code::kOk: return 200;
    case Code::kInvalidArgument: return 400;
    case Code::kUnauthenticated: return 401;
    case Code::kPermissionDenied: return 403;
    case Code::kNotFound: return 404;
    case Code::kConflict: return 409;
    case Code::kTooLarge: return 413;
    case Code::kDeadlineExceeded: return 504;
    case Code::kUnavailable: return 503;
    case Code::kAborted: return 409;
    case Code::kDataLoss: return 500;
    case Code::kResourceExhausted: return 429;
    case Code::kInternal: return 500;
  }
  return 500;
}

Code CodeForHttpStatus(int status) {
  switch (status) {
    case 200: case 201: case 204: case 206: return Code::kOk;
    case 400: case 405: case 416: return Code::kInvalidArgument;
    case 401: return Code::kUnauthenticated;
    case 403: return Code::kPermissionDenied;
    case 404: return Code::kNotFound;
    case 409: return Code::kConflict;
    case 413: return Code::kTooLarge;
    case 429: return Code::kResourceExhausted;
    case 503: return Code::kUnavailable;
    case 504: return Code::kDeadlineExceeded;
    default: return status >= 500 ? Code::kInternal : Code::kInvalidArgument;
  }
}

Result<uint32_t> ParseU32(const std::map<std::string, std::string>& q, const std::string& key,
                          uint32_t def) {
  auto it = q.find(key);
  if (it == q.end() || it->second.empty()) return def;
  uint64_t v = 0;
  for (char c : it->second) {
    if (c < '0' || c > '9' || v > UINT32_MAX) {
      return InvalidArgument("query parameter {}='{}' is not a non-negative integer", key,
                             it->second);
    }
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  if (v > UINT32_MAX) {
    return InvalidArgument("query parameter {}='{}' is not a non-negative integer", key,
                           it->second);
  }
  return static_cast<uint32_t>(v);
}

}  // namespace lk::http
