// Sorted top-k union of each group of G consecutive query rows (token-major groups), for the inspection API
// build_group_union: one CTA per group, a membership array over the group's row window in shared memory.
//
// Compiled at run time by NVRTC (sparse_mla/union/cuda_sorted.py, through CuPy); no #include. Semantics:
// sparse_mla/union/interface.py's build_group_union (the CPU-tested path: the Triton builder, then a sort).
//
// Group g holds queries t0 = g * G .. t0 + glen - 1 (glen = min(G, T - t0)). Entries: indices[t0 + q, k] for
// q < glen, k < min(max(topk_length[t0 + q], 0), K); valid: 0 <= row < num_kv_rows.
// Out: rows[g, :u] the distinct valid rows in ascending order, bits[g, :u] their membership words (bit q set iff
// the row is in query q's list), rows[g, u:width] = -1, bits[g, u:width] = 0, union_len[g] = u.
//
// Window: [0, num_kv_rows) when one pass covers it (find_window = 0), else [lo, hi], the smallest / largest
// valid row of the group (a block min / max over the entries). The window is covered in passes of `pass_rows`
// rows: a pass clears its membership fields (FIELD_BITS bits per row, 32 / FIELD_BITS rows per 32-bit word of
// dynamic shared memory), ORs every entry in the pass's rows into its field (shared-memory atomicOr; the entries
// are read from global memory once per pass, SORTED_UNROLL loads in flight per thread), then emits the non-zero
// fields in row order: in rounds of 4 words per thread, a block-wide exclusive scan of the per-thread counts
// gives each thread its output position, so the rows leave sorted. A window that needs more than `max_passes`
// passes is not built here: union_len[g] = -2 and nothing else is written for the group (the host builds such
// calls another way).

#ifndef SORTED_THREADS
#define SORTED_THREADS 1024
#endif
#ifndef SORTED_MIN_BLOCKS
#define SORTED_MIN_BLOCKS 2
#endif
#ifndef SORTED_UNROLL
#define SORTED_UNROLL 4
#endif
#ifndef FIELD_BITS
#define FIELD_BITS 16
#endif

#define SORTED_WARPS (SORTED_THREADS / 32)
#define SORTED_FULL 0xffffffffu
#define FIELDS_PER_WORD (32 / FIELD_BITS)
#define FIELD_MASK ((1u << FIELD_BITS) - 1u)

#if (SORTED_THREADS % 32) != 0 || SORTED_THREADS > 1024 || SORTED_THREADS < 64
#error "SORTED_THREADS must be a multiple of 32 in [64, 1024]"
#endif
#if FIELD_BITS != 8 && FIELD_BITS != 16
#error "FIELD_BITS must be 8 or 16"
#endif

// Block-wide exclusive scan of x (every thread calls it); returns x's offset, *total the sum. Two barriers.
__device__ __forceinline__ int sorted_block_scan(int x, int* s_warp, int* total) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    int incl = x;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(SORTED_FULL, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int w = lane < SORTED_WARPS ? s_warp[lane] : 0;
        int wincl = w;
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(SORTED_FULL, wincl, o);
            if (lane >= o) wincl += y;
        }
        if (lane < SORTED_WARPS) s_warp[32 + lane] = wincl - w;
        if (lane == 31) s_warp[64] = wincl;
    }
    __syncthreads();
    *total = s_warp[64];
    return s_warp[32 + warp] + incl - x;
}

// The valid row of entry e (or -1): (q, k) = divmod(e, K), k < s_len[q], 0 <= row < num_kv_rows.
__device__ __forceinline__ int sorted_entry(const int* __restrict__ indices, const int* s_len, int e, int n_entries,
                                            int K, int t0, long long stride_it, long long num_kv_rows) {
    if (e >= n_entries) return -1;
    const int q = e / K;
    const int k = e - q * K;
    if (k >= s_len[q]) return -1;
    const int v = __ldg(indices + ((long long)(t0 + q) * stride_it + k));
    return (v >= 0 && (long long)v < num_kv_rows) ? v : -1;
}

