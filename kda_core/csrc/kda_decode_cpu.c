/* One KDA decode token per batch row on the CPU, fp32, reading and writing each row's state in place BY SLOT:
 * the fused form of kda_core.varlen's decode rows (kda_core/decode.py loads it and checks it before use).
 *
 * Two entry points, for the two parts of a decode step that are pure multiply / add (the transcendental parts,
 * SiLU, the L2 norm's rsqrt and exp(g), stay in torch between them):
 *   kda_decode_conv  the short causal depthwise conv over [conv window, this token] and the window's shift,
 *                    as kda_core.conv.short_conv: y = f_0 w_0, then y = y + f_j w_j for j = 1 .. W-1;
 *   kda_decode_step  the delta-rule step, as kda_core.kda._step: S' = S * exp(g); kv = sum_k S'[k] k[k];
 *                    u = beta (v - kv); S = S' + k u^T; o = sum_k S[k] (q[k] scale).
 * Bitwise what the torch form computes: every product is rounded before it is added (this file is built with
 * -ffp-contract=off, so no fused multiply-add), and the two sums over K follow ATen's cascade sum of a float
 * reduction over a strided dim (aten/src/ATen/native/cpu/SumKernel.cpp, multi_row_sum: partial sums of 16 terms
 * carried up 4 levels). The loader checks the bits against the torch form once and uses the torch form if they
 * differ (another ATen, another order).
 *
 * Layouts (elements): a state pool rec [S, H, K, V] and conv pool [S, C, W-1] with any stride for S and the rest
 * contiguous; slots [B] int64, -1 = pad row: its state is neither read nor written and its outputs are NaN.
 * New states go back in place (out == NULL), or to row b of an output [B, ...] (out != NULL, row stride so), so
 * that the pool is only read: the engine writes them by slot when it commits the step.
 * Rows are independent: a row's bits never depend on the other rows of the call.
 */
#include <math.h>
#include <stddef.h>

/* ATen's multi_row_sum for one column: terms x[i * stride], i in [0, n). */
static inline float cascade_sum(const float *x, long stride, int n) {
    enum { LEVELS = 4 };
    int power = 4, lg = 0;
    while ((1L << lg) < n) lg++;                   /* ceil(log2 n) */
    if (lg / LEVELS > power) power = lg / LEVELS;
    const long step = 1L << power, mask = step - 1;
    float acc[LEVELS] = {0.0f, 0.0f, 0.0f, 0.0f};
    long i = 0;
    while (i + step <= n) {
        for (long j = 0; j < step; ++j, ++i) acc[0] += x[i * stride];
        for (int j = 1; j < LEVELS; ++j) {
            acc[j] += acc[j - 1];
            acc[j - 1] = 0.0f;
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < n; ++i) acc[0] += x[i * stride];
    for (int j = 1; j < LEVELS; ++j) acc[0] += acc[j];
    return acc[0];
}

/* x [B, C] raw inputs of this token (row stride sx); w [C, W] (w[:, W-1] multiplies this token); conv pool at
 * conv + slot * sc, [C, W-1] per slot, oldest first. Writes y [B, C] (contiguous) and each live row's shifted
 * window in place (out NULL) or at out + b * so. Returns 0, or -1 for bad sizes. */
int kda_decode_conv(int B, int C, int W, const float *x, long sx, const float *w, float *conv, long sc,
                    const long *slots, float *y, float *out, long so) {
    if (B < 0 || C < 1 || W < 1 || W > 64) return -1;
    float f[64];
    for (int b = 0; b < B; ++b) {
        float *yb = y + (long)b * C;
        if (slots[b] < 0) {
            for (int c = 0; c < C; ++c) yb[c] = NAN;
            continue;
        }
        float *win = conv + slots[b] * sc, *dst = out ? out + (long)b * so : win;
        const float *xb = x + (long)b * sx;
        for (int c = 0; c < C; ++c) {
            float *wc = win + (long)c * (W - 1), *dc = dst + (long)c * (W - 1);
            for (int j = 0; j < W - 1; ++j) f[j] = wc[j];
            f[W - 1] = xb[c];
            const float *k = w + (long)c * W;
            float acc = f[0] * k[0];
            for (int j = 1; j < W; ++j) acc = acc + f[j] * k[j];
            yb[c] = acc;
            for (int j = 0; j < W - 1; ++j) dc[j] = f[j + 1];
        }
    }
    return 0;
}

/* q, k, decay = exp(g) [B, H, K]; v [B, H, V]; beta [B, H] (all contiguous); the state pool at rec + slot * sr,
 * [H, K, V] per slot. Writes o and u [B, H, V] (contiguous) and each live row's new state in place (out NULL)
 * or at out + b * so; scratch holds K * V floats. Returns 0, or -1 for bad sizes. */
int kda_decode_step(int B, int H, int K, int V, float scale, const float *q, const float *k, const float *v,
                    const float *decay, const float *beta, float *rec, long sr, const long *slots,
                    float *o, float *u, float *scratch, float *out, long so) {
    if (B < 0 || H < 1 || K < 1 || V < 1) return -1;
    for (int b = 0; b < B; ++b) {
        for (int h = 0; h < H; ++h) {
            long bh = (long)b * H + h;
            float *ob = o + bh * V, *ub = u + bh * V;
            if (slots[b] < 0) {
                for (int j = 0; j < V; ++j) ob[j] = ub[j] = NAN;
                continue;
            }
            const float *S0 = rec + slots[b] * sr + (long)h * K * V;
            float *S = (out ? out + (long)b * so : rec + slots[b] * sr) + (long)h * K * V;
            const float *qb = q + bh * K, *kb = k + bh * K, *db = decay + bh * K, *vb = v + bh * V;
            const float bt = beta[bh];
            for (int i = 0; i < K; ++i)                               /* S' = S * exp(g) */
                for (int j = 0; j < V; ++j) S[(long)i * V + j] = S0[(long)i * V + j] * db[i];
            for (int i = 0; i < K; ++i)                               /* S' * k, then its column sums */
                for (int j = 0; j < V; ++j) scratch[(long)i * V + j] = S[(long)i * V + j] * kb[i];
            for (int j = 0; j < V; ++j) ub[j] = bt * (vb[j] - cascade_sum(scratch + j, V, K));
            for (int i = 0; i < K; ++i)                               /* S = S' + k u^T */
                for (int j = 0; j < V; ++j) S[(long)i * V + j] = S[(long)i * V + j] + kb[i] * ub[j];
            for (int i = 0; i < K; ++i) {                             /* S * (q scale), then its column sums */
                const float qs = qb[i] * scale;
                for (int j = 0; j < V; ++j) scratch[(long)i * V + j] = S[(long)i * V + j] * qs;
            }
            for (int j = 0; j < V; ++j) ob[j] = cascade_sum(scratch + j, V, K);
        }
    }
    return 0;
}
