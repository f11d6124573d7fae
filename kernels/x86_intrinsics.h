// <immintrin.h> for the files with target-attribute kernels. GCC 12 warns
// about the AVX-512 intrinsics' own deliberately undefined operands
// (_mm512_undefined_*, GCC bug 105593, fixed in GCC 13); the warning is
// located in the header, so it is silenced around its inclusion here.
#ifndef KVTIER_KERNELS_X86_INTRINSICS_H_
#define KVTIER_KERNELS_X86_INTRINSICS_H_

#if defined(__x86_64__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

#endif  // KVTIER_KERNELS_X86_INTRINSICS_H_
