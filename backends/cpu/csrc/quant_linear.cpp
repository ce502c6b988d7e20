// fp32 GEMMs on weights kept compressed in memory: each weight is an integer q per element
// and an fp32 scale s, and optionally an fp32 offset o, per group of `group` consecutive
// inputs of an output, meaning w = s * q (+ o). That is what every GGUF block format of
// llama.cpp (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) dequantizes to
// (cadence/quantization/gguf_blocks.py), and what an int8 weight with group scales is.
//
// The values stay in panels as the fp32 tiled GEMM lays its weights out (tiled_core.h), a
// byte each, or two to a byte where a tensor's values span at most 16 integers (the 4-bit
// formats): against fp32's 4 bytes an element, 1.25 or 0.75 with Q4_1's scales and offsets.
// A chunk of up to 4 rows (decode at small batches) expands each K row of a panel in
// registers right before its FMAs; a larger chunk expands a K block of the panel once into a
// thread's fp32 buffer, which the tiled GEMM's own tiles then read, so the expansion costs a
// multiply (and an add) per weight per chunk against up to 128 FMAs. Measured on a Zen 5
// EPYC (2 threads), the default model's decode GEMMs of one step, 30 layers and the head, at
// one row: 3.4-3.9 ms from 4-bit blocks against 8.9-12.8 ms on fp32 weights; level at 64
// rows (docs/backends/cpu.md, "Quantized weights").
//
// NOTE exactness: the expansion computes s * q rounded to fp32, then adds o and rounds again,
// as numpy computes gguf's dequantization (the barrier below keeps the compiler from
// contracting the two into one FMA, which rounds once). The tiles then run the same FMA chains
// as tiled_linear on the same fp32 values, so this GEMM gives the bits of tiled_linear on the
// dequantized weight, row by row and at every batch size; tests/test_cpu_quant_linear.py
// checks it.

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tiled_core.h"

using namespace cadence_cpu;
using namespace cadence_cpu::tiled;

namespace {

// The values of one K row of a panel (kNR of them) as two vectors of floats, exactly.
//   Bits 8: kNR int8 bytes, the panel's columns in order.
//   Bits 4: kVec bytes; byte j holds column j's value in its low nibble and column j + kVec's
//     in its high one, each as value - zero (a nibble holds 0..15).
// One widening load and a convert each: GCC's __builtin_convertvector of a byte vector went
// lane by lane, ~10x slower.
template <int Bits>
inline void load_row(const uint8_t* p, int32_t zero, vfloat& b0, vfloat& b1) {
#if defined(__AVX512F__)
  __m512 f0, f1;
  if constexpr (Bits == 8) {
    f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + kVec))));
  } else {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    const __m512i z = _mm512_set1_epi32(zero), low = _mm512_set1_epi32(0x0F);
    f0 = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_and_si512(bytes, low), z));
    f1 = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_srli_epi32(bytes, 4), z));
  }
#elif defined(__AVX2__)
  __m256 f0, f1;
  if constexpr (Bits == 8) {
    f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
    f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + kVec))));
  } else {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    const __m256i z = _mm256_set1_epi32(zero), low = _mm256_set1_epi32(0x0F);
    f0 = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_and_si256(bytes, low), z));
    f1 = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_srli_epi32(bytes, 4), z));
  }
#else
  vint v0, v1;
  for (int64_t i = 0; i < kVec; ++i) {
    if constexpr (Bits == 8) {
      v0[i] = static_cast<int8_t>(p[i]);
      v1[i] = static_cast<int8_t>(p[i + kVec]);
    } else {
      v0[i] = (p[i] & 0x0F) + zero;
      v1[i] = (p[i] >> 4) + zero;
    }
  }
  const vfloat f0 = __builtin_convertvector(v0, vfloat), f1 = __builtin_convertvector(v1, vfloat);
#endif
  std::memcpy(&b0, &f0, sizeof(b0));
  std::memcpy(&b1, &f1, sizeof(b1));
}

// Keeps v as computed (rounded to fp32) across this point: no contraction with what follows.
inline vfloat rounded(vfloat v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#else
  asm("" : "+x"(v));
#endif
  return v;
}

// One K row's weights: s * q, then + o (each rounded to fp32).
template <int Bits>
inline void expand_row(const uint8_t* q, int32_t zero, vfloat s0, vfloat s1, const vfloat* o,
                       vfloat& b0, vfloat& b1) {
  load_row<Bits>(q, zero, b0, b1);
  b0 = b0 * s0;
  b1 = b1 * s1;
  if (o != nullptr) {
    b0 = rounded(b0) + o[0];
    b1 = rounded(b1) + o[1];
  }
}

