/* kvrelay CPU kernels for small steps (decode): AVX2 + FMA, fp32 activations, weights in fp32, bf16 or
 * the GGUF block formats Q8_0 and Q4_1 (kept as stored: their kernels are in blocks.h, and ops/quant.py).
 *
 * Built at first use by services/engine/ops/build.py (gcc -O3 -mavx2 -mfma -mf16c -ffp-contract=off
 * -fopenmp, and -mavxvnni / -mavx512vnni where the CPU has AVX-VNNI / AVX512-VNNI: the same bits, fewer
 * instructions for the int8 dot products of GGUF blocks) and called through ctypes from
 * services/engine/ops/cpu.py. Each op has a torch twin that tests compare it with: ops/reference.py
 * (tests/unit/test_ops_cpu.py), attention.reference_attention (tests/unit/test_attention.py), and for
 * kr_llama_layers the model's torch path (tests/unit/test_ops_llama_layers.py).
 *
 * Layouts (row-major, strides in elements):
 *   activations x [M, ldx], weights w [N, K] (bf16 as raw uint16 or fp32), outputs y [M, ldy];
 *   KV cache [num_slots, 2, num_kv_heads, head_dim], slot = block_id * block_size + offset, in fp32 or
 *   fp16 (kv_f16: engine.kv_cache_dtype; written rounded to nearest even, as torch's .to(float16), and
 *   widened exactly to fp32 on every read, so attention's arithmetic is fp32 either way).
 *
 * Batch invariance: every output element of a token is computed with the same operation order whatever
 * the number of tokens in the call, so a sequence gets bitwise the same numbers alone or in a batch.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE_M 4 /* tokens that share one pass over a weight row */

/* Runs `call` with MB, the number of tokens in this tile (1..TILE_M), as a compile-time constant, so the
 * always-inline row-dot functions it calls unroll their loops over the tile for each height. */
#define WITH_TILE_HEIGHT(mb, call)                                                                  \
    do {                                                                                            \
        switch (mb) {                                                                               \
        case 1: { enum { MB = 1 }; call; } break;                                                   \
        case 2: { enum { MB = 2 }; call; } break;                                                   \
        case 3: { enum { MB = 3 }; call; } break;                                                   \
        default: { enum { MB = TILE_M }; call; } break;                                             \
        }                                                                                           \
    } while (0)

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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

/* Dot products of one weight row with MB activation rows, over 16 weights per step: half of the products
 * go to accumulator a0 and half to a1 (fp32: elements 0-7 and 8-15; bf16: even and odd elements), and the
 * result is hsum(a0 + a1) for every MB, so the order of the sums does not depend on the batch. bf16 rows
 * are read 16 at a time and split into their even and odd elements with one shift and one mask (cheaper
 * than widening 8 at a time); x must then be given with each 16-block reordered as [even elements | odd
 * elements] (see permute_even_odd). */
static inline __attribute__((always_inline)) void row_dot(const float *x, int64_t ldx, const int MB,
                                                          const void *w, int64_t K, const int is_bf16,
                                                          float *out) {
    const __m256i high_half = _mm256_set1_epi32((int)0xffff0000u);
    __m256 a0[TILE_M], a1[TILE_M];
    for (int m = 0; m < MB; m++) {
        a0[m] = _mm256_setzero_ps();
        a1[m] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 w0, w1;
        if (is_bf16) {
            const uint16_t *p = (const uint16_t *)w + k;
            _mm_prefetch((const char *)p + 256, _MM_HINT_T0);
            __m256i v = _mm256_loadu_si256((const __m256i *)p);
            w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            w1 = _mm256_castsi256_ps(_mm256_and_si256(v, high_half));
        } else {
            const float *p = (const float *)w + k;
            _mm_prefetch((const char *)p + 512, _MM_HINT_T0);
            w0 = _mm256_loadu_ps(p);
            w1 = _mm256_loadu_ps(p + 8);
        }
        for (int m = 0; m < MB; m++) {
            a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * ldx + k), a0[m]);
            a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * ldx + k + 8), a1[m]);
        }
    }
    if (k < K) { /* K % 16 == 8: one last block of 8, in natural order */
        __m256 w0;
        if (is_bf16) {
            __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
            w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
        } else {
            w0 = _mm256_loadu_ps((const float *)w + k);
        }
        for (int m = 0; m < MB; m++) a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * ldx + k), a0[m]);
    }
    for (int m = 0; m < MB; m++) out[m] = hsum8(_mm256_add_ps(a0[m], a1[m]));
}

