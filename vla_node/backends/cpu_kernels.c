/* Fused CPU kernels for vla_node/backends/cpu_kernels.py: elementwise work that eager PyTorch runs as several
 * passes over memory, done in one (RMSNorm, RoPE, the shared-drift move, KIVI int8 quantization, attention), and the
 * bf16 linear layer's matmul for the CPUs whose oneDNN multiplies bf16 on AVX512-BF16 rather than AMX.
 * Plain C, vectorized by the compiler for the machine it is built on (-O3 -march=native); -ffp-contract=off keeps
 * every multiply and add rounded on its own, as torch's ops round them (the bf16 move and RoPE have AVX-512 forms
 * with the same bits; the attention and the linears use intrinsics and fused multiply-adds: they do not promise
 * torch's bits). bf16 values travel as their 16 bits; a bf16 -> fp32 conversion is exact, fp32 -> bf16 rounds to
 * nearest even, as torch's conversion does (a NaN becomes the quiet NaN 0x7fc0, as torch's scalar conversion makes it;
 * its vectorized one makes 0xffff). All arrays are contiguous but where a kernel says otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

/* The linear kernels split a matmul's column tiles, the attention its kv heads, among `threads` threads of
 * OpenMP's team: built with -fopenmp, this library takes the libgomp.so.1 torch has loaded already (the same soname),
 * so its threads are torch's intra-op threads and nothing else spins beside them. Each thread computes its items
 * exactly as one thread would: the results do not depend on the thread count. Built without OpenMP, every call runs
 * on its caller. */
typedef void (*part_task)(const void *call, int64_t first, int64_t last); /* items [first, last) */
#define THREADED_MIN_MACS (1 << 21) /* a call of fewer multiply-adds (about 19 us on one Zen 4 core) runs on one */

static void run_parts(part_task task, const void *call, int64_t items, int64_t threads) {
#if defined(_OPENMP)
    if (threads > items) threads = items;
    if (threads > 1) {
#pragma omp parallel num_threads((int)threads)
        {
            const int64_t part = omp_get_thread_num(), parts = omp_get_num_threads();
            task(call, items * part / parts, items * (part + 1) / parts);
        }
        return;
    }
#endif
    (void)threads;
    task(call, 0, items);
}

static void count_part(const void *count, int64_t first, int64_t last) {
    (void)first;
    (void)last;
    __atomic_add_fetch((int *)count, 1, __ATOMIC_RELAXED); /* the caller's counter, writable */
}

/* How many parts a call of `items` items on `threads` threads runs in (1 where built without OpenMP). */
int vla_parts(int64_t items, int64_t threads) {
    int count = 0;
    run_parts(count_part, &count, items, threads);
    return count;
}

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
struct shift_call { /* a move's operands, for the threads that share its (outer, token) items */
    const void *old, *fresh;
    int64_t fresh_outer, fresh_token;
    const int64_t *rows, *sample, *at;
    int64_t n, s;
    void *out, *acc;
    int64_t outer, tokens, inner;
};

static int64_t first_row_from(const int64_t *rows, int64_t n, int64_t t) { /* the first j with rows[j] >= t */
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (rows[mid] < t)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The move over tokens: items [first, last) of the outer * tokens (o, t) pairs, each thread computing the move of
 * every o its items touch (the same values on any thread count). A move of at least THREADED_MIN_VALUES values
 * splits its items among the threads (two Zen 4 cores against one, a call from Python: a decoder layer's [196, 512]
 * with its residual stream 20 us against 26, the tower's q|k|v [3, 6, 196, 64] 24 against 38). */
#define THREADED_MIN_VALUES (1 << 16)
#define SHIFT(NAME, T, LOAD, STORE)                                                                            \
    static void NAME##_items(const void *arg, int64_t first, int64_t last) {                                   \
        const struct shift_call *call = arg;                                                                   \
        const T *restrict old = call->old, *restrict fresh = call->fresh;                                      \
        T *restrict out = call->out, *restrict acc = call->acc;                                                \
        const int64_t *rows = call->rows, *sample = call->sample, *at = call->at, n = call->n, s = call->s;    \
        const int64_t tokens = call->tokens, inner = call->inner;                                              \
        float move[MAX_INNER];                                                                                 \
        const T *fresh_o = NULL;                                                                               \
        int64_t o = -1, j = 0;                                                                                 \
        for (int64_t item = first; item < last; item++) {                                                      \
            const int64_t t = item % tokens;                                                                   \
            if (item / tokens != o) {                                                                          \
                o = item / tokens;                                                                             \
                fresh_o = fresh + o * call->fresh_outer;                                                       \
                const T *old_o = old + o * tokens * inner;                                                     \
                for (int64_t i = 0; i < inner; i++) move[i] = 0.0f;                                            \
                for (int64_t k = 0; k < s; k++) {                                                              \
                    const T *a = fresh_o + at[k] * call->fresh_token, *b = old_o + sample[k] * inner;          \
                    for (int64_t i = 0; i < inner; i++) move[i] += LOAD(a + i) - LOAD(b + i);                  \
                }                                                                                              \
                for (int64_t i = 0; i < inner; i++) move[i] /= (float)s;                                       \
                j = first_row_from(rows, n, t);                                                                \
            }                                                                                                  \
            const int64_t at_t = item * inner;                                                                 \
            if (j < n && rows[j] == t) {                                                                       \
                memcpy(out + at_t, fresh_o + j * call->fresh_token, (size_t)inner * sizeof(T));                \
                j++;                                                                                           \
            } else {                                                                                           \
                for (int64_t i = 0; i < inner; i++) STORE(out + at_t + i, LOAD(old + at_t + i) + move[i]);     \
            }                                                                                                  \
            if (acc)                                                                                           \
                for (int64_t i = 0; i < inner; i++)                                                            \
                    STORE(acc + at_t + i, LOAD(acc + at_t + i) + LOAD(out + at_t + i));                        \
        }                                                                                                      \
    }                                                                                                          \
    SHIFT_ENTRY(NAME, T)
#define SHIFT_ENTRY(NAME, T)                                                                                   \
    void NAME(const T *old, const T *fresh, int64_t fresh_outer, int64_t fresh_token, const int64_t *rows,     \
              int64_t n, const int64_t *sample, const int64_t *at, int64_t s, T *out, int64_t outer,           \
              int64_t tokens, int64_t inner, T *acc, int64_t threads) {                                        \
        const struct shift_call call = {.old = old, .fresh = fresh, .fresh_outer = fresh_outer,                \
                                        .fresh_token = fresh_token, .rows = rows, .sample = sample, .at = at,  \
                                        .n = n, .s = s, .out = out, .acc = acc, .outer = outer,                \
                                        .tokens = tokens, .inner = inner};                                     \
        const int64_t items = outer * tokens;                                                                  \
        run_parts(NAME##_items, &call, items, items * inner >= THREADED_MIN_VALUES ? threads : 1);             \
    }

/* RoPE as model/decoder.apply_rope computes it: out = x * cos + roll(x, hd / 2) * signed_sin, each product and the
 * sum rounded to the storage type (torch's three ops on that dtype; no fused multiply-add). x [heads, rows, hd] at
 * strides (x_head, x_row, 1), a view such as the heads of a q|k|v matmul's output; cos, signed_sin [rows, hd] and
 * out [heads, rows, hd] contiguous; hd even, at most MAX_HEAD_DIM. */
#define MAX_HEAD_DIM 512
#define ROPE(NAME, T, LOAD, STORE)                                                                             \
    void NAME(const T *restrict x, int64_t x_head, int64_t x_row, const T *restrict cos,                      \
              const T *restrict signed_sin, int64_t heads, int64_t rows, int64_t hd, T *restrict out) {       \
        const int64_t half = hd / 2;                                                                           \
        for (int64_t h = 0; h < heads; h++)                                                                    \
            for (int64_t r = 0; r < rows; r++) {                                                               \
                const T *xr = x + h * x_head + r * x_row, *c = cos + r * hd, *s = signed_sin + r * hd;        \
                T *o = out + (h * rows + r) * hd;                                                              \
                for (int64_t i = 0; i < hd; i++) {                                                             \
                    T a, b;                                                                                    \
                    STORE(&a, LOAD(xr + i) * LOAD(c + i));                                                     \
                    STORE(&b, LOAD(xr + (i < half ? i + half : i - half)) * LOAD(s + i));                      \
                    STORE(o + i, LOAD(&a) + LOAD(&b));                                                         \
                }                                                                                              \
            }                                                                                                  \
    }

SHIFT(vla_shift_f32, float, load_f32, store_f32)
ROPE(vla_rope_f32, float, load_f32, store_f32)
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* 32 bf16 values at a time, as two fp32 vectors: the even elements' (each 32-bit lane's low half) and the odd ones'
 * (its high half), so that nothing crosses a lane; rounded back as store_bf16 rounds (to nearest even, a NaN to
 * 0x7fc0) in integer arithmetic: the scalar forms' bits, element by element. */
typedef struct {
    __m512 even, odd;
} bf16x32;

static inline bf16x32 widen32_bf16(__m512i bits) {
    return (bf16x32){_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)),
                     _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xffff0000u)))};
}

static inline __m512i load32_bits(const uint16_t *p, __mmask32 m) { /* the values of mask m, 0 elsewhere */
    return m == 0xffffffffu ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(m, p);
}

static inline bf16x32 load32_bf16(const uint16_t *p, __mmask32 m) { return widen32_bf16(load32_bits(p, m)); }

static inline bf16x32 add32(bf16x32 a, bf16x32 b) {
    return (bf16x32){_mm512_add_ps(a.even, b.even), _mm512_add_ps(a.odd, b.odd)};
}

static inline bf16x32 mul32(bf16x32 a, bf16x32 b) {
    return (bf16x32){_mm512_mul_ps(a.even, b.even), _mm512_mul_ps(a.odd, b.odd)};
}

static inline __m512i round_high(__m512 v) { /* v rounded to bf16, in each lane's high half */
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
}

static inline __m512i narrow32_bf16(bf16x32 v) { /* 32 bf16 in element order */
#if defined(__AVX512BF16__)
    /* the bf16 unit's rounding (to nearest even) where no lane is a NaN or a denormal, which it treats otherwise
     * (a NaN keeps its payload, a denormal becomes 0): the common case in 5 instructions instead of 15 */
    const int special = 0x01 | 0x80 | 0x20; /* QNaN, SNaN, denormal */
    if (!(_mm512_fpclass_ps_mask(v.even, special) | _mm512_fpclass_ps_mask(v.odd, special))) {
        const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(v.odd, v.even); /* even elements, then odd */
        const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                               23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        return _mm512_permutexvar_epi16(order, halves);
    }
#endif
    return _mm512_or_si512(_mm512_srli_epi32(round_high(v.even), 16),
                           _mm512_and_si512(round_high(v.odd), _mm512_set1_epi32((int)0xffff0000u)));
}

static inline void store32_bits(uint16_t *p, __m512i bits, __mmask32 m) {
    if (m == 0xffffffffu)
        _mm512_storeu_si512(p, bits);
    else
        _mm512_mask_storeu_epi16(p, m, bits);
}

/* SHIFT for bf16, 32 values of a token at a time (the scalar form's operations in its order, element by element):
 * twice as fast as the compiler's vectors of the scalar form on a Zen 4 core (a decoder layer's [196, 512] with its
 * residual stream: 14 us against 27). */
static void vla_shift_bf16_items(const void *arg, int64_t first, int64_t last) {
    const struct shift_call *call = arg;
    const uint16_t *restrict old = call->old, *restrict fresh = call->fresh;
    uint16_t *restrict out = call->out, *restrict acc = call->acc;
    const int64_t *rows = call->rows, *sample = call->sample, *at = call->at, n = call->n, s = call->s;
    const int64_t tokens = call->tokens, inner = call->inner, chunks = (inner + 31) / 32;
    const __mmask32 tail = inner % 32 ? (__mmask32)((1u << (inner % 32)) - 1) : 0xffffffffu;
    bf16x32 move[MAX_INNER / 32];
    const uint16_t *fresh_o = NULL;
    int64_t o = first / tokens, t = first % tokens, j = 0;
    for (int64_t item = first; item < last; item++, t++) { /* (o, t) = (item / tokens, item % tokens) */
        if (t == tokens) {
            t = 0;
            o++;
        }
        if (item == first || t == 0) {
            fresh_o = fresh + o * call->fresh_outer;
            const uint16_t *old_o = old + o * tokens * inner;
            for (int64_t c = 0; c < chunks; c++) move[c] = (bf16x32){_mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t k = 0; k < s; k++) {
                const uint16_t *a = fresh_o + at[k] * call->fresh_token, *b = old_o + sample[k] * inner;
                for (int64_t c = 0; c < chunks; c++) {
                    const __mmask32 m = c == chunks - 1 ? tail : 0xffffffffu;
                    const bf16x32 x = load32_bf16(a + 32 * c, m), y = load32_bf16(b + 32 * c, m);
                    move[c].even = _mm512_add_ps(move[c].even, _mm512_sub_ps(x.even, y.even));
                    move[c].odd = _mm512_add_ps(move[c].odd, _mm512_sub_ps(x.odd, y.odd));
                }
            }
            const __m512 count = _mm512_set1_ps((float)s);
            for (int64_t c = 0; c < chunks; c++)
                move[c] = (bf16x32){_mm512_div_ps(move[c].even, count), _mm512_div_ps(move[c].odd, count)};
            j = first_row_from(rows, n, t);
        }
        const int64_t at_t = item * inner;
        const uint16_t *from = j < n && rows[j] == t ? fresh_o + j++ * call->fresh_token : NULL;
        for (int64_t c = 0; c < chunks; c++) {
            const __mmask32 m = c == chunks - 1 ? tail : 0xffffffffu;
            const __m512i stored = from ? load32_bits(from + 32 * c, m)
                                        : narrow32_bf16(add32(load32_bf16(old + at_t + 32 * c, m), move[c]));
            store32_bits(out + at_t + 32 * c, stored, m);
        }
        if (acc)
            for (int64_t c = 0; c < chunks; c++) {
                const __mmask32 m = c == chunks - 1 ? tail : 0xffffffffu;
                const bf16x32 sum = add32(load32_bf16(acc + at_t + 32 * c, m), load32_bf16(out + at_t + 32 * c, m));
                store32_bits(acc + at_t + 32 * c, narrow32_bf16(sum), m);
            }
    }
}
SHIFT_ENTRY(vla_shift_bf16, uint16_t)

