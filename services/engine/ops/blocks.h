/* kvrelay CPU kernels, GGUF block formats: their layouts, the int8 quantization of activations, and the
 * row-dot kernels that read blocks (fp32 or int8 activations; AVX2, AVX-VNNI and AVX512-VNNI forms giving
 * the same bits). Included once, by kernels.c, after its shared helpers (TILE_M, hsum8); ops/build.py
 * compiles the two as one unit and hashes both. */
#ifndef KVRELAY_BLOCKS_H
#define KVRELAY_BLOCKS_H

/* Weight formats (ops/quant.py WeightFormat). A row of a block format holds nb = K / QK blocks:
 *   Q8_0: fp16 scale d, 32 int8 q;                       w[j] = d * q[j]                      (34 bytes)
 *   Q4_1: fp16 scale d, fp16 minimum m, 16 bytes of nibbles: w[j] = d * (qs[j] & 15) + m and
 *         w[j + 16] = d * (qs[j] >> 4) + m, j < 16                                           (20 bytes)
 * the layouts of ggml, so a GGUF's tensor data is used as it is; and
 *   Q4_1S ("split"): the same blocks with each row regrouped as [nb scales d][nb minimums m][nb * 16 bytes of
 *         nibbles], the same 20 bytes per block: eight blocks' scales convert in one instruction and two
 *         blocks' nibbles come in one 32-byte load (row_dot_x8_split). nb must be even.
 *   Q8_0S: Q8_0 regrouped the same way, [nb scales d][nb * 32 int8 q] (row_dot_x8_split8). */
