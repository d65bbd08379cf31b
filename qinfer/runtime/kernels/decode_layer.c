/* A forward call's every layer and the output head in one native call (qinfer_decode_step), or several greedy
 * decode steps in a row. One step of one layer (llama, bamboo, qwen2, falcon, opt, and the mixtures of experts
 * qwen2moe, qwen3moe and mixtral) for a batch of tokens, one per sequence (a decode step), runs of a prompt's, or both:
 * attention norm (RMSNorm, or LayerNorm with its bias), the q/k/v products (and their biases), an RMSNorm over
 * each head of q and k (Qwen3), rope (where the family has it), the KV-cache write (float, f16 or Q8_0 rows),
 * attention of each token over its own sequence's cached positions (the last `window` of them where the model slides
 * one) or over the rows a window cache keeps (updating their attention mass and replacing the weakest), the output
 * product (and its bias) and residual, the FFN norm, the predictor (fc1, relu, fc2, threshold), the sparse or dense
 * FFN over the union of the neurons the tokens select (with up's and down's biases where there are), and its
 * residual; or, for a parallel block (falcon), attention and FFN both from the layer's input and added to it
 * together; or, for a mixture, the router, each token's top experts (qinfer/core/expert_routing.py), their SwiGLU
 * and the sigmoid-gated shared expert (Qwen2-MoE).
 *
 * A decode step in torch is some thirty small operator calls per layer, each with its own dispatch and allocation:
 * about 1 ms a layer on two cores, a third of the time a 7B layer's sparse Q4_0 rows take to read. Here the
 * threads stay in one parallel region for the whole layer and meet at barriers, and every buffer is the caller's
 * scratch, made once.
 *
 * Weights are rows as in row_kernels.c (F16, Q4_0, Q8_0); products over quantized rows take the input quantized
 * to Q8_0 blocks. The float math follows the runtime's torch path (model/llama.py, ffn/sparse.py): RMSNorm,
 * rope on adjacent pairs or on halves (neox) with the caller's cos/sin, softmax attention scaled by 1/sqrt(head_dim)
 * with grouped kv heads, neurons selected where fc2(relu(fc1(h))) >= threshold or, without a predictor, where
 * |act(gate)| exceeds the layer's gate threshold (0 for ReLU; calibrated for a sparse SwiGLU model).
 *
 * The caller (qinfer/runtime/kernels/decode_layer.py) checks every shape against the tensors once, when it builds the
 * layer descriptions; decode_layer checks again that the matrices fit the dimensions before reading.
 *
 * A Q8_0 cache row (llama.cpp's block_q8_0: an f16 scale d, then 32 int8 q, per 32 values) is written with
 * quantize_row_q8_0_ref's rounding, the bytes the torch path (qinfer/runtime/kv/q8_rows.py) writes, and read in
 * place, each block's q widened to float against the float query or the value's weight: attention then computes
 * what the torch path computes over the dequantized rows, to float rounding. (An integer dot with the query
 * quantized to Q8_0, as llama.cpp takes, would add the query's own rounding for a gain only once the keys no longer
 * come from memory.)
 */
#include <stddef.h>

#include "row_kernels.c"

/* KV-cache element types (qinfer/core/kv_policy.py's names f32, f16, q8_0). */
#define CACHE_F32 0
#define CACHE_F16 1
#define CACHE_Q8_0 2
#define EMPTY_ROW -1 /* a window cache's row that holds no position */

typedef struct {
    const uint8_t *data;
    int64_t stride; /* bytes between rows */
    int32_t type;   /* F16, Q4_0, Q8_0 */
    int64_t rows, cols;
} matrix;

typedef struct {
    matrix q, k, v, o;
    matrix gate, up, down; /* the dense FFN's, or a mixture's shared expert's (down [E, F] then) */
    matrix fc1, fc2;
    stacks experts;        /* a mixture's experts (dims.experts of them) */
    const float *router;   /* a mixture's [experts, E] */
    const float *shared_gate; /* [E]: the shared expert's output is scaled by sigmoid(shared_gate . x) */
    const float *q_norm, *k_norm; /* [head_dim]: an RMSNorm over each head of q and of k (Qwen3); NULL: none */
    const float *attn_norm, *ffn_norm;
    const float *attn_norm_bias, *ffn_norm_bias; /* a LayerNorm's biases */
    const float *q_bias, *k_bias, *v_bias;       /* NULL where the family has none */
    const float *o_bias, *up_bias, *down_bias;   /* opt's */
    void *k_cache, *v_cache; /* this layer's [slots, kv_heads, rows, row]: rows of head_dim in the cache's types */
    int32_t *pos_cache;      /* a window cache's [slots, kv_heads, kept]: each row's position; NULL: the full cache */
    float *mass_cache;       /* a window cache's [slots, kv_heads, kept]: each row's decayed attention mass */
    float gate_threshold;                  /* without a predictor: a neuron fires where |act(gate)| exceeds it */
} layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, ffn, ctx;
    int64_t predictor; /* the largest predictor rank of any layer (each layer's is its fc1's rows) */
    int64_t widest;    /* floats the quantized-input scratch holds per token: max(E, F, predictor) */
    int64_t window;    /* a token attends to its last `window` positions; 0: to all of them */
    int64_t tokens;    /* the most tokens one call takes (the scratch holds that many) */
    int64_t kept;      /* a window cache's rows per slot and kv head (ctx's rows for the full cache: 0) */
    int64_t sinks;     /* positions below it are a window's sinks, always kept */
    int64_t recent;    /* a window's last `recent` positions are always kept */
    int64_t experts;   /* a mixture's experts per layer, each token running `used` of them; 0: a dense FFN */
    int64_t used;
    int64_t expert_ffn; /* each expert's neurons (a mixture's `ffn` is its shared expert's, 0 without one) */
    float eps, threshold;
    float decay; /* a window row's attention mass is multiplied by it each decode step */
    int32_t form;       /* FORM_GATED, FORM_GATED_RELU_UP, FORM_GATED_SILU or FORM_UP */
    int32_t sparse;     /* 1: the neurons the predictor selects; 0: every neuron whose gate passes its threshold */
    int32_t down_rows;  /* 1: down holds neuron rows [F, E] (PowerInfer); 0: a matrix [E, F] (dense GGUF) */
    int32_t rope_neox;  /* 1: rope rotates x[i] against x[i + d/2]; 0: adjacent pairs */
    int32_t k_type;     /* the cache's keys: CACHE_F32, CACHE_F16 or CACHE_Q8_0 */
    int32_t v_type;     /* the cache's values, likewise */
    int32_t layer_norm; /* 1: LayerNorm with a bias (falcon); 0: RMSNorm */
    int32_t parallel;   /* 1: attention and FFN both read the layer's input (falcon); 0: the FFN follows attention */
    int32_t norm_top_k; /* 1: a token's chosen experts' weights are rescaled to sum to 1 */
} dims;

/* Scratch, made once by the caller in the sizes qinfer_scratch_sizes gives; per token, [tokens, ...]. */
typedef struct {
    float *x;      /* [E] the normalised input */
    float *q;      /* [heads * head_dim] */
    float *k, *v;  /* [kv_heads * head_dim] */
    float *att;    /* [heads * head_dim] */
    float *scores; /* [heads * (ctx + 1)] */
    float *pred;   /* [predictor] */
    float *g;      /* [F]; a mixture's [used * expert_ffn + 2 * F] */
    float *out;    /* [E] */
    float *held;   /* [E] a parallel block's attention output, or a shared expert's, until it is added */
    float *probs;  /* [experts] the router's probabilities */
    float *weights; /* [used] the chosen experts' weights */
    int64_t *chosen; /* [used] the chosen experts */
    int64_t *ids;  /* [F], once for all tokens */
    int8_t *xq;    /* [widest] */
    float *xd;     /* [widest / 32 + 1] */
    int32_t *xs;   /* [widest / 32 + 1] */
} scratch;

static int matrix_fits(const matrix *m, int64_t rows, int64_t cols) {
    return m->data && m->rows == rows && fits(m->type, m->stride, m->rows, m->cols, cols, NULL, rows);
}

/* x [tokens, n] quantized for the products over m (nothing to do for F16 rows), by one thread; the barrier at the
 * end of `single` publishes it. Every thread takes the same branch, as worksharing requires. */
