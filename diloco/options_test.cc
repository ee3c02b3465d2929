// DilocoOptions::Validate on the parameter dtype: the three the library takes pass, any other
// value is refused by name before a Diloco exists (nothing is sent). The refusal of a buffer of
// another dtype than the options' is pinned through the C API, which calls the same C++ methods
// (tests/c_diloco.c, "a DiLoCo trainer in C ..." in agent_integration_test).
#include <doctest/doctest.h>
#include <lightkeeper/diloco.h>

#include <string>

namespace lk::diloco {

namespace {
DilocoOptions Valid() {
  DilocoOptions o;
  o.params = {TensorSpec{"w", 0, {4}}};
  return o;
}
}  // namespace

TEST_CASE("diloco options take float32, bf16 and fp16 parameters and refuse any other dtype") {
  for (ParamDType d : {ParamDType::kFloat32, ParamDType::kBfloat16, ParamDType::kFloat16}) {
    DilocoOptions o = Valid();
    o.param_dtype = d;
    CAPTURE(ParamDTypeName(d));
    CHECK(o.Validate().ok());
  }
  DilocoOptions o = Valid();
  o.param_dtype = static_cast<ParamDType>(7);
  Status st = o.Validate();
  CHECK(st.code() == Code::kInvalidArgument);
  CHECK(st.message().find("unknown param_dtype 7") != std::string::npos);
  ParamDType parsed = ParamDType::kFloat32;
  CHECK(ParseParamDType("bfloat16", &parsed));
  CHECK(parsed == ParamDType::kBfloat16);
  CHECK(ParseParamDType("half", &parsed));
  CHECK(parsed == ParamDType::kFloat16);
  CHECK_FALSE(ParseParamDType("float64", &parsed));
  CHECK(parsed == ParamDType::kFloat16);  // untouched by a refusal
}

TEST_CASE(
    "diloco options: explicit shard rows need sharded, fit their tensors, come with the inner "
    "state's, and cover everything in a group of one") {
  auto refused = [](const DilocoOptions& o, const std::string& part) {
    const Status st = o.Validate();
    CHECK(st.code() == Code::kInvalidArgument);
    CHECK_MESSAGE(st.message().find(part) != std::string::npos, st.message());
  };
  DilocoOptions o = Valid();
  o.group_size = 2;
  o.group_rank = 1;
  o.shard_rows = {{3, 4}};
  refused(o, "shard_rows needs sharded");
  o.sharded = true;
  CHECK(o.Validate().ok());  // the group checks its tiling at its first join
  o.shard_rows = {{3, 5}};
  refused(o, "tensor 'w': rows [3, 5) are not rows of its 4");
  o.shard_rows = {{3, 4}, {0, 1}};
  refused(o, "2 row ranges for 1 tensors");
  o.shard_rows = {{3, 4}};
  o.inner_state = {TensorSpec{"m/w", 0, {4}}};
  refused(o, "shard_rows needs inner_shard_rows too");
  o.inner_shard_rows = {{3, 4}};
  CHECK(o.Validate().ok());
  o.shard_rows.clear();
  refused(o, "inner_shard_rows needs shard_rows");
  DilocoOptions one = Valid();
  one.sharded = true;
  one.shard_rows = {{1, 4}};
  refused(one, "a group of one: tensor 'w': rows [0, 1) are held by no trainer");
  one.shard_rows = {{0, 4}};
  CHECK(one.Validate().ok());
}

}  // namespace lk::diloco