enum kr_format { KR_F32 = 0, KR_BF16 = 1, KR_Q8_0 = 2, KR_Q4_1 = 3, KR_Q4_1S = 4, KR_Q8_0S = 5 };
#define QK 32
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KR_VNNI512 /* the 512-bit forms of the Q4_1S / Q8_0S int8 kernels */
/* [lo, hi] as one 512-bit register, with AVX512F alone (insertf32x8 needs AVX512DQ) */
static inline __m512 join_halves(__m256 lo, __m256 hi) {
    const __m512d wide = _mm512_castpd256_pd512(_mm256_castps_pd(lo));
    return _mm512_castpd_ps(_mm512_insertf64x4(wide, _mm256_castps_pd(hi), 1));
}
/* Lanes 8-15 of v (extractf32x8 needs AVX512DQ too) */
static inline __m256 high_half(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
#endif
/* How far ahead of the block being read the block kernels prefetch. Batch-1 decode streams every weight
 * once per step and is bound by memory: on a 2-core Sapphire Rapids VM 4 KB ahead took SmolLM2's gguf-int8
 * decode from 133 to ~175 tok/s against 512 bytes (1-8 KB were within noise of each other). */
#define PREFETCH_AHEAD 4096

/* Per int32 lane, the sum of 4 products of unsigned bytes u and signed bytes s. AVX-VNNI (built with
 * -mavxvnni where the CPU has it: ops/build.py; or AVX512-VNNI's 256-bit form) does it in one instruction;
 * AVX2 takes maddubs (pairs into
 * int16) and madd. Every caller has u <= 128 and |s| <= 127, so a pair's sum stays below 2^15 and maddubs
 * never saturates: both give the same bits (tests/unit/test_ops_quant.py). */
static inline __m256i dot4(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
typedef struct {
    uint16_t d;
    int8_t qs[QK];
} block_q8_0;
typedef struct {
    uint16_t d, m;
    uint8_t qs[QK / 2];
} block_q4_1;
_Static_assert(sizeof(block_q8_0) == 34 && sizeof(block_q4_1) == 20, "ggml block sizes");

static inline int is_block_format(int format) {
    return format >= KR_Q8_0 && format <= KR_Q8_0S;
}

/* Bytes of one row of K weights in `format`. */
static inline int64_t row_bytes(int format, int64_t K) {
    switch (format) {
    case KR_BF16: return 2 * K;
    case KR_Q8_0:
    case KR_Q8_0S: return K / QK * (int64_t)sizeof(block_q8_0);
    case KR_Q4_1:
    case KR_Q4_1S: return K / QK * (int64_t)sizeof(block_q4_1);
    default: return 4 * K;
    }
}

/* Block b of a row w of nb blocks: its 32 weights as four fp32 vectors of 8 (elements 0-7, 8-15, 16-23,
 * 24-31) before the scale, with its scale d and minimum m (0 for Q8_0). */
static inline __attribute__((always_inline)) void block_weights(const void *w, int64_t b, int64_t nb,
                                                                const int format, __m256 q[4], float *d,
                                                                float *m) {
    if (format == KR_Q4_1S) {
        const uint16_t *scales = (const uint16_t *)w;
        const uint8_t *qs = (const uint8_t *)(scales + 2 * nb) + 16 * b;
        _mm_prefetch((const char *)qs + PREFETCH_AHEAD, _MM_HINT_T0);
        const __m128i nibble = _mm_set1_epi8(15);
        __m128i v = _mm_loadu_si128((const __m128i *)qs);
        __m128i lo = _mm_and_si128(v, nibble), hi = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        *d = _cvtsh_ss(scales[b]);
        *m = _cvtsh_ss(scales[nb + b]);
    } else if (format == KR_Q8_0 || format == KR_Q8_0S) {
        const int split = format == KR_Q8_0S;
        const block_q8_0 *blk = (const block_q8_0 *)w + b;
        const int8_t *qs = split ? (const int8_t *)((const uint16_t *)w + nb) + QK * b : blk->qs;
        _mm_prefetch((const char *)qs + PREFETCH_AHEAD, _MM_HINT_T0);
        __m256i v = _mm256_loadu_si256((const __m256i *)qs);
        __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
        *d = _cvtsh_ss(split ? ((const uint16_t *)w)[b] : blk->d);
        *m = 0.0f;
    } else {
        const block_q4_1 *blk = (const block_q4_1 *)w + b;
        _mm_prefetch((const char *)blk + PREFETCH_AHEAD, _MM_HINT_T0);
        const __m128i nibble = _mm_set1_epi8(15);
        __m128i v = _mm_loadu_si128((const __m128i *)blk->qs);
        __m128i lo = _mm_and_si128(v, nibble), hi = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        *d = _cvtsh_ss(blk->d);
        *m = _cvtsh_ss(blk->m);
    }
}

/* Dot products of one block-format weight row with MB activation rows: per block, d * sum(q * x) into an
 * 8-lane accumulator and m * sum(x) (the block's activation sum, xsum[m * ldxs + b], made once per call by
 * block_sums) into a scalar one. The order of the sums does not depend on MB (batch invariance). */
static inline __attribute__((always_inline)) void row_dot_blocks(const float *x, int64_t ldx, const int MB,
                                                                 const void *w, int64_t K, const int format,
                                                                 const float *xsum, int64_t ldxs,
                                                                 float *out) {
    __m256 acc[TILE_M];
    float min_acc[TILE_M];
    for (int i = 0; i < MB; i++) {
        acc[i] = _mm256_setzero_ps();
        min_acc[i] = 0.0f;
    }
    const int64_t num_blocks = K / QK;
    for (int64_t b = 0; b < num_blocks; b++) {
        __m256 q[4];
        float d, m;
        block_weights(w, b, num_blocks, format, q, &d, &m);
        const __m256 dv = _mm256_set1_ps(d);
        for (int i = 0; i < MB; i++) {
            const float *xb = x + i * ldx + b * QK;
            __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
            s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), s);
            s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), s);
            s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), s);
            acc[i] = _mm256_fmadd_ps(dv, s, acc[i]);
            if (format == KR_Q4_1 || format == KR_Q4_1S) min_acc[i] += m * xsum[i * ldxs + b];
        }
    }
    for (int i = 0; i < MB; i++) out[i] = hsum8(acc[i]) + min_acc[i];
}

/* xsum[m, b] = the sum of x[m, b * QK .. b * QK + QK - 1], for Q4_1's minimums. */
static void block_sums(const float *x, int64_t ldx, float *xsum, int64_t M, int64_t K) {
    const int64_t num_blocks = K / QK;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < num_blocks; b++) {
            const float *xb = x + m * ldx + b * QK;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
            xsum[m * num_blocks + b] = hsum8(s);
        }
}

