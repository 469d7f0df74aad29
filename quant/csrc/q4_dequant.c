/* 4-bit weights dequantized on the CPU into fp32 or bf16, the arithmetic of quant/groupwise.py's
 * `dequantize`: value = code * scale + minimum in fp32 (the product is exact: a code has 4
 * significant bits, an fp16 scale 11; the sum rounds once), then rounded to nearest-even bf16 where
 * bf16 is asked for. The same bits as the torch route, which unpacks into temporaries and makes
 * three passes over memory (nibbles, widening, the affine); this makes one: a prompt pass of
 * 4-bit weights dequantizes every layer's weights once per pass (quant/fused.py). Built and loaded
 * by quant/cpu_weight_dequant.py, which states the layouts it covers.
 *
 * Layouts (quant/packing.py), per line of K values (one weight row), groups of G along it:
 *   0: split halves of the line: byte i holds value i (low nibble) and value i + K / 2 (high);
 *   1: adjacent pairs: byte i holds values 2i (low) and 2i + 1 (high);
 *   2: split halves of each group: byte g * G / 2 + i holds values g * G + i and g * G + i + G / 2.
 * Scale and minimum: fp16, one per group, row-major [rows, K / G].
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float v) {
    /* round to nearest, ties to even (torch's conversion; the values are finite) */
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* n values from the nibbles of `bytes` (shift 0: low, 4: high), one group's scale s and minimum m,
 * into out[i * stride] (fp32 or bf16). */
static inline void emit(const uint8_t *bytes, int shift, int64_t n, float s, float m, void *out, int64_t at,
                        int64_t stride, int bf16) {
    if (bf16) {
        uint16_t *o = (uint16_t *)out + at;
        for (int64_t i = 0; i < n; i++) {
            const float product = (float)((bytes[i] >> shift) & 15) * s;
            o[i * stride] = to_bf16(product + m);
        }
    } else {
        float *o = (float *)out + at;
        for (int64_t i = 0; i < n; i++) {
            const float product = (float)((bytes[i] >> shift) & 15) * s;
            o[i * stride] = product + m;
        }
    }
}

/* Line r: K values from K / 2 bytes of `codes`, groups of G. */
static void dequantize_line(const uint8_t *codes, const uint16_t *scale, const uint16_t *minimum, int64_t r,
                            int64_t K, int64_t G, int layout, void *out, int bf16) {
    const uint8_t *line = codes + r * (K / 2);
    const uint16_t *sc = scale + r * (K / G), *mn = minimum + r * (K / G);
    const int64_t base = r * K, half = K / 2;
    for (int64_t g = 0; g < K / G; g++) {
        const float s = _cvtsh_ss(sc[g]), m = _cvtsh_ss(mn[g]);
        const int64_t k0 = g * G, k1 = k0 + G;
        if (layout == 1) {
            emit(line + k0 / 2, 0, G / 2, s, m, out, base + k0, 2, bf16);
            emit(line + k0 / 2, 4, G / 2, s, m, out, base + k0 + 1, 2, bf16);
        } else if (layout == 2) {
            emit(line + k0 / 2, 0, G / 2, s, m, out, base + k0, 1, bf16);
            emit(line + k0 / 2, 4, G / 2, s, m, out, base + k0 + G / 2, 1, bf16);
        } else { /* the group's values below K / 2 from low nibbles, the rest from high ones */
            const int64_t split = k1 < half ? k1 : (k0 > half ? k0 : half);
            if (split > k0) emit(line + k0, 0, split - k0, s, m, out, base + k0, 1, bf16);
            if (k1 > split) emit(line + split - half, 4, k1 - split, s, m, out, base + split, 1, bf16);
        }
    }
}

/* Lines [0, rows), taken in runs by `threads` threads of the caller's OpenMP team (torch's own
 * workers: quant/csrc/q4_int8_gemm.c says why). out: [rows, K] fp32 (bf16 = 0) or bf16. */
void fs_q4_dequantize(const uint8_t *codes, const uint16_t *scale, const uint16_t *minimum, int64_t rows, int64_t K,
                      int64_t G, int layout, void *out, int bf16, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) dequantize_line(codes, scale, minimum, r, K, G, layout, out, bf16);
}