extern "C" __global__ void __launch_bounds__(SORTED_THREADS, SORTED_MIN_BLOCKS)
sparse_mla_union_sorted(
    const int* __restrict__ indices,      // [T, K], row stride stride_it (elements), last dim contiguous
    const int* __restrict__ topk_length,  // [T] or unused (has_topk_length = 0)
    int* __restrict__ rows,               // [num_groups, >= width], row stride stride_rg
    int* __restrict__ bits,               // [num_groups, >= width], row stride stride_rg
    int* __restrict__ union_len,          // [num_groups]
    long long stride_it,
    long long stride_rg,
    long long num_kv_rows,                // N; may be 2^31 (every non-negative int32 row valid)
    int T,
    int K,
    int G,                                // 1..FIELD_BITS (the launcher checks)
    int width,                            // columns written per group (G * K)
    int pass_rows,                        // rows per pass: a multiple of 4 * 32 / FIELD_BITS that fits the smem
    int max_passes,
    int find_window,                      // 0: the window is [0, N) and one pass covers it
    int has_topk_length)
{
    extern __shared__ uint4 words4[];
    unsigned* words = reinterpret_cast<unsigned*>(words4);
    __shared__ int s_len[32];
    __shared__ int s_warp[72];
    __shared__ int s_lo;
    __shared__ int s_hi;

    const int g = blockIdx.x;
    const int tid = threadIdx.x;
    const int t0 = g * G;
    const int glen = min(G, T - t0);
    const int n_entries = glen * K;  // < 2^31 (the launcher checks G * K)
    const long long out_base = (long long)g * stride_rg;

    if (tid < glen) {
        int n = K;
        if (has_topk_length) {
            n = topk_length[t0 + tid];
            n = n < 0 ? 0 : (n > K ? K : n);
        }
        s_len[tid] = n;
    }
    if (tid == 0) {
        s_lo = 0x7fffffff;
        s_hi = -1;
    }
    __syncthreads();

    int lo = 0;
    int hi = (int)(num_kv_rows - 1);  // without find_window, N <= pass_rows (the launcher's plan)
    if (find_window) {
        lo = 0x7fffffff;
        hi = -1;
        for (int e0 = tid; e0 < n_entries; e0 += SORTED_THREADS * SORTED_UNROLL) {
            int r[SORTED_UNROLL];
#pragma unroll
            for (int j = 0; j < SORTED_UNROLL; ++j)
                r[j] = sorted_entry(indices, s_len, e0 + j * SORTED_THREADS, n_entries, K, t0, stride_it, num_kv_rows);
#pragma unroll
            for (int j = 0; j < SORTED_UNROLL; ++j) {
                if (r[j] >= 0) {
                    lo = min(lo, r[j]);
                    hi = max(hi, r[j]);
                }
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            lo = min(lo, __shfl_xor_sync(SORTED_FULL, lo, o));
            hi = max(hi, __shfl_xor_sync(SORTED_FULL, hi, o));
        }
        if ((tid & 31) == 0) {
            atomicMin(&s_lo, lo);
            atomicMax(&s_hi, hi);
        }
        __syncthreads();
        lo = s_lo;
        hi = s_hi;
    }

    int u = 0;
    if (hi >= lo) {
        const long long span = (long long)hi - lo + 1;
        const long long passes = (span + pass_rows - 1) / pass_rows;
        if (passes > max_passes) {  // block-uniform: too wide a window for this kernel
            if (tid == 0) union_len[g] = -2;
            return;
        }
        for (int p = 0; p < (int)passes; ++p) {
            const int c0 = lo + p * pass_rows;  // <= hi < 2^31
            const int n_rows = (int)min((long long)pass_rows, (long long)hi - c0 + 1);
            const int n_words = (n_rows + FIELDS_PER_WORD - 1) / FIELDS_PER_WORD;
            const int n_quads = (n_words + 3) / 4;
            for (int w = tid; w < n_quads; w += SORTED_THREADS) words4[w] = make_uint4(0u, 0u, 0u, 0u);
            __syncthreads();
            for (int e0 = tid; e0 < n_entries; e0 += SORTED_THREADS * SORTED_UNROLL) {
                int r[SORTED_UNROLL];
#pragma unroll
                for (int j = 0; j < SORTED_UNROLL; ++j)
                    r[j] = sorted_entry(indices, s_len, e0 + j * SORTED_THREADS, n_entries, K, t0, stride_it,
                                        num_kv_rows);
#pragma unroll
                for (int j = 0; j < SORTED_UNROLL; ++j) {
                    if (r[j] >= c0 && r[j] - c0 < n_rows) {
                        const int q = (e0 + j * SORTED_THREADS) / K;
                        const int d = r[j] - c0;
                        atomicOr(words + d / FIELDS_PER_WORD, (1u << q) << ((d % FIELDS_PER_WORD) * FIELD_BITS));
                    }
                }
            }
            __syncthreads();
            // emission in row order: round w0, thread tid owns words 4 * (w0 + tid) .. + 3
            for (int w0 = 0; w0 < n_quads; w0 += SORTED_THREADS) {
                const int wq = w0 + tid;
                const uint4 quad = wq < n_quads ? words4[wq] : make_uint4(0u, 0u, 0u, 0u);
                const unsigned wv[4] = {quad.x, quad.y, quad.z, quad.w};
                int cnt = 0;
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int f = 0; f < FIELDS_PER_WORD; ++f) cnt += ((wv[i] >> (f * FIELD_BITS)) & FIELD_MASK) != 0u;
                int total;
                int at = u + sorted_block_scan(cnt, s_warp, &total);
                if (cnt != 0) {
#pragma unroll
                    for (int i = 0; i < 4; ++i)
#pragma unroll
                        for (int f = 0; f < FIELDS_PER_WORD; ++f) {
                            const unsigned m = (wv[i] >> (f * FIELD_BITS)) & FIELD_MASK;
                            if (m != 0u) {
                                rows[out_base + at] = c0 + (wq * 4 + i) * FIELDS_PER_WORD + f;
                                bits[out_base + at] = (int)m;
                                ++at;
                            }
                        }
                }
                // No barrier here: every thread's reads of this round (its words, then s_warp) come before it
                // arrives at the scan's next barrier, and the next round's s_warp writes and the next pass's clear
                // of the words both come after a barrier every thread has passed.
                u += total;
            }
        }
    }
    // ---- the columns after the union: -1 rows, 0 words
    for (int c = u + tid; c < width; c += SORTED_THREADS) {
        rows[out_base + c] = -1;
        bits[out_base + c] = 0;
    }
    if (tid == 0) union_len[g] = u;
}
