/* Decode attention straight from a compressed paged KV cache (offload/kv_cache.py), for CPU
 * attention at decode: one query row per sequence against its cached keys and values, read as
 * 4-bit codes and never written out as fp32. The gather-then-attend route dequantizes every
 * layer's whole context into fp32 buffers (70 MB per layer for llama-2-7b's 32 sequences x 144
 * tokens) and streams them again through the attention kernel: ~50 ms per layer and step on 2
 * cores; this reads each code once. Built and loaded by quant/cpu_kv_attention.py, which states the
 * layouts it covers and the arithmetic it is held to.
 *
 * Layouts (what KVPool stores; quant/packing.py's split halves per line):
 *   K: block `blk` holds W = H * d lines (channel w = h * d + c) of bs codes, bs / 2 bytes each:
 *      byte t holds token t (low nibble) and token t + bs / 2 (high); fp16 scale and minimum per
 *      line. The block being filled lives in full precision in `kres` [R, bs, H, d].
 *   V: slot s holds H lines of d codes (d / 2 bytes: byte i holds value i low, i + d / 2 high),
 *      groups of G values along the line, fp16 scale and minimum per group.
 *
 * Arithmetic: a key's value is code * scale + minimum, so q . k = sum_c (q_c * scale_c) * code_c +
 * sum_c q_c * minimum_c, summed in fp32 in that order; p_j = exp(s_j - max) with s_j = scale * q . k_j;
 * out = sum_j p_j * v_j / sum_j p_j, and V's affine is applied the same way (the minimums' term
 * once per group). Another order of fp32 operations than dequantize-then-attend: the Python side
 * states the tolerance the tests hold it to.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#else /* built without OpenMP (quant/cpu_kernels.py's fallback): one thread */
static inline int omp_get_thread_num(void) { return 0; }
#endif

