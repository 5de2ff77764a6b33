/* Fused CPU kernels for vla_node/backends/cpu_kernels.py: elementwise work that eager PyTorch runs as several
 * passes over memory, done in one (RMSNorm, the shared-drift move, KIVI int8 quantization). Plain C, vectorized
 * by the compiler for the machine it is built on (-O3 -march=native); -ffp-contract=off keeps every multiply and
 * add rounded on its own, as torch's ops round them. bf16 values travel as their 16 bits; a bf16 -> fp32
 * conversion is exact, fp32 -> bf16 rounds to nearest even (a NaN becomes the quiet NaN 0x7fc0), as torch's
 * conversion does. All arrays are contiguous but where a kernel says otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float load_f32(const float *p) { return *p; }
static inline void store_f32(float *p, float v) { *p = v; }

static inline float load_bf16(const uint16_t *p) {
    uint32_t bits = (uint32_t)*p << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

static inline void store_bf16(uint16_t *p, float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    uint16_t rounded = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    *p = (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : rounded;
}

#define LANES 16 /* independent partial sums: the compiler vectorizes them without reordering any one of them */

/* y[r, :] = (x[r, :] * rsqrt(mean(x[r, :]^2) + eps)) * w, in fp32, rounded once to the storage type: torch's
 * rms_norm. x, y [rows, cols]; w [cols]. Only the sum of squares adds in another order than torch's reduction. */
#define RMS_NORM(NAME, T, LOAD, STORE)                                                                         \
    void NAME(const T *restrict x, const T *restrict w, T *restrict y, int64_t rows, int64_t cols, float eps) { \
        for (int64_t r = 0; r < rows; r++) {                                                                   \
            const T *xr = x + r * cols;                                                                        \
            T *yr = y + r * cols;                                                                              \
            float partial[LANES] = {0};                                                                        \
            int64_t c = 0;                                                                                     \
            for (; c + LANES <= cols; c += LANES)                                                              \
                for (int lane = 0; lane < LANES; lane++) {                                                     \
                    float v = LOAD(xr + c + lane);                                                             \
                    partial[lane] += v * v;                                                                    \
                }                                                                                              \
            for (; c < cols; c++) {                                                                            \
                float v = LOAD(xr + c);                                                                        \
                partial[0] += v * v;                                                                           \
            }                                                                                                  \
            for (int half = LANES / 2; half; half /= 2)                                                        \
                for (int lane = 0; lane < half; lane++) partial[lane] += partial[lane + half];                 \
            float scale = 1.0f / sqrtf(partial[0] / (float)cols + eps);                                        \
            for (c = 0; c < cols; c++) STORE(yr + c, (LOAD(xr + c) * scale) * LOAD(w + c));                   \
        }                                                                                                      \
    }

RMS_NORM(vla_rms_norm_bf16, uint16_t, load_bf16, store_bf16)
RMS_NORM(vla_rms_norm_f32, float, load_f32, store_f32)

/* The shared-drift move of runtime/vision_cache.shift_reused over [outer, T, inner] (tokens along T). Per o, the
 * move is the mean change of the sample: move[i] = sum_k (fresh[o, at[k], i] - old[o, sample[k], i]) / s, each
 * difference in fp32, summed in k's order; then out[o, t, :] = old[o, t, :] + move in fp32, rounded once, for every
 * token t not in `rows`, and out[o, t, :] = fresh[o, j, :] where rows[j] == t. rows: sorted int64 [n]; sample and
 * at int64 [s] (s >= 1; at: the sample's places among the rows); fresh [outer, n, inner] at strides (fresh_outer,
 * fresh_token, 1): a view such as a permuted q|k|v; inner <= MAX_INNER. torch's form of it (index_select,
 * a subtraction and a mean over the sample, a copy to fp32, an add, a copy back, an index_copy) gives the same
 * bits: its mean over at most 16 values sums them in order and divides. With `acc` (else NULL; out's layout, apart
 * from it) the residual stream takes the result too: acc += out as stored, one rounding, as torch's add_ does. */
