// Bearer-token checks. Tokens are compared in constant time so that response timing does not
// reveal how much of a guessed token was right.
// Thread-safety: pure functions.
#pragma once

#include <string_view>

namespace lk::http {

bool ConstantTimeEquals(std::string_view a, std::string_view b);
// The token of an "Authorization: Bearer TOKEN" header, or empty.
std::string_view BearerToken(std::string_view authorization);

}  // namespace lk::http
