// The token file's parser and the name alphabet (tokens.h).
#include "common/http/tokens.h"

#include <cctype>
#include <sstream>

#include "common/flags.h"

namespace lk::http {

Status ValidName(std::string_view what, std::string_view v, size_t max) {
  if (v.empty()) return InvalidArgument("{} is missing", what);
  if (v.size() > max) return InvalidArgument("{} is longer than {} bytes", what, max);
  for (char c : v) {
    bool ok = std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
              c == ':' || c == '@' || c == '+';
    if (!ok) return InvalidArgument("{} '{}' has a character outside [A-Za-z0-9-_.:@+]", what, v);
  }
  return Status::Ok();
}

Result<Tokens> LoadTokens(const std::string& token_file, const std::string& admin_file) {
  Tokens t;
  if (!admin_file.empty()) {
    LK_ASSIGN_OR_RETURN(t.admin, ReadTokenFile(admin_file));
    t.enabled = true;
  }
  if (token_file.empty()) return t;
  LK_ASSIGN_OR_RETURN(std::string text, ReadTokenFile(token_file));
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    std::istringstream fields(line);
    std::string a, b, extra;
    fields >> a >> b >> extra;
    if (a.empty() || a[0] == '#') continue;
    if (!extra.empty())
      return InvalidArgument("token file {} line {}: more than two fields", token_file, n);
    if (b.empty()) {
      t.any_job.push_back(a);
    } else if (a.rfind("role=", 0) == 0) {
      if (a == "role=read-only") {
        t.read_only.push_back(b);
      } else if (a == "role=all-jobs") {
        t.any_job.push_back(b);
      } else if (a == "role=gateway") {
        t.gateway.push_back(b);
      } else {
        return InvalidArgument("token file {} line {}: unknown {} (read-only, all-jobs or gateway)",
                               token_file, n, a);
      }
    } else {
      Status name = ValidName("job", a);
      if (!name.ok()) return name.WithContext(fmt::format("token file {} line {}", token_file, n));
      t.per_job[a].push_back(b);
    }
  }
  t.enabled = true;
  return t;
}

}  // namespace lk::http
