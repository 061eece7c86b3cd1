// Python binding of FlashMLA's SM90 sparse decode (deepseek-ai/FlashMLA 9241ae3: csrc/sm90/decode/sparse_fp8, with
// csrc/smxx/decode/get_decoding_sched_meta and csrc/smxx/decode/combine), built from FlashMLA's own sources by
// benchmarks/flashmla/build.py --decode as the extension flashmla_sm90_decode, for side-by-side benchmarks only
// (sparse_mla.bench.op_decode). Written for this repository; built on the H200 (CUDA 13.0, torch 2.11) and its
// outputs checked against sparse_mla.flash_mla_with_kvcache_ref there in a smoke run of the decode suite.
//
// sparse_decode_fwd(q, k_cache, indices, topk_length=None, attn_sink=None, tile_scheduler_metadata=None,
//                   num_splits=None, d_v=512, sm_scale=d_qk ** -0.5) -> [out, lse, tile_scheduler_metadata, num_splits]
// is FlashMLA's flash_mla_cuda.sparse_decode_fwd without the second cache: q [b, s_q, 64 | 128, 576] bf16, k_cache
// [num_blocks, page_block_size, 1, 656] FP8 bytes (the V3.2 layout; uint8 / int8 / float8_e4m3fn), indices [b, s_q,
// topk] int32 physical rows (block * page_block_size + offset; -1 = none), topk % 64 == 0; out [b, s_q, h_q, 512]
// bf16, lse [b, h_q, s_q] float32 (a transposed view, as FlashMLA returns it). The schedule metadata is computed when
// not given and returned, to be passed to later calls of the same shape and topk_length values (FlashMLA's lazy
// get_mla_metadata object).
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>

#include "params.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace {

constexpr int kV32RowBytes = 512 + 4 * 4 + 64 * 2;  // 512 fp8 kv_c, 4 fp32 scales, 64 bf16 k_pe
constexpr int kBlockSizeTopk = 64;                   // Decode_Sm90_Impl::get_meta
constexpr int kFixedOverheadBlocks = 5;              // Decode_Sm90_Impl::get_meta
constexpr int kMaxSmParts = 160;                     // the combine kernel's largest split table
constexpr float kLog2e = 1.44269504f;

int as_int(int64_t v, const char* what) {
    TORCH_CHECK(v >= 0 && v <= INT32_MAX, what, " does not fit an int32: ", v);
    return static_cast<int>(v);
}

