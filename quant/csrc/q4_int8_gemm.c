/* y = x @ W^T for a 4-bit group-wise weight W (ours: `code * scale + minimum` per group of G along
 * the input dimension), with x rounded to int8 per block of 32 values: the integer dot products run
 * 32 multiply-adds per AVX2 instruction (vpmaddubsw: unsigned codes x signed x), llama.cpp's way of
 * making 4-bit weights pay on CPUs without VNNI or AVX-512. Built and loaded by
 * quant/cpu_int8_matmul.py, which holds the arithmetic contract and the error bound.
 *
 * Per output value, with the codes centred (c - 8, so that the rounding of x is weighted by
 * |w - zero| rather than by |w - minimum|, ~3x less) and zero = minimum + 8 * scale:
 *   y[m, n] = sum_g ( scale[n, g] * (sum_{b in g} xd[m, b] * sum_{k in b} code[n, k] * xq[m, k] - 8 * xh[m, g])
 *                     + zero[n, g] * xg[m, g] )
 * where xq[m, k] * xd[m, b] is x[m, k] rounded to its block's int8 step, xh[m, g] the sum of those
 * rounded values over group g and xg[m, g] the exact fp32 sum of x over it (so the zero's term
 * carries no rounding of x). Each block's integer sum is exact (|sum| <= 128 * 15 * 127 < 2^24).
 *
 * Code layouts (the weight's rows, K / 2 bytes each):
 *   split halves (quant/packing.py): byte j holds code j (low nibble) and code j + K/2 (high);
 *     32 bytes give block c (low nibbles) and block c + K/64 (high nibbles).
 *   adjacent pairs (GPTQ / compressed-tensors words): byte j holds codes 2j (low) and 2j + 1 (high);
 *     32 bytes give blocks 2c and 2c+1, the low nibbles being their even codes and the high their odd
 *     ones: x is stored in that order (fs_quantize_x, pairs = 1), so no byte is shuffled here.
 *   group halves (GGUF Q4_0 / Q4_1 blocks' bytes): byte j of a group of G holds codes j (low) and
 *     j + G/2 (high); like pairs, 32 bytes give blocks 2c and 2c+1 (G = 32) or one block's codes,
 *     and x is stored in the order the nibbles take (pairs = 2), so the pairs path runs as it is.
 *
 * Instruction paths (one source, built once per path by quant/cpu_kernels.py, the path chosen at
 * load by the CPU's flags): AVX2 (no FS_VNNI): vpmaddubsw into int16 sums, flushed into int32 by
 * vpmaddwd before they could overflow; FS_VNNI = 256 (AVX-VNNI) and 512 (AVX-512 VNNI): vpdpbusd,
 * the four products of each int32 lane added into it in one instruction. Every int32 lane holds
 * the same products on every path (lane j of a 32-byte chunk: its bytes 4j .. 4j + 3), and sums of
 * them are exact, so the fp32 work after them (the same operations, in the same order, per output)
 * gives the same bits on every path. The 512-bit path runs two 8-row panels side by side (lanes
 * 0-7 and 8-15); which outputs go through a panel and which row by row is the same on every path
 * (the two compute an output in different fp32 orders).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


/* x fp32 [M, K] (row stride ldx) -> xq int8 [M, K], xd fp32 [M, K / XB] (each block's step),
 * xg fp32 [M, K / G] (exact sums of x over each weight group), xh fp32 [M, K / G] (sums of the
 * rounded x, xq * xd, over each group). A block holding a NaN or an infinity gets a NaN step, so
 * the product is NaN, never a finite number that ignored it.
 * rq != NULL: also the rounding's residual, x - xq * xd, rounded the same way with 254 times finer
 * steps (|residual| <= step / 2, so its codes fit in +-127) into rq / rd / rh, with rg = 0 (the
 * exact sum is counted once): as M more rows of x, the kernel's product over both is x rounded
 * to ~16 bits per block instead of 8. */
static inline float hsum(__m256 v);

/* Where x's value k goes in xq so that the pairs path multiplies it by its code: 64 values per 32
 * code bytes, the low nibbles taking positions 0-31 and the high ones 32-63. */
static inline int64_t x_position(int layout, int64_t k, int64_t G) {
    if (layout == 1) /* adjacent pairs: each 64 values as even of 1st 32, even of 2nd, odd, odd */
        return (k / 64) * 64 + (k % 2) * 32 + ((k / 32) % 2) * 16 + (k % 32) / 2;
    if (layout == 2) { /* group halves: value q of group g in byte g * G/2 + q % (G/2), nibble q / (G/2) */
        const int64_t h = G / 2, q = k % G, byte = (k / G) * h + q % h;
        return (byte / 32) * 64 + (q / h) * 32 + byte % 32;
    }
    return k;
}

static void quantize_rows_avx2(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t G, int64_t XB, int8_t *xq,
                               float *xd, float *xg, float *xh);

/* xq rows in x's order -> the group-halves order (x_position, layout 2), in place: the values move
 * in runs that stay together (16 for G = 32, 32 otherwise; G = 64 leaves every value where it is). */
static void to_group_halves_order(int8_t *xq, int64_t M, int64_t K, int64_t G) {
    if (G == 64) return;
    const int64_t run = G == 32 ? 16 : 32;
    int8_t *row = malloc((size_t)K);
    if (!row) abort();
    for (int64_t m = 0; m < M; m++) {
        memcpy(row, xq + m * K, (size_t)K);
        for (int64_t k = 0; k < K; k += run) memcpy(xq + m * K + x_position(2, k, G), row + k, (size_t)run);
    }
    free(row);
}

void fs_quantize_x(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t G, int64_t XB, int pairs,
                   int8_t *xq, float *xd, float *xg, float *xh, int8_t *rq, float *rd, float *rg, float *rh) {
    const int64_t nb = K / XB, ng = K / G;
    if ((pairs == 0 || pairs == 2) && !rq) { /* one plane, 8 values per instruction */
        quantize_rows_avx2(x, M, K, ldx, G, XB, xq, xd, xg, xh);
        if (pairs == 2) to_group_halves_order(xq, M, K, G);
        return;
    }
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        for (int64_t g = 0; g < ng; g++) {
            float s = 0.f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) s += xr[k];
            xg[m * ng + g] = s;
            xh[m * ng + g] = 0.f;
            if (rq) rg[m * ng + g] = rh[m * ng + g] = 0.f;
        }
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = xr + b * XB;
            float amax = 0.f;
            int finite = 1;
            for (int i = 0; i < XB; i++) {
                const float a = fabsf(xb[i]);
                finite &= isfinite(a);
                amax = a > amax ? a : amax;
            }
            const float inv = (finite && amax > 0.f) ? 127.f / amax : 0.f;
            const float step = finite ? amax / 127.f : NAN;
            const float fine = step / 254.f, fine_inv = inv * 254.f;
            int32_t isum = 0, rsum = 0;
            xd[m * nb + b] = step;
            if (rq) rd[m * nb + b] = fine;
            for (int64_t i = 0; i < XB; i++) {
                float r = finite ? nearbyintf(xb[i] * inv) : 0.f; /* round half to even; |r| <= 127 */
                r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
                const int64_t pos = x_position(pairs, b * XB + i, G);
                xq[m * K + pos] = (int8_t)r;
                isum += (int32_t)r;
                if (rq) {
                    const float residual = xb[i] - r * step;
                    float e = finite ? nearbyintf(residual * fine_inv) : 0.f;
                    e = e > 127.f ? 127.f : (e < -127.f ? -127.f : e);
                    rq[m * K + pos] = (int8_t)e;
                    rsum += (int32_t)e;
                }
            }
            xh[m * ng + (b * XB) / G] += step * (float)isum;
            if (rq) rh[m * ng + (b * XB) / G] += fine * (float)rsum;
        }
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* fs_quantize_x for the split-halves layout and one plane: the same codes, steps and rounded sums
 * (x * inv rounded half to even, as nearbyintf; integer sums exact), the exact group sums added 8
 * lanes at a time (another order of fp32 additions than the scalar loop's: within the kernel's
 * stated fp32 slack). The scalar loop took ~1.5% of a llama-2-7b pass. */