/* int8 activations (kr_format | KR_INT8_ACTIVATIONS with a block format): each token's activations are
 * quantized to int8 with one scale per 4 of them (d = max|x| / 127), and each 32-block keeps
 * s = sum(d * q). A block product is an integer dot product (maddubs, then madd) whose int32 lane i sums
 * the products of elements 4i..4i+3, so a scale per 4 costs the dot product nothing: the eight lanes are
 * scaled by their eight d at once.
 *   Q8_0: d_w * sum_lanes(d_x * sum(q_w * q_x));   Q4_1: the same + m_w * s_x.
 * (llama.cpp's Q8_1 activations have one scale per 32: on SmolLM2 that kept teacher-forced top-1 agreement
 * with fp32 at 97.7%, and one per 16 at 98.4%, docs/performance.md.) */
#define KR_INT8_ACTIVATIONS 16
#define X8_GROUP 4 /* activations per scale: the bytes one int32 lane of madd(maddubs(w, x), 1) sums */
typedef struct {
    float d[QK / X8_GROUP]; /* lane i's scale */
    float s;
    int8_t qs[QK];
} block_x8;

/* One 32-block of activations xb as int8 qs with one scale d per X8_GROUP (d = max|x| / 127, q = x / d
 * rounded half away from zero); returns s = sum(d * q), summed group by group. */
static inline float quantize_block(const float *xb, float d[QK / X8_GROUP], int8_t qs[QK]) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
    __m256i q[4];
    for (int c = 0; c < 4; c++) { /* elements 8c..8c+7: groups 2c and 2c+1 */
        const __m256 v = _mm256_loadu_ps(xb + 8 * c);
        __m256 amax = _mm256_andnot_ps(sign_bit, v);
        amax = _mm256_max_ps(amax, _mm256_permute_ps(amax, 0xB1)); /* each lane: the max of its group */
        amax = _mm256_max_ps(amax, _mm256_permute_ps(amax, 0x4E));
        const __m256 dg = _mm256_div_ps(amax, _mm256_set1_ps(127.0f));
        const __m256 inv = _mm256_and_ps(_mm256_cmp_ps(dg, _mm256_setzero_ps(), _CMP_GT_OQ),
                                         _mm256_div_ps(_mm256_set1_ps(1.0f), dg));
        const __m256 scaled = _mm256_mul_ps(v, inv);
        const __m256 away = _mm256_or_ps(_mm256_and_ps(scaled, sign_bit), half); /* +-0.5, sign of v */
        q[c] = _mm256_cvttps_epi32(_mm256_add_ps(scaled, away));
        float lanes[8];
        _mm256_storeu_ps(lanes, dg);
        d[2 * c] = lanes[0];
        d[2 * c + 1] = lanes[4];
    }
    /* int32 to int8 (|q| <= 127): the packs interleave 128-bit lanes, the permute restores the order */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i q8 = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)qs, q8);
    const __m256i sums = dot4(_mm256_set1_epi8(1), q8); /* lane g: group g's sum */
    int32_t group_sums[8];
    _mm256_storeu_si256((__m256i *)group_sums, sums);
    float s = 0.0f;
    for (int g = 0; g < QK / X8_GROUP; g++) s += d[g] * (float)group_sums[g];
    return s;
}

/* xq[m, b] = the block b of x[m, :] as int8. */
static void quantize_rows(const float *x, int64_t ldx, block_x8 *xq, int64_t M, int64_t K) {
    const int64_t num_blocks = K / QK;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < num_blocks; b++) {
            block_x8 *out = xq + m * num_blocks + b;
            out->s = quantize_block(x + m * ldx + b * QK, out->d, out->qs);
        }
}

/* int8 activations for Q4_1S rows, in the order a 32-byte load of two blocks' nibbles gives: pair p of a
 * token holds blocks a = 2p and b = 2p + 1 as half [0] = (elements 0-15 of a, then of b) and half [1] =
 * (elements 16-31 of a, then of b), each with its 8 scales (4 of a, 4 of b); the blocks' sums s are kept
 * apart, lds (nb rounded up to 8, zero-padded) per token, for the minimums' 8-wide products. */
typedef struct {
    float d[2][8];
    int8_t qs[2][QK];
} pair_x8;

