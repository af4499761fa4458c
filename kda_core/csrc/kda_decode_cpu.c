/* A KDA layer's token-by-token part on the CPU, fp32, in ONE call: everything between the layer's input GEMM
 * (q|k|v, f_a, b, g_a of kda_core.layer.KDALayer) and its o_proj GEMM, for B rows of T tokens each, reading and
 * writing each row's state in place BY SLOT. kda_core/decode.py loads it and checks it against the torch form.
 *
 * Per token of a live row (kda_core.layer.KDALayer, kda_core.kda._step; Kimi Linear, arXiv:2510.26692):
 *   conv     y_c = sum_j f_j w_cj over [window, this token] (kda_core.conv.short_conv), the window shifted;
 *   SiLU     y / (1 + exp(-y)); q, k L2-normalised per head: x / sqrt(sum x^2 + 1e-6);
 *   gate     f = f_b f_low (+ dt_bias); softplus form g = -exp(A_log) softplus(f) (softplus(x) = x above 20,
 *            else log1p(exp(x)), as ATen's), lower-bound form g = lb sigmoid(exp(A_log) f);
 *   beta     sigmoid(b);
 *   step     S' = S exp(g); u = beta (v - S'^T k); S = S' + k u^T; o = S^T (q scale);
 *   output   per head o / sqrt(mean o^2 + eps) * o_norm * sigmoid(g_b g_low): o_proj's input.
 * The two small GEMMs (f_b, g_b) and every other sum run in one fixed order, each output one fmaf chain over its
 * inputs in index order (as kda_core/csrc/invariant_cpu.c), so a row's bits never depend on the other rows of the
 * call, on B or on T: a token of a verify row is bitwise the same token decoded alone. The transcendentals are
 * this file's exp_f / log_f (Cephes' polynomials, vectorisable) and sqrtf, not ATen's SLEEF forms, so results differ from the torch form by a few ulp; the
 * loader checks them against it within a tolerance (decode.py's TOLERANCE). The state update is a rounded
 * product then a rounded add (this file is built with -ffp-contract=off: no contraction except the explicit
 * fmaf), so folding records (k, u, exp(g)) in torch rebuilds the state bitwise (kda_decode_exp gives the decay).
 *
 * Layouts (elements): token (b, t) of an input at x + (b T + t) sx (raw [C], f_low [RF], b [H], g_low [RG]); the
 * pools rec [S, H, K, V] and conv [S, C, W-1] with slot stride sr / sc and the rest contiguous; slots [B] int64,
 * -1 = pad row: its state is neither read nor written and its outputs are NaN. New states go to the pool in place
 * (out NULL) or to row b of out [B, ...] (row stride so), the pool then only read. Optional per-token outputs
 * (NULL: not written), all contiguous [B T, ...]: q, k, g [H K]; v, u [H V]; beta [H]; states [H K V] (the state
 * after each token). y [B T, H V] is always written.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define L2_EPS 1e-6f

typedef struct {
    int H, K, V, C, W, RF, RG;      /* heads, key dim, value dim, conv channels 2HK + HV, conv width, gate ranks */
    float lower_bound;              /* 0: softplus gate; < 0: the lower-bound gate */
    float rms_eps, scale;
    const float *conv_w;            /* [C, W] */
    const float *f_bt;              /* f_b^T [RF, H K] */
    const float *A_log;             /* [H] */
    const float *dt_bias;           /* [H K] or NULL */
    const float *g_bt;              /* g_b^T [RG, H V] */
    const float *o_norm;            /* [V] */
} KdaWeights;

typedef struct {
    float *q, *k, *v, *g, *beta, *u, *states;   /* optional per-token outputs (NULL: none) */
} KdaAux;

/* exp and log as straight-line fp32 code (Cephes' expf / logf polynomials, within ~1 ulp of libm), so that the
 * compiler vectorises the loops that call them; deterministic (no table, no library call): every call site of the
 * layer and kda_decode_exp get the same bits. */
static inline float bits_to_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned int float_to_bits(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }

