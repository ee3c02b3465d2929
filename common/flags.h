// Flags: command-line options where every flag also reads an LK_* environment variable
// (--data-dir <-> LK_DATA_DIR). Precedence: flag, then environment, then the default the caller
// put in the variable. --help prints every flag with its variable, default and meaning.
// Thread-safety: use from one thread during start-up.
#pragma once

#include <lightkeeper/status.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace lk {

class Flags {
 public:
  Flags(std::string program, std::string summary);

  // `name` without dashes, e.g. "data-dir". The environment variable is LK_DATA_DIR unless `env`
  // is given. A flag marked secret is shown as <set> in Effective().
  void Add(std::string name, std::string* value, std::string help, std::string env = "");
  void Add(std::string name, int64_t* value, std::string help, std::string env = "");
  void Add(std::string name, uint32_t* value, std::string help, std::string env = "");
  void Add(std::string name, double* value, std::string help, std::string env = "");
  void Add(std::string name, bool* value, std::string help, std::string env = "");
  void MarkSecret(const std::string& name);

  // Parses argv (from index `first`) and the environment. Unknown flags and values that do not
  // parse are errors naming the flag. Arguments that are not flags, and everything after "--",
  // are kept as positional().
  Status Parse(int argc, const char* const* argv, int first = 1);

  // The command line as a program's main meets it: Parse, then `resolve` (the program's own
  // checks of what the flags set). Returns the exit code the program leaves with when it is not
  // to go on: 0 after printing the help to stdout for --help, 2 after printing
  // "PROGRAM: reason" (and `usage`, when given) to stderr for a flag, a value or a check that
  // failed. nullopt: go on. One rule for every binary, so that scripts can tell a refused
  // command line (2) from a failure at run time (1).
  std::optional<int> ParseCommandLine(int argc, const char* const* argv,
                                      const std::function<Status()>& resolve = {}, int first = 1,
                                      std::string_view usage = {});

  bool help_requested() const { return help_requested_; }
  std::string Help() const;
  // "key=value ..." for the start-up log line.
  std::string Effective() const;
  const std::vector<std::string>& positional() const { return positional_; }
  // Whether the flag was given on the command line or in the environment.
  bool IsSet(const std::string& name) const;

 private:
  using Target = std::variant<std::string*, int64_t*, uint32_t*, double*, bool*>;
  struct Flag {
    std::string name;
    std::string env;
    std::string help;
    std::string default_text;
    Target target;
    bool secret = false;
    bool set = false;
  };
  void AddFlag(std::string name, Target target, std::string help, std::string env);
  Flag* Find(std::string_view name);
  static Status Assign(Flag& flag, const std::string& text, const std::string& origin);
  static std::string ValueText(const Target& target);

  std::string program_;
  std::string summary_;
  std::vector<Flag> flags_;
  std::vector<std::string> positional_;
  bool help_requested_ = false;
};

// Reads a secret (token) from a file: whitespace around it is dropped, an empty file is an error.
Result<std::string> ReadTokenFile(const std::string& path);

}  // namespace lk
