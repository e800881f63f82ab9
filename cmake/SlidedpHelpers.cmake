# Helpers shared by every module: one small library per module, tests beside the code.

set(SLIDEDP_WARNINGS -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)
# Clang checks the abseil lock annotations (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED, ...)
# at compile time; a finding is an error even without SLIDEDP_WERROR (scripts/lint.sh build).
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  list(APPEND SLIDEDP_WARNINGS -Wthread-safety -Werror=thread-safety)
endif()
if(SLIDEDP_WERROR)
  list(APPEND SLIDEDP_WARNINGS -Werror)
endif()
# Warning flags only GCC knows are spelled $<$<CXX_COMPILER_ID:GNU>:-W...> where they are used,
# since clang rejects unknown warning options under -Werror.
if(SLIDEDP_ASAN)
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
endif()
if(SLIDEDP_TSAN)
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
endif()
# libFuzzer build (clang only, scripts/fuzz.sh): every library is instrumented for coverage and
# built with ASan + UBSan (UBSan findings abort, so the fuzzer reports them as crashes); only the
# tests/fuzz/ targets link libFuzzer's main (-fsanitize=fuzzer).
if(SLIDEDP_FUZZ)
  add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined
                      -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
endif()

# slidedp_library(NAME SRCS a.cc b.cc DEPS x y [PUBLIC_INCLUDE dir])
function(slidedp_library name)
  cmake_parse_arguments(ARG "" "" "SRCS;DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SRCS})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
  target_compile_options(${name} PRIVATE ${SLIDEDP_WARNINGS})
  target_link_libraries(${name} PUBLIC ${ARG_DEPS})
endfunction()

# slidedp_test(NAME SRCS a_test.cc DEPS x y LABELS unit [TIMEOUT s])
function(slidedp_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SRCS})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
  target_compile_options(${name} PRIVATE ${SLIDEDP_WARNINGS})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  if(NOT ARG_LABELS)
    set(ARG_LABELS unit)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT})
endfunction()

# slidedp_gpu_test(NAME SRCS a_test.cc DEPS x y [LABELS extra] [TIMEOUT s]): a GoogleTest binary
# labelled `gpu` whose main (common/gpu_test_main.cc) exits 77 when no CUDA device is usable;
# CTest reports that as skipped, so gpu tests skip cleanly on machines without a GPU.
function(slidedp_gpu_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SRCS} ${PROJECT_SOURCE_DIR}/common/gpu_test_main.cc)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${SLIDEDP_WARNINGS}>)
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} CUDA::cudart GTest::gtest GTest::gmock)
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES LABELS "gpu;${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT}
                       SKIP_RETURN_CODE 77)
endfunction()
