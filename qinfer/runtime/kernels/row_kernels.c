/* Decode-time products over weight rows read straight from the (mapped) file: a sparse FFN over rows picked by id, and a matrix-vector product over all rows. Rows are F16, Q4_0 or Q8_0 (ggml block layouts, see
 * qinfer/runtime/kernels/quant_rows.py), so quantized weights are never expanded into a float copy.
 *
 * torch can only compute on picked rows after gathering them into a new tensor, which writes every byte it
 * reads and then reads it again, and on quantized rows only after dequantizing them; here each row is read once.
 * Built on first use by qinfer/runtime/kernels/row_kernels.py with the machine's C compiler and OpenMP.
 *
 * A weight is a base pointer, a row stride in bytes, a type (F16, Q4_0, Q8_0), and its rows and columns.
 * Neuron ids[j] is row ids[j] of gate, up and down_t; the FFN form says how gate and up make its activation.
 * The codes, block layouts and structures are mirrored in qinfer/runtime/kernels/abi.py and checked against
 * qinfer_abi (decode_layer.c) when the library loads.
 *
 * Shapes come from model files, which come from the internet: every entry point checks the ids and row lengths
 * against the weights' own rows and columns before it reads anything, and returns -1 (nothing read) where they do
 * not fit, so no crafted header makes a kernel read past a tensor; -2 means no memory for the quantized input.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
/* The integer-product kernels need AVX2 for the products, F16C for the scales and FMA for the sums. */
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define INT_AVX2 1
#else
#define INT_AVX2 0
#endif
/* The blocked quantized product's widest kernel sums 16 rows at once with VNNI, whose products of unsigned and
 * signed bytes have no int16 step to saturate (AVX-512 without VNNI takes the AVX2 kernel). */
#if INT_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INT_AVX512 1
#else
#define INT_AVX512 0
#endif
/* Its tile form (AMX, Intel from Sapphire Rapids) is built where the compiler targets it, and used only where Linux
 * grants the process the tile registers (see amx_granted). */
#if INT_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define QG_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define QG_AMX 0
#endif

enum { F16 = 0, Q4_0 = 1, Q8_0 = 2 };
/* relu(gate) * up, relu(gate) * relu(up), relu(up), silu(gate) * up (SwiGLU) */
enum { FORM_GATED = 0, FORM_GATED_RELU_UP = 1, FORM_UP = 2, FORM_GATED_SILU = 3 };

/* The activation of a neuron's first product: silu of SwiGLU's gate, relu of any other gate or of up where there
 * is no gate (0 means the neuron adds nothing). */
static inline float gate_act(int form, float g) {
    if (form == FORM_GATED_SILU) return g / (1.0f + expf(-g));
    return g > 0.0f ? g : 0.0f;
}

/* What up's product u multiplies a gated neuron's activation by: relu(u) for FORM_GATED_RELU_UP, else u. */
static inline float up_factor(int form, float u) { return form == FORM_GATED_RELU_UP && u < 0.0f ? 0.0f : u; }

#if INT_AVX2
/* The sum of the eight floats of v (the AVX2 vector sum, and the integer kernels' too under AVX-512). */
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif
#define QK 32 /* weights per quantized block */
#define Q4_0_BYTES (2 + QK / 2) /* an f16 scale, then 32 nibbles */
#define Q8_0_BYTES (2 + QK)     /* an f16 scale, then 32 signed bytes */
/* Tokens a kernel takes at once: a prompt's products go a block at a time, each row read once per block. */
#define TOKEN_BLOCK 16

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
static inline vec vload_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
/* max(a, b) is b where either is NaN (the instruction's rule), so NaN passes through max(bound, x). */
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vround(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* 2^n for whole n in float's normal exponent range, built from the exponent bits. */
static inline vec vpow2(vec n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
/* y where x >= bound (or NaN), else 0. */
static inline vec vzero_below(vec y, vec x, float bound) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(bound), _CMP_NLT_UQ), y);
}
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vset(float a) { return _mm512_set1_ps(a); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
/* LANES signed bytes as floats; the low and the high nibbles of LANES bytes, each minus 8, as floats. */
static inline vec vload_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
/* A nibble becomes its weight (nibble - 8) by a table lookup, which reads only an index's low four bits: no mask,
 * no subtraction, no conversion. */
static inline void vload_q4(const uint8_t *p, vec *lo, vec *hi) {
    const __m512 weights = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_permutexvar_ps(b, weights);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), weights);
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
static inline vec vload_half(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vround(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vpow2(vec n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vec vzero_below(vec y, vec x, float bound) {
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(bound), _CMP_NLT_UQ), y);
}
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vset(float a) { return _mm256_set1_ps(a); }
static inline float vsum(vec v) { return hsum256(v); }
static inline vec vload_i8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline void vload_q4(const uint8_t *p, vec *lo, vec *hi) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), eight = _mm256_set1_epi32(8);
    *lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), eight));
    *hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight));
}
#else
#define LANES 1
#endif

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
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
#endif
}

static inline float block_scale(const uint8_t *block) { return half_to_float((uint16_t)(block[0] | block[1] << 8)); }

static inline int64_t block_bytes(int type) { return type == Q4_0 ? Q4_0_BYTES : Q8_0_BYTES; }

/* Whether n values can be read from every picked row (ids[0..k-1], or rows 0..k-1 where ids is NULL) of a weight
 * of `rows` rows of `cols` values, `stride` bytes apart. A row must hold exactly n, so no output is left unwritten. */
static int fits(int type, int64_t stride, int64_t rows, int64_t cols, int64_t n, const int64_t *ids, int64_t k) {
    if (n < 0 || k < 0 || rows < 0 || n != cols || (type != F16 && n % QK)) return 0;
    int64_t bytes = type == F16 ? 2 * n : n / QK * block_bytes(type);
    if (rows > 1 && stride < bytes) return 0;
    if (!ids) return k <= rows;
    for (int64_t j = 0; j < k; j++)
        if (ids[j] < 0 || ids[j] >= rows) return 0;
    return 1;
}

/* Rows are scattered, so the hardware prefetcher restarts at each one; reading the next row (`next`) ahead while
 * this one is summed keeps enough reads in flight to run near memory bandwidth. Consecutive rows of a matrix
 * stream without it, and there the extra instructions only cost (23 against 29 GB/s for an F16 product on two
 * Zen 4 cores): their `next` is NULL. */
static inline void prefetch(const uint8_t *next, int64_t byte) {
    if (next) __builtin_prefetch(next + byte);
}

#if LANES > 1
/* The end of an F16 row's dot product from column i on, given its four vector sums so far: a short row (an attention
 * head of 32 or 64) takes the rest a vector at a time, the sums one reduction, then the last columns one by one.
 * dot_f16 and f16_rows both end here, so a row's sum is the same whichever of them read it. */
static inline float f16_row_end(vec a0, vec a1, vec a2, vec a3, const uint16_t *w, const float *x, int64_t i,
                                int64_t n) {
    for (; i + LANES <= n; i += LANES) a0 = vfma(vload_half(w + i), vload(x + i), a0);
    float s = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
    for (; i < n; i++) s += half_to_float(w[i]) * x[i];
    return s;
}
#endif

static float dot_f16(const uint16_t *w, const uint8_t *next, const float *x, int64_t n) {
    int64_t i = 0;
#if LANES > 1
    vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (; i + 4 * LANES <= n; i += 4 * LANES) {
        prefetch(next, 2 * i);
        prefetch(next, 2 * i + 64);
        a0 = vfma(vload_half(w + i), vload(x + i), a0);
        a1 = vfma(vload_half(w + i + LANES), vload(x + i + LANES), a1);
        a2 = vfma(vload_half(w + i + 2 * LANES), vload(x + i + 2 * LANES), a2);
        a3 = vfma(vload_half(w + i + 3 * LANES), vload(x + i + 3 * LANES), a3);
    }
    return f16_row_end(a0, a1, a2, a3, w, x, i, n);
#else
    (void)next;
    float s = 0.0f;
    for (; i < n; i++) s += half_to_float(w[i]) * x[i];
    return s;
#endif
}

#if LANES > 1
/* Rows a one-token F16 product sums at once: each input vector loaded serves them all, and each thread keeps that
 * many streams in flight. Four need sixteen sums in registers, which AVX-512 has room for and AVX2 does not. */
#define F16_ROWS (LANES == 16 ? 4 : 2)
#define F16_STEP (4 * LANES)

/* How far ahead (bytes) a one-token F16 product reads each of its rows; 0 leaves it to the hardware prefetcher. On
 * an Intel Xeon (Sapphire Rapids, two threads of one core), four rows at once read 4096 x 4096, 11008 x 4096 and
 * 4096 x 11008 products at 1.2-1.3x one row at a time, and reading 1 KiB ahead made that 1.35-1.45x. Both were
 * measured on that Xeon alone; the rows are grouped everywhere, but reading ahead stays off on other vendors' CPUs,
 * where it once cost consecutive rows bandwidth (prefetch, on Zen 4). */
static int64_t f16_ahead;
__attribute__((constructor)) static void f16_ahead_set(void) {
    __builtin_cpu_init();
    f16_ahead = __builtin_cpu_is("intel") ? 1024 : 0;
}

/* F16_ROWS rows, `stride` bytes apart from row0, each . x [n] into out[0..F16_ROWS-1]: each row's sum is dot_f16's,
 * the same products added in the same order and ended by the same f16_row_end, so the output does not depend on how
 * rows were grouped. */
static inline __attribute__((always_inline)) void f16_rows(const uint8_t *row0, int64_t stride, const float *x,
                                                          int64_t n, float *out) {
    const uint16_t *w[F16_ROWS];
    vec a[F16_ROWS][4];
    for (int r = 0; r < F16_ROWS; r++) {
        w[r] = (const uint16_t *)(row0 + r * stride);
        a[r][0] = a[r][1] = a[r][2] = a[r][3] = vzero();
    }
    int64_t i = 0;
    for (; i + F16_STEP <= n; i += F16_STEP) {
        vec x0 = vload(x + i), x1 = vload(x + i + LANES), x2 = vload(x + i + 2 * LANES), x3 = vload(x + i + 3 * LANES);
        for (int r = 0; r < F16_ROWS; r++) {
            if (f16_ahead)
                for (int b = 0; b < F16_STEP * 2; b += 64) __builtin_prefetch((const uint8_t *)(w[r] + i) + f16_ahead + b);
            a[r][0] = vfma(vload_half(w[r] + i), x0, a[r][0]);
            a[r][1] = vfma(vload_half(w[r] + i + LANES), x1, a[r][1]);
            a[r][2] = vfma(vload_half(w[r] + i + 2 * LANES), x2, a[r][2]);
            a[r][3] = vfma(vload_half(w[r] + i + 3 * LANES), x3, a[r][3]);
        }
    }
    for (int r = 0; r < F16_ROWS; r++) out[r] = f16_row_end(a[r][0], a[r][1], a[r][2], a[r][3], w[r], x, i, n);
}

#define F16_TILE 8
/* One F16 row against tokens t0..t0+count-1 (count <= F16_TILE): each stretch of the row is converted once for all
 * of them. Inlined with a constant count, the sums stay in registers. */
static inline __attribute__((always_inline)) void f16_tile(const uint16_t *w, const float *x, int64_t t0, int count,
                                                          int64_t n, float *out, int64_t out_stride) {
    vec acc[F16_TILE];
    for (int t = 0; t < count; t++) acc[t] = vzero();
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vec wv = vload_half(w + i);
        for (int t = 0; t < count; t++) acc[t] = vfma(wv, vload(x + (t0 + t) * n + i), acc[t]);
    }
    for (int t = 0; t < count; t++) {
        float s = vsum(acc[t]);
        for (int64_t c = i; c < n; c++) s += half_to_float(w[c]) * x[(t0 + t) * n + c];
        out[t * out_stride] = s;
    }
}
#endif

/* Quantized weights multiply activations quantized to Q8_0 as ggml does (Q4_0 x Q8_0, Q8_0 x Q8_0): per block of
 * 32, q = round(x / d) with d = max|x| / 127, and the row's dot product is sum over blocks of d_w * d_x * (integer
 * dot of the 32 weights with the 32 q). Integer products do in one instruction what the float path does in four
 * (widen, convert, scale, add), which is what keeps a quantized row at memory speed. Unlike ggml, d stays float
 * instead of being rounded to f16, so the error is at most ggml's. */
typedef struct {
    int8_t *q;     /* [tokens, n] */
    float *d;      /* [tokens, n / 32] */
    int32_t *sum;  /* [tokens, n / 32]: sum of each block's q */
} q8_act;

/* The first `blocks` blocks of 32 of x into a's buffers. A prompt's input is millions of values, whose quantizing
 * one value at a time took a third of a 4096 x 4096 product of 512 tokens; the vector form rounds as roundf does
 * (half away from zero: the truncation, plus the sign where the dropped fraction is at least a half), so both
 * give the same bytes. */