static inline float exp_f(float x) {
    const float hi = 88.0f, lo = -87.33654475f;
    float c = x > hi ? hi : (x < lo ? lo : x);                 /* NaN stays NaN */
    float n = floorf(fmaf(c, 1.44269504088896341f, 0.5f));    /* round(c / ln 2) */
    float r = fmaf(n, -0.693359375f, c);                        /* c - n ln 2, in two parts */
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    float e = p * bits_to_float((unsigned int)((int)n + 127) << 23);   /* p 2^n, n in [-126, 127] */
    return x < lo ? 0.0f : (x > hi ? INFINITY : e);
}

/* log(x) for a normal x > 0. */
static inline float log_f(float x) {
    unsigned int i = float_to_bits(x);
    float e = (float)((int)((i >> 23) & 0xff) - 127);
    float m = bits_to_float((i & 0x7fffffu) | 0x3f800000u);    /* x = m 2^e, m in [1, 2) */
    int big = m > 1.41421356f;
    m = big ? 0.5f * m : m;                                     /* m in [0.707, 1.414) */
    e = big ? e + 1.0f : e;
    float f = m - 1.0f, z = f * f;
    float y = 7.0376836292e-2f;
    y = fmaf(y, f, -1.1514610310e-1f);
    y = fmaf(y, f, 1.1676998740e-1f);
    y = fmaf(y, f, -1.2420140846e-1f);
    y = fmaf(y, f, 1.4249322787e-1f);
    y = fmaf(y, f, -1.6668057665e-1f);
    y = fmaf(y, f, 2.0000714765e-1f);
    y = fmaf(y, f, -2.4999993993e-1f);
    y = fmaf(y, f, 3.3333331174e-1f);
    y = y * f * z;
    y = fmaf(e, -2.12194440e-4f, y);
    y = fmaf(-0.5f, z, y);
    return fmaf(e, 0.693359375f, f + y);
}

static inline float sigmoidf_(float x) { return 1.0f / (1.0f + exp_f(-x)); }

/* ATen's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x)); log1p(t) = log(u) t / (u - 1) with
 * u = 1 + t (exact where u rounds to 1: then t), accurate for small t (Kahan's trick). */
static inline float softplusf_(float x) {
    float t = exp_f(x > 20.0f ? 20.0f : x), u = 1.0f + t;
    float l = u == 1.0f ? t : log_f(u) * (t / (u - 1.0f));
    return x > 20.0f ? x : l;
}

/* out[j] = sum_i S[i, j] (w[i] sc) for S [K, V]: one fmaf chain in i order per j, 16 chains at a time in
 * registers (the chains side by side, so each block of 16 is one vector accumulator). sc = 1 leaves w exact. */
static void colsum(int K, int V, const float *restrict S, const float *restrict w, float sc, float *restrict out) {
    int j0 = 0;
    for (; j0 + 16 <= V; j0 += 16) {
        float acc[16] = {0.0f};
        for (int i = 0; i < K; ++i) {
            const float wi = w[i] * sc, *r = S + (long)i * V + j0;
            for (int l = 0; l < 16; ++l) acc[l] = fmaf(r[l], wi, acc[l]);
        }
        for (int l = 0; l < 16; ++l) out[j0 + l] = acc[l];
    }
    for (int j = j0; j < V; ++j) {
        float acc = 0.0f;
        for (int i = 0; i < K; ++i) acc = fmaf(S[(long)i * V + j], w[i] * sc, acc);
        out[j] = acc;
    }
}

/* out[n] = sum_k x[k] w[n, k] from wt = w^T [R, N]: one fmaf chain in k order per n. */
static void gemv(int N, int R, const float *x, const float *wt, float *out) { colsum(R, N, wt, x, 1.0f, out); }

/* x[0..n) *= 1 / sqrt(sum x^2 + eps), the sum one fmaf chain. */
static void l2norm(float *x, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; ++i) s = fmaf(x[i], x[i], s);
    const float r = 1.0f / sqrtf(s + L2_EPS);
    for (int i = 0; i < n; ++i) x[i] = x[i] * r;
}

/* The delta rule's state update of one head: S' = S0 exp(g); u = beta (v - S'^T k); S = S' + k u^T (S may be S0;
 * kv [V + K] scratch). */
