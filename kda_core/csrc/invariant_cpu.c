/* The C forms of kda_core.invariant's row-invariant ops (fp32): the GEMM of linear and the RMSNorm of rmsnorm.
 *
 * GEMM: out[m, n] = sum_k x[m, k] * W[n, k].
 *
 * Every output is ONE accumulator that starts at +0 and takes x[m, k] * W[n, k] for k = 0, 1, ..., K - 1 in
 * that order, each step a fused multiply-add (rounded once). The order never depends on M, N, the tile, the
 * thread or the vector width: K is never split and partial sums are never reassociated. Since an FMA is
 * exactly rounded, the AVX-512 tiles, the AVX2 tiles, the masked tails and the scalar fmaf loop
 * (linear_ref_f32) all give the same bits, so row m of the result is the same bits for any number of rows:
 * row-invariant by construction, without padding the rows (MKL's sgemm changes its kernel, and its
 * summation order, below 16 rows; the torch form pads to 16 for that reason).
 *
 * The weight is packed once (linear_pack_f32) into panels of PANEL = 16 output columns, k-major:
 * packed[p][k][j] = W[16 p + j, k] (0 past N), so a tile's step k reads 16 consecutive floats per panel and
 * broadcasts x[m, k]: a register-blocked microkernel of MR rows x J panels (AVX-512: up to 6 x 4 zmm
 * accumulators; AVX2: up to 4 x 2 panels of 2 ymm each).
 *
 * RMSNorm: y[m, :] = (x[m, :] * r) * w with r = 1 / sqrt(ss / D + eps); ss = sum_d x[m, d]^2 in a fixed order: 16
 * partial sums (lane j takes d = j, j + 16, ... by fmaf from +0), then added pairwise in a fixed tree. One row at a
 * time, the same order for any number of rows and on either path.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>
#include <immintrin.h>

#define PANEL 16

int linear_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#else
    return 256;
#endif
}

/* packed [ceil(N / 16), K, 16] from w [N, K] (row stride ldw). */
void linear_pack_f32(int N, int K, const float *w, long ldw, float *packed) {
    int np = (N + PANEL - 1) / PANEL;
    for (int p = 0; p < np; p++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < PANEL; j++) {
                int n = p * PANEL + j;
                packed[((long)p * K + k) * PANEL + j] = n < N ? w[(long)n * ldw + k] : 0.0f;
            }
}

/* The scalar reference: the same order, one fmaf per step. */
void linear_ref_f32(int M, int N, int K, const float *x, long ldx, const float *w, long ldw, float *out, long ldo) {
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++)
                acc = fmaf(x[(long)m * ldx + k], w[(long)n * ldw + k], acc);
            out[(long)m * ldo + n] = acc;
        }
}

/* Store 16 columns (a panel) of one row: all of them, or the first `valid` ones. */
static inline void store_cols(float *dst, const float *acc16, int valid) {
    memcpy(dst, acc16, sizeof(float) * valid);
}