/* ROPE for bf16, 32 values of a row at a time; the roll reads the other half's chunks where half of hd is a whole
 * number of them (hd 64, 128...), else a stack copy with the halves swapped. */
void vla_rope_bf16(const uint16_t *restrict x, int64_t x_head, int64_t x_row, const uint16_t *restrict cos,
                   const uint16_t *restrict signed_sin, int64_t heads, int64_t rows, int64_t hd,
                   uint16_t *restrict out) {
    uint16_t rolled[MAX_HEAD_DIM];
    const int64_t half = hd / 2, chunks = (hd + 31) / 32;
    const __mmask32 tail = hd % 32 ? (__mmask32)((1u << (hd % 32)) - 1) : 0xffffffffu;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t r = 0; r < rows; r++) {
            const uint16_t *xr = x + h * x_head + r * x_row, *c = cos + r * hd, *s = signed_sin + r * hd;
            uint16_t *o = out + (h * rows + r) * hd;
            const uint16_t *swapped = rolled;
            if (half % 32) {
                memcpy(rolled, xr + half, (size_t)half * sizeof *xr);
                memcpy(rolled + half, xr, (size_t)half * sizeof *xr);
            }
            for (int64_t k = 0; k < chunks; k++) {
                const __mmask32 m = k == chunks - 1 ? tail : 0xffffffffu;
                if (!(half % 32)) swapped = xr + (k < chunks / 2 ? half : -half);
                const bf16x32 a = widen32_bf16(narrow32_bf16(mul32(load32_bf16(xr + 32 * k, m),
                                                                   load32_bf16(c + 32 * k, m))));
                const bf16x32 b = widen32_bf16(narrow32_bf16(mul32(load32_bf16(swapped + 32 * k, m),
                                                                   load32_bf16(s + 32 * k, m))));
                store32_bits(o + 32 * k, narrow32_bf16(add32(a, b)), m);
            }
        }
}
#else
SHIFT(vla_shift_bf16, uint16_t, load_bf16, store_bf16)
ROPE(vla_rope_bf16, uint16_t, load_bf16, store_bf16)
#endif

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

/* Attention of bf16 q [heads, rows, dim] over k, v [kv_heads, keys, dim] with an fp32 bias [rows, keys] added to
 * the scaled logits (NULL: none; -inf = masked), query head h on kv head h / (heads / kv_heads); out [heads, rows,
 * dim]. Each array at its own strides (head, row; its last dim contiguous), so that out can be the [rows, heads *
 * dim] input of the output projection. The products on AVX512-BF16's dot-product instruction (bf16 pairs, fp32
 * sums), the softmax in fp32: logits = (q . k) * scale + bias; p = exp(logits - max) / sum, rounded to bf16 for
 * p v, as torch's form (buffer_attention: two batched matmuls and a softmax) rounds it; out rounded once to bf16.
 * torch's form also rounds the logits to bf16: this one is nearer the exact value. A row that may attend to nothing
 * gets zeros, a NaN among a row's logits NaNs. dim: even, a multiple of 16. Returns 0; -1 when its workspace (per
 * thread, grown to the largest call) cannot be allocated; -2 where the library was built without AVX512-BF16. No
 * fp32 form (vla_attention_f32 returns -2): torch's runs. */
#include <stdlib.h>
#define ATTENTION_SIGNATURE(NAME, T)                                                                       \
    int NAME(const T *q, int64_t q_head, int64_t q_row, const T *k, const T *v, int64_t kv_head, int64_t kv_row, \
             const float *bias, int64_t bias_row, int64_t heads, int64_t kv_heads, int64_t rows, int64_t keys,  \
             int64_t dim, float scale, T *out, int64_t out_head, int64_t out_row, int64_t threads)
#define LINEAR_SIGNATURE(NAME, T)                                                                          \
    int NAME(const T *x, int64_t m, int64_t ldx, const T *packed, int64_t n, int64_t k, const float *bias, int op, \
             const T *other, int64_t ldo, T *y, int64_t ldy, int64_t threads)
#define PACK_LINEAR_SIGNATURE(NAME, T) int NAME(const T *w, int64_t n, int64_t k, T *packed)
#define LINEAR_S8_SIGNATURE(NAME, T)                                                                       \
    int NAME(const T *x, int64_t m, int64_t ldx, const int8_t *packed, const float *scale, const int32_t *sums,  \
             int64_t n, int64_t k, const float *bias, int op, const T *other, int64_t ldo, T *y, int64_t ldy,      \
             int64_t threads)
#define PACK_LINEAR_S8_SIGNATURE(NAME, T) \
    int NAME(const T *w, int64_t n, int64_t k, int8_t *packed, float *scale, int32_t *sums)
int vla_amx(int use);
/* the AMX paths: built where the compiler targets AMX-BF16 and the AVX512-BF16 kernels they extend */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
        defined(__AVX512VL__)
#define VLA_AMX 1
#else
#define VLA_AMX 0
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define VL 16        /* fp32 lanes of a vector */
#define KEY_BLOCK 32 /* keys per logit step: two vectors */
#define ROW_BLOCK 12 /* query rows sharing each load of K and V (24 logit accumulators; 4, 8 and 16 ran slower) */
#define AMX_ROWS 16  /* an AMX tile's rows (linear_amx_row_parts counts them on every build) */

#if VLA_AMX
/* AMX tiles (the linear's and the attention's): the kernel's permission asked once a process, one configuration. */
#include <sys/syscall.h>
#include <unistd.h>
struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static int amx_use = 1; /* vla_amx's switch */
static int amx_state;   /* 0 not asked yet, 1 granted, -1 refused (the kernel's XTILEDATA permission) */

static int amx_granted(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state == 0) { /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: without it the first tile instruction is SIGILL */
        state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state > 0;
}

/* Every tile 64 bytes a row: tmm0-3 accumulators and tmm4 the left operand, `rows` rows; tmm5-7 the right
 * operand, 16 rows of pairs (the linear's weights; the attention's K and V). */
static void amx_configure(int rows) {
    struct amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = t < 5 ? (uint8_t)rows : 16;
    }
    _tile_loadconfig(&c);
}

#endif

static _Thread_local char *attention_workspace;
static _Thread_local size_t attention_capacity;

static char *attention_work(size_t bytes) {
    if (bytes > attention_capacity) {
        char *grown = realloc(attention_workspace, bytes);
        if (!grown) return NULL;
        attention_workspace = grown;
        attention_capacity = bytes;
    }
    return attention_workspace;
}

/* exp(x) for x <= 0 (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial; about 1 ulp); 0 below -87,
 * for -inf and for NaN */
static inline __m512 exp_nonpositive(__m512 x) {
    __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_maskz_mov_ps(kept, x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, n));
}

/* One row's logits lr [kp] (keys..kp already -inf) -> p as bf16 into pr [kp]. */
static inline void softmax_row(float *lr, uint16_t *pr, int64_t kp) {
    __m512 peak = _mm512_loadu_ps(lr);
    __mmask16 nan = _mm512_cmp_ps_mask(peak, peak, _CMP_UNORD_Q);
    for (int64_t j = VL; j < kp; j += VL) {
        __m512 x = _mm512_loadu_ps(lr + j);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        peak = _mm512_max_ps(peak, x);
    }
    const float top = _mm512_reduce_max_ps(peak);
    if (nan || top == -INFINITY) {
        const uint16_t fill = nan ? 0x7fc0 : 0; /* bf16 NaN, or zeros: nothing to attend */
        for (int64_t j = 0; j < kp; j++) pr[j] = fill;
        return;
    }
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < kp; j += VL) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(lr + j), _mm512_set1_ps(top)));
        _mm512_storeu_ps(lr + j, e);
        total = _mm512_add_ps(total, e);
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int64_t j = 0; j < kp; j += 2 * VL) /* rounded to nearest even: torch's .to(bfloat16) */
        _mm512_storeu_si512(pr + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(lr + j + VL), inverse),
                                                                  _mm512_mul_ps(_mm512_loadu_ps(lr + j), inverse)));
}

/* out = p v for `vectors` (1 or 2, a constant where inlined) column vectors of VL from column c: ROW_BLOCK rows of
 * bf16 p [ROW_BLOCK, kp] over V's interleaved row pairs vp [kp / 2, dim], fp32 sums rounded once to bf16; the block's
 * first `block` rows stored at their (head, row) places in out. */
static inline __attribute__((always_inline)) void pv_columns(
    int vectors, const uint16_t *p, int64_t kp, const uint32_t *vp, int64_t dim, int64_t c, uint16_t *out,
    int64_t out_head, int64_t out_row, int64_t i0, int64_t block, int64_t hk, int64_t group, int64_t rows) {
    __m512 acc[ROW_BLOCK][2];
    for (int r = 0; r < ROW_BLOCK; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kp / 2; i++) {
        __m512bh vi[2];
        for (int u = 0; u < vectors; u++) vi[u] = (__m512bh)_mm512_loadu_si512(vp + i * dim + c + u * VL);
        for (int r = 0; r < ROW_BLOCK; r++) {
            uint32_t pair;
            memcpy(&pair, p + r * kp + 2 * i, 4);
            const __m512bh pr = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int u = 0; u < vectors; u++) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], pr, vi[u]);
        }
    }
    for (int64_t r = 0; r < block; r++) {
        const int64_t i = i0 + r, h = hk * group + i / rows, t = i % rows;
        uint16_t *o = out + h * out_head + t * out_row + c;
        for (int u = 0; u < vectors; u++)
            _mm256_storeu_si256((__m256i *)(o + u * VL), (__m256i)_mm512_cvtneps_pbh(acc[r][u]));
    }
}

/* r [16] rows of 16 32-bit values -> its transpose, in place. */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* K [keys, dim] (rows kv_row apart) -> kt [pairs, kp]: each (d, d+1) pair of a key, key-major per pair, keys past
 * `keys` zero; 16 keys by 16 pairs at a time, transposed in registers (the scalar form's strided stores, or a gather
 * of 16 keys, took a tenth of the tower's attention on a Zen 5 core). */
static void rearrange_keys(const uint16_t *kh, int64_t kv_row, int64_t keys, int64_t kp, int64_t pairs,
                           uint32_t *kt) {
    for (int64_t j = 0; j < kp; j += VL)
        for (int64_t c = 0; c < pairs; c += VL) {
            const int64_t width = pairs - c < VL ? pairs - c : VL;
            const __mmask16 m = (__mmask16)((1u << width) - 1);
            __m512i r[VL];
            for (int i = 0; i < VL; i++)
                r[i] = j + i < keys ? _mm512_maskz_loadu_epi32(m, kh + (j + i) * kv_row + 2 * c)
                                    : _mm512_setzero_si512();
            transpose16_epi32(r);
            for (int i = 0; i < width; i++) _mm512_storeu_si512(kt + (c + i) * kp + j, r[i]);
        }
}

/* V [keys, dim] (rows kv_row apart) -> vp [kp / 2, dim]: rows 2i and 2i+1 interleaved (a (2i, 2i+1) pair per
 * column), rows past `keys` zero; 32 columns at a time by two word permutes. */
static void rearrange_values(const uint16_t *vh, int64_t kv_row, int64_t keys, int64_t kp, int64_t dim,
                             uint32_t *vp) {
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t i = 0; i < kp / 2; i++) {
        const uint16_t *a = vh + 2 * i * kv_row, *b = a + kv_row;
        const int live_a = 2 * i < keys, live_b = 2 * i + 1 < keys;
        for (int64_t d = 0; d < dim; d += 2 * VL) {
            const __mmask32 m = dim - d >= 2 * VL ? 0xffffffffu : (__mmask32)((1u << (dim - d)) - 1);
            const __m512i x = live_a ? _mm512_maskz_loadu_epi16(m, a + d) : _mm512_setzero_si512();
            const __m512i y = live_b ? _mm512_maskz_loadu_epi16(m, b + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + i * dim + d, _mm512_permutex2var_epi16(x, low, y));
            if (dim - d > VL)
                _mm512_storeu_si512(vp + i * dim + d + VL, _mm512_permutex2var_epi16(x, high, y));
        }
    }
}

/* An attention call, for the threads that share its kv heads. */
struct attention_call {
    const uint16_t *q, *k, *v;
    int64_t q_head, q_row, kv_head, kv_row;
    const float *bias;
    int64_t bias_row, heads, kv_heads, rows, keys, dim;
    float scale;
    uint16_t *out;
    int64_t out_head, out_row;
    int *failed; /* set where a thread's workspace could not be allocated */
};

