# Helpers every module uses to declare its tests, so a module's CMakeLists.txt is the only
# file that changes when the module gains a test.

# embd_unit_test(test_foo LIBS lib... [SOURCES ...] [TIMEOUT s] [JOBS n]), called from a module's
# folder: tests/unit/<module>/test_foo.c, a Criterion test binary running n tests at once
# (default 2), ctest name <module>/test_foo.
function(embd_unit_test name)
  cmake_parse_arguments(arg "" "TIMEOUT;JOBS" "LIBS;SOURCES" ${ARGN})
  if(NOT CRITERION_FOUND)
    message(WARNING "criterion not found: ${name} is not built (run tools/install-deps.sh)")
    return()
  endif()
  get_filename_component(module ${CMAKE_CURRENT_SOURCE_DIR} NAME)
  add_executable(${name} ${PROJECT_SOURCE_DIR}/tests/unit/${module}/${name}.c ${arg_SOURCES})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/include)
  target_link_libraries(${name} PRIVATE ${arg_LIBS} PkgConfig::CRITERION Threads::Threads m)
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 300)
  endif()
  # Criterion forks one process per test; -j2 keeps it inside CI's two cores.
  if(NOT arg_JOBS)
    set(arg_JOBS 2)
  endif()
  add_test(NAME ${module}/${name} COMMAND ${name} -j${arg_JOBS} --ascii)
  set_tests_properties(${module}/${name} PROPERTIES TIMEOUT ${arg_TIMEOUT} LABELS unit)
endfunction()

# embd_fuzz_target(fuzz_foo LIBS lib...): tests/fuzz/fuzz_foo.c defines LLVMFuzzerTestOneInput.
# With EMBD_FUZZ it links libFuzzer; otherwise it links a replay main and ctest runs it over
# tests/fuzz/corpus/fuzz_foo/, so every parser's seeds and past crashes stay regression tests.
function(embd_fuzz_target name)
  cmake_parse_arguments(arg "" "" "LIBS" ${ARGN})
  set(src ${PROJECT_SOURCE_DIR}/tests/fuzz/${name}.c)
  if(EMBD_FUZZ)
    add_executable(${name} ${src})
    target_link_options(${name} PRIVATE -fsanitize=fuzzer)
  else()
    add_executable(${name} ${src} ${PROJECT_SOURCE_DIR}/tests/fuzz/replay_main.c)
  endif()
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/include)
  target_link_libraries(${name} PRIVATE ${arg_LIBS} Threads::Threads m)
  set(corpus ${PROJECT_SOURCE_DIR}/tests/fuzz/corpus/${name})
  if(NOT EMBD_FUZZ AND EXISTS ${corpus})
    add_test(NAME ${name}_replay COMMAND ${name} ${corpus})
    set_tests_properties(${name}_replay PROPERTIES TIMEOUT 120 LABELS fuzz)
  endif()
endfunction()