#include "blocks.h"

/* 8 fp32 to bf16, rounded to nearest even (torch's .to(bfloat16) for every finite value). */
static inline __m128i to_bf16(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

/* out [N, K] = the weights of w [N, K] in a block format, as fp32, or as bf16 (raw uint16) where out_bf16
 * (the prefill path's per-matrix unpacking: fp32 GEMM, or bf16 GEMM where bf16 runs in hardware). */
void kr_dequantize(const void *w, int format, void *out, int64_t N, int64_t K, int out_bf16,
                   int num_threads) {
    const int64_t num_blocks = K / QK, stride = row_bytes(format, K);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const char *row = (const char *)w + n * stride;
        for (int64_t b = 0; b < num_blocks; b++) {
            __m256 q[4];
            float d, m;
            block_weights(row, b, num_blocks, format, q, &d, &m);
            const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
            const int64_t at = n * K + b * QK;
            for (int c = 0; c < 4; c++) {
                const __m256 v = _mm256_fmadd_ps(dv, q[c], mv);
                if (out_bf16)
                    _mm_storeu_si128((__m128i *)((uint16_t *)out + at + 8 * c), to_bf16(v));
                else
                    _mm256_storeu_ps((float *)out + at + 8 * c, v);
            }
        }
    }
}

/* xp [M, K] = x [M, ldx] with each full 16-block reordered as [elements 0, 2, .., 14 | 1, 3, .., 15]. */
static void permute_even_odd(const float *x, int64_t ldx, float *xp, int64_t M, int64_t K) {
    for (int64_t m = 0; m < M; m++) {
        const float *src = x + m * ldx;
        float *dst = xp + m * K;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            __m256 lo = _mm256_loadu_ps(src + k), hi = _mm256_loadu_ps(src + k + 8);
            __m256 even = _mm256_shuffle_ps(lo, hi, 0x88), odd = _mm256_shuffle_ps(lo, hi, 0xDD);
            _mm256_storeu_ps(dst + k, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8)));
            _mm256_storeu_ps(dst + k + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xD8)));
        }
        for (; k < K; k++) dst[k] = src[k];
    }
}

/* xn[m, :] = x[m, :] / sqrt(mean(x[m, :]^2) + eps) * weight, the RMSNorm of Llama. K % 8 == 0. */
void kr_rms_norm(const float *x, int64_t ldx, const float *weight, float *xn, int64_t ldn, int64_t M,
                 int64_t K, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * ldx;
        float *dst = xn + m * ldn;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
            __m256 v = _mm256_loadu_ps(row + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc) / (float)K + eps));
        for (int64_t k = 0; k < K; k += 8)
            _mm256_storeu_ps(dst + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(row + k), inv),
                                                    _mm256_loadu_ps(weight + k)));
    }
}

/* y[m, n] = sum_k x[m, k] * w[n, k] (accumulate = 0), or y[m, n] += that sum (accumulate = 1), w in
 * `format` (kr_format; | KR_INT8_ACTIVATIONS with a block format: int8 activations). K must be a multiple
 * of 8 (of QK for a block format); xbuf holds M * K floats of scratch for bf16 and block formats (else
 * unused). Threads split the rows of w, so each thread streams
 * one contiguous range of the weights. */