static void delta(int K, int V, const float *kh, const float *vh, const float *gh, float bt, const float *S0,
                  float *S, float *kv, float *uh) {
    float *d = kv + V;                                          /* exp(g) [K] */
    for (int i = 0; i < K; ++i) d[i] = exp_f(gh[i]);
    for (int i = 0; i < K; ++i)                                 /* S' = S exp(g) */
        for (int j = 0; j < V; ++j) S[(long)i * V + j] = S0[(long)i * V + j] * d[i];
    colsum(K, V, S, kh, 1.0f, kv);                              /* S'^T k */
    for (int j = 0; j < V; ++j) uh[j] = bt * (vh[j] - kv[j]);
    for (int i = 0; i < K; ++i)                                 /* S = S' + k u^T (rounded product, then add) */
        for (int j = 0; j < V; ++j) S[(long)i * V + j] = S[(long)i * V + j] + kh[i] * uh[j];
}

/* One token of one live row. win: the conv window read ([C, W-1]); wdst: where the shifted window goes (may be
 * win); S0: the state read ([H, K, V]); S: where the new state goes (may be S0). a [C + 2 H K + H V + H] scratch. */
static void token(const KdaWeights *p, const float *raw, const float *flow, const float *bp, const float *glow,
                  const float *win, float *wdst, const float *S0, float *S, float *y, float *scr,
                  float *q_o, float *k_o, float *v_o, float *g_o, float *beta_o, float *u_o) {
    const int H = p->H, K = p->K, V = p->V, C = p->C, W = p->W, W1 = p->W - 1;
    float *a = scr, *g = scr + C, *gate = g + (long)H * K, *kv = gate + (long)H * V;
    const float *cw = p->conv_w;                                 /* conv: per channel one fmaf chain over */
    for (int c = 0; c < C; ++c) a[c] = 0.0f;                     /* [window, this token], the channels side */
    for (int j = 0; j < W1; ++j)                                 /* by side so the loops over c vectorise */
        for (int c = 0; c < C; ++c) a[c] = fmaf(win[(long)c * W1 + j], cw[(long)c * W + j], a[c]);
    for (int c = 0; c < C; ++c) a[c] = fmaf(raw[c], cw[(long)c * W + W1], a[c]);
    for (int c = 0; c < C; ++c) a[c] = a[c] / (1.0f + exp_f(-a[c]));   /* SiLU */
    for (int c = 0; c < C; ++c) {
        float *dc = wdst + (long)c * W1;
        const float *wc = win + (long)c * W1;
        for (int j = 0; j + 1 < W1; ++j) dc[j] = wc[j + 1];      /* in place: reads j + 1 before any write there */
        if (W1 > 0) dc[W1 - 1] = raw[c];
    }
    float *q = a, *k = a + (long)H * K, *v = a + 2L * H * K;
    for (int h = 0; h < 2 * H; ++h) l2norm(a + (long)h * K, K);
    gemv(H * K, p->RF, flow, p->f_bt, g);                        /* forget gate */
    if (p->dt_bias)
        for (long n = 0; n < (long)H * K; ++n) g[n] = g[n] + p->dt_bias[n];
    for (int h = 0; h < H; ++h) {
        const float A = exp_f(p->A_log[h]), lb = p->lower_bound;
        float *gh = g + (long)h * K;
        if (lb < 0.0f)
            for (int i = 0; i < K; ++i) gh[i] = lb * sigmoidf_(A * gh[i]);
        else
            for (int i = 0; i < K; ++i) gh[i] = -A * softplusf_(gh[i]);
    }
    gemv(H * V, p->RG, glow, p->g_bt, gate);                     /* output gate (pre-sigmoid) */
    for (int h = 0; h < H; ++h) {
        const float *qh = q + (long)h * K, *kh = k + (long)h * K, *vh = v + (long)h * V, *gh = g + (long)h * K;
        const float *Sa = S0 + (long)h * K * V;
        float *Sh = S + (long)h * K * V, *yh = y + (long)h * V, *uh = u_o ? u_o + (long)h * V : kv + V + K;
        const float bt = sigmoidf_(bp[h]);
        if (beta_o) beta_o[h] = bt;
        delta(K, V, kh, vh, gh, bt, Sa, Sh, kv, uh);
        colsum(K, V, Sh, qh, p->scale, yh);                     /* o = S^T (q scale) */
        float ss = 0.0f;                                        /* gated RMSNorm */
        for (int j = 0; j < V; ++j) ss = fmaf(yh[j], yh[j], ss);
        const float r = 1.0f / sqrtf(ss / (float)V + p->rms_eps);
        const float *gt = gate + (long)h * V;
        for (int j = 0; j < V; ++j) yh[j] = yh[j] * r * p->o_norm[j] * sigmoidf_(gt[j]);
    }
    for (long i = 0; q_o && i < (long)H * K; ++i) q_o[i] = q[i];
    for (long i = 0; k_o && i < (long)H * K; ++i) k_o[i] = k[i];
    for (long i = 0; v_o && i < (long)H * V; ++i) v_o[i] = v[i];
    for (long i = 0; g_o && i < (long)H * K; ++i) g_o[i] = g[i];
}

