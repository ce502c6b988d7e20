// The register-tiled fp32 GEMM's machinery, shared by the kernels that feed it panels: fp32
// weights packed once at load (tiled_linear.cpp) and weights kept compressed in memory and
// expanded a block at a time into fp32 (quant_linear.cpp). Whatever the source, the tiles see
// the same fp32 block and run the same FMA chains, so the two give the same bits on the same
// values (see tiled_linear.cpp's NOTE on batch invariance).
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemm_chunks.h"
#include "vec.h"

namespace cadence_cpu {
namespace tiled {

constexpr int64_t kNR = 2 * kVec;  // columns per panel: two vectors
// Rows per register tile (2 x kMR accumulators). With AVX-512's 32 registers, 12 rows: each
// panel row loaded serves twice the FMAs, and the panel is read from cache half as often.
// Measured on an AMX Xeon (AVX-512), a decode step's 121 GEMMs against 6 rows: 1.07x at 64
// rows, 1.11x at 16, 1.06x at 256, 1.12x at 2048; 14 rows was slower than 12.
constexpr int kMR = kVec >= 16 ? 12 : 6;
constexpr int64_t kMaxKC = 1536;   // a panel's K block: at most 96 KiB on AVX2, 192 on AVX-512
constexpr int64_t kMC = 128;       // most rows per chunk, before the even split
constexpr int64_t kPacedTiles = 6;  // most tiles of a chunk that paces its prefetch

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
inline void rows_block(int64_t rows, const float* a, int64_t lda, const float* b, int64_t kc,
                       float* c, bool first, const char* next, int64_t lines) {
  const int64_t tiles = (rows + kMR - 1) / kMR;
  const int64_t per_tile = P == Prefetch::kPaced ? (lines + tiles - 1) / tiles : lines;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t l0 = std::min(lines, t * per_tile), l1 = std::min(lines, l0 + per_tile);
    Ahead ahead;
    if (next != nullptr && l1 > l0) {
      ahead.at = next + l0 * 64;
      ahead.lines = l1 - l0;
      ahead.every = std::max<int64_t>(1, kc / ahead.lines);  // run_tiled: lines <= kc
    }
    tile_rows_upto<kMR, P>(static_cast<int>(std::min<int64_t>(kMR, rows - t * kMR)),
                           a + t * kMR * lda, lda, b, kc, c + t * kMR * kNR, first, ahead);
  }
}


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

// An fp32 weight packed in panels (tiled_pack): a block is read where it lies.
struct FloatPanels {
  const float* w;
  int64_t k;
  static constexpr bool kBuffered = false;
  static constexpr int64_t kMaxKC = tiled::kMaxKC;  // K rows per block
  static constexpr int64_t kRowBytes = kNR * 4;  // bytes per K row of a panel, as stored
  const char* raw(int64_t p, int64_t k0) const {
    return reinterpret_cast<const char*>(w + (p * k + k0) * kNR);
  }
  const float* block(int64_t p, int64_t k0, int64_t, float*) const {
    return w + (p * k + k0) * kNR;
  }
  bool direct(int64_t, const float*, int64_t, int64_t, int64_t, int64_t, float*, bool) const {
    return false;
  }
};

// a [M, K] (rows lda apart) times the `panels` panels of a weight, each finished panel handed
// to `out`. `src` gives a panel's K block as fp32 [kc, kNR] (a pointer into the weight, or a
// thread's buffer it filled: Src::kBuffered) and the address and bytes per K row of its
// storage, which the prefetch streams.
template <typename Src, typename Out>
void run_tiled(const float* a, int64_t m, int64_t k, int64_t lda, const Src& src,
               int64_t panels, const Out& out) {
  const int64_t kc_max = std::min(k, Src::kMaxKC);
  // Equal chunks of whole tiles (gemm_chunks.h). A decode step's GEMMs on an AMX Xeon,
  // against 128 rows and a remainder: 1.6-1.8x at 136 rows, 1.2x at 200, 1.13-1.16x at 300,
  // level at 240, 256 and 2048.
  const RowChunks split = even_row_chunks(m, kMC, kMR);
  const int64_t chunk_rows = split.rows, chunks = split.count;
  // With one row chunk of few tiles (a small decode batch) each thread reads its share of
  // the panels once, from memory, with little compute per panel to hide it behind, and
  // paces its prefetch over the panel's tiles. With more tiles the burst in the first tile
  // has the rest of the panel's work to land behind; with more chunks both threads read
  // every panel (a thread's run of items is a chunk's whole row of panels), the second read
  // mostly from cache. Measured, a decode step's GEMMs (docs/backends/cpu.md, "Paced
  // prefetch"): paced 1.09-1.16x at 64 rows (6 tiles) on an AMX Xeon, level at 128-256;
  // on an AVX2 Zen 3 paced 1.2x at 16 rows (3 tiles), the burst 1.16x at 64 rows (11),
  // 1.4-1.5x at 96-128 and 1.15-1.35x at 136-256; at 2048 rows the burst 1.05-1.13x.
  const bool paced = chunks == 1 && (chunk_rows + kMR - 1) / kMR <= kPacedTiles;
  // Work items are (row chunk, panel), chunk-major: a thread takes a run of panels and
  // streams them in order, which is what the prefetch of "the next one" relies on.
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(static_cast<size_t>(std::min(m, chunk_rows) * kNR));
    std::vector<float> buf(Src::kBuffered ? static_cast<size_t>(kc_max * kNR) : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / panels, p = item % panels;
      const int64_t m0 = chunk * chunk_rows, rows = std::min(chunk_rows, m - m0);
      for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
        const int64_t kc = std::min(kc_max, k - k0);
        // The block this thread reads next: the panel's next K block, or the first K block
        // of its next item's panel.
        const char* next = nullptr;
        int64_t next_rows = 0;
        if (k0 + kc < k) {
          next = src.raw(p, k0 + kc);
          next_rows = std::min(kc_max, k - k0 - kc);
        } else if (item + 1 < end) {
          next = src.raw((item + 1) % panels, 0);
          next_rows = kc_max;
        }
        const int64_t lines = next_rows * Src::kRowBytes / 64;
        // A source may multiply a chunk of few rows itself (QuantPanels: from the compressed
        // block, without expanding it into memory first).
        if (src.direct(rows, a + m0 * lda + k0, lda, p, k0, kc, c.data(), k0 == 0)) continue;
        const float* b = src.block(p, k0, kc, buf.data());
        // Paced at one line a K step at most: a chunk of one tile prefetches in a burst.
        if (paced && lines <= kc * ((rows + kMR - 1) / kMR))
          rows_block<Prefetch::kPaced>(rows, a + m0 * lda + k0, lda, b, kc, c.data(), k0 == 0,
                                       next, lines);
        else
          rows_block<Prefetch::kBurst>(rows, a + m0 * lda + k0, lda, b, kc, c.data(), k0 == 0,
                                       next, lines);
      }
      out(c.data(), m0, rows, p);
    }
  });
}

// bias as an fp32 [count] tensor (empty: none); `what` names count in the error.
inline torch::Tensor bias_of(const c10::optional<torch::Tensor>& bias, int64_t count,
                      const char* what) {
  if (!bias.has_value() || !bias->defined()) return torch::Tensor();
  TORCH_CHECK(bias->device().is_cpu(), "bias must be on the CPU");
  auto bc = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(bc.numel() == count, "bias must have ", what, " elements (", count, "), got ",
              bc.numel());
  return bc;
}

}  // namespace tiled
}  // namespace cadence_cpu