// A compressed weight's panels (qtiled_pack): q [panels, K, kNR * Bits / 8] bytes, s and o
// [panels, K / group, kNR] fp32 (o may be absent).
template <int Bits>
struct QuantPanels {
  const uint8_t* q;
  const float* s;
  const float* o;  // or null
  int64_t k, group;
  int32_t zero;  // Bits 4: what a nibble of 0 stands for
  static constexpr bool kBuffered = true;
  // 256 K rows: the expanded block (32 KiB with AVX-512, 8 with AVX2) stays in L1 between
  // the expansion and the tiles. Smaller blocks change no bit: a block's partial sums are
  // stored as fp32 and reloaded (tiled_linear.cpp NOTE). 1536 rows, the fp32 kernel's block,
  // measured 1.5x slower at one row.
  static constexpr int64_t kMaxKC = 256;
  static constexpr int64_t kRowBytes = kNR * Bits / 8;
  // Row chunks of at most this many rows multiply straight from the compressed block.
  // Beyond, expanding the block once for all the chunk's tiles costs less than once per tile.
  static constexpr int64_t kDirectRows = 4;

  const char* raw(int64_t p, int64_t k0) const {
    return reinterpret_cast<const char*>(q + (p * k + k0) * kRowBytes);
  }

  // Calls f(i0, i1, s0, s1, o or null) for each run [i0, i1) of the block's K rows that
  // shares one group's scales (and offsets).
  template <typename F>
  void by_group(int64_t p, int64_t k0, int64_t kc, F&& f) const {
    const int64_t groups = k / group;
    for (int64_t i0 = 0; i0 < kc;) {
      const int64_t g = (k0 + i0) / group, i1 = std::min(kc, (g + 1) * group - k0);
      const int64_t at = (p * groups + g) * kNR;
      vfloat off[2];
      if (o != nullptr) {
        off[0] = load(o + at);
        off[1] = load(o + at + kVec);
      }
      f(i0, i1, load(s + at), load(s + at + kVec), o != nullptr ? off : nullptr);
      i0 = i1;
    }
  }

  const float* block(int64_t p, int64_t k0, int64_t kc, float* buf) const {
    const uint8_t* qp = q + (p * k + k0) * kRowBytes;
    by_group(p, k0, kc, [&](int64_t i0, int64_t i1, vfloat s0, vfloat s1, const vfloat* off) {
      for (int64_t i = i0; i < i1; ++i) {
        vfloat b0, b1;
        expand_row<Bits>(qp + i * kRowBytes, zero, s0, s1, off, b0, b1);
        store(buf + i * kNR, b0);
        store(buf + i * kNR + kVec, b1);
      }
    });
    return buf;
  }

  // c[MR, kNR] (+)= a[MR, kc] x the block, each weight expanded in registers just before its
  // FMAs: the expansion of the next K row overlaps the FMA chains of this one, whose latency
  // bounds a tile of one row. Each weight and each FMA chain is computed as the buffered path
  // computes it: the same bits.
  template <int MR>
  void direct_tile(const float* __restrict a, int64_t lda, int64_t p, int64_t k0, int64_t kc,
                   float* __restrict c, bool first) const {
    vfloat acc0[MR], acc1[MR];
    for (int r = 0; r < MR; ++r) {
      acc0[r] = first ? splat(0.0f) : load(c + r * kNR);
      acc1[r] = first ? splat(0.0f) : load(c + r * kNR + kVec);
    }
    const uint8_t* qp = q + (p * k + k0) * kRowBytes;
    by_group(p, k0, kc, [&](int64_t i0, int64_t i1, vfloat s0, vfloat s1, const vfloat* off) {
      for (int64_t i = i0; i < i1; ++i) {
        vfloat b0, b1;
        expand_row<Bits>(qp + i * kRowBytes, zero, s0, s1, off, b0, b1);
        for (int r = 0; r < MR; ++r) {
          const vfloat av = splat(a[r * lda + i]);
          acc0[r] = fma(av, b0, acc0[r]);
          acc1[r] = fma(av, b1, acc1[r]);
        }
      }
    });
    for (int r = 0; r < MR; ++r) {
      store(c + r * kNR, acc0[r]);
      store(c + r * kNR + kVec, acc1[r]);
    }
  }

