/* The chunked KDA forward on the CPU, fp32, one C pass per phase: the fused form of kda_core/chunk.py.
 *
 * Same algorithm as kda_core.chunk / kda_core.wy (fla naive_chunk_kda; Kimi Linear, arXiv:2510.26692,
 * the chunkwise algorithm): per unit (chunk j, batch row b, head h) of C tokens
 *   G = cumsum(g), Akk[i][j] = sum_d k_i k_j exp(G_i - G_j) (j < i), Aqk the same with q_i (j <= i),
 *   Tinv = (I + diag(beta) Akk)^{-1}, w = Tinv (beta k exp(G)), u = Tinv (beta v),
 *   qg = q exp(G), kd = k exp(G_C - G), decay_last = exp(G_C);
 * then per chunk  v_new = u - w S,  o = scale (qg S + Aqk v_new),  S <- diag(decay_last) S + kd^T v_new.
 * Only the chunk-level factoring exp(G_i - G_j) = exp(G_i) exp(-G_j) is done here (chunks that decay by at
 * most max_decay nats in every key dim); other units are flagged and left to kda_core.wy.wy_safe.
 *
 * Every product of a unit is computed the same way wherever the unit sits in a call (fixed loop order, no
 * dependence on the other units, on alignment or on threads): the chunk-grid facts of the Python form hold.
 * Two paths, chosen when the library is built: AVX-512F (built with -mavx512f: 8 x 32 matmul tiles on zmm
 * registers, elementwise passes 16 lanes wide) and AVX2/FMA (6 x 16 tiles on ymm, 8 lanes). Every output
 * element is the same sequence of operations on both (a matmul entry is one FMA chain over the inner index in
 * the same order; an elementwise lane the same ops), so the two paths give the same bits; only how many
 * elements run at once differs. Products whose left factor is lower triangular skip the zero blocks (adding
 * exact zeros changes nothing, so this is bitwise the full product).
 * Layouts: inputs [B, T, H, D] with any strides for B, T, H (D contiguous); unit results chunk-major
 * [NT, B, H, rows, cols] contiguous; h [NT + 1, B, H, K, V]; o [B, T, H, V] with any strides for B, T, H.
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The matmul tile (MR rows x NR columns, two vectors per row), chosen when the library is built. Its shapes: all
 * NR columns; nv < NR columns in two vectors (masked); nv <= NR / 2 columns in one vector (masked). */
enum { TILE_FULL, TILE_TWO, TILE_ONE };
#if defined(__AVX512F__)
#define VECTOR_BITS 512
#define MR 8
#define NR 32
#else
#define VECTOR_BITS 256
#define MR 6
#define NR 16
#endif

/* The vector width (bits) of the path this library was built with (the loader checks it against the flags). */
int kda_vector_bits(void) { return VECTOR_BITS; }

/* ---- exp on 8 floats: cephes_exp.h (Cephes expf; a NaN stays NaN) ---- */
#include "cephes_exp.h"

static float exp1(float x) {           /* the same formula on one float (tails of rows not a multiple of VW) */
    float buf[8] = {x, x, x, x, x, x, x, x};
    _mm256_storeu_ps(buf, exp8(_mm256_loadu_ps(buf)));
    return buf[0];
}

/* ---- the elementwise passes on VW floats at a time: 16 (zmm) on the AVX-512 path, else 8 (ymm). Each lane
 * runs the same operations in the same order on both paths, so the results are bitwise the same. ---- */
#if defined(__AVX512F__)
#define VW 16
typedef __m512 vfloat;
#define vexp exp16
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vmul _mm512_mul_ps
#define vneg(x) _mm512_sub_ps(_mm512_setzero_ps(), (x))
#else
#define VW 8
typedef __m256 vfloat;
#define vexp exp8
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vset1 _mm256_set1_ps
#define vmul _mm256_mul_ps
#define vneg(x) _mm256_sub_ps(_mm256_setzero_ps(), (x))
#endif

