// Fused elementwise ops of the decoder layer for the CPU backend: RMSNorm (alone and with the
// residual add before it), SiLU-and-mul, rotary embeddings and the K/V cache write. In torch
// each is several ops, each a full pass over memory; at a prefill of thousands of tokens
// those passes cost as much as a third of the GEMM time (measured on the default model).
// One pass each here, rows in parallel.
//
// Every op computes a row from that row alone, so outputs never depend on the batch. bf16
// tensors are rounded where the torch code in cadence.layers rounds them, so the two paths
// agree to the last bit or nearly (the sums' order differs).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "vec.h"

namespace {

using namespace cadence_cpu;

// out = w * (x / rms), the product x / rms rounded to T before the weight as RMSNorm does;
// ss is the row's sum of squares. out may alias x.
template <typename T>
inline void normalize_row(const T* x, const T* w, T* out, int64_t n, float ss, float eps) {
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    const vfloat y = round_to(load(x + i) * inv, x);
    store(out + i, load(w + i) * y);
  }
  for (; i < n; ++i) {
    const float y = static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * inv));
    out[i] = static_cast<T>(static_cast<float>(w[i]) * y);
  }
}

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* out, int64_t rows, int64_t n,
                   float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* orow = out + r * n;
      vfloat acc = vfloat{};
      int64_t i = 0;
      for (; i + kVec <= n; i += kVec) {
        const vfloat v = load(xr + i);
        acc += v * v;
      }
      float ss = hsum(acc);
      for (; i < n; ++i) {
        const float v = static_cast<float>(xr[i]);
        ss += v * v;
      }
      normalize_row(xr, w, orow, n, ss, eps);
    }
  });
}

// res <- x + res (rounded to T, as torch's add), then x <- rms_norm(res) * w: the decoder's
// residual add and the next norm in one pass over each row, both in place.
template <typename T>
void add_rms_norm_rows(T* x, T* res, const T* w, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * n;
      T* rr = res + r * n;
      vfloat acc = vfloat{};
      int64_t i = 0;
      for (; i + kVec <= n; i += kVec) {
        const vfloat v = round_to(load(xr + i) + load(rr + i), xr);
        store(rr + i, v);
        acc += v * v;
      }
      float ss = hsum(acc);
      for (; i < n; ++i) {
        const T v = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        rr[i] = v;
        ss += static_cast<float>(v) * static_cast<float>(v);
      }
      normalize_row(rr, w, xr, n, ss, eps);
    }
  });
}

template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * n;
      const T* up = gate + n;
      T* o = out + r * n;
      int64_t i = 0;
      for (; i + kVec <= n; i += kVec) {
        const vfloat g = load(gate + i);
        const vfloat act = round_to(silu(g), gate);
        store(o + i, act * load(up + i));
      }
      for (; i < n; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float act = static_cast<float>(static_cast<T>(g / (1.0f + std::exp(-g))));
        o[i] = static_cast<T>(act * static_cast<float>(up[i]));
      }
    }
  });
}

// NeoX-style rotation (HF's rotate_half) of x [T, heads, D] in place, token t with the
// cos/sin rows cos[t], sin[t] ([T, D], both halves equal as in the tables).
template <typename T>
void rotary_rows(T* x, int64_t t_stride, int64_t h_stride, int64_t tokens, int64_t heads,
                 int64_t d, const T* cos, const T* sin) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * d;
      const T* s = sin + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* xr = x + t * t_stride + h * h_stride;
        int64_t i = 0;
        for (; i + kVec <= half; i += kVec) {
          const vfloat x1 = load(xr + i), x2 = load(xr + half + i);
          const vfloat c1 = load(c + i), s1 = load(s + i);
          const vfloat c2 = load(c + half + i), s2 = load(s + half + i);
          // x * cos + rotate_half(x) * sin, each product rounded as torch rounds it.
          const vfloat o1 = round_to(x1 * c1, xr) + round_to(-x2 * s1, xr);
          const vfloat o2 = round_to(x2 * c2, xr) + round_to(x1 * s2, xr);
          store(xr + i, o1);
          store(xr + half + i, o2);
        }
        for (; i < half; ++i) {
          const float x1 = static_cast<float>(xr[i]), x2 = static_cast<float>(xr[half + i]);
          const float a = static_cast<float>(static_cast<T>(x1 * static_cast<float>(c[i])));
          const float b = static_cast<float>(static_cast<T>(-x2 * static_cast<float>(s[i])));
          const float e = static_cast<float>(static_cast<T>(x2 * static_cast<float>(c[half + i])));
          const float f = static_cast<float>(static_cast<T>(x1 * static_cast<float>(s[half + i])));
          xr[i] = static_cast<T>(a + b);
          xr[half + i] = static_cast<T>(e + f);
        }
      }
    }
  });
}