static inline float half_to_float(uint16_t h) {
    /* F16C's scalar conversion (the kernels are built with -mf16c) */
    return _cvtsh_ss(h);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Scores of tokens [t0, t1) of one K block for the query q (one head h): s[t - t0] = q . k_t.
 * qs: scratch of d floats, acc: scratch of bs floats. */
static void block_scores(const uint8_t *kd, const uint16_t *ks, const uint16_t *km, int64_t blk, int64_t h,
                         int64_t H, int64_t d, int64_t bs, const float *q, int64_t t0, int64_t t1, float *qs,
                         float *acc, float *s) {
    const int64_t W = H * d, line = bs / 2;
    const uint8_t *codes = kd + (blk * W + h * d) * line;
    const uint16_t *scale = ks + blk * W + h * d, *minimum = km + blk * W + h * d;
    float offset = 0.f;
    for (int64_t c = 0; c < d; c++) {
        qs[c] = q[c] * half_to_float(scale[c]);
        offset += q[c] * half_to_float(minimum[c]);
    }
    for (int64_t t = 0; t < bs; t++) acc[t] = 0.f;
    float *lo = acc, *hi = acc + line;
    for (int64_t c = 0; c < d; c++) { /* contiguous in t: the compiler vectorizes these two */
        const uint8_t *row = codes + c * line;
        const float w = qs[c];
        for (int64_t t = 0; t < line; t++) lo[t] += w * (float)(row[t] & 15);
        for (int64_t t = 0; t < line; t++) hi[t] += w * (float)(row[t] >> 4);
    }
    for (int64_t t = t0; t < t1; t++) s[t - t0] = acc[t] + offset;
}

/* acc[0, d) += p * v, v the value of head h at `slot`. */
static void add_value(const uint8_t *vd, const uint16_t *vs, const uint16_t *vm, int64_t slot, int64_t h, int64_t H,
                      int64_t d, int64_t G, float p, float *acc) {
    const int64_t half = d / 2, groups = d / G;
    const uint8_t *codes = vd + (slot * H + h) * half;
    const uint16_t *scale = vs + (slot * H + h) * groups, *minimum = vm + (slot * H + h) * groups;
    for (int64_t g = 0; g < groups; g++) {
        const float s = p * half_to_float(scale[g]), m = p * half_to_float(minimum[g]);
        const int64_t start = g * G, stop = start + G;
        const int64_t mid = stop < half ? stop : (start > half ? start : half);
        for (int64_t i = start; i < mid; i++) acc[i] += s * (float)(codes[i] & 15) + m;
        for (int64_t i = mid; i < stop; i++) acc[i] += s * (float)(codes[i - half] >> 4) + m;
    }
}

/* s[0, n) scores whose maximum is `top` -> their softmax, in place; returns the log-sum-exp. */
static float softmax_in_place(float *s, int64_t n, float top) {
    float total = 0.f;
    for (int64_t j = 0; j < n; j++) total += (s[j] = expf(s[j] - top));
    const float inv = 1.f / total;
    for (int64_t j = 0; j < n; j++) s[j] *= inv;
    return top + logf(total);
}

/* Scores of query head qh (KV head h) over keys [j0, j1) of sequence b, scaled, into s[0, j1 - j0);
 * returns their maximum. qs: d floats, kacc: bs floats of scratch. */
static float head_scores(const uint8_t *kd, const uint16_t *ks, const uint16_t *km, const int64_t *blocks,
                         const float *open, int64_t j0, int64_t j1, int64_t done, const float *knew,
                         int64_t newpos, const float *qv, int64_t h, int64_t H, int64_t d, int64_t bs,
                         float scale, float *qs, float *kacc, float *s) {
    for (int64_t j = j0; j < done;) { /* quantized blocks, a block's tokens at a time */
        const int64_t t0 = j % bs, t1 = (done - j + t0) < bs ? done - j + t0 : bs;
        block_scores(kd, ks, km, blocks[j / bs], h, H, d, bs, qv, t0, t1, qs, kacc, s + (j - j0));
        j += t1 - t0;
    }
    for (int64_t j = done > j0 ? done : j0; j < j1; j++) s[j - j0] = dot(qv, open + (j % bs) * H * d + h * d, d);
    if (newpos >= j0 && newpos < j1) s[newpos - j0] = dot(qv, knew + h * d, d);
    float top = -INFINITY;
    for (int64_t j = 0; j < j1 - j0; j++) {
        s[j] *= scale;
        top = s[j] > top ? s[j] : top;
    }
    return top;
}

/* Sequences b in [b0, b1), every query head. Per sequence: blocks[b, :nb] its K blocks, slots[b, :L]
 * its V slots, keys [lo[b], hi[b]) visible, the first complete[b] from K blocks and the rest from
 * residual row res_ids[b], except newpos[b] (-1: none), which reads knew / vnew [B, H, d].
 * q, out [B, heads, d], lse [B, heads] (natural log; -inf and out 0 where no key is visible).
 * scratch: d + bs + heads * (L + d) floats. All heads' probabilities come first, so that V is read
 * slot by slot, each slot's heads in one contiguous run (head by head, the strided reads missed
 * the cache: 57% of the kernel's time). */
void fs_kv_decode_attention(const uint8_t *kd, const uint16_t *ks, const uint16_t *km, const int64_t *blocks,
                            int64_t nb, const float *kres, const int64_t *res_ids, const uint8_t *vd,
                            const uint16_t *vs, const uint16_t *vm, const int64_t *slots, int64_t L,
                            const int64_t *lo, const int64_t *hi, const int64_t *complete, const float *knew,
                            const float *vnew, const int64_t *newpos, const float *q, int64_t heads, int64_t H,
                            int64_t d, int64_t bs, int64_t G, float scale, int64_t b0, int64_t b1, float *out,
                            float *lse, float *scratch) {
    float *qs = scratch, *kacc = scratch + d, *probs = scratch + d + bs, *acc = probs + heads * L;
    const int64_t group = heads / H;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t j0 = lo[b], j1 = hi[b], n = j1 - j0, done = complete[b] < j1 ? complete[b] : j1;
        if (n <= 0) {
            for (int64_t c = 0; c < heads * d; c++) out[b * heads * d + c] = 0.f;
            for (int64_t qh = 0; qh < heads; qh++) lse[b * heads + qh] = -INFINITY;
            continue;
        }
        const float *open = kres + res_ids[b] * bs * H * d;
        for (int64_t qh = 0; qh < heads; qh++) {
            float *s = probs + qh * L;
            const float top = head_scores(kd, ks, km, blocks + b * nb, open, j0, j1, done, knew + b * H * d,
                                          newpos[b], q + (b * heads + qh) * d, qh / group, H, d, bs, scale, qs,
                                          kacc, s);
            lse[b * heads + qh] = softmax_in_place(s, n, top);
        }
        for (int64_t c = 0; c < heads * d; c++) acc[c] = 0.f;
        for (int64_t j = j0; j < j1; j++) {
            for (int64_t qh = 0; qh < heads; qh++) {
                const float p = probs[qh * L + j - j0];
                if (j == newpos[b]) {
                    const float *v = vnew + (b * H + qh / group) * d;
                    for (int64_t c = 0; c < d; c++) acc[qh * d + c] += p * v[c];
                } else {
                    add_value(vd, vs, vm, slots[b * L + j], qh / group, H, d, G, p, acc + qh * d);
                }
            }
        }
        for (int64_t c = 0; c < heads * d; c++) out[b * heads * d + c] = acc[c];
    }
}

