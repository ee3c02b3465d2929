// A CommandRunner for tests: answers each command with a fixed result and records what ran.
// Thread-safety: none; one test thread.
#pragma once

#include <deque>
#include <vector>

#include "slurm/command.h"

namespace lk::slurm {

class FakeRunner : public CommandRunner {
 public:
  // Queues the answer to the next Run().
  void Answer(Result<CommandResult> result) { answers_.push_back(std::move(result)); }
  void Answer(int exit_code, std::string out, std::string err = "") {
    Answer(CommandResult{exit_code, std::move(out), std::move(err)});
  }

  Result<CommandResult> Run(const Command& command) override {
    ran_.push_back(command);
    if (answers_.empty()) return Error(Code::kInternal, "FakeRunner: no answer queued");
    Result<CommandResult> r = std::move(answers_.front());
    answers_.pop_front();
    return r;
  }

  const std::vector<Command>& ran() const { return ran_; }

 private:
  std::deque<Result<CommandResult>> answers_;
  std::vector<Command> ran_;
};

}  // namespace lk::slurm