static void quantize_pairs(const float *x, int64_t ldx, pair_x8 *xq, float *xs, int64_t lds, int64_t M,
                           int64_t K) {
    const int64_t num_blocks = K / QK;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            float d[QK / X8_GROUP];
            int8_t qs[QK];
            xs[m * lds + b] = quantize_block(x + m * ldx + b * QK, d, qs);
            pair_x8 *out = xq + m * (num_blocks / 2) + b / 2;
            const int half = (int)(b & 1);
            for (int j = 0; j < QK / 2; j++) {
                out->qs[0][16 * half + j] = qs[j];
                out->qs[1][16 * half + j] = qs[QK / 2 + j];
            }
            for (int g = 0; g < 4; g++) {
                out->d[0][4 * half + g] = d[g];
                out->d[1][4 * half + g] = d[4 + g];
            }
        }
        for (int64_t b = num_blocks; b < lds; b++) xs[m * lds + b] = 0.0f;
    }
}

/* Dot products of one block-format weight row with MB rows of int8 activations xq [MB, K / QK]. */
static inline __attribute__((always_inline)) void row_dot_x8(const block_x8 *xq, int64_t ldq, const int MB,
                                                             const void *w, int64_t K, const int format,
                                                             float *out) {
    __m256 acc[TILE_M];
    float min_acc[TILE_M];
    for (int i = 0; i < MB; i++) {
        acc[i] = _mm256_setzero_ps();
        min_acc[i] = 0.0f;
    }
    const int64_t num_blocks = K / QK;
    for (int64_t b = 0; b < num_blocks; b++) {
        __m256i wq; /* Q8_0: |q| with the signs moved onto x; Q4_1: q in 0..15 */
        __m256i sign = _mm256_setzero_si256();
        float d, m = 0.0f;
        if (format == KR_Q8_0) {
            const block_q8_0 *blk = (const block_q8_0 *)w + b;
            _mm_prefetch((const char *)blk + PREFETCH_AHEAD, _MM_HINT_T0);
            sign = _mm256_loadu_si256((const __m256i *)blk->qs);
            wq = _mm256_sign_epi8(sign, sign);
            d = _cvtsh_ss(blk->d);
        } else {
            const block_q4_1 *blk = (const block_q4_1 *)w + b;
            _mm_prefetch((const char *)blk + PREFETCH_AHEAD, _MM_HINT_T0);
            const __m128i nibble = _mm_set1_epi8(15);
            __m128i v = _mm_loadu_si128((const __m128i *)blk->qs);
            wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nibble), _mm_and_si128(v, nibble));
            d = _cvtsh_ss(blk->d);
            m = _cvtsh_ss(blk->m);
        }
        const __m256 dv = _mm256_set1_ps(d);
        for (int i = 0; i < MB; i++) {
            const block_x8 *xb = xq + i * ldq + b;
            __m256i xv = _mm256_loadu_si256((const __m256i *)xb->qs);
            if (format == KR_Q8_0) xv = _mm256_sign_epi8(xv, sign);
            __m256i sums = dot4(wq, xv);
            __m256 scale = _mm256_mul_ps(dv, _mm256_loadu_ps(xb->d));
            acc[i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc[i]);
            if (format == KR_Q4_1) min_acc[i] += m * xb->s;
        }
    }
    for (int i = 0; i < MB; i++) out[i] = hsum8(acc[i]) + min_acc[i];
}

/* Dot products of one Q4_1S weight row (nb blocks) with MB tokens of int8 activations in pairs (xq, ldq
 * pairs per token; sums xs, lds per token). Per two blocks: one 32-byte load gives both blocks' low
 * nibbles (elements 0-15) and high nibbles (16-31), each an integer dot product whose eight int32 lanes
 * are scaled by weight scale * activation scale (the weight scales of 8 blocks converted at once, one
 * permute picking a pair's); the minimums' terms m * s are 8 blocks per fused multiply-add. */
