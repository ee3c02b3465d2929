// The trainer's place in its group from torchrun's and Slurm's variables.
#include "common/task_place.h"

#include <doctest/doctest.h>

namespace lk {
namespace {

TEST_CASE("no launcher variables: no place, the flags decide") {
  auto p = TaskPlaceFromEnv({{"PATH", "/bin"}});
  REQUIRE(p.ok());
  CHECK_FALSE(p->has_value());
}

TEST_CASE("a Slurm task takes its rank, group size and node-local rank from Slurm") {
  auto p = TaskPlaceFromEnv({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                             {"SLURM_NODEID", "1"}});
  REQUIRE(p.ok());
  REQUIRE(p->has_value());
  CHECK((*p)->rank == 3);
  CHECK((*p)->size == 8);
  CHECK((*p)->local_rank == 1u);
  CHECK((*p)->source == "slurm");
}

TEST_CASE("torchrun inside a Slurm step: torchrun's per-process rank wins over the step's task") {
  auto p = TaskPlaceFromEnv({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"RANK", "5"},
                             {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}});
  REQUIRE(p.ok());
  REQUIRE(p->has_value());
  CHECK((*p)->rank == 5);
  CHECK((*p)->size == 8);
  CHECK((*p)->local_rank == 1u);
  CHECK((*p)->source == "torchrun");
}

TEST_CASE("a rank that is not a number, half a pair, or a rank past the size is refused by name") {
  struct Row {
    std::map<std::string, std::string> env;
    const char* names;
  };
  for (const Row& r : {Row{{{"RANK", "x"}, {"WORLD_SIZE", "2"}}, "RANK=x"},
                       Row{{{"RANK", "1"}}, "RANK is set without WORLD_SIZE"},
                       Row{{{"SLURM_NTASKS", "4"}}, "SLURM_NTASKS is set without SLURM_PROCID"},
                       Row{{{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}}, "SLURM_PROCID=4"},
                       Row{{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE=0"},
                       Row{{{"SLURM_PROCID", "-1"}, {"SLURM_NTASKS", "2"}}, "SLURM_PROCID=-1"},
                       Row{{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", ""}}, "LOCAL_RANK="}}) {
    auto p = TaskPlaceFromEnv(r.env);
    REQUIRE_FALSE(p.ok());
    CHECK(p.status().code() == Code::kInvalidArgument);
    CHECK_MESSAGE(p.status().ToString().find(r.names) != std::string::npos, p.status().ToString());
  }
}

}  // namespace
}  // namespace lk