static void quantize_input(int type, const float *x, int64_t tokens, int64_t n, const scratch *s, q8_act *a) {
    a->q = s->xq;
    a->d = s->xd;
    a->sum = s->xs;
    if (type == F16) return;
#pragma omp single
    q8_quantize_blocks(x, tokens * (n / QK), a);
}

/* out [tokens, rows] = x [tokens, cols] . m's rows, shared among the threads (inside the parallel region). */
static void product(const matrix *m, const float *x, const q8_act *a, int64_t tokens, float *out) {
    matvec_rows(m->type, m->data, m->stride, m->rows, x, a, m->cols, tokens, out);
}

/* RMSNorm, or LayerNorm where there is a bias. */
static void norm(const dims *d, const float *h, const float *w, const float *bias, float *out) {
    int64_t n = d->hidden;
    if (d->layer_norm) {
        float mean = 0.0f, var = 0.0f;
        for (int64_t i = 0; i < n; i++) mean += h[i];
        mean /= (float)n;
        for (int64_t i = 0; i < n; i++) var += (h[i] - mean) * (h[i] - mean);
        float scale = 1.0f / sqrtf(var / (float)n + d->eps);
        for (int64_t i = 0; i < n; i++) out[i] = (h[i] - mean) * scale * w[i] + bias[i];
        return;
    }
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += h[i] * h[i];
    float scale = 1.0f / sqrtf(ss / (float)n + d->eps);
    for (int64_t i = 0; i < n; i++) out[i] = h[i] * scale * w[i];
}

/* An RMSNorm over each head of x [heads, hd] with the weights w [hd], where there are (Qwen3's q and k). */
static void head_norm(float *x, int64_t heads, int64_t hd, const float *w, float eps) {
    if (!w) return;
    for (int64_t h = 0; h < heads; h++, x += hd) {
        float ss = 0.0f;
        for (int64_t i = 0; i < hd; i++) ss += x[i] * x[i];
        float scale = 1.0f / sqrtf(ss / (float)hd + eps);
        for (int64_t i = 0; i < hd; i++) x[i] = x[i] * scale * w[i];
    }
}

static void rope(float *x, int64_t heads, int64_t hd, const float *cos, const float *sin, int neox) {
    /* Dimension i turns with dimension i + half (neox) or with its neighbour (pairs). */
    int64_t half = hd / 2, step = neox ? 1 : 2, partner = neox ? half : 1;
    for (int64_t h = 0; h < heads; h++) {
        float *p = x + h * hd;
        for (int64_t i = 0; i < half; i++) {
            float *a = p + i * step, *b = a + partner, first = *a, second = *b;
            *a = first * cos[i] - second * sin[i];
            *b = first * sin[i] + second * cos[i];
        }
    }
}

static void add_bias(float *x, const float *bias, int64_t n) {
    if (bias)
        for (int64_t i = 0; i < n; i++) x[i] += bias[i];
}

static float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if LANES > 1
    vec acc = vzero();
    for (; i + LANES <= n; i += LANES) acc = vfma(vload(a + i), vload(b + i), acc);
    s = vsum(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out += a * v over n floats, v float or half. */
static void axpy_f32(float *out, float a, const float *v, int64_t n) {
    int64_t i = 0;
#if LANES > 1
    vec va = vset(a);
    for (; i + LANES <= n; i += LANES) vstore(out + i, vfma(va, vload(v + i), vload(out + i)));
#endif
    for (; i < n; i++) out[i] += a * v[i];
}

static void axpy_half(float *out, float a, const uint16_t *v, int64_t n) {
    int64_t i = 0;
#if LANES > 1
    vec va = vset(a);
    for (; i + LANES <= n; i += LANES) vstore(out + i, vfma(va, vload_half(v + i), vload(out + i)));
#endif
    for (; i < n; i++) out[i] += a * half_to_float(v[i]);
}

/* f rounded to the nearest half (ties to even), as torch's conversion rounds it. */
static uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000, abs = x & 0x7fffffff;
    if (abs > 0x7f800000) return (uint16_t)(sign | 0x7e00);      /* NaN */
    if (abs >= 0x477ff000) return (uint16_t)(sign | 0x7c00);     /* 65520 and above round to infinity */
    if (abs < 0x38800000) {                                      /* below 2^-14: a subnormal half, or 0 */
        float v;
        memcpy(&v, &abs, sizeof v);
        return (uint16_t)(sign | (uint32_t)nearbyintf(v * 16777216.0f)); /* in units of 2^-24 */
    }
    /* Rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest, ties to even. */
    return (uint16_t)(sign | (abs + 0xc8000fffu + ((abs >> 13) & 1)) >> 13);
#endif
}

static int64_t cache_row_bytes(int type, int64_t hd) {
    return type == CACHE_Q8_0 ? hd / QK * Q8_0_BYTES : hd * (type == CACHE_F16 ? 2 : 4);
}

/* A cache row of head_dim values written from floats x; Q8_0 as quantize_row_q8_0_ref: d = max|x| / 127, then each
 * x times 1 / d rounded to nearest, halves away from zero (roundf). */
static void cache_store(int type, int64_t hd, uint8_t *row, const float *x) {
    if (type == CACHE_Q8_0) {
        for (int64_t b = 0; b < hd / QK; b++, row += Q8_0_BYTES, x += QK) {
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(x[i]));
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            uint16_t half = float_to_half(d);
            row[0] = (uint8_t)(half & 0xff);
            row[1] = (uint8_t)(half >> 8);
            for (int i = 0; i < QK; i++) ((int8_t *)row)[2 + i] = (int8_t)roundf(x[i] * id);
        }
    } else if (type == CACHE_F16) {
        for (int64_t i = 0; i < hd; i++) ((uint16_t *)row)[i] = float_to_half(x[i]);
    } else {
        memcpy(row, x, (size_t)hd * sizeof(float));
    }
}

/* x . a Q8_0 row: per block, the q widened to float against x, times d. */
static float dot_q8_row(const uint8_t *row, const float *x, int64_t hd) {
#if LANES > 1
    vec acc = vzero();
    for (int64_t b = 0; b < hd / QK; b++, row += Q8_0_BYTES, x += QK) {
        const int8_t *q = (const int8_t *)(row + 2);
        vec part = vzero();
        for (int i = 0; i < QK; i += LANES) part = vfma(vload(x + i), vload_i8(q + i), part);
        acc = vfma(vset(block_scale(row)), part, acc);
    }
    return vsum(acc);
#else
    float s = 0.0f;
    for (int64_t b = 0; b < hd / QK; b++, row += Q8_0_BYTES, x += QK) {
        const int8_t *q = (const int8_t *)(row + 2);
        float part = 0.0f;
        for (int i = 0; i < QK; i++) part += x[i] * (float)q[i];
        s += block_scale(row) * part;
    }
    return s;
#endif
}

/* out += a * a Q8_0 row: per block, (a * d) times the q widened to float. */
static void axpy_q8_row(float *out, float a, const uint8_t *row, int64_t hd) {
    for (int64_t b = 0; b < hd / QK; b++, row += Q8_0_BYTES, out += QK) {
        const int8_t *q = (const int8_t *)(row + 2);
        float ad = a * block_scale(row);
        int i = 0;
#if LANES > 1
        vec va = vset(ad);
        for (; i < QK; i += LANES) vstore(out + i, vfma(va, vload_i8(q + i), vload(out + i)));
#endif
        for (; i < QK; i++) out[i] += ad * (float)q[i];
    }
}

static float cache_dot(int type, const uint8_t *row, const float *q, int64_t hd) {
    if (type == CACHE_Q8_0) return dot_q8_row(row, q, hd);
    return type == CACHE_F16 ? dot_f16((const uint16_t *)row, NULL, q, hd) : dot_f32(q, (const float *)row, hd);
}

static void cache_axpy(int type, float *out, float a, const uint8_t *row, int64_t hd) {
    if (type == CACHE_Q8_0)
        axpy_q8_row(out, a, row, hd);
    else if (type == CACHE_F16)
        axpy_half(out, a, (const uint16_t *)row, hd);
    else
        axpy_f32(out, a, (const float *)row, hd);
}

/* Softmax's exponentials: x[i] = exp(x[i] - top) for i < n, returning their sum. A score less the row's largest is
 * at most 0, so the vector forms need no overflow path: they compute exp as Cephes' expf does (whole powers of two
 * taken out, a degree-6 polynomial of the rest, within 2 ulp of expf), give 0 below float's normal range (where
 * expf gives a subnormal: nothing beside the largest score's 1), and keep NaN. expf one score at a time took a
 * tenth of a 32-sequence decode step of a small model. */