#if defined(__AVX512F__)
#define MR_MAX 6
#define J_MAX 4
/* One tile: MR rows (m0..) x J panels (p0..); `nvalid` columns valid in the last panel. */
static inline __attribute__((always_inline)) void tile(int MR, int J, int K, const float *x, long ldx,
                                                       const float *packed, float *out, long ldo, int n0,
                                                       int last_valid) {
    __m512 acc[MR_MAX][J_MAX];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();
    const float *pp = packed;
    for (int k = 0; k < K; k++) {
        __m512 wv[J_MAX];
        for (int j = 0; j < J; j++) wv[j] = _mm512_loadu_ps(pp + ((long)j * K + k) * PANEL);
        for (int r = 0; r < MR; r++) {
            __m512 xv = _mm512_set1_ps(x[(long)r * ldx + k]);
            for (int j = 0; j < J; j++) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < J; j++) {
            float *dst = out + (long)r * ldo + n0 + j * PANEL;
            if (j < J - 1 || last_valid == PANEL) _mm512_storeu_ps(dst, acc[r][j]);
            else _mm512_mask_storeu_ps(dst, (__mmask16)((1u << last_valid) - 1u), acc[r][j]);
        }
}
#elif defined(__AVX2__)
#define MR_MAX 4
#define J_MAX 2
static inline __attribute__((always_inline)) void tile(int MR, int J, int K, const float *x, long ldx,
                                                       const float *packed, float *out, long ldo, int n0,
                                                       int last_valid) {
    __m256 acc[MR_MAX][2 * J_MAX];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 2 * J; j++) acc[r][j] = _mm256_setzero_ps();
    const float *pp = packed;
    for (int k = 0; k < K; k++) {
        __m256 wv[2 * J_MAX];
        for (int j = 0; j < J; j++) {
            wv[2 * j] = _mm256_loadu_ps(pp + ((long)j * K + k) * PANEL);
            wv[2 * j + 1] = _mm256_loadu_ps(pp + ((long)j * K + k) * PANEL + 8);
        }
        for (int r = 0; r < MR; r++) {
            __m256 xv = _mm256_broadcast_ss(x + (long)r * ldx + k);
            for (int j = 0; j < 2 * J; j++) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < J; j++) {
            float *dst = out + (long)r * ldo + n0 + j * PANEL;
            if (j < J - 1 || last_valid == PANEL) {
                _mm256_storeu_ps(dst, acc[r][2 * j]);
                _mm256_storeu_ps(dst + 8, acc[r][2 * j + 1]);
            } else {
                float buf[PANEL];
                _mm256_storeu_ps(buf, acc[r][2 * j]);
                _mm256_storeu_ps(buf + 8, acc[r][2 * j + 1]);
                store_cols(dst, buf, last_valid);
            }
        }
}
#else
#error "invariant_cpu.c needs AVX2 + FMA or AVX-512F (kda_core.cpu_build.ISAS)"
#endif

/* Constant MR and J per call site, so that each instance unrolls into registers. */
#define TILE_CASE(mr, j) tile(mr, j, K, xr, ldx, pp, orow, ldo, n0, last_valid)
static void tile_dispatch(int mr, int j, int K, const float *xr, long ldx, const float *pp, float *orow, long ldo,
                          int n0, int last_valid) {
#if defined(__AVX512F__)
#define ROWS(j) switch (mr) { case 6: TILE_CASE(6, j); break; case 5: TILE_CASE(5, j); break; \
    case 4: TILE_CASE(4, j); break; case 3: TILE_CASE(3, j); break; case 2: TILE_CASE(2, j); break; \
    default: TILE_CASE(1, j); }
    switch (j) { case 4: ROWS(4) break; case 3: ROWS(3) break; case 2: ROWS(2) break; default: ROWS(1) }
#elif defined(__AVX2__)
#define ROWS(j) switch (mr) { case 4: TILE_CASE(4, j); break; case 3: TILE_CASE(3, j); break; \
    case 2: TILE_CASE(2, j); break; default: TILE_CASE(1, j); }
    switch (j) { case 2: ROWS(2) break; default: ROWS(1) }
#endif
}

/* Column group g (J_MAX panels from panel g J_MAX) of every row. */
static void column_group(int g, int np, int M, int N, int K, const float *x, long ldx, const float *packed,
                         float *out, long ldo) {
    int p0 = g * J_MAX;
    int j = np - p0 < J_MAX ? np - p0 : J_MAX;
    int n0 = p0 * PANEL;
    int last_valid = N - (p0 + j - 1) * PANEL;
    if (last_valid > PANEL) last_valid = PANEL;
    const float *pp = packed + (long)p0 * K * PANEL;
    for (int m = 0; m < M; m += MR_MAX) {
        int mr = M - m < MR_MAX ? M - m : MR_MAX;
        tile_dispatch(mr, j, K, x + (long)m * ldx, ldx, pp, out + (long)m * ldo, ldo, n0, last_valid);
    }
}

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) @ W^T, W packed by linear_pack_f32. Column groups of
 * J_MAX panels are shared among `threads` OpenMP threads (any split: every output's order is the same); one thread
 * runs them without entering OpenMP (an inactive parallel region still costs ~0.7 us a call: a decode step's
 * small GEMMs are a few us each). */
int linear_f32(int M, int N, int K, const float *x, long ldx, const float *packed, float *out, long ldo,
               int threads) {
    if (M < 0 || N < 0 || K < 0) return 1;
    if (M == 0 || N == 0) return 0;
    int np = (N + PANEL - 1) / PANEL;
    int ngroups = (np + J_MAX - 1) / J_MAX;
    if (threads < 1 || (double)M * N * K < 4.0e6) threads = 1;
    if (threads == 1) {
        for (int g = 0; g < ngroups; g++) column_group(g, np, M, N, K, x, ldx, packed, out, ldo);
        return 0;
    }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int g = 0; g < ngroups; g++) column_group(g, np, M, N, K, x, ldx, packed, out, ldo);
    return 0;
}

/* y [M, D] (row stride ldy) = RMSNorm of x [M, D] (row stride ldx) with weight w [D]. */
void rmsnorm_f32(int M, int D, const float *x, long ldx, const float *w, float eps, float *y, long ldy) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + (long)m * ldx;
        float *yr = y + (long)m * ldy;
        float acc[16] = {0};
        int d = 0;
        for (; d + 16 <= D; d += 16)
            for (int j = 0; j < 16; j++) acc[j] = fmaf(xr[d + j], xr[d + j], acc[j]);
        for (int j = 0; d + j < D; j++) acc[j] = fmaf(xr[d + j], xr[d + j], acc[j]);
        for (int h = 8; h >= 1; h /= 2)
            for (int j = 0; j < h; j++) acc[j] = acc[j] + acc[j + h];
        float ss = acc[0];
        float r = 1.0f / sqrtf(ss / (float)D + eps);
        for (int e = 0; e < D; e++) yr[e] = (xr[e] * r) * w[e];
    }
}