static inline __attribute__((always_inline)) void row_dot_x8_split(const pair_x8 *xq, int64_t ldq,
                                                                   const float *xs, int64_t lds,
                                                                   const int MB, const void *w, int64_t nb,
                                                                   float *out) {
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i pair_lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const uint16_t *scales = (const uint16_t *)w, *mins = scales + nb;
    const uint8_t *qs = (const uint8_t *)(mins + nb);
#ifdef KR_VNNI512
    /* AVX512-VNNI: a pair's low and high halves in one 512-bit register (lanes 0-7 low, 8-15 high), each
     * lane computed and summed exactly as the AVX2 code's lo_acc and hi_acc lanes: the same bits. */
    const __m512i nibble512 = _mm512_set1_epi8(15);
    const __m512i half_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    /* pair p's weight scales in both halves, [a x 4, b x 4, a x 4, b x 4], in one permute of the group's 8 */
    __m512i pair_pick[4];
    for (int p = 0; p < 4; p++)
        pair_pick[p] = _mm512_add_epi32(_mm512_broadcast_i64x4(pair_lanes), _mm512_set1_epi32(2 * p));
    __m512 acc512[TILE_M];
    for (int i = 0; i < MB; i++) acc512[i] = _mm512_setzero_ps();
#endif
    __m256 lo_acc[TILE_M], hi_acc[TILE_M], min_acc[TILE_M];
    for (int i = 0; i < MB; i++) lo_acc[i] = hi_acc[i] = min_acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g += 8) {
        /* A short last group's loads of 8 read on into its minimums and nibbles: lanes masked or unused. */
        const int r = (int)(nb - g < 8 ? nb - g : 8);
        const __m256 dw8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + g)));
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(r), lane));
        const __m256 mw8 =
            _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + g))), valid);
        for (int i = 0; i < MB; i++)
            min_acc[i] = _mm256_fmadd_ps(mw8, _mm256_loadu_ps(xs + i * lds + g), min_acc[i]);
        for (int p = 0; p < r / 2; p++) {
            const uint8_t *src = qs + 16 * (g + 2 * p);
            _mm_prefetch((const char *)src + PREFETCH_AHEAD, _MM_HINT_T0);
#ifdef KR_VNNI512
            const __m512i twice = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)src));
            const __m512i both = /* [low nibbles of both blocks, high nibbles] */
                _mm512_and_si512(_mm512_srlv_epi16(twice, half_shift), nibble512);
            const __m512 dw2 = _mm512_permutexvar_ps(pair_pick[p], _mm512_castps256_ps512(dw8));
            for (int i = 0; i < MB; i++) {
                const pair_x8 *xp = xq + i * ldq + (g / 2 + p);
                const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), both,
                                                         _mm512_loadu_si512((const void *)xp->qs));
                const __m512 scale = _mm512_mul_ps(dw2, _mm512_loadu_ps(xp->d));
                acc512[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), acc512[i]);
            }
#else
            const __m256i pick = _mm256_add_epi32(pair_lanes, _mm256_set1_epi32(2 * p));
            const __m256 dw = _mm256_permutevar8x32_ps(dw8, pick); /* [d of block a x 4, d of b x 4] */
            const __m256i v = _mm256_loadu_si256((const __m256i *)src);
            const __m256i lo = _mm256_and_si256(v, nibble);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            for (int i = 0; i < MB; i++) {
                const pair_x8 *xp = xq + i * ldq + (g / 2 + p);
                const __m256i slo = dot4(lo, _mm256_loadu_si256((const __m256i *)xp->qs[0]));
                const __m256i shi = dot4(hi, _mm256_loadu_si256((const __m256i *)xp->qs[1]));
                const __m256 scale_lo = _mm256_mul_ps(dw, _mm256_loadu_ps(xp->d[0]));
                const __m256 scale_hi = _mm256_mul_ps(dw, _mm256_loadu_ps(xp->d[1]));
                lo_acc[i] = _mm256_fmadd_ps(scale_lo, _mm256_cvtepi32_ps(slo), lo_acc[i]);
                hi_acc[i] = _mm256_fmadd_ps(scale_hi, _mm256_cvtepi32_ps(shi), hi_acc[i]);
            }
#endif
        }
    }
#ifdef KR_VNNI512
    for (int i = 0; i < MB; i++) {
        lo_acc[i] = _mm512_castps512_ps256(acc512[i]);
        hi_acc[i] = high_half(acc512[i]);
    }
#endif
    for (int i = 0; i < MB; i++) out[i] = hsum8(_mm256_add_ps(lo_acc[i], hi_acc[i])) + hsum8(min_acc[i]);
}

/* row_dot_x8_split for one token and NR (1 or 2) weight rows at once, w0 and w0 + stride: the token's
 * loads shared and two rows' dependency chains interleaved, each row's lanes summed and reduced in
 * row_dot_x8_split's order (the same bits). Batch-1 decode's rows of K = 576 are short: one row at a
 * time its fixed costs and chains left the core idle (docs/performance.md, "GGUF blocks"). AVX2 code;
 * the AVX512-VNNI build keeps row_dot_x8_split. */
