// fp32 GEMMs on a register-tiled micro-kernel over weights packed once at load in column
// panels: what made the default model's decode GEMMs faster than oneDNN's packed inner product
// on an AVX2-only AMD EPYC (docs/backends/cpu.md, "The fp32 tiled GEMM"). linear.py measures it
// against oneDNN and F.linear on the model's own shapes and keeps the fastest.
//
// Why it wins at decode sizes: at 16-64 rows oneDNN's inner product runs at 45-61 GFLOP/s
// there against ~72 at 2048 rows. Here a weight panel (kNR columns, the whole K) is read
// from memory once per chunk of rows, the next panel is prefetched while the current one is
// used by every row tile, and a tile of kMR rows x kNR columns lives in registers (12 of the
// 16 AVX2 registers; 24 of AVX-512's 32), so the FMA units are fed from cache whatever the
// number of rows.
//
// A gated MLP's gate/up weight can be packed with each panel holding the gate and the up
// columns of the same outputs (tiled_pack_gated); tiled_linear_gated then writes
// silu(gate) * up from the finished panel, without the [M, 2 * h] intermediate
// (backends/cpu/gated.py).
//
// NOTE batch invariance: every output element is one FMA chain over k = 0..K-1 in order,
// whatever M is, which row tile or chunk holds the row, or which thread computes it (a K
// block ends with the partial sums stored as fp32 and reloaded: no rounding). Rows of any
// batch therefore get the bits they get alone; tests/test_cpu_kernels.py checks it.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm_chunks.h"
#include "vec.h"