std::vector<at::Tensor> sparse_decode_fwd(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& indices,
                                          const c10::optional<at::Tensor>& topk_length,
                                          const c10::optional<at::Tensor>& attn_sink,
                                          c10::optional<at::Tensor> tile_scheduler_metadata,
                                          c10::optional<at::Tensor> num_splits, int64_t d_v,
                                          c10::optional<double> sm_scale) {
    TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && indices.dim() == 3,
                "q [b, s_q, h_q, d_qk], k_cache [num_blocks, page_block_size, 1, 656], indices [b, s_q, topk]");
    TORCH_CHECK(q.is_cuda() && k_cache.is_cuda() && indices.is_cuda(), "CUDA tensors only");
    TORCH_CHECK(k_cache.device() == q.device() && indices.device() == q.device(), "tensors on q's device only");
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "bf16 q only");
    TORCH_CHECK(k_cache.scalar_type() == at::kByte || k_cache.scalar_type() == at::kChar ||
                k_cache.scalar_type() == at::kFloat8_e4m3fn, "k_cache must be FP8 bytes (uint8 / int8 / float8_e4m3fn)");
    TORCH_CHECK(indices.scalar_type() == at::kInt, "int32 indices only");
    const int b = as_int(q.size(0), "b"), s_q = as_int(q.size(1), "s_q"), h_q = as_int(q.size(2), "h_q");
    const int d_qk = as_int(q.size(3), "d_qk");
    const int num_blocks = as_int(k_cache.size(0), "num_blocks"), page_block_size = as_int(k_cache.size(1), "page");
    const int topk = as_int(indices.size(2), "topk");
    TORCH_CHECK(b > 0 && s_q > 0 && topk > 0, "b, s_q, topk must be > 0");
    TORCH_CHECK(h_q == 64 || h_q == 128, "FlashMLA's SM90 sparse decode takes h_q 64 or 128, got ", h_q);
    TORCH_CHECK(d_qk == 576, "this binding serves the V3.2 layout only (d_qk 576, 656-byte rows), got d_qk ", d_qk);
    TORCH_CHECK(d_v == 512, "d_v 512 only");
    TORCH_CHECK(topk % kBlockSizeTopk == 0, "topk must be a multiple of 64, got ", topk);
    TORCH_CHECK(k_cache.size(2) == 1 && k_cache.size(3) == kV32RowBytes, "k_cache rows must be [1, 656] bytes");
    TORCH_CHECK(k_cache.stride(1) == kV32RowBytes, "k_cache: each block's rows must be contiguous (stride(1) == 656)");
    TORCH_CHECK(indices.size(0) == b && indices.size(1) == s_q, "indices must be [b, s_q, topk]");
    TORCH_CHECK(q.stride(3) == 1 && k_cache.stride(3) == 1 && indices.stride(2) == 1, "last dims must be contiguous");
    // FlashMLA's kernel asserts that the V3.2 layout takes no dynamic topk length on SM90.
    TORCH_CHECK(!topk_length.has_value(), "topk_length: FlashMLA's SM90 V3.2 decode does not take it");
    if (attn_sink.has_value()) {
        TORCH_CHECK(attn_sink->is_cuda() && attn_sink->scalar_type() == at::kFloat && attn_sink->numel() == h_q &&
                    attn_sink->is_contiguous(), "attn_sink must be [h_q] float32 contiguous on q's device");
    }
    const auto* prop = at::cuda::getCurrentDeviceProperties();
    TORCH_CHECK(prop->major == 9 && prop->minor == 0, "FlashMLA's SM90 sparse decode needs an sm_90 GPU");
    const int num_sm_parts = std::max(prop->multiProcessorCount / s_q / (h_q / 64), 1);
    TORCH_CHECK(num_sm_parts <= kMaxSmParts, "more schedule parts than the combine kernel takes: ", num_sm_parts);
    const int meta_ints = static_cast<int>(sizeof(DecodingSchedMeta) / sizeof(int));

    at::cuda::CUDAGuard guard{q.device()};
    const auto stream = at::cuda::getCurrentCUDAStream().stream();
    auto opts = q.options();
    TORCH_CHECK(tile_scheduler_metadata.has_value() == num_splits.has_value(),
                "pass tile_scheduler_metadata and num_splits together (both from an earlier call) or neither");
    if (!tile_scheduler_metadata.has_value()) {
        tile_scheduler_metadata = at::empty({num_sm_parts, meta_ints}, opts.dtype(at::kInt));
        num_splits = at::empty({b + 1}, opts.dtype(at::kInt));
        GetDecodeSchedMetaParams mp{};
        mp.b = b;
        mp.s_q = s_q;
        mp.block_size_n = kBlockSizeTopk;
        mp.fixed_overhead_num_blocks = kFixedOverheadBlocks;
        mp.topk = topk;
        mp.extra_topk = 0;
        mp.topk_length = nullptr;
        mp.extra_topk_length = nullptr;
        mp.seqlens_k_ptr = nullptr;
        mp.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta*>(tile_scheduler_metadata->data_ptr());
        mp.num_splits_ptr = num_splits->data_ptr<int>();
        mp.num_sm_parts = num_sm_parts;
        mp.stream = stream;
        smxx::decode::run_get_decoding_sched_meta_kernel(mp);
    }
    const at::Tensor& sched = *tile_scheduler_metadata;
    const at::Tensor& splits = *num_splits;
    TORCH_CHECK(sched.is_cuda() && sched.scalar_type() == at::kInt && sched.is_contiguous() &&
                sched.size(0) == num_sm_parts && sched.size(1) == meta_ints,
                "tile_scheduler_metadata must be the [num_sm_parts, 8] int32 an earlier call of this shape returned");
    TORCH_CHECK(splits.is_cuda() && splits.scalar_type() == at::kInt && splits.is_contiguous() &&
                splits.numel() == b + 1, "num_splits must be the [b + 1] int32 an earlier call of this shape returned");

    at::Tensor out = at::empty({b, s_q, h_q, d_v}, opts);
    at::Tensor lse = at::empty({b, s_q, h_q}, opts.dtype(at::kFloat));
    at::Tensor lse_accum = at::empty({b + num_sm_parts, s_q, h_q}, opts.dtype(at::kFloat));
    at::Tensor o_accum = at::empty({b + num_sm_parts, s_q, h_q, d_v}, opts.dtype(at::kFloat));
    const float scale = sm_scale.has_value() ? static_cast<float>(*sm_scale) : 1.0f / std::sqrt(static_cast<float>(d_qk));

    SparseAttnDecodeParams p{};
    p.b = b;
    p.s_q = s_q;
    p.h_q = h_q;
    p.h_kv = 1;
    p.d_qk = d_qk;
    p.d_v = static_cast<int>(d_v);
    p.sm_scale = scale;
    p.sm_scale_div_log2 = scale * kLog2e;  // FlashMLA's name for sm_scale * log2(e)
    p.num_blocks = num_blocks;
    p.page_block_size = page_block_size;
    p.topk = topk;
    p.model_type = ModelType::V32;
    p.q = reinterpret_cast<cutlass::bfloat16_t*>(q.data_ptr());
    p.kv = reinterpret_cast<cutlass::bfloat16_t*>(k_cache.data_ptr());  // bytes, addressed by byte strides
    p.indices = indices.data_ptr<int>();
    p.topk_length = nullptr;
    p.attn_sink = attn_sink.has_value() ? attn_sink->data_ptr<float>() : nullptr;
    p.lse = lse.data_ptr<float>();
    p.out = reinterpret_cast<cutlass::bfloat16_t*>(out.data_ptr());
    p.extra_num_blocks = 0;
    p.extra_page_block_size = 0;
    p.extra_topk = 0;
    p.extra_kv = nullptr;
    p.extra_indices = nullptr;
    p.extra_topk_length = nullptr;
    p.stride_q_b = as_int(q.stride(0), "q.stride(0)");
    p.stride_q_s_q = as_int(q.stride(1), "q.stride(1)");
    p.stride_q_h_q = as_int(q.stride(2), "q.stride(2)");
    p.stride_kv_block = as_int(k_cache.stride(0), "k_cache.stride(0)");
    p.stride_kv_row = as_int(k_cache.stride(1), "k_cache.stride(1)");
    p.stride_indices_b = as_int(indices.stride(0), "indices.stride(0)");
    p.stride_indices_s_q = as_int(indices.stride(1), "indices.stride(1)");
    p.stride_lse_b = as_int(lse.stride(0), "lse.stride(0)");
    p.stride_lse_s_q = as_int(lse.stride(1), "lse.stride(1)");
    p.stride_o_b = as_int(out.stride(0), "out.stride(0)");
    p.stride_o_s_q = as_int(out.stride(1), "out.stride(1)");
    p.stride_o_h_q = as_int(out.stride(2), "out.stride(2)");
    p.stride_extra_kv_block = 0;
    p.stride_extra_kv_row = 0;
    p.stride_extra_indices_b = 0;
    p.stride_extra_indices_s_q = 0;
    p.stream = stream;
    p.lse_accum = lse_accum.data_ptr<float>();
    p.o_accum = o_accum.data_ptr<float>();
    p.stride_lse_accum_split = as_int(lse_accum.stride(0), "lse_accum.stride(0)");
    p.stride_lse_accum_s_q = as_int(lse_accum.stride(1), "lse_accum.stride(1)");
    p.stride_o_accum_split = as_int(o_accum.stride(0), "o_accum.stride(0)");
    p.stride_o_accum_s_q = as_int(o_accum.stride(1), "o_accum.stride(1)");
    p.stride_o_accum_h_q = as_int(o_accum.stride(2), "o_accum.stride(2)");
    p.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta*>(sched.data_ptr());
    p.num_splits_ptr = splits.data_ptr<int>();
    p.num_sm_parts = num_sm_parts;

    if (h_q == 64) {
        sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, 64>(p);
    } else {
        sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, 128>(p);
    }

    CombineParams c{};
    c.b = b;
    c.s_q = s_q;
    c.h_q = h_q;
    c.d_v = p.d_v;
    c.lse = p.lse;
    c.out = p.out;
    c.stride_lse_b = p.stride_lse_b;
    c.stride_lse_s_q = p.stride_lse_s_q;
    c.stride_o_b = p.stride_o_b;
    c.stride_o_s_q = p.stride_o_s_q;
    c.stride_o_h_q = p.stride_o_h_q;
    c.lse_accum = p.lse_accum;
    c.o_accum = p.o_accum;
    c.stride_lse_accum_split = p.stride_lse_accum_split;
    c.stride_lse_accum_s_q = p.stride_lse_accum_s_q;
    c.stride_o_accum_split = p.stride_o_accum_split;
    c.stride_o_accum_s_q = p.stride_o_accum_s_q;
    c.stride_o_accum_h_q = p.stride_o_accum_h_q;
    c.tile_scheduler_metadata_ptr = p.tile_scheduler_metadata_ptr;
    c.num_splits_ptr = p.num_splits_ptr;
    c.num_sm_parts = num_sm_parts;
    c.attn_sink = p.attn_sink;
    c.stream = stream;
    smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(c);

    return {out, lse.transpose(1, 2), sched, splits};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA's SM90 sparse decode, FP8 V3.2 cache (benchmark baseline; benchmarks/flashmla/build.py --decode)";
    m.def("sparse_decode_fwd", &sparse_decode_fwd, "FlashMLA SM90 sparse decode (FP8 cache)", py::arg("q"),
          py::arg("k_cache"), py::arg("indices"), py::arg("topk_length") = py::none(), py::arg("attn_sink") = py::none(),
          py::arg("tile_scheduler_metadata") = py::none(), py::arg("num_splits") = py::none(), py::arg("d_v") = 512,
          py::arg("sm_scale") = py::none());
}