static inline __attribute__((always_inline)) void rows_dot_x8_split(const pair_x8 *xq, const float *xs,
                                                                    const char *w0, int64_t stride,
                                                                    const int NR, int64_t nb, float *out) {
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i pair_lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 lo_acc[2], hi_acc[2], min_acc[2], dw8[2];
    for (int r = 0; r < NR; r++) lo_acc[r] = hi_acc[r] = min_acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g += 8) {
        const int rem = (int)(nb - g < 8 ? nb - g : 8); /* a short last group: as row_dot_x8_split */
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(rem), lane));
        const __m256 xs8 = _mm256_loadu_ps(xs + g);
        for (int r = 0; r < NR; r++) {
            const uint16_t *scales = (const uint16_t *)(w0 + r * stride), *mins = scales + nb;
            dw8[r] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + g)));
            const __m256 mw8 =
                _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + g))), valid);
            min_acc[r] = _mm256_fmadd_ps(mw8, xs8, min_acc[r]);
        }
        for (int p = 0; p < rem / 2; p++) {
            const pair_x8 *xp = xq + (g / 2 + p);
            const __m256i xlo = _mm256_loadu_si256((const __m256i *)xp->qs[0]);
            const __m256i xhi = _mm256_loadu_si256((const __m256i *)xp->qs[1]);
            const __m256 dlo = _mm256_loadu_ps(xp->d[0]), dhi = _mm256_loadu_ps(xp->d[1]);
            const __m256i pick = _mm256_add_epi32(pair_lanes, _mm256_set1_epi32(2 * p));
            for (int r = 0; r < NR; r++) {
                const uint8_t *src = (const uint8_t *)(w0 + r * stride) + 4 * nb + 16 * (g + 2 * p);
                _mm_prefetch((const char *)src + PREFETCH_AHEAD, _MM_HINT_T0);
                const __m256 dw = _mm256_permutevar8x32_ps(dw8[r], pick);
                const __m256i v = _mm256_loadu_si256((const __m256i *)src);
                const __m256i slo = dot4(_mm256_and_si256(v, nibble), xlo);
                const __m256i shi = dot4(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), xhi);
                lo_acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dlo), _mm256_cvtepi32_ps(slo), lo_acc[r]);
                hi_acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dhi), _mm256_cvtepi32_ps(shi), hi_acc[r]);
            }
        }
    }
    for (int r = 0; r < NR; r++) out[r] = hsum8(_mm256_add_ps(lo_acc[r], hi_acc[r])) + hsum8(min_acc[r]);
}

/* Dot products of one Q8_0S weight row (nb blocks) with MB tokens of int8 activations (block_x8): per
 * block one 32-byte load; the weights' signs move onto the activations (maddubs multiplies unsigned by
 * signed); eight blocks' scales convert at once. Even and odd blocks sum apart (two dependency chains). */
static inline __attribute__((always_inline)) void row_dot_x8_split8(const block_x8 *xq, int64_t ldq,
                                                                    const int MB, const void *w, int64_t nb,
                                                                    float *out) {
    const uint16_t *scales = (const uint16_t *)w;
    const int8_t *qs = (const int8_t *)(scales + nb);
    __m256 acc[2][TILE_M];
    for (int i = 0; i < MB; i++) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
#ifdef KR_VNNI512
    /* AVX512-VNNI: blocks j (lanes 0-7) and j + 1 (lanes 8-15) in one register, each lane computed and
     * summed as the AVX2 code's acc[0] and acc[1] lanes (a lone last block only in lanes 0-7): same bits. */
    __m512 acc512[TILE_M];
    for (int i = 0; i < MB; i++) acc512[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nb; g += 8) {
        const int r = (int)(nb - g < 8 ? nb - g : 8);
        const __m256 scales8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + g)));
        const __m512 dw8 = _mm512_castps256_ps512(scales8);
        for (int j = 0; j < r; j += 2) {
            const int8_t *src = qs + QK * (g + j);
            _mm_prefetch((const char *)src + PREFETCH_AHEAD, _MM_HINT_T0);
            const __mmask16 lanes = j + 1 < r ? 0xFFFF : 0x00FF;
            const __m512i wv = _mm512_maskz_loadu_epi8(j + 1 < r ? ~0ULL : 0xFFFFFFFFULL, src);
            const __m512i magnitude = _mm512_abs_epi8(wv);
            const __mmask64 negative = _mm512_movepi8_mask(wv);
            const __m512 dw = _mm512_permutexvar_ps(
                _mm512_inserti64x4(_mm512_set1_epi32(j), _mm256_set1_epi32(j + 1), 1), dw8);
            for (int i = 0; i < MB; i++) {
                const block_x8 *xb = xq + i * ldq + g + j, *xn = j + 1 < r ? xb + 1 : xb;
                const __m256i xa = _mm256_loadu_si256((const __m256i *)xb->qs);
                __m512i xv = _mm512_inserti64x4(_mm512_castsi256_si512(xa),
                                                _mm256_loadu_si256((const __m256i *)xn->qs), 1);
                xv = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
                const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, xv);
                const __m512 xd = join_halves(_mm256_loadu_ps(xb->d), _mm256_loadu_ps(xn->d));
                const __m512 scale = _mm512_mul_ps(dw, xd);
                acc512[i] = _mm512_mask3_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), acc512[i], lanes);
            }
        }
    }
    for (int i = 0; i < MB; i++) {
        acc[0][i] = _mm512_castps512_ps256(acc512[i]);
        acc[1][i] = high_half(acc512[i]);
    }
