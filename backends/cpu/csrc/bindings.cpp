// The Python module of the CPU backend's kernels (backends/cpu/kernels.py builds it).
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale,
                                     int64_t sliding_window, double soft_cap);
void prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out,
                       torch::Tensor starts, torch::Tensor lens, double scale,
                       int64_t sliding_window, double soft_cap);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slots);
void rotary_inplace(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
torch::Tensor refine_top_logits(torch::Tensor logits, torch::Tensor hidden, torch::Tensor weight,
                                c10::optional<torch::Tensor> bias);
torch::Tensor draw_from_logits(torch::Tensor logits, torch::Tensor frac);
int64_t tiled_panel_width();
torch::Tensor tiled_pack(torch::Tensor w);
torch::Tensor tiled_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                           c10::optional<torch::Tensor> bias);
torch::Tensor tiled_pack_gated(torch::Tensor w);
torch::Tensor tiled_linear_gated(torch::Tensor x, torch::Tensor packed, int64_t h,
                                 c10::optional<torch::Tensor> bias);
std::vector<torch::Tensor> qtiled_pack(torch::Tensor q, torch::Tensor s,
                                       c10::optional<torch::Tensor> o);
std::vector<torch::Tensor> qtiled_pack_gated(torch::Tensor q, torch::Tensor s,
                                             c10::optional<torch::Tensor> o);
torch::Tensor qtiled_linear(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t n,
                            c10::optional<torch::Tensor> bias);
torch::Tensor qtiled_linear_gated(torch::Tensor x, std::vector<torch::Tensor> packed, int64_t h,
                                  c10::optional<torch::Tensor> bias);
bool brgemm_available();
torch::Tensor brgemm_pack(torch::Tensor w);
torch::Tensor brgemm_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                            c10::optional<torch::Tensor> bias);
bool amx_available();
torch::Tensor amx_pack(torch::Tensor w);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                         c10::optional<torch::Tensor> bias);
torch::Tensor amx_pack_gated(torch::Tensor w);
torch::Tensor amx_linear_gated(torch::Tensor x, torch::Tensor packed, int64_t h,
                               c10::optional<torch::Tensor> bias);
void lora_expand_add(torch::Tensor y, torch::Tensor t, torch::Tensor bt, torch::Tensor starts,
                     torch::Tensor widths, torch::Tensor order);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged KV cache, read in place", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("sliding_window") = 0, py::arg("soft_cap") = 0.0);
  m.def("prefill_attention", &prefill_attention,
        "causal attention of fresh prompts (no cached context), all prompts in one call",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("starts"),
        py::arg("lens"), py::arg("scale"), py::arg("sliding_window") = 0,
        py::arg("soft_cap") = 0.0);
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension");
  m.def("add_rms_norm", &add_rms_norm,
        "residual += x, then x = RMSNorm(residual), both in place");
  m.def("write_kv", &write_kv, "k, v rows into the flat slot caches at the given slots");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :n]) * x[:, n:]");
  m.def("rotary_inplace", &rotary_inplace, "NeoX-style rotary embedding of q and k, in place");
  m.def("refine_top_logits", &refine_top_logits,
        "bf16 logits to fp32, the entries tied at each row's maximum recomputed in fp32");
  m.def("draw_from_logits", &draw_from_logits,
        "per row, the token where the softmax CDF of fp32 logits first reaches frac of its "
        "total");
  m.def("tiled_panel_width", &tiled_panel_width, "columns per panel of tiled_pack's layout");
  m.def("tiled_pack", &tiled_pack, "an fp32 [N, K] weight packed in panels for tiled_linear");
  m.def("tiled_linear", &tiled_linear, "x @ w.T (+ bias) on a tiled_pack'ed fp32 weight",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("tiled_pack_gated", &tiled_pack_gated,
        "an fp32 [2 * h, K] gate-then-up weight packed for tiled_linear_gated");
  m.def("tiled_linear_gated", &tiled_linear_gated,
        "silu(x @ gate.T + b) * (x @ up.T + b) on a tiled_pack_gated weight", py::arg("x"),
        py::arg("packed"), py::arg("h"), py::arg("bias") = py::none());
  m.def("qtiled_pack", &qtiled_pack,
        "an int8 [N, K] weight with fp32 group scales (and offsets) packed for qtiled_linear",
        py::arg("q"), py::arg("s"), py::arg("o") = py::none());
  m.def("qtiled_pack_gated", &qtiled_pack_gated,
        "the same for a [2 * h, K] gate-then-up weight, for qtiled_linear_gated", py::arg("q"),
        py::arg("s"), py::arg("o") = py::none());
  m.def("qtiled_linear", &qtiled_linear,
        "x @ (s * q + o).T (+ bias) on a qtiled_pack'ed weight: tiled_linear's bits",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("qtiled_linear_gated", &qtiled_linear_gated,
        "silu(x @ gate.T + b) * (x @ up.T + b) on a qtiled_pack_gated weight", py::arg("x"),
        py::arg("packed"), py::arg("h"), py::arg("bias") = py::none());
  m.def("brgemm_available", &brgemm_available,
        "whether ATen's bf16 micro-kernel runs on this CPU (it needs AMX)");
  m.def("brgemm_pack", &brgemm_pack, "a bf16 [N, K] weight packed for brgemm_linear");
  m.def("brgemm_linear", &brgemm_linear, "x @ w.T (+ bias) on a brgemm_pack'ed weight",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("amx_available", &amx_available,
        "whether this CPU has AMX bf16 tiles and the kernel may use them");
  m.def("amx_pack", &amx_pack, "a bf16 [N, K] weight packed for amx_linear");
  m.def("amx_linear", &amx_linear, "x @ w.T (+ bias) on an amx_pack'ed weight, on AMX tiles",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("amx_pack_gated", &amx_pack_gated,
        "a bf16 [2 * h, K] gate-then-up weight packed for amx_linear_gated");
  m.def("amx_linear_gated", &amx_linear_gated,
        "silu(x @ gate.T + b) * (x @ up.T + b) on an amx_pack_gated weight", py::arg("x"),
        py::arg("packed"), py::arg("h"), py::arg("bias") = py::none());
  m.def("lora_expand_add", &lora_expand_add,
        "y[m] += t[m, s:s+w] @ bt[s:s+w] per row, in place (LoRA's expand); rows visited in "
        "order, those of one adapter four at a time");
}
