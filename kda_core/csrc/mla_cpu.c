/* The absorbed MLA decode attention of kda_core.layer.MLALayer.attend_absorbed in one call (fp32), for Q queries
 * (decode tokens and verify tokens), each over its own run of latents: the first ones read in place from the paged
 * latent cache, the rest (this step's new latents) from a contiguous tensor. kda_core/cpu_mla.py loads it.
 *
 * Per query i and head h, with latents c_j (R = r + rope floats each, rows lat[off_i .. off_i + len_i)):
 *   qc_h = [q_nope_h W_uk[h] | q_rope_h]                     (W_uk[h] [nope, r]: the key half of kv_b's head h)
 *   s_j = (qc_h . c_j) * scale;  p_j = exp(s_j - max s) / sum_j exp(s_j - max s)
 *   o_h = (sum_j p_j c_j[:r]) W_uv[h]^T                      (W_uv[h] [vd, r]: the value half of kv_b's head h)
 * and out_i = [o_0 | ... | o_{Hm-1}] (Hm vd floats).
 *
 * The absorption and the output are the row-invariant GEMM of invariant_cpu.c (its linear_f32 on its packed
 * copies of W_uk[h]^T and W_uv[h], called through the pointer the loader passes): bitwise MLALayer.absorb_queries /
 * absorbed_output. The dot product s_j takes 8 partial sums (lane l: c = l, l + 8, ... by FMA in order, a masked
 * tail) added in a fixed tree; the sum of the exps and each output value sum_j p_j c_j[d] one chain over j in order (exp: the Cephes expf of csrc/moe_cpu.c on 8 lanes, every
 * element through the same lanes). So a query's bits depend on its own q and latents only: not on the other
 * queries of the call nor on where its latents are stored. Built with -ffp-contract=off: the products outside those FMA
 * chains are rounded on their own.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "cephes_exp.h"

typedef int (*linear_fn)(int M, int N, int K, const float *x, long ldx, const float *packed, float *out, long ldo,
                         int threads);

int mla_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#else
    return 256;
#endif
}

typedef void (*rmsnorm_fn)(int M, int D, const float *x, long ldx, const float *w, float eps, float *y, long ldy);

/* Sizes and weights of one MLA layer, built once by the loader: uk[h] = packed W_uk[h]^T ([r, nope]), uv[h] =
 * packed W_uv[h] ([vd, r]) (invariant_cpu.c's linear_pack_f32); linear: invariant_cpu.c's linear_f32. For the whole
 * decode layer (mla_decode_f32) also: proj = packed [kv_a; q_proj] ([R + Hm dq, D]), norm = kv_a_layernorm's weight
 * [r] with eps, o = packed o_proj ([D, Hm vd]), rmsnorm: invariant_cpu.c's rmsnorm_f32. */
struct mla_block {
    int Hm, nope, rope, r, vd;
    float scale;
    const long *uk, *uv;
    linear_fn linear;
    int D;
    float eps;
    const float *proj, *norm, *o;
    rmsnorm_fn rmsnorm;
};

/* dst[c] = sum_j p[j] rows[j][c] for the next blocks of 8 NB values c < r: one FMA chain over j per value, NB chains at
 * a time. */
#define OUT_BLOCKS(NB, dst)                                                                                           \
    for (; c + 8 * NB <= r; c += 8 * NB) {                                                                         \
        __m256 acc[NB];                                                                                            \
        for (int u = 0; u < NB; u++) acc[u] = _mm256_setzero_ps();                                                 \
        for (long j = 0; j < n; j++) {                                                                             \
            __m256 pj = _mm256_set1_ps(p[j]);                                                                      \
            for (int u = 0; u < NB; u++) acc[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(rows[j] + c + 8 * u), acc[u]); \
        }                                                                                                          \
        for (int u = 0; u < NB; u++) _mm256_storeu_ps((dst) + c + 8 * u, acc[u]);                                 \
    }

/* One query over all its heads: qc [Hm, R], its n latents at rows[0 .. n) (R floats each) -> ol [Hm, r]. s:
 * scratch of Hm (n + 8) floats. */