static void q8_quantize_blocks(const float *x, int64_t blocks, const q8_act *a) {
#if defined(__AVX512F__)
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    for (int64_t b = 0; b < blocks; b++) {
        __m512 v[2] = {_mm512_loadu_ps(x + b * QK), _mm512_loadu_ps(x + b * QK + 16)};
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
        a->d[b] = d;
        __m512i sum = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            __m512 scaled = _mm512_mul_ps(v[h], _mm512_set1_ps(inv));
            __m512 whole = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(scaled, whole)), half, _CMP_GE_OQ);
            __m512 sign = _mm512_castsi512_ps(_mm512_or_si512(
                _mm512_and_si512(_mm512_castps_si512(scaled), _mm512_set1_epi32(INT32_MIN)), _mm512_castps_si512(one)));
            __m512i q = _mm512_cvttps_epi32(_mm512_mask_add_ps(whole, up, whole, sign));
            _mm_storeu_si128((__m128i *)(a->q + b * QK + 16 * h), _mm512_cvtepi32_epi8(q));
            sum = _mm512_add_epi32(sum, q);
        }
        a->sum[b] = _mm512_reduce_add_epi32(sum);
    }
#else
    for (int64_t b = 0; b < blocks; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
        a->d[b] = d;
        int32_t sum = 0;
        for (int i = 0; i < QK; i++) sum += a->q[b * QK + i] = (int8_t)roundf(xb[i] * inv);
        a->sum[b] = sum;
    }
#endif
}

/* Buffers for `tokens` inputs of n quantized (q8_free releases them); -1 where memory runs out. */
static int q8_alloc(int64_t tokens, int64_t n, q8_act *a) {
    a->q = malloc((size_t)(tokens * n));
    a->d = malloc((size_t)(tokens * (n / QK)) * sizeof(float));
    a->sum = malloc((size_t)(tokens * (n / QK)) * sizeof(int32_t));
    return a->q && a->d && a->sum ? 0 : -1;
}

/* x [tokens, n] quantized into buffers allocated here; -1 where memory runs out. */
static int q8_quantize(const float *x, int64_t tokens, int64_t n, q8_act *a) {
    if (q8_alloc(tokens, n, a)) return -1;
    q8_quantize_blocks(x, tokens * (n / QK), a);
    return 0;
}

static void q8_free(q8_act *a) {
    free(a->q);
    free(a->d);
    free(a->sum);
}

#if INT_AVX2
/* Eight int32 partial sums of u[i] * x[i] over 32 unsigned bytes u and signed bytes x. No pair sum reaches int16's
 * limit while u <= 128 and |x| <= 127 (128 * 127 * 2 < 32767), so the AVX2 form is as exact as VNNI's. */
static inline __m256i unsigned_dot32(__m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

/* The same for signed w: |w| times x with w's sign. */
static inline __m256i int_dot32(__m256i w, __m256i x) {
    return unsigned_dot32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

static inline __m256i q8_weights(const uint8_t *b) { return _mm256_loadu_si256((const __m256i *)(b + 2)); }

static inline __m256i q4_nibbles(const uint8_t *p) {
    __m128i r = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r, 4), r), _mm256_set1_epi8(15));
}

/* Lane j of the result = the sum of the eight lanes of p[j]. */
static inline __m256i sum_lanes8(const __m256i p[8]) {
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* Q4_0 rows: the nibbles (0..15) go into the multiply unsigned as they are, and the 8 they are offset by comes off
 * as 8 * sum(q) of the block (kept with the quantized input), which saves re-signing every weight. Eight blocks
 * per pass share one vector of their scales, so the scaling costs a few instructions per eight blocks. */
static float dot_q4_q8(const uint8_t *row, const uint8_t *next, const int8_t *q, const float *d, const int32_t *qsum,
                       int64_t n) {
    const int64_t bb = Q4_0_BYTES, nb = n / QK;
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const uint8_t *blk = row + b * bb;
        prefetch(next, b * bb);
        prefetch(next, b * bb + 64);
        prefetch(next, b * bb + 128);
        __m256i p[8];
        uint16_t halves[8];
        for (int m = 0; m < 8; m++) {
            const uint8_t *bm = blk + m * bb;
            __m256i x = _mm256_loadu_si256((const __m256i *)(q + (b + m) * QK));
            p[m] = unsigned_dot32(q4_nibbles(bm + 2), x);
            halves[m] = (uint16_t)(bm[0] | bm[1] << 8);
        }
        __m128i h = _mm_loadu_si128((const __m128i *)halves);
        __m256i sums = _mm256_sub_epi32(sum_lanes8(p), _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(qsum + b)), 3));
        __m256 scale = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(d + b));
        acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc);
    }
    float s = 0.0f;
    for (; b < nb; b++) {
        const uint8_t *bm = row + b * bb;
        __m256i x = _mm256_loadu_si256((const __m256i *)(q + b * QK));
        __m256i pm = unsigned_dot32(q4_nibbles(bm + 2), x);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(pm), _mm256_extracti128_si256(pm, 1));
        t = _mm_hadd_epi32(t, t);
        t = _mm_hadd_epi32(t, t);
        s += block_scale(bm) * d[b] * (float)(_mm_cvtsi128_si32(t) - 8 * qsum[b]);
    }
    return hsum256(acc) + s;
}

/* A Q8_0 row against the quantized input. */
static float dot_q8_q8(const uint8_t *row, const uint8_t *next, const int8_t *q, const float *d, int64_t n) {
    const int64_t bb = Q8_0_BYTES, nb = n / QK;
    int64_t b = 0;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    /* Two blocks per pass: two independent sums keep the multiply-add latency hidden. */
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *b0 = row + b * bb, *b1 = b0 + bb;
        prefetch(next, b * bb);
        __m256i p0 = int_dot32(q8_weights(b0), _mm256_loadu_si256((const __m256i *)(q + b * QK)));
        __m256i p1 = int_dot32(q8_weights(b1), _mm256_loadu_si256((const __m256i *)(q + b * QK + QK)));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(block_scale(b0) * d[b]), _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(block_scale(b1) * d[b + 1]), _mm256_cvtepi32_ps(p1), acc1);
    }
    if (b < nb) {
        const uint8_t *b0 = row + b * bb;
        __m256i p0 = int_dot32(q8_weights(b0), _mm256_loadu_si256((const __m256i *)(q + b * QK)));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(block_scale(b0) * d[b]), _mm256_cvtepi32_ps(p0), acc0);
    }
    return hsum256(_mm256_add_ps(acc0, acc1));
}

static float dot_q8(int type, const uint8_t *row, const uint8_t *next, const int8_t *q, const float *d,
                    const int32_t *qsum, int64_t n) {
    if (type == Q4_0) return dot_q4_q8(row, next, q, d, qsum, n);
    return dot_q8_q8(row, next, q, d, n);
}


/* One Q4_0 row against `count` tokens (a constant where inlined: the sums stay in registers) from t0 of a quantized
 * prompt: each group of eight blocks is unpacked, and its scales converted, once for all of them. */
#define Q4_TILE 4
static inline __attribute__((always_inline)) void q4_tile(const uint8_t *row, const q8_act *a, int64_t t0, int count,
                                                         int64_t n, float *out, int64_t out_stride) {
    const int64_t bb = Q4_0_BYTES, nb = n / QK, whole = nb / 8 * 8;
    __m256 acc[Q4_TILE];
    for (int t = 0; t < count; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < whole; b += 8) {
        const uint8_t *blk = row + b * bb;
        __m256i nibbles[8];
        uint16_t halves[8];
        for (int m = 0; m < 8; m++) {
            nibbles[m] = q4_nibbles(blk + m * bb + 2);
            halves[m] = (uint16_t)(blk[m * bb] | blk[m * bb + 1] << 8);
        }
        __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)halves));
        for (int t = 0; t < count; t++) {
            const int8_t *q = a->q + (t0 + t) * n + b * QK;
            int64_t at = (t0 + t) * nb + b;
            __m256i p[8];
            for (int m = 0; m < 8; m++) p[m] = unsigned_dot32(nibbles[m], _mm256_loadu_si256((const __m256i *)(q + m * QK)));
            __m256i sums = _mm256_sub_epi32(sum_lanes8(p), _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(a->sum + at)), 3));
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_loadu_ps(a->d + at)), _mm256_cvtepi32_ps(sums), acc[t]);
        }
    }
    for (int t = 0; t < count; t++) {
        int64_t at = (t0 + t) * nb + whole;
        float tail = whole < nb ? dot_q4_q8(row + whole * bb, NULL, a->q + (t0 + t) * n + whole * QK, a->d + at,
                                            a->sum + at, n - whole * QK)
                                : 0.0f;
        out[t * out_stride] = hsum256(acc[t]) + tail;
    }
}

/* One Q4_0 row against tokens t0..t0+count-1 of a quantized prompt, in tiles of Q4_TILE, then 2 and 1; out[t *
 * out_stride] gets token t0 + t. */
static void q4_row_tokens(const uint8_t *row, const q8_act *a, int64_t t0, int64_t count, int64_t n, float *out,
                          int64_t out_stride) {
    int64_t t = 0;
    for (; t + Q4_TILE <= count; t += Q4_TILE) q4_tile(row, a, t0 + t, Q4_TILE, n, out + t * out_stride, out_stride);
    for (; t + 2 <= count; t += 2) q4_tile(row, a, t0 + t, 2, n, out + t * out_stride, out_stride);
    for (; t < count; t++) q4_tile(row, a, t0 + t, 1, n, out + t * out_stride, out_stride);
}
#else
/* The scalar reference of the SIMD kernels above: the same integer block sums, the same float scaling. */
static float dot_q8(int type, const uint8_t *row, const uint8_t *next, const int8_t *q, const float *d,
                    const int32_t *qsum, int64_t n) {
    (void)qsum;
    int64_t bb = block_bytes(type);
    float s = 0.0f;
    for (int64_t b = 0; b < n / QK; b++) {
        const uint8_t *blk = row + b * bb;
        const int8_t *qb = q + b * QK;
        prefetch(next, b * bb);
        int32_t sum = 0;
        for (int i = 0; i < QK / 2; i++) {
            if (type == Q4_0) {
                sum += ((blk[2 + i] & 15) - 8) * qb[i] + ((blk[2 + i] >> 4) - 8) * qb[i + QK / 2];
            } else {
                sum += (int8_t)blk[2 + i] * qb[i] + (int8_t)blk[2 + QK / 2 + i] * qb[i + QK / 2];
            }
        }
        s += block_scale(blk) * d[b] * (float)sum;
    }
    return s;
}
#endif

#if INT_AVX512
/* Quantized rows sixteen at a time against a few tokens (a decode batch, one token included), with a lane per row
 * as in the blocked product but without its unpacking pass: each block of the 16 rows is loaded and transposed in
 * registers, so the rows are read straight from memory once for up to QX_TOKENS tokens and nothing is written
 * back. One 16-byte load per row and stretch of 16 weight bytes; four two-source permutes per pair of groups put
 * bytes 4g..4g+3 of every row in one vector (lane r = row r). A Q4_0 stretch's low nibbles are weights 4g..4g+3
 * and its high nibbles 16+4g..16+4g+3; Q8_0 has two stretches, weights 4g..4g+3 and 16+4g..16+4g+3. A block's 16
 * products then take 8 VNNI steps against each token's broadcast input, and one scaling, with no horizontal sums.
 * Against the row-at-a-time kernels, on 11008 x 4096 and 4096 x 11008 Q4_0 read from memory (matrices well past
 * the last-level cache), two Zen 5 threads: 1 token 0.99-1.09x, 2 tokens 1.4-1.9x, 4 tokens 2.0-2.6x, 16 tokens
 * 2.6-2.8x. A whole matrix's products of QG_MIN_TOKENS tokens and more go to the blocked product (q_gemm) instead,
 * which is quicker from about 24 tokens (from 10 in the tile unit: qg_takes); a selection's rows, which it cannot
 * take, come here up to QX_MAX_TOKENS - 1 tokens. Q8_0 rows come here from one token too (see qx_takes). */
#define QX_ROWS 16
#define QX_TOKENS 16
#define QX_MAX_TOKENS 48

/* v[g] lane r = bytes 4g..4g+3 of the 16 bytes at rows[r] + off. */
static inline __attribute__((always_inline)) void qx_transpose(const uint8_t *const rows[QX_ROWS], int64_t off,
                                                              __m512i v[4]) {
    __m512i z[4];
    for (int k = 0; k < 4; k++) {
        __m512i w = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rows[4 * k] + off)));
        w = _mm512_inserti32x4(w, _mm_loadu_si128((const __m128i *)(rows[4 * k + 1] + off)), 1);
        w = _mm512_inserti32x4(w, _mm_loadu_si128((const __m128i *)(rows[4 * k + 2] + off)), 2);
        z[k] = _mm512_inserti32x4(w, _mm_loadu_si128((const __m128i *)(rows[4 * k + 3] + off)), 3);
    }
    /* z[k]'s dword 4j + g is row 4k + j's group g: first rows 0-7 and 8-15 of groups 0 and 1 (a), 2 and 3 (c),
     * then each group's 16 rows in order. */
    const __m512i even = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i odd = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    __m512i a0 = _mm512_permutex2var_epi32(z[0], even, z[1]), a1 = _mm512_permutex2var_epi32(z[2], even, z[3]);
    __m512i c0 = _mm512_permutex2var_epi32(z[0], odd, z[1]), c1 = _mm512_permutex2var_epi32(z[2], odd, z[3]);
    v[0] = _mm512_permutex2var_epi32(a0, first, a1);
    v[1] = _mm512_permutex2var_epi32(a0, second, a1);
    v[2] = _mm512_permutex2var_epi32(c0, first, c1);
    v[3] = _mm512_permutex2var_epi32(c0, second, c1);
}