namespace {

using namespace cadence_cpu;

constexpr int64_t kNR = 2 * kVec;  // columns per panel: two vectors
// Rows per register tile (2 x kMR accumulators). With AVX-512's 32 registers, 12 rows: each
// panel row loaded serves twice the FMAs, and the panel is read from cache half as often.
// Measured on an AMX Xeon (AVX-512), a decode step's 121 GEMMs against 6 rows: 1.07x at 64
// rows, 1.11x at 16, 1.06x at 256, 1.12x at 2048; 14 rows was slower than 12.
constexpr int kMR = kVec >= 16 ? 12 : 6;
constexpr int64_t kMaxKC = 1536;   // a panel's K block: at most 96 KiB on AVX2, 192 on AVX-512
constexpr int64_t kMC = 128;       // most rows per chunk, before the even split

// How a tile prefetches the block its thread reads next (into L2; it never changes a bit):
//   kBurst: one row of kNR floats (two lines on AVX-512) per K step from the start of the
//     tile, for `lines` lines; the block comes from cache, so a burst keeps enough misses in
//     flight.
//   kPaced: one line every `every` K steps, for `lines` lines; the block comes from memory,
//     and a burst would hold the core's line-fill buffers the tile's own misses need.
enum class Prefetch { kBurst, kPaced };

struct Ahead {
  const char* at = nullptr;  // the first line to prefetch
  int64_t lines = 0;
  int64_t every = 1;  // kPaced: K steps between lines
};

// c[MR, kNR] (+)= a[MR, kc] (rows lda apart) x b[kc, kNR], prefetching `ahead` meanwhile.
template <int MR, Prefetch P>
inline void tile(const float* __restrict a, int64_t lda, const float* __restrict b, int64_t kc,
                 float* __restrict c, bool first, Ahead ahead) {
  vfloat acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) {
    acc0[r] = first ? splat(0.0f) : load(c + r * kNR);
    acc1[r] = first ? splat(0.0f) : load(c + r * kNR + kVec);
  }
  // kBurst's condition (k < rows) costs the K loop fewer registers than kPaced's countdown:
  // with 12 row pointers live, every extra one is a reload from the stack per K step.
  const int64_t burst_rows =
      P == Prefetch::kBurst ? (ahead.lines * 64 + kNR * 4 - 1) / (kNR * 4) : 0;
  int64_t left = ahead.lines, count = ahead.every;
  const char* line = ahead.at;
  for (int64_t k = 0; k < kc; ++k) {
    const vfloat b0 = load(b + k * kNR), b1 = load(b + k * kNR + kVec);
    if constexpr (P == Prefetch::kBurst) {
      if (k < burst_rows) {
        for (int64_t off = 0; off < kNR * 4; off += 64)
          __builtin_prefetch(ahead.at + k * kNR * 4 + off, 0, 2);
      }
    } else {
      if (left > 0 && --count == 0) {
        count = ahead.every;
        __builtin_prefetch(line, 0, 2);
        line += 64;
        --left;
      }
    }
    for (int r = 0; r < MR; ++r) {
      const vfloat av = splat(a[r * lda + k]);
      acc0[r] = fma(av, b0, acc0[r]);
      acc1[r] = fma(av, b1, acc1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    store(c + r * kNR, acc0[r]);
    store(c + r * kNR + kVec, acc1[r]);
  }
}

// tile<rows> for 1 <= rows <= MR (only the sizes a build can reach are instantiated).
template <int MR, Prefetch P>
inline void tile_rows_upto(int rows, const float* a, int64_t lda, const float* b, int64_t kc,
                           float* c, bool first, Ahead ahead) {
  if constexpr (MR == 1) {
    tile<1, P>(a, lda, b, kc, c, first, ahead);
  } else {
    if (rows == MR) return tile<MR, P>(a, lda, b, kc, c, first, ahead);
    tile_rows_upto<MR - 1, P>(rows, a, lda, b, kc, c, first, ahead);
  }
}

// Rows [0, rows) of a (rows lda apart) against one K block b of a panel, into c, tile by
// tile; meanwhile `lines` lines from `next` are prefetched: all in the first tile (kBurst),
// or evenly over every tile (kPaced).
template <Prefetch P>
void rows_block(int64_t rows, const float* a, int64_t lda, const float* b, int64_t kc,
                float* c, bool first, const float* next, int64_t lines) {
  const int64_t tiles = (rows + kMR - 1) / kMR;
  const int64_t per_tile = P == Prefetch::kPaced ? (lines + tiles - 1) / tiles : lines;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t l0 = std::min(lines, t * per_tile), l1 = std::min(lines, l0 + per_tile);
    Ahead ahead;
    if (next != nullptr && l1 > l0) {
      ahead.at = reinterpret_cast<const char*>(next) + l0 * 64;
      ahead.lines = l1 - l0;
      ahead.every = std::max<int64_t>(1, kc / ahead.lines);  // run_tiled: lines <= kc
    }
    tile_rows_upto<kMR, P>(static_cast<int>(std::min<int64_t>(kMR, rows - t * kMR)),
                           a + t * kMR * lda, lda, b, kc, c + t * kMR * kNR, first, ahead);
  }
}

}  // namespace

int64_t tiled_panel_width() { return kNR; }