#else
    for (int64_t g = 0; g < nb; g += 8) {
        const int r = (int)(nb - g < 8 ? nb - g : 8); /* a short last group's scale load reads on into q */
        const __m256 dw8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + g)));
        for (int j = 0; j < r; j++) {
            const int8_t *src = qs + QK * (g + j);
            _mm_prefetch((const char *)src + PREFETCH_AHEAD, _MM_HINT_T0);
            const __m256i wv = _mm256_loadu_si256((const __m256i *)src);
            const __m256i magnitude = _mm256_sign_epi8(wv, wv);
            const __m256 dw = _mm256_permutevar8x32_ps(dw8, _mm256_set1_epi32(j));
            for (int i = 0; i < MB; i++) {
                const block_x8 *xb = xq + i * ldq + g + j;
                const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb->qs), wv);
                const __m256i sums = dot4(magnitude, xv);
                const __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(xb->d));
                acc[j & 1][i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc[j & 1][i]);
            }
        }
    }
#endif
    for (int i = 0; i < MB; i++) out[i] = hsum8(_mm256_add_ps(acc[0][i], acc[1][i]));
}

/* row_dot_x8_split8 for one token and NR (1 or 2) weight rows at once, w0 and w0 + stride, as
 * rows_dot_x8_split does for Q4_1S: shared loads, interleaved chains, row_dot_x8_split8's bits. */
static inline __attribute__((always_inline)) void rows_dot_x8_split8(const block_x8 *xq, const char *w0,
                                                                     int64_t stride, const int NR,
                                                                     int64_t nb, float *out) {
    __m256 acc[2][2], dw8[2]; /* [even or odd block][row] */
    for (int r = 0; r < NR; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g += 8) {
        const int rem = (int)(nb - g < 8 ? nb - g : 8);
        for (int r = 0; r < NR; r++) {
            const uint16_t *scales = (const uint16_t *)(w0 + r * stride);
            dw8[r] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + g)));
        }
        for (int j = 0; j < rem; j++) {
            const block_x8 *xb = xq + g + j;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)xb->qs);
            const __m256 xd = _mm256_loadu_ps(xb->d);
            const __m256i at = _mm256_set1_epi32(j);
            for (int r = 0; r < NR; r++) {
                const int8_t *src = (const int8_t *)(w0 + r * stride) + 2 * nb + QK * (g + j);
                _mm_prefetch((const char *)src + PREFETCH_AHEAD, _MM_HINT_T0);
                const __m256i wv = _mm256_loadu_si256((const __m256i *)src);
                const __m256i sums = dot4(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
                const __m256 scale = _mm256_mul_ps(_mm256_permutevar8x32_ps(dw8[r], at), xd);
                acc[j & 1][r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc[j & 1][r]);
            }
        }
    }
    for (int r = 0; r < NR; r++) out[r] = hsum8(_mm256_add_ps(acc[0][r], acc[1][r]));
}

#endif /* KVRELAY_BLOCKS_H */