static void fill_nan(float *x, long n) {
    for (long i = 0; x && i < n; ++i) x[i] = NAN;
}

/* B rows of T tokens (see the header). Returns 0, -1 for bad sizes, -2 when out of memory. */
int kda_decode_layer(const KdaWeights *p, int B, int T, const float *raw, long sraw, const float *flow, long sflow,
                     const float *bp, long sb, const float *glow, long sglow, float *rec, long sr, float *conv, long sc,
                     const long *slots, float *out_rec, long sor, float *out_conv, long soc, float *y,
                     const KdaAux *aux) {
    if (B < 0 || T < 1 || p->H < 1 || p->K < 1 || p->V < 1 || p->W < 1 || p->RF < 1 || p->RG < 1
        || p->C != 2 * p->H * p->K + p->H * p->V)
        return -1;
    const int H = p->H, K = p->K, V = p->V, C = p->C;
    const long HK = (long)H * K, HV = (long)H * V, HKV = HK * V;
    float *scr = malloc(sizeof(float) * ((size_t)C + HK + HV + 2 * (size_t)V + K));   /* a, g, gate, kv, d, u */
    if (!scr) return -2;
    KdaAux none = {0};
    const KdaAux *x = aux ? aux : &none;
    for (int b = 0; b < B; ++b) {
        for (int t = 0; t < T; ++t) {
            const long n = (long)b * T + t;
            float *q_o = x->q ? x->q + n * HK : NULL, *k_o = x->k ? x->k + n * HK : NULL;
            float *v_o = x->v ? x->v + n * HV : NULL, *g_o = x->g ? x->g + n * HK : NULL;
            float *b_o = x->beta ? x->beta + n * H : NULL, *u_o = x->u ? x->u + n * HV : NULL;
            float *st_o = x->states ? x->states + n * HKV : NULL;
            if (slots[b] < 0) {
                fill_nan(y + n * HV, HV), fill_nan(q_o, HK), fill_nan(k_o, HK), fill_nan(v_o, HV);
                fill_nan(g_o, HK), fill_nan(b_o, H), fill_nan(u_o, HV), fill_nan(st_o, HKV);
                continue;
            }
            float *pool_rec = rec + slots[b] * sr, *pool_conv = conv + slots[b] * sc;
            float *S = out_rec ? out_rec + (long)b * sor : pool_rec;
            float *win = out_conv ? out_conv + (long)b * soc : pool_conv;
            token(p, raw + n * sraw, flow + n * sflow, bp + n * sb, glow + n * sglow,
                  t == 0 ? pool_conv : win, win, t == 0 ? pool_rec : S, S, y + n * HV, scr,
                  q_o, k_o, v_o, g_o, b_o, u_o);
            for (long i = 0; st_o && i < HKV; ++i) st_o[i] = S[i];
        }
    }
    free(scr);
    return 0;
}

typedef int (*linear_fn)(int M, int N, int K, const float *x, long ldx, const float *packed, float *out, long ldo,
                         int threads);
typedef void (*rmsnorm_fn)(int M, int D, const float *x, long ldx, const float *w, float eps, float *y, long ldy);

typedef struct {
    int D, NP;                      /* hidden size; input GEMM outputs C + RF + H + RG */
    const float *proj;              /* [qkv_proj; f_a; b_proj; g_a] packed for `linear` ([NP, D]) */
    const float *o_proj;            /* o_proj packed for `linear` ([D, H V]) */
    linear_fn linear;               /* invariant_cpu.c's linear_f32 and rmsnorm_f32 */
    rmsnorm_fn rmsnorm;
} KdaBlock;