/* ---- matmul ----
 * acc[i][j] = sum_p A1[i*rs1 + p*cs1] B1[p*ld1 + j]  (p < k1, or p <= i's block end when tri1)
 *           + the same with (A2, B2, k2)  (optional second product)
 * then C[i][j] = alpha * acc (mode 0) or C[i][j] += alpha * acc (mode 1); i < m, j < n. */
typedef struct {
    const float *A; long rs, cs; const float *B; long ld; int k; int tri;
} Prod;

#if defined(__AVX512F__)
static inline __mmask16 tail_mask16(int nv) {  /* lanes [0, nv) of 16 */
    return nv <= 0 ? 0 : nv >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nv) - 1);
}

/* acc[r] over the products as below, two zmm per row: each output element is the same sequential chain of
 * FMAs over p as on the AVX2 path (same order, same rounding), only more of them at a time. */
static inline __attribute__((always_inline)) void tile(
        const int mr, const int shape, int nv, int r0, const Prod *p, int nprod,
        float *C, long ldc, float alpha, int mode) {
    const int full = shape == TILE_FULL, two = shape != TILE_ONE;
    __m512 c0[MR], c1[MR];
    for (int r = 0; r < mr; r++) { c0[r] = _mm512_setzero_ps(); c1[r] = _mm512_setzero_ps(); }
    __mmask16 m0 = 0xFFFF, m1 = 0xFFFF;
    if (!full) { m0 = tail_mask16(nv); m1 = tail_mask16(nv - 16); }
    for (int q = 0; q < nprod; q++) {
        const Prod *P = p + q;
        int kk = P->k;
        if (P->tri && r0 + mr < kk) kk = r0 + mr;
        const float *A = P->A + r0 * P->rs;
        const float *B = P->B;
        for (int s = 0; s < kk; s++) {
            __m512 b0, b1 = _mm512_setzero_ps();
            if (full) { b0 = _mm512_loadu_ps(B); b1 = _mm512_loadu_ps(B + 16); }
            else {
                b0 = _mm512_maskz_loadu_ps(m0, B);
                if (two) b1 = _mm512_maskz_loadu_ps(m1, B + 16);
            }
#pragma GCC unroll 16
            for (int r = 0; r < mr; r++) {
                __m512 a = _mm512_set1_ps(A[r * P->rs]);
                c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
                if (two) c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
            }
            A += P->cs;
            B += P->ld;
        }
    }
    __m512 al = _mm512_set1_ps(alpha);
    for (int r = 0; r < mr; r++) {
        float *Cr = C + (long)(r0 + r) * ldc;
        __m512 x0 = _mm512_mul_ps(al, c0[r]), x1 = _mm512_mul_ps(al, c1[r]);
        if (full) {
            if (mode) { x0 = _mm512_add_ps(_mm512_loadu_ps(Cr), x0); x1 = _mm512_add_ps(_mm512_loadu_ps(Cr + 16), x1); }
            _mm512_storeu_ps(Cr, x0);
            _mm512_storeu_ps(Cr + 16, x1);
        } else {
            if (mode) x0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, Cr), x0);
            _mm512_mask_storeu_ps(Cr, m0, x0);
            if (two) {
                if (mode) x1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, Cr + 16), x1);
                _mm512_mask_storeu_ps(Cr + 16, m1, x1);
            }
        }
    }
}
#else
static inline __m256i tail_mask(int nv) {  /* lanes [0, nv) of 8 */
    const int idx[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(nv), _mm256_loadu_si256((const __m256i *)idx));
}