// w [N, K] fp32 -> [ceil(N / kNR), K, kNR]: panel p holds columns p*kNR.. as K rows of kNR
// floats; the last panel is zero-padded.
torch::Tensor tiled_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "w must be [N, K] float32");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = (n + kNR - 1) / kNR;
  auto padded = torch::zeros({panels * kNR, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({panels, kNR, k}).transpose(1, 2).contiguous();
}

namespace {

// Epilogues: what becomes of a finished panel (the kNR sums of each of `rows` rows, in c)
// from row m0 on. A panel's sums are complete before the epilogue sees them, so it changes
// no bit of the GEMM itself.

// The panel's columns (a short last panel: the first ones), plus bias, into o [M, n].
struct PlainOut {
  float* o;
  int64_t n;
  const float* bias;  // [n] or null
  void operator()(const float* c, int64_t m0, int64_t rows, int64_t p) const {
    const int64_t n0 = p * kNR, cols = std::min(kNR, n - n0);
    for (int64_t r = 0; r < rows; ++r) {
      float* orow = o + (m0 + r) * n + n0;
      const float* crow = c + r * kNR;
      for (int64_t j = 0; j < cols; ++j)
        orow[j] = bias == nullptr ? crow[j] : crow[j] + bias[n0 + j];
    }
  }
};

// A gated panel (tiled_pack_gated: kVec gate columns, then the kVec up columns of the same
// outputs), plus bias, -> silu(gate) * up into o [M, half]: the arithmetic of tiled_linear
// followed by silu_and_mul, without the [M, 2 * half] intermediate.
struct GatedOut {
  float* o;
  int64_t half;
  const float* bias;  // [2 * half] in the weight's own order (gate, then up), or null
  void operator()(const float* c, int64_t m0, int64_t rows, int64_t p) const {
    const int64_t j0 = p * kVec;
    for (int64_t r = 0; r < rows; ++r) {
      const float* crow = c + r * kNR;
      vfloat g = load(crow), u = load(crow + kVec);
      if (bias != nullptr) {
        g = g + load(bias + j0);
        u = u + load(bias + half + j0);
      }
      store(o + (m0 + r) * half + j0, silu(g) * u);
    }
  }
};

// a [M, K] (rows lda apart) times the packed weight (`panels` panels of K rows), each
// finished panel handed to `out`.
template <typename Out>
void run_tiled(const float* a, int64_t m, int64_t k, int64_t lda, const float* w,
               int64_t panels, const Out& out) {
  const int64_t kc_max = std::min(k, kMaxKC);
  // Equal chunks of whole tiles (gemm_chunks.h). A decode step's GEMMs on an AMX Xeon,
  // against 128 rows and a remainder: 1.6-1.8x at 136 rows, 1.2x at 200, 1.13-1.16x at 300,
  // level at 240, 256 and 2048.
  const RowChunks split = even_row_chunks(m, kMC, kMR);
  const int64_t chunk_rows = split.rows, chunks = split.count;
  // With one or two row chunks (decode batches) each thread reads the weight once, from
  // memory, and paces its prefetch over a panel's tiles; with more (prefill) the weight is
  // read again per chunk, from cache, and a burst in the first tile is faster.
  // Measured on an AMX Xeon, a decode step's GEMMs: paced 1.09-1.16x at 64 rows, level at
  // 128-256; at 2048 rows the burst 1.05-1.13x faster (docs/backends/cpu.md, "Paced
  // prefetch").
  const bool paced = chunks <= 2;
  // Work items are (row chunk, panel), chunk-major: a thread takes a run of panels and
  // streams them in order, which is what the prefetch of "the next one" relies on.
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(static_cast<size_t>(std::min(m, chunk_rows) * kNR));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / panels, p = item % panels;
      const int64_t m0 = chunk * chunk_rows, rows = std::min(chunk_rows, m - m0);
      const float* panel = w + p * k * kNR;
      for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
        const int64_t kc = std::min(kc_max, k - k0);
        // The block this thread reads next: the panel's next K block, or the first K block
        // of its next item's panel.
        const float* next = nullptr;
        int64_t next_rows = 0;
        if (k0 + kc < k) {
          next = panel + (k0 + kc) * kNR;
          next_rows = std::min(kc_max, k - k0 - kc);
        } else if (item + 1 < end) {
          next = w + ((item + 1) % panels) * k * kNR;
          next_rows = kc_max;
        }
        const int64_t lines = next_rows * kNR * 4 / 64;
        // Paced at one line a K step at most: a chunk of one tile prefetches in a burst.
        if (paced && lines <= kc * ((rows + kMR - 1) / kMR))
          rows_block<Prefetch::kPaced>(rows, a + m0 * lda + k0, lda, panel + k0 * kNR, kc,
                                       c.data(), k0 == 0, next, lines);
        else
          rows_block<Prefetch::kBurst>(rows, a + m0 * lda + k0, lda, panel + k0 * kNR, kc,
                                       c.data(), k0 == 0, next, lines);
      }
      out(c.data(), m0, rows, p);
    }
  });
}