void kr_linear(const float *x, int64_t ldx, const void *w, int format, float *y, int64_t ldy, int64_t M,
               int64_t N, int64_t K, int accumulate, float *xbuf, int num_threads) {
    const int int8_x = (format & KR_INT8_ACTIVATIONS) != 0;
    format &= ~KR_INT8_ACTIVATIONS;
    const int blocks = is_block_format(format), int8_blocks = int8_x && blocks;
    const int64_t stride = row_bytes(format, K), ldxs = K / QK;
    const block_x8 *xq = (const block_x8 *)xbuf;
    const int split_x8 = int8_blocks && format == KR_Q4_1S;
    const pair_x8 *xp = (const pair_x8 *)xbuf;
    const int64_t ldp = ldxs / 2, lds = (ldxs + 7) / 8 * 8;
    float *xs = (float *)(xp + M * ldp); /* after the pairs: 2 * M * K bytes + 4 * M * lds <= 4 * M * K */
    if (split_x8) {
        quantize_pairs(x, ldx, (pair_x8 *)xbuf, xs, lds, M, K);
    } else if (int8_blocks) {
        quantize_rows(x, ldx, (block_x8 *)xbuf, M, K);
    } else if (format == KR_BF16) {
        permute_even_odd(x, ldx, xbuf, M, K);
        x = xbuf;
        ldx = K;
    } else if (format == KR_Q4_1 || format == KR_Q4_1S) {
        block_sums(x, ldx, xbuf, M, K);
    }
#ifndef KR_VNNI512
    if (M == 1 && (split_x8 || (int8_blocks && format == KR_Q8_0S))) {
        /* one token: rows in pairs (blocks.h rows_dot_x8_split*), an odd last row alone */
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t n = 0; n < N; n += 2) {
            const char *row = (const char *)w + n * stride;
            const int nr = n + 1 < N ? 2 : 1;
            float dots[2];
            if (split_x8 && nr == 2) rows_dot_x8_split(xp, xs, row, stride, 2, ldxs, dots);
            else if (split_x8) rows_dot_x8_split(xp, xs, row, stride, 1, ldxs, dots);
            else if (nr == 2) rows_dot_x8_split8(xq, row, stride, 2, ldxs, dots);
            else rows_dot_x8_split8(xq, row, stride, 1, ldxs, dots);
            for (int r = 0; r < nr; r++) y[n + r] = accumulate ? y[n + r] + dots[r] : dots[r];
        }
        return;
    }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const char *row = (const char *)w + n * stride;
        for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
            float dots[TILE_M];
            int mb = (int)(M - m0 < TILE_M ? M - m0 : TILE_M);
            const float *xm = x + m0 * ldx, *sums = xbuf + m0 * ldxs; /* fp32 rows; Q4_1 block sums */
            const block_x8 *qm = xq + m0 * ldxs;                          /* int8 blocks */
            const pair_x8 *pm = xp + m0 * ldp;                            /* int8 pairs, for Q4_1S */
            if (split_x8)
                WITH_TILE_HEIGHT(mb, row_dot_x8_split(pm, ldp, xs + m0 * lds, lds, MB, row, ldxs, dots));
            else if (int8_blocks && format == KR_Q8_0S)
                WITH_TILE_HEIGHT(mb, row_dot_x8_split8(qm, ldxs, MB, row, ldxs, dots));
            else if (int8_blocks)
                WITH_TILE_HEIGHT(mb, row_dot_x8(qm, ldxs, MB, row, K, format, dots));
            else if (blocks)
                WITH_TILE_HEIGHT(mb, row_dot_blocks(xm, ldx, MB, row, K, format, sums, ldxs, dots));
            else
                WITH_TILE_HEIGHT(mb, row_dot(xm, ldx, MB, row, K, format == KR_BF16, dots));
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