static inline __attribute__((always_inline)) void tile(
        const int mr, const int shape, int nv, int r0, const Prod *p, int nprod,
        float *C, long ldc, float alpha, int mode) {
    const int full = shape == TILE_FULL, two = shape != TILE_ONE;
    __m256 c0[MR], c1[MR];
    for (int r = 0; r < mr; r++) { c0[r] = _mm256_setzero_ps(); c1[r] = _mm256_setzero_ps(); }
    __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();
    if (!full) { m0 = tail_mask(nv); m1 = tail_mask(nv - 8); }
    for (int q = 0; q < nprod; q++) {
        const Prod *P = p + q;
        int kk = P->k;
        if (P->tri && r0 + mr < kk) kk = r0 + mr;
        const float *A = P->A + r0 * P->rs;
        const float *B = P->B;
        for (int s = 0; s < kk; s++) {
            __m256 b0, b1 = _mm256_setzero_ps();
            if (full) { b0 = _mm256_loadu_ps(B); b1 = _mm256_loadu_ps(B + 8); }
            else {
                b0 = _mm256_maskload_ps(B, m0);
                if (two) b1 = _mm256_maskload_ps(B + 8, m1);
            }
#pragma GCC unroll 6
            for (int r = 0; r < mr; r++) {
                __m256 a = _mm256_broadcast_ss(A + r * P->rs);
                c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
                if (two) c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
            }
            A += P->cs;
            B += P->ld;
        }
    }
    __m256 al = _mm256_set1_ps(alpha);
    for (int r = 0; r < mr; r++) {
        float *Cr = C + (long)(r0 + r) * ldc;
        __m256 x0 = _mm256_mul_ps(al, c0[r]), x1 = _mm256_mul_ps(al, c1[r]);
        if (full) {
            if (mode) { x0 = _mm256_add_ps(_mm256_loadu_ps(Cr), x0); x1 = _mm256_add_ps(_mm256_loadu_ps(Cr + 8), x1); }
            _mm256_storeu_ps(Cr, x0);
            _mm256_storeu_ps(Cr + 8, x1);
        } else {
            if (mode) x0 = _mm256_add_ps(_mm256_maskload_ps(Cr, m0), x0);
            _mm256_maskstore_ps(Cr, m0, x0);
            if (two) {
                if (mode) x1 = _mm256_add_ps(_mm256_maskload_ps(Cr + 8, m1), x1);
                _mm256_maskstore_ps(Cr + 8, m1, x1);
            }
        }
    }
}
#endif

/* tile() with the row count mr (1..MR) and the shape constants: every loop over rows is fixed-length, so the
 * accumulators stay in registers (expanded inside gemm: a call through a separate function here made the AVX2
 * path 2x slower). */
#define TILE_CASE(M, SHAPE) case M: tile(M, SHAPE, nv, r0, pp, nprod, Cc, ldc, alpha, mode); break;
#if MR == 8
#define TILE_CASES(SHAPE)                                                                                   \
    switch (mr) {                                                                                           \
        TILE_CASE(8, SHAPE) TILE_CASE(7, SHAPE) TILE_CASE(6, SHAPE) TILE_CASE(5, SHAPE) TILE_CASE(4, SHAPE) \
        TILE_CASE(3, SHAPE) TILE_CASE(2, SHAPE) default: tile(1, SHAPE, nv, r0, pp, nprod, Cc, ldc, alpha, mode); \
    }
#elif MR == 6
#define TILE_CASES(SHAPE)                                                                                   \
    switch (mr) {                                                                                           \
        TILE_CASE(6, SHAPE) TILE_CASE(5, SHAPE) TILE_CASE(4, SHAPE) TILE_CASE(3, SHAPE) TILE_CASE(2, SHAPE) \
        default: tile(1, SHAPE, nv, r0, pp, nprod, Cc, ldc, alpha, mode);                                   \
    }
#else
#error "MR must be 6 or 8"
#endif

/* lower_out: only the columns up to the row block's last diagonal entry are computed, rounded up to a whole
 * vector (the result's lower triangle incl. the diagonal is exact; some entries above it are computed too, the
 * rest left untouched). */