static void quantize_rows_avx2(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t G, int64_t XB, int8_t *xq,
                               float *xd, float *xg, float *xh) {
    const int64_t nb = K / XB, ng = K / G;
    const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(3.402823466e38f);
    const __m256 top = _mm256_set1_ps(127.f), bottom = _mm256_set1_ps(-127.f);
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        for (int64_t g = 0; g < ng; g++) {
            __m256 s = _mm256_setzero_ps();
            for (int64_t k = g * G; k < (g + 1) * G; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xr + k));
            xg[m * ng + g] = hsum(s);
            xh[m * ng + g] = 0.f;
        }
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = xr + b * XB;
            __m256 amax = _mm256_setzero_ps();
            int finite = 1;
            for (int64_t i = 0; i < XB; i += 8) {
                const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i));
                finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ)) == 0xFF; /* NaN, inf: false */
                amax = _mm256_max_ps(amax, a);
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float am = _mm_cvtss_f32(h);
            const float inv = (finite && am > 0.f) ? 127.f / am : 0.f;
            const float step = finite ? am / 127.f : NAN;
            xd[m * nb + b] = step;
            const __m256 vinv = _mm256_set1_ps(inv);
            __m256i isum = _mm256_setzero_si256();
            for (int64_t i = 0; i < XB; i += 8) {
                __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vinv),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                r = _mm256_min_ps(_mm256_max_ps(r, bottom), top); /* not finite: inv = 0, so 0 * x: NaN */
                if (!finite) r = _mm256_setzero_ps();
                const __m256i q = _mm256_cvtps_epi32(r);
                isum = _mm256_add_epi32(isum, q);
                const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
                _mm_storel_epi64((__m128i *)(xq + m * K + b * XB + i), _mm_packs_epi16(q16, q16));
            }
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
            xh[m * ng + (b * XB) / G] += step * (float)_mm_cvtsi128_si32(t);
        }
    }
}

/* int16 pair sums of unsigned codes x signed int8 (|each| <= 2 * 15 * 127: two may be added). */
static inline __m256i pair_sums(__m256i codes, const int8_t *x) {
    return _mm256_maddubs_epi16(codes, _mm256_loadu_si256((const __m256i *)x));
}

static inline __m256 to_float(__m256i sums16) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(sums16, _mm256_set1_epi16(1)));
}

#ifdef FS_VNNI
/* acc's int32 lane j += the four products of bytes 4j .. 4j + 3 (unsigned codes x signed x): the
 * int32 lanes AVX2 gets from vpmaddubsw + vpmaddwd, in one instruction. */
