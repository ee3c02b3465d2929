#include <doctest/doctest.h>
#include <lightkeeper/clock.h>
#include <lightkeeper/status.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>

#include "common/flags.h"
#include "common/float_env.h"
#include "common/log.h"

namespace lk {
namespace {

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgument("{} is odd", x);
  return x / 2;
}

Status Quarter(int x, int* out) {
  LK_ASSIGN_OR_RETURN(int h, Half(x));
  LK_ASSIGN_OR_RETURN(int q, Half(h));
  *out = q;
  return Status::Ok();
}

TEST_CASE("Result carries a value or an error with context") {
  int q = 0;
  CHECK(Quarter(8, &q).ok());
  CHECK(q == 2);
  Status st = Quarter(6, &q);
  CHECK(st.code() == Code::kInvalidArgument);
  CHECK(st.message() == "3 is odd");
  CHECK(st.WithContext("quarter").ToString() == "invalid_argument: quarter: 3 is odd");
}

TEST_CASE("LineLimiter lets one line through per window and counts the ones it dropped") {
  using namespace std::chrono_literals;
  LineLimiter limiter(10s);
  const auto t0 = LineLimiter::Clock::time_point{} + 1000s;
  uint64_t dropped = 99;
  CHECK(limiter.Allow(t0, &dropped));
  CHECK(dropped == 0);
  for (int i = 0; i < 5; ++i) CHECK_FALSE(limiter.Allow(t0 + 9s, &dropped));
  CHECK(limiter.Allow(t0 + 10s, &dropped));
  CHECK(dropped == 5);
  CHECK_FALSE(limiter.Allow(t0 + 11s, &dropped));
  CHECK(limiter.Allow(t0 + 30s, &dropped));
  CHECK(dropped == 1);
}

TEST_CASE("ManualClock moves only when told") {
  ManualClock clock;
  auto t0 = clock.Now();
  CHECK(clock.Now() == t0);
  clock.Advance(Millis(250));
  CHECK(ToMillis(clock.Now() - t0) == 250);
}

TEST_CASE("Q quotes values that would break key=value parsing") {
  CHECK(Q("plain") == "plain");
  CHECK(Q("two words") == "\"two words\"");
  CHECK(Q("a\"b") == "\"a\\\"b\"");
  CHECK(Q("") == "\"\"");
}

TEST_CASE("Q escapes control bytes from peers, so one event stays one printable line") {
  // A request path is percent-decoded before it is logged: %00, %0d and %1b arrive as bytes.
  using namespace std::string_literals;
  CHECK(Q("a\nb") == "\"a\\nb\"");
  CHECK(Q("a\rb") == "\"a\\rb\"");
  CHECK(Q("a\tb") == "\"a\\tb\"");
  CHECK(Q("/v1/x\0"s) == "\"/v1/x\\x00\"");
  CHECK(Q("\x1b[2J") == "\"\\x1b[2J\"");
  CHECK(Q("del\x7f") == "\"del\\x7f\"");
  for (char c = 0; c >= 0 && c < 0x20; ++c) {
    std::string q = Q(std::string("x") + c);
    CAPTURE(static_cast<int>(c));
    CHECK(std::none_of(q.begin(), q.end(), [](char b) { return b >= 0 && b < 0x20; }));
  }
  // Bytes above 0x7f (UTF-8) are left as they are.
  CHECK(Q("caf\xc3\xa9") == "caf\xc3\xa9");
}

TEST_CASE("OneLine: one line of valid UTF-8 within the bound, never a split character") {
  CHECK(OneLine("scontrol: refused\nfor job 7\r\n", 100) == "scontrol: refused for job 7  ");
  CHECK(OneLine("abc", 2) == "ab");
  CHECK(OneLine("a\xc3\xa9z", 2) == "a");  // the two bytes of e-acute do not fit after 'a'
  CHECK(OneLine("a\xc3\xa9z", 3) == "a\xc3\xa9");
  CHECK(OneLine("\xff\xfe", 10) == "??");
  CHECK(OneLine(std::string(1000, 'x'), 256).size() == 256);
  CHECK(OneLine("", 5).empty());
}

TEST_CASE("Q escapes bytes outside valid UTF-8 - a logged protobuf body stays readable text") {
  // The lighthouse logs a refused request's reply body; for an agent that is protobuf.
  CHECK(Q("\x12\x8e\x01" "commit") == "\"\\x12\\x8e\\x01commit\"");
  CHECK(Q("a\xff") == "\"a\\xff\"");
  CHECK(Q("\xc3(") == "\"\\xc3(\"");            // a lead byte without its continuation
  CHECK(Q("\xed\xa0\x80") == "\"\\xed\\xa0\\x80\"");  // a surrogate
  CHECK(Q("\xe2\x82\xac \xf0\x9f\x98\x80") == "\"\xe2\x82\xac \xf0\x9f\x98\x80\"");
  CHECK(Utf8SequenceBytes("") == 0);
  CHECK(Utf8SequenceBytes("\xc3\xa9x") == 2);
  CHECK(Utf8SequenceBytes("\xc0\x80") == 0);  // overlong
}

TEST_CASE("Flags: command line beats environment beats default - errors name the flag") {
  std::string bind = "0.0.0.0:29510";
  uint32_t min_replicas = 1;
  bool verbose = false;
  Flags flags("prog", "test");
  flags.Add("bind", &bind, "address");
  flags.Add("min-replicas", &min_replicas, "minimum");
  flags.Add("verbose", &verbose, "more output");
  setenv("LK_MIN_REPLICAS", "3", 1);
  setenv("LK_BIND", "1.2.3.4:5", 1);
  const char* argv[] = {"prog", "--bind", "127.0.0.1:0", "--verbose", "pos", "--", "--x"};
  REQUIRE(flags.Parse(7, argv).ok());
  CHECK(bind == "127.0.0.1:0");
  CHECK(min_replicas == 3);
  CHECK(verbose);
  CHECK(flags.positional() == std::vector<std::string>{"pos", "--x"});
  CHECK(flags.Effective().find("min_replicas=3") != std::string::npos);
  CHECK(flags.Help().find("$LK_MIN_REPLICAS") != std::string::npos);
  unsetenv("LK_MIN_REPLICAS");
  unsetenv("LK_BIND");

  Flags bad("prog", "test");
  uint32_t n = 7;
  bad.Add("n", &n, "a number");
  const char* argv2[] = {"prog", "--n", "-4"};
  Status st = bad.Parse(3, argv2);
  CHECK(st.code() == Code::kInvalidArgument);
  CHECK(st.message().find("--n") == std::string::npos);
  CHECK(st.message().find("n: cannot parse value '-4'") != std::string::npos);
  CHECK(n == 7);
  const char* argv3[] = {"prog", "--nope"};
  CHECK(bad.Parse(2, argv3).message().find("unknown flag --nope") != std::string::npos);
}

TEST_CASE(
    "Flags::ParseCommandLine: 0 for --help, 2 for a bad flag or a refused check, else go on") {
  uint32_t n = 1;
  int resolved = 0;
  auto make = [&] {
    auto f = std::make_unique<Flags>("prog", "test");
    f->Add("n", &n, "a number");
    return f;
  };
  auto check = [&] {
    ++resolved;
    return n > 5 ? InvalidArgument("--n {} is over 5", n) : Status::Ok();
  };
  const char* help[] = {"prog", "--help"};
  CHECK(make()->ParseCommandLine(2, help, check) == std::optional<int>(0));
  CHECK(resolved == 0);  // --help runs no check
  const char* bad[] = {"prog", "--n", "x"};
  CHECK(make()->ParseCommandLine(3, bad, check) == std::optional<int>(2));
  CHECK(resolved == 0);  // nor does a flag that did not parse
  const char* over[] = {"prog", "--n", "9"};
  CHECK(make()->ParseCommandLine(3, over, check) == std::optional<int>(2));
  CHECK(resolved == 1);
  const char* ok[] = {"prog", "--n", "4"};
  CHECK(make()->ParseCommandLine(3, ok, check) == std::nullopt);
  CHECK(n == 4);
  CHECK(make()->ParseCommandLine(3, ok) == std::nullopt);  // no check of its own
}

TEST_CASE("ReadTokenFile trims whitespace and rejects empty or missing files") {
  std::string path = "/tmp/lk_token_test_" + std::to_string(getpid());
  std::ofstream(path) << "  s3cret \n";
  auto t = ReadTokenFile(path);
  REQUIRE(t.ok());
  CHECK(*t == "s3cret");
  std::ofstream(path) << "\n";
  CHECK(ReadTokenFile(path).status().code() == Code::kInvalidArgument);
  std::remove(path.c_str());
  CHECK(ReadTokenFile(path).status().code() == Code::kNotFound);
}

TEST_CASE("FixedFloatEnv flushes denormals inside and gives the caller its mode back" *
          doctest::skip(!FixedFloatEnv::Active())) {
  const uint64_t before = FloatControlWord();
  volatile float tiny = 1.0e-38f;  // normal; half of it is not
  for (uint64_t caller : {WithFlushDenormals(before, false), WithRoundTowardZero(before)}) {
    SetFloatControlWord(caller);
    volatile float outside = tiny * 0.5f;
    float inside;
    {
      FixedFloatEnv env;
      inside = tiny * 0.5f;
      volatile float third = 1.0f;
      third = third / 3.0f;  // round to nearest: 0x3eaaaaab; toward zero: 0x3eaaaaaa
      CHECK(third == 0x1.555556p-2f);
    }
    CHECK(FloatMode(FloatControlWord()) == FloatMode(caller));
    SetFloatControlWord(before);
    CHECK(outside != 0.0f);
    CHECK(inside == 0.0f);
  }
}

}  // namespace
}  // namespace lk
