/* Gather and dequantize a compressed paged KV cache (offload/kv_cache.py) in one pass, for CPU
 * attention at decode: torch's route (advanced indexing of the codes, unpacking into a temporary,
 * an affine pass, a permuting copy) touches every value four times and took 198 ms per layer for
 * 32 sequences x 144 tokens of llama-2-7b's KV; this reads each code once and writes each value once.
 * Built and loaded by quant/cpu_kv_dequant.py, which states the layouts it covers.
 *
 * Values are `code * scale + minimum` in fp32: the product is exact (a 4-bit code times an fp16
 * scale has at most 15 significant bits), so the sum's rounding is the only one, the same bits as
 * quant.groupwise.dequantize's fp32 path. Codes are split halves per line (quant/packing.py): for a
 * line of P codes, byte i holds code i (low nibble) and code i + P/2 (high).
 */
#include <immintrin.h>
#include <stdint.h>

static inline void to_floats(const uint16_t *half, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(half + i))));
    for (; i < n; i++) out[i] = _cvtsh_ss(half[i]);
}

/* Keys, grouped per channel over the tokens of a block: block `blk` holds W = kvh * d lines of
 * `bs` codes (bs / 2 bytes each) and W fp16 scales and minimums. For sequences b in [b0, b1):
 * out[b, j, w] (fp32 [B, L, W]) = key at position j < L, read from block blocks[b, j / bs].
 * sw, mw: fp32 scratch of W values each (one block's scales and minimums). */
void fs_kv_keys(const uint8_t *data, const uint16_t *scale, const uint16_t *minimum, const int64_t *blocks,
                int64_t nb, int64_t L, int64_t W, int64_t bs, int64_t b0, int64_t b1, float *out, float *sw,
                float *mw) {
    const int64_t half = bs / 2, line = bs / 2;
    for (int64_t b = b0; b < b1; b++) {
        for (int64_t j = 0; j < nb; j++) {
            const int64_t blk = blocks[b * nb + j];
            const uint8_t *codes = data + blk * W * line;
            to_floats(scale + blk * W, sw, W);
            to_floats(minimum + blk * W, mw, W);
            const int64_t t_end = L - j * bs < bs ? L - j * bs : bs;
            for (int64_t t = 0; t < t_end; t++) {
                float *row = out + (b * L + j * bs + t) * W;
                const uint8_t *col = codes + (t < half ? t : t - half);
                const int shift = t < half ? 0 : 4;
                for (int64_t w = 0; w < W; w++)
                    row[w] = (float)((col[w * line] >> shift) & 15) * sw[w] + mw[w];
            }
        }
    }
}

/* Values, grouped per token along each head's dimension: slot s holds H lines (one per KV head)
 * of P codes (P / 2 bytes; P = d rounded up to a multiple of the group size G) and H * P / G fp16
 * scales and minimums. For sequences b in [b0, b1): out[b, j, h, :d] (fp32 [B, L, H, d]) = the
 * value at slot slots[b, j]. */
void fs_kv_values(const uint8_t *data, const uint16_t *scale, const uint16_t *minimum, const int64_t *slots,
                  int64_t L, int64_t H, int64_t d, int64_t P, int64_t G, int64_t b0, int64_t b1, float *out) {
    const int64_t half = P / 2, groups = P / G;
    float sw[groups > 0 ? groups : 1], mw[groups > 0 ? groups : 1];
    for (int64_t b = b0; b < b1; b++) {
        for (int64_t j = 0; j < L; j++) {
            const int64_t slot = slots[b * L + j];
            float *row = out + (b * L + j) * H * d;
            for (int64_t h = 0; h < H; h++) {
                const uint8_t *codes = data + (slot * H + h) * half;
                to_floats(scale + (slot * H + h) * groups, sw, groups);
                to_floats(minimum + (slot * H + h) * groups, mw, groups);
                float *o = row + h * d;
                for (int64_t g = 0; g < groups; g++) {  /* a group may straddle the two halves */
                    const float s = sw[g], m = mw[g];
                    const int64_t start = g * G, stop = (g + 1) * G < d ? (g + 1) * G : d;
                    const int64_t mid = stop < half ? stop : (start > half ? start : half);
                    for (int64_t i = start; i < mid; i++) o[i] = (float)(codes[i] & 15) * s + m;
                    for (int64_t i = mid; i < stop; i++) o[i] = (float)(codes[i - half] >> 4) * s + m;
                }
            }
        }
    }
}
