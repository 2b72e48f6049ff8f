/*
 * nvme-offload native kernels: an Adam step on 8-bit block-wise state, and stochastic rounding to bf16.
 *
 * Compiled with -ffp-contract=off: every operation rounds once, as each of torch's element-wise kernels
 * does, and a fused multiply-add happens only where it is written (fmaf), where torch's vectorized lerp
 * uses one. The reference these must equal bit for bit is offload.adam.lowbit's, written with torch ops.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "offload_kernels.h"

/* Inlined into both the plain and the FMA build of the loops. */
#define HOT static inline __attribute__((always_inline))

/* -- conversions ------------------------------------------------------------------------------- */

HOT float from_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

HOT uint32_t to_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

HOT float bf16_to_f32(uint16_t h) { return from_bits((uint32_t)h << 16); }

HOT float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return from_bits(sign | 0x7f800000u | (man << 13));        /* inf, nan */
    if (exp != 0) return from_bits(sign | ((exp + 112) << 23) | (man << 13));   /* normal */
    if (man == 0) return from_bits(sign);                                       /* zero */
    float f = (float)man * 5.9604644775390625e-08f;                             /* subnormal: man * 2^-24, exact */
    return sign ? -f : f;
}

HOT float grad_at(const ofl_adam_args *a, int64_t k) {
    switch (a->grad_dtype) {
    case OFL_DTYPE_BF16: return bf16_to_f32(((const uint16_t *)a->grad)[k]);
    case OFL_DTYPE_F16: return f16_to_f32(((const uint16_t *)a->grad)[k]);
    default: return ((const float *)a->grad)[k];
    }
}

/* -- the random stream of stochastic rounding ---------------------------------------------------- */

HOT uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

uint32_t ofl_random16(uint32_t key0, uint32_t key1, int64_t index) {
    uint64_t i = (uint64_t)index;
    return lowbias32(lowbias32(key0 ^ (uint32_t)i) ^ key1 ^ (uint32_t)(i >> 32)) >> 16;
}

/* Round toward zero, or away from it with the probability of the 16 bits dropped (torchao's rule). */
HOT uint16_t round_bf16(float x, uint32_t key0, uint32_t key1, int64_t index) {
    uint32_t bits = to_bits(x), trunc = bits & 0xffff0000u;
    if (ofl_random16(key0, key1, index) < (bits & 0xffffu))
        trunc += 0x10000u;
    return (uint16_t)(trunc >> 16);
}

/* -- 8-bit block-wise codes ---------------------------------------------------------------------- */

/* The code whose value is nearest y, ties up (0 for NaN), from the book's step table: the same code as
 * torchao's branch-free binary search over the book, which offload.codes.quantize follows. */
HOT uint8_t encode(const uint32_t *steps, float y) {
    uint32_t b = to_bits(y), s = b & 0x80000000u ? ~b : b ^ 0x80000000u, e = steps[s >> 16];
    return (uint8_t)((e & 0xffu) + ((s & 0xffffu) >= (e >> 8)));
}

/* Codes and absmax of a block: absmax = max |x| (NaN if any is), at least 1e-12; code = encode(x / absmax). */
HOT void quantize_block(const float *x, int64_t n, const uint32_t *steps, uint8_t *codes, float *absmax) {
    float m = 0.0f, y[OFL_BLOCK];
    int nan = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = fabsf(x[i]);
        nan |= v != v;
        m = v > m ? v : m;
    }
    if (nan)
        m = NAN;
    else if (m < 1e-12f)
        m = 1e-12f;
    *absmax = m;
    for (int64_t i = 0; i < n; i++)
        y[i] = x[i] / m;
    for (int64_t i = 0; i < n; i++)
        codes[i] = encode(steps, y[i]);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_SIMD 1