/* A KDA decoder sublayer for one decode token per row, in place: x [B, D] (row stride ldx) = x + o_proj(layer(
 * rmsnorm(x))), the RMSNorm of weight norm [D] and eps, the input GEMM into [B, NP] (raw | f_low | b | g_low at row
 * stride NP, as kda_core.layer.KDALayer.project_inputs' views), kda_decode_layer with T = 1 (the same pools, slots,
 * out and aux), the o_proj GEMM and a rounded add: bitwise those calls and torch's add. Returns 0, -1 for bad sizes,
 * -2 when out of memory (x then unwritten). */
int kda_decode_block(const KdaWeights *p, const KdaBlock *blk, int B, float *x, long ldx, const float *norm, float eps,
                     float *rec, long sr, float *conv, long sc, const long *slots, float *out_rec, long sor,
                     float *out_conv, long soc, const KdaAux *aux, int threads) {
    const int D = blk->D, NP = blk->NP, C = p->C, RF = p->RF, H = p->H;
    if (B < 0 || D < 1 || NP != C + RF + H + p->RG) return -1;
    if (B == 0) return 0;
    const long HV = (long)p->H * p->V;
    float *h = malloc(sizeof(float) * (size_t)B * (2 * (size_t)D + NP + HV));
    if (!h) return -2;
    float *proj = h + (size_t)B * D, *y = proj + (size_t)B * NP, *o = y + (size_t)B * HV;
    blk->rmsnorm(B, D, x, ldx, norm, eps, h, D);
    int rc = blk->linear(B, NP, D, h, D, blk->proj, proj, NP, threads) ? -2 : 0;
    if (!rc)
        rc = kda_decode_layer(p, B, 1, proj, NP, proj + C, NP, proj + C + RF, NP, proj + C + RF + H, NP, rec, sr, conv,
                              sc, slots, out_rec, sor, out_conv, soc, y, aux);
    if (!rc) rc = blk->linear(B, D, (int)HV, y, HV, blk->o_proj, o, D, threads) ? -2 : 0;
    if (!rc)
        for (int b = 0; b < B; ++b) {
            float *xb = x + b * ldx;
            const float *ob = o + (size_t)b * D;
            for (int d = 0; d < D; ++d) xb[d] = xb[d] + ob[d];
        }
    free(h);
    return rc;
}

/* Write n rows of L state pieces into their slots: piece j's row i (len[j] floats at src[j] + i len[j]) to
 * dst[j] + slots[i] sdst[j] for each i with slots[i] >= 0 (-1: not written). A copy (the bits unchanged): the
 * commit of a step's staged states, one call for every layer of a slot group. */
void kda_write_slots(int L, int n, const long *slots, float *const *dst, const long *sdst, const float *const *src,
                     const long *len) {
    for (int j = 0; j < L; ++j)
        for (int i = 0; i < n; ++i)
            if (slots[i] >= 0) memcpy(dst[j] + slots[i] * sdst[j], src[j] + (long)i * len[j], sizeof(float) * len[j]);
}

/* Replay kda_decode_layer's state updates from what its steps consumed: k, g [B, T, H, K], v [B, T, H, V], beta
 * [B, T, H] (contiguous), onto S [B, H, K, V] (contiguous) in place, token by token: bitwise the states the layer
 * wrote (the same delta()). Returns 0, -1 for bad sizes, -2 when out of memory. */
int kda_decode_replay(int B, int T, int H, int K, int V, const float *k, const float *v, const float *g,
                      const float *beta, float *S) {
    if (B < 0 || T < 0 || H < 1 || K < 1 || V < 1) return -1;
    float *scr = malloc(sizeof(float) * (2 * (size_t)V + K));                    /* kv, d, u */
    if (!scr) return -2;
    for (int b = 0; b < B; ++b)
        for (int t = 0; t < T; ++t)
            for (int h = 0; h < H; ++h) {
                const long n = ((long)b * T + t) * H + h;
                float *Sh = S + ((long)b * H + h) * K * V;
                delta(K, V, k + n * K, v + n * V, g + n * K, beta[n], Sh, Sh, scr, scr + V + K);
            }
    free(scr);
    return 0;
}

/* out[i] = exp(x[i]) as kda_decode_layer's step computes its decay exp(g) (for replaying its records bitwise). */
void kda_decode_exp(long n, const float *x, float *out) {
    for (long i = 0; i < n; ++i) out[i] = exp_f(x[i]);
}

int kda_decode_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 128;
#endif
}