static void attention_heads(const void *arg, int64_t first, int64_t last) { /* kv heads [first, last) */
    const struct attention_call *call = arg;
    const uint16_t *q = call->q, *k = call->k, *v = call->v;
    const int64_t q_head = call->q_head, q_row = call->q_row, kv_head = call->kv_head, kv_row = call->kv_row;
    const float *bias = call->bias, scale = call->scale;
    const int64_t bias_row = call->bias_row, heads = call->heads, kv_heads = call->kv_heads, rows = call->rows;
    const int64_t keys = call->keys, dim = call->dim, out_head = call->out_head, out_row = call->out_row;
    uint16_t *out = call->out;
    const int64_t kp = (keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK, pairs = dim / 2, group = heads / kv_heads;
    char *work = attention_work((size_t)(pairs * kp * 4 + kp / 2 * dim * 4 + ROW_BLOCK * (kp * 6 + pairs * 4)));
    if (!work) {
        __atomic_store_n(call->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    uint32_t *kt = (uint32_t *)work;                 /* [pairs, kp]: K's (d, d+1) pairs, key-major per pair */
    uint32_t *vp = kt + pairs * kp;                  /* [kp / 2, dim]: V's rows 2i and 2i+1 interleaved */
    float *logits = (float *)(vp + kp / 2 * dim);    /* [ROW_BLOCK, kp] */
    uint16_t *p = (uint16_t *)(logits + ROW_BLOCK * kp); /* [ROW_BLOCK, kp] bf16 */
    uint32_t *qs = (uint32_t *)(p + ROW_BLOCK * kp); /* [ROW_BLOCK, pairs] */
    for (int64_t hk = first; hk < last; hk++) {
        rearrange_keys(k + hk * kv_head, kv_row, keys, kp, pairs, kt);
        rearrange_values(v + hk * kv_head, kv_row, keys, kp, dim, vp);
        const int64_t n = group * rows; /* this kv head's query rows, (head, row) pairs in order */
        for (int64_t i0 = 0; i0 < n; i0 += ROW_BLOCK) {
            const int64_t block = n - i0 < ROW_BLOCK ? n - i0 : ROW_BLOCK;
            for (int64_t r = 0; r < ROW_BLOCK; r++) { /* rows past the block repeat its first (results dropped) */
                const int64_t i = i0 + (r < block ? r : 0), h = hk * group + i / rows, t = i % rows;
                memcpy(qs + r * pairs, q + h * q_head + t * q_row, (size_t)dim * 2);
            }
            for (int64_t jb = 0; jb < kp; jb += KEY_BLOCK) {
                __m512 acc[ROW_BLOCK][2];
                for (int r = 0; r < ROW_BLOCK; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
                for (int64_t c = 0; c < pairs; c++) {
                    __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + c * kp + jb);
                    __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + c * kp + jb + VL);
                    for (int r = 0; r < ROW_BLOCK; r++) {
                        __m512bh qc = (__m512bh)_mm512_set1_epi32((int)qs[r * pairs + c]);
                        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qc, k0);
                        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qc, k1);
                    }
                }
                for (int r = 0; r < ROW_BLOCK; r++) {
                    _mm512_storeu_ps(logits + r * kp + jb, _mm512_mul_ps(acc[r][0], _mm512_set1_ps(scale)));
                    _mm512_storeu_ps(logits + r * kp + jb + VL, _mm512_mul_ps(acc[r][1], _mm512_set1_ps(scale)));
                }
            }
            for (int64_t r = 0; r < ROW_BLOCK; r++) {
                float *lr = logits + r * kp;
                if (r >= block) {
                    memset(p + r * kp, 0, (size_t)kp * 2);
                    continue;
                }
                if (bias) {
                    const float *br = bias + (i0 + r) % rows * bias_row;
                    for (int64_t j = 0; j < keys; j++) lr[j] += br[j];
                }
                for (int64_t j = keys; j < kp; j++) lr[j] = -INFINITY;
                softmax_row(lr, p + r * kp, kp);
            }
            int64_t c = 0;
            for (; c + 2 * VL <= dim; c += 2 * VL) /* out = p v: each broadcast p pair feeds two column vectors */
                pv_columns(2, p, kp, vp, dim, c, out, out_head, out_row, i0, block, hk, group, rows);
            if (c < dim) /* the last VL columns of a head_dim that is an odd multiple of VL */
                pv_columns(1, p, kp, vp, dim, c, out, out_head, out_row, i0, block, hk, group, rows);
        }
    }
}

#if VLA_AMX
/* attention_heads on AMX tiles, for a head_dim a multiple of 32: blocks of 16 query rows (rows past the block repeat
 * its first, their results dropped); the logits of 32 keys at a time in two accumulator tiles over K's pairs as
 * rearrange_keys lays them ([pairs][kp]: the tile product's right operand, 16 pairs x 16 keys a tile), scaled, biased
 * and softmaxed as the vector path does (softmax_row); then P V in up to four accumulator tiles of 16 columns over V's
 * interleaved row pairs (rearrange_values' [kp / 2][dim]: 16 pairs of keys x 16 columns a tile), rounded once to
 * bf16. The tiles sum in another order than the vector path: within a rounding of it, not its bits. */
static void attention_heads_amx(const void *arg, int64_t first, int64_t last) { /* kv heads [first, last) */
    const struct attention_call *c = arg;
    const int64_t rows = c->rows, keys = c->keys, dim = c->dim, group = c->heads / c->kv_heads;
    const int64_t kp = (keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK, pairs = dim / 2;
    const int64_t per_row = kp * 6 + pairs * 4 + dim * 4; /* a row's logits, p, q and P V sums */
    char *work = attention_work((size_t)(pairs * kp * 4 + kp / 2 * dim * 4 + AMX_ROWS * per_row));
    if (!work) {
        __atomic_store_n(c->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    uint32_t *kt = (uint32_t *)work;                     /* [pairs, kp] */
    uint32_t *vp = kt + pairs * kp;                      /* [kp / 2, dim] */
    float *logits = (float *)(vp + kp / 2 * dim);        /* [AMX_ROWS, kp] */
    float *acc = logits + AMX_ROWS * kp;                 /* [AMX_ROWS, dim]: P V's sums */
    uint16_t *p = (uint16_t *)(acc + AMX_ROWS * dim);    /* [AMX_ROWS, kp] bf16 */
    uint32_t *qs = (uint32_t *)(p + AMX_ROWS * kp);      /* [AMX_ROWS, pairs] */
    amx_configure(AMX_ROWS);
    for (int64_t hk = first; hk < last; hk++) {
        rearrange_keys(c->k + hk * c->kv_head, c->kv_row, keys, kp, pairs, kt);
        rearrange_values(c->v + hk * c->kv_head, c->kv_row, keys, kp, dim, vp);
        const int64_t n = group * rows; /* this kv head's query rows, (head, row) pairs in order */
        for (int64_t i0 = 0; i0 < n; i0 += AMX_ROWS) {
            const int64_t block = n - i0 < AMX_ROWS ? n - i0 : AMX_ROWS;
            for (int64_t r = 0; r < AMX_ROWS; r++) {
                const int64_t i = i0 + (r < block ? r : 0), h = hk * group + i / rows, t = i % rows;
                memcpy(qs + r * pairs, c->q + h * c->q_head + t * c->q_row, (size_t)dim * 2);
            }
            for (int64_t jb = 0; jb < kp; jb += KEY_BLOCK) {
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t c0 = 0; c0 < pairs; c0 += 16) {
                    _tile_loadd(4, qs + c0, pairs * 4);
                    _tile_loadd(5, kt + c0 * kp + jb, kp * 4);
                    _tile_loadd(6, kt + c0 * kp + jb + VL, kp * 4);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_dpbf16ps(1, 4, 6);
                }
                _tile_stored(0, logits + jb, kp * 4);
                _tile_stored(1, logits + jb + VL, kp * 4);
            }
            for (int64_t r = 0; r < AMX_ROWS; r++) {
                float *lr = logits + r * kp;
                if (r >= block) {
                    memset(p + r * kp, 0, (size_t)kp * 2);
                    continue;
                }
                for (int64_t j = 0; j < kp; j += VL)
                    _mm512_storeu_ps(lr + j, _mm512_mul_ps(_mm512_loadu_ps(lr + j), _mm512_set1_ps(c->scale)));
                if (c->bias) {
                    const float *br = c->bias + (i0 + r) % rows * c->bias_row;
                    for (int64_t j = 0; j < keys; j++) lr[j] += br[j];
                }
                for (int64_t j = keys; j < kp; j++) lr[j] = -INFINITY;
                softmax_row(lr, p + r * kp, kp);
            }
            for (int64_t c0 = 0; c0 < dim; c0 += 4 * VL) { /* 64 columns (or the last 32) a pass over the keys */
                const int wide = dim - c0 >= 4 * VL;
                _tile_zero(0);
                _tile_zero(1);
                if (wide) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
                for (int64_t j0 = 0; j0 < kp; j0 += KEY_BLOCK) {
                    const uint32_t *w = vp + j0 / 2 * dim + c0;
                    _tile_loadd(4, p + j0, kp * 2);
                    _tile_loadd(5, w, dim * 4);
                    _tile_loadd(6, w + VL, dim * 4);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_dpbf16ps(1, 4, 6);
                    if (wide) {
                        _tile_loadd(7, w + 2 * VL, dim * 4);
                        _tile_loadd(5, w + 3 * VL, dim * 4);
                        _tile_dpbf16ps(2, 4, 7);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                _tile_stored(0, acc + c0, dim * 4);
                _tile_stored(1, acc + c0 + VL, dim * 4);
                if (wide) {
                    _tile_stored(2, acc + c0 + 2 * VL, dim * 4);
                    _tile_stored(3, acc + c0 + 3 * VL, dim * 4);
                }
            }
            for (int64_t r = 0; r < block; r++) {
                const int64_t i = i0 + r, h = hk * group + i / rows, t = i % rows;
                uint16_t *o = c->out + h * c->out_head + t * c->out_row;
                for (int64_t c = 0; c < dim; c += VL) {
                    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * dim + c));
                    _mm256_storeu_si256((__m256i *)(o + c), rounded);
                }
            }
        }
    }
    _tile_release();
}
#endif

ATTENTION_SIGNATURE(vla_attention_bf16, uint16_t) {
    int failed = 0;
    const struct attention_call call = {.q = q, .k = k, .v = v, .q_head = q_head, .q_row = q_row, .kv_head = kv_head,
                                        .kv_row = kv_row, .bias = bias, .bias_row = bias_row, .heads = heads,
                                        .kv_heads = kv_heads, .rows = rows, .keys = keys, .dim = dim, .scale = scale,
                                        .out = out, .out_head = out_head, .out_row = out_row, .failed = &failed};
    part_task heads_task = attention_heads;
#if VLA_AMX
    if (dim % 32 == 0 && vla_amx(-1) == 1) heads_task = attention_heads_amx;
#endif
    run_parts(heads_task, &call, kv_heads, heads * rows * keys * dim * 2 >= THREADED_MIN_MACS ? threads : 1);
    return failed ? -1 : 0;
}

/* The bf16 linear: y [m, n] = op(x [m, k] W^T + bias), W packed by vla_pack_linear_bf16 into tiles of up to
 * LINEAR_TILE columns, each tile [k / 2][cols][2] (a column's (k, k + 1) pair beside the next column's): the tile
 * streams from memory once, in order, while up to LINEAR_ROWS rows of x share each load of it (27 accumulators of
 * 16 fp32 sums: 9 rows x 48 columns), their pairs broadcast to the bf16 dot-product instruction. Sums are fp32,
 * the bias and the op applied in fp32 and the result rounded once to bf16 (op: 0 none, 1 SiLU, 2 times other
 * [m, n] bf16, 3 tanh-approximated GELU), as oneDNN's fused primitives do; the order of the k sums is this kernel's.
 * Streamed from memory (a tick's 48 MB of weights do not stay in a 32 MB L3), the hardware prefetcher alone left the
 * kernel waiting: a software prefetch keeps the next lines coming (packed_weights' figures), the next tile's spread
 * over this one's row blocks (a Zen 5 core, 120 MB of distinct weights in turn: 20 x 512 -> 1536 72-79 us against
 * 83-85 with the whole next tile in the second block, 69 x 384 -> 1536 161-164 against 169).
 * x and other rows may be strided (ldx, ldo: elements), y's too (ldy). k is even; where n is not a multiple of 16
 * the last tile's columns are padded with zeros when packed (the packed weight holds n rounded up to 16 columns)
 * and its last vector is loaded and stored under a mask. */
#define LINEAR_VECTORS 3                     /* 48 columns a tile */
#define LINEAR_TILE (LINEAR_VECTORS * VL)
#define LINEAR_ROWS 9                        /* 9 x 3 accumulators + 3 weight vectors + 1 broadcast: 31 registers */
#define LINEAR_AHEAD 64                      /* pairs of k the weight stream is prefetched ahead (8 to 128 tried) */

static inline __m512 sigmoid(__m512 s) { /* 1 / (1 + exp(-s)), by exp of the non-positive -|s| */
    __m512 e = exp_nonpositive(_mm512_min_ps(s, _mm512_sub_ps(_mm512_setzero_ps(), s)));
    __mmask16 positive = _mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GE_OQ);
    __m512 numerator = _mm512_mask_mov_ps(e, positive, _mm512_set1_ps(1.0f));
    return _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

static inline __m512 linear_op(__m512 s, int op, const uint16_t *other, __mmask16 lanes) {
    if (op == 1) return _mm512_mul_ps(s, sigmoid(s));
    if (op == 2) {
        __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, other));
        return _mm512_mul_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
    }
    if (op == 3) { /* 0.5 s (1 + tanh(u)), u = sqrt(2 / pi) (s + 0.044715 s^3); 1 + tanh(u) = 2 sigmoid(2u) */
        __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                 _mm512_add_ps(s, _mm512_mul_ps(_mm512_set1_ps(0.044715f),
                                                                _mm512_mul_ps(s, _mm512_mul_ps(s, s)))));
        return _mm512_mul_ps(s, sigmoid(_mm512_add_ps(u, u)));
    }
    return s;
}

/* A row r's vector v of sums s: plus the bias, the op (linear_op), rounded once to bf16 and stored under `lanes`
 * (the bf16 linear's epilogue on either path, and the int8 linear's once its sums are scaled). */