template <typename F>
void dispatch(const torch::Tensor& t, const char* what, F&& f) {
  if (t.scalar_type() == at::kFloat)
    f(static_cast<float*>(nullptr));
  else if (t.scalar_type() == at::kBFloat16)
    f(static_cast<c10::BFloat16*>(nullptr));
  else
    TORCH_CHECK(false, what, ": only float32 and bfloat16 are supported");
}

}  // namespace

// x [..., n] with a contiguous last dimension; returns a new contiguous tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  const int64_t n = x.size(-1);
  auto x2 = x.reshape({-1, n});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const auto w = weight.contiguous();
  auto out = torch::empty({x2.size(0), n}, x.options());
  dispatch(x, "rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(x2.data_ptr<T>(), x2.stride(0), w.data_ptr<T>(), out.data_ptr<T>(),
                     x2.size(0), n, static_cast<float>(eps));
  });
  return out.view(x.sizes());
}

// x, residual [T, n], contiguous, same dtype: residual <- x + residual, x <- rms_norm(residual),
// in place.
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(),
              "add_rms_norm: x and residual must both be [T, n]");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous(),
              "add_rms_norm: x and residual must be contiguous");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() &&
                  x.scalar_type() == weight.scalar_type(),
              "add_rms_norm: x, residual and weight dtypes differ");
  const auto w = weight.contiguous();
  TORCH_CHECK(w.numel() == x.size(1), "add_rms_norm: weight must have n elements");
  dispatch(x, "add_rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    add_rms_norm_rows<T>(x.data_ptr<T>(), residual.data_ptr<T>(), w.data_ptr<T>(), x.size(0),
                         x.size(1), static_cast<float>(eps));
  });
}

// Writes this step's k, v [T, KVH, D] (any token/head strides, contiguous D) into the flat
// slot caches [num_slots, KVH, D] at slots [T] (int64): the two index_copy_ calls of the
// torch path in one pass, without their per-call dispatch (~40 us each at decode sizes).
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 3 &&
                  v_cache.sizes() == k_cache.sizes() && k.size(1) == k_cache.size(1) &&
                  k.size(2) == k_cache.size(2),
              "write_kv: k, v must be [T, KVH, D] and the caches [num_slots, KVH, D]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "write_kv: k, v and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "write_kv: the caches must be contiguous");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "write_kv: head_dim must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(0),
              "write_kv: slots must be int64 [T]");
  const auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t T = k.size(0), kvh = k.size(1), d = k.size(2), num_slots = k_cache.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "write_kv: slot ", sp[t],
                " is outside the cache (", num_slots, " slots)");
  const int64_t row_bytes = d * static_cast<int64_t>(k.element_size());
  auto copy = [&](const torch::Tensor& src, torch::Tensor& dst) {
    const char* s0 = static_cast<const char*>(src.data_ptr());
    char* d0 = static_cast<char*>(dst.data_ptr());
    const int64_t es = src.element_size();
    const int64_t ts = src.stride(0) * es, hs = src.stride(1) * es;
    at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        char* drow = d0 + sp[t] * kvh * row_bytes;
        for (int64_t h = 0; h < kvh; ++h)
          std::memcpy(drow + h * row_bytes, s0 + t * ts + h * hs, row_bytes);
      }
    });
  };
  copy(k, k_cache);
  copy(v, v_cache);
}

// x [T, 2 * n] (gate, up) -> silu(gate) * up [T, n].
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2 * n]");
  const auto xc = x.contiguous();
  const int64_t n = x.size(1) / 2;
  auto out = torch::empty({x.size(0), n}, x.options());
  dispatch(x, "silu_and_mul", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_and_mul_rows<T>(xc.data_ptr<T>(), out.data_ptr<T>(), x.size(0), n);
  });
  return out;
}

// Rotates q [T, H, D] and k [T, KVH, D] in place (strided token/head dims, contiguous D)
// with cos, sin [T, D] (or [T, 1, D]).
void rotary_inplace(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "rotary: q and k must be [T, heads, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "rotary: head_dim must be contiguous");
  TORCH_CHECK(q.scalar_type() == cos.scalar_type() && k.scalar_type() == cos.scalar_type(),
              "rotary: q, k and the tables must share a dtype");
  const int64_t d = q.size(2);
  TORCH_CHECK(d % 2 == 0, "rotary: head_dim must be even");
  const auto c = cos.reshape({-1, d}).contiguous();
  const auto s = sin.reshape({-1, d}).contiguous();
  TORCH_CHECK(c.size(0) == q.size(0), "rotary: one cos/sin row per token");
  dispatch(q, "rotary", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rotary_rows<T>(q.data_ptr<T>(), q.stride(0), q.stride(1), q.size(0), q.size(1), d,
                   c.data_ptr<T>(), s.data_ptr<T>());
    rotary_rows<T>(k.data_ptr<T>(), k.stride(0), k.stride(1), k.size(0), k.size(1), d,
                   c.data_ptr<T>(), s.data_ptr<T>());
  });
}