/* Block `off` (a byte offset into each row) of the 16 rows as unsigned bytes w[g] lane r = weights 4g..4g+3 of row
 * r (the 32 in column order, g < 8) plus the offset returned: Q4_0's nibbles as they are (8), Q8_0's bytes plus
 * 128, since VNNI multiplies unsigned bytes by signed ones. */
static inline __attribute__((always_inline)) int qx_weights(int type, const uint8_t *const rows[QX_ROWS], int64_t off,
                                                           __m512i w[8]) {
    if (type == Q4_0) {
        __m512i v[4];
        qx_transpose(rows, off + 2, v);
        const __m512i low = _mm512_set1_epi8(15);
        for (int g = 0; g < 4; g++) {
            w[g] = _mm512_and_si512(v[g], low);
            w[4 + g] = _mm512_and_si512(_mm512_srli_epi16(v[g], 4), low);
        }
        return 8;
    }
    qx_transpose(rows, off + 2, w);
    qx_transpose(rows, off + 2 + QK / 2, w + 4);
    for (int g = 0; g < 8; g++) w[g] = _mm512_xor_si512(w[g], _mm512_set1_epi8((char)0x80));
    return 128;
}

/* qx_weights, and the block's 16 scales (sidx: each row's offset from rows[0]). */
static inline __attribute__((always_inline)) int qx_block(int type, const uint8_t *const rows[QX_ROWS], __m512i sidx,
                                                         int64_t off, __m512i w[8], __m512 *scale) {
    /* Each row's first four bytes, of which the low two are its scale. */
    *scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(sidx, rows[0] + off, 1)));
    return qx_weights(type, rows, off, w);
}

/* acc[t] lane r = row r . token t's quantized input, for `count` tokens (type and count constants where inlined).
 * The weights' offset comes off through the sums' start: -offset times the input's block sum. */
static inline __attribute__((always_inline)) void qx_tile(int type, const uint8_t *const rows[QX_ROWS], __m512i sidx,
                                                         const uint8_t *const next[QX_ROWS], const q8_act *a,
                                                         int count, int64_t n, __m512 acc[QX_TOKENS]) {
    int64_t nb = n / QK, bb = block_bytes(type);
    for (int t = 0; t < count; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i w[8];
        __m512 scale;
        int offset = qx_block(type, rows, sidx, b * bb, w, &scale);
        /* Sixteen row streams are more than the hardware prefetcher follows, and a row of a few kilobytes ends
         * before a prefetch a fixed distance ahead pays: the same bytes of the next 16 rows (`next`) are read
         * ahead instead, the two lines under every fourth Q4_0 block's 72 bytes or every second Q8_0 block's 68
         * (Q4_0, one token: 49-51 GB/s, against 23-25 without, and 37-40 reading each row 1 KiB ahead). */
        if (b % (type == Q4_0 ? 4 : 2) == 0)
            for (int r = 0; r < QX_ROWS; r++) {
                __builtin_prefetch(next[r] + b * bb);
                __builtin_prefetch(next[r] + b * bb + 64);
            }
        for (int t = 0; t < count; t++) {
            int32_t x[QK / 4];
            memcpy(x, a->q + t * n + b * QK, QK);
            __m512i p = _mm512_set1_epi32(-offset * a->sum[t * nb + b]);
            for (int g = 0; g < 8; g++) p = _mm512_dpbusd_epi32(p, w[g], _mm512_set1_epi32(x[g]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(scale, _mm512_set1_ps(a->d[t * nb + b])), acc[t]);
        }
    }
}

/* One tile of `count` tokens, the type and count made constants for qx_tile. */
static void qx_tile_of(int type, const uint8_t *const rows[QX_ROWS], __m512i sidx, const uint8_t *const next[QX_ROWS],
                       const q8_act *a, int count, int64_t n, __m512 acc[QX_TOKENS]) {
#define QX_COUNTS(t)                                                                                                   \
    if (count == 16) qx_tile(t, rows, sidx, next, a, 16, n, acc);                                                      \
    else if (count == 8) qx_tile(t, rows, sidx, next, a, 8, n, acc);                                                   \
    else if (count == 4) qx_tile(t, rows, sidx, next, a, 4, n, acc);                                                   \
    else if (count == 2) qx_tile(t, rows, sidx, next, a, 2, n, acc);                                                   \
    else qx_tile(t, rows, sidx, next, a, 1, n, acc);
    if (type == Q4_0) {
        QX_COUNTS(Q4_0)
    } else {
        QX_COUNTS(Q8_0)
    }
#undef QX_COUNTS
}

/* rows[r] (r < count, at most 16; the array holds 16, the last row repeated past count) against `tokens` quantized
 * inputs a (token t at a->q + t * n): out[t * out_stride + r], tokens in tiles of 16, 8, 4, 2 and 1, while the
 * rows next[r] are read ahead. The rows lie within INT32_MAX bytes of rows[0] (qx_takes). */
static void qx_rows_at(int type, const uint8_t *const rows[QX_ROWS], const uint8_t *const next[QX_ROWS], int64_t count,
                       const q8_act *a, int64_t tokens, int64_t n, float *out, int64_t out_stride) {
    int32_t offsets[QX_ROWS];
    for (int r = 0; r < QX_ROWS; r++) offsets[r] = (int32_t)(rows[r] - rows[0]);
    __m512i sidx = _mm512_loadu_si512(offsets);
    __mmask16 keep = (__mmask16)((1u << count) - 1);
    int64_t nb = n / QK;
    for (int64_t t0 = 0; t0 < tokens;) {
        q8_act at = {a->q + t0 * n, a->d + t0 * nb, a->sum + t0 * nb};
        int64_t left = tokens - t0;
        int tile = left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        __m512 acc[QX_TOKENS];
        qx_tile_of(type, rows, sidx, next, &at, tile, n, acc);
        for (int t = 0; t < tile; t++) _mm512_mask_storeu_ps(out + (t0 + t) * out_stride, keep, acc[t]);
        t0 += tile;
    }
}

/* The same for the rows row0 + r * stride, r < rows (at most 16), reading the 16 rows after them ahead. */
static void qx_rows(int type, const uint8_t *row0, int64_t stride, int64_t rows, const q8_act *a, int64_t tokens,
                    int64_t n, float *out, int64_t out_stride) {
    const uint8_t *rs[QX_ROWS], *next[QX_ROWS];
    for (int r = 0; r < QX_ROWS; r++) {
        rs[r] = row0 + (r < rows ? r : rows - 1) * stride;
        next[r] = rs[r] + QX_ROWS * stride;
    }
    qx_rows_at(type, rs, next, rows, a, tokens, n, out, out_stride);
}

/* Whether qx_rows takes rows of this type for this many tokens, where the rows of a tile lie up to `span` bytes
 * apart: the gather's offsets are 32-bit. One token too: a 32000 x 4096 Q8_0 head (a Q4_0 file's, as quantize
 * writes it) from memory took 0.51-0.65 of the row kernel's time on two Sapphire Rapids threads. */
static int qx_takes(int type, int64_t span, int64_t tokens) {
    return (type == Q4_0 || type == Q8_0) && tokens >= 1 && tokens < QX_MAX_TOKENS && span <= INT32_MAX;
}
#endif

/* Row . token t's input: F16 rows take the float input, quantized rows its Q8_0 blocks. */
static float dot_row(int type, const uint8_t *row, const uint8_t *next, const float *x, const q8_act *xq, int64_t t,
                     int64_t n) {
    if (type == F16) return dot_f16((const uint16_t *)row, next, x + t * n, n);
    return dot_q8(type, row, next, xq->q + t * n, xq->d + t * (n / QK), xq->sum + t * (n / QK), n);
}


/* out[t * out_stride] = row . token t's input, for every token: the row is read once, and unpacked once per tile
 * of tokens where a kernel for its type does that. */
static void row_tokens(int type, const uint8_t *row, const uint8_t *next, const float *x, const q8_act *xq,
                       int64_t tokens, int64_t n, float *out, int64_t out_stride) {
    if (tokens == 1) {
        *out = dot_row(type, row, next, x, xq, 0, n);
        return;
    }
#if LANES > 1
    if (type == F16) {
        /* Tiles of 8, then 4, 2 and 1: constant sizes, so each tile's sums stay in registers. */
        int64_t t0 = 0;
        for (int tile = F16_TILE; tile >= 1; tile /= 2) {
            for (; t0 + tile <= tokens; t0 += tile) {
                float *o = out + t0 * out_stride;
                const uint16_t *w = (const uint16_t *)row;
                if (tile == 8) f16_tile(w, x, t0, 8, n, o, out_stride);
                else if (tile == 4) f16_tile(w, x, t0, 4, n, o, out_stride);
                else if (tile == 2) f16_tile(w, x, t0, 2, n, o, out_stride);
                else *o = dot_f16(w, next, x + t0 * n, n);
            }
        }
        return;
    }
#endif
#if INT_AVX2
    if (type == Q4_0) {
        for (int64_t t0 = 0; t0 < tokens; t0 += TOKEN_BLOCK)
            q4_row_tokens(row, xq, t0, tokens - t0 < TOKEN_BLOCK ? tokens - t0 : TOKEN_BLOCK, n, out + t0 * out_stride,
                          out_stride);
        return;
    }
#endif
    for (int64_t t = 0; t < tokens; t++) out[t * out_stride] = dot_row(type, row, next, x, xq, t, n);
}

#if LANES > 1
/* Two F16 rows against tokens t0..t0+count-1 (count <= 4): each input vector loaded serves both rows, which
 * halves the input traffic that bounds a prompt's products once the inputs outgrow the first-level cache. */
static inline __attribute__((always_inline)) void f16_tile2(const uint16_t *w0, const uint16_t *w1, const float *x,
                                                           int64_t t0, int count, int64_t n, float *out,
                                                           int64_t out_stride) {
    vec a0[4], a1[4];
    for (int t = 0; t < count; t++) a0[t] = a1[t] = vzero();
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vec v0 = vload_half(w0 + i), v1 = vload_half(w1 + i);
        for (int t = 0; t < count; t++) {
            vec xv = vload(x + (t0 + t) * n + i);
            a0[t] = vfma(v0, xv, a0[t]);
            a1[t] = vfma(v1, xv, a1[t]);
        }
    }
    for (int t = 0; t < count; t++) {
        float s0 = vsum(a0[t]), s1 = vsum(a1[t]);
        for (int64_t c = i; c < n; c++) {
            s0 += half_to_float(w0[c]) * x[(t0 + t) * n + c];
            s1 += half_to_float(w1[c]) * x[(t0 + t) * n + c];
        }
        out[t * out_stride] = s0;
        out[t * out_stride + 1] = s1;
    }
}
#endif

/* row_tokens for two rows at once, whose products land side by side: out[t * out_stride] and the next float. */
static void rows2_tokens(int type, const uint8_t *row0, const uint8_t *row1, const float *x, const q8_act *xq,
                         int64_t tokens, int64_t n, float *out, int64_t out_stride) {
#if LANES > 1
    if (type == F16) {
        const uint16_t *w0 = (const uint16_t *)row0, *w1 = (const uint16_t *)row1;
        int64_t t0 = 0;
        for (; t0 + 4 <= tokens; t0 += 4) f16_tile2(w0, w1, x, t0, 4, n, out + t0 * out_stride, out_stride);
        for (; t0 + 2 <= tokens; t0 += 2) f16_tile2(w0, w1, x, t0, 2, n, out + t0 * out_stride, out_stride);
        for (; t0 < tokens; t0++) f16_tile2(w0, w1, x, t0, 1, n, out + t0 * out_stride, out_stride);
        return;
    }
#endif
    row_tokens(type, row0, row1, x, xq, tokens, n, out, out_stride);
    row_tokens(type, row1, row1, x, xq, tokens, n, out + 1, out_stride);
}

/* out[0:w] += sum over 4 rows of a[m] * row_m[c0:c0+w] (four rows per pass read and write out a quarter as often).
 * For quantized rows c0 and w are multiples of 32. */