static inline __attribute__((always_inline)) void linear_store(
        __m512 s, const float *bias, int op, const uint16_t *other, int64_t ldo, uint16_t *y, int64_t ldy, int r, int v,
        __mmask16 lanes) {
    if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(lanes, bias + v * VL));
    s = linear_op(s, op, other ? other + r * ldo + v * VL : NULL, lanes);
    _mm256_mask_storeu_epi16(y + r * ldy + v * VL, lanes, (__m256i)_mm512_cvtneps_pbh(s));
}

static inline __attribute__((always_inline)) void linear_block(
        const uint16_t *x, int64_t ldx, const uint16_t *tile, int64_t k, const float *bias, int op,
        const uint16_t *other, int64_t ldo, uint16_t *y, int64_t ldy, __mmask16 tail, const char *ahead,
        int64_t ahead_lines, const int rows, const int vectors) {
    __m512 acc[LINEAR_ROWS][LINEAR_VECTORS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vectors; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {
        if (ahead)
            for (int64_t l = 0; l < ahead_lines; l++) _mm_prefetch(ahead + (p * ahead_lines + l) * 64, _MM_HINT_T0);
        __m512bh w[LINEAR_VECTORS];
        for (int v = 0; v < vectors; v++) w[v] = (__m512bh)_mm512_loadu_si512(tile + (p * vectors + v) * 2 * VL);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);
            __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < vectors; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, w[v]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vectors; v++) {
            const __mmask16 lanes = v == vectors - 1 ? tail : 0xffff; /* the columns this vector holds */
            linear_store(acc[r][v], bias, op, other, ldo, y, ldy, r, v, lanes);
        }
}

#define LINEAR_CASE(R, V)                                                                                      \
    case R:                                                                                                    \
        linear_block(x + r0 * ldx, ldx, tile, k, b, op, o, ldo, y + r0 * ldy + n0, ldy, tail, ahead, step, R, V); \
        break;
#define LINEAR_ROWS_SWITCH(V)                                                                                  \
    switch (rows) {                                                                                            \
        LINEAR_CASE(1, V) LINEAR_CASE(2, V) LINEAR_CASE(3, V) LINEAR_CASE(4, V) LINEAR_CASE(5, V)              \
        LINEAR_CASE(6, V) LINEAR_CASE(7, V) LINEAR_CASE(8, V) LINEAR_CASE(9, V)                                \
    }

/* A linear kernel's call, for the threads that share its column tiles (the int8 kernel's fields last). */
struct linear_call {
    const uint16_t *x;
    int64_t m, ldx;
    const void *packed;
    int64_t n, k;
    const float *bias;
    int op;
    const uint16_t *other;
    int64_t ldo;
    uint16_t *y;
    int64_t ldy;
    const float *scale;      /* per column */
    const int32_t *sums;     /* per column */
    const uint8_t *codes;    /* x's rows quantized, kp apart */
    int64_t kp;
    const float *row_scale;
    int64_t row_parts; /* the bf16 linear's (linear_row_parts) */
    int amx;           /* the bf16 linear's: on AMX tiles (linear_amx_range) */
};

/* Column tiles [first, last) of the call's rows [row0, row0 + m). */
static void linear_bf16_range(const struct linear_call *call, int64_t row0, int64_t m, int64_t first, int64_t last) {
    const uint16_t *x = call->x + row0 * call->ldx, *packed = call->packed;
    const uint16_t *other = call->other ? call->other + row0 * call->ldo : NULL;
    const int64_t ldx = call->ldx, k = call->k, ldo = call->ldo, ldy = call->ldy;
    const int64_t n = call->n < last * LINEAR_TILE ? call->n : last * LINEAR_TILE;
    const float *bias = call->bias;
    const int op = call->op;
    uint16_t *y = call->y + row0 * ldy;
    const int64_t blocks = (m + LINEAR_ROWS - 1) / LINEAR_ROWS; /* row blocks as even as they go: 17 -> 9 + 8 */
    for (int64_t n0 = first * LINEAR_TILE; n0 < n; n0 += LINEAR_TILE) {
        const int64_t cols = n - n0 < LINEAR_TILE ? n - n0 : LINEAR_TILE;
        const int vectors = (int)((cols + VL - 1) / VL);
        const __mmask16 tail = cols % VL ? (__mmask16)((1u << (cols % VL)) - 1) : 0xffff;
        const uint16_t *tile = packed + n0 * k;
        const float *b = bias ? bias + n0 : NULL;
        int64_t r0 = 0;
        for (int64_t block = 0; block < blocks; block++) {
            const int rows = (int)((m - r0) / (blocks - block));
            const uint16_t *o = other ? other + r0 * ldo + n0 : NULL;
            /* the weight stream prefetched LINEAR_AHEAD pairs ahead by the first block of rows (on into the next
             * tile) and, while the other blocks reread this tile from cache, the next tile's stream ahead of that,
             * block after block, as many lines a pair as the blocks after the first need to cover it (one where
             * they are three or more; the later blocks run on into the tiles after): the whole of it in the second
             * block outran the memory */
            const char *next = (const char *)(tile + cols * k) + LINEAR_AHEAD * vectors * 64;
            const int64_t share = (k / 2 * vectors + blocks - 2) / (blocks > 1 ? blocks - 1 : 1); /* lines */
            const int64_t lines = (share + k / 2 - 1) / (k / 2);
            const char *ahead = block == 0 ? (const char *)tile + LINEAR_AHEAD * vectors * 64
                                           : next + (block - 1) * (k / 2) * lines * 64;
            const int64_t step = block == 0 ? vectors : lines;
            if (vectors == 3) {
                LINEAR_ROWS_SWITCH(3)
            } else if (vectors == 2) {
                LINEAR_ROWS_SWITCH(2)
            } else {
                LINEAR_ROWS_SWITCH(1)
            }
            r0 += rows;
        }
    }
}

#if VLA_AMX
/* A column tile's `vectors` accumulator tiles S0, S1, S2 (literal tile numbers: gcc's tile intrinsics spell them into
 * the instruction): zeroed, and stored into acc [rows][LINEAR_TILE] (the AMX linears, bf16 and int8). */
#define AMX_ZERO_SUMS(S0, S1, S2, vectors) \
    do {                                   \
        _tile_zero(S0);                    \
        if ((vectors) > 1) _tile_zero(S1); \
        if ((vectors) > 2) _tile_zero(S2); \
    } while (0)
#define AMX_STORE_SUMS(S0, S1, S2, acc, vectors)                               \
    do {                                                                       \
        _tile_stored(S0, (acc), LINEAR_TILE * 4);                              \
        if ((vectors) > 1) _tile_stored(S1, (acc) + VL, LINEAR_TILE * 4);      \
        if ((vectors) > 2) _tile_stored(S2, (acc) + 2 * VL, LINEAR_TILE * 4);  \
    } while (0)
/* The products DP of the rows in tile X with a column tile's `vectors` weights at w (64 bytes apart, a row of k every
 * `stride` bytes) into the sums S0, S1, S2, each weight loaded through the one tile W: the pair passes', whose second
 * block loads them again from L1 (linear_amx_pair, linear_s8_amx_tiles). */
#define AMX_PRODUCTS(DP, S0, S1, S2, X, W, w, stride, vectors)        \
    do {                                                              \
        _tile_loadd(W, (w), (stride));                                \
        DP(S0, X, W);                                                 \
        if ((vectors) > 1) {                                          \
            _tile_loadd(W, (const char *)(w) + 64, (stride));         \
            DP(S1, X, W);                                             \
        }                                                             \
        if ((vectors) > 2) {                                          \
            _tile_loadd(W, (const char *)(w) + 128, (stride));        \
            DP(S2, X, W);                                             \
        }                                                             \
    } while (0)

/* The stored sums acc [rows][LINEAR_TILE] of a block of rows x: plus the k past the tiles (the vector product), then
 * the bias, the op and one rounding (linear_store). */
static inline __attribute__((always_inline)) void linear_amx_store(
        const float *acc, const uint16_t *x, int64_t ldx, const uint16_t *tile, int64_t k, const float *bias, int op,
        const uint16_t *other, int64_t ldo, uint16_t *y, int64_t ldy, __mmask16 tail, int rows, const int vectors) {
    const int64_t tiled = k / 32 * 32;
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vectors; v++) {
            const __mmask16 lanes = v == vectors - 1 ? tail : 0xffff;
            __m512 s = _mm512_load_ps(acc + r * LINEAR_TILE + v * VL);
            for (int64_t p = tiled / 2; p < k / 2; p++) {
                int32_t pair;
                memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);
                s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_set1_epi32(pair),
                                     (__m512bh)_mm512_loadu_si512(tile + (p * vectors + v) * 2 * VL));
            }
            linear_store(s, bias, op, other, ldo, y, ldy, r, v, lanes);
        }
}

/* The same linear on AMX tiles, where the CPU has them and the kernel lets this process use them: a 16 x 16 fp32
 * accumulator tile per vector of a column tile (tmm0-2), a block of up to 16 rows x 32 values of x (tmm4) and the
 * weight's 16 pairs of k x 16 columns (tmm5-7) as they lie in the packed tile: vla_pack_linear_bf16's [k / 2][cols][2]
 * is the VNNI layout the tile product reads, a row of pairs every `vectors` * 64 bytes. k past the last multiple of
 * 32 goes through the vector product (linear_block's) on the stored accumulators, then the bias, the op and one
 * rounding as linear_block. The tiles sum a row's products in another order than the vector kernel: within a bf16
 * step of it, not its bits; every caller (the native layers included) takes the same path, so they agree with each
 * other. An Intel Xeon with AMX (2 vCPU), us, two threads, against the vector kernel: see cpu_kernels.py's `linear`. */
static inline __attribute__((always_inline)) void linear_amx_block(
        const uint16_t *x, int64_t ldx, const uint16_t *tile, int64_t k, const float *bias, int op,
        const uint16_t *other, int64_t ldo, uint16_t *y, int64_t ldy, __mmask16 tail, int rows, const int vectors) {
    float acc[AMX_ROWS * LINEAR_TILE] __attribute__((aligned(64))); /* [rows][vectors * VL] */
    const int64_t tiled = k / 32 * 32, stride = vectors * 64;      /* values by the tiles; bytes a pair of k */
    AMX_ZERO_SUMS(0, 1, 2, vectors);
    for (int64_t k0 = 0; k0 < tiled; k0 += 32) {
        const uint16_t *w = tile + k0 / 2 * vectors * 2 * VL;
        _tile_loadd(4, x + k0, ldx * 2);
        _tile_loadd(5, w, stride);
        _tile_dpbf16ps(0, 4, 5);
        if (vectors > 1) {
            _tile_loadd(6, w + 2 * VL, stride);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (vectors > 2) {
            _tile_loadd(7, w + 4 * VL, stride);
            _tile_dpbf16ps(2, 4, 7);
        }
    }
    AMX_STORE_SUMS(0, 1, 2, acc, vectors);
    linear_amx_store(acc, x, ldx, tile, k, bias, op, other, ldo, y, ldy, tail, rows, vectors);
}

/* Two blocks of rows down a column tile in one pass, 16 rows x and the next `rows` (1 to 16) below them: each step's
 * weight is loaded from memory once, for the first block, and again from L1 for the second (tmm0-2 and tmm3-5 their
 * sums, tmm6 the rows, tmm7 the weight; every tile configured for 16 rows, the second block's rows copied into
 * zeros). The same products in the same order as two linear_amx_block calls, so the same bits. A tick's 17 rows:
 * without it the 17th row's block reread every tile from L2; an Intel Xeon with AMX (2 vCPU), two threads, a tick's
 * linears (8 layers' five, 48 MB in turn) 1.49-1.62 ms against 1.72-1.79 (16 rows: 1.37-1.48). */
static inline __attribute__((always_inline)) void linear_amx_pair(
        const uint16_t *x, int64_t ldx, const uint16_t *tile, int64_t k, const float *bias, int op,
        const uint16_t *other, int64_t ldo, uint16_t *y, int64_t ldy, __mmask16 tail, int rows, const int vectors) {
    float acc[AMX_ROWS * LINEAR_TILE] __attribute__((aligned(64))); /* [rows][vectors * VL] */
    uint16_t rest[AMX_ROWS * 32] __attribute__((aligned(64)));      /* the second block's 32 values of k, padded */
    const uint16_t *x1 = x + AMX_ROWS * ldx;
    const int64_t tiled = k / 32 * 32, stride = vectors * 64;
    memset(rest, 0, sizeof rest);
    AMX_ZERO_SUMS(0, 1, 2, vectors);
    AMX_ZERO_SUMS(3, 4, 5, vectors);
    for (int64_t k0 = 0; k0 < tiled; k0 += 32) {
        const uint16_t *w = tile + k0 / 2 * vectors * 2 * VL;
        _tile_loadd(6, x + k0, ldx * 2);
        AMX_PRODUCTS(_tile_dpbf16ps, 0, 1, 2, 6, 7, w, stride, vectors);
        for (int r = 0; r < rows; r++) _mm512_store_si512(rest + r * 32, _mm512_loadu_si512(x1 + r * ldx + k0));
        _tile_loadd(6, rest, 64);
        AMX_PRODUCTS(_tile_dpbf16ps, 3, 4, 5, 6, 7, w, stride, vectors);
    }
    AMX_STORE_SUMS(0, 1, 2, acc, vectors);
    linear_amx_store(acc, x, ldx, tile, k, bias, op, other, ldo, y, ldy, tail, AMX_ROWS, vectors);
    AMX_STORE_SUMS(3, 4, 5, acc, vectors);
    linear_amx_store(acc, x1, ldx, tile, k, bias, op, other ? other + AMX_ROWS * ldo : NULL, ldo, y + AMX_ROWS * ldy,
                     ldy, tail, rows, vectors);
}

/* linear_bf16_range on the tiles: blocks of 16 rows (the last the rest) down each column tile, the last two in one
 * pass where they are 17 to 32 rows (linear_amx_pair). */
static void linear_amx_range(const struct linear_call *call, int64_t row0, int64_t m, int64_t first, int64_t last) {
    const uint16_t *x = call->x + row0 * call->ldx, *packed = call->packed;
    const uint16_t *other = call->other ? call->other + row0 * call->ldo : NULL;
    const int64_t ldx = call->ldx, k = call->k, ldo = call->ldo, ldy = call->ldy;
    const int64_t n = call->n < last * LINEAR_TILE ? call->n : last * LINEAR_TILE;
    uint16_t *y = call->y + row0 * ldy;
    const int op = call->op;
    int configured = 0; /* the rows the tiles are configured for (0: none yet) */
    for (int64_t n0 = first * LINEAR_TILE; n0 < n; n0 += LINEAR_TILE) {
        const int64_t cols = n - n0 < LINEAR_TILE ? n - n0 : LINEAR_TILE;
        const int vectors = (int)((cols + VL - 1) / VL);
        const __mmask16 tail = cols % VL ? (__mmask16)((1u << (cols % VL)) - 1) : 0xffff;
        const uint16_t *tile = packed + n0 * k;
        const float *b = call->bias ? call->bias + n0 : NULL;
#define AMX_BLOCKS(F, ROWS) (vectors == 3   ? F(x + r0 * ldx, ldx, tile, k, b, op, o, ldo, out, ldy, tail, ROWS, 3) \
                             : vectors == 2 ? F(x + r0 * ldx, ldx, tile, k, b, op, o, ldo, out, ldy, tail, ROWS, 2) \
                                            : F(x + r0 * ldx, ldx, tile, k, b, op, o, ldo, out, ldy, tail, ROWS, 1))
        for (int64_t r0 = 0; r0 < m; r0 += AMX_ROWS) {
            const uint16_t *o = other ? other + r0 * ldo + n0 : NULL;
            uint16_t *out = y + r0 * ldy + n0;
            if (m - r0 > AMX_ROWS && m - r0 <= 2 * AMX_ROWS) { /* the last two blocks, 17 to 32 rows: one pass */
                if (configured != AMX_ROWS) amx_configure(configured = AMX_ROWS);
                AMX_BLOCKS(linear_amx_pair, (int)(m - r0 - AMX_ROWS));
                break;
            }
            const int rows = (int)(m - r0 < AMX_ROWS ? m - r0 : AMX_ROWS);
            if (rows != configured) amx_configure(configured = rows);
            AMX_BLOCKS(linear_amx_block, rows);
        }
#undef AMX_BLOCKS
    }
    if (configured) _tile_release();
}
#endif

