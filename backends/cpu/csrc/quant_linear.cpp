// fp32 GEMMs on weights kept compressed in memory: each weight is an integer q per element
// (int8) and an fp32 scale s, and optionally an fp32 offset o, per group of `group`
// consecutive inputs of an output, meaning w = s * q (+ o). That is what every GGUF block
// format of llama.cpp (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) dequantizes to
// (cadence/quantization/gguf_blocks.py), and what an int8 weight with group scales is.
//
// The weight stays in panels of q (1 byte an element against fp32's 4) and is expanded one K
// block of one panel at a time into a thread's fp32 buffer, which the fp32 tiled GEMM's tiles
// then read (tiled_core.h). A decode step streams the weights from memory once, so reading a
// quarter of the bytes is what makes it faster; the expansion costs one multiply (and one add)
// per weight element per row chunk, against kMR to 128 FMAs on it.
//
// NOTE exactness: the expansion computes s * q rounded to fp32, then adds o and rounds again,
// as numpy computes gguf's dequantization (the barrier below keeps the compiler from
// contracting the two into one FMA, which rounds once). The tiles then run the same FMA chains
// as tiled_linear on the same fp32 values, so this GEMM gives the bits of tiled_linear on the
// dequantized weight, row by row and at every batch size; tests/test_cpu_quant_linear.py
// checks it.

#include <torch/extension.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "tiled_core.h"

using namespace cadence_cpu;
using namespace cadence_cpu::tiled;

