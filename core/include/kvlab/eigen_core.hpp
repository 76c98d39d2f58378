#pragma once
// <Eigen/Core> for every kvlab file that uses Eigen. GCC 12 reports -Wmaybe-uninitialized inside
// its own AVX-512 intrinsics (avx512fintrin.h, `__Y`; and -Wuninitialized for the value of
// _mm512_undefined_*(), which Eigen's exp() reaches) when Eigen's packet code is inlined
// under -march=native on an AVX-512 machine: a false positive in third-party code, 129 of them
// per build. The warning is located in the intrinsics header, so it is silenced for that header
// alone by including it (first, through Eigen) between a push and a pop; kvlab's own code keeps
// the warning. Include this before any other header that pulls in <immintrin.h> or Eigen.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"  // _mm512_undefined_*() is uninitialized by design
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <Eigen/Core>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
