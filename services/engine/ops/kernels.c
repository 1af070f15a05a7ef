/* kvrelay CPU kernels for small steps (decode): AVX2 + FMA, fp32 activations, fp32 or bf16 weights.
 *
 * Built at first use by services/engine/ops/build.py (gcc -O3 -mavx2 -mfma -ffp-contract=off -fopenmp)
 * and called through ctypes from services/engine/ops/cpu.py. Each entry point has a torch reference in
 * services/engine/ops/reference.py, and tests/unit/test_ops_cpu.py checks that they agree.
 *
 * Layouts (row-major, strides in elements):
 *   activations x [M, ldx], weights w [N, K] (bf16 as raw uint16 or fp32), outputs y [M, ldy];
 *   KV cache [num_slots, 2, num_kv_heads, head_dim], slot = block_id * block_size + offset.
 *
 * Batch invariance: every output element of a token is computed with the same operation order whatever
 * the number of tokens in the call, so a sequence gets bitwise the same numbers alone or in a batch.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define TILE_M 4 /* tokens that share one pass over a weight row */

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 load_w(const void *w, int64_t i, const int is_bf16) {
    if (is_bf16) {
        __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    }
    return _mm256_loadu_ps((const float *)w + i);
}

/* exp(x) for 8 lanes: Cephes-style range reduction and degree-5 polynomial, relative error ~2e-7. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Dot products of one weight row with MB activation rows. Chunk c of 8 lanes always goes to accumulator
 * c % 2 and the result is hsum(a0 + a1), for every MB: the order does not depend on the batch. */
static inline __attribute__((always_inline)) void row_dot(const float *x, int64_t ldx, const int MB,
                                                          const void *w, int64_t K, const int is_bf16,
                                                          float *out) {
    __m256 a0[TILE_M], a1[TILE_M];
    for (int m = 0; m < MB; m++) {
        a0[m] = _mm256_setzero_ps();
        a1[m] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = load_w(w, k, is_bf16), w1 = load_w(w, k + 8, is_bf16);
        for (int m = 0; m < MB; m++) {
            a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * ldx + k), a0[m]);
            a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * ldx + k + 8), a1[m]);
        }
    }
    if (k < K) {
        __m256 w0 = load_w(w, k, is_bf16);
        for (int m = 0; m < MB; m++) a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * ldx + k), a0[m]);
    }
    for (int m = 0; m < MB; m++) out[m] = hsum8(_mm256_add_ps(a0[m], a1[m]));
}

static inline __attribute__((always_inline)) void row_dot_any(const float *x, int64_t ldx, int mb,
                                                              const void *w, int64_t K, const int is_bf16,
                                                              float *out) {
    switch (mb) {
    case 1: row_dot(x, ldx, 1, w, K, is_bf16, out); break;
    case 2: row_dot(x, ldx, 2, w, K, is_bf16, out); break;
    case 3: row_dot(x, ldx, 3, w, K, is_bf16, out); break;
    default: row_dot(x, ldx, 4, w, K, is_bf16, out); break;
    }
}

/* xn[m, :] = x[m, :] / sqrt(mean(x[m, :]^2) + eps) * weight, the RMSNorm of Llama. */
void kr_rms_norm(const float *x, int64_t ldx, const float *weight, float *xn, int64_t ldn, int64_t M,
                 int64_t K, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * ldx;
        double sum = 0.0;
        for (int64_t k = 0; k < K; k++) sum += (double)row[k] * row[k];
        float inv = 1.0f / sqrtf((float)(sum / (double)K) + eps);
        for (int64_t k = 0; k < K; k++) xn[m * ldn + k] = (row[k] * inv) * weight[k];
    }
}

/* y[m, n] = sum_k x[m, k] * w[n, k] (accumulate = 0), or y[m, n] += that sum (accumulate = 1).
 * K must be a multiple of 8. Threads split the rows of w, so each thread streams one contiguous range. */
void kr_linear(const float *x, int64_t ldx, const void *w, int w_bf16, float *y, int64_t ldy, int64_t M,
               int64_t N, int64_t K, int accumulate, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const void *row = w_bf16 ? (const void *)((const uint16_t *)w + n * K) : (const void *)((const float *)w + n * K);
        for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
            float dots[TILE_M];
            int mb = (int)(M - m0 < TILE_M ? M - m0 : TILE_M);
            if (w_bf16)
                row_dot_any(x + m0 * ldx, ldx, mb, row, K, 1, dots);
            else
                row_dot_any(x + m0 * ldx, ldx, mb, row, K, 0, dots);
            for (int m = 0; m < mb; m++) {
                float *dst = y + (m0 + m) * ldy + n;
                *dst = accumulate ? *dst + dots[m] : dots[m];
            }
        }
    }
}

