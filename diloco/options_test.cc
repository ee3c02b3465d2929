// DilocoOptions::Validate on the parameter dtype: the three the library takes pass, any other
// value is refused by name before a Diloco exists (nothing is sent). The refusal of a buffer of
// another dtype than the options' is pinned through the C API, which calls the same C++ methods
// (tests/c_diloco.c, "a DiLoCo trainer in C ..." in agent_integration_test).
#include <doctest/doctest.h>
#include <lightkeeper/diloco.h>

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

}  // namespace lk::diloco