/* 8 cache elements from element i of p, widened to fp32 (exact for fp16). */
static inline __attribute__((always_inline)) __m256 load_kv8(const void *p, int64_t i, const int kv_f16) {
    if (kv_f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_loadu_ps((const float *)p + i);
}

/* Rotate q and k of each token in place (rotate-half layout: x * cos + rotate_half(x) * sin), then write
 * k and v into the token's cache slot (fp16: rounded to nearest even; head_dim is a multiple of 8).
 * qkv [M, ldq] holds q (num_heads * head_dim), k, v per token. */
void kr_rope_write_kv(float *qkv, int64_t ldq, int64_t M, int num_heads, int num_kv_heads, int head_dim,
                      const int64_t *positions, const float *cos_table, const float *sin_table, void *cache,
                      const int64_t *slots, int kv_f16) {
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
        const float *k = tok + (int64_t)num_heads * head_dim;
        if (kv_f16) {
            uint16_t *dst = (uint16_t *)cache + slots[t] * 2 * kv_size;
            for (int64_t i = 0; i < 2 * kv_size; i += 8)
                _mm_storeu_si128((__m128i *)(dst + i),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(k + i), _MM_FROUND_TO_NEAREST_INT));
        } else {
            float *dst = (float *)cache + slots[t] * 2 * kv_size;
            for (int64_t i = 0; i < 2 * kv_size; i++) dst[i] = k[i];
        }
    }
}

/* Keys per attention task. A token's keys split at fixed multiples of KEY_CHUNK (never by the number of
 * tokens or threads); one task attends one chunk for all the query heads of one KV head, so a key and its
 * value are read from memory once per token (not once per query head), and the chunks' partial softmaxes
 * merge in chunk order, so a token's numbers do not depend on the batch. One decode token is num_kv_heads *
 * chunks tasks for the threads to share (SmolLM2 at 576 keys: 27, where one task per query head gave 9).
 * On a 2-core Zen 4 VM, SmolLM2's 30 layers at 2048 keys: 7.4 ms against 12.2 before (cold caches). */
#define KEY_CHUNK 64

/* The dot products of q with the 8 keys k[0..7], as one vector: eight running sums, then a
 * transpose-and-add tree instead of eight horizontal sums. */
static inline __attribute__((always_inline)) __m256 dot8(const float *q, const void *const *k, int head_dim,
                                                        const int kv_f16) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, load_kv8(k[i], d, kv_f16), acc[i]);
    }
    __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
    __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67); /* per 128-bit half: keys 0-3, 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* The largest of x[0..n-1], as the scalar loop `m = x[i] > m ? x[i] : m` from -inf finds it: 8 lanes at
 * a time, then across them (max is exact, so the order does not change the result). A NaN is skipped by
 * both: every lane starts at -inf, and _mm256_max_ps returns its second operand, the lane's running
 * maximum, when either is NaN, so no lane ever holds one. */