namespace {

// kVec int8 values as floats (exact). One widening load and a convert: GCC's
// __builtin_convertvector of an int8 vector went lane by lane, ~10x slower.
inline vfloat load_q(const int8_t* p) {
  vfloat v;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  int32_t lanes[kVec];
  for (int64_t i = 0; i < kVec; ++i) lanes[i] = p[i];
  const vint f = *reinterpret_cast<const vint*>(lanes);
  v = __builtin_convertvector(f, vfloat);
  return v;
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
  std::memcpy(&v, &f, sizeof(v));
  return v;
#endif
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

// c[MR, kNR] (+)= a[MR, kc] x the block of K rows [k0, k0 + kc) of one compressed panel,
// each weight expanded in registers just before its FMAs. The expansion of the next K row
// overlaps the FMA chains of this one, whose latency bounds a tile of one row. Each weight
// and each FMA chain is computed as the buffered path computes it: the same bits.
template <int MR>
inline void direct_tile(const float* __restrict a, int64_t lda, const int8_t* __restrict q,
                        const float* s, const float* o, int64_t group, int64_t k0, int64_t kc,
                        float* __restrict c, bool first) {
  vfloat acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) {
    acc0[r] = first ? splat(0.0f) : load(c + r * kNR);
    acc1[r] = first ? splat(0.0f) : load(c + r * kNR + kVec);
  }
  for (int64_t i0 = 0; i0 < kc;) {
    const int64_t g = (k0 + i0) / group, i1 = std::min(kc, (g + 1) * group - k0);
    const vfloat s0 = load(s + g * kNR), s1 = load(s + g * kNR + kVec);
    const vfloat o0 = o != nullptr ? load(o + g * kNR) : splat(0.0f);
    const vfloat o1 = o != nullptr ? load(o + g * kNR + kVec) : splat(0.0f);
    for (int64_t i = i0; i < i1; ++i) {
      vfloat b0 = load_q(q + i * kNR) * s0, b1 = load_q(q + i * kNR + kVec) * s1;
      if (o != nullptr) {
        b0 = rounded(b0) + o0;
        b1 = rounded(b1) + o1;
      }
      for (int r = 0; r < MR; ++r) {
        const vfloat av = splat(a[r * lda + i]);
        acc0[r] = fma(av, b0, acc0[r]);
        acc1[r] = fma(av, b1, acc1[r]);
      }
    }
    i0 = i1;
  }
  for (int r = 0; r < MR; ++r) {
    store(c + r * kNR, acc0[r]);
    store(c + r * kNR + kVec, acc1[r]);
  }
}

// Row chunks of at most this many rows multiply straight from the compressed block. Beyond,
// expanding the block once for all the chunk's tiles costs less than once per tile.
constexpr int64_t kDirectRows = 4;

// A compressed weight's panels (qtiled_pack): q [panels, K, kNR] int8, s and o
// [panels, K / group, kNR] fp32 (o may be absent). A block is expanded into the buffer.
struct QuantPanels {
  const int8_t* q;
  const float* s;
  const float* o;  // or null
  int64_t k, group;
  static constexpr bool kBuffered = true;
  // 256 K rows: the expanded block (32 KiB with AVX-512, 8 with AVX2) stays in L1 between
  // the expansion and the tiles. Smaller blocks change no bit: a block's partial sums are
  // stored as fp32 and reloaded (tiled_linear.cpp NOTE). 1536 rows, the fp32 kernel's block,
  // measured 1.5x slower at one row.
  static constexpr int64_t kMaxKC = 256;
  static constexpr int64_t kRowBytes = kNR;
  const char* raw(int64_t p, int64_t k0) const {
    return reinterpret_cast<const char*>(q + (p * k + k0) * kNR);
  }
  bool direct(int64_t rows, const float* a, int64_t lda, int64_t p, int64_t k0, int64_t kc,
              float* c, bool first) const {
    if (rows > kDirectRows) return false;
    const int64_t groups = k / group;
    const int8_t* qp = q + (p * k + k0) * kNR;
    const float* sp = s + p * groups * kNR;
    const float* op = o != nullptr ? o + p * groups * kNR : nullptr;
    switch (rows) {
      case 1: direct_tile<1>(a, lda, qp, sp, op, group, k0, kc, c, first); break;
      case 2: direct_tile<2>(a, lda, qp, sp, op, group, k0, kc, c, first); break;
      case 3: direct_tile<3>(a, lda, qp, sp, op, group, k0, kc, c, first); break;
      default: direct_tile<4>(a, lda, qp, sp, op, group, k0, kc, c, first); break;
    }
    return true;
  }
  const float* block(int64_t p, int64_t k0, int64_t kc, float* buf) const {
    const int64_t groups = k / group;
    const int8_t* qp = q + (p * k + k0) * kNR;
    for (int64_t i0 = 0; i0 < kc;) {
      // The K rows [i0, i1) share one group's scales (and offsets).
      const int64_t g = (k0 + i0) / group, i1 = std::min(kc, (g + 1) * group - k0);
      const float* sg = s + (p * groups + g) * kNR;
      const vfloat s0 = load(sg), s1 = load(sg + kVec);
      if (o == nullptr) {
        for (int64_t i = i0; i < i1; ++i) {
          store(buf + i * kNR, load_q(qp + i * kNR) * s0);
          store(buf + i * kNR + kVec, load_q(qp + i * kNR + kVec) * s1);
        }
      } else {
        const float* og = o + (p * groups + g) * kNR;
        const vfloat o0 = load(og), o1 = load(og + kVec);
        for (int64_t i = i0; i < i1; ++i) {
          store(buf + i * kNR, rounded(load_q(qp + i * kNR) * s0) + o0);
          store(buf + i * kNR + kVec, rounded(load_q(qp + i * kNR + kVec) * s1) + o1);
        }
      }
      i0 = i1;
    }
    return buf;
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

std::vector<torch::Tensor> pack_parts(const torch::Tensor& q, const torch::Tensor& s,
                                      const c10::optional<torch::Tensor>& o) {
  std::vector<torch::Tensor> out{panels_of(q), panels_of(s)};
  if (o.has_value() && o->defined()) out.push_back(panels_of(*o));
  return out;
}

// x [M, K] fp32 and qtiled_pack's parts -> the panels' source; checks their agreement.
QuantPanels source_of(const torch::Tensor& x, const std::vector<torch::Tensor>& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be [M, K] float32 on the CPU");
  TORCH_CHECK(packed.size() == 2 || packed.size() == 3, "packed must be qtiled_pack's output");
  const auto& q = packed[0];
  const auto& s = packed[1];
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kChar && q.size(2) == kNR &&
                  q.size(1) == x.size(1) && q.is_contiguous() && x.size(1) > 0,
              "packed must be qtiled_pack's output for K = x.size(1)");
  TORCH_CHECK(s.dim() == 3 && s.size(0) == q.size(0) && s.size(2) == kNR && s.is_contiguous() &&
                  x.size(1) % s.size(1) == 0, "packed scales do not match its q");
  const float* o = nullptr;
  if (packed.size() == 3) {
    TORCH_CHECK(packed[2].sizes() == s.sizes() && packed[2].is_contiguous(),
                "packed offsets do not match its scales");
    o = packed[2].data_ptr<float>();
  }
  return QuantPanels{q.data_ptr<int8_t>(), s.data_ptr<float>(), o, x.size(1),
                     x.size(1) / s.size(1)};
}

torch::Tensor rows_of(const torch::Tensor& x) {
  return x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
}

}  // namespace

// q [N, K] int8, s [N, K / group] fp32, o (optional) as s -> the parts qtiled_linear reads:
// each in panels of kNR outputs, as tiled_pack lays out an fp32 weight.
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
  const QuantPanels src = source_of(x, packed);
  const auto xc = rows_of(x);
  const int64_t panels = packed[0].size(0);
  TORCH_CHECK(n > (panels - 1) * kNR && n <= panels * kNR, "n does not match packed");
  const auto bc = bias_of(bias, n, "n");
  auto out = torch::empty({xc.size(0), n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (xc.size(0) == 0) return out;
  run_tiled(xc.data_ptr<float>(), xc.size(0), xc.size(1), xc.stride(0), src, panels,
            PlainOut{out.data_ptr<float>(), n, bc.defined() ? bc.data_ptr<float>() : nullptr});
  return out;
}

// silu(x @ gate.T + b) * (x @ up.T + b) -> [M, h] on qtiled_pack_gated's parts: the bits of
// tiled_linear_gated on the dequantized weight.
torch::Tensor qtiled_linear_gated(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t h,
                                  c10::optional<torch::Tensor> bias) {
  const QuantPanels src = source_of(x, packed);
  const auto xc = rows_of(x);
  const int64_t panels = packed[0].size(0);
  TORCH_CHECK(h % kVec == 0 && panels * kVec == h, "h does not match the gated packed weight");
  const auto bc = bias_of(bias, 2 * h, "2 * h");
  auto out = torch::empty({xc.size(0), h}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (xc.size(0) == 0) return out;
  run_tiled(xc.data_ptr<float>(), xc.size(0), xc.size(1), xc.stride(0), src, panels,
            GatedOut{out.data_ptr<float>(), h, bc.defined() ? bc.data_ptr<float>() : nullptr});
  return out;
}
