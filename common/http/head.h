// The HTTP/1.1 request head, parsed by hand from the bytes a peer sent: the request line and the
// header lines that the services use. The server parses every request with it, in place in the
// connection's buffer (no copies); the fuzz target in fuzz/ checks it on hostile input.
// Pure: no I/O. Thread-safety: plain functions on values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace lk::http {

// One request head. The views point into the parsed text.
struct Head {
  std::string_view method, target;
  unsigned version = 11;
  bool keep_alive = true;
  bool expect_continue = false;
  uint64_t content_length = 0;
  std::string_view content_type, accept, authorization, range;
  std::string_view gateway;  // Lk-Gateway: an lk_gateway's credential and site (request.h)
};

// Parses "METHOD SP TARGET SP HTTP/1.x CRLF (NAME: VALUE CRLF)* CRLF" (`text` ends after the
// blank line). Returns an empty string or why the head is malformed. Only what the services
// use is kept; every header line is still checked for shape. Any bytes at all are safe to pass:
// a head that does not end with the blank line is malformed.
std::string ParseHead(std::string_view text, Head* h);

// The head as text that ParseHead reads back into the same values (for tests and the fuzzer;
// the client writes its own requests).
std::string FormatHead(const Head& h);

// ASCII case-insensitive equality, for header names and tokens.
bool IEquals(std::string_view a, std::string_view b);

}  // namespace lk::http
