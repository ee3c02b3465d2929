#include "common/http/auth.h"

#include <algorithm>

#include <string>

namespace lk::http {

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  // Compare over the longer length so that the time does not depend on where they differ,
  // and fold the length difference in instead of returning early.
  size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0 && n > 0;
}

std::string_view BearerToken(std::string_view authorization) {
  constexpr std::string_view kPrefix = "Bearer ";
  if (authorization.size() <= kPrefix.size()) return {};
  if (authorization.substr(0, kPrefix.size()) != kPrefix) return {};
  return authorization.substr(kPrefix.size());
}

}  // namespace lk::http