/* Items [first, last) of the call's row_parts * tiles (row part, column tile) pairs, row part by row part. */
static void linear_bf16_tiles(const void *arg, int64_t first, int64_t last) {
    const struct linear_call *call = arg;
    const int64_t tiles = (call->n + LINEAR_TILE - 1) / LINEAR_TILE, parts = call->row_parts;
    for (int64_t part = first / tiles; part < parts && part * tiles < last; part++) {
        const int64_t row0 = call->m * part / parts, rows = call->m * (part + 1) / parts - row0;
        const int64_t from = first > part * tiles ? first - part * tiles : 0;
        const int64_t to = last < (part + 1) * tiles ? last - part * tiles : tiles;
#if VLA_AMX
        if (call->amx) {
            linear_amx_range(call, row0, rows, from, to);
            continue;
        }
#endif
        linear_bf16_range(call, row0, rows, from, to);
    }
}

/* Row parts of a threaded linear: where its column tiles do not split evenly among the threads (a decoder's 512
 * columns are 11 tiles, its K or V's 128 three) and each thread still has LINEAR_SPLIT_ROWS rows or more (the
 * products bound it, not the weight stream), each thread takes every tile of its share of the rows: the same
 * products of the same rows, so the same bits. */
#define LINEAR_SPLIT_ROWS (2 * LINEAR_ROWS)
static int64_t linear_row_parts(int64_t m, int64_t tiles, int64_t threads) {
    return threads > 1 && tiles % threads && m >= threads * LINEAR_SPLIT_ROWS ? threads : 1;
}

/* On AMX tiles a block of 16 rows costs the same at any row count, and a thread's first block down a column tile
 * streams the tile from memory (about as long again), the blocks after read it from its cache: so the threads split
 * the rows only where that takes less of those passes on the slowest thread than splitting the columns (a frame's
 * K or V, 196 x 512 -> 128: 3 tiles, 7 + 1 passes each against 2 x (13 + 1); a tick's 17 x 512 -> 512 keeps the
 * columns: 6 x (2 + 1) against 11 x (1 + 1), which each thread would stream whole). An Intel Xeon with AMX (2 vCPU),
 * us, six weights in turn, the columns against the rows: 17 x 512 -> 512 19 / 28, 17 x 1536 -> 512 58 / 80, 61 x
 * 1536 -> 512 86 / 117; the rows against the columns: 61 x 512 -> 128 8.2 / 10.2, 196 x 512 -> 128 22 / 25. */
static int64_t linear_amx_row_parts(int64_t m, int64_t tiles, int64_t threads) {
    if (threads < 2) return 1;
    const int64_t by_columns = (tiles + threads - 1) / threads * ((m + AMX_ROWS - 1) / AMX_ROWS + 1);
    const int64_t by_rows = tiles * (((m + threads - 1) / threads + AMX_ROWS - 1) / AMX_ROWS + 1);
    return by_rows < by_columns ? threads : 1;
}

LINEAR_SIGNATURE(vla_linear_bf16, uint16_t) {
    if (k % 2 || op < 0 || op > 3 || (op == 2 && !other)) return -1;
    const int64_t tiles = (n + LINEAR_TILE - 1) / LINEAR_TILE;
    const int amx = vla_amx(-1) == 1, on = m * n * k >= THREADED_MIN_MACS ? (int)threads : 1;
    const int64_t parts = amx ? linear_amx_row_parts(m, tiles, on) : linear_row_parts(m, tiles, on);
    const struct linear_call call = {.x = x, .m = m, .ldx = ldx, .packed = packed, .n = n, .k = k, .bias = bias,
                                     .op = op, .other = other, .ldo = ldo, .y = y, .ldy = ldy, .row_parts = parts,
                                     .amx = amx};
    run_parts(linear_bf16_tiles, &call, parts * tiles, on);
    return 0;
}

PACK_LINEAR_SIGNATURE(vla_pack_linear_bf16, uint16_t) {
    if (k % 2) return -1;
    for (int64_t n0 = 0; n0 < n; n0 += LINEAR_TILE) {
        const int64_t cols = n - n0 < LINEAR_TILE ? n - n0 : LINEAR_TILE, padded = (cols + VL - 1) / VL * VL;
        for (int64_t p = 0; p < k / 2; p++)
            for (int64_t c = 0; c < padded; c++) {
                *packed++ = c < cols ? w[(n0 + c) * k + 2 * p] : 0;
                *packed++ = c < cols ? w[(n0 + c) * k + 2 * p + 1] : 0;
            }
    }
    return 0;
}

/* The int8 linear (AVX512-VNNI): y [m, n] = op(x [m, k] W^T + bias) with W quantized per output column, symmetric
 * (w = scale[c] * q, q in [-127, 127]; vla_pack_linear_s8_bf16), and each row of x quantized as it comes, symmetric
 * per row (x = s_r * q, s_r = max |x_r| / 127, q = round-to-nearest-even(x * 127 / max |x_r|)). The row's codes are
 * stored offset by 128 (u8) for the unsigned x signed byte dot product, which sums four products a lane in int32;
 * the offset comes off exactly with the column's code sum (sums[c]): sum (q_x + 128) q_w - 128 sum q_w. Then, in
 * fp32, s_r * scale[c] * that + bias, the op and one rounding to bf16, as the bf16 linear. Tiles as the bf16 linear's
 * (LINEAR_TILE columns, LINEAR_ROWS rows sharing each weight load), each tile [k / 4][cols][4] bytes: half the bf16
 * weight's bytes and, on a CPU whose byte dot product issues as often as its bf16 one, twice the products a cycle.
 * Where the CPU has AMX-INT8 the products run on its tiles instead (linear_s8_amx_tiles: the same exact sums, the
 * same bits). k is a multiple of 4; a row with no nonzero value gives the bias alone (its codes all 0), a row with a
 * NaN or an infinity NaNs. Returns 0; -1 on a bad k or op; -3 when the codes' workspace (per thread) cannot be
 * allocated. */
typedef int32_t int32x16 __attribute__((vector_size(64))); /* gcc 12 spills __m512i accumulators (its builtin's
                                                              * 16 x int32 view of them); these stay in registers */
static _Thread_local uint8_t *codes_workspace;
static _Thread_local size_t codes_capacity;

/* A row's vector v of int32 sums of offset codes: the offset off (128 times the columns' code sums), scaled by the
 * row's and the columns' scales, then linear_store's epilogue (the int8 linear's, on either path). */
static inline __attribute__((always_inline)) void linear_s8_store(
        __m512i sum, float row_scale, const float *scale, const int32_t *sums, const float *bias, int op,
        const uint16_t *other, int64_t ldo, uint16_t *y, int64_t ldy, int r, int v, __mmask16 lanes) {
    const __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(lanes, sums + v * VL), 7);
    const __m512 units = _mm512_mul_ps(_mm512_set1_ps(row_scale), _mm512_maskz_loadu_ps(lanes, scale + v * VL));
    const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, offset)), units);
    linear_store(s, bias, op, other, ldo, y, ldy, r, v, lanes);
}

static inline __attribute__((always_inline)) void linear_s8_block(
        const uint8_t *x, int64_t ldx, const float *row_scale, const int8_t *tile, const float *scale,
        const int32_t *sums, int64_t k, const float *bias, int op, const uint16_t *other, int64_t ldo, uint16_t *y,
        int64_t ldy, __mmask16 tail, const char *ahead, int64_t ahead_step, const int rows, const int vectors) {
    int32x16 acc[LINEAR_ROWS][LINEAR_VECTORS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vectors; v++) acc[r][v] = (int32x16)_mm512_setzero_si512();
    for (int64_t p = 0; p < k / 4; p++) {
        if (ahead)
            for (int v = 0; v < vectors; v++) _mm_prefetch(ahead + p * ahead_step + 64 * v, _MM_HINT_T0);
        __m512i w[LINEAR_VECTORS];
        for (int v = 0; v < vectors; v++) w[v] = _mm512_loadu_si512(tile + (p * vectors + v) * 4 * VL);
        for (int r = 0; r < rows; r++) {
            int32_t quad;
            memcpy(&quad, x + r * ldx + 4 * p, sizeof quad);
            const __m512i a = _mm512_set1_epi32(quad);
            for (int v = 0; v < vectors; v++) acc[r][v] = (int32x16)_mm512_dpbusd_epi32((__m512i)acc[r][v], a, w[v]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vectors; v++) {
            const __mmask16 lanes = v == vectors - 1 ? tail : 0xffff;
            linear_s8_store((__m512i)acc[r][v], row_scale[r], scale, sums, bias, op, other, ldo, y, ldy, r, v, lanes);
        }
}

/* x's row quantized (see above) into codes [k] (u8, offset 128); returns its scale s_r. */
static float quantize_row(const uint16_t *x, int64_t k, uint8_t *codes) {
    __m512 top = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t i = 0; i < k; i += VL) {
        const __mmask16 lanes = k - i < VL ? (__mmask16)((1u << (k - i)) - 1) : 0xffff;
        const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, x + i));
        const __m512 value = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
        nan |= _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, _mm512_abs_ps(value));
    }
    const float most = nan ? NAN : _mm512_reduce_max_ps(top); /* a NaN makes the row's outputs NaN */
    const __m512 inverse = _mm512_set1_ps(most > 0.0f ? 127.0f / most : 0.0f);
    for (int64_t i = 0; i < k; i += VL) {
        const __mmask16 lanes = k - i < VL ? (__mmask16)((1u << (k - i)) - 1) : 0xffff;
        const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, x + i));
        const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)), inverse);
        const __m512i code = _mm512_add_epi32(_mm512_cvtps_epi32(value), _mm512_set1_epi32(128)); /* nearest even */
        _mm_mask_storeu_epi8(codes + i, lanes, _mm512_cvtepi32_epi8(code));
    }
    return most / 127.0f;
}

#define LINEAR_S8_CASE(R, V)                                                                                   \
    case R:                                                                                                    \
        linear_s8_block(codes + r0 * kp, kp, row_scale + r0, tile, s, c, k, b, op, o, ldo, y + r0 * ldy + n0,     \
                        ldy, tail, ahead, step, R, V);                                                           \
        break;
#define LINEAR_S8_ROWS_SWITCH(V)                                                                               \
    switch (rows) {                                                                                            \
        LINEAR_S8_CASE(1, V) LINEAR_S8_CASE(2, V) LINEAR_S8_CASE(3, V) LINEAR_S8_CASE(4, V)                    \
        LINEAR_S8_CASE(5, V) LINEAR_S8_CASE(6, V) LINEAR_S8_CASE(7, V) LINEAR_S8_CASE(8, V)                    \
        LINEAR_S8_CASE(9, V)                                                                                   \
    }