#define EXP_LOW -87.33654f /* below this, exp(x) is no longer a normal float */
#if LANES > 1
/* exp(x) for x <= 0 (or NaN): x = n ln2 + r with r within ln2 / 2 of 0 (ln2 in two parts, so that n ln2 is exact),
 * then Cephes' polynomial for exp(r), times 2^n. */
static inline vec vexp_nonpositive(vec x) {
    vec in_range = vmax(vset(EXP_LOW), x);
    vec n = vround(vmul(in_range, vset(1.44269504088896341f)));
    vec r = vfma(n, vset(-0.693359375f), in_range);
    r = vfma(n, vset(2.12194440e-4f), r);
    vec y = vfma(vset(1.9875691500e-4f), r, vset(1.3981999507e-3f));
    y = vfma(y, r, vset(8.3334519073e-3f));
    y = vfma(y, r, vset(4.1665795894e-2f));
    y = vfma(y, r, vset(1.6666665459e-1f));
    y = vfma(y, r, vset(5.0000001201e-1f));
    y = vadd(vfma(y, vmul(r, r), r), vset(1.0f));
    return vzero_below(vmul(y, vpow2(n)), x, EXP_LOW);
}
#endif

static float exp_shifted(float *x, int64_t n, float top) {
    int64_t i = 0;
    float total = 0.0f;
#if LANES > 1
    vec sum = vzero(), shift = vset(top);
    for (; i + LANES <= n; i += LANES) {
        vec e = vexp_nonpositive(vsub(vload(x + i), shift));
        vstore(x + i, e);
        sum = vadd(sum, e);
    }
    total = vsum(sum);
#endif
    for (; i < n; i++) total += x[i] = expf(x[i] - top);
    return total;
}

/* exp_shifted for the tests, which compare it with float64. */
float qinfer_exp_shifted(float *x, int64_t n, float top) { return exp_shifted(x, n, top); }

#if LANES > 1
/* acc + p * columns col..col+LANES-1 of a cache row (a Q8_0 block's scale folded into p). */
static inline vec add_row_columns(int type, vec acc, const uint8_t *row, int64_t col, float p) {
    if (type == CACHE_F16) return vfma(vset(p), vload_half((const uint16_t *)row + col), acc);
    if (type == CACHE_F32) return vfma(vset(p), vload((const float *)row + col), acc);
    const uint8_t *block = row + col / QK * Q8_0_BYTES;
    return vfma(vset(p * block_scale(block)), vload_i8((const int8_t *)(block + 2) + col % QK), acc);
}
#endif

/* o = inv * (the sum over the `count` rows from vc, v_bytes apart, of prob[p] times row p). The sums stay in
 * registers over every row, up to eight vectors of columns at a time (a head of 128 in one pass under AVX-512): added
 * into o row after row, each row's add had waited on the store of the row before (a 32-sequence decode step of a
 * small model spent a twelfth of its time there). */
static void attend_values(int type, float *o, const float *prob, const uint8_t *vc, int64_t v_bytes, int64_t count,
                          int64_t hd, float inv) {
#if LANES > 1
    if (hd % LANES == 0) {
        for (int64_t c0 = 0; c0 < hd; c0 += 8 * LANES) {
            int width = hd - c0 >= 8 * LANES ? 8 : (int)((hd - c0) / LANES);
            vec acc[8];
            for (int j = 0; j < 8; j++) acc[j] = vzero();
            for (int64_t p = 0; p < count; p++)
                for (int j = 0; j < width; j++)
                    acc[j] = add_row_columns(type, acc[j], vc + p * v_bytes, c0 + j * LANES, prob[p]);
            for (int j = 0; j < width; j++) vstore(o + c0 + j * LANES, vmul(acc[j], vset(inv)));
        }
        return;
    }
#endif
    memset(o, 0, (size_t)hd * sizeof(float));
    for (int64_t p = 0; p < count; p++) cache_axpy(type, o, prob[p] * inv, vc + p * v_bytes, hd);
}

/* Query head h of token t attends its kv head's positions up to its own (the last `window` of them); the (token,
 * head) pairs are shared among the threads, dynamically, since tokens at later positions cost more. */
static void attend(const dims *d, const layer *w, const scratch *s, int64_t tokens, const int64_t *pos,
                   const int64_t *slot) {
    int64_t hd = d->head_dim, group = d->heads / d->kv_heads;
    int64_t k_bytes = cache_row_bytes(d->k_type, hd), v_bytes = cache_row_bytes(d->v_type, hd);
    float scale = 1.0f / sqrtf((float)hd);
#pragma omp for schedule(dynamic)
    for (int64_t th = 0; th < tokens * d->heads; th++) {
        int64_t t = th / d->heads, h = th % d->heads, last = pos[t];
        int64_t first = d->window > 0 && last - d->window + 1 > 0 ? last - d->window + 1 : 0;
        int64_t at = (slot[t] * d->kv_heads + h / group) * d->ctx;
        const uint8_t *kc = (const uint8_t *)w->k_cache + at * k_bytes, *vc = (const uint8_t *)w->v_cache + at * v_bytes;
        const float *q = s->q + th * hd;
        float *sc = s->scores + th * (d->ctx + 1), *o = s->att + th * hd, top = -INFINITY;
        for (int64_t p = first; p <= last; p++) {
            /* A slot's rows are consecutive: the stream needs no read-ahead of its own. */
            sc[p] = cache_dot(d->k_type, kc + p * k_bytes, q, hd) * scale;
            top = sc[p] > top ? sc[p] : top; /* fmaxf's NaN rule, inline: GCC calls libm's for it */
        }
        float total = exp_shifted(sc + first, last - first + 1, top);
        attend_values(d->v_type, o, sc + first, vc + first * v_bytes, v_bytes, last - first + 1, hd, 1.0f / total);
    }
}

/* A window cache's decode step, as WindowKVCache._attend and _keep compute it for one new token per slot
 * (qinfer/runtime/kv/window.py): each query head of kv head j attends the rows kept for j whose positions it may see
 * and the token's own row (not yet stored); every row's mass decays once and gains the probability the group's
 * heads gave it; then the new row replaces the first of the lowest priority among the kept ones (an empty row,
 * else the least mass outside the sinks and the recent window). The (token, kv head) pairs are shared among the
 * threads: each owns its slot's rows of that head, which no other pair reads. A token at position 0 starts a new
 * sequence: the slot's rows are forgotten first. */
static void attend_window(const dims *d, const layer *w, const scratch *s, int64_t tokens, const int64_t *pos,
                          const int64_t *slot) {
    int64_t hd = d->head_dim, group = d->heads / d->kv_heads, rows = d->kept, kv = d->kv_heads * hd;
    int64_t k_bytes = cache_row_bytes(d->k_type, hd), v_bytes = cache_row_bytes(d->v_type, hd);
    float scale = 1.0f / sqrtf((float)hd);
#pragma omp for schedule(dynamic)
    for (int64_t tj = 0; tj < tokens * d->kv_heads; tj++) {
        int64_t t = tj / d->kv_heads, j = tj % d->kv_heads, last = pos[t], at = slot[t] * d->kv_heads + j;
        uint8_t *kc = (uint8_t *)w->k_cache + at * rows * k_bytes, *vc = (uint8_t *)w->v_cache + at * rows * v_bytes;
        int32_t *rp = w->pos_cache + at * rows;
        float *mass = w->mass_cache + at * rows, *scores = s->scores + (t * d->heads + j * group) * (d->ctx + 1);
        const float *new_k = s->k + t * kv + j * hd, *new_v = s->v + t * kv + j * hd;
        if (last == 0)
            for (int64_t r = 0; r < rows; r++) rp[r] = EMPTY_ROW, mass[r] = 0.0f;
        /* Each head of the group: its probabilities over rows 0..rows-1 and the new row (at `rows`), and its output. */
        for (int64_t g = 0; g < group; g++) {
            int64_t th = t * d->heads + j * group + g;
            const float *q = s->q + th * hd;
            float *sc = scores + g * (d->ctx + 1), *o = s->att + th * hd, total = 0.0f;
            float top = sc[rows] = dot_f32(q, new_k, hd) * scale;
            for (int64_t r = 0; r < rows; r++) {
                int visible = rp[r] >= 0 && rp[r] <= last;
                sc[r] = visible ? cache_dot(d->k_type, kc + r * k_bytes, q, hd) * scale : -INFINITY;
                top = fmaxf(top, sc[r]);
            }
            /* libm's expf, one row at a time: a subnormal probability is a mass the torch path keeps, and the
             * masses choose which row goes (exp_shifted gives 0 there). */
            for (int64_t r = 0; r <= rows; r++) total += sc[r] = expf(sc[r] - top);
            memset(o, 0, (size_t)hd * sizeof(float));
            for (int64_t r = 0; r < rows; r++) {
                sc[r] /= total;
                if (sc[r] != 0.0f) cache_axpy(d->v_type, o, sc[r], vc + r * v_bytes, hd);
            }
            sc[rows] /= total;
            axpy_f32(o, sc[rows], new_v, hd);
        }
        /* The group's probabilities are summed before they join the decayed mass, in the torch path's order. */
        float low = INFINITY, new_mass = 0.0f;
        int64_t victim = 0;
        for (int64_t g = 0; g < group; g++) new_mass += scores[g * (d->ctx + 1) + rows];
        for (int64_t r = 0; r < rows; r++) {
            float received = 0.0f;
            for (int64_t g = 0; g < group; g++) received += scores[g * (d->ctx + 1) + r];
            mass[r] = mass[r] * d->decay + received;
            float priority = rp[r] < 0 ? -INFINITY : rp[r] < d->sinks || rp[r] > last - d->recent ? INFINITY : mass[r];
            if (r == 0 || priority < low) low = priority, victim = r;
        }
        cache_store(d->k_type, hd, kc + victim * k_bytes, new_k);
        cache_store(d->v_type, hd, vc + victim * v_bytes, new_v);
        rp[victim] = (int32_t)last;
        mass[victim] = new_mass;
    }
}

