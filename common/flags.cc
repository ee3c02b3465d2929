#include "common/flags.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace lk {
namespace {

std::string EnvName(const std::string& name) {
  std::string out = "LK_";
  for (char c : name) out += c == '-' ? '_' : static_cast<char>(std::toupper(c));
  return out;
}

template <typename T>
bool ParseInt(const std::string& text, T* out) {
  if (text.empty()) return false;
  errno = 0;
  char* end = nullptr;
  if constexpr (std::is_signed_v<T>) {
    long long v = std::strtoll(text.c_str(), &end, 10);
    if (errno != 0 || *end != '\0') return false;
    *out = static_cast<T>(v);
  } else {
    if (text[0] == '-') return false;
    unsigned long long v = std::strtoull(text.c_str(), &end, 10);
    if (errno != 0 || *end != '\0' || v > std::numeric_limits<T>::max()) return false;
    *out = static_cast<T>(v);
  }
  return true;
}

}  // namespace

Flags::Flags(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

void Flags::AddFlag(std::string name, Target target, std::string help, std::string env) {
  Flag f;
  f.env = env.empty() ? EnvName(name) : std::move(env);
  f.name = std::move(name);
  f.help = std::move(help);
  f.target = target;
  f.default_text = ValueText(target);
  flags_.push_back(std::move(f));
}

void Flags::Add(std::string name, std::string* v, std::string help, std::string env) {
  AddFlag(std::move(name), v, std::move(help), std::move(env));
}
void Flags::Add(std::string name, int64_t* v, std::string help, std::string env) {
  AddFlag(std::move(name), v, std::move(help), std::move(env));
}
void Flags::Add(std::string name, uint32_t* v, std::string help, std::string env) {
  AddFlag(std::move(name), v, std::move(help), std::move(env));
}
void Flags::Add(std::string name, double* v, std::string help, std::string env) {
  AddFlag(std::move(name), v, std::move(help), std::move(env));
}
void Flags::Add(std::string name, bool* v, std::string help, std::string env) {
  AddFlag(std::move(name), v, std::move(help), std::move(env));
}

void Flags::MarkSecret(const std::string& name) {
  if (Flag* f = Find(name)) f->secret = true;
}

Flags::Flag* Flags::Find(std::string_view name) {
  for (auto& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

bool Flags::IsSet(const std::string& name) const {
  for (const auto& f : flags_) {
    if (f.name == name) return f.set;
  }
  return false;
}

std::string Flags::ValueText(const Target& target) {
  return std::visit(
      [](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) return *p;
        else if constexpr (std::is_same_v<T, bool>) return *p ? "true" : "false";
        else return fmt::format("{}", *p);
      },
      target);
}

Status Flags::Assign(Flag& flag, const std::string& text, const std::string& origin) {
  bool ok = std::visit(
      [&](auto* p) -> bool {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) {
          *p = text;
          return true;
        } else if constexpr (std::is_same_v<T, bool>) {
          if (text == "1" || text == "true" || text == "yes") *p = true;
          else if (text == "0" || text == "false" || text == "no") *p = false;
          else return false;
          return true;
        } else if constexpr (std::is_same_v<T, double>) {
          char* end = nullptr;
          double v = std::strtod(text.c_str(), &end);
          if (text.empty() || *end != '\0') return false;
          *p = v;
          return true;
        } else {
          return ParseInt(text, p);
        }
      },
      flag.target);
  if (!ok) {
    return InvalidArgument("{} {}: cannot parse value '{}'", origin, flag.name, text);
  }
  flag.set = true;
  return Status::Ok();
}

Status Flags::Parse(int argc, const char* const* argv, int first) {
  // Environment first, so that flags given on the command line win.
  for (auto& f : flags_) {
    if (const char* v = std::getenv(f.env.c_str()); v != nullptr) {
      LK_RETURN_IF_ERROR(Assign(f, v, "environment variable " + f.env + " for"));
    }
  }
  bool rest_positional = false;
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (rest_positional || arg.size() < 2 || arg.rfind("--", 0) != 0) {
      if (!rest_positional && arg == "-h") {
        help_requested_ = true;
        continue;
      }
      positional_.push_back(arg);
      continue;
    }
    if (arg == "--") {
      rest_positional = true;
      continue;
    }
    if (arg == "--help") {
      help_requested_ = true;
      continue;
    }
    std::string name = arg.substr(2);
    std::string value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    Flag* f = Find(name);
    if (f == nullptr) return InvalidArgument("unknown flag --{} (see --help)", name);
    if (!has_value) {
      if (std::holds_alternative<bool*>(f->target)) {
        value = "true";
      } else {
        if (i + 1 >= argc) return InvalidArgument("flag --{} needs a value", name);
        value = argv[++i];
      }
    }
    LK_RETURN_IF_ERROR(Assign(*f, value, "flag"));
  }
  return Status::Ok();
}

std::optional<int> Flags::ParseCommandLine(int argc, const char* const* argv,
                                           const std::function<Status()>& resolve, int first,
                                           std::string_view usage) {
  Status st = Parse(argc, argv, first);
  if (help_requested_) {
    std::fputs(Help().c_str(), stdout);
    return 0;
  }
  if (st.ok() && resolve) st = resolve();
  if (st.ok()) return std::nullopt;
  std::fprintf(stderr, "%s: %s\n", program_.c_str(), st.message().c_str());
  if (!usage.empty()) std::fprintf(stderr, "\n%.*s", static_cast<int>(usage.size()), usage.data());
  return 2;
}

std::string Flags::Help() const {
  std::ostringstream out;
  out << "usage: " << program_ << " [flags]\n\n" << summary_ << "\n\nflags (each also read from "
      << "its environment variable; a flag given on the command line wins):\n";
  for (const auto& f : flags_) {
    std::string def = f.secret ? "" : f.default_text;
    out << fmt::format("  --{:<24} {:<28} {}", f.name, "$" + f.env, f.help);
    if (!def.empty()) out << " (default: " << def << ")";
    out << "\n";
  }
  out << "  --help                    print this text\n";
  return out.str();
}

std::string Flags::Effective() const {
  std::string out;
  for (const auto& f : flags_) {
    std::string name = f.name;
    std::replace(name.begin(), name.end(), '-', '_');
    std::string value = ValueText(f.target);
    if (f.secret && !value.empty()) value = "<set>";
    if (!out.empty()) out += ' ';
    out += name + "=" + (value.empty() ? "\"\"" : value);
  }
  return out;
}

Result<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Error(Code::kNotFound, "token file {}: {}", path, std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string token = ss.str();
  auto not_space = [](unsigned char c) { return !std::isspace(c); };
  token.erase(token.begin(), std::find_if(token.begin(), token.end(), not_space));
  token.erase(std::find_if(token.rbegin(), token.rend(), not_space).base(), token.end());
  if (token.empty()) return InvalidArgument("token file {} is empty", path);
  return token;
}

}  // namespace lk