#if FS_VNNI == 512
#define QUAD_SUMS(acc, codes, x) _mm256_dpbusd_epi32(acc, codes, x)
#else
#define QUAD_SUMS(acc, codes, x) _mm256_dpbusd_avx_epi32(acc, codes, x)
#endif
static inline __m256i quad_sums(__m256i acc, __m256i codes, const int8_t *x) {
    return QUAD_SUMS(acc, codes, _mm256_loadu_si256((const __m256i *)x));
}
#endif

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* MB rows of x (m .. m + MB - 1) against weight row `row`, x blocks of 32: each block has its own
 * step (and weight scale, sw[block's group]). sw / zw: the row's groups' scales and zeros. */
static inline __attribute__((always_inline)) void tile32(const int MB, const int pairs, const uint8_t *row,
                                                        const float *sw, const float *zw, const int8_t *xq,
                                                        const float *xd, const float *xg, const float *xh, int64_t m, int64_t K,
                                                        int64_t G, float *y, int64_t ldy) {
    const int64_t nb = K / 32, ng = K / G, nc = K / 64;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t c = 0; c < nc; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(row + 32 * c));
        const __m256i lo = _mm256_and_si256(v, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if (pairs) { /* blocks 2c (int32 lanes 0-3) and 2c+1 (lanes 4-7); low: even codes, high: odd */
            for (int i = 0; i < MB; i++) {
                const int8_t *xr = xq + (m + i) * K + 64 * c;
                const float *dr = xd + (m + i) * nb + 2 * c;
#ifdef FS_VNNI
                const __m256 sums = _mm256_cvtepi32_ps(quad_sums(quad_sums(_mm256_setzero_si256(), lo, xr), hi, xr + 32));
#else
                const __m256 sums = to_float(_mm256_add_epi16(pair_sums(lo, xr), pair_sums(hi, xr + 32)));
#endif
                const __m256 step = _mm256_set_m128(_mm_set1_ps(sw[(64 * c + 32) / G] * dr[1]), _mm_set1_ps(sw[(64 * c) / G] * dr[0]));
                acc[i] = _mm256_fmadd_ps(sums, step, acc[i]);
            }
        } else { /* block c (low nibbles) and block c + nc (high nibbles) */
            for (int i = 0; i < MB; i++) {
                const int8_t *xr = xq + (m + i) * K;
                const float *dr = xd + (m + i) * nb;
#ifdef FS_VNNI
                const __m256 sl = _mm256_cvtepi32_ps(quad_sums(_mm256_setzero_si256(), lo, xr + 32 * c));
                const __m256 sh = _mm256_cvtepi32_ps(quad_sums(_mm256_setzero_si256(), hi, xr + 32 * (c + nc)));
#else
                const __m256 sl = to_float(pair_sums(lo, xr + 32 * c)), sh = to_float(pair_sums(hi, xr + 32 * (c + nc)));
#endif
                acc[i] = _mm256_fmadd_ps(sl, _mm256_set1_ps(sw[(32 * c) / G] * dr[c]), acc[i]);
                acc[i] = _mm256_fmadd_ps(sh, _mm256_set1_ps(sw[(32 * (c + nc)) / G] * dr[c + nc]), acc[i]);
            }
        }
    }
    for (int i = 0; i < MB; i++)
        y[(m + i) * ldy] = hsum(acc[i]) + dot(zw, xg + (m + i) * ng, ng) - 8.f * dot(sw, xh + (m + i) * ng, ng);
}

#ifdef FS_VNNI
#define WIDE_TO_FLOAT(sums32) _mm256_cvtepi32_ps(sums32)
#else
#define WIDE_TO_FLOAT(sums16) to_float(sums16)
#endif

/* The same for x blocks of XB = 64 or 128 values inside one weight group (G >= XB): a block's int16
 * pair sums are added over its 32-byte chunks (|lane| <= 4 * 2 * 15 * 127 < 2^15) and converted
 * and scaled once per block, halving the multiplies that dominate tile32 (AVX2 has one integer
 * multiply port on the CPUs this is for). */
static inline __attribute__((always_inline)) void tile_wide(const int MB, const int pairs, const uint8_t *row,
                                                           const float *sw, const float *zw, const int8_t *xq,
                                                           const float *xd, const float *xg, const float *xh, int64_t m, int64_t K,
                                                           int64_t G, int64_t XB, float *y, int64_t ldy) {
    const int64_t nb = K / XB, ng = K / G;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    if (pairs) { /* x block b: code bytes [b * XB / 2, (b + 1) * XB / 2), 64 codes per 32 bytes */
        for (int64_t b = 0; b < nb; b++) {
            __m256i s16[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                              _mm256_setzero_si256()};
            for (int64_t c = b * XB / 64; c < (b + 1) * XB / 64; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(row + 32 * c));
                const __m256i lo = _mm256_and_si256(v, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                for (int i = 0; i < MB; i++) {
                    const int8_t *xr = xq + (m + i) * K + 64 * c;
#ifdef FS_VNNI /* s16: int32 sums here */
                    s16[i] = quad_sums(quad_sums(s16[i], lo, xr), hi, xr + 32);
#else
                    s16[i] = _mm256_add_epi16(s16[i], _mm256_add_epi16(pair_sums(lo, xr), pair_sums(hi, xr + 32)));
#endif
                }
            }
            const float s = sw[(b * XB) / G];
            for (int i = 0; i < MB; i++)
                acc[i] = _mm256_fmadd_ps(WIDE_TO_FLOAT(s16[i]), _mm256_set1_ps(s * xd[(m + i) * nb + b]), acc[i]);
        }
    } else { /* x block b (low nibbles of bytes [b * XB, (b + 1) * XB)) and block b + nb / 2 (high) */
        const int64_t half = nb / 2;
        for (int64_t b = 0; b < half; b++) {
            __m256i slo[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                              _mm256_setzero_si256()};
            __m256i shi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                              _mm256_setzero_si256()};
            for (int64_t off = b * XB; off < (b + 1) * XB; off += 32) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(row + off));
                const __m256i lo = _mm256_and_si256(v, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                for (int i = 0; i < MB; i++) {
                    const int8_t *xr = xq + (m + i) * K;
#ifdef FS_VNNI
                    slo[i] = quad_sums(slo[i], lo, xr + off);
                    shi[i] = quad_sums(shi[i], hi, xr + K / 2 + off);
#else
                    slo[i] = _mm256_add_epi16(slo[i], pair_sums(lo, xr + off));
                    shi[i] = _mm256_add_epi16(shi[i], pair_sums(hi, xr + K / 2 + off));
#endif
                }
            }
            const float sl = sw[(b * XB) / G], sh = sw[((b + half) * XB) / G];
            for (int i = 0; i < MB; i++) {
                const float *dr = xd + (m + i) * nb;
                acc[i] = _mm256_fmadd_ps(WIDE_TO_FLOAT(slo[i]), _mm256_set1_ps(sl * dr[b]), acc[i]);
                acc[i] = _mm256_fmadd_ps(WIDE_TO_FLOAT(shi[i]), _mm256_set1_ps(sh * dr[b + half]), acc[i]);
            }
        }
    }
    for (int i = 0; i < MB; i++)
        y[(m + i) * ldy] = hsum(acc[i]) + dot(zw, xg + (m + i) * ng, ng) - 8.f * dot(sw, xh + (m + i) * ng, ng);
}

/* ---- 8 weight rows at a time (M >= PANEL_MIN_ROWS) ------------------------------------------
 * The rows' code bytes are interleaved by 4 (a "panel", BLIS-style packing into an L1/L2-sized
 * buffer): panel[32 t + 4 j + i] = row j's byte 4 t + i. One 32-byte load then holds 8 codes of
 * each of the 8 rows, multiplied by the same 4 values of x broadcast to every lane, so the int32
 * lanes after vpmaddwd are the 8 rows' sums: converting and scaling a block costs one
 * cvt + fma for 8 outputs instead of one per output (llama.cpp repacks its weights for the same
 * reason). From row-major rows the panels are made per call; a weight stored in them at load
 * (quant/panels.py, gemm_stored below) is read as it is. */
#define PANEL 8
#define PANEL_MIN_ROWS 4

static inline void transpose8(__m256 *r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* A running int16 sum as it stands after each step. Without it gcc -O3 reassociates a flush
 * window's integer adds (legal: they are exact) into a tree over all the window's products and
 * spills those to the stack; the chain of adds keeps each sum in its register (the panel tile
 * 13-20 -> 17-26 multiply-adds per cycle on a Zen 3 core, the whole call 15-24% faster; the sums,
 * and so the outputs, are the same bits). */
#define SUM_AS_IT_STANDS(a) __asm__("" : "+x"(a))

static inline __m256i x4(const int8_t *p) { /* 4 bytes of x in every 32-bit lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

#if defined(FS_VNNI) && FS_VNNI == 512
static inline __m512i x4w(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* r[i]'s 4-byte unit j -> r[j]'s unit i: pairs of units, then quads, within each 128-bit lane; then
 * the lanes, two shuffles of whole lanes deep. */
static inline void transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int q = 0; q < 16; q += 4) { /* u[q + e], lane L: rows q .. q + 3's unit 4 L + e */
        u[q] = _mm512_unpacklo_epi64(t[q], t[q + 2]);
        u[q + 1] = _mm512_unpackhi_epi64(t[q], t[q + 2]);
        u[q + 2] = _mm512_unpacklo_epi64(t[q + 1], t[q + 3]);
        u[q + 3] = _mm512_unpackhi_epi64(t[q + 1], t[q + 3]);
    }
    for (int e = 0; e < 4; e++) {
        const __m512i a = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), b = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
        const __m512i c = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE), d = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
        r[e] = _mm512_shuffle_i32x4(a, b, 0x88);
        r[4 + e] = _mm512_shuffle_i32x4(a, b, 0xDD);
        r[8 + e] = _mm512_shuffle_i32x4(c, d, 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(c, d, 0xDD);
    }
}
#endif

