// Top-k union of a group of G consecutive query rows, built in shared memory (one CTA per group).
//
// Compiled at run time by NVRTC (sparse_mla/union/cuda_smem.py, through CuPy); no #include, so the
// source compiles with any NVRTC and no CUDA headers. Semantics: sparse_mla/union/triton_tl.py's
// build_union (the CPU-tested twin), except where this table overflows (see "Overflow" below).
//
// Per group g (group_start[g] = t0, group_len[g] = glen in 1..G; glen <= 0: union_len[g] = 0):
//   entries: indices[t0 + q, k] for q < glen, k < min(max(topk_length[t0 + q], 0), K);
//   valid:   0 <= row < num_kv_rows (so a valid row is never the -1 that marks an empty slot);
//   out:     union_rows[g, :u] the distinct valid rows (unsorted), union_bits[g, :u] their membership
//            words (bit q set iff the row is in query q's list), union_len[g] = u.
//
// Table: open addressing with linear probing over S = 2^log_slots slots in dynamic shared memory:
//   keys[S] int32 (-1 = empty), then member[S / 2] uint32 holding 16 membership bits per slot
//   (slot s in the half (s & 1) of word s >> 1; G <= 16). 6 bytes per slot.
// Insert: read the slot; if empty, atomicCAS(-1 -> row); the entry is placed when the slot holds its
//   row (found, or just inserted), then atomicOr of its query bit into the slot's half word. Keys are
//   never removed while a group is built, so a slot seen holding another row stays that way.
// Count: each warp adds its number of new rows (ballot + popc) to s_count after every entry step.
// Overflow: capacity (<= S - THREADS when overflow is possible, set by the launcher) bounds the rows
//   a group may hold. A warp stops inserting once s_count > capacity; a probe that visits all S slots
//   without a place (a full table) also stops the group. After the insertion barrier the group
//   overflowed iff s_count > capacity or the table was full, which happens iff its union holds more
//   than `capacity` rows: then union_len[g] = -1, group_len[g] = 0 and its rows' route = 1 (the
//   per-token kernel computes them). Nothing else is written for that group.
// Compaction: warp w owns slots r * THREADS + 32 w + lane (r = 0, 1, ...); pass 1 counts its occupied
//   slots (ballot + popc), one warp scans the 32 warp counts, pass 2 writes each occupied slot to
//   union_rows / union_bits at the warp's offset + the popc of the lower lanes' ballot bits.
// Guard (has_guard): as the Triton builder, in fp32: u * glen > guard_ratio * (valid entries) ->
//   group_len[g] = 0 and its rows' route = 1 (union_len[g] keeps u).

#ifndef UNION_THREADS
#define UNION_THREADS 1024
#endif
#ifndef UNION_MIN_BLOCKS
#define UNION_MIN_BLOCKS 1
#endif
#ifndef UNION_UNROLL
#define UNION_UNROLL 4
#endif

#define UNION_EMPTY (-1)
#define UNION_FULL_MASK 0xffffffffu
#define UNION_WARPS (UNION_THREADS / 32)

#if (UNION_THREADS % 32) != 0 || UNION_THREADS > 1024 || UNION_THREADS < 32
#error "UNION_THREADS must be a multiple of 32 in [32, 1024]"
#endif