static inline float max_of(const float *x, int64_t n) {
    float m = -INFINITY;
    int64_t i = 0;
    if (n >= 8) {
        __m256 v = _mm256_set1_ps(-INFINITY);
        for (; i + 8 <= n; i += 8) v = _mm256_max_ps(_mm256_loadu_ps(x + i), v);
        float lanes[8];
        _mm256_storeu_ps(lanes, v);
        for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    }
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* dst[0..8 * nc - 1] = sum over keys i < n of p[i] * (value i)[off .. off + 8 * nc - 1], in key order:
 * nc (at most 8) accumulators of 8 lanes. */
static inline __attribute__((always_inline)) void weigh_values(const float *p, const void *const *keys,
                                                               int64_t n, int64_t off, const int nc,
                                                               const int kv_f16, float *dst) {
    __m256 acc[8];
    for (int c = 0; c < nc; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        const __m256 w = _mm256_set1_ps(p[i]);
        for (int c = 0; c < nc; c++) acc[c] = _mm256_fmadd_ps(w, load_kv8(keys[i], off + 8 * c, kv_f16), acc[c]);
    }
    for (int c = 0; c < nc; c++) _mm256_storeu_ps(dst + 8 * c, acc[c]);
}

/* The `group` query heads q + j * head_dim of one token attend to the keys k0..k1-1 (at most KEY_CHUNK)
 * of one KV head, read through the block table. For head j, part + j * (head_dim + 2) receives the
 * chunk's partial softmax: the largest score m, the sum of exp(score - m), and the head_dim sums of
 * exp(score - m) * value (not yet divided). cache, kv_stride and v_offset count cache elements (fp32, or
 * fp16 under kv_f16, a constant in each of the two instances below). */
static inline __attribute__((always_inline)) void attend_chunk(
    const float *q, int group, int head_dim, const void *cache, int64_t kv_stride, int64_t v_offset,
    const int64_t *block_table, int64_t block_size, int64_t k0, int64_t k1, float scale, float *part,
    const int kv_f16) {
    const int64_t n = k1 - k0, elem = kv_f16 ? 2 : 4;
    const void *keys[KEY_CHUNK];
    float scores[KEY_CHUNK];
    for (int64_t i = 0, b = k0 / block_size, o = k0 % block_size; i < n; i++, o++) {
        if (o == block_size) {
            b++;
            o = 0;
        }
        keys[i] = (const char *)cache + (block_table[b] * block_size + o) * kv_stride * elem;
    }
    for (int j = 0; j < group; j++) {
        const float *qj = q + (int64_t)j * head_dim;
        float *pj = part + (int64_t)j * (head_dim + 2);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(scores + i,
                             _mm256_mul_ps(dot8(qj, keys + i, head_dim, kv_f16), _mm256_set1_ps(scale)));
        for (; i < n; i++) {
            __m256 acc = _mm256_setzero_ps();
            for (int d = 0; d < head_dim; d += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qj + d), load_kv8(keys[i], d, kv_f16), acc);
            scores[i] = hsum8(acc) * scale;
        }
        float max_score = max_of(scores, n);
        __m256 vmax = _mm256_set1_ps(max_score), vsum = _mm256_setzero_ps();
        for (i = 0; i + 8 <= n; i += 8) {
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), vmax));
            _mm256_storeu_ps(scores + i, p);
            vsum = _mm256_add_ps(vsum, p);
        }
        float sum = hsum8(vsum);
        for (; i < n; i++) {
            scores[i] = expf(scores[i] - max_score);
            sum += scores[i];
        }
        pj[0] = max_score;
        pj[1] = sum;
        for (int d0 = 0; d0 < head_dim; d0 += 64) {
            if (head_dim - d0 >= 64) /* 8 accumulators known at compile time: kept in registers */
                weigh_values(scores, keys, n, v_offset + d0, 8, kv_f16, pj + 2 + d0);
            else
                weigh_values(scores, keys, n, v_offset + d0, (head_dim - d0) / 8, kv_f16, pj + 2 + d0);
        }
    }
}

static void attend_chunk_f32(const float *q, int group, int head_dim, const void *cache, int64_t kv_stride,
                             int64_t v_offset, const int64_t *block_table, int64_t block_size, int64_t k0,
                             int64_t k1, float scale, float *part) {
    attend_chunk(q, group, head_dim, cache, kv_stride, v_offset, block_table, block_size, k0, k1, scale, part,
                 0);
}

static void attend_chunk_f16(const float *q, int group, int head_dim, const void *cache, int64_t kv_stride,
                             int64_t v_offset, const int64_t *block_table, int64_t block_size, int64_t k0,
                             int64_t k1, float scale, float *part) {
    attend_chunk(q, group, head_dim, cache, kv_stride, v_offset, block_table, block_size, k0, k1, scale, part,
                 1);
}

/* out = the chunks' partial softmaxes parts[0..count-1] (stride ld) of one head merged in order:
 * (sum_c exp(m_c - m) * acc_c) / (sum_c exp(m_c - m) * s_c), with m the largest m_c. */
static void merge_chunks(const float *parts, int64_t ld, int64_t count, int head_dim, float *out) {
    float m = -INFINITY;
    for (int64_t c = 0; c < count; c++) m = parts[c * ld] > m ? parts[c * ld] : m;
    float sum = 0.0f;
    for (int d = 0; d < head_dim; d += 8) _mm256_storeu_ps(out + d, _mm256_setzero_ps());
    for (int64_t c = 0; c < count; c++) {
        const float *p = parts + c * ld;
        const float w = expf(p[0] - m); /* exactly 1 for the largest, so a lone chunk stays as it is */
        sum += w * p[1];
        const __m256 wv = _mm256_set1_ps(w);
        for (int d = 0; d < head_dim; d += 8)
            _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(p + 2 + d), _mm256_loadu_ps(out + d)));
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int d = 0; d < head_dim; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(out + d), inv));
}

