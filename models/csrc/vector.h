// What reelflow's CPU kernels share: a 16-float vector as GCC's and clang's vector extension
// spells it (one AVX-512 register; two AVX2 ones), and shuffles of such vectors.
#pragma once
#include <cstdint>

typedef float vec16 __attribute__((vector_size(64), aligned(4)));       // 16 floats, unaligned loads allowed
typedef uint16_t half32 __attribute__((vector_size(64), aligned(2)));   // 32 bfloat16 bit patterns
typedef int32_t index16 __attribute__((vector_size(64)));              // lane selectors for 16-float shuffles

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define REELFLOW_SHUFFLEVECTOR 1
#endif
#endif
// SHUFFLE(type, a, b, lanes...): lanes of a (0 to n-1) and b (n to 2n-1), n the vectors' length;
// `type` names the selector vector type older GCC's __builtin_shuffle needs (half32, index16)
#ifdef REELFLOW_SHUFFLEVECTOR       // clang, GCC 12 and later
#define SHUFFLE(type, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else                               // older GCC: the same selection as a mask vector
#define SHUFFLE(type, a, b, ...) __builtin_shuffle(a, b, (type){__VA_ARGS__})
#endif
