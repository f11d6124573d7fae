# `cmake --install`: the binaries, the systemd units (their paths filled in
# for this prefix) and example flag files. The units run as user kvtier; see
# deploy/README.md for the steps around them.
include(GNUInstallDirs)
install(TARGETS kvtier-store kvtier-worker kvtier-controller kvtier-engine kvtier
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
set(KVTIER_BINDIR ${CMAKE_INSTALL_FULL_BINDIR})
set(KVTIER_CONFDIR ${CMAKE_INSTALL_FULL_SYSCONFDIR}/kvtier)
foreach(unit kvtier-store kvtier-worker kvtier-controller)
  configure_file(${PROJECT_SOURCE_DIR}/deploy/systemd/${unit}.service.in
    ${PROJECT_BINARY_DIR}/deploy/${unit}.service @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/deploy/${unit}.service
    DESTINATION ${CMAKE_INSTALL_PREFIX}/lib/systemd/system)
  install(FILES ${PROJECT_SOURCE_DIR}/deploy/${unit}.conf
    DESTINATION ${CMAKE_INSTALL_FULL_SYSCONFDIR}/kvtier)
endforeach()
install(FILES ${PROJECT_SOURCE_DIR}/deploy/tenants.example
  DESTINATION ${CMAKE_INSTALL_FULL_SYSCONFDIR}/kvtier)
# The Python package (docs/python.md), stubs included, where Debian's python3
# looks: /usr/lib/python3/dist-packages for the /usr prefix, else
# <prefix>/lib/python3.X/dist-packages.
execute_process(COMMAND /usr/bin/python3 -c
  "import sys; print(f'python{sys.version_info[0]}.{sys.version_info[1]}')"
  OUTPUT_VARIABLE _kvt_pyver OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(CMAKE_INSTALL_PREFIX STREQUAL "/usr" OR _kvt_pyver STREQUAL "")
  set(KVTIER_PYTHON_DIR lib/python3/dist-packages)
else()
  set(KVTIER_PYTHON_DIR lib/${_kvt_pyver}/dist-packages)
endif()
install(DIRECTORY ${PROJECT_BINARY_DIR}/python/kvtier DESTINATION ${KVTIER_PYTHON_DIR}
  FILES_MATCHING PATTERN "*.py")
if(TARGET kvtier_inproc_module)
  install(TARGETS kvtier_inproc_module LIBRARY DESTINATION ${KVTIER_PYTHON_DIR}/kvtier)
endif()

# The C++ client SDK: libkvtier_client.so, the headers its API needs, and a
# CMake package (find_package(kvtier) gives kvtier::client).
install(TARGETS kvtier_client_sdk LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(FILES ${PROJECT_SOURCE_DIR}/client/store_client.h
  ${PROJECT_SOURCE_DIR}/client/controller_client.h ${PROJECT_SOURCE_DIR}/client/session_router.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvtier/client)
install(FILES ${PROJECT_SOURCE_DIR}/base/call_options.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvtier/base)
foreach(_p tensor store worker controller)
  install(FILES ${PROJECT_BINARY_DIR}/proto/kvtier/v1/${_p}.pb.h
    ${PROJECT_BINARY_DIR}/proto/kvtier/v1/${_p}.grpc.pb.h
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvtier/kvtier/v1)
endforeach()
file(RELATIVE_PATH KVTIER_CONFIG_TO_PREFIX "${CMAKE_INSTALL_FULL_LIBDIR}/cmake/kvtier"
  "${CMAKE_INSTALL_PREFIX}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/kvtierConfig.cmake.in
  ${PROJECT_BINARY_DIR}/kvtierConfig.cmake @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/kvtierConfig.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvtier)