/* The next stored panel's lines (quant/panels.py: one contiguous run of codes, one of scales, one
 * of minimums), fetched a few per block iteration by the current panel's first tile while it
 * computes: read on demand the panels cost as much again as the compute at 16 rows of x, and one
 * burst of prefetches stalls the core on its miss buffers (spread: 1.33x, 16 rows, Zen 5). */
typedef struct {
    const char *codes, *scale, *minimum;
    int64_t code_lines, scale_lines, minimum_lines;
} Ahead;

/* Iteration `it`'s share: `per` code lines (code_lines / the loop's iterations, worked out once
 * before it: a division per block cost more than the fetches saved), then one line of scales or
 * minimums. */
#define PREFETCH(p) __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)(p))) /* gcc 12 dropped _mm_prefetch's here */

static inline void fetch_ahead(const Ahead *a, int64_t it, int64_t per) {
    if (!a) return;
    for (int64_t l = it * per; l < (it + 1) * per; l++) PREFETCH(a->codes + 64 * l);
    if (it < a->scale_lines) PREFETCH(a->scale + 64 * it);
    else if (it - a->scale_lines < a->minimum_lines) PREFETCH(a->minimum + 64 * (it - a->scale_lines));
}

/* MB (1, 2 or 4) rows of x against a panel (its 32-byte groups PS bytes apart: 32; 64, one half of a
 * stored 16-row panel); swp / zwp: [groups][8] scales and zeros of its rows. Four
 * rows share each panel load and nibble split (4 rows: -10..13% time against 2 on an AVX2 EPYC; the
 * int32 block sums then spill, once per 8 loads). */
static inline __attribute__((always_inline)) void panel_tile(const int MB, const int pairs, const uint8_t *panel,
                                                            const float *swp, const float *zwp, const int8_t *xq,
                                                            const float *xd, const float *xg, const float *xh,
                                                            int64_t m, int64_t K, int64_t G, int64_t XB, float *y,
                                                            int64_t ldy, const int64_t PS, const Ahead *ahead) {
    const int64_t nb = K / XB, ng = K / G;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
#ifndef FS_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 acc[4], z[4], c[4]; /* z, c: each row's sums over the groups of zero * xg and scale * xh */
    for (int i = 0; i < MB; i++) acc[i] = z[i] = c[i] = _mm256_setzero_ps();
    if (!pairs) { /* 4-byte group t: low nibbles codes 4t.. (block b), high ones K/2 + 4t.. (block b + nb/2) */
        const int64_t half = nb / 2;
        const int64_t per = ahead ? ahead->code_lines / half : 0;
        for (int64_t b = 0; b < half; b++) {
            fetch_ahead(ahead, b, per);
            __m256i alo[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
            __m256i ahi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int64_t t0 = b * XB / 4; t0 < (b + 1) * XB / 4; t0 += 8) { /* int16: 8 sums at most */
                __m256i slo[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
                __m256i shi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 8 /* with the sums kept as they stand: -9..-22% time at 512 rows */
                for (int64_t t = t0; t < t0 + 8; t++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(panel + PS * t));
                    const __m256i lo = _mm256_and_si256(v, low4);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    for (int i = 0; i < MB; i++) {
                        const int8_t *xr = xq + (m + i) * K + 4 * t;
#ifdef FS_VNNI /* straight into the int32 sums (slo / shi stay zero) */
                        alo[i] = QUAD_SUMS(alo[i], lo, x4(xr));
                        ahi[i] = QUAD_SUMS(ahi[i], hi, x4(xr + K / 2));
#else
                        slo[i] = _mm256_add_epi16(slo[i], _mm256_maddubs_epi16(lo, x4(xr)));
                        shi[i] = _mm256_add_epi16(shi[i], _mm256_maddubs_epi16(hi, x4(xr + K / 2)));
#endif
                    }
                    for (int i = 0; i < MB; i++) {
                        SUM_AS_IT_STANDS(slo[i]);
                        SUM_AS_IT_STANDS(shi[i]);
                    }
                }
#ifndef FS_VNNI
                for (int i = 0; i < MB; i++) {
                    alo[i] = _mm256_add_epi32(alo[i], _mm256_madd_epi16(slo[i], ones));
                    ahi[i] = _mm256_add_epi32(ahi[i], _mm256_madd_epi16(shi[i], ones));
                }
#endif
            }
            const __m256 sl = _mm256_loadu_ps(swp + PANEL * ((b * XB) / G));
            const __m256 sh = _mm256_loadu_ps(swp + PANEL * (((b + half) * XB) / G));
            for (int i = 0; i < MB; i++) {
                const float *dr = xd + (m + i) * nb;
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(alo[i]), _mm256_mul_ps(sl, _mm256_set1_ps(dr[b])), acc[i]);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ahi[i]), _mm256_mul_ps(sh, _mm256_set1_ps(dr[b + half])),
                                         acc[i]);
            }
        }
        for (int64_t g = 0; g < ng; g++) { /* each row's terms a chain over the groups, the rows side by side */
            const __m256 sg = _mm256_loadu_ps(swp + PANEL * g);
            for (int i = 0; i < MB; i++) {
                if (zwp) z[i] = _mm256_fmadd_ps(_mm256_loadu_ps(zwp + PANEL * g), _mm256_set1_ps(xg[(m + i) * ng + g]), z[i]);
                c[i] = _mm256_fmadd_ps(sg, _mm256_set1_ps(xh[(m + i) * ng + g]), c[i]);
            }
        }
    } else { /* group t: low nibbles the even codes of 8t.., high the odd ones: x's pairs order */
        const int64_t per = ahead ? ahead->code_lines / nb : 0;
        for (int64_t b = 0; b < nb; b++) {
            fetch_ahead(ahead, b, per);
            __m256i a32[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int64_t t0 = b * XB / 8; t0 < (b + 1) * XB / 8; t0 += 4) { /* 8 sums per flush */
                __m256i s16[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
                for (int64_t t = t0; t < t0 + 4; t++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(panel + PS * t));
                    const __m256i lo = _mm256_and_si256(v, low4);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    const int64_t off = (4 * t / 32) * 64 + (4 * t) % 32;
                    for (int i = 0; i < MB; i++) {
                        const int8_t *xr = xq + (m + i) * K + off;
#ifdef FS_VNNI
                        a32[i] = QUAD_SUMS(QUAD_SUMS(a32[i], lo, x4(xr)), hi, x4(xr + 32));
#else
                        s16[i] = _mm256_add_epi16(s16[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x4(xr)),
                                                                           _mm256_maddubs_epi16(hi, x4(xr + 32))));
#endif
                    }
                    for (int i = 0; i < MB; i++) SUM_AS_IT_STANDS(s16[i]);
                }
#ifndef FS_VNNI
                for (int i = 0; i < MB; i++) a32[i] = _mm256_add_epi32(a32[i], _mm256_madd_epi16(s16[i], ones));
#endif
            }
            const int64_t g = (b * XB) / G;
            const __m256 s = _mm256_loadu_ps(swp + PANEL * g);
            for (int i = 0; i < MB; i++)
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a32[i]), _mm256_mul_ps(s, _mm256_set1_ps(xd[(m + i) * nb + b])),
                                         acc[i]);
            if (((b + 1) * XB) % G == 0) /* the group's last block: its zero and correction terms, in group order */
                for (int i = 0; i < MB; i++) {
                    if (zwp) z[i] = _mm256_fmadd_ps(_mm256_loadu_ps(zwp + PANEL * g), _mm256_set1_ps(xg[(m + i) * ng + g]), z[i]);
                    c[i] = _mm256_fmadd_ps(s, _mm256_set1_ps(xh[(m + i) * ng + g]), c[i]);
                }
        }
    }
    for (int i = 0; i < MB; i++)
        _mm256_storeu_ps(y + (m + i) * ldy, _mm256_add_ps(acc[i], _mm256_fnmadd_ps(_mm256_set1_ps(8.f), c[i], z[i])));
}