#if defined(__AVX512VNNI__)
static void linear_s8_tiles(const void *arg, int64_t first, int64_t last) {
    const struct linear_call *call = arg;
    const uint8_t *codes = call->codes;
    const uint16_t *other = call->other;
    const int8_t *packed = call->packed;
    const int64_t m = call->m, k = call->k, kp = call->kp, ldo = call->ldo, ldy = call->ldy;
    const int64_t n = call->n < last * LINEAR_TILE ? call->n : last * LINEAR_TILE;
    const float *bias = call->bias, *scale = call->scale, *row_scale = call->row_scale;
    const int32_t *sums = call->sums;
    const int op = call->op;
    uint16_t *y = call->y;
    const int64_t blocks = (m + LINEAR_ROWS - 1) / LINEAR_ROWS;
    for (int64_t n0 = first * LINEAR_TILE; n0 < n; n0 += LINEAR_TILE) {
        const int64_t cols = n - n0 < LINEAR_TILE ? n - n0 : LINEAR_TILE;
        const int vectors = (int)((cols + VL - 1) / VL);
        const __mmask16 tail = cols % VL ? (__mmask16)((1u << (cols % VL)) - 1) : 0xffff;
        const int8_t *tile = packed + n0 * k;
        const float *b = bias ? bias + n0 : NULL, *s = scale + n0;
        const int32_t *c = sums + n0;
        int64_t r0 = 0;
        for (int64_t block = 0; block < blocks; block++) {
            const int rows = (int)((m - r0) / (blocks - block));
            const uint16_t *o = other ? other + r0 * ldo + n0 : NULL;
            const int64_t step = vectors * 64; /* bytes of the tile a quad of k takes */
            const char *ahead = block == 0 ? (const char *)tile + LINEAR_AHEAD * step
                              : block == 1 ? (const char *)(tile + cols * k) + LINEAR_AHEAD * step : NULL;
            if (vectors == 3) {
                LINEAR_S8_ROWS_SWITCH(3)
            } else if (vectors == 2) {
                LINEAR_S8_ROWS_SWITCH(2)
            } else {
                LINEAR_S8_ROWS_SWITCH(1)
            }
            r0 += rows;
        }
    }
}

#if VLA_AMX && defined(__AMX_INT8__)
/* linear_s8_tiles on AMX tiles where the CPU has AMX-INT8: blocks of up to 16 rows of codes (tmm4, 64 values of k a
 * row) against the packed tile's 16 quads of k x 16 columns (tmm5-7: vla_pack_linear_s8_bf16's [k / 4][cols][4] is
 * the layout the tile product reads), the unsigned x signed byte products summed in int32 accumulator tiles (tmm0-2);
 * k past the last multiple of 64 by the byte dot-product instruction on the stored sums, then linear_s8_block's
 * epilogue (linear_s8_amx_store); the last two blocks in one pass where they are 17 to 32 rows, as the bf16 linear's
 * (linear_amx_pair). Integer sums are exact in any order: the same bits as the vector kernel. Two threads, the
 * whole int8 tick 2.25-2.28 ms against 2.15-2.20 with the pass (an Intel Xeon with AMX, 2 vCPU, alternating). */
static void linear_s8_amx_store(const struct linear_call *call, const int32_t *acc, const uint8_t *x, int64_t r0,
                                int64_t n0, int rows, int vectors, __mmask16 tail) {
    const int8_t *tile = (const int8_t *)call->packed + n0 * call->k;
    const int64_t k = call->k, kp = call->kp, ldo = call->ldo, ldy = call->ldy, tiled = k / 64 * 64;
    const float *row_scale = call->row_scale + r0, *bias = call->bias ? call->bias + n0 : NULL;
    const uint16_t *other = call->other ? call->other + r0 * ldo + n0 : NULL;
    uint16_t *y = call->y + r0 * ldy + n0;
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vectors; v++) {
            const __mmask16 lanes = v == vectors - 1 ? tail : 0xffff;
            __m512i sum = _mm512_load_si512(acc + r * LINEAR_TILE + v * VL);
            for (int64_t p = tiled / 4; p < k / 4; p++) {
                int32_t quad;
                memcpy(&quad, x + r * kp + 4 * p, sizeof quad);
                sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi32(quad),
                                          _mm512_loadu_si512(tile + (p * vectors + v) * 4 * VL));
            }
            linear_s8_store(sum, row_scale[r], call->scale + n0, call->sums + n0, bias, call->op, other, ldo, y, ldy,
                            r, v, lanes);
        }
}

static void linear_s8_amx_tiles(const void *arg, int64_t first, int64_t last) {
    const struct linear_call *call = arg;
    const uint8_t *codes = call->codes;
    const int8_t *packed = call->packed;
    const int64_t m = call->m, k = call->k, kp = call->kp, tiled = k / 64 * 64;
    const int64_t n = call->n < last * LINEAR_TILE ? call->n : last * LINEAR_TILE;
    int32_t acc[AMX_ROWS * LINEAR_TILE] __attribute__((aligned(64))); /* [rows][vectors * VL] */
    uint8_t rest[AMX_ROWS * 64] __attribute__((aligned(64)));        /* a second block's 64 values of k, padded */
    int configured = 0; /* the rows the tiles are configured for (0: none yet) */
    memset(rest, 0, sizeof rest);
    for (int64_t n0 = first * LINEAR_TILE; n0 < n; n0 += LINEAR_TILE) {
        const int64_t cols = n - n0 < LINEAR_TILE ? n - n0 : LINEAR_TILE;
        const int vectors = (int)((cols + VL - 1) / VL);
        const int64_t stride = vectors * 64; /* bytes of the tile a quad of k takes */
        const __mmask16 tail = cols % VL ? (__mmask16)((1u << (cols % VL)) - 1) : 0xffff;
        const int8_t *tile = packed + n0 * k;
        for (int64_t r0 = 0; r0 < m; r0 += AMX_ROWS) {
            const uint8_t *x = codes + r0 * kp, *x1 = x + AMX_ROWS * kp;
            if (m - r0 > AMX_ROWS && m - r0 <= 2 * AMX_ROWS) { /* the last two blocks in one pass, as the bf16 linear's
                                                                  linear_amx_pair: tmm0-2 and tmm5-7 their sums */
                const int second = (int)(m - r0 - AMX_ROWS);
                if (configured != AMX_ROWS) amx_configure(configured = AMX_ROWS);
                AMX_ZERO_SUMS(0, 1, 2, vectors);
                AMX_ZERO_SUMS(5, 6, 7, vectors);
                for (int64_t k0 = 0; k0 < tiled; k0 += 64) {
                    const int8_t *w = tile + k0 / 4 * stride;
                    _tile_loadd(4, x + k0, kp);
                    AMX_PRODUCTS(_tile_dpbusd, 0, 1, 2, 4, 3, w, stride, vectors);
                    for (int r = 0; r < second; r++)
                        _mm512_store_si512(rest + r * 64, _mm512_loadu_si512(x1 + r * kp + k0));
                    _tile_loadd(4, rest, 64);
                    AMX_PRODUCTS(_tile_dpbusd, 5, 6, 7, 4, 3, w, stride, vectors);
                }
                AMX_STORE_SUMS(0, 1, 2, acc, vectors);
                linear_s8_amx_store(call, acc, x, r0, n0, AMX_ROWS, vectors, tail);
                AMX_STORE_SUMS(5, 6, 7, acc, vectors);
                linear_s8_amx_store(call, acc, x1, r0 + AMX_ROWS, n0, second, vectors, tail);
                break;
            }
            const int rows = (int)(m - r0 < AMX_ROWS ? m - r0 : AMX_ROWS);
            if (rows != configured) amx_configure(configured = rows);
            AMX_ZERO_SUMS(0, 1, 2, vectors);
            for (int64_t k0 = 0; k0 < tiled; k0 += 64) {
                const int8_t *w = tile + k0 / 4 * stride;
                _tile_loadd(4, x + k0, kp);
                _tile_loadd(5, w, stride);
                _tile_dpbusd(0, 4, 5);
                if (vectors > 1) {
                    _tile_loadd(6, w + 64, stride);
                    _tile_dpbusd(1, 4, 6);
                }
                if (vectors > 2) {
                    _tile_loadd(7, w + 128, stride);
                    _tile_dpbusd(2, 4, 7);
                }
            }
            AMX_STORE_SUMS(0, 1, 2, acc, vectors);
            linear_s8_amx_store(call, acc, x, r0, n0, rows, vectors, tail);
        }
    }
    if (configured) _tile_release();
}
#endif
#endif

LINEAR_S8_SIGNATURE(vla_linear_s8_bf16, uint16_t) {
#if defined(__AVX512VNNI__)
    if (k % 4 || op < 0 || op > 3 || (op == 2 && !other)) return -1;
    const int64_t kp = (k + 63) / 64 * 64; /* a row's codes start on a cache line */
    const size_t bytes = (size_t)m * (size_t)kp + (size_t)m * sizeof(float); /* the codes, then the row scales */
    if (bytes > codes_capacity) {
        uint8_t *grown = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (!grown) return -3;
        free(codes_workspace);
        codes_workspace = grown;
        codes_capacity = bytes;
    }
    uint8_t *codes = codes_workspace;
    float *row_scale = (float *)(codes + (size_t)m * (size_t)kp);
    for (int64_t r = 0; r < m; r++) row_scale[r] = quantize_row(x + r * ldx, k, codes + r * kp);
    const struct linear_call call = {.m = m, .packed = packed, .n = n, .k = k, .bias = bias, .op = op,
                                     .other = other, .ldo = ldo, .y = y, .ldy = ldy, .scale = scale, .sums = sums,
                                     .codes = codes, .kp = kp, .row_scale = row_scale};
    const int64_t tiles = (n + LINEAR_TILE - 1) / LINEAR_TILE;
    part_task task = linear_s8_tiles;
#if VLA_AMX && defined(__AMX_INT8__)
    if (vla_amx(-1) == 1) task = linear_s8_amx_tiles;
#endif
    run_parts(task, &call, tiles, m * n * k >= THREADED_MIN_MACS ? threads : 1);
    return 0;
#else
    return -2;
#endif
}

PACK_LINEAR_S8_SIGNATURE(vla_pack_linear_s8_bf16, uint16_t) {
#if defined(__AVX512VNNI__)
    if (k % 4) return -1;
    for (int64_t c = 0; c < n; c++) {
        float most = 0.0f;
        for (int64_t i = 0; i < k; i++) most = fmaxf(most, fabsf(load_bf16(w + c * k + i)));
        scale[c] = most / 127.0f;
    }
    for (int64_t n0 = 0; n0 < n; n0 += LINEAR_TILE) {
        const int64_t cols = n - n0 < LINEAR_TILE ? n - n0 : LINEAR_TILE, padded = (cols + VL - 1) / VL * VL;
        for (int64_t c = 0; c < padded; c++) sums[n0 + c] = 0;
        for (int64_t c = cols; c < padded; c++) scale[n0 + c] = 0.0f;
        for (int64_t p = 0; p < k / 4; p++)
            for (int64_t c = 0; c < padded; c++)
                for (int64_t j = 0; j < 4; j++) {
                    int8_t q = 0;
                    if (c < cols && scale[n0 + c] > 0.0f) {
                        const float code = nearbyintf(load_bf16(w + (n0 + c) * k + 4 * p + j) / scale[n0 + c]);
                        q = (int8_t)fminf(fmaxf(code, -127.0f), 127.0f);
                        sums[n0 + c] += q;
                    }
                    *packed++ = q;
                }
    }
    return 0;
#else
    return -2;
#endif
}
#else
ATTENTION_SIGNATURE(vla_attention_bf16, uint16_t) {
    return -2;
}
LINEAR_SIGNATURE(vla_linear_bf16, uint16_t) {
    return -2;
}
PACK_LINEAR_SIGNATURE(vla_pack_linear_bf16, uint16_t) {
    return -2;
}
LINEAR_S8_SIGNATURE(vla_linear_s8_bf16, uint16_t) {
    return -2;
}
PACK_LINEAR_S8_SIGNATURE(vla_pack_linear_s8_bf16, uint16_t) {
    return -2;
}
#endif

/* Whether the bf16 linear and attention run on AMX tiles here: 1 where built with them, the kernel grants this
 * process their registers and they are not switched off; `use` 0 or 1 switches them off or back on (for
 * comparisons), -1 asks. */
int vla_amx(int use) {
#if VLA_AMX
    if (use == 0 || use == 1) amx_use = use;
    return amx_use && amx_granted();
#else
    (void)use;
    return 0;
#endif
}

/* Whether the int8 linear runs on AMX tiles here: vla_amx(-1) and built with AMX-INT8 too. */
int vla_amx_int8(void) {
#if VLA_AMX && defined(__AMX_INT8__)
    return vla_amx(-1);
#else
    return 0;
#endif
}

ATTENTION_SIGNATURE(vla_attention_f32, float) {
    return -2;
}

LINEAR_SIGNATURE(vla_linear_f32, float) {
    return -2;
}

PACK_LINEAR_SIGNATURE(vla_pack_linear_f32, float) {
    return -2;
}

LINEAR_S8_SIGNATURE(vla_linear_s8_f32, float) {
    return -2;
}

PACK_LINEAR_S8_SIGNATURE(vla_pack_linear_s8_f32, float) {
    return -2;
}

/* A native layer's weight, as PackedMatmul holds it: the bf16 linear's packed weight (scale and sums NULL), or
 * (weights = "int8") the int8 linear's packed codes, per-column scales and code sums (vla_pack_linear_s8_bf16's). */
struct weight {
    const void *packed;
    const float *scale;
    const int32_t *sums;
};

/* One decoder layer (model/decoder.LlamaDecoderLayer) of a block of n rows over the layer's key buffer, in one call:
 * the work MultiRatePolicy._run_block does a layer for the action tick's block over kv/prefix.PrefixBuffer, kernel by
 * kernel, the same kernels in the same order, so the same bits (backends/native_rows.py):
 *   h = rms_norm(x, norm_in); qkv = h Wqkv^T; q, k = rope(q, k); v
 *   k, v -> the stage (the block's K/V out) and the buffer's slots [block_at, block_at + n)
 *   attn = attention(q over the buffer's `keys` slots, bias [n, keys]); x = x + attn Wo^T
 *   h = rms_norm(x, norm_post); x = x + ((h Wup^T) * silu(h Wgate^T)) Wdown^T
 * x [n, width] bf16 is updated in place (each add in fp32, rounded once, as torch's); each weight a struct weight
 * (bf16 or int8); cos, sin [n, dim]; the stage and the buffer [kv_heads, slots, dim] at their (head, row)
 * strides; workspaces as sized below. Returns 0; -1 when the attention's or the int8 linear's workspace cannot be
 * allocated; -2 where the library was built without AVX512-BF16. */