static void add_rows4(int type, float *out, const uint8_t *const r[4], const float a[4], int64_t c0, int64_t w) {
    int64_t c = 0;
    if (type == F16) {
        const uint16_t *h[4];
        for (int m = 0; m < 4; m++) h[m] = (const uint16_t *)r[m] + c0;
#if LANES > 1
        vec b0 = vset(a[0]), b1 = vset(a[1]), b2 = vset(a[2]), b3 = vset(a[3]);
        for (; c + LANES <= w; c += LANES) {
            vec s = vload(out + c);
            s = vfma(vload_half(h[0] + c), b0, s);
            s = vfma(vload_half(h[1] + c), b1, s);
            s = vfma(vload_half(h[2] + c), b2, s);
            s = vfma(vload_half(h[3] + c), b3, s);
            vstore(out + c, s);
        }
#endif
        for (; c < w; c++)
            out[c] += a[0] * half_to_float(h[0][c]) + a[1] * half_to_float(h[1][c]) + a[2] * half_to_float(h[2][c]) +
                      a[3] * half_to_float(h[3][c]);
        return;
    }
    int64_t bb = block_bytes(type);
#if LANES == 16
    if (type == Q4_0) {
        /* Four blocks at a time: a block's sums chain four multiply-adds (one per row), and one chain alone leaves
         * the unit idle (14336 rows of 4096 from memory, two Zen 5 threads: 28.7 against 24.4 GB/s). */
        for (; c + 4 * QK <= w; c += 4 * QK) {
            vec lo[4], hi[4];
            for (int u = 0; u < 4; u++) {
                lo[u] = vload(out + c + u * QK);
                hi[u] = vload(out + c + u * QK + QK / 2);
            }
            for (int m = 0; m < 4; m++) {
                const uint8_t *base = r[m] + (c0 + c) / QK * bb;
                for (int u = 0; u < 4; u++) {
                    vec l, h, scale = vset(a[m] * block_scale(base + u * bb));
                    vload_q4(base + u * bb + 2, &l, &h);
                    lo[u] = vfma(l, scale, lo[u]);
                    hi[u] = vfma(h, scale, hi[u]);
                }
            }
            for (int u = 0; u < 4; u++) {
                vstore(out + c + u * QK, lo[u]);
                vstore(out + c + u * QK + QK / 2, hi[u]);
            }
        }
    }
#endif
    for (; c < w; c += QK) {
        const uint8_t *b[4];
        float s[4];
        for (int m = 0; m < 4; m++) {
            b[m] = r[m] + (c0 + c) / QK * bb;
            s[m] = a[m] * block_scale(b[m]);
        }
#if LANES > 1
        if (type == Q4_0) {
            for (int h = 0; h < QK / 2; h += LANES) {
                vec o_lo = vload(out + c + h), o_hi = vload(out + c + QK / 2 + h), lo, hi;
                for (int m = 0; m < 4; m++) {
                    vload_q4(b[m] + 2 + h, &lo, &hi);
                    o_lo = vfma(lo, vset(s[m]), o_lo);
                    o_hi = vfma(hi, vset(s[m]), o_hi);
                }
                vstore(out + c + h, o_lo);
                vstore(out + c + QK / 2 + h, o_hi);
            }
        } else {
            for (int h = 0; h < QK; h += LANES) {
                vec o = vload(out + c + h);
                for (int m = 0; m < 4; m++) o = vfma(vload_i8((const int8_t *)b[m] + 2 + h), vset(s[m]), o);
                vstore(out + c + h, o);
            }
        }
#else
        for (int m = 0; m < 4; m++) {
            for (int i = 0; i < QK / 2; i++) {
                if (type == Q4_0) {
                    out[c + i] += s[m] * (float)((b[m][2 + i] & 15) - 8);
                    out[c + QK / 2 + i] += s[m] * (float)((b[m][2 + i] >> 4) - 8);
                } else {
                    out[c + i] += s[m] * (float)(int8_t)b[m][2 + i];
                    out[c + QK / 2 + i] += s[m] * (float)(int8_t)b[m][2 + QK / 2 + i];
                }
            }
        }
#endif
    }
}

#define ROWS_AHEAD 8
#define F16_AHEAD 256

/* Whether any of `tokens` tokens gives row j a non-zero weight in act [tokens, k]. */
static int row_used(const float *act, int64_t k, int64_t tokens, int64_t j) {
    for (int64_t t = 0; t < tokens; t++)
        if (act[t * k + j] != 0.0f) return 1;
    return 0;
}

/* The down product inside a parallel region: each thread owns a slice of the output columns (whole blocks), so
 * the sums need no locks; rows go four at a time, and each group serves every token while it is in cache. */
static void add_weighted_rows(const uint8_t *down, int64_t down_stride, int down_type, const int64_t *ids, int64_t k,
                              const float *act, int64_t tokens, int64_t n, float *out) {
    int th = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t per = ((n + nt - 1) / nt + QK - 1) / QK * QK;
    int64_t c0 = th * per < n ? th * per : n, c1 = c0 + per < n ? c0 + per : n;
    if (c0 >= c1) return;
    for (int64_t t = 0; t < tokens; t++) memset(out + t * n + c0, 0, (size_t)(c1 - c0) * sizeof(float));
    int64_t group[4], slice = down_type == F16 ? F16_AHEAD : (c1 - c0 + QK - 1) / QK * block_bytes(down_type);
    int64_t from = down_type == F16 ? 2 * c0 : c0 / QK * block_bytes(down_type); /* the slice's first byte in a row */
    /* A thread's slice of a row is a few lines, too short for the hardware prefetcher to follow: the slices of the
     * used rows, from the one being grouped to ROWS_AHEAD - 1 after it, are read ahead whole (ahead: the next row to
     * look at, queued: the used rows read ahead and not yet grouped). Q4_0, 14336 rows of 4096 from memory, two Zen
     * 5 threads, with the table lookup and four blocks at a time: 28.7 GB/s; with neither, 24.2 against 12.1 with the
     * first four lines of each row read ahead as it is grouped. An F16 slice, four times the bytes, is streamed by
     * the hardware once started: only its first F16_AHEAD bytes are (whole slices made the 7b-slice's sparse F16
     * decode 2-3% slower). */
    int64_t ahead = 0, queued = 0;
    int m = 0;
    for (int64_t j = 0; j <= k; j++) {
        if (j < k) {
            if (!row_used(act, k, tokens, j)) continue;
            group[m++] = j;
            for (; ahead < k && (ahead <= j || queued < ROWS_AHEAD); ahead++) {
                if (!row_used(act, k, tokens, ahead)) continue;
                const uint8_t *start = down + (ids ? ids[ahead] : ahead) * down_stride + from;
                /* From the line the slice begins in to the one it ends in. */
                int64_t skew = (int64_t)((uintptr_t)start & 63);
                for (int64_t line = -skew; line < slice; line += 64) __builtin_prefetch(start + line);
                queued++;
            }
            queued--;
            if (m < 4) continue;
        } else if (m == 0) {
            break;
        }
        const uint8_t *rows[4];
        for (int i = 0; i < 4; i++) {
            int64_t j4 = group[i < m ? i : 0];
            rows[i] = down + (ids ? ids[j4] : j4) * down_stride;
        }
        for (int64_t t = 0; t < tokens; t++) {
            float a[4];
            int any = 0;
            for (int i = 0; i < 4; i++) {
                a[i] = i < m ? act[t * k + group[i]] : 0.0f;
                any |= a[i] != 0.0f;
            }
            if (any) add_rows4(down_type, out + t * n + c0, rows, a, c0, c1 - c0);
        }
        m = 0;
    }
}

/* For `tokens` inputs x [tokens, n]: act[t, j] for each selected neuron (0 where mask [tokens, k], if given, leaves
 * neuron j out for token t), then out[t] = sum_j act[t, j] * down_t[ids[j]]. act is caller scratch [tokens, k],
 * which with `first_given` holds the first row's product (the gate's, or up's without a gate) for every token and
 * neuron already. Each picked row is read from memory once for all the tokens. */
static int sparse_ffn(const uint8_t *gate, int64_t gate_stride, int gate_type, const int64_t gate_shape[2],
                      const uint8_t *up, int64_t up_stride, int up_type, const int64_t up_shape[2], const uint8_t *down,
                      int64_t down_stride, int down_type, const int64_t down_shape[2], const float *x, int64_t n,
                      int64_t tokens, const int64_t *ids, int64_t k, const uint8_t *mask, int first_given, int form,
                      float *act, float *out, int threads) {
    if ((form != FORM_UP && !fits(gate_type, gate_stride, gate_shape[0], gate_shape[1], n, ids, k)) ||
        !fits(up_type, up_stride, up_shape[0], up_shape[1], n, ids, k) ||
        !fits(down_type, down_stride, down_shape[0], down_shape[1], n, ids, k))
        return -1;
    const uint8_t *first = form != FORM_UP ? gate : up;
    int64_t first_stride = form != FORM_UP ? gate_stride : up_stride;
    int first_type = form != FORM_UP ? gate_type : up_type;
    /* The input goes to Q8_0 for the quantized rows this call sums: up's of a gated form, and the first rows
     * where the caller did not give their products. */
    q8_act xq = {0};
    int quantized = (form != FORM_UP && up_type != F16) || (!first_given && first_type != F16);
    if (quantized && q8_quantize(x, tokens, n, &xq)) {
        q8_free(&xq);
        return -2;
    }
    /* Without a mask every token needs the first row's product: the caller gave them all in act, or rows go in
     * pairs, one pass over a pair serving all the tokens, and the products wait in act for each token's turn. */
    int shared = !mask && tokens > 1 && !first_given, given = shared || first_given;
#pragma omp parallel num_threads(threads)
    {
        if (shared) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < (k + 1) / 2; p++) {
                int64_t j = 2 * p;
                const uint8_t *r0 = first + ids[j] * first_stride;
                if (j + 1 < k)
                    rows2_tokens(first_type, r0, first + ids[j + 1] * first_stride, x, &xq, tokens, n, act + j, k);
                else
                    row_tokens(first_type, r0, r0, x, &xq, tokens, n, act + j, k);
            }
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < k; j++) {
            int64_t next = ids[j + 1 < k ? j + 1 : j];
            const uint8_t *row = first + ids[j] * first_stride, *next_row = first + next * first_stride;
            const uint8_t *up_row = up + ids[j] * up_stride;
            /* While the gate's row is summed, its up row is read ahead (a neuron picked to fire mostly does), and
             * while the up row is summed, the next neuron's gate row, or where act holds the gates' products, its
             * up row. */
            const uint8_t *ahead = form != FORM_UP ? up_row : next_row;
            const uint8_t *after_up = given ? up + next * up_stride : next_row;
            for (int64_t t = 0; t < tokens; t++) {
                float *a = act + t * k + j;
                if (mask && !mask[t * k + j]) {
                    *a = 0.0f;
                    continue;
                }
                float f = given ? *a : dot_row(first_type, row, ahead, x, &xq, t, n);
                *a = 0.0f;
                if (form == FORM_UP) {
                    *a = f > 0.0f ? f : 0.0f;
                    continue;
                }
                /* A neuron whose gate does not fire contributes nothing: its up and down rows are not read. */
                float g = gate_act(form, f);
                if (g == 0.0f) continue;
                float u = dot_row(up_type, up_row, after_up, x, &xq, t, n);
                *a = g * up_factor(form, u);
            }
        }
        add_weighted_rows(down, down_stride, down_type, ids, k, act, tokens, n, out);
    }
    q8_free(&xq);
    return 0;
}

int qinfer_sparse_ffn(const uint8_t *gate, int64_t gate_stride, int gate_type, const int64_t gate_shape[2],
                      const uint8_t *up, int64_t up_stride, int up_type, const int64_t up_shape[2], const uint8_t *down,
                      int64_t down_stride, int down_type, const int64_t down_shape[2], const float *x, int64_t n,
                      int64_t tokens, const int64_t *ids, int64_t k, const uint8_t *mask, int form, float *act,
                      float *out, int threads) {
    return sparse_ffn(gate, gate_stride, gate_type, gate_shape, up, up_stride, up_type, up_shape, down, down_stride,
                      down_type, down_shape, x, n, tokens, ids, k, mask, 0, form, act, out, threads);
}

/* qinfer_sparse_ffn whose act [tokens, k] comes holding the first row's product for every token and neuron (a
 * prompt's, from the blocked product), and without a mask. */
int qinfer_sparse_ffn_given(const uint8_t *gate, int64_t gate_stride, int gate_type, const int64_t gate_shape[2],
                            const uint8_t *up, int64_t up_stride, int up_type, const int64_t up_shape[2],
                            const uint8_t *down, int64_t down_stride, int down_type, const int64_t down_shape[2],
                            const float *x, int64_t n, int64_t tokens, const int64_t *ids, int64_t k, int form,
                            float *act, float *out, int threads) {
    return sparse_ffn(gate, gate_stride, gate_type, gate_shape, up, up_stride, up_type, up_shape, down, down_stride,
                      down_type, down_shape, x, n, tokens, ids, k, NULL, 1, form, act, out, threads);
}

/* qinfer_sparse_ffn over the neurons some token selects (selected [tokens, f], a byte each) and `skip` [f] (NULL:
 * none) leaves out, each token summing only its own: what a GPU/CPU split's host computes of a layer, found here
 * rather than by the caller's passes over the masks. counts: the neurons computed, and the selected ones skipped. */
