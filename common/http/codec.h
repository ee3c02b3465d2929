// Bodies as protobuf messages: binary (application/x-protobuf) or protobuf's JSON mapping with
// the proto field names (application/json). Also the one mapping between Status codes and HTTP
// statuses, used by servers to answer and by clients to turn answers back into Statuses.
// Thread-safety: pure functions.
#pragma once

#include <google/protobuf/message.h>

#include <map>
#include <string>

#include "common/http/http.h"
#include <lightkeeper/status.h>

namespace lk::http {

enum class Format { kJson, kProto };

inline constexpr const char* kProtoType = "application/x-protobuf";
inline constexpr const char* kJsonType = "application/json";

// The format of a request body, from its Content-Type (JSON unless it says protobuf).
Format BodyFormat(std::string_view content_type);
// The format to answer in: what Accept asks for, else the request body's format.
Format ReplyFormat(const Request& req);

// Parses a body into `msg`. An empty body is the empty message. Unknown JSON fields are ignored
// (as binary protobuf ignores unknown fields); wrong types and malformed input are errors.
Status Decode(std::string_view body, Format format, google::protobuf::Message* msg);
std::string Encode(const google::protobuf::Message& msg, Format format);
// Compact one-line JSON of a message with every field printed (for logs, files and CLIs).
std::string ToJson(const google::protobuf::Message& msg, bool pretty = false);

Response Reply(const google::protobuf::Message& msg, Format format, int status = 200);
Response ErrorReply(const Status& status, Format format);
// The Status of a non-2xx answer: the code of the HTTP status, the server's reason text and its
// reason code (ErrorResponse.code; kUnspecified when the body is no ErrorResponse).
Status StatusFromErrorBody(int http_status, std::string_view body, std::string_view content_type);

// The query parameter `key` as a 32-bit unsigned integer (decimal digits only), `def` when it is
// absent or empty; anything else (a sign, a space, a value past 2^32 - 1) is kInvalidArgument.
Result<uint32_t> ParseU32(const std::map<std::string, std::string>& q, const std::string& key,
                          uint32_t def);
Response TextReply(int status, std::string content_type, std::string body);

int HttpStatusFor(Code code);
Code CodeForHttpStatus(int status);

}  // namespace lk::http
