# `cmake --install`: the binaries, the systemd units and example flag files
# (their paths filled in for the prefix of this install), the Python package
# and the C++ client SDK. The units run as user kvtier; see deploy/README.md
# for the steps around them.
include(GNUInstallDirs)
install(TARGETS kvtier-store kvtier-worker kvtier-controller kvtier-engine kvtier
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# The units name the installed binaries and flag files, and the flag files
# the configuration directory: `cmake --install --prefix` may change the
# prefix after configuring, so they are written when installing, for the
# prefix of that install (/etc/kvtier for /usr, PREFIX/etc/kvtier for any
# other). DESTDIR applies as to every other file.
install(CODE "set(_kvt_src \"${PROJECT_SOURCE_DIR}\")\nset(_kvt_out \"${PROJECT_BINARY_DIR}/deploy\")")
install(CODE [[
  if(CMAKE_INSTALL_PREFIX STREQUAL "/usr")
    set(KVTIER_CONFDIR "/etc/kvtier")
  else()
    set(KVTIER_CONFDIR "${CMAKE_INSTALL_PREFIX}/etc/kvtier")
  endif()
  set(KVTIER_BINDIR "${CMAKE_INSTALL_PREFIX}/bin")
  foreach(unit kvtier-store kvtier-worker kvtier-controller)
    configure_file("${_kvt_src}/deploy/systemd/${unit}.service.in" "${_kvt_out}/${unit}.service"
      @ONLY)
    file(INSTALL "${_kvt_out}/${unit}.service" DESTINATION
      "${CMAKE_INSTALL_PREFIX}/lib/systemd/system")
    file(READ "${_kvt_src}/deploy/${unit}.conf" _kvt_conf)
    string(REPLACE "/etc/kvtier/" "${KVTIER_CONFDIR}/" _kvt_conf "${_kvt_conf}")
    file(WRITE "${_kvt_out}/${unit}.conf" "${_kvt_conf}")
    file(INSTALL "${_kvt_out}/${unit}.conf" DESTINATION "${KVTIER_CONFDIR}")
  endforeach()
  file(INSTALL "${_kvt_src}/deploy/tenants.example" DESTINATION "${KVTIER_CONFDIR}")
]])
# The Python package (docs/python.md), stubs included, where Debian's python3
# looks: /usr/lib/python3/dist-packages for the /usr prefix, else
# <prefix>/lib/python3.X/dist-packages; chosen when installing, for the
# prefix of that install, as the units are.
execute_process(COMMAND /usr/bin/python3 -c
  "import sys; print(f'python{sys.version_info[0]}.{sys.version_info[1]}')"
  OUTPUT_VARIABLE _kvt_pyver OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
set(_kvt_module "")
if(TARGET kvtier_inproc_module)
  set(_kvt_module "$<TARGET_FILE:kvtier_inproc_module>")
endif()
install(CODE "set(_kvt_pyver \"${_kvt_pyver}\")\nset(_kvt_pkg \"${PROJECT_BINARY_DIR}/python/kvtier\")\nset(_kvt_module \"${_kvt_module}\")")
install(CODE [[
  if(CMAKE_INSTALL_PREFIX STREQUAL "/usr" OR _kvt_pyver STREQUAL "")
    set(_kvt_pydir "${CMAKE_INSTALL_PREFIX}/lib/python3/dist-packages")
  else()
    set(_kvt_pydir "${CMAKE_INSTALL_PREFIX}/lib/${_kvt_pyver}/dist-packages")
  endif()
  file(INSTALL "${_kvt_pkg}" DESTINATION "${_kvt_pydir}" FILES_MATCHING PATTERN "*.py")
  if(NOT _kvt_module STREQUAL "")
    file(INSTALL "${_kvt_module}" DESTINATION "${_kvt_pydir}/kvtier")
  endif()
]])

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