int qinfer_selected_ffn(const uint8_t *gate, int64_t gate_stride, int gate_type, const int64_t gate_shape[2],
                        const uint8_t *up, int64_t up_stride, int up_type, const int64_t up_shape[2],
                        const uint8_t *down, int64_t down_stride, int down_type, const int64_t down_shape[2],
                        const float *x, int64_t n, int64_t tokens, const uint8_t *selected, const uint8_t *skip,
                        int64_t f, int form, float *out, int64_t counts[2], int threads) {
    if (f < 1 || tokens < 1) return -1;
    int64_t *ids = malloc((size_t)f * sizeof *ids);
    if (!ids) return -2;
    int64_t k = 0, skipped = 0;
    for (int64_t i = 0; i < f; i++) {
        int any = 0;
        for (int64_t t = 0; t < tokens; t++) any |= selected[t * f + i];
        if (!any) continue;
        if (skip && skip[i])
            skipped++;
        else
            ids[k++] = i;
    }
    /* Scratch for the listed neurons alone (at least one, so that no allocation is of zero bytes). */
    int64_t room = k > 0 ? k : 1;
    uint8_t *mask = tokens > 1 ? malloc((size_t)(tokens * room)) : NULL;
    float *act = malloc((size_t)(tokens * room) * sizeof *act);
    int status = -2;
    if (act && (tokens == 1 || mask)) {
        /* One token: every neuron listed is its own. */
        for (int64_t t = 0; mask && t < tokens; t++)
            for (int64_t j = 0; j < k; j++) mask[t * k + j] = selected[t * f + ids[j]] != 0;
        counts[0] = k;
        counts[1] = skipped;
        status = sparse_ffn(gate, gate_stride, gate_type, gate_shape, up, up_stride, up_type, up_shape, down,
                            down_stride, down_type, down_shape, x, n, tokens, ids, k, mask, 0, form, act, out, threads);
    }
    free(ids);
    free(mask);
    free(act);
    return status;
}

/* An expert's rows go EXPERT_TILE at a time: sixteen rows in one pass (qx_rows), where the build has it. */
#define EXPERT_TILE 16

/* out[r] = row r . token t's input, for rows r < count (at most EXPERT_TILE) from row0, `stride` bytes apart. The
 * row kernel reads, where `ahead`, each row's successor ahead while it is summed (rows that do not follow one another
 * in the order they are read, which the hardware prefetcher does not stream); qx_rows reads the next 16 rows ahead
 * whatever `ahead` says, as it does for every matrix. */
static void tile_rows(int type, const uint8_t *row0, int64_t stride, int64_t count, int ahead, const float *x,
                      const q8_act *xq, int64_t t, int64_t n, float *out) {
#if INT_AVX512
    if (qx_takes(type, (QX_ROWS - 1) * stride, 1)) {
        q8_act token = {xq->q + t * n, xq->d + t * (n / QK), xq->sum + t * (n / QK)};
        qx_rows(type, row0, stride, count, &token, 1, n, out, 0);
        return;
    }
#endif
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *row = row0 + r * stride;
        out[r] = dot_row(type, row, ahead && r + 1 < count ? row + stride : NULL, x, xq, t, n);
    }
}

/* A layer's experts: gate and up stacks [experts, f, n], down [experts, n, f], each a base pointer, a type, and
 * strides in bytes between experts and between rows. */
typedef struct {
    const uint8_t *gate, *up, *down;
    int64_t gate_expert, gate_row, up_expert, up_row, down_expert, down_row;
    int32_t gate_type, up_type, down_type;
    int64_t experts, f, n;
} stacks;

/* Whether every expert's rows fit, as fits() checks a matrix's, and each expert's stride spans a whole expert. */
static int stacks_fit(const stacks *m) {
    int64_t f = m->f, n = m->n;
    return m->gate && m->up && m->down && m->experts > 0 && fits(m->gate_type, m->gate_row, f, n, n, NULL, f) &&
           fits(m->up_type, m->up_row, f, n, n, NULL, f) && fits(m->down_type, m->down_row, n, f, f, NULL, n) &&
           m->gate_expert >= f * m->gate_row && m->up_expert >= f * m->up_row && m->down_expert >= n * m->down_row;
}

/* act[p] [f] = silu(gate x) * up x over expert chosen[p]'s rows, x being token p / k's input, for each (token,
 * expert) pair p < pairs; inside a parallel region, every row of a pair's expert read once for it. The gate's rows
 * go first and then up's, each a run of consecutive rows that the hardware prefetcher streams: with each up row
 * read ahead beside its gate row instead (two streams, a prefetch per line), Mixtral's two Q4_0 experts of a token
 * ran at 40 GB/s, against 42 so and 46 for a plain Q4_0 product (two Zen 4 cores). */
static void expert_act(const stacks *m, const float *x, const q8_act *xq, const int64_t *chosen, int64_t pairs,
                       int64_t k, float *act) {
    int64_t f = m->f, n = m->n, tiles = (f + EXPERT_TILE - 1) / EXPERT_TILE;
    /* Both loops give each thread the same rows (a static schedule of equal trips): no barrier between them. */
#pragma omp for schedule(static) nowait
    for (int64_t pt = 0; pt < pairs * tiles; pt++) {
        int64_t p = pt / tiles, r0 = pt % tiles * EXPERT_TILE, count = f - r0 < EXPERT_TILE ? f - r0 : EXPERT_TILE;
        float *a = act + p * f + r0;
        tile_rows(m->gate_type, m->gate + chosen[p] * m->gate_expert + r0 * m->gate_row, m->gate_row, count, 0, x, xq,
                  p / k, n, a);
        for (int64_t r = 0; r < count; r++) a[r] = gate_act(FORM_GATED_SILU, a[r]);
    }
#pragma omp for schedule(static)
    for (int64_t pt = 0; pt < pairs * tiles; pt++) {
        int64_t p = pt / tiles, r0 = pt % tiles * EXPERT_TILE, count = f - r0 < EXPERT_TILE ? f - r0 : EXPERT_TILE;
        float u[EXPERT_TILE];
        tile_rows(m->up_type, m->up + chosen[p] * m->up_expert + r0 * m->up_row, m->up_row, count, 0, x, xq, p / k, n,
                  u);
        for (int64_t r = 0; r < count; r++) act[p * f + r0 + r] *= u[r];
    }
}

/* out[t] [n] = sum over i < k of weights[t, i] * expert chosen[t, i]'s down product of act[t * k + i] (aq: act
 * quantized, for quantized rows); inside a parallel region, each thread owning whole output columns. */
static void expert_down(const stacks *m, const float *act, const q8_act *aq, const int64_t *chosen,
                        const float *weights, int64_t tokens, int64_t k, float *out) {
    int64_t f = m->f, n = m->n;
#pragma omp for schedule(static)
    for (int64_t c0 = 0; c0 < n; c0 += EXPERT_TILE) {
        int64_t count = n - c0 < EXPERT_TILE ? n - c0 : EXPERT_TILE;
        for (int64_t t = 0; t < tokens; t++) {
            float sum[EXPERT_TILE] = {0}, dot[EXPERT_TILE];
            for (int64_t i = 0; i < k; i++) {
                int64_t p = t * k + i;
                tile_rows(m->down_type, m->down + chosen[p] * m->down_expert + c0 * m->down_row, m->down_row, count, 1,
                          act, aq, p, f, dot);
                for (int64_t c = 0; c < count; c++) sum[c] += weights[p] * dot[c];
            }
            for (int64_t c = 0; c < count; c++) out[t * n + c0 + c] = sum[c];
        }
    }
}

/* A mixture of experts' FFN for a few tokens in one call: out[t] = sum over i < k of weights[t, i] * expert
 * chosen[t, i]'s SwiGLU of x[t], down(silu(gate x) * up x). gate and up are stacks [experts, f, n] and down
 * [experts, n, f], each a base pointer, a type, and strides in bytes (strides[0..5]: gate's expert and row, up's,
 * down's); dims = experts, f, n. act is caller scratch [tokens * k, f]. Each (token, expert) pair reads its
 * expert's rows once: for one token, every row of a chosen expert is read once, in one parallel region instead of
 * a call per matrix and expert. */
int qinfer_moe_ffn(const uint8_t *gate, int gate_type, const uint8_t *up, int up_type, const uint8_t *down,
                   int down_type, const int64_t strides[6], const int64_t dims[3], const float *x, int64_t tokens,
                   const int64_t *chosen, const float *weights, int64_t k, float *act, float *out, int threads) {
    stacks m = {gate, up, down, strides[0], strides[1], strides[2], strides[3], strides[4], strides[5],
                gate_type, up_type, down_type, dims[0], dims[1], dims[2]};
    int64_t pairs = tokens * k, f = m.f;
    if (!stacks_fit(&m)) return -1;
    for (int64_t p = 0; p < pairs; p++)
        if (chosen[p] < 0 || chosen[p] >= m.experts) return -1;
    q8_act xq = {0}, aq = {0};
    int failed = ((gate_type != F16 || up_type != F16) && q8_quantize(x, tokens, m.n, &xq));
    if (!failed && down_type != F16) {
        /* Allocated here, filled once the activations are known. */
        failed = q8_alloc(pairs, f, &aq) != 0;
    }
    if (failed) {
        q8_free(&xq);
        q8_free(&aq);
        return -2;
    }
#pragma omp parallel num_threads(threads)
    {
        expert_act(&m, x, &xq, chosen, pairs, k, act);
        if (down_type != F16) {
#pragma omp single
            q8_quantize_blocks(act, pairs * (f / QK), &aq);
        }
        expert_down(&m, act, &aq, chosen, weights, tokens, k, out);
    }
    q8_free(&xq);
    q8_free(&aq);
    return 0;
}

/* out[t] = sum_j act[t, j] * rows[ids[j]] for `tokens` rows of act [tokens, k] (ids NULL: rows 0..k-1); rows whose
 * act is 0 for every token are not read. */
int qinfer_weighted_rows(const uint8_t *w, int64_t stride, int type, const int64_t shape[2], const int64_t *ids,
                         int64_t k, const float *act, int64_t tokens, int64_t n, float *out, int threads) {
    if (!fits(type, stride, shape[0], shape[1], n, ids, k)) return -1;
#pragma omp parallel num_threads(threads)
    add_weighted_rows(w, stride, type, ids, k, act, tokens, n, out);
    return 0;
}

#if LANES > 1
/* The F16 product of many tokens (a prompt, a wide batch) as a blocked matrix product: a tile of GEMM_ROWS rows by
 * GEMM_TOKENS tokens keeps its GEMM_ROWS * GEMM_TOKENS sums in registers, so each row vector converted and each
 * input vector loaded serves several products. The rows go GEMM_BLOCK_ROWS at a time (fewer in a matrix too small
 * for every thread to take several blocks) past each token tile, whose inputs stay in the first-level cache while
 * they pass: from GEMM_PROMPT_TOKENS tokens the columns go GEMM_PROMPT_K at a time (a tile of four tokens' inputs
 * is then 32 KiB), below it GEMM_K at a time, which reads each row in fewer pieces where the rows' bytes rather
 * than the arithmetic set the pace. A tile loads its tokens' inputs first and then converts one row at a time, so
 * it holds the sums, the inputs and one row: AVX2's 4 x 3 tile fits its 16 registers so.
 *
 * Measured on Zen 5 (products of 3-136 tokens with 4096 x 4096, 11008 x 4096 and 4096 x 11008 rows, two
 * threads): AVX-512's 6 x 4 leads (5 x 5: 0.96x, 4 x 6: 0.82x, 3 x 8: 0.7x); the row blocks, the 2048 columns and
 * the tile's sums taken four at a time (vsum4) make its 136-token product 1.07-1.12x faster than tiles over every
 * token and 4096 columns, and loading the inputs first 1.01-1.04x; 1024 or 3072 columns, 96-row blocks, a packed
 * copy of the rows, or prefetching them did not beat that. AVX2's 4 x 3 runs 1.25-1.32x faster than its 3 x 3
 * (which could not load the inputs first: 3 x 4 and 2 x 6 are 1.0-1.1x), and beats rows2_tokens from 3 tokens (3:
 * 95-130 against 57-73 GFLOP/s; 4, whose second tile then repeated a token twice: even). AVX-512's 6 x 4 beats
 * rows2_tokens from 4 tokens (Zen 4). A tile at the edge of the tokens computes only its own: on an Intel Xeon (two
 * threads) built for AVX2, the 7B slice's 4-sequence decode step 1.08-1.11x (dense f16 file) and 1.17-1.22x
 * (PowerInfer f16 file) against a tile of 3 that repeated the last token twice. */
#if LANES == 16
#define GEMM_ROWS 6   /* 24 sums, 4 inputs and a row: 29 of AVX-512's 32 registers */
#define GEMM_TOKENS 4 /* vsum4's four */
#define GEMM_MIN_TOKENS 4
#else
#define GEMM_ROWS 4   /* 12 sums, 3 inputs and a row: AVX2's 16 registers */
#define GEMM_TOKENS 3
#define GEMM_MIN_TOKENS 3
#endif
#define GEMM_K 4096
#define GEMM_PROMPT_K 2048
#define GEMM_PROMPT_TOKENS 48
#define GEMM_BLOCK_ROWS 48
/* A thread takes at least this many blocks where rows allow: 1024 rows on 16 threads, in blocks of 48, would keep
 * a third of the threads idle for the last block. */