static int quantized(int type) { return type != F16; }

/* For tokens t0..t0+n-1 (n <= TOKEN_BLOCK): out[(t - t0) * out_stride] = row . x[t] where keep[t * keep_stride] is
 * not 0, else 0. Where most of the chunk needs the row, one pass unpacks it for all of them (row_tokens); where
 * few do, each takes its own dot product and the others cost nothing. */
static void masked_row(int type, const uint8_t *row, const uint8_t *next, const float *x, const q8_act *a, int64_t e,
                       int64_t t0, int64_t n, const float *keep, int64_t keep_stride, float *out, int64_t out_stride) {
    int64_t needed = 0, nb = e / QK;
    for (int64_t t = t0; t < t0 + n; t++) needed += keep[t * keep_stride] != 0.0f;
    if (needed > 1 && 2 * needed >= n) {
        float all[TOKEN_BLOCK];
        q8_act block = {a->q + t0 * e, a->d + t0 * nb, a->sum + t0 * nb};
        row_tokens(type, row, next, x + t0 * e, &block, n, e, all, 1);
        for (int64_t t = t0; t < t0 + n; t++)
            out[(t - t0) * out_stride] = keep[t * keep_stride] != 0.0f ? all[t - t0] : 0.0f;
        return;
    }
    for (int64_t t = t0; t < t0 + n; t++)
        out[(t - t0) * out_stride] = keep[t * keep_stride] != 0.0f ? dot_row(type, row, next, x, a, t, e) : 0.0f;
}

/* The neurons any token selects (sel [tokens, f], non-zero where selected), ascending, into ids; then sel packed
 * into [tokens, count] in place: token t's value for ids[k] moves to sel[t * count + k], never past a value still
 * to be read (count <= f and k <= ids[k]). Returns count. One thread. */
static int64_t select_union(float *sel, int64_t tokens, int64_t f, int64_t *ids) {
    int64_t count = 0;
    for (int64_t j = 0; j < f; j++) {
        int any = 0;
        for (int64_t t = 0; t < tokens && !any; t++) any = sel[t * f + j] != 0.0f;
        if (any) ids[count++] = j;
    }
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t k = 0; k < count; k++) sel[t * count + k] = sel[t * f + ids[k]];
    return count;
}

/* The reverse of select_union's packing: act [tokens, count] back to one value per neuron [tokens, f], zeros
 * elsewhere, from the last value to the first, so that each is read before its place is written. One thread. */
static void unpack_union(float *act, int64_t tokens, int64_t f, const int64_t *ids, int64_t count) {
    for (int64_t t = tokens - 1; t >= 0; t--) {
        int64_t end = f;
        for (int64_t k = count - 1; k >= 0; k--) {
            int64_t id = ids[k];
            float v = act[t * count + k];
            for (int64_t j = id + 1; j < end; j++) act[t * f + j] = 0.0f;
            act[t * f + id] = v;
            end = id;
        }
        for (int64_t j = 0; j < end; j++) act[t * f + j] = 0.0f;
    }
}

#if INT_AVX512
/* How many selected rows of m one selected_rows call takes for `tokens` tokens: sixteen quantized rows where
 * qx_rows takes them; 0: none (row by row instead). F16 rows stay row by row: a tile computes every token's product,
 * and against the row kernel, which computes only the tokens that selected a neuron, F16 tiles of 6 rows read the
 * 7b-slice's PowerInfer file at 0.99x (16 sequences) and 0.89x (32). */
static int selected_tile(const matrix *m, int64_t f, int64_t tokens) {
    return qx_takes(m->type, (f - 1) * m->stride, tokens) ? QX_ROWS : 0;
}

/* out[t * out_stride + r] = m's row ids[r] . the quantized input of token t0 + t, for r < count (at most QX_ROWS)
 * and t < tokens, while the rows of the `left` ids from ids[0] one tile further on are read ahead. */
static void selected_rows(const matrix *m, const int64_t *ids, int64_t count, int64_t left, const q8_act *a,
                          int64_t t0, int64_t tokens, int64_t n, float *out, int64_t out_stride) {
    const uint8_t *rs[QX_ROWS], *next[QX_ROWS];
    for (int r = 0; r < QX_ROWS; r++) {
        int64_t k = r < count ? r : count - 1, ahead = k + QX_ROWS < left ? k + QX_ROWS : left - 1;
        rs[r] = m->data + ids[k] * m->stride;
        next[r] = m->data + ids[ahead] * m->stride;
    }
    q8_act at = {a->q + t0 * n, a->d + t0 * (n / QK), a->sum + t0 * (n / QK)};
    qx_rows_at(m->type, rs, next, count, &at, tokens, n, out, out_stride);
}

/* g [tokens, count] of the selected neurons k0..k0+rows-1 (at most QX_ROWS) for tokens t0..t0+n-1 times their up
 * product (relu(up) for FORM_GATED_RELU_UP), where g is not 0. */
static void times_up_tile(const dims *d, const layer *w, const scratch *s, const q8_act *a, int64_t k0, int64_t rows,
                          int64_t count, int64_t t0, int64_t n) {
    float out[TOKEN_BLOCK * QX_ROWS];
    selected_rows(&w->up, s->ids + k0, rows, count - k0, a, t0, n, d->hidden, out, QX_ROWS);
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < rows; r++) {
            float *g = s->g + (t0 + t) * count + k0 + r, up = out[t * QX_ROWS + r];
            if (*g != 0.0f) *g *= up_factor(d->form, up);
        }
}
#endif

/* The same for neuron k alone (its up row `row`, `next` read ahead), through the row kernel: each token's product
 * only where its g is not 0. */
static void times_up_row(const dims *d, const layer *w, const scratch *s, const q8_act *a, int64_t k, int64_t count,
                         const uint8_t *row, const uint8_t *next, int64_t t0, int64_t n) {
    float u[TOKEN_BLOCK];
    masked_row(w->up.type, row, next, s->x, a, d->hidden, t0, n, s->g + k, count, u, 1);
    for (int64_t t = t0; t < t0 + n; t++) {
        float *g = s->g + t * count + k, up = u[t - t0];
        if (*g != 0.0f) *g *= up_factor(d->form, up);
    }
}

/* The predictor's selected neurons ids[0..count-1] for `tokens` tokens, inside the parallel region: g [tokens,
 * count] holds 1 where a token selected a neuron and becomes its activation there, act(first x) (times up x where
 * gated), 0 elsewhere. A batch's quantized rows go sixteen at a time where the build has qx_rows
 * (selected_tile: every token's products computed, the rows read once either way; a tile's up rows only where one
 * of its neurons fired); one token's, F16 rows and other builds' row by row, a token's products only where it
 * selected the neuron, and up's only where the gate fired. */