/* Every sequence [0, B), taken one at a time by `threads` threads of the caller's OpenMP team (torch's
 * own workers: quant/csrc/q4_int8_gemm.c says why); scratch: `threads` blocks of `scratch_floats`. */
void fs_kv_decode_attention_all(const uint8_t *kd, const uint16_t *ks, const uint16_t *km, const int64_t *blocks,
                                int64_t nb, const float *kres, const int64_t *res_ids, const uint8_t *vd,
                                const uint16_t *vs, const uint16_t *vm, const int64_t *slots, int64_t L,
                                const int64_t *lo, const int64_t *hi, const int64_t *complete, const float *knew,
                                const float *vnew, const int64_t *newpos, const float *q, int64_t heads, int64_t H,
                                int64_t d, int64_t bs, int64_t G, float scale, int64_t B, float *out, float *lse,
                                float *scratch, int64_t scratch_floats, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *mine = scratch + (int64_t)omp_get_thread_num() * scratch_floats;
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++)
            fs_kv_decode_attention(kd, ks, km, blocks, nb, kres, res_ids, vd, vs, vm, slots, L, lo, hi, complete, knew,
                                   vnew, newpos, q, heads, H, d, bs, G, scale, b, b + 1, out, lse, mine);
    }
}

/* ---- plain pools: K and V as the compute dtype stores them -------------------------------------
 * KVPool's plain layout, one layer: slot s holds its K then its V, [S, 2, H, d] elements of fp32,
 * bf16 or fp16 (`kind` 0, 1, 2). Read in place through each sequence's slots: no gathered context
 * ([B, L, H, d] copies of K and V per layer), no mask, no transposed strides (SDPA on the gathered
 * bf16 context took 20 ms per layer for 30 sequences x 140 tokens of 32 heads of 64 on 2 cores).
 * Arithmetic: every element widened to fp32 exactly; q . k summed in 8 fixed lanes (lane l takes
 * channels c = l mod 8, in order), the lanes then added pairwise in a fixed tree, so the bits do
 * not depend on the compiler's vectorization; softmax and the weighted sum of V as the 4-bit
 * kernel above does them. The Python side states the tolerance the tests hold it to. */

static inline __m256 load8(const void *base, int64_t index, int kind) {
    /* 8 elements from `index` on, widened to fp32 (exactly: bf16 and fp16 fit in fp32) */
    if (kind == 0) return _mm256_loadu_ps((const float *)base + index);
    const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
    if (kind == 1) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    return _mm256_cvtph_ps(raw);
}

static inline float sum8(__m256 v) {
    /* (l0 + l4) + (l2 + l6) + ((l1 + l5) + (l3 + l7)): a fixed order */
    const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l_i + l_{i+4} */
    const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));                                 /* [0]+[2], [1]+[3] */
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps(b, b, 1)));
}

/* q . k over d channels (d a multiple of 8); k `kind`-typed from element `at` of `base`. */
static inline float dot_plain(const float *q, const void *base, int64_t at, int64_t d, int kind) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + c), load8(base, at + c, kind)));
    return sum8(acc);
}

/* acc[0, d) += p * v, v `kind`-typed from element `at` of `base`. */
static inline void axpy_plain(float p, const void *base, int64_t at, int64_t d, int kind, float *acc) {
    const __m256 w = _mm256_set1_ps(p);
    for (int64_t c = 0; c < d; c += 8)
        _mm256_storeu_ps(acc + c, _mm256_add_ps(_mm256_loadu_ps(acc + c), _mm256_mul_ps(w, load8(base, at + c, kind))));
}

#define PLAIN_AHEAD 2 /* slots whose records are fetched ahead of the one scored (1-4 measured alike) */
#define PREFETCH_LINE(p) __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)(p)))

static inline void fetch_record(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) PREFETCH_LINE(p + i);
}

/* Sequence b, its KV heads [k0, k1) (their query heads [k0 * group, k1 * group)): keys [lo[b], hi[b])
 * at slots[b, :L], position newpos[b] (-1: none) read from knew / vnew [B, H, d] fp32 instead of the
 * pool. q, out [B, heads, d], lse [B, heads] as above. scratch: heads * (L + d) floats. Slot by
 * slot, the heads' K (then V) of a slot read once for all of them: one contiguous run. */