/* The first key a token at context length ctx attends to: 0, or under a sliding window its last `window`. */
static inline int64_t first_key(int64_t ctx, int64_t window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

/* out[t, h * head_dim:] = causal attention of token t's head h over its own sequence, for every token.
 * q [M, ldq]; token t belongs to row token_rows[t] of block_tables [rows, ld_bt] and sits at positions[t].
 * window > 0 restricts each token to its last `window` keys (itself included); 0 attends to all.
 * head_dim must be a multiple of 8. Returns 0, or -1 where its buffers could not be allocated: the
 * partial softmaxes take (chunks of every token) * num_heads * (head_dim + 2) floats, allocated per call
 * (SmolLM2: 2.4 KB per 64 keys of a token). */
int kr_paged_attention(const float *q, int64_t ldq, float *out, int64_t ldo, int64_t M, int num_heads,
                       int num_kv_heads, int head_dim, const void *cache, const int64_t *block_tables,
                       int64_t ld_bt, const int64_t *token_rows, const int64_t *positions, int64_t window,
                       int64_t block_size, float scale, int num_threads, int kv_f16) {
    const int group = num_heads / num_kv_heads;
    void (*const attend)(const float *, int, int, const void *, int64_t, int64_t, const int64_t *, int64_t,
                         int64_t, int64_t, float, float *) = kv_f16 ? attend_chunk_f16 : attend_chunk_f32;
    const int64_t kv_stride = 2 * (int64_t)num_kv_heads * head_dim, ld_part = head_dim + 2;
    if (M == 0) return 0;
    /* token t's chunks are first[t] .. first[t + 1] - 1 of the step's list; chunk_token maps them back */
    int64_t *first = malloc((size_t)(M + 1) * sizeof(int64_t));
    if (!first) return -1;
    first[0] = 0;
    for (int64_t t = 0; t < M; t++) {
        const int64_t ctx = positions[t] + 1, start = first_key(ctx, window);
        first[t + 1] = first[t] + (ctx - 1) / KEY_CHUNK - start / KEY_CHUNK + 1;
    }
    const int64_t num_chunks = first[M];
    int64_t *chunk_token = malloc((size_t)num_chunks * sizeof(int64_t));
    float *parts = malloc((size_t)(num_chunks * num_heads * ld_part) * sizeof(float));
    if (!chunk_token || !parts) {
        free(first);
        free(chunk_token);
        free(parts);
        return -1;
    }
    for (int64_t t = 0; t < M; t++)
        for (int64_t c = first[t]; c < first[t + 1]; c++) chunk_token[c] = t;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_chunks * num_kv_heads; task++) {
            const int64_t c = task / num_kv_heads, t = chunk_token[c];
            const int g = (int)(task % num_kv_heads);
            const int64_t ctx = positions[t] + 1, start = first_key(ctx, window);
            const int64_t chunk_start = (start / KEY_CHUNK + c - first[t]) * KEY_CHUNK;
            const int64_t k0 = chunk_start > start ? chunk_start : start;
            const int64_t k1 = chunk_start + KEY_CHUNK < ctx ? chunk_start + KEY_CHUNK : ctx;
            attend(q + t * ldq + (int64_t)g * group * head_dim, group, head_dim,
                   (const char *)cache + (int64_t)g * head_dim * (kv_f16 ? 2 : 4), kv_stride,
                   (int64_t)num_kv_heads * head_dim, block_tables + token_rows[t] * ld_bt, block_size, k0, k1,
                   scale, parts + (c * num_heads + (int64_t)g * group) * ld_part);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < M * num_heads; task++) {
            const int64_t t = task / num_heads, h = task % num_heads;
            merge_chunks(parts + (first[t] * num_heads + h) * ld_part, num_heads * ld_part,
                         first[t + 1] - first[t], head_dim, out + t * ldo + h * head_dim);
        }
    }
    free(first);
    free(chunk_token);
    free(parts);
    return 0;
}