static void attend_query(int Hm, const float *qc, const float *const *rows, long n, int R, int r, float scale,
                         float *s, float *ol) {
    const long ns = n + 8;
    const int RB = R / 8, rt = R - 8 * RB;            /* full 8-lane blocks of a latent, and the tail */
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(rt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 sc = _mm256_set1_ps(scale);
    for (long j = 0; j < n; j++) {                     /* s_hj = qc_h . c_j: 8 partial sums (lane l takes c = l, l + 8,
                                                          ... by FMA in order), then a fixed tree; 4 heads at a time */
        const float *cj = rows[j];
        for (int h0 = 0; h0 < Hm; h0 += 4) {
            const float *q0 = qc + (long)h0 * R, *q1 = h0 + 1 < Hm ? q0 + R : q0;
            const float *q2 = h0 + 2 < Hm ? q0 + 2 * R : q0, *q3 = h0 + 3 < Hm ? q0 + 3 * R : q0;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int c8 = 0; c8 < RB; c8++) {
                __m256 v = _mm256_loadu_ps(cj + 8 * c8);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 8 * c8), v, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + 8 * c8), v, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + 8 * c8), v, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + 8 * c8), v, a3);
            }
            if (rt) {
                __m256 v = _mm256_maskload_ps(cj + 8 * RB, tail);
                a0 = _mm256_fmadd_ps(_mm256_maskload_ps(q0 + 8 * RB, tail), v, a0);
                a1 = _mm256_fmadd_ps(_mm256_maskload_ps(q1 + 8 * RB, tail), v, a1);
                a2 = _mm256_fmadd_ps(_mm256_maskload_ps(q2 + 8 * RB, tail), v, a2);
                a3 = _mm256_fmadd_ps(_mm256_maskload_ps(q3 + 8 * RB, tail), v, a3);
            }
            /* the tree: (l, l + 4) for 4 lanes, then (l, l + 2), then (0, 1); the 4 heads in one pass */
            __m256 t01 = _mm256_hadd_ps(a0, a1), t23 = _mm256_hadd_ps(a2, a3);    /* pairs (0,1) (2,3) per 128 */
            __m256 t = _mm256_hadd_ps(t01, t23);                                    /* per head, per 128-bit half */
            __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));   /* heads 0..3 */
            float out4[4];
            _mm_storeu_ps(out4, _mm_mul_ps(sum4, _mm256_castps256_ps128(sc)));
            for (int u = 0; u < 4 && h0 + u < Hm; u++) s[(h0 + u) * ns + j] = out4[u];
        }
    }
    for (int h = 0; h < Hm; h++) {
        float *p = s + h * ns, *olh = ol + (long)h * r;
        float mx = p[0];
        for (long j = 1; j < n; j++) mx = p[j] > mx ? p[j] : mx;
        float sum = 0.0f;
        for (long j0 = 0; j0 < n; j0 += 8) {           /* exp(s - max) on 8 lanes; the sum in order */
            int m = n - j0 < 8 ? (int)(n - j0) : 8;
            float e[8];
            _mm256_storeu_ps(e, exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j0), _mm256_set1_ps(mx))));
            for (int l = 0; l < m; l++) {
                p[j0 + l] = e[l];
                sum = sum + e[l];
            }
        }
        for (long j = 0; j < n; j++) p[j] = p[j] / sum;
        int c = 0;
        OUT_BLOCKS(4, olh)
        OUT_BLOCKS(1, olh)
        for (; c < r; c++) {                           /* the same chain, one value at a time */
            float acc = 0.0f;
            for (long j = 0; j < n; j++) acc = fmaf(p[j], rows[j][c], acc);
            olh[c] = acc;
        }
    }
}