static void gemm(int m, int n, const Prod *prods, int nprod, float *C, long ldc, float alpha, int mode, int lower_out) {
    for (int r0 = 0; r0 < m; r0 += MR) {
        int mr = m - r0 < MR ? m - r0 : MR;
        int nlim = lower_out && r0 + mr < n ? r0 + mr : n;
        for (int j0 = 0; j0 < nlim; j0 += NR) {
            int nv = n - j0 < NR ? n - j0 : NR;
            if (nlim - j0 < nv) nv = nlim - j0;
            Prod pp[2];
            for (int q = 0; q < nprod; q++) { pp[q] = prods[q]; pp[q].B += j0; }
            float *Cc = C + j0;
            if (nv == NR) { TILE_CASES(TILE_FULL) } else if (nv > NR / 2) { TILE_CASES(TILE_TWO) } else { TILE_CASES(TILE_ONE) }
        }
    }
}

/* ---- per-unit WY quantities ---- */
typedef struct {
    const float *ptr[5]; long st[5][3];   /* q, k, v, g, beta: base pointer, strides of B, T, H (elements) */
} Inputs;

static inline const float *row(const Inputs *in, int which, int b, long t, int h) {
    return in->ptr[which] + b * in->st[which][0] + t * in->st[which][1] + h * in->st[which][2];
}