/* quantize_block with AVX2: the same operations on 8 values at a time. */
__attribute__((target("avx2,fma"))) static void quantize_block_avx2(const float *x, int64_t n,
                                                                     const uint32_t *steps, uint8_t *codes,
                                                                     float *absmax) {
    if (n != OFL_BLOCK) {
        quantize_block(x, n, steps, codes, absmax);
        return;
    }
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < OFL_BLOCK; i += 8) {
        __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, v);
    }
    float lanes[8], top = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++)
        top = lanes[i] > top ? lanes[i] : top;
    if (_mm256_movemask_ps(nan))
        top = NAN;
    else if (top < 1e-12f)
        top = 1e-12f;
    *absmax = top;
    const __m256 scale = _mm256_set1_ps(top);
    const __m256i flip = _mm256_set1_epi32((int)0x80000000u), low16 = _mm256_set1_epi32(0xffff),
                  low8 = _mm256_set1_epi32(0xff), one = _mm256_set1_epi32(1);
    for (int i = 0; i < OFL_BLOCK; i += 8) {
        __m256i b = _mm256_castps_si256(_mm256_div_ps(_mm256_loadu_ps(x + i), scale));
        __m256i s = _mm256_xor_si256(b, _mm256_or_si256(_mm256_srai_epi32(b, 31), flip));
        __m256i e = _mm256_i32gather_epi32((const int *)steps, _mm256_srli_epi32(s, 16), 4);
        __m256i step = _mm256_cmpgt_epi32(_mm256_and_si256(s, low16), _mm256_sub_epi32(_mm256_srli_epi32(e, 8), one));
        __m256i code = _mm256_sub_epi32(_mm256_and_si256(e, low8), step);
        __m256i words = _mm256_packus_epi32(code, code);
        __m256i bytes = _mm256_packus_epi16(words, words);
        __m128i both = _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
        _mm_storel_epi64((__m128i *)(codes + i), both);
    }
}

/* n values of codes c with one scale, with AVX2. */
__attribute__((target("avx2,fma"))) static void dequantize_avx2(const uint8_t *c, int64_t n, const float *q,
                                                                 float scale, float *out) {
    int64_t i = 0;
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + i)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(q, idx, 4), s));
    }
    for (; i < n; i++)
        out[i] = q[c[i]] * scale;
}

__attribute__((target("avx2,fma"))) static inline __m256i lowbias32_avx2(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bU));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* round_bf16 of n values, 8 at a time: the same stream and rule (elements first + i). */
__attribute__((target("avx2,fma"))) static void round_block_avx2(const float *x, int64_t n, uint32_t key0,
                                                                  uint32_t key1, int64_t first, uint16_t *out) {
    int64_t i = 0;
    const __m256i k0 = _mm256_set1_epi32((int)key0), k1 = _mm256_set1_epi32((int)key1),
                  lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), low = _mm256_set1_epi32(0xffff),
                  high = _mm256_set1_epi32((int)0xffff0000u), unit = _mm256_set1_epi32(0x10000);
    for (; i + 8 <= n; i += 8) {
        uint64_t index = (uint64_t)(first + i);
        /* Eight consecutive indices share their upper 32 bits unless they cross a multiple of 2^32. */
        if ((uint32_t)index > 0xfffffff8u)
            break;
        __m256i lo = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)index), lanes);
        __m256i hi = _mm256_set1_epi32((int)(uint32_t)(index >> 32));
        __m256i r = _mm256_srli_epi32(
            lowbias32_avx2(_mm256_xor_si256(_mm256_xor_si256(lowbias32_avx2(_mm256_xor_si256(k0, lo)), k1), hi)), 16);
        __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(x + i));
        /* r < (bits & 0xffff), both below 2^16: a signed comparison is right. */
        __m256i up = _mm256_cmpgt_epi32(_mm256_and_si256(bits, low), r);
        __m256i trunc = _mm256_and_si256(bits, high);
        __m256i word = _mm256_add_epi32(trunc, _mm256_and_si256(up, unit));
        /* The upper halves, packed to 16 bits: shifted down then packed as unsigned (values below 2^16). */
        __m256i half = _mm256_srli_epi32(word, 16);
        __m256i packed = _mm256_packus_epi32(half, half);
        __m128i both = _mm_unpacklo_epi64(_mm256_castsi256_si128(packed), _mm256_extracti128_si256(packed, 1));
        _mm_storeu_si128((__m128i *)(out + i), both);
    }
    for (; i < n; i++)
        out[i] = round_bf16(x[i], key0, key1, first + i);
}
#else
#define HAVE_SIMD 0
#endif

