// The Python module of the C++ CPU ops: each kernel file's entry points, declared here
// and bound by pybind11 with torch's type casters (torch/python.h, ~15 s to compile; not
// torch/extension.h, which adds torch's whole C++ API for ~10 s more). The kernel files
// include aten.h.
#include <torch/python.h>
#include <tuple>
#include <vector>

// ops.cpp: the W8A8 activation passes and decode attention read in place
std::tuple<at::Tensor, at::Tensor> quant_rows(const at::Tensor& x,
                                              const c10::optional<at::Tensor>& inv, bool u8);
at::Tensor dequant_rows(const at::Tensor& acc, const at::Tensor& sx, const at::Tensor& sw,
                        at::ScalarType dtype);
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, double scale);
at::Tensor slots_causal(const at::Tensor& q, const at::Tensor& kf, const at::Tensor& vf,
                        const at::Tensor& slots, double scale);
at::Tensor slots_decode(const at::Tensor& q, const at::Tensor& kf, const at::Tensor& vf,
                        const at::Tensor& slots, double scale);
// kv_copy.cpp: the KV wire's gather, scatter and checksum words
void kv_gather(const at::Tensor& kv, const std::vector<int64_t>& ids, int64_t l0,
               int64_t l1, py::buffer out);
void kv_scatter(at::Tensor& kv, const std::vector<int64_t>& ids, int64_t l0, int64_t l1,
                py::buffer payload);

// int4_gemv.cpp: the int4 weight's matmul at a few rows
bool int4_simd();
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& codes,
                     const at::Tensor& scale, const at::Tensor& zero);
at::Tensor int4_dequant(const at::Tensor& codes, const at::Tensor& scale,
                        const at::Tensor& zero, const c10::optional<at::Tensor>& into);
// fused.cpp: a decode step's small elementwise passes in one call each
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                bool interleaved);
at::Tensor silu_mul(const at::Tensor& x);
// int8_gemv.cpp: the int8 weight's (the LM head's) matmul at a few rows
bool int8_simd();
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);
bool float_simd();
at::Tensor float_gemv(const at::Tensor& x, const at::Tensor& w);
// batch_gemm.cpp: the int4 and int8 weights' matmuls at a decode batch's rows
bool batch_simd();
void set_batch_helper(bool on);
bool batch_helper_on();
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& codes,
                     const at::Tensor& scale, const at::Tensor& zero);
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_rows", &quant_rows, "int8 (or uint8 + 128) rows + float32 row scales",
        py::arg("x"), py::arg("inv") = py::none(), py::arg("u8") = false);
  m.def("paged_decode", &paged_decode, "decode attention over a paged cache, in place");
  m.def("slots_decode", &slots_decode, "one decode row over flat slots, in place");
  m.def("slots_causal", &slots_causal, "n rows, each as its own decode row, in place");
  m.def("dequant_rows", &dequant_rows, "int32 GEMM result * sx[m] * sw[n] -> dtype");
  m.def("kv_gather", &kv_gather, "pool blocks x layers -> a KV write's payload buffer");
  m.def("int4_simd", &int4_simd, "whether int4_gemv was built with AVX512-BF16");
  m.def("int4_gemv", &int4_gemv, "x @ w.T on gemv-packed int4 codes, bfloat16 scale and zero");
  m.def("int4_dequant", &int4_dequant, "gemv-packed int4 codes -> the bfloat16 weight",
        py::arg("codes"), py::arg("scale"), py::arg("zero"), py::arg("into") = py::none());
  m.def("int8_simd", &int8_simd, "whether int8_gemv was built with AVX-512");
  m.def("int8_gemv", &int8_gemv, "x @ w.T on an int8 weight with per-output scales");
  m.def("float_simd", &float_simd, "whether float_gemv was built (AVX2 and FMA)");
  m.def("float_gemv", &float_gemv, "x @ w.T on a float32 | bfloat16 weight, rows batch-invariant");
  m.def("batch_simd", &batch_simd, "whether batch_gemm.cpp was built with AVX512-BF16");
  m.def("set_batch_helper", &set_batch_helper, "int4_gemv/int8_gemv/int4_gemm/int8_gemm on a helper thread too");
  m.def("batch_helper_on", &batch_helper_on, "whether the matmuls use the helper thread now");
  m.def("int4_gemm", &int4_gemm, "x @ w.T on gemv-packed int4 codes, a decode batch's rows");
  m.def("int8_gemm", &int8_gemm, "x @ w.T on an int8 weight, a decode batch's rows");
  m.def("rms_norm", &rms_norm, "Model.rms_norm in one pass");
  m.def("rope", &rope, "Model.rope in one pass, the same bits");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of gate|up in one pass");
  m.def("kv_scatter", &kv_scatter, "a KV write's payload -> pool blocks x layers, in place");
}