static void gate_up_of_selected(const dims *d, const layer *w, const scratch *s, const q8_act *a, int64_t tokens,
                                int64_t count) {
    int64_t e = d->hidden;
    int gated = d->form != FORM_UP;
    const matrix *first = gated ? &w->gate : &w->up;
#if INT_AVX512
    int tile = selected_tile(first, d->ffn, tokens);
    if (tokens > 1 && tile && (!gated || selected_tile(&w->up, d->ffn, tokens) == tile)) {
        int64_t tiles = (count + tile - 1) / tile;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tiles; i++) {
            int64_t k0 = i * tile, rows = count - k0 < tile ? count - k0 : tile;
            for (int64_t t0 = 0; t0 < tokens; t0 += TOKEN_BLOCK) {
                int64_t n = tokens - t0 < TOKEN_BLOCK ? tokens - t0 : TOKEN_BLOCK;
                float out[TOKEN_BLOCK * QX_ROWS];
                int fired = 0;
                selected_rows(first, s->ids + k0, rows, count - k0, a, t0, n, e, out, tile);
                for (int64_t t = 0; t < n; t++)
                    for (int64_t r = 0; r < rows; r++) {
                        float *g = s->g + (t0 + t) * count + k0 + r;
                        float bias = w->up_bias ? w->up_bias[s->ids[k0 + r]] : 0.0f;
                        *g = *g != 0.0f ? gate_act(d->form, out[t * tile + r] + bias) : 0.0f;
                        fired |= *g != 0.0f;
                    }
                if (gated && fired) times_up_tile(d, w, s, a, k0, rows, count, t0, n);
            }
        }
        return;
    }
#endif
#pragma omp for schedule(dynamic, 8)
    for (int64_t j = 0; j < count; j++) {
        int64_t id = s->ids[j], next = s->ids[j + 1 < count ? j + 1 : j];
        /* Read ahead as qinfer_sparse_ffn does where it sums the first rows: this neuron's up row, then the next
         * one's first row. */
        const uint8_t *first_row = first->data + id * first->stride, *up_row = w->up.data + id * w->up.stride;
        const uint8_t *next_first = first->data + next * first->stride;
        for (int64_t t0 = 0; t0 < tokens; t0 += TOKEN_BLOCK) {
            int64_t n = tokens - t0 < TOKEN_BLOCK ? tokens - t0 : TOKEN_BLOCK;
            float selected[TOKEN_BLOCK];
            for (int64_t t = t0; t < t0 + n; t++) selected[t - t0] = s->g[t * count + j];
            masked_row(first->type, first_row, gated ? up_row : next_first, s->x, a, e, t0, n, s->g + j,
                       count, s->g + t0 * count + j, count);
            /* A neuron whose gate does not fire for a token contributes nothing: no up product for it. */
            for (int64_t t = t0; t < t0 + n; t++) {
                float *g = s->g + t * count + j;
                float bias = w->up_bias ? w->up_bias[id] : 0.0f;
                *g = selected[t - t0] != 0.0f ? gate_act(d->form, *g + bias) : 0.0f;
            }
            if (gated) times_up_row(d, w, s, a, j, count, up_row, next_first, t0, n);
        }
    }
}

/* The selected neurons' activations g [tokens, count] (of the neurons ids[0..count-1]) times up's product, where g
 * is not 0 (relu(up) in place of up for FORM_GATED_RELU_UP), inside the parallel region: quantized rows sixteen at
 * a time where the build has qx_rows (selected_tile), every token's product computed; otherwise row by row, each
 * token's product only where its g is not 0. */
static void up_of_selected(const dims *d, const layer *w, const scratch *s, const q8_act *a, int64_t tokens,
                           int64_t count) {
#if INT_AVX512
    int tile = selected_tile(&w->up, d->ffn, tokens);
    if (tile) {
        int64_t tiles = (count + tile - 1) / tile;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tiles; i++) {
            int64_t k0 = i * tile, rows = count - k0 < tile ? count - k0 : tile;
            for (int64_t t0 = 0; t0 < tokens; t0 += TOKEN_BLOCK)
                times_up_tile(d, w, s, a, k0, rows, count, t0, tokens - t0 < TOKEN_BLOCK ? tokens - t0 : TOKEN_BLOCK);
        }
        return;
    }
#endif
#pragma omp for schedule(dynamic, 8)
    for (int64_t k = 0; k < count; k++) {
        const uint8_t *row = w->up.data + s->ids[k] * w->up.stride;
        const uint8_t *next = w->up.data + s->ids[k + 1 < count ? k + 1 : k] * w->up.stride;
        for (int64_t t0 = 0; t0 < tokens; t0 += TOKEN_BLOCK)
            times_up_row(d, w, s, a, k, count, row, next, t0, tokens - t0 < TOKEN_BLOCK ? tokens - t0 : TOKEN_BLOCK);
    }
}

/* A token's choice, as qinfer/core/expert_routing.py's route makes it: p [experts] holds the router's logits and
 * becomes their softmax; chosen [used] the most probable experts, most probable first, and weights their
 * probabilities, rescaled to sum to 1 where norm_top_k. Of exactly equal probabilities the lower index goes first;
 * torch.topk breaks such ties in its partial sort's own order (the top 8 of 128 equal ones begin 84, 87, 86),
 * which no simple rule reproduces, so there the two paths may choose different experts. */
static void route(const dims *d, float *p, int64_t *chosen, float *weights) {
    float top = -INFINITY, total = 0.0f, sum = 0.0f;
    for (int64_t j = 0; j < d->experts; j++) top = fmaxf(top, p[j]);
    for (int64_t j = 0; j < d->experts; j++) total += p[j] = expf(p[j] - top);
    for (int64_t j = 0; j < d->experts; j++) p[j] /= total;
    for (int64_t i = 0; i < d->used; i++) {
        int64_t best = -1;
        for (int64_t j = 0; j < d->experts; j++) {
            int taken = 0;
            for (int64_t u = 0; u < i; u++) taken |= chosen[u] == j;
            /* A NaN probability is never greater: the first expert not taken stands in for it. */
            if (!taken && (best < 0 || p[j] > p[best])) best = j;
        }
        chosen[i] = best;
        sum += weights[i] = p[best];
    }
    if (d->norm_top_k)
        for (int64_t i = 0; i < d->used; i++) weights[i] /= sum;
}

/* A mixture's FFN of the normalised tokens s->x, inside the parallel region: the router, each token's choice, its
 * experts (row_kernels.c's expert_act and expert_down: every (token, expert) pair reads its expert's rows, so an
 * expert two tokens chose is read twice), into s->out; and the shared expert, under its sigmoid gate, into s->held.
 * The gate scales the shared expert's activations, before down, rather than its output: the same product up to
 * rounding, and no per-token scale to keep. */
static void moe_ffn(const dims *d, const layer *w, const scratch *s, int64_t tokens, q8_act *a) {
    const stacks *m = &w->experts;
    int64_t e = d->hidden, f = d->ffn, ef = d->expert_ffn, pairs = tokens * d->used;
    float *shared_g = s->g + pairs * ef, *shared_u = shared_g + tokens * f;
    int x_type = quantized(m->gate_type) || quantized(m->up_type) || (f && (quantized(w->gate.type) ||
                 quantized(w->up.type))) ? Q8_0 : F16;
    int act_type = quantized(m->down_type) || (f && quantized(w->down.type)) ? Q8_0 : F16;
    quantize_input(x_type, s->x, tokens, e, s, a);
#pragma omp for schedule(static)
    for (int64_t tj = 0; tj < tokens * d->experts; tj++)
        s->probs[tj] = dot_f32(s->x + tj / d->experts * e, w->router + tj % d->experts * e, e);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        route(d, s->probs + t * d->experts, s->chosen + t * d->used, s->weights + t * d->used);
    expert_act(m, s->x, a, s->chosen, pairs, d->used, s->g);
    if (f) {
        product(&w->gate, s->x, a, tokens, shared_g);
        product(&w->up, s->x, a, tokens, shared_u);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            float scale = 1.0f / (1.0f + expf(-dot_f32(s->x + t * e, w->shared_gate, e)));
            for (int64_t i = t * f; i < (t + 1) * f; i++)
                shared_g[i] = gate_act(FORM_GATED_SILU, shared_g[i]) * shared_u[i] * scale;
        }
    }
    /* The routed activations and the shared expert's are consecutive: one quantization serves both downs. */
    quantize_input(act_type, s->g, 1, pairs * ef + tokens * f, s, a);
    expert_down(m, s->g, a, s->chosen, s->weights, tokens, d->used, s->out);
    if (f) {
        int64_t blocks = pairs * ef / QK;
        q8_act shared = {a->q + pairs * ef, a->d + blocks, a->sum + blocks};
        product(&w->down, shared_g, &shared, tokens, s->held);
    }
}