#if defined(FS_VNNI) && FS_VNNI == 512
/* panel_tile on two panels side by side (AVX-512 VNNI): panel[64 t + 32 h + 4 j + i] = row 8 h + j's
 * byte 4 t + i, swp / zwp [groups][16]; int32 lane 8 h + j holds what panel h's lane j holds in
 * panel_tile, and every fp32 operation after it is panel_tile's, lane for lane: the same bits. */
static inline __attribute__((always_inline)) void panel_tile16(const int MB, const int pairs, const uint8_t *panel,
                                                              const float *swp, const float *zwp, const int8_t *xq,
                                                              const float *xd, const float *xg, const float *xh,
                                                              int64_t m, int64_t K, int64_t G, int64_t XB, float *y,
                                                              int64_t ldy, const int64_t PS, const Ahead *ahead) {
    (void)PS; /* always 64: two panels side by side */
    const int64_t nb = K / XB, ng = K / G, W = 2 * PANEL;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[4], z[4], c[4];
    for (int i = 0; i < MB; i++) acc[i] = z[i] = c[i] = _mm512_setzero_ps();
    if (!pairs) {
        const int64_t half = nb / 2;
        const int64_t per = ahead ? ahead->code_lines / half : 0;
        for (int64_t b = 0; b < half; b++) {
            fetch_ahead(ahead, b, per);
            __m512i alo[4], ahi[4];
            for (int i = 0; i < MB; i++) alo[i] = ahi[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int64_t t = b * XB / 4; t < (b + 1) * XB / 4; t++) {
                const __m512i v = _mm512_loadu_si512((const void *)(panel + 64 * t));
                const __m512i lo = _mm512_and_si512(v, low4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                for (int i = 0; i < MB; i++) {
                    const int8_t *xr = xq + (m + i) * K + 4 * t;
                    alo[i] = _mm512_dpbusd_epi32(alo[i], lo, x4w(xr));
                    ahi[i] = _mm512_dpbusd_epi32(ahi[i], hi, x4w(xr + K / 2));
                }
            }
            const __m512 sl = _mm512_loadu_ps(swp + W * ((b * XB) / G));
            const __m512 sh = _mm512_loadu_ps(swp + W * (((b + half) * XB) / G));
            for (int i = 0; i < MB; i++) {
                const float *dr = xd + (m + i) * nb;
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(alo[i]), _mm512_mul_ps(sl, _mm512_set1_ps(dr[b])), acc[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ahi[i]), _mm512_mul_ps(sh, _mm512_set1_ps(dr[b + half])),
                                         acc[i]);
            }
        }
        for (int64_t g = 0; g < ng; g++) {
            const __m512 sg = _mm512_loadu_ps(swp + W * g);
            for (int i = 0; i < MB; i++) {
                if (zwp) z[i] = _mm512_fmadd_ps(_mm512_loadu_ps(zwp + W * g), _mm512_set1_ps(xg[(m + i) * ng + g]), z[i]);
                c[i] = _mm512_fmadd_ps(sg, _mm512_set1_ps(xh[(m + i) * ng + g]), c[i]);
            }
        }
    } else {
        const int64_t per = ahead ? ahead->code_lines / nb : 0;
        for (int64_t b = 0; b < nb; b++) {
            fetch_ahead(ahead, b, per);
            __m512i a32[4];
            for (int i = 0; i < MB; i++) a32[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int64_t t = b * XB / 8; t < (b + 1) * XB / 8; t++) {
                const __m512i v = _mm512_loadu_si512((const void *)(panel + 64 * t));
                const __m512i lo = _mm512_and_si512(v, low4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                const int64_t off = (4 * t / 32) * 64 + (4 * t) % 32;
                for (int i = 0; i < MB; i++) {
                    const int8_t *xr = xq + (m + i) * K + off;
                    a32[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a32[i], lo, x4w(xr)), hi, x4w(xr + 32));
                }
            }
            const int64_t g = (b * XB) / G;
            const __m512 s = _mm512_loadu_ps(swp + W * g);
            for (int i = 0; i < MB; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a32[i]), _mm512_mul_ps(s, _mm512_set1_ps(xd[(m + i) * nb + b])),
                                         acc[i]);
            if (((b + 1) * XB) % G == 0)
                for (int i = 0; i < MB; i++) {
                    if (zwp) z[i] = _mm512_fmadd_ps(_mm512_loadu_ps(zwp + W * g), _mm512_set1_ps(xg[(m + i) * ng + g]), z[i]);
                    c[i] = _mm512_fmadd_ps(s, _mm512_set1_ps(xh[(m + i) * ng + g]), c[i]);
                }
        }
    }
    for (int i = 0; i < MB; i++)
        _mm512_storeu_ps(y + (m + i) * ldy, _mm512_add_ps(acc[i], _mm512_fnmadd_ps(_mm512_set1_ps(8.f), c[i], z[i])));
}
#define PANELS_SIDE_BY_SIDE 2
#else
#define PANELS_SIDE_BY_SIDE 1
#endif

static inline void to_floats(const uint16_t *half, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(half + i))));
    for (; i < n; i++) out[i] = _cvtsh_ss(half[i]);
}

/* Row n's groups' scales and zeros (minimum + 8 * scale: the value of code 8), as fp32. */
static void row_scales(const uint16_t *scale, const void *minimum, int min_fp32, int64_t n, int64_t ng, float *sw,
                       float *zw) {
    to_floats(scale + n * ng, sw, ng);
    if (min_fp32) {
        for (int64_t g = 0; g < ng; g++) zw[g] = ((const float *)minimum)[n * ng + g];
    } else {
        to_floats((const uint16_t *)minimum + n * ng, zw, ng);
    }
    for (int64_t g = 0; g < ng; g++) zw[g] += 8.f * sw[g];
}

/* w panels of 8 rows (the rows from `rows` on, row_bytes apart) packed side by side. Two at a time
 * (AVX-512) as one 16 x 16 transpose of 4-byte units per 64 bytes of each row: with the scales'
 * transposes below, a decode pass's packing took half a 16-row call's time done 8 rows at a time. */
