#include "common/http/head.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>

namespace lk::http {

bool IEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

namespace {

bool TokenChar(char c) {
  // RFC 9110 tchar.
  if (std::isalnum(static_cast<unsigned char>(c))) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

std::string_view Trim(std::string_view v) {
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
  return v;
}

}  // namespace

std::string ParseHead(std::string_view text, Head* h) {
  auto eol = text.find("\r\n");
  if (eol == std::string_view::npos) return "request line without CRLF";
  std::string_view line = text.substr(0, eol);
  text.remove_prefix(eol + 2);
  auto sp1 = line.find(' ');
  auto sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos) return "bad request line";
  h->method = line.substr(0, sp1);
  h->target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  std::string_view version = line.substr(sp2 + 1);
  if (h->method.empty() || !std::all_of(h->method.begin(), h->method.end(), TokenChar)) {
    return "bad method";
  }
  if (h->target.empty() || std::any_of(h->target.begin(), h->target.end(), [](char c) {
        return static_cast<unsigned char>(c) <= 0x20 || c == 0x7f;
      })) {
    return "bad target";
  }
  if (version == "HTTP/1.1") {
    h->version = 11;
  } else if (version == "HTTP/1.0") {
    h->version = 10;
  } else {
    return "bad version";
  }
  bool close = false, keep = false, have_length = false, blank = false;
  while (!text.empty()) {
    eol = text.find("\r\n");
    if (eol == std::string_view::npos) return "header line without CRLF";
    line = text.substr(0, eol);
    text.remove_prefix(eol + 2);
    if (line.empty()) {  // the blank line
      blank = true;
      break;
    }
    auto colon = line.find(':');
    if (colon == 0 || colon == std::string_view::npos) return "bad header line";
    std::string_view name = line.substr(0, colon);
    if (!std::all_of(name.begin(), name.end(), TokenChar)) return "bad header name";
    std::string_view value = Trim(line.substr(colon + 1));
    if (std::any_of(value.begin(), value.end(), [](char c) {
          return (static_cast<unsigned char>(c) < 0x20 && c != '\t') || c == 0x7f;
        })) {
      return "bad header value";
    }
    if (IEquals(name, "content-length")) {
      uint64_t n = 0;
      auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
      if (value.empty() || ec != std::errc() || end != value.data() + value.size()) {
        return "bad Content-Length";
      }
      if (have_length && n != h->content_length) return "conflicting Content-Length";
      h->content_length = n;
      have_length = true;
    } else if (IEquals(name, "transfer-encoding")) {
      return "Transfer-Encoding is not supported: send the body with Content-Length";
    } else if (IEquals(name, "connection")) {
      while (!value.empty()) {
        auto comma = value.find(',');
        std::string_view token = Trim(value.substr(0, comma));
        close |= IEquals(token, "close");
        keep |= IEquals(token, "keep-alive");
        value.remove_prefix(comma == std::string_view::npos ? value.size() : comma + 1);
      }
    } else if (IEquals(name, "content-type")) {
      h->content_type = value;
    } else if (IEquals(name, "accept")) {
      h->accept = value;
    } else if (IEquals(name, "authorization")) {
      h->authorization = value;
    } else if (IEquals(name, "range")) {
      h->range = value;
    } else if (IEquals(name, "lk-gateway")) {
      h->gateway = value;
    } else if (IEquals(name, "expect")) {
      if (!IEquals(value, "100-continue")) return "unsupported Expect";
      h->expect_continue = true;
    }
  }
  if (!blank) return "head without the blank line";
  // HTTP/1.1 keeps the connection unless told; HTTP/1.0 closes it unless told.
  h->keep_alive = h->version == 11 ? !close : keep && !close;
  return {};
}

std::string FormatHead(const Head& h) {
  std::string out = fmt::format("{} {} HTTP/1.{}\r\n", h.method, h.target, h.version == 10 ? 0 : 1);
  // Connection is written whenever it matters, so keep_alive reads back the same either way.
  bool default_keep = h.version == 11;
  if (h.keep_alive != default_keep)
    out += h.keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  if (h.content_length > 0) out += fmt::format("Content-Length: {}\r\n", h.content_length);
  if (h.expect_continue) out += "Expect: 100-continue\r\n";
  auto add = [&out](std::string_view name, std::string_view value) {
    if (!value.empty()) out += fmt::format("{}: {}\r\n", name, value);
  };
  add("Content-Type", h.content_type);
  add("Accept", h.accept);
  add("Authorization", h.authorization);
  add("Range", h.range);
  add("Lk-Gateway", h.gateway);
  return out + "\r\n";
}

}  // namespace lk::http
