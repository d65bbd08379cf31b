/* One decode step of one LLaMA-shaped layer (llama, bamboo, qwen2) for one token, in one native call: attention
 * norm, the q/k/v products (and their biases), rope, the KV-cache write, attention over the cached positions (the
 * last `window` of them where the model slides one), the output product and residual, the FFN norm, the predictor
 * (fc1, relu, fc2, threshold), the sparse or dense FFN, and its residual.
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
 * layer descriptions; qinfer_decode_layer checks again that the matrices fit the dimensions before reading.
 */
#include <stddef.h>

#include "row_kernels.c"

typedef struct {
    const uint8_t *data;
    int64_t stride; /* bytes between rows */
    int32_t type;   /* F16, Q4_0, Q8_0 */
    int64_t rows, cols;
} matrix;

typedef struct {
    matrix q, k, v, o, gate, up, down, fc1, fc2;
    const float *attn_norm, *ffn_norm;
    const float *q_bias, *k_bias, *v_bias; /* NULL where the family has none */
    float *k_cache, *v_cache;              /* this layer's and slot's [kv_heads, ctx, head_dim] */
    float gate_threshold;                  /* without a predictor: a neuron fires where |act(gate)| exceeds it */
} layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, ffn, ctx;
    int64_t predictor; /* the largest predictor rank of any layer (each layer's is its fc1's rows) */
    int64_t widest;    /* floats the quantized-input scratch holds: max(E, F, predictor) */
    int64_t window;    /* a token attends to its last `window` positions; 0: to all of them */
    float eps, threshold;
    int32_t form;       /* FORM_GATED, FORM_GATED_RELU_UP or FORM_GATED_SILU */
    int32_t sparse;     /* 1: the neurons the predictor selects; 0: every neuron whose gate passes its threshold */
    int32_t down_rows;  /* 1: down holds neuron rows [F, E] (PowerInfer); 0: a matrix [E, F] (dense GGUF) */
    int32_t rope_neox;  /* 1: rope rotates x[i] against x[i + d/2]; 0: adjacent pairs */
} dims;

/* Scratch, made once by the caller in the sizes qinfer_scratch_sizes gives. */
typedef struct {
    float *x;      /* [E] the normalised input */
    float *q;      /* [heads * head_dim] */
    float *k, *v;  /* [kv_heads * head_dim] */
    float *att;    /* [heads * head_dim] */
    float *scores; /* [heads * ctx] */
    float *pred;   /* [predictor] */
    float *g;      /* [F] */
    float *out;    /* [E] */
    int64_t *ids;  /* [F] */
    uint8_t *fire; /* [F] */
    int8_t *xq;    /* [widest] */
    float *xd;     /* [widest / 32] */
    int32_t *xs;   /* [widest / 32] */
} scratch;

static int matrix_fits(const matrix *m, int64_t rows, int64_t cols) {
    return m->data && m->rows == rows && fits(m->type, m->stride, m->rows, m->cols, cols, NULL, rows);
}

/* x [n] quantized for the products over m (nothing to do for F16 rows), by one thread; the barrier at the end of
 * `single` publishes it. Every thread takes the same branch, as worksharing requires. */
static void quantize_input(int type, const float *x, int64_t n, const scratch *s, q8_act *a) {
    a->q = s->xq;
    a->d = s->xd;
    a->sum = s->xs;
    if (type == F16) return;
#pragma omp single
    q8_quantize_blocks(x, n / QK, a);
}

/* out[r] = row r of m . x, rows shared among the threads (inside the parallel region). */
static void product(const matrix *m, const float *x, const q8_act *a, float *out) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m->rows; r++) {
        const uint8_t *row = m->data + r * m->stride, *next = m->data + (r + 1 < m->rows ? r + 1 : r) * m->stride;
        out[r] = dot_row(m->type, row, next, x, a, 0, m->cols);
    }
}