// x as run_tiled reads it: fp32 [M, K], rows contiguous (a strided row view is kept).
torch::Tensor rows_of(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "x and packed must be on the CPU");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat &&
                  packed.size(2) == kNR && packed.size(1) == x.size(1) && packed.is_contiguous(),
              "packed must be tiled_pack's output for K = x.size(1)");
  TORCH_CHECK(x.size(1) > 0, "K must be positive");
  return x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
}

// bias as an fp32 [count] tensor (empty: none); `what` names count in the error.
torch::Tensor bias_of(const c10::optional<torch::Tensor>& bias, int64_t count,
                      const char* what) {
  if (!bias.has_value() || !bias->defined()) return torch::Tensor();
  TORCH_CHECK(bias->device().is_cpu(), "bias must be on the CPU");
  auto bc = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(bc.numel() == count, "bias must have ", what, " elements (", count, "), got ",
              bc.numel());
  return bc;
}

}  // namespace

// x [M, K] fp32 (rows contiguous) times the packed weight of an [N, K] linear, plus bias
// (fp32 [N], optional, added to the finished sum) -> [M, N] fp32.
torch::Tensor tiled_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                           c10::optional<torch::Tensor> bias) {
  const auto xc = rows_of(x, packed);
  const int64_t panels = packed.size(0);
  TORCH_CHECK(n > (panels - 1) * kNR && n <= panels * kNR, "n does not match packed");
  const auto bc = bias_of(bias, n, "n");
  auto out = torch::empty({xc.size(0), n},
                         x.options().memory_format(at::MemoryFormat::Contiguous));
  if (xc.size(0) == 0) return out;
  run_tiled(xc.data_ptr<float>(), xc.size(0), xc.size(1), xc.stride(0),
            packed.data_ptr<float>(), panels,
            PlainOut{out.data_ptr<float>(), n, bc.defined() ? bc.data_ptr<float>() : nullptr});
  return out;
}

// w [2 * h, K] fp32, the gate rows then the up rows of a gated MLP, h a multiple of the
// vector width -> tiled_pack of its rows reordered so that every panel holds kVec gate
// columns and the kVec up columns of the same outputs (tiled_linear_gated's layout).
torch::Tensor tiled_pack_gated(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(0) % 2 == 0,
              "w must be [2 * h, K] float32 (gate rows, then up rows)");
  const int64_t h = w.size(0) / 2;
  TORCH_CHECK(h % kVec == 0, "the gated layout needs h (", h, ") to be a multiple of ", kVec);
  const int64_t k = w.size(1);
  return tiled_pack(
      w.contiguous().view({2, h / kVec, kVec, k}).transpose(0, 1).reshape({2 * h, k}));
}

// silu(x @ gate.T + bias_gate) * (x @ up.T + bias_up) -> [M, h] on tiled_pack_gated's
// weight: the bits of tiled_linear then silu_and_mul on the same weight. The packed tensor
// does not say which packing made it: a tiled_pack weight of the same shape runs, wrongly,
// so the caller (gated.py) keeps the two apart.
torch::Tensor tiled_linear_gated(torch::Tensor x, torch::Tensor packed, int64_t h,
                                 c10::optional<torch::Tensor> bias) {
  const auto xc = rows_of(x, packed);
  const int64_t panels = packed.size(0);
  TORCH_CHECK(h % kVec == 0 && panels * kVec == h, "h does not match the gated packed weight");
  const auto bc = bias_of(bias, 2 * h, "2 * h");
  auto out = torch::empty({xc.size(0), h},
                         x.options().memory_format(at::MemoryFormat::Contiguous));
  if (xc.size(0) == 0) return out;
  run_tiled(xc.data_ptr<float>(), xc.size(0), xc.size(1), xc.stride(0),
            packed.data_ptr<float>(), panels,
            GatedOut{out.data_ptr<float>(), h, bc.defined() ? bc.data_ptr<float>() : nullptr});
  return out;
}