#define GEMM_BLOCKS_PER_THREAD 4

#if LANES == 16
/* The sums of four vectors, a lane each: a tree whose shuffles the four share (14 instructions, where four vsum
 * take 32). */
static inline __m128 vsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    /* Halves of a0 and a1 added in one vector, of a2 and a3 in another; then quarters, each one vector's. */
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
    q = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4E));
    q = _mm512_add_ps(q, _mm512_permute_ps(q, 0xB1));
    const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, q));
}
#endif

/* A tile of `count` tokens (at most GEMM_TOKENS, a constant where inlined): a tile at the edge of the batch computes
 * its tokens alone (AVX2's 4-token batch is a tile of 3 and one of 1). Each token's sums are the same whichever tile
 * it is in: a product's lanes do not mix tokens, and vsum4 sums each of its four vectors alone. */
static inline __attribute__((always_inline)) void f16_gemm_tile(const uint16_t *const w[GEMM_ROWS],
                                                               const float *const x[GEMM_TOKENS], int count,
                                                               int64_t k0, int64_t k1,
                                                               float sums[GEMM_ROWS][GEMM_TOKENS]) {
    vec acc[GEMM_ROWS][GEMM_TOKENS];
    /* Every token's sums, a missing one's too: vsum4 reads all four vectors. */
    for (int r = 0; r < GEMM_ROWS; r++)
        for (int t = 0; t < GEMM_TOKENS; t++) acc[r][t] = vzero();
    for (int64_t i = k0; i < k1; i += LANES) {
        vec xv[GEMM_TOKENS];
        for (int t = 0; t < count; t++) xv[t] = vload(x[t] + i);
        for (int r = 0; r < GEMM_ROWS; r++) {
            vec wv = vload_half(w[r] + i);
            for (int t = 0; t < count; t++) acc[r][t] = vfma(wv, xv[t], acc[r][t]);
        }
    }
#if LANES == 16
    for (int r = 0; r < GEMM_ROWS; r++) _mm_storeu_ps(sums[r], vsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
#else
    for (int r = 0; r < GEMM_ROWS; r++)
        for (int t = 0; t < count; t++) sums[r][t] = vsum(acc[r][t]);
#endif
}

/* f16_gemm_tile with its token count made a constant, so that each inlined copy unrolls its token loops and keeps
 * its sums in registers. */
static void f16_gemm_tile_of(const uint16_t *const w[GEMM_ROWS], const float *const x[GEMM_TOKENS], int count,
                             int64_t k0, int64_t k1, float sums[GEMM_ROWS][GEMM_TOKENS]) {
    if (count == GEMM_TOKENS) f16_gemm_tile(w, x, GEMM_TOKENS, k0, k1, sums);
#if GEMM_TOKENS > 3
    else if (count == 3) f16_gemm_tile(w, x, 3, k0, k1, sums);
#endif
    else if (count == 2) f16_gemm_tile(w, x, 2, k0, k1, sums);
    else f16_gemm_tile(w, x, 1, k0, k1, sums);
}

/* out[t * rows + r] = row r . x[t] for `tokens` tokens x [tokens, n] of F16 rows, inside a parallel region (the
 * row blocks shared among the threads). A tile at the edge of a row block repeats its last row and keeps only the
 * rest; one at the edge of the tokens computes only its own tokens. */
static void f16_gemm(const uint8_t *w, int64_t stride, int64_t rows, const float *x, int64_t n, int64_t tokens,
                     float *out) {
    int64_t share = (rows + GEMM_BLOCKS_PER_THREAD * omp_get_num_threads() - 1) /
                    (GEMM_BLOCKS_PER_THREAD * omp_get_num_threads());
    int64_t block_rows = share < GEMM_BLOCK_ROWS ? (share + GEMM_ROWS - 1) / GEMM_ROWS * GEMM_ROWS : GEMM_BLOCK_ROWS;
    int64_t blocks = (rows + block_rows - 1) / block_rows, whole = n / LANES * LANES;
    int64_t k_step = tokens >= GEMM_PROMPT_TOKENS ? GEMM_PROMPT_K : GEMM_K;
    for (int64_t k0 = 0; k0 == 0 || k0 < whole; k0 += k_step) {
        int64_t k1 = k0 + k_step < whole ? k0 + k_step : whole, last = k1 == whole;
#pragma omp for schedule(static)
        for (int64_t block = 0; block < blocks; block++) {
            int64_t b0 = block * block_rows, b1 = rows - b0 > block_rows ? b0 + block_rows : rows;
            for (int64_t t0 = 0; t0 < tokens; t0 += GEMM_TOKENS) {
                int count = tokens - t0 < GEMM_TOKENS ? (int)(tokens - t0) : GEMM_TOKENS;
                const float *xt[GEMM_TOKENS];
                for (int t = 0; t < count; t++) xt[t] = x + (t0 + t) * n;
                for (int64_t r0 = b0; r0 < b1; r0 += GEMM_ROWS) {
                    const uint16_t *wr[GEMM_ROWS];
                    for (int r = 0; r < GEMM_ROWS; r++)
                        wr[r] = (const uint16_t *)(w + (r0 + r < b1 ? r0 + r : b1 - 1) * stride);
                    float sums[GEMM_ROWS][GEMM_TOKENS];
                    f16_gemm_tile_of(wr, xt, count, k0, k1, sums);
                    for (int r = 0; r < GEMM_ROWS && r0 + r < b1; r++) {
                        for (int t = 0; t < count; t++) {
                            float sum = sums[r][t];
                            /* Columns past the last whole vector, once, with the last pass. */
                            for (int64_t c = whole; last && c < n; c++) sum += half_to_float(wr[r][c]) * xt[t][c];
                            float *o = out + (t0 + t) * rows + r0 + r;
                            *o = k0 == 0 ? sum : *o + sum;
                        }
                    }
                }
            }
        }
    }
}
#endif

/* The quantized product of many tokens (a prompt) as a blocked integer matrix product, the Q4_0 and Q8_0
 * counterpart of f16_gemm and what ggml does for a prompt: the input is quantized to Q8_0 once, and a tile of
 * QG_ROWS rows by QG_TOKENS tokens keeps its sums in registers, so each weight block unpacked and each input block
 * loaded serves several integer dot products. A row tile's blocks are unpacked (nibbles to bytes, f16 scales to
 * float) QG_CHUNK columns at a time into a buffer that stays in the first-level cache while every token tile of a
 * token block passes by it, and the token block's quantized inputs stay in the second-level cache while every row
 * tile passes by them; the rows are read from memory once per token block. Each kernel below computes the same
 * sums: per block, the integer dot of the 32 weights with the 32 quantized inputs, times both scales (AVX2's Q4_0
 * tile takes the weights' offset off the scaled sums rather than each block's). */
#define QG_CACHED (1024 * 1024) /* bytes of quantized inputs a token block keeps in the second-level cache */
#if INT_AVX512
#define QG_ROWS 16 /* a vector's lanes */
#define QG_TOKENS 8 /* 8 integer and 8 float sums, a weight vector, an input and the scales: 19 of 32 registers */
#define QG_CHUNK 1024 /* 16 KiB of a 16-row tile */
/* The weights are stored plus 128: VNNI multiplies unsigned bytes by signed ones. */
#define QG_OFFSET 128
#elif INT_AVX2
#define QG_ROWS 2   /* qg_tile: 8 sums, 2 weights and 2 scales, an input and its scale: 14 of AVX2's 16 registers */
#define QG_TOKENS 4
#define QG_CHUNK 4096 /* 8 KiB of a 2-row tile */
#define QG_OFFSET 0
/* Q4_0 weights are stored as their nibbles (weight + 8), unsigned, as maddubs takes them: see qg_tile_q4. */
#define QG_Q4_OFFSET 8
#else
#define QG_ROWS 2
#define QG_TOKENS 2
#define QG_CHUNK 4096
#define QG_OFFSET 0
#endif
/* Unpacking a chunk pays only across enough tokens: past one block of TOKEN_BLOCK the tile wins over the row
 * kernels (one Zen 4 thread, 4096 rows of 11008, 16 tokens: Q4_0 101 against 64 GOP/s), at 8 tokens the row-pair
 * path does (67 against 47). Against the sixteen-row kernel it wins from about 24 tokens (11008 x 4096 and 4096 x
 * 11008 Q4_0 from memory, two Zen 5 threads: 17 tokens 0.95-1.08x, 24 tokens 1.15-1.26x, 47 tokens 1.55x). */
#if INT_AVX512
#define QG_MIN_TOKENS 24
#define QG_AMX_MIN_TOKENS 10 /* where the tile unit runs the blocked product: see qg_takes */
#else
#define QG_MIN_TOKENS (TOKEN_BLOCK + 1)
#endif

#ifndef QG_Q4_OFFSET
#define QG_Q4_OFFSET QG_OFFSET
#endif
/* Block `blk` as 32 bytes in column order, weight + QG_Q4_OFFSET for Q4_0, weight + QG_OFFSET for Q8_0. */
static inline void qg_unpack_block(int type, const uint8_t *blk, uint8_t *o) {
#if INT_AVX2
    if (type == Q4_0) {
        __m128i v = _mm_loadu_si128((const __m128i *)(blk + 2)), low = _mm_set1_epi8(15);
        __m128i offset = _mm_set1_epi8((char)(QG_Q4_OFFSET - 8));
        _mm_storeu_si128((__m128i *)o, _mm_add_epi8(_mm_and_si128(v, low), offset));
        _mm_storeu_si128((__m128i *)(o + QK / 2), _mm_add_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), low), offset));
    } else {
        _mm256_storeu_si256((__m256i *)o, _mm256_add_epi8(q8_weights(blk), _mm256_set1_epi8((char)QG_OFFSET)));
    }
#else
    for (int i = 0; i < QK / 2; i++) {
        if (type == Q4_0) {
            o[i] = (uint8_t)((blk[2 + i] & 15) - 8 + QG_Q4_OFFSET);
            o[i + QK / 2] = (uint8_t)((blk[2 + i] >> 4) - 8 + QG_Q4_OFFSET);
        } else {
            o[i] = (uint8_t)((int8_t)blk[2 + i] + QG_OFFSET);
            o[i + QK / 2] = (uint8_t)((int8_t)blk[2 + QK / 2 + i] + QG_OFFSET);
        }
    }
#endif
}

#if INT_AVX512
/* Blocks b0..b1-1 of a row tile's rows unpacked with the rows interleaved: block b's bytes 4g..4g+3 of row r at
 * w + ((b - b0) * 8 + g) * 64 + 4 * r, so that one vector holds a group of four bytes of all 16 rows (qx_weights'
 * transposition, stored, its offset raised to `offset`: QG_OFFSET for qg_tile, 0 for the tile unit's signed
 * products); its scales as floats at s + (b - b0) * 16 + r. The unpacking is paid once per token block, so it must
 * be cheap next to the tile's products. */
static void qg_unpack(int type, const uint8_t *const rows[QG_ROWS], int64_t b0, int64_t b1, uint8_t *w, float *s,
                      int offset) {
    int64_t bb = block_bytes(type);
    for (int64_t b = b0; b < b1; b++) {
        __m512i v[8];
        __m512i raise = _mm512_set1_epi8((char)(offset - qx_weights(type, rows, b * bb, v)));
        for (int g = 0; g < 8; g++) _mm512_store_si512(w + ((b - b0) * 8 + g) * 64, _mm512_add_epi8(v[g], raise));
        for (int r = 0; r < QG_ROWS; r++) s[(b - b0) * QG_ROWS + r] = block_scale(rows[r] + b * bb);
    }
}

/* sums[t][r] = row r of the unpacked tile . token t's quantized input, over `blocks` blocks. A lane is a row: each
 * token's four input bytes of a group are broadcast to all 16 rows, so a block's integer sums come out whole, one
 * per lane, and take a single scaling for 16 products. The weights' offset comes off through the sums' start:
 * -128 times the input's block sum (qs). */