/* h [tokens, E] += this layer's attention, then += its FFN, for tokens in slots slot[t] (< slots) at positions
 * pos[t], whose keys and values land in the cache: every token stores its own before any attends, so several tokens
 * of one slot at distinct positions (a prompt's chunk) each attend the others before them; the window cache takes
 * one token per slot. cos/sin hold head_dim / 2 values per token (NULL: no rope). The FFN reads each selected
 * neuron's rows once for all the tokens that need it. Returns the number of neurons whose rows were read (the union
 * over the tokens), -1 (nothing read or written) where a matrix does not fit the dimensions or the scratch, -3 where
 * a position or a slot is outside the cache or two tokens would write one row. */
static int64_t decode_layer(const layer *w, const dims *d, const scratch *s, float *h, int64_t tokens,
                            const int64_t *pos, const int64_t *slot, int64_t slots, const float *cos, const float *sin,
                            int threads) {
    int64_t e = d->hidden, f = d->ffn, hd = d->head_dim, kv = d->kv_heads * hd, heads = d->heads * hd;
    if (d->kv_heads < 1 || d->heads % d->kv_heads || hd % 2 || d->window < 0 || tokens < 1 || tokens > d->tokens ||
        (d->form != FORM_GATED && d->form != FORM_GATED_RELU_UP && d->form != FORM_GATED_SILU &&
         d->form != FORM_UP) ||
        (d->layer_norm && (!w->attn_norm_bias || !w->ffn_norm_bias)) || !matrix_fits(&w->q, heads, e) ||
        !matrix_fits(&w->k, kv, e) || !matrix_fits(&w->v, kv, e) || !matrix_fits(&w->o, e, heads))
        return -1;
    if (d->experts) {
        /* A mixture: SwiGLU experts after attention, and a shared expert where f > 0, whose down is [E, f]. */
        const stacks *m = &w->experts;
        int64_t ef = d->expert_ffn;
        if (d->used < 1 || d->used > d->experts || d->form != FORM_GATED_SILU || d->sparse || d->parallel ||
            !w->router || !stacks_fit(m) || m->experts != d->experts || m->f != ef || m->n != e ||
            d->used * ef + f > d->widest || ((quantized(m->down_type) || (f && quantized(w->down.type))) && ef % QK) ||
            (f && (!w->shared_gate || !matrix_fits(&w->gate, f, e) || !matrix_fits(&w->up, f, e) ||
                   !matrix_fits(&w->down, e, f))))
            return -1;
    } else if ((d->form != FORM_UP && !matrix_fits(&w->gate, f, e)) || !matrix_fits(&w->up, f, e) ||
               !(d->down_rows ? matrix_fits(&w->down, f, e) : matrix_fits(&w->down, e, f))) {
        return -1;
    }
    int64_t rank = w->fc1.rows;
    if (d->sparse && (!d->down_rows || rank < 1 || rank > d->predictor || !matrix_fits(&w->fc1, rank, e) ||
                      !matrix_fits(&w->fc2, f, rank)))
        return -1;
    if (e > d->widest || f > d->widest || heads > d->widest || (d->sparse && rank > d->widest)) return -1;
    for (int i = 0; i < 2; i++) {
        int type = i ? d->v_type : d->k_type;
        if ((type != CACHE_F32 && type != CACHE_F16 && type != CACHE_Q8_0) || (type == CACHE_Q8_0 && hd % QK))
            return -1;
    }
    if (w->pos_cache && (!w->mass_cache || d->kept < 1 || d->kept > d->ctx)) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        if (pos[t] < 0 || pos[t] >= d->ctx || slot[t] < 0 || slot[t] >= slots) return -3;
        /* Tokens of one slot need rows of their own, and the window cache's step takes one token per slot. */
        for (int64_t u = 0; u < t; u++)
            if (slot[u] == slot[t] && (w->pos_cache || pos[u] == pos[t])) return -3;
    }
    /* A mixture reads each token's experts' rows and the shared expert's. */
    int64_t count = d->experts ? tokens * d->used * d->expert_ffn + f : f;
    int held = d->parallel || (d->experts && f);
    /* One quantized input serves every quantized matrix that reads it; F16 rows read the float input. */
    int qkv_type = quantized(w->q.type) ? w->q.type : quantized(w->k.type) ? w->k.type : w->v.type;
    /* A gated form's first product is the gate's, relu(up)'s is up's: a neuron fires where it passes. */
    int gated = d->form != FORM_UP;
    const matrix *first = gated ? &w->gate : &w->up;
    int ffn_type = quantized(first->type) ? first->type : w->up.type;
#pragma omp parallel num_threads(threads)
    {
        q8_act a;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) norm(d, h + t * e, w->attn_norm, w->attn_norm_bias, s->x + t * e);
        quantize_input(qkv_type, s->x, tokens, e, s, &a);
        product(&w->q, s->x, &a, tokens, s->q);
        product(&w->k, s->x, &a, tokens, s->k);
        product(&w->v, s->x, &a, tokens, s->v);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            float *q = s->q + t * heads, *k = s->k + t * kv, *v = s->v + t * kv;
            add_bias(q, w->q_bias, heads);
            add_bias(k, w->k_bias, kv);
            add_bias(v, w->v_bias, kv);
            head_norm(q, d->heads, hd, w->q_norm, d->eps);
            head_norm(k, d->kv_heads, hd, w->k_norm, d->eps);
            if (cos) {
                rope(q, d->heads, hd, cos + t * hd / 2, sin + t * hd / 2, d->rope_neox);
                rope(k, d->kv_heads, hd, cos + t * hd / 2, sin + t * hd / 2, d->rope_neox);
            }
            /* A window cache stores the row where attention leaves room for it (attend_window). */
            for (int64_t j = 0; j < (w->pos_cache ? 0 : d->kv_heads); j++) {
                int64_t row = (slot[t] * d->kv_heads + j) * d->ctx + pos[t];
                cache_store(d->k_type, hd, (uint8_t *)w->k_cache + row * cache_row_bytes(d->k_type, hd), k + j * hd);
                cache_store(d->v_type, hd, (uint8_t *)w->v_cache + row * cache_row_bytes(d->v_type, hd), v + j * hd);
            }
        }
        if (w->pos_cache)
            attend_window(d, w, s, tokens, pos, slot);
        else
            attend(d, w, s, tokens, pos, slot);
        quantize_input(w->o.type, s->att, tokens, heads, s, &a);
        product(&w->o, s->att, &a, tokens, s->out);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            add_bias(s->out + t * e, w->o_bias, e);
            /* A parallel block's FFN reads the layer's input too: attention's output waits to be added with it. */
            if (d->parallel)
                memcpy(s->held + t * e, s->out + t * e, (size_t)e * sizeof(float));
            else
                for (int64_t i = 0; i < e; i++) h[t * e + i] += s->out[t * e + i];
            norm(d, h + t * e, w->ffn_norm, w->ffn_norm_bias, s->x + t * e);
        }
        if (d->experts) {
            moe_ffn(d, w, s, tokens, &a);
        } else if (d->sparse) {
            /* The predictor reads the residual h (the layer's input, in a parallel block), not the normalised
             * input; its scores land in g [tokens, F], and become 1 where the neuron is selected. */
            quantize_input(w->fc1.type, h, tokens, e, s, &a);
            product(&w->fc1, h, &a, tokens, s->pred);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < tokens * rank; i++) s->pred[i] = s->pred[i] > 0.0f ? s->pred[i] : 0.0f;
            quantize_input(w->fc2.type, s->pred, tokens, rank, s, &a);
            product(&w->fc2, s->pred, &a, tokens, s->g);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < tokens * f; i++) s->g[i] = s->g[i] >= d->threshold ? 1.0f : 0.0f;
