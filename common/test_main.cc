// The doctest main shared by every test binary. It exports LK_BIN_DIR and LK_SOURCE_DIR (unless
// already set) so that tests, and the processes they start, find the built binaries and the
// sources wherever the build tree is. When every test passed it removes the scratch entries the
// tests left under the temp directory (lk-test-...-PID-... and lk-comm-...-PID-...), so that repeated runs do not fill
// the disk; after a failure they stay for their logs, and LK_KEEP_TEST_DIRS=1 keeps them always.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace {

void RemoveScratch() {
  const char* keep = std::getenv("LK_KEEP_TEST_DIRS");
  if (keep != nullptr && std::string(keep) == "1") return;
  std::string mark = "-" + std::to_string(::getpid()) + "-";
  std::error_code ec;
  auto tmp = std::filesystem::temp_directory_path(ec);
  if (ec) return;
  for (const auto& e : std::filesystem::directory_iterator(tmp, ec)) {
    std::string name = e.path().filename().string();
    bool ours = name.rfind("lk-test-", 0) == 0 || name.rfind("lk-comm-", 0) == 0;
    if (ours && (name + "-").find(mark) != std::string::npos) {
      std::filesystem::remove_all(e.path(), ec);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  setenv("LK_BIN_DIR", LK_BIN_DIR_DEFAULT, 0);
  setenv("LK_SOURCE_DIR", LK_SOURCE_DIR_DEFAULT, 0);
  doctest::Context context(argc, argv);
  int rc = context.run();
  if (rc == 0 && !context.shouldExit()) RemoveScratch();
  return rc;
}