/* One Llama model's shape and its per-layer tensors, mirrored by ctypes structures in cpu.py. */
typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size;
    float eps;
    int32_t weights_format; /* kr_format of the four projections, | KR_INT8_ACTIVATIONS for int8 activations */
    int32_t kv_f16;         /* the layers' caches hold fp16 (else fp32) */
    const float *cos_table, *sin_table; /* [max_positions, head_dim] */
} kr_dims;

typedef struct {
    const void *qkv_proj, *o_proj, *gate_up_proj, *down_proj; /* [N, K] in weights_format */
    const float *qkv_bias;                                     /* [qkv_size] or NULL */
    const float *input_norm, *post_norm;                       /* [hidden] */
    void *cache;                                               /* [num_slots, 2, num_kv_heads, head_dim] */
} kr_layer;

/* Floats of scratch that kr_llama_layers needs for M tokens. */
int64_t kr_llama_work_floats(const kr_dims *d, int64_t M) {
    int64_t q = d->num_heads * d->head_dim, kv = d->num_kv_heads * d->head_dim;
    int64_t widest = d->hidden > d->intermediate ? d->hidden : d->intermediate;
    widest = widest > q ? widest : q;
    return M * (d->hidden + q + 2 * kv + q + 3 * d->intermediate + widest);
}

/* Every decoder layer for M tokens, in place on the residual stream h [M, hidden]. The same math, op for
 * op, as LlamaModel._torch_layer: RMSNorm, qkv, RoPE, KV write, attention, o_proj, RMSNorm, gate_up,
 * SiLU * up, down. Returns 0, or -1 where attention could not allocate its buffers (h is then garbage). */
int kr_llama_layers(const kr_dims *d, const kr_layer *layers, int64_t num_layers, float *h, int64_t M,
                    const int64_t *positions, const int64_t *slots, const int64_t *block_tables, int64_t ld_bt,
                    const int64_t *token_rows, float *work, int num_threads) {
    const int64_t H = d->hidden, I = d->intermediate, nh = d->num_heads, nkv = d->num_kv_heads;
    const int64_t q_size = nh * d->head_dim, qkv_size = q_size + 2 * nkv * d->head_dim;
    const int wb = d->weights_format;
    const float scale = 1.0f / sqrtf((float)d->head_dim);
    float *x = work, *qkv = x + M * H, *attn = qkv + M * qkv_size, *gu = attn + M * q_size;
    float *act = gu + M * 2 * I, *xbuf = act + M * I;
    for (int64_t l = 0; l < num_layers; l++) {
        const kr_layer *L = layers + l;
        kr_rms_norm(h, H, L->input_norm, x, H, M, H, d->eps);
        kr_linear(x, H, L->qkv_proj, wb, qkv, qkv_size, M, qkv_size, H, 0, xbuf, num_threads);
        if (L->qkv_bias)
            for (int64_t m = 0; m < M; m++)
                for (int64_t i = 0; i < qkv_size; i++) qkv[m * qkv_size + i] += L->qkv_bias[i];
        kr_rope_write_kv(qkv, qkv_size, M, (int)nh, (int)nkv, (int)d->head_dim, positions, d->cos_table,
                         d->sin_table, L->cache, slots, d->kv_f16);
        if (kr_paged_attention(qkv, qkv_size, attn, q_size, M, (int)nh, (int)nkv, (int)d->head_dim, L->cache,
                               block_tables, ld_bt, token_rows, positions, 0, d->block_size, scale, num_threads,
                               d->kv_f16))
            return -1;
        kr_linear(attn, q_size, L->o_proj, wb, h, H, M, H, q_size, 1, xbuf, num_threads);
        kr_rms_norm(h, H, L->post_norm, x, H, M, H, d->eps);
        kr_linear(x, H, L->gate_up_proj, wb, gu, 2 * I, M, 2 * I, H, 0, xbuf, num_threads);
        kr_silu_mul(gu, 2 * I, act, I, M, I, num_threads);
        kr_linear(act, I, L->down_proj, wb, h, H, M, H, I, 1, xbuf, num_threads);
    }
    return 0;
}