#pragma omp single
            count = select_union(s->g, tokens, f, s->ids);
            quantize_input(ffn_type, s->x, tokens, e, s, &a);
            /* g [tokens, count]: 1 where the token selected the neuron, then its activation (0: nothing to add). */
            gate_up_of_selected(d, w, s, &a, tokens, count);
            add_weighted_rows(w->down.data, w->down.stride, w->down.type, s->ids, count, s->g, tokens, e, s->out);
        } else {
            quantize_input(ffn_type, s->x, tokens, e, s, &a);
            product(first, s->x, &a, tokens, s->g);
            /* Every neuron whose |act(gate)| exceeds the layer's threshold: relu(gate) * up is 0 wherever the gate
             * does not fire, whatever up is, so with threshold 0 the sum is the dense one exactly and a ReLU model
             * reads a fraction of up; a calibrated SwiGLU model skips the up rows of its quiet neurons. The firing
             * neurons are listed first (ids, their activations packed into g), so that each up row read ahead is
             * one that will be used. */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < tokens * f; i++) {
                float g = gate_act(d->form, s->g[i] + (w->up_bias ? w->up_bias[i % f] : 0.0f));
                s->g[i] = fabsf(g) > w->gate_threshold ? g : 0.0f;
            }
#pragma omp single
            count = select_union(s->g, tokens, f, s->ids);
            /* relu(up) is the activation itself: nothing more to compute. */
            if (gated) up_of_selected(d, w, s, &a, tokens, count);
            if (d->down_rows) {
                add_weighted_rows(w->down.data, w->down.stride, w->down.type, s->ids, count, s->g, tokens, e, s->out);
            } else {
#pragma omp single
                unpack_union(s->g, tokens, f, s->ids, count);
                quantize_input(w->down.type, s->g, tokens, f, s, &a);
                product(&w->down, s->g, &a, tokens, s->out);
            }
        }
        /* add_weighted_rows ends without a barrier; every thread's slice of out must be in. */
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tokens * e; i++)
            h[i] += s->out[i] + (held ? s->held[i] : 0.0f) + (w->down_bias ? w->down_bias[i % e] : 0.0f);
    }
    return count;
}

/* The output head for the tokens of h [tokens, E] that `rows` lists (n of them; NULL: every token, in order): the
 * final norm (RMSNorm, or LayerNorm with `bias`) with the weights w, then logits [n, m's rows] = the normalised rows
 * . m's rows, where torch took six operator calls and the product's. Returns 0, or -1 (nothing written) where m
 * does not fit the dimensions or the scratch, or a row is not one of the tokens. */
static int64_t decode_head(const matrix *m, const float *w, const float *bias, const dims *d, const scratch *s,
                           const float *h, int64_t tokens, const int64_t *rows, int64_t n, float *logits,
                           int threads) {
    int64_t e = d->hidden;
    if (n < 1 || n > d->tokens || e > d->widest || (d->layer_norm && !bias) || !matrix_fits(m, m->rows, e))
        return -1;
    for (int64_t j = 0; rows && j < n; j++)
        if (rows[j] < 0 || rows[j] >= tokens) return -1;
#pragma omp parallel num_threads(threads)
    {
        q8_act a;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) norm(d, h + (rows ? rows[j] : j) * e, w, bias, s->x + j * e);
        quantize_input(m->type, s->x, n, e, s, &a);
        product(m, s->x, &a, n, logits);
    }
    return 0;
}

/* One forward call natively (qinfer_decode_step): where each layer's part of the caches is, what each layer's FFN
 * reads, and the head. */
typedef struct {
    uint8_t *k_cache, *v_cache;   /* layer 0's block of K and V; layer i's is i strides on */
    int64_t k_stride, v_stride;   /* bytes from one layer's block to the next */
    int32_t *pos_cache;           /* a window cache's layer 0 rows' positions and masses (NULL: the full cache) */
    float *mass_cache;
    int64_t pos_stride, mass_stride; /* elements from one layer's to the next */
    const float *freq;            /* rope's head_dim / 2 frequencies (NULL: the family has no rope) */
    const int32_t *sparse;        /* per layer, dims.sparse for it (NULL: dims.sparse for every layer) */
    int64_t *read;                /* per layer, out: the neurons whose rows it read */
    const matrix *output;         /* the head's rows (NULL: no head; the caller's reads h) */
    const float *norm, *norm_bias; /* the final norm's weights and a LayerNorm's bias */
    const int64_t *rows;          /* the tokens whose logits are asked for, n_rows of them (NULL: every token) */
    int64_t n_rows;
    float *logits;                /* [n_rows, output rows] */
    /* Greedy steps in a row (steps > 1, every token's logits asked for): each step's input rows are looked up in
     * the embedding table, its tokens `ids` first, then each step's argmax, which `next` [steps, tokens] gets (-1
     * where the logits hold NaN or +inf, or nothing finite). The steps end after the first that gives a token of
     * `ends` (n_ends of them), -1, or a token outside the table, or once another thread sets `*stop` (a server's
     * new request, which would otherwise wait for every step of the call). */
    int64_t steps;
    const uint8_t *embed;         /* [embed_rows, E] rows of float (embed_half 0) or f16 (1), embed_stride bytes apart */
    int64_t embed_stride, embed_rows;
    int32_t embed_half;
    const int64_t *ids;
    const int64_t *ends;
    int64_t n_ends;
    int64_t *next;
    const int32_t *stop;          /* NULL: nothing ends the steps from outside */
} call;

/* The argmax of n logits, the first of equal ones, or -1 where they hold a NaN or +inf or nothing finite: what
 * greedy decoding in torch takes (qinfer/runtime/engine/sampling.py's greedy_rows). */
static int64_t top_token(const float *x, int64_t n) {
    int64_t best = 0;
    float top = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(x[i])) return -1;
        if (x[i] > top) top = x[i], best = i;
    }
    return isfinite(top) ? best : -1;
}

/* Whether token `id` ends the steps: -1, a token of c's ends, or one the table has no row for. */
static int ends_steps(const call *c, int64_t id) {
    if (id < 0 || id >= c->embed_rows) return 1;
    for (int64_t i = 0; i < c->n_ends; i++)
        if (c->ends[i] == id) return 1;
    return 0;
}

static void embed_rows(const call *c, const int64_t *ids, int64_t tokens, int64_t e, float *h) {
    for (int64_t t = 0; t < tokens; t++) {
        const uint8_t *row = c->embed + ids[t] * c->embed_stride;
        if (c->embed_half)
            for (int64_t i = 0; i < e; i++) h[t * e + i] = half_to_float(((const uint16_t *)row)[i]);
        else
            memcpy(h + t * e, row, (size_t)e * sizeof(float));
    }
}

/* Every layer in turn for the tokens h [tokens, E] at positions pos of their slots (decode_layer's
 * arguments), then the head where c asks for one: one call a step, where one per layer and the head's, with rope's
 * tables made in torch, took as long as the layers of a small model. Rope's angle is the float product of the
 * position and the frequency, as the torch path makes it (model/rope.py). With c->steps > 1, that many greedy steps
 * at most, each at the next positions, as c describes: h, the logits and the scratch hold the last one's. Returns
 * the steps taken (1 without c->steps), a layer's failure (decode_layer's codes; the layers before it ran),
 * -1 where the head or the steps' description does not fit, or -2 where memory could not be allocated. */