static void rms_norm(const float *h, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += h[i] * h[i];
    float scale = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = h[i] * scale * w[i];
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

/* out += a * v over n floats. */
static void axpy_f32(float *out, float a, const float *v, int64_t n) {
    int64_t i = 0;
#if LANES > 1
    vec va = vset(a);
    for (; i + LANES <= n; i += LANES) vstore(out + i, vfma(va, vload(v + i), vload(out + i)));
#endif
    for (; i < n; i++) out[i] += a * v[i];
}

/* Head h attends its kv head's positions 0..pos; the heads are shared among the threads. */
static void attend(const dims *d, const layer *w, const scratch *s, int64_t pos) {
    int64_t hd = d->head_dim, group = d->heads / d->kv_heads;
    int64_t first = d->window > 0 && pos - d->window + 1 > 0 ? pos - d->window + 1 : 0;
    float scale = 1.0f / sqrtf((float)hd);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < d->heads; h++) {
        const float *q = s->q + h * hd, *kc = w->k_cache + h / group * d->ctx * hd;
        const float *vc = w->v_cache + h / group * d->ctx * hd;
        float *sc = s->scores + h * d->ctx, *o = s->att + h * hd, top = -INFINITY, total = 0.0f;
        for (int64_t p = first; p <= pos; p++) {
            sc[p] = dot_f32(q, kc + p * hd, hd) * scale;
            top = fmaxf(top, sc[p]);
        }
        for (int64_t p = first; p <= pos; p++) total += sc[p] = expf(sc[p] - top);
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int64_t p = first; p <= pos; p++) axpy_f32(o, sc[p] / total, vc + p * hd, hd);
    }
}

static int quantized(int type) { return type != F16; }

/* h [E] += this layer's attention, then += its FFN, for the token at `pos`, whose keys and values land in the
 * cache. cos/sin hold head_dim / 2 values for this position. Returns -1 (nothing read or written) where a matrix
 * does not fit the dimensions or the scratch, -3 where the position is outside the cache. */
