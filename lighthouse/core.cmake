# The pure lighthouse core: decisions and the state machine. It links lk_base only (no Asio,
# RocksDB or protobuf), so the build enforces the core/shell split.
add_library(lk_lighthouse_core STATIC
  ${CMAKE_CURRENT_LIST_DIR}/quorum.cc
  ${CMAKE_CURRENT_LIST_DIR}/divergence.cc
  ${CMAKE_CURRENT_LIST_DIR}/lighthouse_core.cc
  ${CMAKE_CURRENT_LIST_DIR}/lighthouse_core_admin.cc
  ${CMAKE_CURRENT_LIST_DIR}/lighthouse_core_issue.cc
  ${CMAKE_CURRENT_LIST_DIR}/lighthouse_core_lives.cc
  ${CMAKE_CURRENT_LIST_DIR}/lighthouse_core_state.cc)
lk_target(lk_lighthouse_core)
target_link_libraries(lk_lighthouse_core PUBLIC lk_base)

# Unit tests (table-driven, manual clock). The seeded simulation, which runs this core beside
# the agents' cores, is tests/sim/.
foreach(test quorum_test divergence_test lighthouse_core_test lighthouse_core_ops_test
             lighthouse_core_trust_test lighthouse_core_late_test
             lighthouse_core_tokens_test lighthouse_core_lives_test)
  lk_test(${test} ${CMAKE_CURRENT_LIST_DIR}/${test}.cc)
  target_link_libraries(${test} PRIVATE lk_lighthouse_core)
endforeach()
