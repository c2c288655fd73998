# Injected into llama.cpp's project() by the Makefile through
# -DCMAKE_PROJECT_llama.cpp_INCLUDE=<this file> when building the llama-cpp-python wheel.
# llama-cpp-python 0.3.36's CMakeLists.txt forces LLAMA_BUILD_COMMON ON, but the Python package
# never loads llama.cpp's "common" library; turning it off cuts the build from ~193 to ~83 ninja
# steps (../shared/DESIGN.md 2.1). A CMake hook, not a supported option.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "Build llama.cpp common library" FORCE)
set(LLAMA_BUILD_COMMON OFF)