/* Returns 1 when the unit decays by more than max_decay nats in some key dim (left to the safe form). */
static int unit_prepare(const Inputs *in, int b, int j, int h, int T, int C, int K, int V, float max_decay,
                        float *qg, float *Aqk, float *w, float *u, float *kd, float *dlast, float *scratch) {
    float *G = scratch, *eG = G + C * K, *kg = eG + C * K, *colsT = kg + C * K, *kgb = colsT + K * C;
    float *vb = kgb + C * K, *Akk = vb + C * V, *Tinv = Akk + C * C;
    long t0 = (long)j * C;
    int Tc = T - t0 < C ? (int)(T - t0) : C;
    /* the same head's next chunk is this thread's unit after the other heads of this chunk: start loading
     * its rows of q, k, v, g into L2 now (the inputs rarely sit in cache; ~3 % in an interleaved A/B here) */
    for (long t = t0 + C; t < t0 + 2 * C && t < T; t++)
        for (int x = 0; x < 4; x++) {
            const char *r = (const char *)row(in, x, b, t, h);
            int bytes = (x == 2 ? V : K) * (int)sizeof(float);
            for (int off = 0; off < bytes; off += 64) __builtin_prefetch(r + off, 0, 2);
        }
    /* G = cumsum(g) over the chunk's tokens (padding tokens: g = 0) */
    for (int i = 0; i < C; i++) {
        float *Gi = G + i * K;
        if (i < Tc) {
            const float *gi = row(in, 3, b, t0 + i, h);
            if (i == 0) memcpy(Gi, gi, K * sizeof(float));
            else for (int d = 0; d < K; d++) Gi[d] = Gi[d - K] + gi[d];
        } else if (i == 0) memset(Gi, 0, K * sizeof(float));       /* T = 0: an all-padding unit */
        else memcpy(Gi, Gi - K, K * sizeof(float));
    }
    const float *Glast = G + (C - 1) * K;
    for (int d = 0; d < K; d++)
        if (!(Glast[d] >= -max_decay)) return 1;
    int KV = K / VW * VW;                              /* key dims done VW at a time; the rest one by one */
    for (int i = 0; i < C; i++) {
        float *Gi = G + i * K, *ei = eG + i * K;
        int d = 0;
        for (; d < KV; d += VW) vstore(ei + d, vexp(vload(Gi + d)));
        for (; d < K; d++) ei[d] = exp1(Gi[d]);
    }
    const float *eGlast = eG + (C - 1) * K;
    memcpy(dlast, eGlast, K * sizeof(float));
    for (int i = 0; i < C; i++) {
        float *Gi = G + i * K, *ei = eG + i * K;
        float *qgi = qg + i * K, *kgi = kg + i * K, *kgbi = kgb + i * K, *kdi = kd + i * K, *vbi = vb + i * V;
        if (i >= Tc) {                                  /* padding token: k = q = v = 0, beta = 0 */
            memset(qgi, 0, K * sizeof(float)); memset(kgi, 0, K * sizeof(float));
            memset(kgbi, 0, K * sizeof(float)); memset(kdi, 0, K * sizeof(float));
            memset(vbi, 0, V * sizeof(float));
            for (int d = 0; d < K; d++) colsT[d * C + i] = 0.0f;
            continue;
        }
        const float *qi = row(in, 0, b, t0 + i, h), *ki = row(in, 1, b, t0 + i, h), *vi = row(in, 2, b, t0 + i, h);
        float bi = *row(in, 4, b, t0 + i, h);
        vfloat bb = vset1(bi);
        int d = 0;
        for (; d < KV; d += VW) {
            vfloat e = vload(ei + d), kk = vload(ki + d);
            vfloat en = vexp(vneg(vload(Gi + d)));                                       /* exp(-G) */
            vfloat kgv = vmul(kk, e), c = vmul(kk, en);
            vstore(qgi + d, vmul(vload(qi + d), e));
            vstore(kgi + d, kgv);
            vstore(kgbi + d, vmul(bb, kgv));
            vstore(kdi + d, vmul(c, vload(eGlast + d)));
            float cc[VW];
            vstore(cc, c);
            for (int x = 0; x < VW; x++) colsT[(d + x) * C + i] = cc[x];
        }
        for (; d < K; d++) {
            float e = ei[d], c = ki[d] * exp1(-Gi[d]);
            qgi[d] = qi[d] * e; kgi[d] = ki[d] * e; kgbi[d] = bi * kgi[d];
            kdi[d] = c * eGlast[d]; colsT[d * C + i] = c;
        }
        for (d = 0; d < V; d++) vbi[d] = bi * vi[d];
    }
    /* Akk (strict lower used) and Aqk (lower incl. the diagonal, the rest set to 0) */
    Prod pk = {kg, K, 1, colsT, C, K, 0};
    gemm(C, C, &pk, 1, Akk, C, 1.0f, 0, 1);
    Prod pq = {qg, K, 1, colsT, C, K, 0};
    gemm(C, C, &pq, 1, Aqk, C, 1.0f, 0, 1);
    for (int i = 0; i < C; i++)
        for (int jj = i + 1; jj < C; jj++) Aqk[i * C + jj] = 0.0f;
    /* Tinv = (I + diag(beta) Akk_strict)^{-1}, unit lower triangular, by rows:
     * Tinv[i] = e_i - sum_{j<i} beta_i Akk[i][j] Tinv[j] (row j is zero beyond column j) */
    memset(Tinv, 0, (size_t)C * C * sizeof(float));
    for (int i = 0; i < C; i++) {
        float *Ti = Tinv + i * C;
        float bi = i < Tc ? *row(in, 4, b, t0 + i, h) : 0.0f;
        int width = (i + 8) & ~7;                      /* columns [0, i] rounded up to 8 (zeros beyond) */
        if (width > C) width = C;
        if (C % 8 == 0) {
            int nb = width / 8;
            for (int x0 = 0; x0 < nb; x0 += 8) {       /* 8 column vectors at a time */
                int nx = nb - x0 < 8 ? nb - x0 : 8;
                __m256 acc[8];
                for (int x = 0; x < nx; x++) acc[x] = _mm256_setzero_ps();
                for (int jj = 0; jj < i; jj++) {
                    __m256 coef = _mm256_set1_ps(bi * Akk[i * C + jj]);
                    const float *Tj = Tinv + jj * C + 8 * x0;
                    for (int x = 0; x < nx; x++) acc[x] = _mm256_fmadd_ps(coef, _mm256_loadu_ps(Tj + 8 * x), acc[x]);
                }
                for (int x = 0; x < nx; x++)
                    _mm256_storeu_ps(Ti + 8 * (x0 + x), _mm256_sub_ps(_mm256_setzero_ps(), acc[x]));
            }
            for (int x = i + 1; x < width; x++) Ti[x] = 0.0f;   /* exact zeros above the diagonal, not -0 */
        } else {
            for (int jj = 0; jj < i; jj++) {
                float coef = bi * Akk[i * C + jj];
                const float *Tj = Tinv + jj * C;
                for (int x = 0; x <= jj; x++) Ti[x] = fmaf(coef, Tj[x], Ti[x]);
            }
            for (int x = 0; x < i; x++) Ti[x] = -Ti[x];
        }
        Ti[i] = 1.0f;
    }
    Prod pw = {Tinv, C, 1, kgb, K, C, 1};
    gemm(C, K, &pw, 1, w, K, 1.0f, 0, 0);
    Prod pu = {Tinv, C, 1, vb, V, C, 1};
    gemm(C, V, &pu, 1, u, V, 1.0f, 0, 0);
    return 0;
}