static void pack_panels(const uint8_t *rows, int64_t row_bytes, int w, uint8_t *panel) {
    int64_t t0 = 0;
#if defined(FS_VNNI) && FS_VNNI == 512
    if (w == 2)
        for (; t0 + 16 <= row_bytes / 4; t0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                r[j] = _mm512_loadu_si512((const void *)(rows + j * row_bytes + 4 * t0));
                /* the next panels' line (a hint: past the weight's end it is dropped): 16 rows read
                 * side by side outrun the hardware's prefetch (-10% time at 16 rows of x) */
                _mm_prefetch((const char *)(rows + (16 + j) * row_bytes + 4 * t0), _MM_HINT_T1);
            }
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512((void *)(panel + (t0 + i) * 64), r[i]);
        }
#endif
    for (int h = 0; h < w; h++) /* the rest (all of it on AVX2): 8 rows by 8 rows */
        for (int64_t t = t0; t < row_bytes / 4; t += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; j++)
                r[j] = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(rows + (8 * h + j) * row_bytes + 4 * t)));
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps((float *)(panel + (t + i) * 32 * w + 32 * h), r[i]);
        }
}

/* The panels' rows' scales and zeros (row_scales' values) as sp / zp [groups][8 w] (lane = row);
 * returns whether every zero is 0. 8 groups of 8 rows at a time, transposed in registers. */
static int panel_scales(const uint16_t *scale, const void *minimum, int min_fp32, int64_t n, int64_t ng, int w,
                        float *sp, float *zp) {
    const int lanes = PANEL * w;
    const __m256 eight = _mm256_set1_ps(8.f), zero = _mm256_setzero_ps();
    int zero_free = 1;
    int64_t g0 = 0;
    for (; g0 + 8 <= ng; g0 += 8)
        for (int h = 0; h < w; h++) {
            __m256 sv[8], zv[8];
            for (int j = 0; j < 8; j++) {
                const int64_t at = (n + 8 * h + j) * ng + g0;
                sv[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + at)));
                zv[j] = min_fp32 ? _mm256_loadu_ps((const float *)minimum + at)
                                 : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)minimum + at)));
                zv[j] = _mm256_add_ps(zv[j], _mm256_mul_ps(eight, sv[j])); /* row_scales' zw += 8.f * sw */
                zero_free &= _mm256_movemask_ps(_mm256_cmp_ps(zv[j], zero, _CMP_EQ_OQ)) == 0xFF;
            }
            transpose8(sv);
            transpose8(zv);
            for (int i = 0; i < 8; i++) {
                _mm256_storeu_ps(sp + (g0 + i) * lanes + 8 * h, sv[i]);
                _mm256_storeu_ps(zp + (g0 + i) * lanes + 8 * h, zv[i]);
            }
        }
    if (g0 < ng) { /* the last ng % 8 groups, row by row */
        float sw[ng], zw[ng];
        for (int j = 0; j < lanes; j++) {
            row_scales(scale, minimum, min_fp32, n + j, ng, sw, zw);
            for (int64_t g = g0; g < ng; g++) {
                sp[g * lanes + j] = sw[g];
                zp[g * lanes + j] = zw[g];
                zero_free &= zw[g] == 0.f;
            }
        }
    }
    return zero_free;
}

/* Rows [m0, m1) of x against one packed panel (w = 2: two side by side; PS: see panel_tile), 4 rows
 * a tile while they last. zp NULL: every zero of the panel's rows is 0 (Q4_0's): its term is left out (+0 either way
 * for finite x; a sum of x that overflowed no longer turns the output into a NaN). */
static inline __attribute__((always_inline)) void panel_rows(const int w, const int pairs, const uint8_t *panel,
                                                            const float *sp, const float *zp, const int8_t *xq,
                                                            const float *xd, const float *xg, const float *xh,
                                                            int64_t m0, int64_t m1, int64_t K, int64_t G, int64_t XB,
                                                            float *y, int64_t ldy, const int64_t PS,
                                                            const Ahead *ahead) {
    int64_t m = m0;
#define TILES(P, TILE)                                                                                        \
    do {                                                                                                      \
        for (; m + 4 <= m1; m += 4) TILE(4, P, panel, sp, zp, xq, xd, xg, xh, m, K, G, XB, y, ldy, PS, m == m0 ? ahead : NULL);           \
        for (; m + 2 <= m1; m += 2) TILE(2, P, panel, sp, zp, xq, xd, xg, xh, m, K, G, XB, y, ldy, PS, m == m0 ? ahead : NULL);           \
        for (; m < m1; m++) TILE(1, P, panel, sp, zp, xq, xd, xg, xh, m, K, G, XB, y, ldy, PS, m == m0 ? ahead : NULL);                   \
    } while (0)
#if PANELS_SIDE_BY_SIDE == 2
    if (w == 2) {
        if (pairs) TILES(1, panel_tile16);
        else TILES(0, panel_tile16);
        return;
    }
#endif
    if (pairs) TILES(1, panel_tile);
    else TILES(0, panel_tile);
#undef TILES
}

/* panel_rows with the block and group sizes as constants where they are the usual ones (GGUF
 * Q4_0's 32 / 32; 64 and 128 groups), so that the tiles' block loops unroll whole and the groups'
 * indices need no division: -7% time at 512 rows with Q4_0's. */
static void panel_rows_sized(int w, int pairs, const uint8_t *panel, const float *sp, const float *zp, const int8_t *xq,
                             const float *xd, const float *xg, const float *xh, int64_t m0, int64_t m1, int64_t K,
                             int64_t G, int64_t XB, float *y, int64_t ldy, int64_t PS,
                             const Ahead *ahead) {
#define SIZED(XB_, G_) panel_rows(w, pairs, panel, sp, zp, xq, xd, xg, xh, m0, m1, K, G_, XB_, y, ldy, PS, ahead)
    if (XB == 32 && G == 32) SIZED(32, 32);
    else if (XB == 64 && G == 64) SIZED(64, 64);
    else if (XB == 128 && G == 128) SIZED(128, 128);
    else SIZED(XB, G);
#undef SIZED
}

/* Rows of x per sweep over the weight rows (a multiple of 4): their int8 copy (256 KiB) stays in L2
 * beside the panel (128 KiB measured 9% slower at K = 11008 on a 512 KiB-L2 EPYC; 384 the same). */
static inline int64_t sweep_rows(int64_t K) {
    const int64_t rows = (256 * 1024) / K;
    return rows < 4 ? 4 : rows - rows % 4;
}

/* Output columns [n0, n1) of y fp32 [M, N] (row stride ldy), from xq / xd / xg / xh as fs_quantize_x
 * wrote them with block size XB (32, or 64 / 128 dividing G), the weight's rows row-major: codes
 * uint8 [N, K / 2]; scale fp16 [N, K / G]; minimum fp16 or fp32 (min_fp32) [N, K / G]. Needs K % 64
 * == 0, G % 32 == 0, K % G == 0, and for the split-halves layout K / 2 % XB == 0. */