extern "C" __global__ void __launch_bounds__(UNION_THREADS, UNION_MIN_BLOCKS)
sparse_mla_union_smem(
    const int* __restrict__ indices,      // [T, K] rows, row stride stride_it (elements)
    const int* __restrict__ topk_length,  // [T] or unused (has_topk_length = 0)
    const int* __restrict__ group_start,  // [num_groups]
    int* __restrict__ group_len,          // [num_groups]; set to 0 for guarded / overflowed groups
    signed char* __restrict__ route,      // [T] int8; set to 1 for the rows of those groups
    int* __restrict__ union_rows,         // [num_groups, >= G * K], row stride stride_rg
    int* __restrict__ union_bits,         // [num_groups, >= G * K], row stride stride_rg
    int* __restrict__ union_len,          // [num_groups]
    long long stride_it,
    long long stride_rg,
    long long num_kv_rows,                // N; may be 2^31 (then every non-negative int32 row is valid)
    int K,
    int G,                                // 1..16
    int log_slots,                        // 6..15
    int capacity,                         // most union rows kept; more -> union_len = -1
    float guard_ratio,
    int has_topk_length,
    int has_guard)
{
    extern __shared__ int smem[];
    __shared__ int s_len[16];
    __shared__ int s_warp[32];
    __shared__ int s_count;
    __shared__ int s_valid;
    __shared__ int s_full;
    __shared__ int s_total;

    const int g = blockIdx.x;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int S = 1 << log_slots;
    int* keys = smem;
    unsigned* member = reinterpret_cast<unsigned*>(smem + S);

    // Every thread reads the same glen: the early return below is block-uniform (no thread of this
    // block has reached a barrier yet). Thread 0 may overwrite group_len[g] only after barriers.
    int glen = group_len[g];
    if (glen <= 0) {
        if (tid == 0) union_len[g] = 0;
        return;
    }
    if (glen > G) glen = G;
    const int t0 = group_start[g];

    if (tid < glen) {
        int n = K;
        if (has_topk_length) {
            n = topk_length[t0 + tid];
            n = n < 0 ? 0 : (n > K ? K : n);
        }
        s_len[tid] = n;
    }
    if (tid == 0) {
        s_count = 0;
        s_valid = 0;
        s_full = 0;
    }
    for (int s = tid; s < S; s += UNION_THREADS) keys[s] = UNION_EMPTY;
    for (int s = tid; s < (S >> 1); s += UNION_THREADS) member[s] = 0u;
    __syncthreads();

    // ---- insertion: this thread's entries are e = tid + i * THREADS (i = 0, 1, ...), (q, k) = divmod(e, K)
    const int n_entries = glen * K;  // <= 16 K < 2^31 (the launcher checks G * K)
    const unsigned shift = 32u - (unsigned)log_slots;
    const unsigned slot_mask = (unsigned)S - 1u;
    volatile int* vkeys = keys;
    volatile int* v_count = &s_count;
    volatile int* v_full = &s_full;
    int my_valid = 0;
    int q = tid / K;
    int k = tid - q * K;
    bool stop = false;
    for (int e0 = 0; e0 < n_entries && !stop; e0 += UNION_THREADS * UNION_UNROLL) {
        // loads first (UNROLL independent loads in flight per thread), then the probes
        int rows[UNION_UNROLL];
        int qs[UNION_UNROLL];
#pragma unroll
        for (int j = 0; j < UNION_UNROLL; ++j) {
            rows[j] = UNION_EMPTY;
            qs[j] = q;
            if (q < glen && k < s_len[q]) {
                const int r = __ldg(indices + ((long long)(t0 + q) * stride_it + k));
                if (r >= 0 && (long long)r < num_kv_rows) rows[j] = r;
            }
            k += UNION_THREADS;
            if (k >= K) {
                const int d = k / K;
                q += d;
                k -= d * K;
            }
        }
#pragma unroll
        for (int j = 0; j < UNION_UNROLL; ++j) {
            // warp-uniform: every lane of the warp runs the same (e0, j) steps and votes here
            const int over = (*v_count > capacity) | *v_full;
            if (__any_sync(UNION_FULL_MASK, over)) {
                stop = true;
                break;
            }
            int inserted = 0;
            const int row = rows[j];
            if (row != UNION_EMPTY) {
                ++my_valid;
                unsigned h = ((unsigned)row * 0x9E3779B1u) >> shift;
                bool placed = false;
                for (int p = 0; p < S; ++p) {
                    int cur = vkeys[h];
                    if (cur == UNION_EMPTY) {
                        cur = atomicCAS(keys + h, UNION_EMPTY, row);
                        if (cur == UNION_EMPTY) {
                            inserted = 1;
                            cur = row;
                        }
                    }
                    if (cur == row) {
                        atomicOr(member + (h >> 1), (1u << qs[j]) << ((h & 1u) << 4));
                        placed = true;
                        break;
                    }
                    h = (h + 1u) & slot_mask;
                }
                if (!placed) *v_full = 1;  // all S slots hold other rows
            }
            const unsigned ins = __ballot_sync(UNION_FULL_MASK, inserted);
            if (lane == 0 && ins != 0u) atomicAdd(&s_count, __popc(ins));
        }
    }
    if (has_guard) {  // valid entries of the group (block-uniform branch; every lane is here)
        int v = my_valid;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(UNION_FULL_MASK, v, o);
        if (lane == 0 && v != 0) atomicAdd(&s_valid, v);
    }
    __syncthreads();

    // ---- overflow: the union holds more than `capacity` rows -> this group runs per token
    if (s_count > capacity || s_full != 0) {  // block-uniform (read after the barrier, not written again)
        if (tid == 0) {
            union_len[g] = -1;
            group_len[g] = 0;
        }
        if (tid < glen) route[t0 + tid] = 1;
        return;
    }

    // ---- compaction, pass 1: occupied slots per warp
    const int rounds = (S + UNION_THREADS - 1) / UNION_THREADS;
    int wcount = 0;
    for (int r = 0; r < rounds; ++r) {
        const int s = r * UNION_THREADS + tid;
        const bool occ = s < S && keys[s] != UNION_EMPTY;
        wcount += __popc(__ballot_sync(UNION_FULL_MASK, occ));
    }
    if (lane == 0) s_warp[warp] = wcount;
    __syncthreads();
    if (warp == 0) {  // exclusive scan of the warp counts (UNION_WARPS <= 32)
        const int x = lane < UNION_WARPS ? s_warp[lane] : 0;
        int incl = x;
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(UNION_FULL_MASK, incl, o);
            if (lane >= o) incl += y;
        }
        __syncwarp();  // every lane has read s_warp before any lane overwrites it
        if (lane < UNION_WARPS) s_warp[lane] = incl - x;
        if (lane == 31) s_total = incl;
    }
    __syncthreads();

    // ---- compaction, pass 2: write the rows and their membership words
    const long long out_base = (long long)g * stride_rg;
    const unsigned lower_lanes = (1u << lane) - 1u;
    int pos = s_warp[warp];
    for (int r = 0; r < rounds; ++r) {
        const int s = r * UNION_THREADS + tid;
        const int key = s < S ? keys[s] : UNION_EMPTY;
        const bool occ = key != UNION_EMPTY;
        const unsigned m = __ballot_sync(UNION_FULL_MASK, occ);
        if (occ) {
            const int at = pos + __popc(m & lower_lanes);
            union_rows[out_base + at] = key;
            union_bits[out_base + at] = (int)((member[s >> 1] >> ((s & 1) << 4)) & 0xffffu);
        }
        pos += __popc(m);
    }

    // ---- length and overlap guard (same fp32 comparison as the Triton builder)
    const int total = s_total;
    bool guarded = false;
    if (has_guard) {
        guarded = __fmul_rn((float)total, (float)glen) > __fmul_rn(guard_ratio, (float)s_valid);
    }
    if (tid == 0) {
        union_len[g] = total;
        if (guarded) group_len[g] = 0;
    }
    if (guarded && tid < glen) route[t0 + tid] = 1;
}