#define MAX_INNER 4096 /* the move's values per token: a stack array */
#define SHIFT(NAME, T, LOAD, STORE)                                                                            \
    void NAME(const T *restrict old, const T *restrict fresh, int64_t fresh_outer, int64_t fresh_token,       \
              const int64_t *restrict rows, int64_t n, const int64_t *restrict sample,                         \
              const int64_t *restrict at, int64_t s, T *restrict out, int64_t outer, int64_t tokens,           \
              int64_t inner, T *restrict acc) {                                                                \
        float move[MAX_INNER];                                                                                 \
        for (int64_t o = 0; o < outer; o++) {                                                                  \
            const T *fresh_o = fresh + o * fresh_outer, *old_o = old + o * tokens * inner;                     \
            for (int64_t i = 0; i < inner; i++) move[i] = 0.0f;                                                \
            for (int64_t k = 0; k < s; k++) {                                                                  \
                const T *a = fresh_o + at[k] * fresh_token, *b = old_o + sample[k] * inner;                    \
                for (int64_t i = 0; i < inner; i++) move[i] += LOAD(a + i) - LOAD(b + i);                      \
            }                                                                                                  \
            for (int64_t i = 0; i < inner; i++) move[i] /= (float)s;                                           \
            int64_t j = 0;                                                                                     \
            for (int64_t t = 0; t < tokens; t++) {                                                             \
                const int64_t at_t = (o * tokens + t) * inner;                                                 \
                if (j < n && rows[j] == t) {                                                                   \
                    memcpy(out + at_t, fresh_o + j * fresh_token, (size_t)inner * sizeof(T));                  \
                    j++;                                                                                       \
                } else {                                                                                       \
                    for (int64_t i = 0; i < inner; i++) STORE(out + at_t + i, LOAD(old + at_t + i) + move[i]); \
                }                                                                                              \
                if (acc)                                                                                       \
                    for (int64_t i = 0; i < inner; i++)                                                        \
                        STORE(acc + at_t + i, LOAD(acc + at_t + i) + LOAD(out + at_t + i));                    \
            }                                                                                                  \
        }                                                                                                      \
    }

SHIFT(vla_shift_bf16, uint16_t, load_bf16, store_bf16)
SHIFT(vla_shift_f32, float, load_f32, store_f32)

/* KIVI int8 (kv/quant.py), fp16 scales and zero points as their 16 bits. Per group of values (a key channel over
 * `group` consecutive tokens, the last group of a row possibly shorter; a value token over its head_dim):
 * zero = lo rounded to fp16 toward -inf, scale = max((hi - zero) / 255, fp16's smallest normal) rounded toward
 * +inf, code = clamp(round_half_even((x - zero) / scale), 0, 255) - 128; x' = (code + 128) * scale + zero, each
 * step in fp32 and rounded once, as quant.py's torch ops do (the same bits). */
#if defined(__F16C__)
#include <immintrin.h>
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t float_to_half(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#else /* the same conversions in integer arithmetic */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalize */
        int shift = 0;
        while (!(man & 0x400u)) {
            man <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3ffu) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_half(float f) { /* round to nearest even; overflow to infinity */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) return sign | 0x7e00u; /* NaN */
    if (abs >= 0x477ff000u) return sign | 0x7c00u; /* rounds past 65504: infinity */
    if (abs >= 0x38800000u) { /* normal half */
        uint32_t mant = abs + 0xc8000fffu + ((abs >> 13) & 1u); /* rebias exponent (-112 << 23) and round */
        return sign | (uint16_t)(mant >> 13);
    }
    if (abs < 0x33000000u) return sign; /* below half the smallest subnormal: zero */
    /* subnormal half: value = man * 2^-24 */
    uint32_t e = abs >> 23, man = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14 .. 24 */
    uint32_t h = man >> shift, rest = man & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
    if (rest > halfway || (rest == halfway && (h & 1u))) h++;
    return sign | (uint16_t)h;
}
#endif