static inline __attribute__((always_inline)) void qg_tile(const uint8_t *w, const float *s, const int8_t *const q[QG_TOKENS],
                                                         const float *const d[QG_TOKENS],
                                                         const int32_t *const qs[QG_TOKENS], int64_t blocks,
                                                         float sums[QG_TOKENS][QG_ROWS]) {
    __m512 acc[QG_TOKENS];
    for (int t = 0; t < QG_TOKENS; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i p[QG_TOKENS];
        for (int t = 0; t < QG_TOKENS; t++) p[t] = _mm512_set1_epi32(-QG_OFFSET * qs[t][b]);
        for (int g = 0; g < QK / 4; g++) {
            __m512i wv = _mm512_loadu_si512(w + (b * (QK / 4) + g) * 64);
            for (int t = 0; t < QG_TOKENS; t++) {
                int32_t x;
                memcpy(&x, q[t] + b * QK + 4 * g, 4);
                p[t] = _mm512_dpbusd_epi32(p[t], wv, _mm512_set1_epi32(x));
            }
        }
        __m512 dw = _mm512_loadu_ps(s + b * QG_ROWS);
        for (int t = 0; t < QG_TOKENS; t++)
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[t]), _mm512_mul_ps(dw, _mm512_set1_ps(d[t][b])), acc[t]);
    }
    for (int t = 0; t < QG_TOKENS; t++) _mm512_storeu_ps(sums[t], acc[t]);
}
#if QG_AMX
/* The tile unit multiplies a tile of 16 x 64 signed bytes by one of 64 x 16 into 16 x 16 int32 sums in one
 * instruction (TDPBSSD). Each block of 32 has its own pair of scales, so each takes one product of its own, K = 32:
 * 16 tokens' inputs (rows of the tile, packed by qg_amx_pack) by the 16 rows' unpacked block, whose VNNI layout
 * (four bytes of a row side by side, the 16 rows in a line) is qg_unpack's with the offset 0. The integer sums are
 * stored and scaled on the vector units, which keep the float sums, a token's 16 rows a register. A block costs
 * the tile unit about as much as its scaling costs the vector units, and the two overlap little: one thread took
 * 16.5 ns a block for the tile work alone, 10 for the scaling alone and 28 for both (25-28 scaling the pair of
 * blocks before the pair just stored). On Q4_0 4096 x 4096, 11008 x 4096 and 4096 x 11008 from memory, two
 * threads of an Intel Xeon (Sapphire Rapids, whose two virtual CPUs run together each took 2.2x as long for the
 * same tile work), against the VNNI tile, best of 4: 32 tokens 1.37-1.38x, 64 1.45-1.47x, 128 1.46-1.51x, 512
 * 1.22-1.46x. */
#define QG_AMX_TOKENS 16

/* Linux lends the tile registers (8 KiB of state to save at each switch) to a process that asks, and a virtual
 * machine may not offer them at all: the request is made once, and where it fails the VNNI tile is used. A thread
 * loads the tile configuration at each product and releases it after, which keeps its switches cheap between
 * prompts and holds no state a library sharing the thread could have changed. */
static int amx_granted(void) {
    static int state; /* 0 not asked yet, 1 granted, -1 refused */
    int got = __atomic_load_n(&state, __ATOMIC_RELAXED);
    if (!got) {
        enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
        got = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, got, __ATOMIC_RELAXED);
    }
    return got > 0;
}

/* Asked when the library loads, so that every thread of a parallel region reads the same answer, and a thread's
 * choice of kernel (which decides its worksharing loops' token blocks, see q_gemm) never depends on a race. */
__attribute__((constructor)) static void amx_ask(void) { amx_granted(); }

_Static_assert(QG_ROWS * 4 == 64, "a tile's line of 64 bytes holds a sum or a group of four bytes of each row");

static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    /* tmm0, tmm1: the sums of 16 tokens by 16 rows; tmm2, tmm3: a block of 16 tokens' inputs; tmm4, tmm5: a block
     * of 16 rows, a group of four bytes of each in a line of 64. */
    for (int i = 0; i < 2; i++) {
        config.rows[i] = QG_AMX_TOKENS, config.colsb[i] = QG_ROWS * 4;
        config.rows[2 + i] = QG_AMX_TOKENS, config.colsb[2 + i] = QK;
        config.rows[4 + i] = QK / 4, config.colsb[4 + i] = QG_ROWS * 4;
    }
    _tile_loadconfig(&config);
}

/* acc[t] += each row's integer sums c[t] of one block times the row scales s and the token's scale d[t][b]. */
static inline __attribute__((always_inline)) void qg_amx_scale(const int32_t c[QG_AMX_TOKENS][QG_ROWS],
                                                              const float *s, const float *const d[QG_AMX_TOKENS],
                                                              int64_t b, __m512 acc[QG_AMX_TOKENS]) {
    __m512 dw = _mm512_loadu_ps(s);
    for (int t = 0; t < QG_AMX_TOKENS; t++) {
        __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(d[t][b]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[t])), scale, acc[t]);
    }
}

/* A token block's quantized inputs, tokens t0..t1-1, packed for the tile unit: 16 tokens' block b (32 bytes each,
 * one after the other) at tiles + (j * nb + b) * 512 for the j-th 16 tokens, the last token repeated to fill the
 * last 16. Read in place, the inputs of 16 tokens lie n bytes apart, which for n a multiple of 4096 puts all 16 in
 * one set of the first-level cache: packed, a block's 16 are 512 bytes in a row. */
static void qg_amx_pack(const q8_act *xq, int64_t n, int64_t t0, int64_t t1, int8_t *tiles) {
    int64_t nb = n / QK;
    for (int64_t j = 0; t0 + j * QG_AMX_TOKENS < t1; j++) {
        for (int t = 0; t < QG_AMX_TOKENS; t++) {
            int64_t tt = t0 + j * QG_AMX_TOKENS + t < t1 ? t0 + j * QG_AMX_TOKENS + t : t1 - 1;
            const int8_t *from = xq->q + tt * n;
            int8_t *to = tiles + j * nb * QK * QG_AMX_TOKENS + t * QK;
            for (int64_t b = 0; b < nb; b++) memcpy(to + b * QK * QG_AMX_TOKENS, from + b * QK, QK);
        }
    }
}

/* sums[t][r] = row r of the unpacked tile . token t's quantized input, over `blocks` blocks of 16 tokens' inputs
 * as qg_amx_pack lays them out (q: the first block's). */
static void qg_amx_tile(const uint8_t *w, const float *s, const int8_t *q, const float *const d[QG_AMX_TOKENS],
                        int64_t blocks, float sums[QG_AMX_TOKENS][QG_ROWS]) {
    __m512 acc[QG_AMX_TOKENS];
    _Alignas(64) int32_t c[2][QG_AMX_TOKENS][QG_ROWS];
    for (int t = 0; t < QG_AMX_TOKENS; t++) acc[t] = _mm512_setzero_ps();
    const int64_t tile = QK * QG_ROWS; /* bytes of one unpacked block, and of 16 tokens' inputs of a block */
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        _tile_loadd(2, q + b * tile, QK);
        _tile_loadd(4, w + b * tile, QG_ROWS * 4);
        _tile_zero(0);
        _tile_dpbssd(0, 2, 4);
        _tile_loadd(3, q + (b + 1) * tile, QK);
        _tile_loadd(5, w + (b + 1) * tile, QG_ROWS * 4);
        _tile_zero(1);
        _tile_dpbssd(1, 3, 5);
        _tile_stored(0, c[0], QG_ROWS * 4);
        _tile_stored(1, c[1], QG_ROWS * 4);
        qg_amx_scale(c[0], s + b * QG_ROWS, d, b, acc);
        qg_amx_scale(c[1], s + (b + 1) * QG_ROWS, d, b + 1, acc);
    }
    if (b < blocks) {
        _tile_loadd(2, q + b * tile, QK);
        _tile_loadd(4, w + b * tile, QG_ROWS * 4);
        _tile_zero(0);
        _tile_dpbssd(0, 2, 4);
        _tile_stored(0, c[0], QG_ROWS * 4);
        qg_amx_scale(c[0], s + b * QG_ROWS, d, b, acc);
    }
    for (int t = 0; t < QG_AMX_TOKENS; t++) _mm512_storeu_ps(sums[t], acc[t]);
}
#endif
#else
/* Blocks b0..b1-1 of a row tile's rows unpacked (row r at w + r * QG_CHUNK), with their scales as floats (row r at
 * s + r * QG_CHUNK / QK). */
static void qg_unpack(int type, const uint8_t *const rows[QG_ROWS], int64_t b0, int64_t b1, uint8_t *w, float *s) {
    int64_t bb = block_bytes(type);
    for (int r = 0; r < QG_ROWS; r++) {
        for (int64_t b = b0; b < b1; b++) {
            qg_unpack_block(type, rows[r] + b * bb, w + r * QG_CHUNK + (b - b0) * QK);
            s[r * (QG_CHUNK / QK) + b - b0] = block_scale(rows[r] + b * bb);
        }
    }
}
#endif

#if INT_AVX2 && !INT_AVX512
/* Q8_0's tile (Q4_0 takes qg_tile_q4): one block per vector; the signed weights' products go through unsigned_dot32
 * as in dot_q8_q8 (|w| times x with w's sign). The input's block sums (qs) are for the offsets of the other tiles. */
static inline __attribute__((always_inline)) void qg_tile(const uint8_t *w, const float *s, const int8_t *const q[QG_TOKENS],
                                                         const float *const d[QG_TOKENS],
                                                         const int32_t *const qs[QG_TOKENS], int64_t blocks,
                                                         float sums[QG_TOKENS][QG_ROWS]) {
    (void)qs;
    __m256 acc[QG_ROWS][QG_TOKENS];
    for (int r = 0; r < QG_ROWS; r++)
        for (int t = 0; t < QG_TOKENS; t++) acc[r][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i wv[QG_ROWS], aw[QG_ROWS];
        __m256 dw[QG_ROWS];
        for (int r = 0; r < QG_ROWS; r++) {
            wv[r] = _mm256_loadu_si256((const __m256i *)(w + r * QG_CHUNK + b * QK));
            aw[r] = _mm256_sign_epi8(wv[r], wv[r]);
            dw[r] = _mm256_broadcast_ss(s + r * (QG_CHUNK / QK) + b);
        }
        for (int t = 0; t < QG_TOKENS; t++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(q[t] + b * QK));
            __m256 dx = _mm256_broadcast_ss(d[t] + b);
            for (int r = 0; r < QG_ROWS; r++) {
                __m256i p = unsigned_dot32(aw[r], _mm256_sign_epi8(x, wv[r]));
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw[r], dx), acc[r][t]);
            }
        }
    }
    for (int r = 0; r < QG_ROWS; r++)
        for (int t = 0; t < QG_TOKENS; t++) sums[t][r] = hsum256(acc[r][t]);
}

/* qg_tile for Q4_0, two blocks at a time, with the weights unsigned (0..15): maddubs takes them as they are, with
 * no sign operations, and the blocks' 16-bit pair sums are added (hadd) before they are widened, so that one
 * widening, conversion, scaling and sum serve two blocks. A 16-bit lane then sums at most 4 * 15 * 127, exact; a
 * lane of the widened sums holds, per 128-bit half, two partial sums of the first block and two of the second,
 * whose scales `pairs` lays out alike. The offset comes off at the end: 8 times the input's block sums (qs), scaled,
 * eight blocks at a time. An odd last block goes one byte at a time. 4096 x 4096, 11008 x 4096 and 4096 x 11008
 * against 136 and 514 tokens, two Zen 5 threads in AVX2: 1.15-1.19x qg_tile (the pairs alone, signed: 1.06-1.10x;
 * unsigned weights alone, one block at a time: 0.91-0.96x). */
static inline __attribute__((always_inline)) void qg_tile_q4(const uint8_t *w, const float *s,
                                                            const int8_t *const q[QG_TOKENS],
                                                            const float *const d[QG_TOKENS],
                                                            const int32_t *const qs[QG_TOKENS], int64_t blocks,
                                                            float sums[QG_TOKENS][QG_ROWS]) {
    const __m256i ones = _mm256_set1_epi16(1), pairs = _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1);
    __m256 acc[QG_ROWS][QG_TOKENS];
    for (int r = 0; r < QG_ROWS; r++)
        for (int t = 0; t < QG_TOKENS; t++) acc[r][t] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        __m256i w0[QG_ROWS], w1[QG_ROWS];
        __m256 dw[QG_ROWS];
        for (int r = 0; r < QG_ROWS; r++) {
            w0[r] = _mm256_loadu_si256((const __m256i *)(w + r * QG_CHUNK + b * QK));
            w1[r] = _mm256_loadu_si256((const __m256i *)(w + r * QG_CHUNK + (b + 1) * QK));
            __m128i scales = _mm_loadl_epi64((const __m128i *)(s + r * (QG_CHUNK / QK) + b));
            dw[r] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(scales)), pairs);
        }
        for (int t = 0; t < QG_TOKENS; t++) {
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(q[t] + b * QK));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(q[t] + (b + 1) * QK));
            __m128i scales = _mm_loadl_epi64((const __m128i *)(d[t] + b));
            __m256 dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(scales)), pairs);
            for (int r = 0; r < QG_ROWS; r++) {
                __m256i m0 = _mm256_maddubs_epi16(w0[r], x0);
                __m256i m1 = _mm256_maddubs_epi16(w1[r], x1);
                __m256i p = _mm256_madd_epi16(_mm256_hadd_epi16(m0, m1), ones);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw[r], dx), acc[r][t]);
            }
        }
    }
    int64_t c8 = 0;
    for (; c8 + 8 <= b; c8 += 8) {
        for (int t = 0; t < QG_TOKENS; t++) {
            __m256 c = _mm256_mul_ps(_mm256_loadu_ps(d[t] + c8),
                                     _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(qs[t] + c8))));
            c = _mm256_mul_ps(c, _mm256_set1_ps(-(float)QG_Q4_OFFSET));
            for (int r = 0; r < QG_ROWS; r++)
                acc[r][t] = _mm256_fmadd_ps(c, _mm256_loadu_ps(s + r * (QG_CHUNK / QK) + c8), acc[r][t]);
        }
    }
    for (int r = 0; r < QG_ROWS; r++) {
        for (int t = 0; t < QG_TOKENS; t++) {
            float sum = hsum256(acc[r][t]);
            for (int64_t c = c8; c < b; c++)
                sum -= QG_Q4_OFFSET * s[r * (QG_CHUNK / QK) + c] * d[t][c] * (float)qs[t][c];
            if (b < blocks) {
                const uint8_t *wb = w + r * QG_CHUNK + b * QK;
                const int8_t *xb = q[t] + b * QK;
                int32_t dot = 0;
                for (int i = 0; i < QK; i++) dot += (wb[i] - QG_Q4_OFFSET) * xb[i];
                sum += s[r * (QG_CHUNK / QK) + b] * d[t][b] * (float)dot;
            }
            sums[t][r] = sum;
        }
    }
}
#elif !INT_AVX512
/* The scalar reference of the SIMD tiles: the same integer block sums, scaled block by block. */
static void qg_tile(const uint8_t *w, const float *s, const int8_t *const q[QG_TOKENS], const float *const d[QG_TOKENS],
                    const int32_t *const qs[QG_TOKENS], int64_t blocks, float sums[QG_TOKENS][QG_ROWS]) {
    (void)qs;
    for (int r = 0; r < QG_ROWS; r++) {
        for (int t = 0; t < QG_TOKENS; t++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const int8_t *wb = (const int8_t *)w + r * QG_CHUNK + b * QK, *xb = q[t] + b * QK;
                int32_t sum = 0;
                for (int i = 0; i < QK; i++) sum += wb[i] * xb[i];
                acc += s[r * (QG_CHUNK / QK) + b] * d[t][b] * (float)sum;
            }
            sums[t][r] = acc;
        }
    }
}
#endif