/* out [Q, Hm vd] (row stride ldo) for queries q [Q, Hm, nope + rope] (row stride ldq; heads contiguous). Query i
 * reads qm[i] = tstart, qm[Q + i] = cached, qm[2Q + i] = first, qm[3Q + i] = len: len latents, the first `cached` of
 * them from the paged cache (latent j at cache + pages[tstart + j / NB] * page_stride + (j % NB) * ld_cache, pages of
 * [0, num_pages); pages has npages entries), the rest the rows lat[first .. first + len - cached) (row stride ldl,
 * nlat rows). Returns 0; 1 for a bad size; 3 for a latent run that is empty or outside its storage (nothing
 * written); 4 when out of memory. */
int mla_absorbed_f32(int Q, const float *q, long ldq, const float *cache, long page_stride, int NB, long ld_cache,
                     long num_pages, const long *pages, long npages, const float *lat, long ldl, long nlat,
                     const long *qm, float *out, long ldo, const struct mla_block *b, int threads) {
    const int Hm = b->Hm, nope = b->nope, rope = b->rope, r = b->r, vd = b->vd, dq = nope + rope, R = r + rope;
    if (Q < 0 || Hm < 1 || nope < 1 || rope < 0 || r < 1 || vd < 1 || NB < 1) return 1;
    const long *tstart = qm, *cached = qm + Q, *first = qm + 2L * Q, *len = qm + 3L * Q;
    long nmax = 0;
    for (int i = 0; i < Q; i++) {
        long nc = cached[i], nb = (nc + NB - 1) / NB;
        if (len[i] < 1 || nc < 0 || nc > len[i] || first[i] < 0 || first[i] + len[i] - nc > nlat) return 3;
        if (nc && (!cache || tstart[i] < 0 || tstart[i] + nb > npages)) return 3;
        for (long t = 0; t < nb; t++)
            if (pages[tstart[i] + t] < 0 || pages[tstart[i] + t] >= num_pages) return 3;
        if (len[i] > nmax) nmax = len[i];
    }
    if (Q == 0) return 0;
    size_t floats = (size_t)Q * Hm * R + (size_t)Q * Hm * r + (size_t)Hm * (nmax + 8);
    const float **rows = malloc(sizeof(float *) * nmax + sizeof(float) * floats);   /* the pointers first: aligned */
    if (!rows) return 4;
    float *qc = (float *)(rows + nmax), *ol = qc + (size_t)Q * Hm * R, *s = ol + (size_t)Q * Hm * r;
    int rc = 0;
    for (int h = 0; h < Hm; h++)                       /* q_nope W_uk[h] of every query: one GEMM per head */
        if ((rc = b->linear(Q, r, nope, q + h * dq, ldq, (const float *)b->uk[h], qc + h * R, (long)Hm * R, threads)))
            goto done;
    for (int i = 0; i < Q; i++) {
        for (int h = 0; h < Hm; h++)                   /* the rope part of the query as it is */
            memcpy(qc + ((size_t)i * Hm + h) * R + r, q + i * ldq + h * dq + nope, sizeof(float) * rope);
        for (long j = 0; j < len[i]; j++)
            rows[j] = j < cached[i] ? cache + pages[tstart[i] + j / NB] * page_stride + (j % NB) * ld_cache
                                    : lat + (first[i] + j - cached[i]) * ldl;
        attend_query(Hm, qc + (size_t)i * Hm * R, rows, len[i], R, r, b->scale, s, ol + (size_t)i * Hm * r);
    }
    for (int h = 0; h < Hm; h++)                       /* o_lat W_uv[h]^T of every query: one GEMM per head */
        if ((rc = b->linear(Q, vd, r, ol + h * r, (long)Hm * r, (const float *)b->uv[h], out + h * vd, ldo, threads)))
            goto done;
done:
    free(rows);
    return rc;
}