static void gemm_rowmajor(const int8_t *xq, const float *xd, const float *xg, const float *xh, int64_t M, int64_t K,
                          int64_t G, int64_t XB, const uint8_t *codes, const uint16_t *scale, const void *minimum,
                          int min_fp32, int pairs, int64_t n0, int64_t n1, float *y, int64_t ldy) {
    const int64_t ng = K / G;
    float sw[ng], zw[ng]; /* the row's scales, and its groups' values of code 8 (minimum + 8 * scale) */
    const int64_t m_block = sweep_rows(K);
    /* Whole panels of 8 rows first where x has rows enough to repay the packing; the rest row by row. */
    int64_t n_rows = n0;
    if (M >= PANEL_MIN_ROWS && n1 - n0 >= PANEL) {
        const int64_t n_panels = (n1 - n0) / PANEL;
        /* More than one sweep (prefill rows): every panel packed once up front, the thread's share of
         * the weight copied once (11 MB for llama-2-7b's down_proj), not once per sweep (-13% time at
         * 512 rows, K = 11008); one sweep: one panel at a time, in L1/L2. */
        const int all = M > m_block, side = PANELS_SIDE_BY_SIDE;
        const int64_t slots = all ? n_panels : side; /* panels held at once */
        uint8_t *panels = aligned_alloc(64, (size_t)(K / 2) * PANEL * slots);
        float *swp = malloc(sizeof(float) * ng * PANEL * slots), *zwp = malloc(sizeof(float) * ng * PANEL * slots);
        uint8_t *zero_free = malloc((size_t)slots); /* a slot's zeros all 0 (Q4_0's): their term left out */
        if (!panels || !swp || !zwp || !zero_free) abort();
        for (int64_t m0 = 0; m0 < M; m0 += m_block) {
            const int64_t m1 = m0 + m_block < M ? m0 + m_block : M;
            for (int64_t p = 0; p < n_panels;) {
                const int64_t n = n0 + p * PANEL, slot = all ? p : 0;
                const int w = p + side <= n_panels ? side : 1; /* panels side by side in this one */
                uint8_t *panel = panels + slot * (K / 2) * PANEL;
                float *sp = swp + slot * ng * PANEL, *zp = zwp + slot * ng * PANEL;
                if (!all || m0 == 0) {
                    pack_panels(codes + n * (K / 2), K / 2, w, panel);
                    zero_free[slot] = panel_scales(scale, minimum, min_fp32, n, ng, w, sp, zp);
                }
                panel_rows_sized(w, pairs, panel, sp, zero_free[slot] ? NULL : zp, xq, xd, xg, xh, m0, m1, K, G, XB, y + n, ldy,
                                 32 * w, NULL);
                p += w;
            }
        }
        free(panels);
        free(swp);
        free(zwp);
        free(zero_free);
        n_rows = n0 + n_panels * PANEL;
    }
    for (int64_t m0 = 0; m0 < M; m0 += m_block) {
        const int64_t m1 = m0 + m_block < M ? m0 + m_block : M;
        for (int64_t n = n_rows; n < n1; n++) {
            row_scales(scale, minimum, min_fp32, n, ng, sw, zw);
            const uint8_t *row = codes + n * (K / 2);
            float *yn = y + n;
            int64_t m = m0;
#define RUN(MB, P) (XB == 32 ? tile32(MB, P, row, sw, zw, xq, xd, xg, xh, m, K, G, yn, ldy) \
                             : tile_wide(MB, P, row, sw, zw, xq, xd, xg, xh, m, K, G, XB, yn, ldy))
            if (pairs) {
                for (; m + 4 <= m1; m += 4) RUN(4, 1);
                for (; m < m1; m++) RUN(1, 1);
            } else {
                for (; m + 4 <= m1; m += 4) RUN(4, 0);
                for (; m < m1; m++) RUN(1, 0);
            }
#undef RUN
        }
    }
}

/* ---- weights stored in panels (quant/panels.py) ------------------------------------------------
 * Rows [0, packed_rows) of a weight kept resident for this kernel lie in 16-row panels, packed once
 * at load: panel p's codes are bytes [p, p + 1) * 16 * K / 2, byte 64 t + 32 h + 4 j + i = row
 * 16 p + 8 h + j's byte 4 t + i (two 8-row panels side by side, as pack_panels writes them), and its
 * scales and minimums [groups][16] (lane = row). The rows after them (fewer than 16) are row-major.
 * Each output goes the way it goes from row-major rows (the same panels and tiles, the same bits),
 * without the per-call packing that took half of a 16-row call's time. */

/* Panel rows [n, n + 16)'s scales and zeros, lanes 8 h .. 8 h + lanes - 1, as sp / zp [groups][lanes]
 * (lanes 16: both halves; 8: half h); returns whether every zero is 0. */
static int stored_scales(const uint16_t *scale, const void *minimum, int min_fp32, int64_t n, int64_t ng, int lanes,
                         int h, float *sp, float *zp) {
    const __m256 eight = _mm256_set1_ps(8.f), zero = _mm256_setzero_ps();
    int zero_free = 1;
    for (int64_t g = 0; g < ng; g++)
        for (int q = 0; q < lanes; q += 8) {
            const int64_t at = n * ng + 16 * g + 8 * h + q;
            const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + at)));
            __m256 zv = min_fp32 ? _mm256_loadu_ps((const float *)minimum + at)
                                 : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)minimum + at)));
            zv = _mm256_add_ps(zv, _mm256_mul_ps(eight, sv)); /* row_scales' zw += 8.f * sw */
            zero_free &= _mm256_movemask_ps(_mm256_cmp_ps(zv, zero, _CMP_EQ_OQ)) == 0xFF;
            _mm256_storeu_ps(sp + g * lanes + q, sv);
            _mm256_storeu_ps(zp + g * lanes + q, zv);
        }
    return zero_free;
}

/* A stored panel back to 16 row-major rows (codes [16][K / 2], scales and minimums [16][groups]):
 * fewer rows of x than a panel tile takes go row by row, as they do from row-major rows. */
static void unpack_panel(const uint8_t *panel, const uint16_t *scale, const void *minimum, int min_fp32, int64_t K,
                         int64_t ng, uint8_t *codes, uint16_t *sc, void *mn) {
    int64_t t0 = 0; /* the transposes that pack panels, undone (each is its own inverse) */
#if defined(FS_VNNI) && FS_VNNI == 512
    for (; t0 + 16 <= K / 8; t0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(panel + 64 * (t0 + i)));
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)(codes + j * (K / 2) + 4 * t0), r[j]);
    }
#endif
    for (; t0 < K / 8; t0 += 8)
        for (int h = 0; h < 2; h++) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(panel + 64 * (t0 + i) + 32 * h)));
            transpose8(r);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps((float *)(codes + (8 * h + j) * (K / 2) + 4 * t0), r[j]);
        }
    const size_t mb = min_fp32 ? 4 : 2;
    for (int64_t g = 0; g < ng; g++)
        for (int r = 0; r < 16; r++) {
            sc[r * ng + g] = scale[16 * g + r];
            memcpy((char *)mn + (r * ng + g) * mb, (const char *)minimum + (16 * g + r) * mb, mb);
        }
}

