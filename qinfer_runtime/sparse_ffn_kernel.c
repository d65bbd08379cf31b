/* One decode token's sparse ReLU FFN over f16 rows picked by id, without copying the rows first.
 *
 * torch can only compute on picked rows after gathering them into a new tensor, which writes every byte it
 * reads and then reads it again; here each selected row is read once, straight from the (mapped) weights.
 * Built on first use by qinfer_runtime/sparse_ffn_native.py with the machine's C compiler and OpenMP.
 *
 * Weights are row-major f16 [rows, n] with a row stride in elements; neuron ids[j] is row ids[j] of gate, up and
 * down_t. variant: 0 llama relu(g)*u, 1 bamboo relu(g)*relu(u), 2 falcon relu(u) (no gate).
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
static inline vec vload_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vset(float a) { return _mm512_set1_ps(a); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
static inline vec vload_half(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vset(float a) { return _mm256_set1_ps(a); }
static inline float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#define LANES 1
#endif

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        /* Subnormal half: normalise the mantissa into a float exponent. */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Rows are scattered, so the hardware prefetcher restarts at each one; reading the next row (`next`) ahead while
 * this one is summed keeps enough reads in flight to run near memory bandwidth. */
static float dot_half(const uint16_t *w, const uint16_t *next, const float *x, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if LANES > 1
    vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (; i + 4 * LANES <= n; i += 4 * LANES) {
        __builtin_prefetch(next + i);
        __builtin_prefetch(next + i + 2 * LANES);
        a0 = vfma(vload_half(w + i), vload(x + i), a0);
        a1 = vfma(vload_half(w + i + LANES), vload(x + i + LANES), a1);
        a2 = vfma(vload_half(w + i + 2 * LANES), vload(x + i + 2 * LANES), a2);
        a3 = vfma(vload_half(w + i + 3 * LANES), vload(x + i + 3 * LANES), a3);
    }
    s = vsum(a0) + vsum(a1) + vsum(a2) + vsum(a3);
#endif
    for (; i < n; i++) s += half_to_float(w[i]) * x[i];
    return s;
}

/* out[c0:c1] += sum over 4 rows r[m][c] * a[m]: four rows per pass read and write the output a quarter as often. */
static void add_rows4(float *out, const uint16_t *const r[4], const float a[4], int64_t n) {
    int64_t c = 0;
#if LANES > 1
    vec b0 = vset(a[0]), b1 = vset(a[1]), b2 = vset(a[2]), b3 = vset(a[3]);
    for (; c + LANES <= n; c += LANES) {
        vec s = vload(out + c);
        s = vfma(vload_half(r[0] + c), b0, s);
        s = vfma(vload_half(r[1] + c), b1, s);
        s = vfma(vload_half(r[2] + c), b2, s);
        s = vfma(vload_half(r[3] + c), b3, s);
        vstore(out + c, s);
    }
#endif
    for (; c < n; c++)
        out[c] += a[0] * half_to_float(r[0][c]) + a[1] * half_to_float(r[1][c]) + a[2] * half_to_float(r[2][c]) +
                  a[3] * half_to_float(r[3][c]);
}

/* act[j] for each selected neuron, then out[n] = sum_j act[j] * down_t[ids[j]]. act is caller scratch [k]. */
void qinfer_sparse_ffn(const uint16_t *gate, int64_t gate_stride, const uint16_t *up, int64_t up_stride,
                       const uint16_t *down, int64_t down_stride, const float *x, int64_t n, const int64_t *ids,
                       int64_t k, int variant, float *act, float *out, int threads) {
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < k; j++) {
            int64_t next = ids[j + 1 < k ? j + 1 : j];
            float g = 1.0f;
            if (variant != 2) {
                g = dot_half(gate + ids[j] * gate_stride, gate + next * gate_stride, x, n);
                /* A neuron whose gate does not fire contributes nothing: its up and down rows are never read. */
                if (g <= 0.0f) {
                    act[j] = 0.0f;
                    continue;
                }
            }
            float u = dot_half(up + ids[j] * up_stride, up + next * up_stride, x, n);
            if (variant != 0 && u < 0.0f) u = 0.0f;
            act[j] = variant == 2 ? u : g * u;
        }
        /* Each thread owns a slice of the output columns, so the sums need no locks. */
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t per = ((n + nt - 1) / nt + 15) / 16 * 16;
        int64_t c0 = t * per < n ? t * per : n, c1 = c0 + per < n ? c0 + per : n;
        float *o = out + c0;
        memset(o, 0, (size_t)(c1 - c0) * sizeof(float));
        const uint16_t *rows[4];
        float a[4];
        int m = 0;
        for (int64_t j = 0; j < k; j++) {
            if (act[j] == 0.0f) continue;
            rows[m] = down + ids[j] * down_stride + c0;
            a[m] = act[j];
            if (++m == 4) {
                add_rows4(o, rows, a, c1 - c0);
                m = 0;
            }
        }
        for (int i = m; i < 4 && m > 0; i++) {
            rows[i] = rows[0];
            a[i] = 0.0f;
        }
        if (m > 0) add_rows4(o, rows, a, c1 - c0);
    }
}