int64_t qinfer_decode_step(const layer *layers, int64_t n_layers, const call *c, const dims *d,
                           const scratch *s, float *h, int64_t tokens, const int64_t *pos, const int64_t *slot,
                           int64_t slots, int threads) {
    int64_t half = d->head_dim / 2, steps = c->steps > 1 ? c->steps : 1;
    if (tokens < 1 || (steps > 1 && (!c->output || c->rows || c->n_rows != tokens || !c->embed || !c->ids ||
                                     !c->next || c->output->rows < 1)))
        return -1;
    for (int64_t t = 0; steps > 1 && t < tokens; t++)
        if (c->ids[t] < 0 || c->ids[t] >= c->embed_rows) return -1;
    /* The positions, then rope's cos and sin tables. */
    int64_t *at = malloc((size_t)tokens * sizeof(int64_t) + (size_t)(2 * tokens * half) * sizeof(float));
    if (!at) return -2;
    memcpy(at, pos, (size_t)tokens * sizeof(int64_t));
    float *cos = c->freq ? (float *)(at + tokens) : NULL, *sin = cos ? cos + tokens * half : NULL;
    int64_t status = 0, taken = 0;
    while (taken < steps && status >= 0) {
        if (steps > 1) embed_rows(c, taken ? c->next + (taken - 1) * tokens : c->ids, tokens, d->hidden, h);
        for (int64_t t = 0; cos && t < tokens; t++)
            for (int64_t j = 0; j < half; j++) {
                float angle = (float)at[t] * c->freq[j];
                cos[t * half + j] = cosf(angle);
                sin[t * half + j] = sinf(angle);
            }
        for (int64_t i = 0; i < n_layers && status >= 0; i++) {
            layer w = layers[i];
            dims di = *d;
            w.k_cache = c->k_cache + i * c->k_stride;
            w.v_cache = c->v_cache + i * c->v_stride;
            w.pos_cache = c->pos_cache ? c->pos_cache + i * c->pos_stride : NULL;
            w.mass_cache = c->mass_cache ? c->mass_cache + i * c->mass_stride : NULL;
            if (c->sparse) di.sparse = c->sparse[i];
            status = decode_layer(&w, &di, s, h, tokens, at, slot, slots, cos, sin, threads);
            if (status >= 0 && c->read) c->read[i] = status;
        }
        if (status >= 0 && c->output)
            status = decode_head(c->output, c->norm, c->norm_bias, d, s, h, tokens, c->rows, c->n_rows, c->logits,
                                 threads);
        if (status < 0) break;
        taken++;
        if (steps == 1) break;
        int last = taken == steps;
        for (int64_t t = 0; t < tokens; t++) {
            int64_t id = top_token(c->logits + t * c->output->rows, c->output->rows);
            c->next[(taken - 1) * tokens + t] = id;
            last |= ends_steps(c, id);
            at[t]++;
        }
        if (last || (c->stop && __atomic_load_n(c->stop, __ATOMIC_RELAXED))) break;
    }
    free(at);
    return status < 0 ? status : taken;
}

/* Element counts of the scratch buffers, in the struct's order, for the dimensions d (ctx and tokens included). */
void qinfer_scratch_sizes(const dims *d, int64_t out[17]) {
    int64_t heads = d->heads * d->head_dim, kv = d->kv_heads * d->head_dim, blocks = d->widest / QK + 1;
    int64_t b = d->tokens, rank = d->predictor > 0 ? d->predictor : 1;
    int64_t g = d->experts ? d->used * d->expert_ffn + 2 * d->ffn : d->ffn;
    int64_t sizes[17] = {b * d->hidden, b * heads, b * kv, b * kv, b * heads, b * d->heads * (d->ctx + 1), b * rank,
                         b * g, b * d->hidden, b * d->hidden, b * d->experts, b * d->used, b * d->used, d->ffn,
                         b * d->widest, b * blocks, b * blocks};
    memcpy(out, sizes, sizeof sizes);
}

/* The facts the Python side mirrors (qinfer/runtime/kernels/abi.py), each under its C name: codes, block layouts,
 * the token block, each structure's size and field offsets, the scratch element sizes. The loader compares them by
 * name, so a fact changed, added or dropped on one side alone is caught at load. */
typedef struct {
    const char *name;
    int64_t value;
} abi_fact;

#define FACT(n) {#n, (int64_t)(n)}
#define SIZE(s) {"sizeof " #s, (int64_t)sizeof(s)}
#define FIELD(s, f) {#s "." #f, (int64_t)offsetof(s, f)}
#define ELEMENT(f) {"scratch." #f " element", (int64_t)sizeof(*((scratch *)0)->f)}

static const abi_fact abi_facts[] = {
    FACT(F16), FACT(Q4_0), FACT(Q8_0), FACT(QK), FACT(Q4_0_BYTES), FACT(Q8_0_BYTES),
    FACT(FORM_GATED), FACT(FORM_GATED_RELU_UP), FACT(FORM_UP), FACT(FORM_GATED_SILU), FACT(TOKEN_BLOCK),
    FACT(CACHE_F32), FACT(CACHE_F16), FACT(CACHE_Q8_0), FACT(EMPTY_ROW),
    SIZE(matrix), FIELD(matrix, data), FIELD(matrix, stride), FIELD(matrix, type), FIELD(matrix, rows),
    FIELD(matrix, cols),
    SIZE(stacks), FIELD(stacks, gate), FIELD(stacks, up), FIELD(stacks, down), FIELD(stacks, gate_expert),
    FIELD(stacks, gate_row), FIELD(stacks, up_expert), FIELD(stacks, up_row), FIELD(stacks, down_expert),
    FIELD(stacks, down_row), FIELD(stacks, gate_type), FIELD(stacks, up_type), FIELD(stacks, down_type),
    FIELD(stacks, experts), FIELD(stacks, f), FIELD(stacks, n),
    SIZE(layer), FIELD(layer, q), FIELD(layer, k), FIELD(layer, v), FIELD(layer, o), FIELD(layer, gate),
    FIELD(layer, up), FIELD(layer, down), FIELD(layer, fc1), FIELD(layer, fc2), FIELD(layer, experts),
    FIELD(layer, router), FIELD(layer, shared_gate), FIELD(layer, q_norm), FIELD(layer, k_norm), FIELD(layer, attn_norm),
    FIELD(layer, ffn_norm), FIELD(layer, attn_norm_bias), FIELD(layer, ffn_norm_bias), FIELD(layer, q_bias),
    FIELD(layer, k_bias), FIELD(layer, v_bias), FIELD(layer, o_bias), FIELD(layer, up_bias), FIELD(layer, down_bias),
    FIELD(layer, k_cache), FIELD(layer, v_cache), FIELD(layer, pos_cache), FIELD(layer, mass_cache),
    FIELD(layer, gate_threshold),
    SIZE(dims), FIELD(dims, hidden), FIELD(dims, heads), FIELD(dims, kv_heads), FIELD(dims, head_dim),
    FIELD(dims, ffn), FIELD(dims, ctx), FIELD(dims, predictor), FIELD(dims, widest), FIELD(dims, window),
    FIELD(dims, tokens), FIELD(dims, kept), FIELD(dims, sinks), FIELD(dims, recent), FIELD(dims, experts),
    FIELD(dims, used), FIELD(dims, expert_ffn), FIELD(dims, norm_top_k),
    FIELD(dims, eps), FIELD(dims, threshold), FIELD(dims, decay), FIELD(dims, form), FIELD(dims, sparse), FIELD(dims, down_rows),
    FIELD(dims, rope_neox), FIELD(dims, k_type), FIELD(dims, v_type), FIELD(dims, layer_norm), FIELD(dims, parallel),
    SIZE(call), FIELD(call, k_cache), FIELD(call, v_cache), FIELD(call, k_stride),
    FIELD(call, v_stride), FIELD(call, pos_cache), FIELD(call, mass_cache), FIELD(call, pos_stride),
    FIELD(call, mass_stride), FIELD(call, freq), FIELD(call, sparse), FIELD(call, read),
    FIELD(call, output), FIELD(call, norm), FIELD(call, norm_bias), FIELD(call, rows),
    FIELD(call, n_rows), FIELD(call, logits), FIELD(call, steps), FIELD(call, embed), FIELD(call, embed_stride),
    FIELD(call, embed_rows), FIELD(call, embed_half), FIELD(call, ids), FIELD(call, ends), FIELD(call, n_ends),
    FIELD(call, next), FIELD(call, stop),
    SIZE(scratch), FIELD(scratch, x), FIELD(scratch, q), FIELD(scratch, k), FIELD(scratch, v),
    FIELD(scratch, att), FIELD(scratch, scores), FIELD(scratch, pred), FIELD(scratch, g), FIELD(scratch, out),
    FIELD(scratch, held), FIELD(scratch, probs), FIELD(scratch, weights), FIELD(scratch, chosen),
    FIELD(scratch, ids), FIELD(scratch, xq), FIELD(scratch, xd), FIELD(scratch, xs),
    ELEMENT(x), ELEMENT(q), ELEMENT(k), ELEMENT(v), ELEMENT(att), ELEMENT(scores), ELEMENT(pred), ELEMENT(g),
    ELEMENT(out), ELEMENT(held), ELEMENT(probs), ELEMENT(weights), ELEMENT(chosen), ELEMENT(ids), ELEMENT(xq),
    ELEMENT(xd), ELEMENT(xs),
};

/* The facts, and how many there are. */
int64_t qinfer_abi(const abi_fact **out) {
    *out = abi_facts;
    return (int64_t)(sizeof abi_facts / sizeof *abi_facts);
}