/* -- the step ------------------------------------------------------------------------------------- */

/* start + i for i < n, where torch's vectorized lerp(start, end, w) computes it: fused where it is. */
HOT void lerp_block(float *out, const float *start, const float *end, float w, int64_t n, int fused) {
    if (fabsf(w) < 0.5f) {
        if (fused)
            for (int64_t i = 0; i < n; i++)
                out[i] = fmaf(w, end[i] - start[i], start[i]);
        else
            for (int64_t i = 0; i < n; i++)
                out[i] = start[i] + w * (end[i] - start[i]);
    } else {
        float c = w - 1.0f;
        if (fused)
            for (int64_t i = 0; i < n; i++)
                out[i] = fmaf(c, end[i] - start[i], end[i]);
        else
            for (int64_t i = 0; i < n; i++)
                out[i] = end[i] + c * (end[i] - start[i]);
    }
}

/* Moment j of elements [k, k + n) as fp32 values. */
HOT void load_moment(const ofl_adam_args *a, int j, const float *q, int64_t k, int64_t n, float *out, int simd) {
    if (a->moment[j] != NULL) {
        memcpy(out, a->moment[j] + k, (size_t)n * sizeof(float));
        return;
    }
    const uint8_t *c = a->codes[j] + k;
    float scale = a->absmax[j][k / OFL_BLOCK];
#if HAVE_SIMD
    if (simd) {
        dequantize_avx2(c, n, q, scale, out);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        out[i] = q[c[i]] * scale;
}

HOT void load_weights(const ofl_adam_args *a, int64_t k, int64_t n, float *out) {
    if (a->param != NULL) {
        memcpy(out, a->param + k, (size_t)n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i++)
        out[i] = bf16_to_f32(a->param_bf16[k + i]);
}

HOT void load_grad(const ofl_adam_args *a, int64_t k, int64_t n, float *out) {
    if (a->grad_dtype == OFL_DTYPE_F32)
        memcpy(out, (const float *)a->grad + k, (size_t)n * sizeof(float));
    else if (a->grad_dtype == OFL_DTYPE_BF16)
        for (int64_t i = 0; i < n; i++)
            out[i] = bf16_to_f32(((const uint16_t *)a->grad)[k + i]);
    else
        for (int64_t i = 0; i < n; i++)
            out[i] = f16_to_f32(((const uint16_t *)a->grad)[k + i]);
}

/* The first pass over blocks [lo, hi) of the chunk (element k of the chunk at m[k - base]), as torchao's
 * single_param_adam computes it in fp32: decay (Adam's), both lerps, amsgrad's maximum, the codes stored. */
HOT void moments_range(const ofl_adam_args *a, int64_t lo, int64_t hi, int64_t base, float *m, float *second,
                       int simd) {
    float p[OFL_BLOCK], g[OFL_BLOCK], g2[OFL_BLOCK], old[OFL_BLOCK], v[OFL_BLOCK];
    for (int64_t start = lo; start < hi; start += OFL_BLOCK) {
        int64_t n = hi - start < OFL_BLOCK ? hi - start : OFL_BLOCK;
        float *mb = m + (start - base), *sb = second + (start - base);
        load_grad(a, start, n, g);
        if (a->maximize)
            for (int64_t i = 0; i < n; i++)
                g[i] = -g[i];
        if (!a->adamw) {
            load_weights(a, start, n, p);
            for (int64_t i = 0; i < n; i++) {
                float decay = a->wd * p[i];
                g[i] = g[i] + decay;
            }
        }
        load_moment(a, 0, a->qmap_signed, start, n, old, simd);
        lerp_block(mb, old, g, a->w1, n, a->fused);
        for (int64_t i = 0; i < n; i++)
            g2[i] = g[i] * g[i];
        load_moment(a, 1, a->qmap_unsigned, start, n, old, simd);
        lerp_block(v, old, g2, a->w2, n, a->fused);
        if (a->amsgrad) {
            load_moment(a, 2, a->qmap_unsigned, start, n, old, simd);
            for (int64_t i = 0; i < n; i++)
                sb[i] = old[i] != old[i] || v[i] != v[i] ? NAN : (old[i] > v[i] ? old[i] : v[i]);
        } else {
            memcpy(sb, v, (size_t)n * sizeof(float));
        }
        const float *values[3] = {mb, v, sb};
        const uint32_t *steps[3] = {a->steps_signed, a->steps_unsigned, a->steps_unsigned};
        for (int j = 0; j < (a->amsgrad ? 3 : 2); j++) {
            if (a->moment[j] != NULL)
                memcpy(a->moment[j] + start, values[j], (size_t)n * sizeof(float));
#if HAVE_SIMD
            else if (simd)
                quantize_block_avx2(values[j], n, steps[j], a->codes[j] + start, a->absmax[j] + start / OFL_BLOCK);
#endif
            else
                quantize_block(values[j], n, steps[j], a->codes[j] + start, a->absmax[j] + start / OFL_BLOCK);
        }
    }
}

/* The second pass over elements [lo, hi): the weights, from the first pass's m and torch's root. */
HOT void apply_range(const ofl_adam_args *a, int64_t lo, int64_t hi, int64_t base, const float *m,
                     const float *root, int simd) {
    float p[OFL_BLOCK];
    for (int64_t start = lo; start < hi; start += OFL_BLOCK) {
        int64_t n = hi - start < OFL_BLOCK ? hi - start : OFL_BLOCK;
        const float *mb = m + (start - base), *rb = root + (start - base);
        load_weights(a, start, n, p);
        if (a->adamw)
            for (int64_t i = 0; i < n; i++) {
                float decay = a->lr_wd * p[i];
                p[i] = p[i] - decay;
            }
        for (int64_t i = 0; i < n; i++) {
            float denom = rb[i] / a->bc2_sqrt;
            denom = denom + a->eps;
            float step = mb[i] / a->bc1;
            step = a->lr * step;
            step = step / denom;
            p[i] = p[i] - step;
        }
        if (a->param != NULL)
            memcpy(a->param + start, p, (size_t)n * sizeof(float));
#if HAVE_SIMD
        else if (simd)
            round_block_avx2(p, n, a->key0, a->key1, a->first + start, a->param_bf16 + start);
#endif
        else
            for (int64_t i = 0; i < n; i++)
                a->param_bf16[start + i] = round_bf16(p[i], a->key0, a->key1, a->first + start + i);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
/* The same loops for CPUs with AVX2 and FMA: vectorized, and fmaf one instruction instead of a libm call. */
__attribute__((target("avx2,fma"))) static void moments_avx2(const ofl_adam_args *a, int64_t lo, int64_t hi,
                                                              int64_t base, float *m, float *second) {
    moments_range(a, lo, hi, base, m, second, 1);
}

__attribute__((target("avx2,fma"))) static void apply_avx2(const ofl_adam_args *a, int64_t lo, int64_t hi,
                                                            int64_t base, const float *m, const float *root) {
    apply_range(a, lo, hi, base, m, root, 1);
}

static int have_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

static void moments(const ofl_adam_args *a, int64_t lo, int64_t hi, int64_t base, float *m, float *second) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (have_avx2()) {
        moments_avx2(a, lo, hi, base, m, second);
        return;
    }
#endif
    moments_range(a, lo, hi, base, m, second, 0);
}

static void apply(const ofl_adam_args *a, int64_t lo, int64_t hi, int64_t base, const float *m, const float *root) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (have_avx2()) {
        apply_avx2(a, lo, hi, base, m, root);
        return;
    }
#endif
    apply_range(a, lo, hi, base, m, root, 0);
}

/* -- threads ------------------------------------------------------------------------------------- */

typedef struct {
    const ofl_adam_args *step;
    float *m, *second;
    const float *root;
    const float *src;
    uint16_t *dst;
    int64_t first, base;
    uint32_t key0, key1;
    int64_t lo, hi;
} part;

static void *run_moments(void *arg) {
    part *p = arg;
    moments(p->step, p->lo, p->hi, p->base, p->m, p->second);
    return NULL;
}

static void *run_apply(void *arg) {
    part *p = arg;
    apply(p->step, p->lo, p->hi, p->base, p->m, p->root);
    return NULL;
}

static void *run_round(void *arg) {
    part *p = arg;
#if HAVE_SIMD
    if (have_avx2()) {
        round_block_avx2(p->src + p->lo, p->hi - p->lo, p->key0, p->key1, p->first + p->lo, p->dst + p->lo);
        return NULL;
    }
#endif
    for (int64_t i = p->lo; i < p->hi; i++)
        p->dst[i] = round_bf16(p->src[i], p->key0, p->key1, p->first + i);
    return NULL;
}

#define MAX_THREADS 64

/* Split [lo, hi) into up to `threads` parts, each a multiple of `grain` long but the last, running all but
 * the first on threads of their own; a thread that cannot be started runs its part here instead. */
static void split(const part *tmpl, int64_t lo, int64_t hi, int64_t grain, int threads, void *(*fn)(void *)) {
    part parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    int64_t units = (hi - lo + grain - 1) / grain;
    if (units < threads)
        threads = units > 0 ? (int)units : 1;
    int64_t per = (units + threads - 1) / threads * grain;
    for (int t = 0; t < threads; t++) {
        parts[t] = *tmpl;
        parts[t].lo = lo + t * per < hi ? lo + t * per : hi;
        parts[t].hi = lo + (t + 1) * per < hi ? lo + (t + 1) * per : hi;
        started[t] = t > 0 && pthread_create(&ids[t], NULL, fn, &parts[t]) == 0;
    }
    for (int t = 0; t < threads; t++)
        if (!started[t])
            fn(&parts[t]);
    for (int t = 1; t < threads; t++)
        if (started[t])
            pthread_join(ids[t], NULL);
}

static int bad_step(const ofl_adam_args *a, int64_t lo, int64_t hi) {
    if (a == NULL || a->n < 0 || a->first < 0 || lo < 0 || hi < lo || hi > a->n || a->grad == NULL ||
        (a->param == NULL) == (a->param_bf16 == NULL) || a->qmap_signed == NULL || a->qmap_unsigned == NULL ||
        a->steps_signed == NULL || a->steps_unsigned == NULL ||
        a->grad_dtype < OFL_DTYPE_F32 || a->grad_dtype > OFL_DTYPE_F16)
        return 1;
    for (int j = 0; j < (a->amsgrad ? 3 : 2); j++) {
        if (a->moment[j] != NULL)
            continue;
        if (a->codes[j] == NULL || a->absmax[j] == NULL || lo % OFL_BLOCK != 0 || a->first % OFL_BLOCK != 0)
            return 1;
    }
    return 0;
}

/* Threads take whole blocks (a block's codes share one absmax) of at least this many elements each. */
#define GRAIN (1 << 14)

int ofl_adam_moments(const ofl_adam_args *a, int64_t lo, int64_t hi, float *m, float *second, int threads) {
    if (bad_step(a, lo, hi) || m == NULL || second == NULL)
        return -EINVAL;
    part tmpl = {.step = a, .m = m, .second = second, .base = lo};
    split(&tmpl, lo, hi, GRAIN, threads, run_moments);
    return 0;
}

int ofl_adam_apply(const ofl_adam_args *a, int64_t lo, int64_t hi, const float *m, const float *root, int threads) {
    if (bad_step(a, lo, hi) || m == NULL || root == NULL)
        return -EINVAL;
    part tmpl = {.step = a, .m = (float *)m, .root = root, .base = lo};
    split(&tmpl, lo, hi, GRAIN, threads, run_apply);
    return 0;
}

int ofl_round_bf16(const float *src, uint16_t *dst, int64_t n, int64_t first, uint32_t key0, uint32_t key1,
                   int threads) {
    if (src == NULL || dst == NULL || n < 0 || first < 0)
        return -EINVAL;
    part tmpl = {.src = src, .dst = dst, .first = first, .key0 = key0, .key1 = key1};
    split(&tmpl, 0, n, 1 << 16, threads, run_round);
    return 0;
}