static size_t scratch_floats(int C, int K, int V) { return (size_t)5 * C * K + (size_t)C * V + 2 * (size_t)C * C + 16; }

/* The WY quantities of every unit of a [B, T, H, *] call, chunk-major [NT, B, H, ...]; slow[n] = 1 for the
 * units left to the safe form. Returns their number (-1 when out of memory). */
static int prepare_unit(const Inputs *in, long n, int B, int T, int H, int K, int V, int C, float max_decay,
                        float *qg, float *Aqk, float *w, float *u, float *kd, float *dlast, unsigned char *slow,
                        float *scratch) {
    int j = (int)(n / ((long)B * H)), b = (int)(n / H % B), h = (int)(n % H);
    int s = unit_prepare(in, b, j, h, T, C, K, V, max_decay, qg + n * C * K, Aqk + n * C * C,
                         w + n * C * K, u + n * C * V, kd + n * C * K, dlast + n * K, scratch);
    slow[n] = (unsigned char)s;
    return s;
}

int kda_prepare(int B, int T, int H, int K, int V, int C, float max_decay,
                const float *q, const float *k, const float *v, const float *g, const float *beta, const long *strides,
                float *qg, float *Aqk, float *w, float *u, float *kd, float *dlast, unsigned char *slow, int nthreads) {
    Inputs in = {{q, k, v, g, beta}, {{0}}};
    for (int x = 0; x < 5; x++) for (int y = 0; y < 3; y++) in.st[x][y] = strides[3 * x + y];
    int NT = (T + C - 1) / C;
    if (NT < 1) NT = 1;
    long n_units = (long)NT * B * H;
    size_t per = (scratch_floats(C, K, V) + 15) / 16 * 16;
    float *scratch = aligned_alloc(64, per * nthreads * sizeof(float));
    if (!scratch) return -1;
    int nslow = 0;
    if (nthreads > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+ : nslow)
        for (long n = 0; n < n_units; n++)
            nslow += prepare_unit(&in, n, B, T, H, K, V, C, max_decay, qg, Aqk, w, u, kd, dlast, slow,
                                  scratch + per * omp_get_thread_num());
    } else {                       /* no OpenMP call at all on one thread: safe in a process forked after one */
        for (long n = 0; n < n_units; n++)
            nslow += prepare_unit(&in, n, B, T, H, K, V, C, max_decay, qg, Aqk, w, u, kd, dlast, slow, scratch);
    }
    free(scratch);
    return nslow;
}

/* One unit's scan step and / or outputs: S [K, V] the state before the chunk, Sn [K, V] the state after it
 * (do_scan), vn [C, V] v_new (written when do_scan, else read); orow: the unit's first output row, rows
 * ldo apart, Tc of them written (do_out). */
