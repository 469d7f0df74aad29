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
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>


/* x fp32 [M, K] (row stride ldx) -> xq int8 [M, K], xd fp32 [M, K / XB] (each block's step),
 * xg fp32 [M, K / G] (exact sums of x over each weight group), xh fp32 [M, K / G] (sums of the
 * rounded x, xq * xd, over each group). A block holding a NaN or an infinity gets a NaN step, so
 * the product is NaN, never a finite number that ignored it.
 * rq != NULL: also the rounding's residual, x - xq * xd, rounded the same way with 254 times finer
 * steps (|residual| <= step / 2, so its codes fit in +-127) into rq / rd / rh, with rg = 0 (the
 * exact sum is counted once): as M more rows of x, the kernel's product over both is x rounded
 * to ~16 bits per block instead of 8. */
void fs_quantize_x(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t G, int64_t XB, int pairs,
                   int8_t *xq, float *xd, float *xg, float *xh, int8_t *rq, float *rd, float *rg, float *rh) {
    const int64_t nb = K / XB, ng = K / G;
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
                const int64_t k = b * XB + i; /* pairs: each 64 values as even of 1st 32, even of 2nd, odd, odd */
                const int64_t pos = pairs ? (k / 64) * 64 + (k % 2) * 32 + ((k / 32) % 2) * 16 + (k % 32) / 2 : k;
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

/* int16 pair sums of unsigned codes x signed int8 (|each| <= 2 * 15 * 127: two may be added). */
static inline __m256i pair_sums(__m256i codes, const int8_t *x) {
    return _mm256_maddubs_epi16(codes, _mm256_loadu_si256((const __m256i *)x));
}

static inline __m256 to_float(__m256i sums16) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(sums16, _mm256_set1_epi16(1)));
}

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
                const __m256i s16 = _mm256_add_epi16(pair_sums(lo, xr), pair_sums(hi, xr + 32));
                const __m256 step = _mm256_set_m128(_mm_set1_ps(sw[(64 * c + 32) / G] * dr[1]), _mm_set1_ps(sw[(64 * c) / G] * dr[0]));
                acc[i] = _mm256_fmadd_ps(to_float(s16), step, acc[i]);
            }
        } else { /* block c (low nibbles) and block c + nc (high nibbles) */
            for (int i = 0; i < MB; i++) {
                const int8_t *xr = xq + (m + i) * K;
                const float *dr = xd + (m + i) * nb;
                acc[i] = _mm256_fmadd_ps(to_float(pair_sums(lo, xr + 32 * c)), _mm256_set1_ps(sw[(32 * c) / G] * dr[c]), acc[i]);
                acc[i] = _mm256_fmadd_ps(to_float(pair_sums(hi, xr + 32 * (c + nc))),
                                         _mm256_set1_ps(sw[(32 * (c + nc)) / G] * dr[c + nc]), acc[i]);
            }
        }
    }
    for (int i = 0; i < MB; i++)
        y[(m + i) * ldy] = hsum(acc[i]) + dot(zw, xg + (m + i) * ng, ng) - 8.f * dot(sw, xh + (m + i) * ng, ng);
}

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
                    s16[i] = _mm256_add_epi16(s16[i], _mm256_add_epi16(pair_sums(lo, xr), pair_sums(hi, xr + 32)));
                }
            }
            const float s = sw[(b * XB) / G];
            for (int i = 0; i < MB; i++)
                acc[i] = _mm256_fmadd_ps(to_float(s16[i]), _mm256_set1_ps(s * xd[(m + i) * nb + b]), acc[i]);
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
                    slo[i] = _mm256_add_epi16(slo[i], pair_sums(lo, xr + off));
                    shi[i] = _mm256_add_epi16(shi[i], pair_sums(hi, xr + K / 2 + off));
                }
            }
            const float sl = sw[(b * XB) / G], sh = sw[((b + half) * XB) / G];
            for (int i = 0; i < MB; i++) {
                const float *dr = xd + (m + i) * nb;
                acc[i] = _mm256_fmadd_ps(to_float(slo[i]), _mm256_set1_ps(sl * dr[b]), acc[i]);
                acc[i] = _mm256_fmadd_ps(to_float(shi[i]), _mm256_set1_ps(sh * dr[b + half]), acc[i]);
            }
        }
    }
    for (int i = 0; i < MB; i++)
        y[(m + i) * ldy] = hsum(acc[i]) + dot(zw, xg + (m + i) * ng, ng) - 8.f * dot(sw, xh + (m + i) * ng, ng);
}

static inline void to_floats(const uint16_t *half, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(half + i))));
    for (; i < n; i++) out[i] = _cvtsh_ss(half[i]);
}

/* Output columns [n0, n1) of y fp32 [M, N] (row stride ldy), from xq / xd / xg / xh as fs_quantize_x
 * wrote them with block size XB (32, or 64 / 128 dividing G). codes uint8 [N, K / 2]; scale fp16
 * [N, K / G]; minimum fp16 or fp32 (min_fp32) [N, K / G]. Needs K % 64 == 0, G % 32 == 0, K % G == 0,
 * and for the split-halves layout K / 2 % XB == 0. */
void fs_q4_gemm(const int8_t *xq, const float *xd, const float *xg, const float *xh, int64_t M, int64_t K, int64_t G, int64_t XB,
                const uint8_t *codes, const uint16_t *scale, const void *minimum, int min_fp32, int pairs,
                int64_t n0, int64_t n1, float *y, int64_t ldy) {
    const int64_t ng = K / G;
    float sw[ng], zw[ng]; /* the row's scales, and its groups' values of code 8 (minimum + 8 * scale) */
    /* Rows of x per sweep over the weight rows: their int8 copy (m_block * K bytes) stays in L2. */
    int64_t m_block = (128 * 1024) / K;
    m_block = m_block < 4 ? 4 : m_block - m_block % 4;
    for (int64_t m0 = 0; m0 < M; m0 += m_block) {
        const int64_t m1 = m0 + m_block < M ? m0 + m_block : M;
        for (int64_t n = n0; n < n1; n++) {
            to_floats(scale + n * ng, sw, ng);
            if (min_fp32) {
                for (int64_t g = 0; g < ng; g++) zw[g] = ((const float *)minimum)[n * ng + g];
            } else {
                to_floats((const uint16_t *)minimum + n * ng, zw, ng);
            }
            for (int64_t g = 0; g < ng; g++) zw[g] += 8.f * sw[g];
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