static void gemm_stored(const int8_t *xq, const float *xd, const float *xg, const float *xh, int64_t M, int64_t K,
                        int64_t G, int64_t XB, const uint8_t *codes, const uint16_t *scale, const void *minimum,
                        int min_fp32, int pairs, int64_t n0, int64_t n1, float *y, int64_t ldy) {
    const int64_t ng = K / G, mbytes = min_fp32 ? 4 : 2;
    if (M < PANEL_MIN_ROWS) { /* row by row, from each panel unpacked */
        uint8_t *rows = malloc((size_t)(K / 2) * 16);
        uint16_t *sc = malloc(sizeof(uint16_t) * 16 * ng);
        void *mn = malloc((size_t)(mbytes * 16 * ng));
        if (!rows || !sc || !mn) abort();
        for (int64_t n = n0; n < n1; n += 16) {
            unpack_panel(codes + n * (K / 2), scale + n * ng, (const char *)minimum + n * ng * mbytes, min_fp32, K, ng,
                         rows, sc, mn);
            gemm_rowmajor(xq, xd, xg, xh, M, K, G, XB, rows, sc, mn, min_fp32, pairs, 0, 16, y + n, ldy);
        }
        free(rows);
        free(sc);
        free(mn);
        return;
    }
    const int64_t m_block = sweep_rows(K);
    float *sp = malloc(sizeof(float) * ng * 16), *zp = malloc(sizeof(float) * ng * 16);
    if (!sp || !zp) abort();
    for (int64_t m0 = 0; m0 < M; m0 += m_block) {
        const int64_t m1 = m0 + m_block < M ? m0 + m_block : M;
        for (int64_t n = n0; n < n1; n += 16) {
            const uint8_t *panel = codes + n * (K / 2);
            const int64_t next = n + 16; /* the next panel of this range (its scales follow this one's) */
            const Ahead ahead = {(const char *)(codes + next * (K / 2)), (const char *)(scale + next * ng),
                                 (const char *)minimum + next * ng * mbytes, K / 8, ng / 2, ng * mbytes / 4};
            const Ahead *fetch = next < n1 ? &ahead : NULL;
#if PANELS_SIDE_BY_SIDE == 2
            const int zero_free = stored_scales(scale, minimum, min_fp32, n, ng, 16, 0, sp, zp);
            panel_rows_sized(2, pairs, panel, sp, zero_free ? NULL : zp, xq, xd, xg, xh, m0, m1, K, G, XB, y + n, ldy, 64,
                             fetch);
#else
            for (int h = 0; h < 2; h++) { /* each half an 8-row panel, its groups 64 bytes apart */
                const int zero_free = stored_scales(scale, minimum, min_fp32, n, ng, 8, h, sp, zp);
                panel_rows_sized(1, pairs, panel + 32 * h, sp, zero_free ? NULL : zp, xq, xd, xg, xh, m0, m1, K, G, XB,
                                 y + n + 8 * h, ldy, 64, h ? NULL : fetch);
            }
#endif
        }
    }
    free(sp);
    free(zp);
}

/* Output columns [n0, n1) of y (gemm_rowmajor's), rows [0, packed_rows) of the weight stored in
 * panels (a multiple of 16; 0: all row-major) and n0 a multiple of 16 where packed_rows > n0. */
void fs_q4_gemm(const int8_t *xq, const float *xd, const float *xg, const float *xh, int64_t M, int64_t K, int64_t G,
                int64_t XB, const uint8_t *codes, const uint16_t *scale, const void *minimum, int min_fp32, int pairs,
                int64_t packed_rows, int64_t n0, int64_t n1, float *y, int64_t ldy) {
    const int64_t split = n1 < packed_rows ? n1 : packed_rows;
    if (n0 < split)
        gemm_stored(xq, xd, xg, xh, M, K, G, XB, codes, scale, minimum, min_fp32, pairs, n0, split, y, ldy);
    if ((n0 > split ? n0 : split) < n1)
        gemm_rowmajor(xq, xd, xg, xh, M, K, G, XB, codes, scale, minimum, min_fp32, pairs, n0 > split ? n0 : split, n1,
                      y, ldy);
}

/* ---- the whole call on one OpenMP team ---------------------------------------------------------
 * Built with -fopenmp, this file needs libgomp.so.1; in a process that imported torch the loader
 * resolves that soname to the copy torch already loaded, so these loops run on torch's own worker
 * threads. Splitting over Python threads instead (one ctypes call per range) cost the decode
 * passes 30-45% of the kernel's isolated rate: torch's workers, spinning after every small torch
 * op, took a core from the kernel's second thread, and each range's hand-off waited on the GIL
 * behind the engine's other Python threads. */

/* fs_quantize_x over M rows on `threads` threads (rows in contiguous shares). */
void fs_quantize_x_all(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t G, int64_t XB, int pairs,
                       int8_t *xq, float *xd, float *xg, float *xh, int8_t *rq, float *rd, float *rg, float *rh,
                       int threads) {
    const int64_t nb = K / XB, ng = K / G;
    const int parts = (int64_t)threads < M ? threads : (int)M;
#pragma omp parallel for schedule(static, 1) num_threads(parts)
    for (int p = 0; p < parts; p++) {
        const int64_t r0 = M * p / parts, r1 = M * (p + 1) / parts;
        if (r1 > r0)
            fs_quantize_x(x + r0 * ldx, r1 - r0, K, ldx, G, XB, pairs, xq + r0 * K, xd + r0 * nb, xg + r0 * ng,
                          xh + r0 * ng, rq ? rq + r0 * K : NULL, rq ? rd + r0 * nb : NULL, rq ? rg + r0 * ng : NULL,
                          rq ? rh + r0 * ng : NULL);
    }
}

/* fs_q4_gemm over output columns [0, N) in ranges of `step` (a multiple of 8; of 16 for a weight stored in panels), taken in turn by
 * `threads` threads: a core that other work slows takes fewer of them. */
void fs_q4_gemm_all(const int8_t *xq, const float *xd, const float *xg, const float *xh, int64_t M, int64_t K, int64_t G,
                    int64_t XB, const uint8_t *codes, const uint16_t *scale, const void *minimum, int min_fp32,
                    int pairs, int64_t packed_rows, int64_t N, int64_t step, float *y, int64_t ldy,
                    int threads) {
    const int64_t pieces = (N + step - 1) / step;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t p = 0; p < pieces; p++) {
        const int64_t n0 = p * step, n1 = n0 + step < N ? n0 + step : N;
        fs_q4_gemm(xq, xd, xg, xh, M, K, G, XB, codes, scale, minimum, min_fp32, pairs, packed_rows, n0, n1, y, ldy);
    }
}