/* out[m, i] = silu(gu[m, i]) * gu[m, inter + i], with silu(g) = g / (1 + exp(-g)). */
void kr_silu_mul(const float *gu, int64_t ldg, float *out, int64_t ldo, int64_t M, int64_t inter,
                 int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * ldg, *u = g + inter;
        float *o = out + m * ldo;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 sig = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotate q and k of each token in place (rotate-half layout: x * cos + rotate_half(x) * sin), then write
 * k and v into the token's cache slot. qkv [M, ldq] holds q (num_heads * head_dim), k, v per token. */
void kr_rope_write_kv(float *qkv, int64_t ldq, int64_t M, int num_heads, int num_kv_heads, int head_dim,
                      const int64_t *positions, const float *cos_table, const float *sin_table, float *cache,
                      const int64_t *slots) {
    const int half = head_dim / 2;
    const int64_t kv_size = (int64_t)num_kv_heads * head_dim;
    for (int64_t t = 0; t < M; t++) {
        float *tok = qkv + t * ldq;
        const float *c = cos_table + positions[t] * head_dim, *s = sin_table + positions[t] * head_dim;
        for (int h = 0; h < num_heads + num_kv_heads; h++) {
            float *x = tok + (int64_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                float a = x[i], b = x[i + half];
                x[i] = a * c[i] + (-b) * s[i];
                x[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
        float *dst = cache + slots[t] * 2 * kv_size;
        const float *k = tok + (int64_t)num_heads * head_dim;
        for (int64_t i = 0; i < 2 * kv_size; i++) dst[i] = k[i];
    }
}

/* One query head of one token attends to its sequence's keys 0..position (causal), read through the
 * block table. scores is scratch of at least position + 1 floats. */
static void attend_one(const float *q, float *out, int head_dim, const float *cache, int64_t kv_stride,
                       int64_t v_offset, const int64_t *block_table, int64_t block_size, int64_t ctx,
                       float scale, float *scores) {
    float max_score = -INFINITY;
    for (int64_t j = 0; j < ctx; j++) {
        const float *k = cache + (block_table[j / block_size] * block_size + j % block_size) * kv_stride;
        __m256 acc = _mm256_setzero_ps();
        for (int d = 0; d < head_dim; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
        scores[j] = hsum8(acc) * scale;
        if (scores[j] > max_score) max_score = scores[j];
    }
    __m256 vmax = _mm256_set1_ps(max_score), vsum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= ctx; j += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vmax));
        _mm256_storeu_ps(scores + j, p);
        vsum = _mm256_add_ps(vsum, p);
    }
    float sum = hsum8(vsum);
    for (; j < ctx; j++) {
        scores[j] = expf(scores[j] - max_score);
        sum += scores[j];
    }
    for (int d0 = 0; d0 < head_dim; d0 += 32) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        int width = head_dim - d0 < 32 ? head_dim - d0 : 32;
        for (int64_t i = 0; i < ctx; i++) {
            const float *v = cache + (block_table[i / block_size] * block_size + i % block_size) * kv_stride
                             + v_offset + d0;
            __m256 p = _mm256_set1_ps(scores[i]);
            for (int c = 0; c < width / 8; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
        }
        __m256 inv = _mm256_set1_ps(1.0f / sum);
        for (int c = 0; c < width / 8; c++) _mm256_storeu_ps(out + d0 + 8 * c, _mm256_mul_ps(acc[c], inv));
    }
}

/* out[t, h * head_dim:] = causal attention of token t's head h over its own sequence, for every token.
 * q [M, ldq]; token t belongs to row token_rows[t] of block_tables [rows, ld_bt] and sits at positions[t].
 * scratch [num_threads, ld_scratch] with ld_scratch > every position. head_dim must be a multiple of 8. */
void kr_paged_attention(const float *q, int64_t ldq, float *out, int64_t ldo, int64_t M, int num_heads,
                        int num_kv_heads, int head_dim, const float *cache, const int64_t *block_tables,
                        int64_t ld_bt, const int64_t *token_rows, const int64_t *positions,
                        int64_t block_size, float scale, float *scratch, int64_t ld_scratch,
                        int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int64_t kv_stride = 2 * (int64_t)num_kv_heads * head_dim;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = scratch + omp_get_thread_num() * ld_scratch;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < M * num_heads; task++) {
            int64_t t = task / num_heads;
            int h = (int)(task % num_heads), g = h / group;
            attend_one(q + t * ldq + (int64_t)h * head_dim, out + t * ldo + (int64_t)h * head_dim, head_dim,
                       cache + (int64_t)g * head_dim, kv_stride, (int64_t)num_kv_heads * head_dim,
                       block_tables + token_rows[t] * ld_bt, block_size, positions[t] + 1, scale, scores);
        }
    }
}
