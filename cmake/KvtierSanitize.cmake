# KVTIER_SANITIZE=address|undefined|thread instruments every target.
# KVTIER_SANITIZER_FLAGS keeps the flags for the installed SDK's CMake
# package: a program linking an instrumented libkvtier_client.so needs the
# sanitizer's runtime first (cmake/kvtierConfig.cmake.in).
set(KVTIER_SANITIZER_FLAGS "")
if(KVTIER_SANITIZE STREQUAL "")
  return()
endif()
if(KVTIER_SANITIZE STREQUAL "address")
  # float-cast-overflow is in clang's "undefined" group but not GCC's: an
  # out-of-range or NaN float converted to an integer is undefined behaviour.
  set(_kvt_san "-fsanitize=address,undefined,float-cast-overflow")
elseif(KVTIER_SANITIZE STREQUAL "undefined")
  set(_kvt_san "-fsanitize=undefined,float-cast-overflow")
elseif(KVTIER_SANITIZE STREQUAL "thread")
  set(_kvt_san "-fsanitize=thread")
else()
  message(FATAL_ERROR "KVTIER_SANITIZE must be address, undefined or thread, got '${KVTIER_SANITIZE}'")
endif()
message(STATUS "kvtier: sanitizer ${_kvt_san}")
set(KVTIER_SANITIZER_FLAGS "${_kvt_san}")
add_compile_options(${_kvt_san} -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
add_link_options(${_kvt_san})
add_compile_definitions(KVTIER_SANITIZED=1)
