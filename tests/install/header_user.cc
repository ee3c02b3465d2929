// Uses the installed C++ headers: the options of the DiLoCo library and its spec check, which
// live in liblightkeeper.so. Prints "specs ok total=N".
#include <cstdio>

#include <lightkeeper/diloco.h>
#include <lightkeeper/session.h>

int main() {
  std::vector<lk::diloco::TensorSpec> specs = {{"w", 0, {4, 3}}, {"b", 12, {5}}};
  size_t total = 0;
  lk::Status st = lk::diloco::ValidateSpecs(specs, &total);
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return 1;
  }
  lk::diloco::DilocoOptions o;
  o.params = specs;
  if (!o.Validate().ok()) return 1;
  std::printf("specs ok total=%zu\n", total);
  return 0;
}