  bool direct(int64_t rows, const float* a, int64_t lda, int64_t p, int64_t k0, int64_t kc,
              float* c, bool first) const {
    switch (rows) {
      case 1: direct_tile<1>(a, lda, p, k0, kc, c, first); return true;
      case 2: direct_tile<2>(a, lda, p, k0, kc, c, first); return true;
      case 3: direct_tile<3>(a, lda, p, k0, kc, c, first); return true;
      case 4: direct_tile<4>(a, lda, p, k0, kc, c, first); return true;
      default: return false;
    }
  }
};

// t [N, C] (any dtype) -> [panels, C, kNR], the last panel's missing rows zero.
torch::Tensor panels_of(const torch::Tensor& t) {
  const int64_t n = t.size(0), cols = t.size(1);
  const int64_t panels = (n + kNR - 1) / kNR;
  auto padded = torch::zeros({panels * kNR, cols}, t.options());
  padded.narrow(0, 0, n).copy_(t);
  return padded.view({panels, kNR, cols}).transpose(1, 2).contiguous();
}

// [2 * h, C] gate rows then up rows -> each run of kVec gate rows followed by the kVec up rows
// of the same outputs (tiled_pack_gated's order).
torch::Tensor gated_rows(const torch::Tensor& t) {
  const int64_t h = t.size(0) / 2, cols = t.size(1);
  return t.contiguous().view({2, h / kVec, kVec, cols}).transpose(0, 1).reshape({2 * h, cols});
}

void check_parts(const torch::Tensor& q, const torch::Tensor& s,
                 const c10::optional<torch::Tensor>& o) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "q must be [N, K] int8");
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == at::kFloat && s.size(0) == q.size(0) &&
                  s.size(1) > 0 && q.size(1) % s.size(1) == 0,
              "s must be [N, K / group] float32 with group dividing K");
  if (o.has_value() && o->defined())
    TORCH_CHECK(o->sizes() == s.sizes() && o->scalar_type() == at::kFloat,
                "o must be float32 and shaped as s");
}

// The packed parts: [q bytes, s, o (empty when absent), meta = int64 {bits, zero}].
std::vector<torch::Tensor> pack_parts(const torch::Tensor& q, const torch::Tensor& s,
                                      const c10::optional<torch::Tensor>& o) {
  const bool has_o = o.has_value() && o->defined();
  // Values that fit in a nibble (every 4-bit GGUF format's) are stored two to a byte.
  const int32_t lo = q.numel() ? q.min().item<int8_t>() : 0;
  const int32_t hi = q.numel() ? q.max().item<int8_t>() : 0;
  torch::Tensor qp = panels_of(q);  // [panels, K, kNR] int8
  int64_t bits = 8;
  int32_t zero = 0;
  if (hi - lo <= 15) {
    bits = 4;
    zero = lo;
    // The last panel's padding (q 0, s 0) may lie outside lo..lo+15; any nibble serves it.
    const auto n = (qp.to(at::kInt) - lo).clamp(0, 15).to(at::kByte);
    qp = (n.narrow(2, 0, kVec) | n.narrow(2, kVec, kVec).mul(16)).contiguous();
  } else {
    qp = qp.view(at::kByte);
  }
  return {qp, panels_of(s), has_o ? panels_of(*o) : torch::empty({0}, s.options()),
          torch::tensor({bits, static_cast<int64_t>(zero)}, torch::dtype(at::kLong))};
}

struct Source {
  int64_t bits;
  QuantPanels<8> q8;
  QuantPanels<4> q4;
};

