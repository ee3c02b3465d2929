# Install rules: a relocatable tree (every path inside it is relative to the tree).
#   DIR/bin/{lighthouse,replica_agent,lk_gateway,lkctl,diloco_trainer}
#   DIR/lib/liblightkeeper.so*             the C API, the Session and the DiLoCo library
#   DIR/include/lightkeeper/*.h             its public headers: #include <lightkeeper/session.h>
#   DIR/lib/cmake/Lightkeeper/             find_package(Lightkeeper) -> Lightkeeper::client
#   DIR/lib/pkgconfig/lightkeeper.pc       pkg-config --cflags --libs lightkeeper
#   DIR/lib/python3/dist-packages/lightkeeper/   the Python package, when it is built
include(CMakePackageConfigHelpers)

# The headers a program that links liblightkeeper includes: include/lightkeeper/ as it is. None
# of them pulls in Asio, Beast, protobuf, OpenSSL or Gloo (tests/install_test.sh checks it on the
# installed tree).
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/lightkeeper DESTINATION include
  FILES_MATCHING PATTERN "*.h")

foreach(bin lighthouse replica_agent lk_gateway lkctl diloco_trainer)
  if(TARGET ${bin})
    install(TARGETS ${bin} RUNTIME DESTINATION bin)
  endif()
endforeach()

install(TARGETS lightkeeper EXPORT LightkeeperTargets
  LIBRARY DESTINATION lib
  INCLUDES DESTINATION include)
install(EXPORT LightkeeperTargets NAMESPACE Lightkeeper:: DESTINATION lib/cmake/Lightkeeper)
file(WRITE ${PROJECT_BINARY_DIR}/LightkeeperConfig.cmake.in [=[
@PACKAGE_INIT@
# Lightkeeper's trainer library: the target Lightkeeper::client (liblightkeeper.so and its
# headers; C++ users also get fmt, which <lightkeeper/status.h> uses).
include(CMakeFindDependencyMacro)
find_dependency(fmt)
include("${CMAKE_CURRENT_LIST_DIR}/LightkeeperTargets.cmake")
# Where liblightkeeper.so lies (an RPATH for what links it), and whether it has the NCCL
# communicator (python/site/ builds the Python module with this).
get_filename_component(Lightkeeper_LIBDIR "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
set(Lightkeeper_NCCL @LK_NCCL_FOUND@)
check_required_components(Lightkeeper)
]=])
configure_package_config_file(${PROJECT_BINARY_DIR}/LightkeeperConfig.cmake.in
  ${PROJECT_BINARY_DIR}/LightkeeperConfig.cmake INSTALL_DESTINATION lib/cmake/Lightkeeper)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/LightkeeperConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/LightkeeperConfig.cmake
  ${PROJECT_BINARY_DIR}/LightkeeperConfigVersion.cmake DESTINATION lib/cmake/Lightkeeper)

# The prefix is computed from where the .pc file lies, so the tree may move.
file(WRITE ${PROJECT_BINARY_DIR}/lightkeeper.pc "\
prefix=\${pcfiledir}/../..
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: lightkeeper
Description: Lightkeeper trainer library (C API, Session, DiLoCo outer step)
Version: ${PROJECT_VERSION}
Requires: fmt
Libs: -L\${libdir} -llightkeeper
Cflags: -I\${includedir}
")
install(FILES ${PROJECT_BINARY_DIR}/lightkeeper.pc DESTINATION lib/pkgconfig)

# What a site needs to build the Python module for its own Python (python/site/CMakeLists.txt):
# the module's source and the package's Python files, beside the standalone project.
install(FILES ${PROJECT_SOURCE_DIR}/python/site/CMakeLists.txt
  DESTINATION share/lightkeeper/python-site)
install(FILES ${PROJECT_SOURCE_DIR}/python/src/module.cc DESTINATION share/lightkeeper/python-site/src)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/python/lightkeeper/ DESTINATION share/lightkeeper/python-site/lightkeeper
  FILES_MATCHING PATTERN "*.py" PATTERN "*.pyi" PATTERN "py.typed")

# The Python package (python/, built into build/python/lightkeeper): the compiled module finds
# liblightkeeper (if it links it) three levels up, in DIR/lib.
if(TARGET lightkeeper_python)
  set_target_properties(lightkeeper_python PROPERTIES INSTALL_RPATH "$ORIGIN/../../..")
  install(TARGETS lightkeeper_python LIBRARY DESTINATION lib/python3/dist-packages/lightkeeper)
  install(DIRECTORY ${PROJECT_BINARY_DIR}/python/lightkeeper/
    DESTINATION lib/python3/dist-packages/lightkeeper
    FILES_MATCHING PATTERN "*.py" PATTERN "*.pyi" PATTERN "py.typed")
endif()
