# hostd: model manifests (manifest.{h,cc}) and daemon configuration (config.{h,cc}).
# Included from hostd/CMakeLists.txt; paths are relative to this fragment.

set(_mc_dir ${CMAKE_CURRENT_LIST_DIR})

# xxhash (libxxhash-dev) ships no CMake package: prefer pkg-config, fall back to find_library.
if(NOT TARGET slidedp_xxhash)
  find_package(PkgConfig QUIET)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(XXHASH QUIET IMPORTED_TARGET libxxhash)
  endif()
  add_library(slidedp_xxhash INTERFACE)
  if(TARGET PkgConfig::XXHASH)
    target_link_libraries(slidedp_xxhash INTERFACE PkgConfig::XXHASH)
  else()
    find_library(XXHASH_LIB xxhash)
    find_path(XXHASH_INCLUDE_DIR xxhash.h)
    if(NOT XXHASH_LIB OR NOT XXHASH_INCLUDE_DIR)
      message(FATAL_ERROR "xxhash not found (install libxxhash-dev)")
    endif()
    target_include_directories(slidedp_xxhash INTERFACE ${XXHASH_INCLUDE_DIR})
    target_link_libraries(slidedp_xxhash INTERFACE ${XXHASH_LIB})
  endif()
endif()

# CLI11 is header-only; Debian ships a CMake package, older installs only the headers.
if(TARGET CLI11::CLI11)
  set(_mc_cli11 CLI11::CLI11)
else()
  find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp PATHS /usr/include)
  if(NOT CLI11_INCLUDE_DIR)
    message(FATAL_ERROR "CLI11 not found (install libcli11-dev)")
  endif()
  add_library(slidedp_cli11 INTERFACE)
  target_include_directories(slidedp_cli11 INTERFACE ${CLI11_INCLUDE_DIR})
  set(_mc_cli11 slidedp_cli11)
endif()

slidedp_library(slidedp_manifest
  SRCS ${_mc_dir}/manifest.cc ${_mc_dir}/lr_schedule.cc ${_mc_dir}/job_spec.cc
  DEPS slidedp_proto slidedp_common nlohmann_json::nlohmann_json slidedp_xxhash absl::status
       absl::statusor absl::strings absl::str_format)

slidedp_library(slidedp_config
  SRCS ${_mc_dir}/config.cc
  DEPS slidedp_proto slidedp_manifest tomlplusplus::tomlplusplus ${_mc_cli11} absl::status
       absl::statusor absl::strings absl::str_format)

slidedp_test(manifest_test SRCS ${_mc_dir}/manifest_test.cc DEPS slidedp_manifest LABELS unit)
slidedp_test(config_test SRCS ${_mc_dir}/config_test.cc DEPS slidedp_config LABELS unit)
slidedp_test(job_spec_test SRCS ${_mc_dir}/job_spec_test.cc DEPS slidedp_config LABELS unit)