static inline uint16_t half_toward(uint16_t h, int up) { /* nextafter toward +inf (up) or -inf */
    if ((h & 0x7fffu) == 0) return up ? 0x0001u : 0x8001u;
    return ((h & 0x8000u) == 0) == (up != 0) ? (uint16_t)(h + 1u) : (uint16_t)(h - 1u);
}

static inline void kivi_params(float lo, float hi, uint16_t *scale, uint16_t *zero) {
    uint16_t z = float_to_half(lo);
    if (half_to_float(z) > lo) z = half_toward(z, 0);
    float step = (hi - half_to_float(z)) / 255.0f;
    if (step < 6.103515625e-05f) step = 6.103515625e-05f; /* fp16's smallest normal */
    uint16_t s = float_to_half(step);
    if (half_to_float(s) < step) s = half_toward(s, 1);
    *scale = s;
    *zero = z;
}

static inline int8_t kivi_code(float x, float scale, float zero) {
    /* round half to even as torch.round does: adding and subtracting 1.5 * 2^23 leaves the nearest integer for
     * |level| < 2^22 (the FPU's default rounding); beyond that the result stays past the clamp's bounds */
    float level = ((x - zero) / scale + 12582912.0f) - 12582912.0f;
    level = level < 0.0f ? 0.0f : level > 255.0f ? 255.0f : level;
    return (int8_t)((int)level - 128);
}

/* x [outer, tokens, D] contiguous -> codes [outer, tokens, D]; scale, zero [outer, groups, D] (keys) */
#define KIVI_KEYS(NAME, T, LOAD)                                                                               \
    void NAME(const T *restrict x, int64_t outer, int64_t tokens, int64_t D, int64_t group,                    \
              int8_t *restrict codes, uint16_t *restrict scale, uint16_t *restrict zero) {                     \
        const int64_t groups = (tokens + group - 1) / group;                                                   \
        float lo[MAX_INNER], hi[MAX_INNER], s[MAX_INNER], z[MAX_INNER];                                        \
        for (int64_t o = 0; o < outer; o++)                                                                    \
            for (int64_t g = 0; g < groups; g++) {                                                             \
                const int64_t first = g * group, end = first + group < tokens ? first + group : tokens;        \
                const T *xg = x + (o * tokens + first) * D;                                                    \
                for (int64_t d = 0; d < D; d++) lo[d] = hi[d] = LOAD(xg + d);                                  \
                for (int64_t t = 1; t < end - first; t++)                                                      \
                    for (int64_t d = 0; d < D; d++) {                                                          \
                        float v = LOAD(xg + t * D + d);                                                        \
                        lo[d] = v < lo[d] ? v : lo[d];                                                         \
                        hi[d] = v > hi[d] ? v : hi[d];                                                         \
                    }                                                                                          \
                uint16_t *sg = scale + (o * groups + g) * D, *zg = zero + (o * groups + g) * D;                \
                for (int64_t d = 0; d < D; d++) {                                                              \
                    kivi_params(lo[d], hi[d], sg + d, zg + d);                                                 \
                    s[d] = half_to_float(sg[d]);                                                               \
                    z[d] = half_to_float(zg[d]);                                                               \
                }                                                                                              \
                int8_t *cg = codes + (o * tokens + first) * D;                                                 \
                for (int64_t t = 0; t < end - first; t++)                                                      \
                    for (int64_t d = 0; d < D; d++)                                                            \
                        cg[t * D + d] = kivi_code(LOAD(xg + t * D + d), s[d], z[d]);                           \
            }                                                                                                  \
    }

/* x [rows, D] contiguous -> codes [rows, D]; scale, zero [rows] (values: one pair per token). Rows are taken
 * LANES at a time, one per lane, so that the per-token reductions run across tokens (min and max are exact in
 * any order). */