int qinfer_decode_layer(const layer *w, const dims *d, const scratch *s, float *h, int64_t pos, const float *cos,
                        const float *sin, int threads) {
    int64_t e = d->hidden, f = d->ffn, hd = d->head_dim, kv = d->kv_heads * hd;
    if (d->kv_heads < 1 || d->heads % d->kv_heads || hd % 2 || d->window < 0 ||
        (d->form != FORM_GATED && d->form != FORM_GATED_RELU_UP && d->form != FORM_GATED_SILU) ||
        !matrix_fits(&w->q, d->heads * hd, e) || !matrix_fits(&w->k, kv, e) || !matrix_fits(&w->v, kv, e) ||
        !matrix_fits(&w->o, e, d->heads * hd) || !matrix_fits(&w->gate, f, e) || !matrix_fits(&w->up, f, e) ||
        !(d->down_rows ? matrix_fits(&w->down, f, e) : matrix_fits(&w->down, e, f)))
        return -1;
    int64_t rank = w->fc1.rows;
    if (d->sparse && (!d->down_rows || rank < 1 || rank > d->predictor || !matrix_fits(&w->fc1, rank, e) ||
                      !matrix_fits(&w->fc2, f, rank)))
        return -1;
    if (e > d->widest || f > d->widest || (d->sparse && rank > d->widest)) return -1;
    if (pos < 0 || pos >= d->ctx) return -3;
    int64_t count = f;
    /* One quantized input serves every quantized matrix that reads it; F16 rows read the float input. */
    int qkv_type = quantized(w->q.type) ? w->q.type : quantized(w->k.type) ? w->k.type : w->v.type;
    int ffn_type = quantized(w->gate.type) ? w->gate.type : w->up.type;
#pragma omp parallel num_threads(threads)
    {
        q8_act a;
#pragma omp single
        rms_norm(h, w->attn_norm, e, d->eps, s->x);
        quantize_input(qkv_type, s->x, e, s, &a);
        product(&w->q, s->x, &a, s->q);
        product(&w->k, s->x, &a, s->k);
        product(&w->v, s->x, &a, s->v);
#pragma omp single
        {
            add_bias(s->q, w->q_bias, d->heads * hd);
            add_bias(s->k, w->k_bias, kv);
            add_bias(s->v, w->v_bias, kv);
            rope(s->q, d->heads, hd, cos, sin, d->rope_neox);
            rope(s->k, d->kv_heads, hd, cos, sin, d->rope_neox);
            for (int64_t j = 0; j < d->kv_heads; j++) {
                memcpy(w->k_cache + (j * d->ctx + pos) * hd, s->k + j * hd, (size_t)hd * sizeof(float));
                memcpy(w->v_cache + (j * d->ctx + pos) * hd, s->v + j * hd, (size_t)hd * sizeof(float));
            }
        }
        attend(d, w, s, pos);
        quantize_input(w->o.type, s->att, d->heads * hd, s, &a);
        product(&w->o, s->att, &a, s->out);
#pragma omp single
        {
            for (int64_t i = 0; i < e; i++) h[i] += s->out[i];
            rms_norm(h, w->ffn_norm, e, d->eps, s->x);
        }
        if (d->sparse) {
            /* The predictor reads the residual h, not the normalised input. */
            quantize_input(w->fc1.type, h, e, s, &a);
            product(&w->fc1, h, &a, s->pred);
#pragma omp single
            for (int64_t i = 0; i < rank; i++) s->pred[i] = s->pred[i] > 0.0f ? s->pred[i] : 0.0f;
            quantize_input(w->fc2.type, s->pred, rank, s, &a);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < f; r++) {
                const uint8_t *row = w->fc2.data + r * w->fc2.stride;
                s->fire[r] = dot_row(w->fc2.type, row, row, s->pred, &a, 0, rank) >= d->threshold;
            }
#pragma omp single
            {
                count = 0;
                for (int64_t r = 0; r < f; r++)
                    if (s->fire[r]) s->ids[count++] = r;
            }
            quantize_input(ffn_type, s->x, e, s, &a);
#pragma omp for schedule(static)
            for (int64_t j = 0; j < count; j++) {
                int64_t id = s->ids[j], next = s->ids[j + 1 < count ? j + 1 : j];
                const uint8_t *up_row = w->up.data + id * w->up.stride;
                /* Read ahead as qinfer_sparse_ffn does: this neuron's up row, then the next one's gate row. */
                const uint8_t *gate_row = w->gate.data + id * w->gate.stride;
                float g = gate_act(d->form, dot_row(w->gate.type, gate_row, up_row, s->x, &a, 0, e));
                s->g[j] = 0.0f;
                /* A neuron whose gate does not fire contributes nothing: its up and down rows are not read. */
                if (g == 0.0f) continue;
                float u = dot_row(w->up.type, up_row, w->gate.data + next * w->gate.stride, s->x, &a, 0, e);
                s->g[j] = g * (d->form == FORM_GATED_RELU_UP && u < 0.0f ? 0.0f : u);
            }
            add_weighted_rows(w->down.data, w->down.stride, w->down.type, s->ids, count, s->g, 1, e, s->out);
        } else {
            quantize_input(ffn_type, s->x, e, s, &a);
            product(&w->gate, s->x, &a, s->g);
            /* Every neuron whose |act(gate)| exceeds the layer's threshold: relu(gate) * up is 0 wherever the gate
             * does not fire, whatever up is, so with threshold 0 the sum is the dense one exactly and a ReLU model
             * reads a fraction of up; a calibrated SwiGLU model skips the up rows of its quiet neurons. The firing
             * neurons are listed first (ids, their activations packed into the front of g), so that each up row
             * read ahead is one that will be used. */
#pragma omp single
            {
                count = 0;
                for (int64_t j = 0; j < f; j++) {
                    float g = gate_act(d->form, s->g[j]);
                    if (!(fabsf(g) > w->gate_threshold)) continue;
                    s->ids[count] = j;
                    s->g[count++] = g; /* count <= j: g[j] is read before anything is written there */
                }
            }
#pragma omp for schedule(static)
            for (int64_t k = 0; k < count; k++) {
                const uint8_t *row = w->up.data + s->ids[k] * w->up.stride;
                const uint8_t *next = w->up.data + s->ids[k + 1 < count ? k + 1 : k] * w->up.stride;
                float u = dot_row(w->up.type, row, next, s->x, &a, 0, e);
                s->g[k] *= d->form == FORM_GATED_RELU_UP && u < 0.0f ? 0.0f : u;
            }
            if (d->down_rows) {
                add_weighted_rows(w->down.data, w->down.stride, w->down.type, s->ids, count, s->g, 1, e, s->out);
            } else {
#pragma omp single
                {
                    /* Back to one activation per neuron, from the last: ids[k] >= k, so each packed value is read
                     * before its place is overwritten. */
                    int64_t end = f;
                    for (int64_t k = count - 1; k >= 0; k--) {
                        int64_t id = s->ids[k];
                        float v = s->g[k];
                        for (int64_t j = id + 1; j < end; j++) s->g[j] = 0.0f;
                        s->g[id] = v;
                        end = id;
                    }
                    for (int64_t j = 0; j < end; j++) s->g[j] = 0.0f;
                }
                quantize_input(w->down.type, s->g, f, s, &a);
                product(&w->down, s->g, &a, s->out);
            }
        }
        /* add_weighted_rows ends without a barrier; every thread's slice of out must be in. */
#pragma omp barrier
#pragma omp single
        for (int64_t i = 0; i < e; i++) h[i] += s->out[i];
    }
    return 0;
}