struct decoder_rows {
    uint16_t *x;
    int64_t n, width, heads, kv_heads, dim, inter;
    const uint16_t *norm_in, *norm_post;                 /* [width] */
    const struct weight *w_qkv, *w_o, *w_gate, *w_up, *w_down; /* layer_linear's */
    const uint16_t *cos, *sin;                           /* [n, dim] */
    uint16_t *stage_k, *stage_v;
    int64_t stage_head, stage_row;
    uint16_t *buffer_k, *buffer_v;
    int64_t buffer_head, buffer_row, keys, block_at;
    const float *bias;
    int64_t bias_row;
    uint16_t *h;    /* [n, width] */
    uint16_t *qkv;  /* [n, (heads + 2 kv_heads) dim] */
    uint16_t *qk;   /* [heads + kv_heads, n, dim] */
    uint16_t *attn; /* [n, heads dim] */
    uint16_t *act;  /* [n, inter] */
    uint16_t *prod; /* [n, inter] */
    uint16_t *y;    /* [n, width] */
    int64_t threads;
    float eps, scale;
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) /* the native layers' pieces */
static void add_rows_bf16(uint16_t *x, const uint16_t *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) store_bf16(x + i, load_bf16(x + i) + load_bf16(y + i));
}

static void copy_rows(uint16_t *to, int64_t to_row, const uint16_t *from, int64_t from_row, int64_t rows,
                      int64_t dim) {
    for (int64_t r = 0; r < rows; r++) memcpy(to + r * to_row, from + r * from_row, (size_t)dim * 2);
}

static void gather_rows(uint16_t *to, const uint16_t *from, const int64_t *index, int64_t rows, int64_t width) {
    for (int64_t r = 0; r < rows; r++) memcpy(to + r * width, from + index[r] * width, (size_t)width * 2);
}

/* The frame layers' RMSNorm and RoPE with their rows (RoPE: its heads) split among the threads where there are
 * enough values: each row as the one-thread call computes it, so the same bits on any thread count. A full refresh's
 * 216 rows of 512 (norm) and 8 heads of them (RoPE) ran on the caller alone while the other thread waited: on an
 * Intel Xeon with AMX (2 vCPU), 2026-12-07, 0.92 of the 10.07 ms its decoder layers took; the frame 20.6-21.6 ms
 * against 21.5-22.4 after (three pairs of processes, alternating). */
struct norm_call { /* vla_rms_norm_bf16's operands */
    const uint16_t *x, *w;
    uint16_t *y;
    int64_t cols;
    float eps;
};

static void rms_norm_part(const void *arg, int64_t first, int64_t last) { /* rows [first, last) */
    const struct norm_call *c = arg;
    vla_rms_norm_bf16(c->x + first * c->cols, c->w, c->y + first * c->cols, last - first, c->cols, c->eps);
}

static void rms_norm_rows(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t cols, float eps,
                          int64_t threads) {
    const struct norm_call call = {.x = x, .w = w, .y = y, .cols = cols, .eps = eps};
    run_parts(rms_norm_part, &call, rows, rows * cols >= THREADED_MIN_VALUES ? threads : 1);
}

struct rope_call { /* vla_rope_bf16's operands */
    const uint16_t *x, *cos, *sin;
    int64_t x_head, x_row, rows, hd;
    uint16_t *out;
};

static void rope_part(const void *arg, int64_t first, int64_t last) { /* heads [first, last) */
    const struct rope_call *c = arg;
    vla_rope_bf16(c->x + first * c->x_head, c->x_head, c->x_row, c->cos, c->sin, last - first, c->rows, c->hd,
                  c->out + first * c->rows * c->hd);
}

static void rope_heads(const uint16_t *x, int64_t x_head, int64_t x_row, const uint16_t *cos, const uint16_t *sin,
                       int64_t heads, int64_t rows, int64_t hd, uint16_t *out, int64_t threads) {
    const struct rope_call call = {.x = x, .cos = cos, .sin = sin, .x_head = x_head, .x_row = x_row, .rows = rows,
                                   .hd = hd, .out = out};
    run_parts(rope_part, &call, heads, heads * rows * hd >= THREADED_MIN_VALUES ? threads : 1);
}

/* x [m, k] W^T as PackedMatmul runs it: on the int8 linear where the weight has scales (weights = "int8"), else on
 * the bf16 linear. Nonzero where the kernel failed (the int8 linear's codes workspace could not be allocated). */
static int layer_linear(const struct weight *w, const uint16_t *x, int64_t m, int64_t ldx, int64_t n, int64_t k,
                        const float *bias, int op, const uint16_t *other, int64_t ldo, uint16_t *y, int64_t ldy,
                        int64_t threads) {
    if (!w->scale) return vla_linear_bf16(x, m, ldx, w->packed, n, k, bias, op, other, ldo, y, ldy, threads);
    return vla_linear_s8_bf16(x, m, ldx, w->packed, w->scale, w->sums, n, k, bias, op, other, ldo, y, ldy, threads);
}

/* Llama's MLP of rows h [n, width] (normed already) into out [n, width], as PackedSwiGLU runs it:
 * down((h Wup^T) * silu(h Wgate^T)); act and prod [n, inter] its scratch. Nonzero where a linear failed. */
static int swiglu_mlp(const uint16_t *h, int64_t n, int64_t width, int64_t inter, const struct weight *w_gate,
                      const struct weight *w_up, const struct weight *w_down, uint16_t *act, uint16_t *prod,
                      uint16_t *out, int64_t threads) {
    return layer_linear(w_gate, h, n, width, inter, width, NULL, 1, NULL, 0, act, inter, threads)
           || layer_linear(w_up, h, n, width, inter, width, NULL, 2, act, inter, prod, inter, threads)
           || layer_linear(w_down, prod, n, inter, width, inter, NULL, 0, NULL, 0, out, width, threads);
}
#endif

int vla_decoder_rows_bf16(const struct decoder_rows *c) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const int64_t n = c->n, width = c->width, heads = c->heads, kv = c->kv_heads, dim = c->dim, inter = c->inter;
    const int64_t cols = (heads + 2 * kv) * dim, threads = c->threads;
    vla_rms_norm_bf16(c->x, c->norm_in, c->h, n, width, c->eps);
    if (layer_linear(c->w_qkv, c->h, n, width, cols, width, NULL, 0, NULL, 0, c->qkv, cols, threads))
        return -1;
    vla_rope_bf16(c->qkv, dim, cols, c->cos, c->sin, heads + kv, n, dim, c->qk); /* [n, cols] -> [H + KV, n, dim] */
    for (int64_t j = 0; j < kv; j++) { /* k: rows of qk's head heads + j; v: qkv's columns of head heads + kv + j */
        const uint16_t *k = c->qk + (heads + j) * n * dim, *v = c->qkv + (heads + kv + j) * dim;
        const int64_t stage = j * c->stage_head, slot = j * c->buffer_head + c->block_at * c->buffer_row;
        copy_rows(c->stage_k + stage, c->stage_row, k, dim, n, dim);
        copy_rows(c->stage_v + stage, c->stage_row, v, cols, n, dim);
        copy_rows(c->buffer_k + slot, c->buffer_row, k, dim, n, dim);
        copy_rows(c->buffer_v + slot, c->buffer_row, v, cols, n, dim);
    }
    if (vla_attention_bf16(c->qk, n * dim, dim, c->buffer_k, c->buffer_v, c->buffer_head, c->buffer_row, c->bias,
                           c->bias_row, heads, kv, n, c->keys, dim, c->scale, c->attn, dim, heads * dim, threads))
        return -1;
    if (layer_linear(c->w_o, c->attn, n, heads * dim, width, heads * dim, NULL, 0, NULL, 0, c->y, width,
                     threads))
        return -1;
    add_rows_bf16(c->x, c->y, n * width);
    vla_rms_norm_bf16(c->x, c->norm_post, c->h, n, width, c->eps);
    if (swiglu_mlp(c->h, n, width, inter, c->w_gate, c->w_up, c->w_down, c->act, c->prod, c->y, threads))
        return -1;
    add_rows_bf16(c->x, c->y, n * width);
    return 0;
#else
    (void)c;
    return -2;
#endif
}

/* The action head on the query rows' final hidden states x [queries, width] (backends/native_tick.py: NativeHead): the
 * final norm and the LM head (into h and head), their logits widened to fp32, and per row its bin (the argmax over its
 * `bins` logits from bin_base: the first of equal maxima, a NaN the maximum, as torch.argmax) and its value
 * (low + (bin + 0.5) * step of its dim, in double, rounded to float once, as ActionBins.to_values; row r is dim
 * r % dims). The same kernels on the same operands as the Python head (Decoder.logits), so the same bits. Returns 0;
 * -2 where built without AVX512-BF16. */
struct tick_head {
    const uint16_t *x; /* [queries, width] */
    int64_t queries, width;
    const uint16_t *norm; /* [width] */
    float eps;
    const struct weight *w_head;
    int64_t vocab;
    uint16_t *h;    /* [queries, width] */
    uint16_t *head; /* [queries, vocab] */
    float *logits;  /* [queries, vocab] */
    int64_t bin_base, bins, dims;
    const double *low, *step; /* [dims] */
    int64_t *out_bins;        /* [queries] */
    float *values;            /* [queries] */
    int64_t threads;
};

int vla_tick_head_bf16(const struct tick_head *c) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    vla_rms_norm_bf16(c->x, c->norm, c->h, c->queries, c->width, c->eps);
    if (layer_linear(c->w_head, c->h, c->queries, c->width, c->vocab, c->width, NULL, 0, NULL, 0, c->head,
                     c->vocab, c->threads))
        return -1;
    for (int64_t r = 0; r < c->queries; r++) {
        const uint16_t *head = c->head + r * c->vocab;
        float *logits = c->logits + r * c->vocab;
        for (int64_t j = 0; j < c->vocab; j++) logits[j] = load_bf16(head + j);
        const float *bins = logits + c->bin_base;
        int64_t best = 0;
        for (int64_t j = 1; j < c->bins && !isnan(bins[best]); j++)
            if (isnan(bins[j]) || bins[j] > bins[best]) best = j;
        const int64_t dim = r % c->dims;
        c->out_bins[r] = best;
        c->values[r] = (float)(c->low[dim] + ((double)best + 0.5) * c->step[dim]);
    }
    return 0;
#else
    (void)c;
    return -2;
#endif
}

int vla_tick_head_f32(const struct tick_head *c) { /* no fp32 form: the Python head runs */
    (void)c;
    return -2;
}

/* The action tick whole, in one call (backends/native_tick.py: NativeTick), on the prefix buffer its block was
 * set_block'ed in: rows of x: the state's embedding (state W_state^T + b_state, the state projection as PackedLinear
 * runs it; also into state_row, for the commit), then n - 1 copies of the action query's embedding; every decoder
 * layer as vla_decoder_rows_bf16 (the layers' own fields but for n, cos, sin and threads, which are this call's),
 * `stop` asked before each where given (nonzero: stop there); then vla_tick_head_bf16 on the query rows (`head`: its
 * x and threads this call's). The same kernels in the same order as the Python path, so the same bits. Returns 0;
 * -1 when the attention's or the int8 linear's workspace cannot be allocated; -2 where built without AVX512-BF16;
 * -3 when stop said to stop (before layer `stopped`; nothing after it ran). */
struct tick_rows {
    const struct decoder_rows *layers; /* [count] */
    int64_t count, n, threads;
    const uint16_t *cos, *sin; /* [n, dim] */
    const uint16_t *state;     /* [state_dim] */
    int64_t state_dim;
    const struct weight *w_state;
    const float *b_state;    /* [width] or NULL */
    uint16_t *state_row;     /* [width] */
    const uint16_t *query;   /* [width] */
    struct tick_head head;
    int (*stop)(int64_t layer);
    int64_t stopped;
};

int vla_tick_rows_bf16(struct tick_rows *t) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const struct decoder_rows *first = t->layers;
    const int64_t n = t->n, width = first->width;
    uint16_t *x = first->x;
    if (layer_linear(t->w_state, t->state, 1, t->state_dim, width, t->state_dim, t->b_state, 0, NULL, 0,
                     t->state_row, width, t->threads))
        return -1;
    memcpy(x, t->state_row, (size_t)width * 2);
    for (int64_t r = 1; r < n; r++) memcpy(x + r * width, t->query, (size_t)width * 2);
    for (int64_t i = 0; i < t->count; i++) {
        if (t->stop && t->stop(i)) {
            t->stopped = i;
            return -3;
        }
        struct decoder_rows layer = t->layers[i];
        layer.n = n, layer.cos = t->cos, layer.sin = t->sin, layer.threads = t->threads;
        if (vla_decoder_rows_bf16(&layer)) return -1;
    }
    struct tick_head head = t->head;
    head.x = x + width, head.queries = n - 1, head.threads = t->threads;
    return vla_tick_head_bf16(&head);
#else
    (void)t;
    return -2;
#endif
}

int vla_tick_rows_f32(struct tick_rows *t) { /* no fp32 form: the policy's own tick runs */
    (void)t;
    return -2;
}

