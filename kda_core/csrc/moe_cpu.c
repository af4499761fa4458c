/* The MoE feed-forward of kda_core.moe in one call (fp32): router, top-k, the routed SwiGLU experts, the weighted
 * combine and the shared experts, for M rows. kda_core/cpu_moe.py loads it.
 *
 * Per row x (D values), with E experts, k per token, F the expert width and Fs the shared experts' width:
 *   [logits | shared gate | shared up] = x [router; shared gate_up]^T      (one GEMM, E + 2 Fs outputs)
 *   s = sigmoid(logits); c = s + bias; with G > 1 groups each group scored by the sum of its two best c and only
 *   the topk_group best groups kept; idx = the k best c of the kept experts, best first (a tie: the lower index);
 *   w_j = s[idx_j], divided by (w_0 + ... + w_{k-1}) + 1e-20 when renormalising, times routed_scaling_factor;
 *   y = p_0 w_0; y = y + p_j w_j for j = 1 .. k-1 (p_j = down_e(silu(gate_e x) * up_e x), e = idx_j);
 *   y = y + shared_down(silu(shared gate) * shared up).
 * Every product and sum is rounded on its own (built with -ffp-contract=off), in the order of the torch form
 * (MoE.forward_torch). Every GEMM is the row-invariant GEMM of invariant_cpu.c, called through the pointer the
 * loader passes (linear_f32 of that library, on its packed weights): each output one FMA chain over K in order,
 * so a row's bits never depend on how many rows share its expert or the call. The rows of one expert are gathered
 * and run as one GEMM (its tiles give the bits of a row alone).
 *
 * exp is Cephes' expf on 8 lanes (as csrc/kda_chunk_cpu.c: range reduction by ln 2 in two parts, degree-5
 * polynomial, ~1 ulp); every element, tails included, goes through the same 8-lane code, so an element's bits do
 * not depend on its position. sigmoid(v) = 1 / (1 + exp(-v)) and silu(v) = v / (1 + exp(-v)) differ from ATen's
 * (SLEEF) in the last bits: the torch form is the reference within kda_core.cpu_moe's tolerance, and every path
 * that must agree bitwise runs this same code.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "cephes_exp.h"

typedef int (*linear_fn)(int M, int N, int K, const float *x, long ldx, const float *packed, float *out, long ldo,
                         int threads);

int moe_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#else
    return 256;
#endif
}

/* One 8-lane step: sigmoid(x) = 1 / (1 + exp(-x)), or (silu) x / (1 + exp(-x)) * up. */
static inline __m256 act8(__m256 x, __m256 up, int silu) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)));
    return silu ? _mm256_mul_ps(_mm256_div_ps(x, den), up) : _mm256_div_ps(one, den);
}

/* out[i] = sigmoid(v[i]), or (silu) silu(v[i]) * up[i], for n values: 8 at a time, the tail on a zero-padded copy
 * through the same 8 lanes. */
static void act(int n, const float *v, const float *up, float *out, int silu) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, act8(_mm256_loadu_ps(v + i), up ? _mm256_loadu_ps(up + i) : _mm256_setzero_ps(), silu));
    if (i < n) {
        float vb[8] = {0}, ub[8] = {0}, ob[8];
        memcpy(vb, v + i, sizeof(float) * (n - i));
        if (up) memcpy(ub, up + i, sizeof(float) * (n - i));
        _mm256_storeu_ps(ob, act8(_mm256_loadu_ps(vb), _mm256_loadu_ps(ub), silu));
        memcpy(out + i, ob, sizeof(float) * (n - i));
    }
}

/* The activations alone (tests, the loader's check): out = sigmoid(v), or silu(v) * up. */
void moe_sigmoid_f32(int n, const float *v, float *out) { act(n, v, NULL, out, 0); }
void moe_silu_mul_f32(int n, const float *v, const float *up, float *out) { act(n, v, up, out, 1); }

