// The doctest main shared by every test binary. It exports LK_BIN_DIR and LK_SOURCE_DIR (unless
// already set) so that tests, and the processes they start, find the built binaries and the
// sources wherever the build tree is.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdlib>

int main(int argc, char** argv) {
  setenv("LK_BIN_DIR", LK_BIN_DIR_DEFAULT, 0);
  setenv("LK_SOURCE_DIR", LK_SOURCE_DIR_DEFAULT, 0);
  doctest::Context context(argc, argv);
  return context.run();
}