/* A decoder layer of a reuse frame's pass with the action tick's rows in it (runtime/vision_cache.FrameTokenCache.run,
 * a partial run with the shared-drift sample, the extra rows attending over the tick's prefix buffer), in one call:
 * the same kernels in the same order as the Python layer (backends/native_frame.py), so the same bits. Rows of x:
 * the frame's T tokens, then the `extra` rows; `index` [picked + extra] the recomputed rows (sorted) then the extra
 * rows, as rows of x. Below the last layer:
 *   h = rms_norm(x, norm_in); k = rope(h Wk^T), v = h Wv^T (every row) -> the stage (frame rows) and extra_k/v
 *   q = rope(h[index] Wq^T, picked rotary); stage_q = live_q with the picked rows' queries
 *   attention of the picked rows over text | the frame's staged K/V; of the extra rows over the prefix buffer
 *     (the frame's K/V copied to its slots [frame_at, frame_at + T), the rows' own to [block_at, block_at + extra))
 *   out = attn Wo^T; stage_attn = shift(live_attn, out[:picked]), the frame's stream += it; extra rows += out[picked:]
 *   mid = x[index]; out = MLP(rms_norm(mid, norm_post)); stage_mlp and the streams likewise
 * The last layer (`last`): the K/V as above, then the extra rows alone through the rest of the layer (their queries
 * at their own rotary rows). Returns 0; -1 when the attention's or the int8 linear's workspace cannot be allocated;
 * -2 without AVX512-BF16. */
struct frame_rows {
    uint16_t *x;
    int64_t tokens, extra, picked, last, width, heads, kv_heads, dim, inter;
    const uint16_t *norm_in, *norm_post;
    const struct weight *w_q, *w_k, *w_v, *w_o, *w_gate, *w_up, *w_down; /* layer_linear's */
    const uint16_t *cos, *sin;                                      /* [tokens + extra, dim] */
    const uint16_t *picked_cos, *picked_sin;                        /* [picked + extra, dim] */
    const int64_t *index, *sample, *at;
    int64_t samples;
    uint16_t *stage_k, *stage_v;                                    /* [kv_heads, tokens, dim] */
    uint16_t *extra_k, *extra_v;
    int64_t extra_head, extra_row;
    uint16_t *stage_q;                                              /* [heads, tokens, dim] */
    const uint16_t *live_q;
    uint16_t *stage_attn, *stage_mlp;                               /* [tokens, width] */
    const uint16_t *live_attn, *live_mlp;
    const uint16_t *text_k, *text_v;
    int64_t text_head, text_row, text_tokens;
    uint16_t *buffer_k, *buffer_v;
    int64_t buffer_head, buffer_row, keys, frame_at, block_at;
    const float *bias;
    int64_t bias_row;
    uint16_t *h;       /* [tokens + extra, width] */
    uint16_t *k, *v;   /* [tokens + extra, kv_heads dim] */
    uint16_t *kr;      /* [kv_heads, tokens + extra, dim] */
    uint16_t *q;       /* [tokens + extra, heads dim] */
    uint16_t *qr;      /* [heads, tokens + extra, dim] */
    uint16_t *gk, *gv; /* [kv_heads, text_tokens + tokens, dim] */
    uint16_t *attn;    /* [tokens + extra, heads dim] */
    uint16_t *out;     /* [tokens + extra, width] */
    uint16_t *act, *prod; /* [tokens + extra, inter] */
    int64_t threads;
    float eps, scale;
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* The extra rows' queries qr [heads, rows, dim] at head stride q_head over the prefix buffer, into attn's rows. */
static int frame_extra_attention(const struct frame_rows *c, const uint16_t *qr, int64_t q_head, uint16_t *attn) {
    const int64_t T = c->tokens, ne = c->extra, dim = c->dim;
    for (int64_t j = 0; j < c->kv_heads; j++) {
        const int64_t frame = j * c->buffer_head + c->frame_at * c->buffer_row;
        const int64_t block = j * c->buffer_head + c->block_at * c->buffer_row;
        copy_rows(c->buffer_k + frame, c->buffer_row, c->stage_k + j * T * dim, dim, T, dim);
        copy_rows(c->buffer_v + frame, c->buffer_row, c->stage_v + j * T * dim, dim, T, dim);
        copy_rows(c->buffer_k + block, c->buffer_row, c->extra_k + j * c->extra_head, c->extra_row, ne, dim);
        copy_rows(c->buffer_v + block, c->buffer_row, c->extra_v + j * c->extra_head, c->extra_row, ne, dim);
    }
    return vla_attention_bf16(qr, q_head, dim, c->buffer_k, c->buffer_v, c->buffer_head, c->buffer_row, c->bias,
                              c->bias_row, c->heads, c->kv_heads, ne, c->keys, dim, c->scale, attn, dim,
                              c->heads * dim, c->threads);
}

/* The MLP of rows h [n, width] (normed already) into out [n, width], on the frame call's weights and scratch. */
static int frame_mlp(const struct frame_rows *c, const uint16_t *h, int64_t n, uint16_t *out) {
    return swiglu_mlp(h, n, c->width, c->inter, c->w_gate, c->w_up, c->w_down, c->act, c->prod, out,
                      c->threads);
}
#endif

int vla_frame_rows_bf16(const struct frame_rows *c) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const int64_t T = c->tokens, ne = c->extra, R = T + ne, width = c->width, H = c->heads, KV = c->kv_heads;
    const int64_t dim = c->dim, kvw = KV * dim, hw = H * dim, threads = c->threads;
    uint16_t *x = c->x, *xe = c->x + T * width;
    rms_norm_rows(x, c->norm_in, c->h, R, width, c->eps, threads);
    if (layer_linear(c->w_k, c->h, R, width, kvw, width, NULL, 0, NULL, 0, c->k, kvw, threads)) return -1;
    rope_heads(c->k, dim, kvw, c->cos, c->sin, KV, R, dim, c->kr, threads); /* [R, KV dim] -> [KV, R, dim] */
    if (layer_linear(c->w_v, c->h, R, width, kvw, width, NULL, 0, NULL, 0, c->v, kvw, threads)) return -1;
    for (int64_t j = 0; j < KV; j++) {
        copy_rows(c->stage_k + j * T * dim, dim, c->kr + j * R * dim, dim, T, dim);
        copy_rows(c->stage_v + j * T * dim, dim, c->v + j * dim, kvw, T, dim);
        copy_rows(c->extra_k + j * c->extra_head, c->extra_row, c->kr + (j * R + T) * dim, dim, ne, dim);
        copy_rows(c->extra_v + j * c->extra_head, c->extra_row, c->v + T * kvw + j * dim, kvw, ne, dim);
    }
    if (c->last) { /* the extra rows alone finish the layer */
        if (layer_linear(c->w_q, c->h + T * width, ne, width, hw, width, NULL, 0, NULL, 0, c->q, hw, threads))
            return -1;
        vla_rope_bf16(c->q, dim, hw, c->cos + T * dim, c->sin + T * dim, H, ne, dim, c->qr); /* -> [H, ne, dim] */
        if (frame_extra_attention(c, c->qr, ne * dim, c->attn)) return -1;
        if (layer_linear(c->w_o, c->attn, ne, hw, width, hw, NULL, 0, NULL, 0, c->out, width, threads))
            return -1;
        add_rows_bf16(xe, c->out, ne * width);
        vla_rms_norm_bf16(xe, c->norm_post, c->h, ne, width, c->eps);
        if (frame_mlp(c, c->h, ne, c->out)) return -1;
        add_rows_bf16(xe, c->out, ne * width);
        return 0;
    }
    const int64_t n = c->picked, m = n + ne, text = c->text_tokens, keys = text + T;
    gather_rows(c->q, c->h, c->index, m, width); /* h[index] (the query matmul's input), in q's room */
    if (layer_linear(c->w_q, c->q, m, width, hw, width, NULL, 0, NULL, 0, c->attn, hw, threads)) return -1;
    rope_heads(c->attn, dim, hw, c->picked_cos, c->picked_sin, H, m, dim, c->qr, threads); /* -> [H, m, dim] */
    if (n < T) memcpy(c->stage_q, c->live_q, (size_t)(H * T * dim) * 2); /* the reused rows' queries */
    for (int64_t head = 0; head < H; head++)
        for (int64_t r = 0; r < n; r++)
            memcpy(c->stage_q + (head * T + c->index[r]) * dim, c->qr + (head * m + r) * dim, (size_t)dim * 2);
    for (int64_t j = 0; j < KV; j++) { /* text | the frame's staged K/V, gathered as gather_attention does */
        copy_rows(c->gk + j * keys * dim, dim, c->text_k + j * c->text_head, c->text_row, text, dim);
        copy_rows(c->gv + j * keys * dim, dim, c->text_v + j * c->text_head, c->text_row, text, dim);
        copy_rows(c->gk + (j * keys + text) * dim, dim, c->stage_k + j * T * dim, dim, T, dim);
        copy_rows(c->gv + (j * keys + text) * dim, dim, c->stage_v + j * T * dim, dim, T, dim);
    }
    if (vla_attention_bf16(c->qr, m * dim, dim, c->gk, c->gv, keys * dim, dim, NULL, 0, H, KV, n, keys, dim,
                           c->scale, c->attn, dim, hw, threads)
        || frame_extra_attention(c, c->qr + n * dim, m * dim, c->attn + n * hw))
        return -1;
    if (layer_linear(c->w_o, c->attn, m, hw, width, hw, NULL, 0, NULL, 0, c->out, width, threads)) return -1;
    vla_shift_bf16(c->live_attn, c->out, 0, width, c->index, n, c->sample, c->at, c->samples, c->stage_attn, 1, T,
                   width, x, threads);
    add_rows_bf16(xe, c->out + n * width, ne * width);
    gather_rows(c->q, x, c->index, m, width); /* the MLP's rows of the streams, in q's room */
    rms_norm_rows(c->q, c->norm_post, c->h, m, width, c->eps, threads);
    if (frame_mlp(c, c->h, m, c->out)) return -1;
    vla_shift_bf16(c->live_mlp, c->out, 0, width, c->index, n, c->sample, c->at, c->samples, c->stage_mlp, 1, T,
                   width, x, threads);
    add_rows_bf16(xe, c->out + n * width, ne * width);
    return 0;
#else
    (void)c;
    return -2;
#endif
}

int vla_frame_rows_f32(const struct frame_rows *c) { /* no fp32 form: the frame cache's own layers run */
    (void)c;
    return -2;
}

/* Half a vision tower layer of a partial refresh (runtime/vision_cache.VisionTokenCache._layer: the picked rows with
 * the shared-drift sample), in one call: the same kernels in the same order as the Python layer, so the same bits
 * (backends/native_tower.py). The layer norms stay torch's (their bits are its kernel's); `h` is the picked rows'
 * normed input [picked, width]. part 0, the attention: qkv = h Wqkv^T + b; stage_qkv = shift(live_qkv, qkv) (the
 * three [heads, tokens, dim] at once); attn = attention(q over the staged K/V); stage_attn = shift(live_attn,
 * attn Wo^T + b), x += it. part 1, the MLP: stage_mlp = shift(live_mlp, fc2(gelu_tanh(fc1(h)))), x += it.
 * Returns 0; -1 when the attention's or the int8 linear's workspace cannot be allocated; -2 without AVX512-BF16. */
struct tower_rows {
    uint16_t *x; /* [tokens, width] the camera's residual stream */
    int64_t tokens, picked, width, heads, dim, inter, part;
    const uint16_t *h;
    const struct weight *w_qkv, *w_o, *w_fc1, *w_fc2; /* layer_linear's */
    const float *b_qkv, *b_o, *b_fc1, *b_fc2;    /* fp32 or NULL */
    const int64_t *rows, *sample, *at;
    int64_t samples;
    uint16_t *stage_qkv; /* [3, heads, tokens, dim] */
    const uint16_t *live_qkv;
    uint16_t *stage_out; /* [tokens, width]: the attention's or the MLP's update */
    const uint16_t *live_out;
    uint16_t *qkv;  /* [picked, 3 width] */
    uint16_t *attn; /* [picked, width] */
    uint16_t *out;  /* [picked, width] */
    uint16_t *act;  /* [picked, inter] */
    int64_t threads;
    float scale;
};

int vla_tower_rows_bf16(const struct tower_rows *c) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const int64_t T = c->tokens, n = c->picked, W = c->width, H = c->heads, dim = c->dim, threads = c->threads;
    if (c->part == 0) {
        if (layer_linear(c->w_qkv, c->h, n, W, 3 * W, W, c->b_qkv, 0, NULL, 0, c->qkv, 3 * W, threads))
            return -1;
        /* [n, 3 W] as [3, H, n, dim]: head stride dim, token stride 3 W */
        vla_shift_bf16(c->live_qkv, c->qkv, dim, 3 * W, c->rows, n, c->sample, c->at, c->samples, c->stage_qkv,
                       3 * H, T, dim, NULL, threads);
        const uint16_t *k = c->stage_qkv + H * T * dim, *v = k + H * T * dim;
        if (vla_attention_bf16(c->qkv, dim, 3 * W, k, v, T * dim, dim, NULL, 0, H, H, n, T, dim, c->scale, c->attn,
                               dim, W, threads))
            return -1;
        if (layer_linear(c->w_o, c->attn, n, W, W, W, c->b_o, 0, NULL, 0, c->out, W, threads)) return -1;
    } else if (layer_linear(c->w_fc1, c->h, n, W, c->inter, W, c->b_fc1, 3, NULL, 0, c->act, c->inter, threads)
               || layer_linear(c->w_fc2, c->act, n, c->inter, W, c->inter, c->b_fc2, 0, NULL, 0, c->out, W,
                               threads)) {
        return -1;
    }
    vla_shift_bf16(c->live_out, c->out, 0, W, c->rows, n, c->sample, c->at, c->samples, c->stage_out, 1, T, W, c->x,
                   threads);
    return 0;
#else
    (void)c;
    return -2;
#endif
}

int vla_tower_rows_f32(const struct tower_rows *c) { /* no fp32 form: the tower cache's own layers run */
    (void)c;
    return -2;
}

int vla_decoder_rows_f32(const struct decoder_rows *c) { /* no fp32 form: the policy's own layers run */
    (void)c;
    return -2;
}