/* Routing of one row: scores s [E] (sigmoid of the logits) -> idx [k] (best first), w [k]. */
static void route_row(int E, int k, int G, int topk_group, int renorm, float scale, const float *s,
                      const float *bias, long *idx, float *w) {
    float c[E];
    unsigned char allowed[E];
    for (int e = 0; e < E; e++) {
        c[e] = s[e] + bias[e];
        allowed[e] = 1;
    }
    if (G > 1) {
        int gs = E / G;
        float gscore[G];
        unsigned char keep[G];
        for (int g = 0; g < G; g++) {                 /* the sum of the group's two best c (its one c if alone) */
            int b0 = g * gs;
            for (int e = g * gs + 1; e < (g + 1) * gs; e++) if (c[e] > c[b0]) b0 = e;
            int b1 = -1;
            for (int e = g * gs; e < (g + 1) * gs; e++)
                if (e != b0 && (b1 < 0 || c[e] > c[b1])) b1 = e;
            gscore[g] = b1 < 0 ? c[b0] : c[b0] + c[b1];
            keep[g] = 0;
        }
        for (int t = 0; t < topk_group; t++) {        /* the topk_group best groups (a tie: the lower index) */
            int b = -1;
            for (int g = 0; g < G; g++) if (!keep[g] && (b < 0 || gscore[g] > gscore[b])) b = g;
            keep[b] = 1;
        }
        for (int e = 0; e < E; e++) allowed[e] = keep[e / gs];
    }
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {                     /* the k best allowed c, best first (a tie: the lower index) */
        int b = -1;
        for (int e = 0; e < E; e++) if (allowed[e] && (b < 0 || c[e] > c[b])) b = e;
        allowed[b] = 0;
        idx[j] = b;
        w[j] = s[b];
        sum = j ? sum + w[j] : w[j];
    }
    for (int j = 0; j < k; j++) {
        if (renorm) w[j] = w[j] / (sum + 1e-20f);
        w[j] = w[j] * scale;
    }
}

/* A MoE block's sizes and weights, built once by the loader. Packed weights (invariant_cpu.c's linear_pack_f32):
 * rs = [router; shared gate_up] ([E + 2 Fs, D]), gu[e] ([2F, D], gate then up), dn[e] ([D, F]), sdown ([D, Fs],
 * unused when Fs == 0); bias [E]; linear: invariant_cpu.c's linear_f32. */
struct moe_block {
    int D, E, k, F, Fs, G, topk_group, renorm;
    float scale;
    const float *rs, *bias;
    const long *gu, *dn;
    const float *sdown;
    linear_fn linear;
};

/* out [M, D] (row stride ldo) = the MoE block b of x [M, D] (row stride ldx). idx_out [M, k] int64 (may be NULL):
 * the experts chosen, best first. `threads` goes to the GEMMs (any split gives the same bits). Returns 0, 1 for a
 * bad size, 4 when out of memory. */