#define KIVI_VALUES(NAME, T, LOAD)                                                                             \
    void NAME(const T *restrict x, int64_t rows, int64_t D, int8_t *restrict codes, uint16_t *restrict scale, \
              uint16_t *restrict zero) {                                                                       \
        for (int64_t r0 = 0; r0 < rows; r0 += LANES) {                                                         \
            const int64_t n = rows - r0 < LANES ? rows - r0 : LANES;                                           \
            float lo[LANES], hi[LANES], s[LANES], z[LANES];                                                    \
            for (int64_t j = 0; j < n; j++) lo[j] = hi[j] = LOAD(x + (r0 + j) * D);                            \
            for (int64_t d = 1; d < D; d++)                                                                    \
                for (int64_t j = 0; j < n; j++) {                                                              \
                    float v = LOAD(x + (r0 + j) * D + d);                                                      \
                    lo[j] = v < lo[j] ? v : lo[j];                                                             \
                    hi[j] = v > hi[j] ? v : hi[j];                                                             \
                }                                                                                              \
            for (int64_t j = 0; j < n; j++) {                                                                  \
                kivi_params(lo[j], hi[j], scale + r0 + j, zero + r0 + j);                                      \
                s[j] = half_to_float(scale[r0 + j]);                                                           \
                z[j] = half_to_float(zero[r0 + j]);                                                            \
            }                                                                                                  \
            for (int64_t j = 0; j < n; j++)                                                                    \
                for (int64_t d = 0; d < D; d++)                                                                \
                    codes[(r0 + j) * D + d] = kivi_code(LOAD(x + (r0 + j) * D + d), s[j], z[j]);               \
        }                                                                                                      \
    }

/* codes [outer, tokens, D] contiguous with scale, zero [outer, groups, D] (keys: group tokens per group) or
 * [outer, tokens, 1] (values: group 0) -> out [outer, tokens, D], rows of an outer index `out_outer` elements
 * apart (a view into a larger buffer along tokens). */
#define KIVI_DEQUANT(NAME, T, STORE)                                                                           \
    void NAME(const int8_t *restrict codes, const uint16_t *restrict scale, const uint16_t *restrict zero,     \
              int64_t outer, int64_t tokens, int64_t D, int64_t group, T *restrict out, int64_t out_outer) {  \
        const int64_t groups = group ? (tokens + group - 1) / group : tokens;                                  \
        float s[MAX_INNER], z[MAX_INNER];                                                                      \
        for (int64_t o = 0; o < outer; o++)                                                                    \
            for (int64_t t = 0; t < tokens; t++) {                                                             \
                const int8_t *c = codes + (o * tokens + t) * D;                                                \
                T *y = out + o * out_outer + t * D;                                                            \
                if (group) {                                                                                   \
                    if (t % group == 0) {                                                                      \
                        const int64_t at = (o * groups + t / group) * D;                                       \
                        for (int64_t d = 0; d < D; d++) {                                                      \
                            s[d] = half_to_float(scale[at + d]);                                               \
                            z[d] = half_to_float(zero[at + d]);                                                \
                        }                                                                                      \
                    }                                                                                          \
                    for (int64_t d = 0; d < D; d++) STORE(y + d, (float)(c[d] + 128) * s[d] + z[d]);           \
                } else {                                                                                       \
                    const float sv = half_to_float(scale[o * tokens + t]);                                     \
                    const float zv = half_to_float(zero[o * tokens + t]);                                      \
                    for (int64_t d = 0; d < D; d++) STORE(y + d, (float)(c[d] + 128) * sv + zv);               \
                }                                                                                              \
            }                                                                                                  \
    }

KIVI_KEYS(vla_kivi_keys_bf16, uint16_t, load_bf16)
KIVI_KEYS(vla_kivi_keys_f32, float, load_f32)
KIVI_VALUES(vla_kivi_values_bf16, uint16_t, load_bf16)
KIVI_VALUES(vla_kivi_values_f32, float, load_f32)
KIVI_DEQUANT(vla_kivi_dequant_bf16, uint16_t, store_bf16)
KIVI_DEQUANT(vla_kivi_dequant_f32, float, store_f32)