static void unit_scan_out(int K, int V, int C, int Tc, float scale, const float *qg, const float *Aqk,
                          const float *w, const float *u, const float *kd, const float *dl,
                          const float *S, float *Sn, float *vn, float *orow, long ldo, int do_scan, int do_out) {
    if (do_scan) {
        memcpy(vn, u, (size_t)C * V * sizeof(float));
        Prod pv = {w, K, 1, S, V, K, 0};
        gemm(C, V, &pv, 1, vn, V, -1.0f, 1, 0);                 /* u - w S */
    }
    if (do_out) {
        Prod po[2] = {{qg, K, 1, S, V, K, 0}, {Aqk, C, 1, vn, V, C, 1}};
        gemm(Tc, V, po, 2, orow, ldo, scale, 0, 0);              /* scale (qg S + Aqk v_new) */
    }
    if (do_scan) {
        for (int r = 0; r < K; r++) {
            vfloat dr = vset1(dl[r]);
            const float *Sr = S + (long)r * V;
            float *Snr = Sn + (long)r * V;
            int c = 0;
            for (; c + VW <= V; c += VW) vstore(Snr + c, vmul(dr, vload(Sr + c)));
            for (; c < V; c++) Snr[c] = dl[r] * Sr[c];
        }
        Prod ps = {kd, 1, K, vn, V, C, 0};                      /* kd^T: A[r][p] = kd[p][r] */
        gemm(K, V, &ps, 1, Sn, V, 1.0f, 1, 0);                   /* diag(exp(G_C)) S + kd^T v_new */
    }
}

static void scan_sequence(long s, int NT, int B, int H, int K, int V, int C, int T, float scale,
                          const float *qg, const float *Aqk, const float *w, const float *u, const float *kd,
                          const float *dlast, float *h, float *v_new, float *o, const long *so, int do_scan, int do_out) {
    long BH = (long)B * H;
    int b = (int)(s / H), hh = (int)(s % H);
    for (int j = 0; j < NT; j++) {
        long n = (long)j * BH + s, t0 = (long)j * C;
        int Tc = T - t0 < C ? (int)(T - t0) : C;
        unit_scan_out(K, V, C, Tc, scale, qg + n * C * K, Aqk + n * C * C, w + n * C * K, u + n * C * V,
                      kd + n * C * K, dlast + n * K, h + n * K * V, h + (n + BH) * K * V, v_new + n * C * V,
                      do_out ? o + b * so[0] + t0 * so[1] + hh * so[2] : NULL, do_out ? so[1] : 0, do_scan, do_out);
    }
}

/* The scan and / or the outputs over NT chunks of B * H sequences (chunk-major unit results).
 * do_scan: v_new = u - w S into v_new, S <- diag(decay_last) S + kd^T v_new into h[j + 1] (h[0] given).
 * do_out: o rows (the first T tokens) = scale (qg S + Aqk v_new) with S = h[j]; o at (b, t, h) is
 * o + b * so[0] + t * so[1] + h * so[2]. */
void kda_scan_outputs(int NT, int B, int H, int K, int V, int C, int T, float scale,
                      const float *qg, const float *Aqk, const float *w, const float *u, const float *kd,
                      const float *dlast, float *h, float *v_new, float *o, const long *so, int do_scan, int do_out, int nthreads) {
    long BH = (long)B * H;
    if (nthreads > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (long s = 0; s < BH; s++)
            scan_sequence(s, NT, B, H, K, V, C, T, scale, qg, Aqk, w, u, kd, dlast, h, v_new, o, so, do_scan, do_out);
    } else {
        for (long s = 0; s < BH; s++)
            scan_sequence(s, NT, B, H, K, V, C, T, scale, qg, Aqk, w, u, kd, dlast, h, v_new, o, so, do_scan, do_out);
    }
}

