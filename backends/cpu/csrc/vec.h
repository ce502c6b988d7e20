// Portable float vectors for the CPU kernels (GCC/Clang vector extensions), as wide as the
// widest register the build targets: 16 floats with AVX-512, 8 with AVX2, 4 with SSE. One
// source serves every x86 CPU the backend meets. The width is the native one on purpose:
// GCC lowers a vector wider than the target's registers (a 16-float vector on AVX2) through
// the stack, lane by lane for compares and shuffles: the decode attention measured ~2-3x
// slower that way on an AVX2-only CPU than on 8-float vectors (docs/backends/cpu.md).
//
// NOTE the width is part of the arithmetic (the attention kernels' tile of kVec keys, the
// lane order of every sum), so a kernel's bits are fixed per build, not across ISAs; the
// kernels that must agree with each other (decode and prefill attention) share one build.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>

namespace cadence_cpu {

#if defined(__AVX512F__)
constexpr int64_t kVec = 16;  // floats per vector
#elif defined(__AVX__)
constexpr int64_t kVec = 8;
#else
constexpr int64_t kVec = 4;
#endif

typedef float vfloat __attribute__((vector_size(kVec * 4)));
typedef int32_t vint __attribute__((vector_size(kVec * 4)));
typedef uint32_t vuint __attribute__((vector_size(kVec * 4)));
typedef uint16_t vu16 __attribute__((vector_size(kVec * 2)));

namespace detail {
template <size_t... I>
inline vfloat splat(float x, std::index_sequence<I...>) {
  return vfloat{((void)I, x)...};
}
// Lane i of the result is lane i ^ S of the input (a butterfly step of a horizontal sum).
template <int S, size_t... I>
inline vfloat swap_lanes(vfloat v, std::index_sequence<I...>) {
  return __builtin_shuffle(v, vint{static_cast<int32_t>(I ^ S)...});
}
}  // namespace detail

// A broadcast (vfloat{} + x would keep an add: 0 + x is not x for x = -0).
inline vfloat splat(float x) { return detail::splat(x, std::make_index_sequence<kVec>{}); }

// a * b + c as one fused operation in every instantiation (the compiler's contraction is a
// choice it may make differently per function; the bits must not depend on it).
inline vfloat fma(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
  __m512 x, y, z;
  std::memcpy(&x, &a, sizeof(x)); std::memcpy(&y, &b, sizeof(y)); std::memcpy(&z, &c, sizeof(z));
  z = _mm512_fmadd_ps(x, y, z);
#elif defined(__FMA__)
  __m256 x, y, z;
  std::memcpy(&x, &a, sizeof(x)); std::memcpy(&y, &b, sizeof(y)); std::memcpy(&z, &c, sizeof(z));
  z = _mm256_fmadd_ps(x, y, z);
#else
  const vfloat z = a * b + c;  // no FMA unit: one rounding per step, the same in every tile
#endif
  vfloat r;
  std::memcpy(&r, &z, sizeof(r));
  return r;
}

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vfloat load(const c10::BFloat16* p) {
#ifdef __AVX512F__
  // One widening load; GCC lowers __builtin_convertvector below to two half-width ones.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16);
  vfloat v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#else
  vu16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const vuint bits = __builtin_convertvector(raw, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#endif
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
// float -> bf16 with round-to-nearest-even, as torch's .to(torch.bfloat16) (NaN stays NaN).
inline void store(c10::BFloat16* p, vfloat v) {
  vuint bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vuint rounded = (bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16;
  const vuint nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const vuint out = nan ? ((bits >> 16) | 0x40u) : rounded;
  const vu16 narrow = __builtin_convertvector(out, vu16);
  std::memcpy(p, &narrow, sizeof(narrow));
}
// Rounds through the storage type: what torch does between two ops on bf16 tensors.
inline vfloat round_to(vfloat v, const float*) { return v; }
inline vfloat round_to(vfloat v, const c10::BFloat16*) {
  vuint bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits = (bits + (((bits >> 16) & 1u) + 0x7fffu)) & 0xffff0000u;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

#if defined(__AVX512BF16__)
constexpr bool kHasDotBf16 = true;
// acc + the products of 32 bf16 pairs from a and b, summed in pairs into 16 fp32 lanes (one
// vdpbf16ps): products of bf16 values are exact in fp32, and the instruction reads bf16
// with no widening step. Denormal inputs count as zero (the instruction's fixed mode).
inline vfloat dot_bf16(vfloat acc, const c10::BFloat16* a, const c10::BFloat16* b) {
  __m512 r;
  std::memcpy(&r, &acc, sizeof(r));
  const __m512i x = _mm512_loadu_si512(a), y = _mm512_loadu_si512(b);
  __m512bh xb, yb;
  std::memcpy(&xb, &x, sizeof(xb));
  std::memcpy(&yb, &y, sizeof(yb));
  r = _mm512_dpbf16_ps(r, xb, yb);
  std::memcpy(&acc, &r, sizeof(acc));
  return acc;
}
#else
constexpr bool kHasDotBf16 = false;
inline vfloat dot_bf16(vfloat acc, const c10::BFloat16*, const c10::BFloat16*) { return acc; }
#endif

// Sum of the lanes: lane i plus lane i + kVec/2, then i + kVec/4, ... (a fixed order).
template <int S = kVec / 2>
inline float hsum(vfloat v) {
  if constexpr (S == 0) {
    return v[0];
  } else {
    return hsum<S / 2>(v + detail::swap_lanes<S>(v, std::make_index_sequence<kVec>{}));
  }
}

namespace detail {
// exp(x) = 2^n * p(r): returns p(r) and sets n = round(x / ln 2), |r| <= ln2 / 2, p a degree-6
// Taylor polynomial (relative error < 2e-7). |x| must stay well under 2^22 (the rounding
// trick). Shared by exp below and the sampling kernel's exp (logits.cpp), which scale by 2^n
// in their own ways.
inline vfloat exp_reduced(vfloat x, vfloat& n) {
  // 1.5 * 2^23: adding it rounds to an integer.
  const vfloat shifter = ::cadence_cpu::splat(12582912.0f);
  n = (x * 1.44269504088896341f + shifter) - shifter;
  const vfloat r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  vfloat p = ::cadence_cpu::splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}
}  // namespace detail

// exp(x) (detail::exp_reduced). x is clamped to [-87, 88]: exp underflows to ~1e-38 and
// overflows to ~1.6e38 there instead of to 0 and inf, which no caller can tell apart.
inline vfloat exp(vfloat x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  vfloat n;
  const vfloat p = detail::exp_reduced(x, n);
  // n <= 127 after the clamp; split the scale in two so 2^n never overflows the exponent.
  const vint ni = __builtin_convertvector(n, vint);
  const vint half = ni >> 1;
  const vint b1 = (half + 127) << 23;
  const vint b2 = (ni - half + 127) << 23;
  vfloat s1, s2;
  std::memcpy(&s1, &b1, sizeof(s1));
  std::memcpy(&s2, &b2, sizeof(s2));
  return p * s1 * s2;
}

// SiLU of a vector of fp32 gate values, x / (1 + exp(-x)): one definition, so the
// elementwise kernel (silu_and_mul) and the gated GEMM's epilogue give the same bits.
inline vfloat silu(vfloat x) { return x / (1.0f + exp(-x)); }

}  // namespace cadence_cpu
