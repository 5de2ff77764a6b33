/* Fused CPU kernels for vla_node/backends/cpu_kernels.py: elementwise work that eager PyTorch runs as several
 * passes over memory, done in one. Plain C, vectorized by the compiler for the machine it is built on
 * (-O3 -march=native); -ffp-contract=off keeps every multiply and add rounded on its own, as torch's ops round
 * them. bf16 values travel as their 16 bits; a bf16 -> fp32 conversion is exact, fp32 -> bf16 rounds to nearest
 * even (a NaN becomes the quiet NaN 0x7fc0), as torch's conversion does. All arrays are contiguous.
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
 * bits: its mean over at most 16 values sums them in order and divides. */
#define MAX_INNER 4096 /* the move's values per token: a stack array */
#define SHIFT(NAME, T, LOAD, STORE)                                                                            \
    void NAME(const T *restrict old, const T *restrict fresh, int64_t fresh_outer, int64_t fresh_token,       \
              const int64_t *restrict rows, int64_t n, const int64_t *restrict sample,                         \
              const int64_t *restrict at, int64_t s, T *restrict out, int64_t outer, int64_t tokens,           \
              int64_t inner) {                                                                                 \
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
                    continue;                                                                                  \
                }                                                                                              \
                for (int64_t i = 0; i < inner; i++) STORE(out + at_t + i, LOAD(old + at_t + i) + move[i]);     \
            }                                                                                                  \
        }                                                                                                      \
    }

SHIFT(vla_shift_bf16, uint16_t, load_bf16, store_bf16)
SHIFT(vla_shift_f32, float, load_f32, store_f32)