/* Unit (chunk j, sequence s) of kda_forward: its WY quantities in scratch, then its scan step and outputs.
 * Returns 1 (nothing written) when the unit is beyond the chunk-level bound. */
static int forward_unit(const Inputs *in, int j, long s, int B, int T, int H, int K, int V, int C, float max_decay,
                        float scale, float *h, float *o, const long *so, float *mine) {
    long BH = (long)B * H;
    float *qg = mine + scratch_floats(C, K, V), *kd = qg + C * K, *w = kd + C * K, *Aqk = w + C * K;
    float *u = Aqk + C * C, *vn = u + C * V, *dl = vn + C * V;
    if (unit_prepare(in, (int)(s / H), j, (int)(s % H), T, C, K, V, max_decay, qg, Aqk, w, u, kd, dl, mine))
        return 1;
    long n = (long)j * BH + s, t0 = (long)j * C;
    int Tc = T - t0 < C ? (int)(T - t0) : C;
    unit_scan_out(K, V, C, Tc, scale, qg, Aqk, w, u, kd, dl, h + n * K * V, h + (n + BH) * K * V, vn,
                  o + (s / H) * so[0] + t0 * so[1] + (s % H) * so[2], so[1], 1, 1);
    return 0;
}

/* The whole forward, chunk by chunk: each unit's WY quantities in scratch, then its scan step and outputs
 * (the same arithmetic as kda_prepare then kda_scan_outputs, without the unit tensors in memory). h [NT + 1,
 * B, H, K, V] with h[0] given; o as kda_scan_outputs. Stops before the first chunk holding a unit beyond the
 * chunk-level bound and returns its index (NT when every chunk was done; -1 when out of memory): the caller
 * runs the chunks from there with kda_prepare / the safe form / kda_scan_outputs. */
int kda_forward(int B, int T, int H, int K, int V, int C, float max_decay, float scale,
                const float *q, const float *k, const float *v, const float *g, const float *beta, const long *strides,
                float *h, float *o, const long *so, int nthreads) {
    Inputs in = {{q, k, v, g, beta}, {{0}}};
    for (int x = 0; x < 5; x++) for (int y = 0; y < 3; y++) in.st[x][y] = strides[3 * x + y];
    int NT = (T + C - 1) / C;
    if (NT < 1) NT = 1;
    long BH = (long)B * H;
    size_t unit = (size_t)3 * C * K + (size_t)C * C + (size_t)2 * C * V + K;     /* qg kd w, Aqk, u vn, dlast */
    size_t per = (scratch_floats(C, K, V) + unit + 15) / 16 * 16;
    float *scratch = aligned_alloc(64, per * nthreads * sizeof(float));
    if (!scratch) return -1;
    int stop = NT;          /* the first chunk holding a unit beyond the bound (only ever lowered) */
    if (nthreads <= 1) {    /* no OpenMP call at all on one thread: safe in a process forked after one */
        for (int j = 0; j < NT && stop == NT; j++)
            for (long s = 0; s < BH; s++)
                if (forward_unit(&in, j, s, B, T, H, K, V, C, max_decay, scale, h, o, so, scratch)) {
                    stop = j;      /* a chunk left part-done is redone whole by the caller, to the same bits */
                    break;
                }
        free(scratch);
        return stop;
    }
#pragma omp parallel num_threads(nthreads)
    {
        float *mine = scratch + per * omp_get_thread_num();
        for (int j = 0; j < NT; j++) {
#pragma omp for schedule(static)
            for (long s = 0; s < BH; s++)
                if (forward_unit(&in, j, s, B, T, H, K, V, C, max_decay, scale, h, o, so, mine)) {
#pragma omp critical(kda_stop)
                    if (j < stop) stop = j;
                }
            /* after the loop's barrier every thread sees the flags of chunks <= j (later ones are > j) */
            int st;
#pragma omp critical(kda_stop)
            st = stop;
            if (st <= j) break;
        }
    }
    free(scratch);
    return stop;
}