/* Element counts of the scratch buffers, in the struct's order, for the dimensions d (ctx included). */
void qinfer_scratch_sizes(const dims *d, int64_t out[14]) {
    int64_t heads = d->heads * d->head_dim, kv = d->kv_heads * d->head_dim, blocks = d->widest / QK + 1;
    int64_t sizes[14] = {d->hidden, heads, kv, kv, heads, d->heads * d->ctx, d->predictor > 0 ? d->predictor : 1,
                         d->ffn, d->hidden, d->ffn, d->ffn, d->widest, blocks, blocks};
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
    SIZE(matrix), FIELD(matrix, data), FIELD(matrix, stride), FIELD(matrix, type), FIELD(matrix, rows),
    FIELD(matrix, cols),
    SIZE(layer), FIELD(layer, q), FIELD(layer, k), FIELD(layer, v), FIELD(layer, o), FIELD(layer, gate),
    FIELD(layer, up), FIELD(layer, down), FIELD(layer, fc1), FIELD(layer, fc2), FIELD(layer, attn_norm),
    FIELD(layer, ffn_norm), FIELD(layer, q_bias), FIELD(layer, k_bias), FIELD(layer, v_bias), FIELD(layer, k_cache),
    FIELD(layer, v_cache), FIELD(layer, gate_threshold),
    SIZE(dims), FIELD(dims, hidden), FIELD(dims, heads), FIELD(dims, kv_heads), FIELD(dims, head_dim),
    FIELD(dims, ffn), FIELD(dims, ctx), FIELD(dims, predictor), FIELD(dims, widest), FIELD(dims, window),
    FIELD(dims, eps), FIELD(dims, threshold), FIELD(dims, form), FIELD(dims, sparse), FIELD(dims, down_rows),
    FIELD(dims, rope_neox),
    SIZE(scratch), FIELD(scratch, x), FIELD(scratch, q), FIELD(scratch, k), FIELD(scratch, v),
    FIELD(scratch, att), FIELD(scratch, scores), FIELD(scratch, pred), FIELD(scratch, g), FIELD(scratch, out),
    FIELD(scratch, ids), FIELD(scratch, fire), FIELD(scratch, xq), FIELD(scratch, xd), FIELD(scratch, xs),
    ELEMENT(x), ELEMENT(q), ELEMENT(k), ELEMENT(v), ELEMENT(att), ELEMENT(scores), ELEMENT(pred), ELEMENT(g),
    ELEMENT(out), ELEMENT(ids), ELEMENT(fire), ELEMENT(xq), ELEMENT(xd), ELEMENT(xs),
};

/* The facts, and how many there are. */
int64_t qinfer_abi(const abi_fact **out) {
    *out = abi_facts;
    return (int64_t)(sizeof abi_facts / sizeof *abi_facts);
}