// x [M, K] fp32 and qtiled_pack's parts -> the panels' source; checks their agreement.
Source source_of(const torch::Tensor& x, const std::vector<torch::Tensor>& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be [M, K] float32 on the CPU");
  TORCH_CHECK(packed.size() == 4 && packed[3].numel() == 2 &&
                  packed[3].scalar_type() == at::kLong && packed[3].is_contiguous(),
              "packed must be qtiled_pack's output");
  const auto& q = packed[0];
  const auto& s = packed[1];
  // Read in place: two item() calls went through the dispatcher on every GEMM call.
  const int64_t* meta = packed[3].data_ptr<int64_t>();
  const int64_t bits = meta[0];
  const int32_t zero = static_cast<int32_t>(meta[1]);
  TORCH_CHECK((bits == 8 || bits == 4) && q.dim() == 3 && q.scalar_type() == at::kByte &&
                  q.size(2) == kNR * bits / 8 && q.size(1) == x.size(1) && q.is_contiguous() &&
                  x.size(1) > 0,
              "packed must be qtiled_pack's output for K = x.size(1)");
  TORCH_CHECK(s.dim() == 3 && s.size(0) == q.size(0) && s.size(2) == kNR && s.is_contiguous() &&
                  x.size(1) % s.size(1) == 0, "packed scales do not match its q");
  const float* o = nullptr;
  if (packed[2].numel() > 0) {
    TORCH_CHECK(packed[2].sizes() == s.sizes() && packed[2].is_contiguous(),
                "packed offsets do not match its scales");
    o = packed[2].data_ptr<float>();
  }
  const auto* qb = q.data_ptr<uint8_t>();
  const int64_t k = x.size(1), group = k / s.size(1);
  return {bits, QuantPanels<8>{qb, s.data_ptr<float>(), o, k, group, 0},
          QuantPanels<4>{qb, s.data_ptr<float>(), o, k, group, zero}};
}

torch::Tensor rows_of(const torch::Tensor& x) {
  return x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
}

template <typename Out>
void run(const torch::Tensor& xc, const Source& src, int64_t panels, const Out& out) {
  if (src.bits == 4)
    run_tiled(xc.data_ptr<float>(), xc.size(0), xc.size(1), xc.stride(0), src.q4, panels, out);
  else
    run_tiled(xc.data_ptr<float>(), xc.size(0), xc.size(1), xc.stride(0), src.q8, panels, out);
}

}  // namespace

// q [N, K] int8, s [N, K / group] fp32, o (optional) as s -> the parts qtiled_linear reads,
// each in panels of kNR outputs as tiled_pack lays out an fp32 weight; values that span at
// most 16 consecutive integers (the 4-bit formats') two to a byte.
std::vector<torch::Tensor> qtiled_pack(torch::Tensor q, torch::Tensor s,
                                       c10::optional<torch::Tensor> o) {
  check_parts(q, s, o);
  return pack_parts(q, s, o);
}

// The same for a gated MLP's [2 * h, K] gate-then-up weight, in tiled_pack_gated's order
// (h a multiple of the vector width), for qtiled_linear_gated.
std::vector<torch::Tensor> qtiled_pack_gated(torch::Tensor q, torch::Tensor s,
                                             c10::optional<torch::Tensor> o) {
  check_parts(q, s, o);
  TORCH_CHECK(q.size(0) % 2 == 0 && (q.size(0) / 2) % kVec == 0,
              "the gated layout needs h to be a multiple of ", kVec);
  c10::optional<torch::Tensor> og;
  if (o.has_value() && o->defined()) og = gated_rows(*o);
  return pack_parts(gated_rows(q), gated_rows(s), og);
}

// x [M, K] fp32 times the compressed weight of an [N, K] linear (+ bias) -> [M, N] fp32: the
// bits of tiled_linear on the dequantized weight.
torch::Tensor qtiled_linear(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t n,
                            c10::optional<torch::Tensor> bias) {
  const Source src = source_of(x, packed);
  const auto xc = rows_of(x);
  const int64_t panels = packed[0].size(0);
  TORCH_CHECK(n > (panels - 1) * kNR && n <= panels * kNR, "n does not match packed");
  const auto bc = bias_of(bias, n, "n");
  auto out = torch::empty({xc.size(0), n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (xc.size(0) == 0) return out;
  run(xc, src, panels,
      PlainOut{out.data_ptr<float>(), n, bc.defined() ? bc.data_ptr<float>() : nullptr});
  return out;
}

// silu(x @ gate.T + b) * (x @ up.T + b) -> [M, h] on qtiled_pack_gated's parts: the bits of
// tiled_linear_gated on the dequantized weight.
torch::Tensor qtiled_linear_gated(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t h,
                                  c10::optional<torch::Tensor> bias) {
  const Source src = source_of(x, packed);
  const auto xc = rows_of(x);
  const int64_t panels = packed[0].size(0);
  TORCH_CHECK(h % kVec == 0 && panels * kVec == h, "h does not match the gated packed weight");
  const auto bc = bias_of(bias, 2 * h, "2 * h");
  auto out = torch::empty({xc.size(0), h}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (xc.size(0) == 0) return out;
  run(xc, src, panels,
      GatedOut{out.data_ptr<float>(), h, bc.defined() ? bc.data_ptr<float>() : nullptr});
  return out;
}