#if QG_AMX
#define QG_MOST_TOKENS QG_AMX_TOKENS
#else
#define QG_MOST_TOKENS QG_TOKENS
#endif

/* out[t * rows + r] = row r . x[t] for `tokens` quantized inputs xq of Q4_0 or Q8_0 rows, inside a parallel region
 * (the row tiles of each token block shared among the threads). A tile at the edge repeats its last row or token
 * and keeps only the rest. */
static void q_gemm(int type, const uint8_t *w, int64_t stride, int64_t rows, const q8_act *xq, int64_t n,
                   int64_t tokens, float *out) {
    int64_t nb = n / QK, tiles = (rows + QG_ROWS - 1) / QG_ROWS;
    /* Every thread meets the same worksharing loops, one per token block, so a thread with the tile unit and one
     * without (no memory for its copy) take the same blocks: a multiple of both tiles' tokens. */
    int64_t block = QG_CACHED / (n > 0 ? n : 1) / QG_MOST_TOKENS * QG_MOST_TOKENS;
    if (block < QG_MOST_TOKENS) block = QG_MOST_TOKENS;
#if QG_AMX
    /* Each thread packs each token block for itself: a copy of at most QG_CACHED bytes (of 16 tokens where one
     * input is larger) next to the block's products over every row tile. Where the tile unit is refused, or the
     * copy has no memory, this thread takes the VNNI tile. */
    int64_t span = (tokens < block ? tokens : block) + QG_AMX_TOKENS - 1;
    int8_t *packed = amx_granted() ? aligned_alloc(64, span / QG_AMX_TOKENS * QG_AMX_TOKENS * n) : NULL;
    int amx = packed != NULL;
    if (amx) amx_configure();
    int64_t step = amx ? QG_AMX_TOKENS : QG_TOKENS;
#else
    int64_t step = QG_TOKENS;
#endif
    _Alignas(64) uint8_t wbuf[QG_ROWS * QG_CHUNK];
    float sbuf[QG_ROWS * (QG_CHUNK / QK)];
    for (int64_t tb0 = 0; tb0 < tokens; tb0 += block) {
        int64_t tb1 = tb0 + block < tokens ? tb0 + block : tokens;
#if QG_AMX
        if (amx) qg_amx_pack(xq, n, tb0, tb1, packed);
#endif
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const uint8_t *wr[QG_ROWS];
            int64_t r0 = tile * QG_ROWS;
            for (int r = 0; r < QG_ROWS; r++) wr[r] = w + (r0 + r < rows ? r0 + r : rows - 1) * stride;
            for (int64_t c0 = 0; c0 < nb; c0 += QG_CHUNK / QK) {
                int64_t c1 = c0 + QG_CHUNK / QK < nb ? c0 + QG_CHUNK / QK : nb;
#if QG_AMX
                qg_unpack(type, wr, c0, c1, wbuf, sbuf, amx ? 0 : QG_OFFSET);
#elif INT_AVX512
                qg_unpack(type, wr, c0, c1, wbuf, sbuf, QG_OFFSET);
#else
                qg_unpack(type, wr, c0, c1, wbuf, sbuf);
#endif
                for (int64_t t0 = tb0; t0 < tb1; t0 += step) {
                    const int8_t *q[QG_MOST_TOKENS];
                    const float *d[QG_MOST_TOKENS];
                    const int32_t *qs[QG_MOST_TOKENS];
                    for (int t = 0; t < step; t++) {
                        int64_t tt = t0 + t < tb1 ? t0 + t : tb1 - 1;
                        q[t] = xq->q + tt * n + c0 * QK;
                        d[t] = xq->d + tt * nb + c0;
                        qs[t] = xq->sum + tt * nb + c0;
                    }
                    _Alignas(64) float sums[QG_MOST_TOKENS][QG_ROWS];
#if QG_AMX
                    if (amx)
                        qg_amx_tile(wbuf, sbuf, packed + ((t0 - tb0) / QG_AMX_TOKENS * nb + c0) * QK * QG_AMX_TOKENS,
                                    d, c1 - c0, sums);
                    else
#endif
#if INT_AVX2 && !INT_AVX512
                    if (type == Q4_0)
                        qg_tile_q4(wbuf, sbuf, q, d, qs, c1 - c0, sums);
                    else
#endif
                        qg_tile(wbuf, sbuf, q, d, qs, c1 - c0, sums);
                    for (int t = 0; t < step && t0 + t < tb1; t++) {
                        float *o = out + (t0 + t) * rows + r0;
                        for (int r = 0; r < QG_ROWS && r0 + r < rows; r++) o[r] = c0 == 0 ? sums[t][r] : o[r] + sums[t][r];
                    }
                }
            }
        }
    }
#if QG_AMX
    if (amx) _tile_release();
    free(packed);
#endif
}

/* Whether the blocked product takes a product of `tokens` tokens over rows of `type` and n columns (a row of no
 * whole block has nothing for it to sum, and the row kernels write its zeros). The tile unit's tiles take 16
 * tokens, and from 10 they beat the sixteen-row kernel's 8 + 2 (Q4_0, 4096 x 4096, 11008 x 4096 and 4096 x 11008
 * from memory, two threads of an Intel Xeon with AMX, best of 8: 8 tokens 0.82x, 10 1.18x, 12 1.31x, 14 1.65x, 16
 * 1.19x, 20 1.33x). */
static int qg_takes(int type, int64_t n, int64_t tokens) {
    if (type == F16 || n < QK) return 0;
#if QG_AMX
    if (tokens >= QG_AMX_MIN_TOKENS && amx_granted()) return 1;
#endif
    return tokens >= QG_MIN_TOKENS;
}

/* out[t, r] = row r . x[t] for `tokens` inputs x [tokens, n], inside a parallel region: each row is read once for
 * all of them. xq holds the inputs quantized (for quantized rows). */
static void matvec_rows(int type, const uint8_t *w, int64_t stride, int64_t rows, const float *x, const q8_act *xq,
                        int64_t n, int64_t tokens, float *out) {
    if (qg_takes(type, n, tokens)) {
        q_gemm(type, w, stride, rows, xq, n, tokens, out);
        return;
    }
#if INT_AVX512
    if (qx_takes(type, (QX_ROWS - 1) * stride, tokens)) {
#pragma omp for schedule(static)
        for (int64_t r0 = 0; r0 < rows; r0 += QX_ROWS)
            qx_rows(type, w + r0 * stride, stride, rows - r0 < QX_ROWS ? rows - r0 : QX_ROWS, xq, tokens, n, out + r0,
                     rows);
        return;
    }
#endif
#if LANES > 1
    if (type == F16 && tokens >= GEMM_MIN_TOKENS) {
        f16_gemm(w, stride, rows, x, n, tokens, out);
        return;
    }
#endif
    /* Tokens go a block at a time, so a block's inputs stay in cache while every row passes by them. */
    for (int64_t t0 = 0; t0 < tokens; t0 += TOKEN_BLOCK) {
        int64_t count = tokens - t0 < TOKEN_BLOCK ? tokens - t0 : TOKEN_BLOCK, nb = n / QK;
        q8_act block = {xq->q ? xq->q + t0 * n : NULL, xq->d ? xq->d + t0 * nb : NULL,
                        xq->sum ? xq->sum + t0 * nb : NULL};
        if (count > 1) {
            /* Rows in pairs: each input vector loaded serves both (see rows2_tokens). */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < (rows + 1) / 2; p++) {
                int64_t r = 2 * p;
                const uint8_t *row = w + r * stride;
                if (r + 1 < rows)
                    rows2_tokens(type, row, row + stride, x + t0 * n, &block, count, n, out + t0 * rows + r, rows);
                else
                    row_tokens(type, row, row, x + t0 * n, &block, count, n, out + t0 * rows + r, rows);
            }
            continue;
        }
#if LANES > 1
        if (type == F16) {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < (rows + F16_ROWS - 1) / F16_ROWS; g++) {
                int64_t r = g * F16_ROWS;
                if (r + F16_ROWS <= rows) {
                    f16_rows(w + r * stride, stride, x + t0 * n, n, out + t0 * rows + r);
                    continue;
                }
                for (; r < rows; r++)
                    out[t0 * rows + r] = dot_f16((const uint16_t *)(w + r * stride), NULL, x + t0 * n, n);
            }
            continue;
        }
#endif
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            row_tokens(type, w + r * stride, NULL, x + t0 * n, &block, count, n, out + t0 * rows + r, rows);
    }
}

/* Whether this build has the blocked F16 product: without SIMD its products of many tokens would read every row
 * once per TOKEN_BLOCK tokens, and the caller's float32 matrix product is quicker. */
int32_t qinfer_f16_blocked(void) {
#if LANES > 1
    return 1;
#else
    return 0;
#endif
}

/* Whether the blocked quantized product has the tile unit (AMX): 0 not in this build, 1 built but refused by Linux,
 * 2 in use. */
int32_t qinfer_tile_unit(void) {
#if QG_AMX
    return amx_granted() ? 2 : 1;
#else
    return 0;
#endif
}

/* Ends the calling thread's idle OpenMP team in libgomp, whose OpenMP 5.0 pause frees the caller's threads alone
 * (its next parallel region makes a new team). libgomp counts the threads of every thread's team, and where they
 * outnumber the CPUs its barriers wait asleep rather than spinning: a thread that loaded a model and hands the
 * kernels to another (the server's engine thread) would otherwise leave its idle team counted and make each of the
 * other's barriers a sleep and a wake (the tiny model's decode step: 1.2-2.3 ms against 0.2). Compilers older than
 * the pause (GCC before 9, clang before 8) build it as nothing; so does a runtime without it, through the weak
 * reference. */
#if (defined(__clang__) && __clang_major__ >= 8) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 9)
#pragma weak omp_pause_resource_all
void qinfer_release_threads(void) {
    if (omp_pause_resource_all) omp_pause_resource_all(omp_pause_soft);
}
#else
void qinfer_release_threads(void) {}
#endif

/* out[t, r] = row r . x[t] for `tokens` inputs x [tokens, n]: each row is read once for all of them. */
int qinfer_matvec(const uint8_t *w, int64_t stride, int type, const int64_t shape[2], const float *x, int64_t n,
                  int64_t tokens, float *out, int threads) {
    int64_t rows = shape[0];
    if (!fits(type, stride, rows, shape[1], n, NULL, rows)) return -1;
    q8_act xq = {0};
    if (type != F16 && q8_alloc(tokens, n, &xq)) {
        q8_free(&xq);
        return -2;
    }
    int64_t nb = n / QK;
#pragma omp parallel num_threads(threads)
    {
        /* A prompt's tokens are quantized by all the threads; the loop's barrier publishes them. */
        if (type != F16) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tokens; t++) {
                q8_act token = {xq.q + t * n, xq.d + t * nb, xq.sum + t * nb};
                q8_quantize_blocks(x + t * n, nb, &token);
            }
        }
        matvec_rows(type, w, stride, rows, x, &xq, n, tokens, out);
    }
    q8_free(&xq);
    return 0;
}
