// Python binding of FlashMLA's SM90 sparse prefill kernel (deepseek-ai/FlashMLA, csrc/sm90/prefill/sparse),
// built from FlashMLA's own sources by benchmarks/flashmla/build.py, for side-by-side benchmarks only.
// The call matches FlashMLA's last Hopper release (commit ba89a346): flash_mla_sparse_fwd(q, kv, indices,
// sm_scale, d_v, attn_sink, topk_length, out) -> (out, max_logits, lse), out optional.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "params.h"
#include "sm90/prefill/sparse/fwd.h"

namespace {

int as_int(int64_t v, const char* what) {
    TORCH_CHECK(v >= 0 && v <= INT32_MAX, what, " does not fit an int32: ", v);
    return static_cast<int>(v);
}

std::vector<at::Tensor> sparse_prefill_fwd(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices,
                                           double sm_scale, int64_t d_v, const c10::optional<at::Tensor>& attn_sink,
                                           const c10::optional<at::Tensor>& topk_length,
                                           const c10::optional<at::Tensor>& out_opt) {
    TORCH_CHECK(q.dim() == 3 && kv.dim() == 3 && indices.dim() == 3, "q, kv, indices must be 3-D");
    TORCH_CHECK(q.is_cuda() && kv.is_cuda() && indices.is_cuda(), "CUDA tensors only");
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16, "bf16 q / kv only");
    TORCH_CHECK(indices.scalar_type() == at::kInt, "int32 indices only");
    const int s_q = q.size(0), h_q = q.size(1), d_qk = q.size(2);
    const int s_kv = kv.size(0), h_kv = kv.size(1), topk = indices.size(2);
    TORCH_CHECK(h_q == 64 || h_q == 128, "FlashMLA's SM90 sparse prefill takes h_q 64 or 128, got ", h_q);
    TORCH_CHECK(d_qk == 512 || d_qk == 576, "d_qk 512 or 576, got ", d_qk);
    TORCH_CHECK(d_v == 512, "d_v 512 only");
    TORCH_CHECK(kv.size(2) == d_qk && indices.size(0) == s_q && indices.size(1) == h_kv, "shape mismatch");
    TORCH_CHECK(q.stride(2) == 1 && kv.stride(2) == 1 && indices.stride(2) == 1, "last dims must be contiguous");
    if (attn_sink.has_value()) {
        TORCH_CHECK(attn_sink->scalar_type() == at::kFloat && attn_sink->numel() == h_q && attn_sink->is_contiguous(),
                    "attn_sink [h_q] float32 contiguous");
    }
    if (topk_length.has_value()) {
        TORCH_CHECK(topk_length->scalar_type() == at::kInt && topk_length->numel() == s_q &&
                    topk_length->is_contiguous(), "topk_length [s_q] int32 contiguous");
    }
    at::cuda::CUDAGuard guard{q.device()};
    auto opts = q.options();
    at::Tensor out = out_opt.has_value() ? *out_opt : at::empty({s_q, h_q, d_v}, opts);
    TORCH_CHECK(out.is_contiguous() && out.size(0) == s_q && out.size(1) == h_q && out.size(2) == d_v &&
                out.scalar_type() == at::kBFloat16, "out must be a contiguous bf16 [s_q, h_q, d_v]");
    at::Tensor lse = at::empty({s_q, h_q}, opts.dtype(at::kFloat));
    at::Tensor max_logits = at::empty({s_q, h_q}, opts.dtype(at::kFloat));
    const float scale = static_cast<float>(sm_scale);
    SparseAttnFwdParams p = {
        s_q, s_kv, h_q, h_kv, d_qk, static_cast<int>(d_v), topk,
        scale, scale * 1.44269504f,
        reinterpret_cast<cutlass::bfloat16_t*>(q.data_ptr()),
        reinterpret_cast<cutlass::bfloat16_t*>(kv.data_ptr()),
        indices.data_ptr<int>(),
        attn_sink.has_value() ? attn_sink->data_ptr<float>() : nullptr,
        topk_length.has_value() ? topk_length->data_ptr<int>() : nullptr,
        as_int(q.stride(0), "q.stride(0)"), as_int(q.stride(1), "q.stride(1)"),
        as_int(kv.stride(0), "kv.stride(0)"), as_int(kv.stride(1), "kv.stride(1)"),
        as_int(indices.stride(0), "indices.stride(0)"), as_int(indices.stride(1), "indices.stride(1)"),
        reinterpret_cast<cutlass::bfloat16_t*>(out.data_ptr()),
        max_logits.data_ptr<float>(),
        lse.data_ptr<float>(),
        at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
        at::cuda::getCurrentCUDAStream().stream(),
    };
    sm90::run_fwd_kernel(p);
    return {out, max_logits, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA's SM90 sparse prefill (benchmark baseline; built by benchmarks/flashmla/build.py)";
    m.def("sparse_prefill_fwd", &sparse_prefill_fwd, "FlashMLA SM90 sparse prefill", py::arg("q"), py::arg("kv"),
          py::arg("indices"), py::arg("sm_scale"), py::arg("d_v") = 512, py::arg("attn_sink") = py::none(),
          py::arg("topk_length") = py::none(), py::arg("out") = py::none());
}