int moe_forward_f32(int M, const float *x, long ldx, float *out, long ldo, long *idx_out, const struct moe_block *b,
                    int threads) {
    const int D = b->D, E = b->E, k = b->k, F = b->F, Fs = b->Fs, G = b->G, topk_group = b->topk_group;
    const int renorm = b->renorm;
    const float scale = b->scale, *rs = b->rs, *bias = b->bias, *sdown = b->sdown;
    const long *gu = b->gu, *dn = b->dn;
    linear_fn linear = b->linear;
    if (M < 0 || D < 1 || E < 1 || k < 1 || k > E || F < 1 || Fs < 0 || G < 1 || E % G || topk_group < 1 ||
        topk_group > G || k > topk_group * (E / G))
        return 1;
    if (M == 0) return 0;
    long P = (long)M * k, NR = E + 2L * Fs;
    size_t floats = M * NR + (size_t)M * E + P + P * D + (size_t)M * 2 * F + (size_t)M * F + P * D + (size_t)M * Fs + (size_t)M * D;
    float *buf = malloc(sizeof(float) * floats + sizeof(long) * (2 * P + E + 1));
    if (!buf) return 4;
    float *logits = buf;                              /* [M, E + 2 Fs]: router logits, shared gate, shared up */
    float *sc = logits + M * NR;                      /* [M, E] router scores */
    float *w = sc + (size_t)M * E;                    /* [M, k] routing weights */
    float *xe = w + P;                                /* [<= M, D] one expert's rows, gathered */
    float *gue = xe + P * D;                          /* [<= M, 2F] */
    float *he = gue + (size_t)M * 2 * F;              /* [<= M, F] */
    float *pk = he + (size_t)M * F;                   /* [P, D] each pair's expert output, grouped by expert */
    float *hs = pk + P * D;                           /* [M, Fs] */
    float *ys = hs + (size_t)M * Fs;                  /* [M, D] */
    long *idx = (long *)(ys + (size_t)M * D);         /* [M, k] */
    long *pos = idx + P;                              /* [M, k] the pair's row in pk */
    long *start = pos + P;                            /* [E + 1] */
    int rc = linear(M, (int)NR, D, x, ldx, rs, logits, NR, threads);
    if (rc) goto done;
    for (int m = 0; m < M; m++) {
        moe_sigmoid_f32(E, logits + m * NR, sc + (size_t)m * E);
        route_row(E, k, G, topk_group, renorm, scale, sc + (size_t)m * E, bias, idx + m * k, w + m * k);
    }
    memset(start, 0, sizeof(long) * (E + 1));
    for (long p = 0; p < P; p++) start[idx[p] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    for (int e = 0; e < E; e++) {                     /* expert e's pairs, in row order: one GEMM each way */
        long n = 0;
        for (long p = 0; p < P; p++)
            if (idx[p] == e) {
                pos[p] = start[e] + n;
                memcpy(xe + n * D, x + (p / k) * ldx, sizeof(float) * D);
                n++;
            }
        if (!n) continue;
        if ((rc = linear((int)n, 2 * F, D, xe, D, (const float *)gu[e], gue, 2 * F, threads))) goto done;
        for (long r = 0; r < n; r++) moe_silu_mul_f32(F, gue + r * 2 * F, gue + r * 2 * F + F, he + r * F);
        if ((rc = linear((int)n, D, F, he, F, (const float *)dn[e], pk + start[e] * D, D, threads))) goto done;
    }
    if (Fs) {
        for (int m = 0; m < M; m++) moe_silu_mul_f32(Fs, logits + m * NR + E, logits + m * NR + E + Fs, hs + m * Fs);
        if ((rc = linear(M, D, Fs, hs, Fs, sdown, ys, D, threads))) goto done;
    }
    for (int m = 0; m < M; m++) {
        float *o = out + m * ldo;
        const float *p0 = pk + pos[m * k] * D;
        for (int d = 0; d < D; d++) o[d] = p0[d] * w[m * k];
        for (int j = 1; j < k; j++) {
            const float *pj = pk + pos[m * k + j] * D;
            float wj = w[m * k + j];
            for (int d = 0; d < D; d++) o[d] = o[d] + pj[d] * wj;
        }
        if (Fs)
            for (int d = 0; d < D; d++) o[d] = o[d] + ys[m * D + d];
    }
    if (idx_out) memcpy(idx_out, idx, sizeof(long) * P);
done:
    free(buf);
    return rc;
}

/* The dense SwiGLU MLP: out [M, D] (row stride ldo) = down(silu(gate x) * up x) of x [M, D] (row stride ldx), gate_up
 * packed ([2F, D], gate then up), down packed ([D, F]); the GEMMs through `linear` (invariant_cpu.c's linear_f32).
 * Returns 0, 1 for a bad size, 4 when out of memory. */
int moe_dense_f32(int M, int D, int F, const float *x, long ldx, const float *gate_up, const float *down, float *out,
                  long ldo, linear_fn linear, int threads) {
    if (M < 0 || D < 1 || F < 1) return 1;
    if (M == 0) return 0;
    float *gu = malloc(sizeof(float) * (size_t)M * 3 * F);
    if (!gu) return 4;
    float *h = gu + (size_t)M * 2 * F;
    int rc = linear(M, 2 * F, D, x, ldx, gate_up, gu, 2L * F, threads);
    if (!rc) {
        for (int m = 0; m < M; m++) moe_silu_mul_f32(F, gu + (size_t)m * 2 * F, gu + (size_t)m * 2 * F + F, h + (size_t)m * F);
        rc = linear(M, D, F, h, F, down, out, ldo, threads);
    }
    free(gu);
    return rc;
}

typedef void (*rmsnorm_fn)(int M, int D, const float *x, long ldx, const float *w, float eps, float *y, long ldy);

/* A decoder layer's post-attention sublayer in place: x [M, D] (row stride ldx) = x + ffn(rmsnorm(x)), the RMSNorm of
 * weight norm [D] and eps through `rmsnorm` (invariant_cpu.c's rmsnorm_f32), ffn the MoE of `b` (moe_forward_f32) or,
 * b NULL, the dense MLP of gate_up / down and width F (moe_dense_f32); each sum rounded on its own, as torch's add:
 * bitwise those three calls and the add. Returns what the feed-forward returns (x written only on 0), 1 for a bad
 * size, 4 when out of memory. */
int moe_residual_f32(int M, int D, float *x, long ldx, const float *norm, float eps, rmsnorm_fn rmsnorm,
                     const struct moe_block *b, int F, const float *gate_up, const float *down, linear_fn linear,
                     int threads) {
    if (M < 0 || D < 1 || (b && b->D != D)) return 1;
    if (M == 0) return 0;
    float *h = malloc(sizeof(float) * 2 * (size_t)M * D);
    if (!h) return 4;
    float *y = h + (size_t)M * D;
    rmsnorm(M, D, x, ldx, norm, eps, h, D);
    int rc = b ? moe_forward_f32(M, h, D, y, D, NULL, b, threads)
               : moe_dense_f32(M, D, F, h, D, gate_up, down, y, D, linear, threads);
    if (!rc)
        for (int m = 0; m < M; m++) {
            float *xm = x + m * ldx;
            const float *ym = y + (size_t)m * D;
            for (int d = 0; d < D; d++) xm[d] = xm[d] + ym[d];
        }
    free(h);
    return rc;
}