static void plain_decode_attention(const void *kv, int kind, const int64_t *slots, int64_t L, const int64_t *lo,
                                   const int64_t *hi, const float *knew, const float *vnew, const int64_t *newpos,
                                   const float *q, int64_t heads, int64_t H, int64_t d, float scale, int64_t b,
                                   int64_t k0, int64_t k1, float *out, float *lse, float *scratch) {
    float *probs = scratch, *acc = scratch + heads * L;
    const int64_t group = heads / H, j0 = lo[b], j1 = hi[b], n = j1 - j0, width = H * d;
    const int64_t h0 = k0 * group, h1 = k1 * group, elt = kind == 0 ? 4 : 2;
    const float *qb = q + b * heads * d;
    if (n <= 0) {
        for (int64_t c = h0 * d; c < h1 * d; c++) out[b * heads * d + c] = 0.f;
        for (int64_t qh = h0; qh < h1; qh++) lse[b * heads + qh] = -INFINITY;
        return;
    }
    for (int64_t j = j0; j < j1; j++) {
        const int own = j == newpos[b];
        const void *base = own ? (const void *)knew : kv;
        const int64_t at = own ? b * width : slots[b * L + j] * 2 * width;
        if (j + PLAIN_AHEAD < j1) { /* a slot ahead's K and V of these heads, for both passes (the V pass
                                       then reads them from the cache): one core's demand misses alone
                                       read the pool at a third of the rate (3.4 -> 1.4 ms, 30 x 150) */
            const char *ahead = (const char *)kv + (slots[b * L + j + PLAIN_AHEAD] * 2 * width + k0 * d) * elt;
            if (k1 - k0 == H) {
                fetch_record(ahead, 2 * width * elt);
            } else {
                fetch_record(ahead, (k1 - k0) * d * elt);
                fetch_record(ahead + width * elt, (k1 - k0) * d * elt);
            }
        }
        for (int64_t qh = h0; qh < h1; qh++)
            probs[qh * L + j - j0] = dot_plain(qb + qh * d, base, at + (qh / group) * d, d, own ? 0 : kind) * scale;
    }
    for (int64_t qh = h0; qh < h1; qh++) {
        float *s = probs + qh * L, top = -INFINITY;
        for (int64_t j = 0; j < n; j++) top = s[j] > top ? s[j] : top;
        lse[b * heads + qh] = softmax_in_place(s, n, top);
    }
    for (int64_t c = h0 * d; c < h1 * d; c++) acc[c] = 0.f;
    for (int64_t j = j0; j < j1; j++) {
        const int own = j == newpos[b];
        const void *base = own ? (const void *)vnew : kv;
        const int64_t at = own ? b * width : slots[b * L + j] * 2 * width + width;
        for (int64_t qh = h0; qh < h1; qh++)
            axpy_plain(probs[qh * L + j - j0], base, at + (qh / group) * d, d, own ? 0 : kind, acc + qh * d);
    }
    for (int64_t c = h0 * d; c < h1 * d; c++) out[b * heads * d + c] = acc[c];
}

/* Every sequence [0, B), taken by `threads` threads of the caller's OpenMP team as
 * fs_kv_decode_attention_all takes them; with fewer sequences than threads, each sequence's KV heads
 * split into as many runs as keep every thread busy (a head's arithmetic is the same either way). */
void fs_plain_decode_attention_all(const void *kv, int kind, const int64_t *slots, int64_t L, const int64_t *lo,
                                   const int64_t *hi, const float *knew, const float *vnew, const int64_t *newpos,
                                   const float *q, int64_t heads, int64_t H, int64_t d, float scale, int64_t B,
                                   float *out, float *lse, float *scratch, int64_t scratch_floats, int threads) {
    const int64_t wanted = B >= threads ? 1 : (threads + B - 1) / B, runs = wanted < H ? wanted : H;
#pragma omp parallel num_threads(threads)
    {
        float *mine = scratch + (int64_t)omp_get_thread_num() * scratch_floats;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < B * runs; t++) {
            const int64_t b = t / runs, r = t % runs;
            plain_decode_attention(kv, kind, slots, L, lo, hi, knew, vnew, newpos, q, heads, H, d, scale, b,
                                   r * H / runs, (r + 1) * H / runs, out, lse, mine);
        }
    }
}