/* A whole MLA layer for Q decode tokens (one per row) of hidden states h [Q, D] (row stride ldh), as
 * MLALayer.forward(mode="recurrent") computes a token: [c_kv | k_rope | q] = h [kv_a; q_proj]^T (one GEMM), the
 * latent [rmsnorm(c_kv) | k_rope] written to the cache at page wpage[i], offset woff[i] (wpage[i] < 0: not written,
 * a pad row), the absorbed attention of query i over its qm run (mla_absorbed_f32; its new latent the one just
 * formed), then y [Q, D] (row stride ldy) = o o_proj^T. qm [6, Q]: the 4 rows of mla_absorbed_f32, then wpage,
 * woff. Every GEMM and the RMSNorm are invariant_cpu.c's (linear_f32, rmsnorm_f32): bitwise MLALayer's
 * latents_and_queries_at and o_proj. Returns as mla_absorbed_f32 (3 also for a write outside the cache; nothing
 * written then). */
int mla_decode_f32(int Q, const float *h, long ldh, float *cache, long page_stride, int NB, long ld_cache,
                   long num_pages, const long *pages, long npages, const long *qm, float *y, long ldy,
                   const struct mla_block *b, int threads) {
    const int Hm = b->Hm, r = b->r, R = r + b->rope, NQ = Hm * (b->nope + b->rope), NP = R + NQ, D = b->D;
    if (Q < 0 || D < 1) return 1;
    if (Q == 0) return 0;
    const long *wpage = qm + 4L * Q, *woff = qm + 5L * Q;
    for (int i = 0; i < Q; i++)
        if (wpage[i] >= num_pages || (wpage[i] >= 0 && (woff[i] < 0 || woff[i] >= NB))) return 3;
    float *proj = malloc(sizeof(float) * ((size_t)Q * NP + (size_t)Q * R + (size_t)Q * Hm * b->vd));
    if (!proj) return 4;
    float *lat = proj + (size_t)Q * NP, *att = lat + (size_t)Q * R;
    int rc = b->linear(Q, NP, D, h, ldh, b->proj, proj, NP, threads);
    if (rc) goto done;
    b->rmsnorm(Q, r, proj, NP, b->norm, b->eps, lat, R);
    for (int i = 0; i < Q; i++) memcpy(lat + (size_t)i * R + r, proj + (size_t)i * NP + r, sizeof(float) * b->rope);
    rc = mla_absorbed_f32(Q, proj + R, NP, cache, page_stride, NB, ld_cache, num_pages, pages, npages, lat, R, Q, qm,
                          att, (long)Hm * b->vd, b, threads);
    if (rc) goto done;                                 /* (its runs end before the new latents: written after) */
    for (int i = 0; i < Q; i++)
        if (wpage[i] >= 0) memcpy(cache + wpage[i] * page_stride + woff[i] * ld_cache, lat + (size_t)i * R, sizeof(float) * R);
    rc = b->linear(Q, D, Hm * b->vd, att, (long)Hm * b->vd, b->o, y, ldy, threads);
done:
    free(proj);
    return rc;
}

/* The MLA decoder sublayer in place: x [Q, D] (row stride ldx) = x + mla_decode_f32(rmsnorm(x)), the RMSNorm of
 * weight norm [D] and eps through b->rmsnorm; each sum rounded on its own, as torch's add: bitwise the RMSNorm
 * call, mla_decode_f32 and the add. Returns as mla_decode_f32 (x written only on 0). */
int mla_decode_residual_f32(int Q, float *x, long ldx, const float *norm, float eps, float *cache, long page_stride,
                            int NB, long ld_cache, long num_pages, const long *pages, long npages, const long *qm,
                            const struct mla_block *b, int threads) {
    const int D = b->D;
    if (Q < 0 || D < 1) return 1;
    if (Q == 0) return 0;
    float *h = malloc(sizeof(float) * 2 * (size_t)Q * D);
    if (!h) return 4;
    float *y = h + (size_t)Q * D;
    b->rmsnorm(Q, D, x, ldx, norm, eps, h, D);
    int rc = mla_decode_f32(Q, h, D, cache, page_stride, NB, ld_cache, num_pages, pages, npages, qm, y, D, b, threads);
    if (!rc)
        for (int i = 0; i < Q; i++) {
            float *xi = x + i * ldx;
            const float *yi = y + (size_t)i * D;
            for (int d = 0; d < D; d++) xi[d] = xi[d] + yi[d];
        }
    free(h);
    return rc;
}
