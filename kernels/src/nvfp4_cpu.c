/* NVFP4 quantization on the CPU, bit-identical to kernels/src/reference.py (ModelOpt's math).
 *
 * Hand-written because no library quantizes NVFP4 bit-exactly on the CPU at speed: ModelOpt's own
 * torch path moves 0.055 GB/s on 2 cores. Built at first use with the system C compiler
 * (kernels/src/nvfp4_cpu.py), with -ffp-contract=off so no multiply-add is fused: every operation is
 * one IEEE fp32 operation, as in the reference. The *_mt entry points split the work across the
 * caller's `threads` in kc_pool.c (built into the same library, ahead of this file); rows are
 * independent and an amax is a maximum, so no split can change a byte.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CLONES_AMAX __attribute__((target_clones("avx2", "default")))

static inline float f32_of_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_of_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* amax of |x| over n bf16 values, as the bits of the fp32 result; 0x7F800000 (inf) if any value
 * is NaN or Inf. For finite values |x| orders like its bits, so this is an integer max. */
CLONES_AMAX uint32_t kc_amax_bf16(const uint16_t *x, int64_t n) {
    uint16_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint16_t a = x[i] & 0x7FFF;
        m = a > m ? a : m;
    }
    return m >= 0x7F80 ? 0x7F800000u : (uint32_t)m << 16;
}

CLONES_AMAX uint32_t kc_amax_f32(const uint32_t *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = x[i] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m >= 0x7F800000u ? 0x7F800000u : m;
}

/* Round sb in [2^-9, 448] to e4m3, ties to even; returns the value, stores the byte. */
static inline float e4m3_rne(float sb, uint8_t *byte) {
    int e = (int)((bits_of_f32(sb) >> 23) & 0xFF) - 127;
    if (e < -6) e = -6;
    float q = f32_of_bits((uint32_t)(e - 3 + 127) << 23);
    float inv_q = f32_of_bits((uint32_t)(127 - (e - 3)) << 23);
    float y = sb * inv_q + 8388608.0f; /* exact product; the add rounds to an integer, ties to even */
    float r = y - 8388608.0f;
    float v = r * q;
    *byte = v >= 0.015625f ? (uint8_t)((bits_of_f32(v) >> 20) - (120 << 3)) : (uint8_t)r;
    return v;
}

static inline uint8_t e2m1(float x) {
    float a = x < 0 ? -x : x; /* NaN fails every comparison: code 7, like the reference */
    int mag = 7 - (a <= 5.0f) - (a < 3.5f) - (a <= 2.5f) - (a < 1.75f) - (a <= 1.25f) - (a < 0.75f) - (a <= 0.25f);
    return (uint8_t)(mag | ((x < 0.0f) << 3));
}

/* The largest |v| of a 16-value block, as bits (an integer max over |v|'s bits orders like |v| for finite v). */
static inline uint32_t block_amax_bits(const uint32_t *bits) {
    uint32_t m = 0;
    for (int j = 0; j < 16; j++) {
        uint32_t a = bits[j] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

/* One row of k fp32 values, in vectorizable passes: block amax (an integer max over |v|'s bits,
 * which orders like |v| for finite values; NaN/Inf were rejected by the amax pass), block scales,
 * codes (a division and a comparison chain, branch-free), packing.
 * scratch: k/16 floats for the denominators, then k bytes of codes. */
static inline void quant_row(const float *v, int64_t k, float s2, uint8_t *packed, uint8_t *scales, float *denom,
                             uint8_t *codes) {
    const uint32_t *bits = (const uint32_t *)v;
    for (int64_t b = 0; b < k / 16; b++) {
        uint32_t m = block_amax_bits(bits + b * 16);
        float sb = f32_of_bits(m) / (6.0f * s2);
        if (sb == 0.0f) sb = 1.0f;
        if (sb < 0.001953125f) sb = 0.001953125f;
        if (sb > 448.0f) sb = 448.0f;
        denom[b] = e4m3_rne(sb, scales + b) * s2;
    }
    for (int64_t b = 0; b < k / 16; b++) {
        const float d = denom[b];
        for (int j = 0; j < 16; j++) codes[b * 16 + j] = e2m1(v[b * 16 + j] / d);
    }
    for (int64_t i = 0; i < k / 2; i++) packed[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* quant_row of one row of k bf16 values with AVX2 intrinsics, a 16-block at a time (GCC leaves the byte packing
 * and the block scales scalar and the codes in bytes: seen with perf). The same IEEE
 * operations as quant_row: the block amax an integer max over |x|'s bits, the scale by e4m3_rne, each code from
 * one correctly rounded division (vdivps) and ordered comparisons (NaN: code 7, as e2m1).
 * `fast` (s2 in [2^-80, 2^80], every real checkpoint): no division a value but the GPU kernel's way
 * (nvfp4_triton._fast_code, the same IEEE operations, fma included): q0 = RN(x 4/d), Markstein's correction
 * q = RN(q0 + RN(x - q0 d/4) 4/d), E2M1 of q/4 by Veltkamp's split, the sign by one fma. Its codes equal the
 * correctly rounded quotient's for every bf16 value and 1,052,478 divisors (benchmarks/gpu_division_check.py). */
__attribute__((target("avx2,fma"))) static void quant_row_bf16_avx2(const uint16_t *x, int64_t k, float s2,
                                                                    uint8_t *packed, uint8_t *scales, float *denom,
                                                                    int fast) {
    const __m256i seven = _mm256_set1_epi32(7);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u)), zero = _mm256_setzero_ps();
    const __m256 t50 = _mm256_set1_ps(5.0f), t35 = _mm256_set1_ps(3.5f), t25 = _mm256_set1_ps(2.5f);
    const __m256 t175 = _mm256_set1_ps(1.75f), t125 = _mm256_set1_ps(1.25f), t075 = _mm256_set1_ps(0.75f);
    const __m256 t025 = _mm256_set1_ps(0.25f);
    const __m256i eight = _mm256_set1_epi32(8);
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const float six_s2 = 6.0f * s2;
    uint32_t *amax = (uint32_t *)denom; /* the block amax bits, then in place their denominators */
    for (int64_t b = 0; b < k / 16; b++) { /* the block scales first: no dependency on the codes */
        __m256i raw = _mm256_loadu_si256((const __m256i *)(x + 16 * b));
        __m256i m16 = _mm256_and_si256(raw, _mm256_set1_epi16(0x7FFF));
        __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(m16), _mm256_extracti128_si256(m16, 1));
        m8 = _mm_max_epu16(m8, _mm_shuffle_epi32(m8, 0x4E));
        m8 = _mm_max_epu16(m8, _mm_shuffle_epi32(m8, 0xB1));
        m8 = _mm_max_epu16(m8, _mm_srli_epi32(m8, 16));
        amax[b] = ((uint32_t)_mm_cvtsi128_si32(m8) & 0xFFFFu) << 16;
    }
    int64_t b8 = 0;
    const __m256 v_six_s2 = _mm256_set1_ps(six_s2), v_s2 = _mm256_set1_ps(s2), one = _mm256_set1_ps(1.0f);
    const __m256 lo_clamp = _mm256_set1_ps(0.001953125f), hi_clamp = _mm256_set1_ps(448.0f);
    const __m256 sub_min = _mm256_set1_ps(0.015625f), big = _mm256_set1_ps(8388608.0f);
    for (; b8 + 8 <= k / 16; b8 += 8) { /* e4m3_rne of 8 clamped block scales, each `if` a masked blend */
        __m256 sb = _mm256_div_ps(_mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(amax + b8))), v_six_s2);
        sb = _mm256_blendv_ps(sb, one, _mm256_cmp_ps(sb, zero, _CMP_EQ_OQ));
        sb = _mm256_blendv_ps(sb, lo_clamp, _mm256_cmp_ps(sb, lo_clamp, _CMP_LT_OQ));
        sb = _mm256_blendv_ps(sb, hi_clamp, _mm256_cmp_ps(sb, hi_clamp, _CMP_GT_OQ));
        __m256i e = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(sb), 23),
                                                      _mm256_set1_epi32(0xFF)), _mm256_set1_epi32(127));
        e = _mm256_max_epi32(e, _mm256_set1_epi32(-6));
        __m256 q = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(124)), 23));
        __m256 inv_q = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(130), e), 23));
        __m256 r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(sb, inv_q), big), big);
        __m256 val = _mm256_mul_ps(r, q);
        __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(val), 20), _mm256_set1_epi32(960));
        __m256i sub = _mm256_cvttps_epi32(r);
        __m256i byte = _mm256_blendv_epi8(sub, normal, _mm256_castps_si256(_mm256_cmp_ps(val, sub_min, _CMP_GE_OQ)));
        /* bytes 0-3 and 4-7 land in words 0 and 2 (packs work within 128-bit lanes) */
        __m256i b16 = _mm256_packus_epi32(_mm256_and_si256(byte, _mm256_set1_epi32(0xFF)), _mm256_setzero_si256());
        __m128i b8s = _mm_packus_epi16(_mm256_castsi256_si128(b16), _mm256_extracti128_si256(b16, 1));
        uint32_t w0 = (uint32_t)_mm_cvtsi128_si32(b8s), w1 = (uint32_t)_mm_extract_epi32(b8s, 2);
        memcpy(scales + b8, &w0, 4);
        memcpy(scales + b8 + 4, &w1, 4);
        _mm256_storeu_ps(denom + b8, _mm256_mul_ps(val, v_s2));
    }
    for (; b8 < k / 16; b8++) {
        float sb = f32_of_bits(amax[b8]) / six_s2;
        if (sb == 0.0f) sb = 1.0f;
        if (sb < 0.001953125f) sb = 0.001953125f;
        if (sb > 448.0f) sb = 448.0f;
        denom[b8] = e4m3_rne(sb, scales + b8) * s2;
    }
    for (int64_t b = 0; b < k / 16; b++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(x + 16 * b));
        __m256i i0 = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16);
        __m256i i1 = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16);
        const __m256 d = _mm256_set1_ps(denom[b]);
        __m256i c[2];
        if (fast) { /* nvfp4_triton._fast_code: one reciprocal a block, Markstein's correction (see above) */
            const __m256 r4 = _mm256_set1_ps((1.0f / denom[b]) * 4.0f), d4 = _mm256_set1_ps(denom[b] * 0.25f);
            const __m256 d_low = _mm256_set1_ps(denom[b] * 9.313225746154785e-10f);
            for (int h = 0; h < 2; h++) {
                const __m256 xv = _mm256_castsi256_ps(h ? i1 : i0);
                __m256 q0 = _mm256_mul_ps(xv, r4);
                __m256 q = _mm256_fmadd_ps(_mm256_fnmadd_ps(q0, d4, xv), r4, q0);
                __m256 y = _mm256_min_ps(_mm256_andnot_ps(sign, q), _mm256_set1_ps(24.0f));
                __m256 g = _mm256_mul_ps(y, _mm256_set1_ps(4194305.0f));
                __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(_mm256_add_ps(g, _mm256_sub_ps(y, g))), 22);
                __m256i sub = _mm256_castps_si256(_mm256_add_ps(y, _mm256_set1_ps(16777216.0f)));
                __m256 below = _mm256_cmp_ps(y, _mm256_set1_ps(4.0f), _CMP_LT_OQ);
                __m256i mag = _mm256_and_si256(_mm256_blendv_epi8(hi, sub, _mm256_castps_si256(below)), seven);
                __m256 sgn = _mm256_fmadd_ps(xv, _mm256_set1_ps(1.329227995784916e36f), d_low);
                c[h] = _mm256_or_si256(mag, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(sgn, zero, _CMP_LT_OQ)),
                                                             eight));
            }
        } else for (int h = 0; h < 2; h++) {
            __m256 q = _mm256_div_ps(_mm256_castsi256_ps(h ? i1 : i0), d);
            __m256 a = _mm256_andnot_ps(sign, q);
            __m256i mag = seven; /* 7 minus one for each threshold a is at or below (a mask is -1) */
            mag = _mm256_add_epi32(mag, _mm256_castps_si256(_mm256_cmp_ps(a, t50, _CMP_LE_OQ)));
            mag = _mm256_add_epi32(mag, _mm256_castps_si256(_mm256_cmp_ps(a, t35, _CMP_LT_OQ)));
            mag = _mm256_add_epi32(mag, _mm256_castps_si256(_mm256_cmp_ps(a, t25, _CMP_LE_OQ)));
            mag = _mm256_add_epi32(mag, _mm256_castps_si256(_mm256_cmp_ps(a, t175, _CMP_LT_OQ)));
            mag = _mm256_add_epi32(mag, _mm256_castps_si256(_mm256_cmp_ps(a, t125, _CMP_LE_OQ)));
            mag = _mm256_add_epi32(mag, _mm256_castps_si256(_mm256_cmp_ps(a, t075, _CMP_LT_OQ)));
            mag = _mm256_add_epi32(mag, _mm256_castps_si256(_mm256_cmp_ps(a, t025, _CMP_LE_OQ)));
            __m256i neg = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(q, zero, _CMP_LT_OQ)), eight);
            c[h] = _mm256_or_si256(mag, neg);
        }
        /* 16 codes in order as 16-bit lanes, then each 32-bit lane's pair (c[2j], c[2j+1]) into one byte */
        __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(c[0], c[1]), 0xD8);
        w = _mm256_or_si256(w, _mm256_srli_epi32(w, 12));
        w = _mm256_shuffle_epi8(w, pick);
        uint32_t lo = (uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(w));
        uint32_t hi = (uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(w, 1));
        memcpy(packed + 8 * b, &lo, 4);
        memcpy(packed + 8 * b + 4, &hi, 4);
    }
}
#define KC_HAVE_AVX2_ROW 1

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

/* e4m3_rne of 16 block scales (the `live` ones) from their blocks' amax bits, each `if` of quant_row a masked
 * blend: the scale bytes stored, the denominators (scale * s2) returned. */
AVX512 static inline __m512 scales16_avx512(const uint32_t *amax, __mmask16 live, __m512 v_six_s2, __m512 v_s2,
                                            uint8_t *scales) {
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f), lo_clamp = _mm512_set1_ps(0.001953125f);
    const __m512 hi_clamp = _mm512_set1_ps(448.0f), sub_min = _mm512_set1_ps(0.015625f);
    const __m512 big = _mm512_set1_ps(8388608.0f);
    __m512 sb = _mm512_div_ps(_mm512_castsi512_ps(_mm512_maskz_loadu_epi32(live, amax)), v_six_s2);
    sb = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(sb, zero, _CMP_EQ_OQ), sb, one);
    sb = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(sb, lo_clamp, _CMP_LT_OQ), sb, lo_clamp);
    sb = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(sb, hi_clamp, _CMP_GT_OQ), sb, hi_clamp);
    __m512i e = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(sb), 23),
                                                  _mm512_set1_epi32(0xFF)), _mm512_set1_epi32(127));
    e = _mm512_max_epi32(e, _mm512_set1_epi32(-6));
    __m512 q = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(124)), 23));
    __m512 inv_q = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(130), e), 23));
    __m512 r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(sb, inv_q), big), big);
    __m512 val = _mm512_mul_ps(r, q);
    __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(val), 20), _mm512_set1_epi32(960));
    __m512i byte = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(val, sub_min, _CMP_GE_OQ), _mm512_cvttps_epi32(r),
                                           normal);
    _mm_mask_storeu_epi8(scales, live, _mm512_cvtepi32_epi8(byte));
    return _mm512_mul_ps(val, v_s2);
}

/* 16 codes (0-15, one a 32-bit lane) packed two a byte, the even one in the low nibble, into 8 bytes at `out`. */
AVX512 static inline void pack16_avx512(__m512i c, uint8_t *out) {
    c = _mm512_sllv_epi32(c, _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4));
    c = _mm512_or_si512(c, _mm512_srli_epi64(c, 32));
    _mm_storel_epi64((__m128i *)out, _mm512_cvtepi64_epi8(c));
}

/* quant_row_bf16_avx2's fast path (the same IEEE operations in the same order, so the same bytes) on AVX-512:
 * 16 values a register, so a 16-block's codes are one pass; on the H200 machine's 16 CPUs the AVX2 row was
 * compute-bound (4.0 GB/s a thread, 1.55x the copy floor at 16 threads: docs/history/RESULTS-history.md). The block
 * amaxes 4 blocks a step; the scales, their reciprocals and d/4, d 2^-30 16 blocks a step (one vdivps each, as
 * the scalar 1.0f / d: both correctly rounded). scratch: 4 arrays of k/16 + 16 floats. */
AVX512 static void quant_row_bf16_avx512(
    const uint16_t *x, int64_t k, float s2, uint8_t *packed, uint8_t *scales, float *scratch) {
    const int64_t nb = k / 16, stride = nb + 16;
    uint32_t *amax = (uint32_t *)scratch;
    float *r4s = scratch + stride, *d4s = scratch + 2 * stride, *dls = scratch + 3 * stride;
    int64_t b = 0;
    const __m512i abs16 = _mm512_set1_epi16(0x7FFF);
    /* 64-bit lanes: lo = blocks 0-1's first halves then 2-3's, hi = their second halves */
    const __m512i lo_idx = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), hi_idx = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
    for (; b + 4 <= nb; b += 4) { /* 4 blocks: each 128-bit lane ends up holding one block's 8 candidate maxima */
        __m512i v0 = _mm512_and_si512(_mm512_loadu_si512(x + 16 * b), abs16);
        __m512i v1 = _mm512_and_si512(_mm512_loadu_si512(x + 16 * b + 32), abs16);
        __m512i m = _mm512_max_epu16(_mm512_permutex2var_epi64(v0, lo_idx, v1), _mm512_permutex2var_epi64(v0, hi_idx, v1));
        m = _mm512_max_epu16(m, _mm512_shuffle_epi32(m, 0x4E));
        m = _mm512_max_epu16(m, _mm512_shuffle_epi32(m, 0xB1));
        m = _mm512_max_epu16(m, _mm512_srli_epi32(m, 16));
        m = _mm512_slli_epi32(m, 16); /* each lane's low word is its max: as fp32 bits, the rest shifted out */
        _mm_storeu_si128((__m128i *)(amax + b), _mm512_castsi512_si128(_mm512_maskz_compress_epi32(0x1111, m)));
    }
    for (; b < nb; b++) {
        uint16_t m = 0;
        for (int j = 0; j < 16; j++) m = (x[16 * b + j] & 0x7FFF) > m ? (x[16 * b + j] & 0x7FFF) : m;
        amax[b] = (uint32_t)m << 16;
    }
    const __m512 v_six_s2 = _mm512_set1_ps(6.0f * s2), v_s2 = _mm512_set1_ps(s2), one = _mm512_set1_ps(1.0f);
    const __m512 zero = _mm512_setzero_ps();
    for (b = 0; b < nb; b += 16) {
        const __mmask16 live = nb - b >= 16 ? 0xFFFF : (__mmask16)((1u << (nb - b)) - 1);
        __m512 d = scales16_avx512(amax + b, live, v_six_s2, v_s2, scales + b);
        _mm512_storeu_ps(r4s + b, _mm512_mul_ps(_mm512_div_ps(one, d), _mm512_set1_ps(4.0f)));
        _mm512_storeu_ps(d4s + b, _mm512_mul_ps(d, _mm512_set1_ps(0.25f)));
        _mm512_storeu_ps(dls + b, _mm512_mul_ps(d, _mm512_set1_ps(9.313225746154785e-10f)));
    }
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u));
    const __m512 cap = _mm512_set1_ps(24.0f), split = _mm512_set1_ps(4194305.0f), two24 = _mm512_set1_ps(16777216.0f);
    const __m512 four = _mm512_set1_ps(4.0f), huge = _mm512_set1_ps(1.329227995784916e36f);
    const __m512i seven = _mm512_set1_epi32(7), eight = _mm512_set1_epi32(8);
    for (b = 0; b < nb; b++) { /* nvfp4_triton._fast_code on 16 values: quant_row_bf16_avx2's fast branch */
        const __m512 xv = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + 16 * b))), 16));
        const __m512 r4 = _mm512_set1_ps(r4s[b]);
        __m512 q0 = _mm512_mul_ps(xv, r4);
        __m512 q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, _mm512_set1_ps(d4s[b]), xv), r4, q0);
        __m512 y = _mm512_min_ps(_mm512_andnot_ps(sign, q), cap);
        __m512 g = _mm512_mul_ps(y, split);
        __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(_mm512_add_ps(g, _mm512_sub_ps(y, g))), 22);
        __m512i sub = _mm512_castps_si512(_mm512_add_ps(y, two24));
        __m512i mag = _mm512_and_si512(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(y, four, _CMP_LT_OQ), hi, sub), seven);
        __mmask16 neg = _mm512_cmp_ps_mask(_mm512_fmadd_ps(xv, huge, _mm512_set1_ps(dls[b])), zero, _CMP_LT_OQ);
        pack16_avx512(_mm512_mask_or_epi32(mag, neg, mag, eight), packed + 8 * b);
    }
}

/* quant_row on AVX-512 for fp32 values (decoded INT4 / FP8 rows, fp32 weights): the same IEEE operations, each code
 * from one correctly rounded division (vdivps) and ordered comparisons (NaN: code 7, as e2m1), 16 values a step.
 * scratch: 2 arrays of k/16 + 16 floats. */
AVX512 static void quant_row_f32_avx512(const float *x, int64_t k, float s2, uint8_t *packed, uint8_t *scales,
                                        float *scratch) {
    const int64_t nb = k / 16;
    uint32_t *amax = (uint32_t *)scratch;
    float *ds = scratch + nb + 16;
    const __m512i abs32 = _mm512_set1_epi32(0x7FFFFFFF);
    for (int64_t b = 0; b < nb; b++)
        amax[b] = _mm512_reduce_max_epu32(_mm512_and_si512(_mm512_loadu_si512(x + 16 * b), abs32));
    const __m512 v_six_s2 = _mm512_set1_ps(6.0f * s2), v_s2 = _mm512_set1_ps(s2);
    for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 live = nb - b >= 16 ? 0xFFFF : (__mmask16)((1u << (nb - b)) - 1);
        _mm512_storeu_ps(ds + b, scales16_avx512(amax + b, live, v_six_s2, v_s2, scales + b));
    }
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u)), zero = _mm512_setzero_ps();
    const __m512 t50 = _mm512_set1_ps(5.0f), t35 = _mm512_set1_ps(3.5f), t25 = _mm512_set1_ps(2.5f);
    const __m512 t175 = _mm512_set1_ps(1.75f), t125 = _mm512_set1_ps(1.25f), t075 = _mm512_set1_ps(0.75f);
    const __m512 t025 = _mm512_set1_ps(0.25f);
    const __m512i seven = _mm512_set1_epi32(7), eight = _mm512_set1_epi32(8), one = _mm512_set1_epi32(1);
    for (int64_t b = 0; b < nb; b++) {
        const __m512 q = _mm512_div_ps(_mm512_loadu_ps(x + 16 * b), _mm512_set1_ps(ds[b]));
        const __m512 a = _mm512_andnot_ps(sign, q);
        __m512i mag = seven; /* 7 minus one for each threshold a is at or below */
        mag = _mm512_mask_sub_epi32(mag, _mm512_cmp_ps_mask(a, t50, _CMP_LE_OQ), mag, one);
        mag = _mm512_mask_sub_epi32(mag, _mm512_cmp_ps_mask(a, t35, _CMP_LT_OQ), mag, one);
        mag = _mm512_mask_sub_epi32(mag, _mm512_cmp_ps_mask(a, t25, _CMP_LE_OQ), mag, one);
        mag = _mm512_mask_sub_epi32(mag, _mm512_cmp_ps_mask(a, t175, _CMP_LT_OQ), mag, one);
        mag = _mm512_mask_sub_epi32(mag, _mm512_cmp_ps_mask(a, t125, _CMP_LE_OQ), mag, one);
        mag = _mm512_mask_sub_epi32(mag, _mm512_cmp_ps_mask(a, t075, _CMP_LT_OQ), mag, one);
        mag = _mm512_mask_sub_epi32(mag, _mm512_cmp_ps_mask(a, t025, _CMP_LE_OQ), mag, one);
        const __mmask16 neg = _mm512_cmp_ps_mask(q, zero, _CMP_LT_OQ);
        pack16_avx512(_mm512_mask_or_epi32(mag, neg, mag, eight), packed + 8 * b);
    }
}
#define KC_HAVE_AVX512_ROW 1
#endif

/* Whether the AVX-512 row runs: the CPU has it and KIMI_CONVERT_CPU_ISA (read once) does not cap the kernels at
 * "avx2" (benchmarks time both on one machine; the checks compare both with the torch code). */
static int kc_use_avx512(void) {
#ifdef KC_HAVE_AVX512_ROW
    static int use = -1;
    int u = __atomic_load_n(&use, __ATOMIC_RELAXED);
    if (u < 0) {
        const char *cap = getenv("KIMI_CONVERT_CPU_ISA");
        u = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && !(cap && !strcmp(cap, "avx2"));
        __atomic_store_n(&use, u, __ATOMIC_RELAXED);
    }
    return u;
#else
    return 0;
#endif
}

/* 1 where kc_quant_bf16's rows run on AVX-512 (tests and benchmarks say which path they held to the torch code). */
int kc_nvfp4_avx512(void) { return kc_use_avx512(); }

#define CLONES __attribute__((target_clones("avx2", "default")))

/* x: rows x k bf16 (as uint16); packed: rows x k/2; scales: rows x k/16 e4m3 bytes. */
CLONES void kc_quant_bf16(const uint16_t *x, int64_t rows, int64_t k, float s2, uint8_t *packed, uint8_t *scales) {
    if (!(s2 > 0.0f)) s2 = 1.0f;
#ifdef KC_HAVE_AVX2_ROW
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        /* one reciprocal a block where 1/d stays normal: s2 in [2^-80, 2^80], as nvfp4_triton */
        const int fast = s2 >= 8.271806125530277e-25f && s2 <= 1.2089258196146292e24f;
        if (fast && kc_use_avx512()) {
            float *scratch = malloc(sizeof(float) * 4 * (size_t)(k / 16 + 16));
            for (int64_t r = 0; r < rows; r++)
                quant_row_bf16_avx512(x + r * k, k, s2, packed + r * (k / 2), scales + r * (k / 16), scratch);
            free(scratch);
            return;
        }
        float *denom = malloc(sizeof(float) * (size_t)(k / 16 + 1));
        for (int64_t r = 0; r < rows; r++)
            quant_row_bf16_avx2(x + r * k, k, s2, packed + r * (k / 2), scales + r * (k / 16), denom, fast);
        free(denom);
        return;
    }
#endif
    float *v = malloc(sizeof(float) * (size_t)(k + k / 16) + (size_t)k);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < k; j++) v[j] = f32_of_bits((uint32_t)x[r * k + j] << 16);
        quant_row(v, k, s2, packed + r * (k / 2), scales + r * (k / 16), v + k, (uint8_t *)(v + k + k / 16));
    }
    free(v);
}

CLONES void kc_quant_f32(const float *x, int64_t rows, int64_t k, float s2, uint8_t *packed, uint8_t *scales) {
    if (!(s2 > 0.0f)) s2 = 1.0f;
#ifdef KC_HAVE_AVX512_ROW
    if (kc_use_avx512()) {
        float *scratch = malloc(sizeof(float) * 2 * (size_t)(k / 16 + 16));
        for (int64_t r = 0; r < rows; r++)
            quant_row_f32_avx512(x + r * k, k, s2, packed + r * (k / 2), scales + r * (k / 16), scratch);
        free(scratch);
        return;
    }
#endif
    float *d = malloc(sizeof(float) * (size_t)(k / 16 + 1) + (size_t)k);
    for (int64_t r = 0; r < rows; r++)
        quant_row(x + r * k, k, s2, packed + r * (k / 2), scales + r * (k / 16), d, (uint8_t *)(d + k / 16 + 1));
    free(d);
}

/* --- one ctypes call a kernel: the work split into tasks of kc_pool.c ---------------------------------- */

#define KC_AMAX_CHUNK 4096 /* elements: an amax task's unit */

typedef struct {
    const void *x;
    int64_t n, ntasks;
    int f32;
    uint32_t *parts;
} kc_amax_job;

static void kc_amax_task(void *ctx, int64_t t) {
    kc_amax_job *j = ctx;
    int64_t a, b;
    kc_range((j->n + KC_AMAX_CHUNK - 1) / KC_AMAX_CHUNK, j->ntasks, t, &a, &b);
    a *= KC_AMAX_CHUNK;
    b = b * KC_AMAX_CHUNK < j->n ? b * KC_AMAX_CHUNK : j->n;
    j->parts[t] = j->f32 ? kc_amax_f32((const uint32_t *)j->x + a, b - a)
                         : kc_amax_bf16((const uint16_t *)j->x + a, b - a);
}

static uint32_t kc_amax_mt(const void *x, int64_t n, int f32, int32_t threads) {
    const int64_t chunks = (n + KC_AMAX_CHUNK - 1) / KC_AMAX_CHUNK;
    uint32_t parts[4 * 1024 + 1];
    int64_t ntasks = kc_tasks(chunks, KC_AMAX_CHUNK, threads > 1024 ? 1024 : threads, KC_MIN_SPLIT);
    if (!ntasks) return 0;
    kc_amax_job j = {x, n, ntasks, f32, parts};
    kc_parallel(kc_amax_task, &j, ntasks, threads);
    uint32_t m = 0;
    for (int64_t t = 0; t < ntasks; t++) m = parts[t] > m ? parts[t] : m;
    return m;
}

/* amax of n values, as kc_amax_bf16 / kc_amax_f32, on `threads` threads. */
uint32_t kc_amax_bf16_mt(const uint16_t *x, int64_t n, int32_t threads) { return kc_amax_mt(x, n, 0, threads); }
uint32_t kc_amax_f32_mt(const uint32_t *x, int64_t n, int32_t threads) { return kc_amax_mt(x, n, 1, threads); }

typedef struct {
    const void *x;
    int64_t rows, k, ntasks;
    float s2;
    int f32;
    uint8_t *packed, *scales;
} kc_quant_job;

/* Rows a step of a quantize task, which walks its range from the end: the amax pass read each task's range
 * forwards (the same split, near enough), so what it read last is what the last-level cache still holds. */
#define KC_QUANT_STEP_BYTES (256 << 10)

static void kc_quant_task(void *ctx, int64_t t) {
    kc_quant_job *j = ctx;
    int64_t a, b;
    kc_range(j->rows, j->ntasks, t, &a, &b);
    const int64_t row_bytes = j->k * (j->f32 ? 4 : 2);
    const int64_t step = row_bytes >= KC_QUANT_STEP_BYTES ? 1 : KC_QUANT_STEP_BYTES / row_bytes;
    for (int64_t hi = b; hi > a; hi -= step) {
        const int64_t lo = hi - step > a ? hi - step : a;
        uint8_t *p = j->packed + lo * (j->k / 2), *s = j->scales + lo * (j->k / 16);
        if (j->f32)
            kc_quant_f32((const float *)j->x + lo * j->k, hi - lo, j->k, j->s2, p, s);
        else
            kc_quant_bf16((const uint16_t *)j->x + lo * j->k, hi - lo, j->k, j->s2, p, s);
    }
}

static void kc_quant_mt(const void *x, int64_t rows, int64_t k, float s2, uint8_t *packed, uint8_t *scales, int f32,
                        int32_t threads) {
    kc_quant_job j = {x, rows, k, kc_tasks(rows, k, threads, KC_MIN_SPLIT), s2, f32, packed, scales};
    kc_parallel(kc_quant_task, &j, j.ntasks, threads);
}

/* kc_quant_bf16 / kc_quant_f32 of rows x k on `threads` threads. */
void kc_quant_bf16_mt(const uint16_t *x, int64_t rows, int64_t k, float s2, uint8_t *packed, uint8_t *scales,
                      int32_t threads) {
    kc_quant_mt(x, rows, k, s2, packed, scales, 0, threads);
}
void kc_quant_f32_mt(const float *x, int64_t rows, int64_t k, float s2, uint8_t *packed, uint8_t *scales,
                     int32_t threads) {
    kc_quant_mt(x, rows, k, s2, packed, scales, 1, threads);
}

/* --- compressed-tensors' NVFP4 arithmetic (ct_nvfp4.py, step by step; the same IEEE operations) ----------------
 * g: weight_global_scale (448*6/amax, computed by the caller in the weights' dtype). Per 16-block:
 * local = block_amax / 6 (rounded to bf16 for bf16 weights: compressed-tensors divides in the weights' dtype),
 * s = e4m3(min(g * local, 448)), 0 -> 0.125; each code e2m1(x / (s / g)) (sign from the quotient, as
 * cast_to_fp4's sign(x) * magnitude with pack_fp4_to_uint8's signbit). */

static inline float bf16_rne(float f) { /* finite f */
    uint32_t u = bits_of_f32(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return f32_of_bits(u & 0xFFFF0000u);
}

static inline void ct_quant_row(const float *v, int64_t k, float g, int bf16_local, uint8_t *packed, uint8_t *scales,
                                float *denom, uint8_t *codes) {
    const uint32_t *bits = (const uint32_t *)v;
    for (int64_t b = 0; b < k / 16; b++) {
        uint32_t m = block_amax_bits(bits + b * 16);
        float local = f32_of_bits(m) / 6.0f;
        if (bf16_local) local = bf16_rne(local);
        float s = g * local;
        if (s > 448.0f) s = 448.0f;
        float q = e4m3_rne(s, scales + b);
        if (q == 0.0f) q = e4m3_rne(0.125f, scales + b);
        denom[b] = q / g;
    }
    for (int64_t b = 0; b < k / 16; b++) {
        const float d = denom[b];
        for (int j = 0; j < 16; j++) codes[b * 16 + j] = e2m1(v[b * 16 + j] / d);
    }
    for (int64_t i = 0; i < k / 2; i++) packed[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
}

typedef struct {
    const void *x;
    int64_t rows, k, ntasks;
    float g;
    int f32;
    uint8_t *packed, *scales;
} kc_ct_job;

CLONES static void kc_ct_rows(const kc_ct_job *j, int64_t lo, int64_t hi) {
    const int64_t k = j->k;
    float *v = malloc(sizeof(float) * (size_t)(k + k / 16 + 1) + (size_t)k);
    float *denom = v + k;
    uint8_t *codes = (uint8_t *)(denom + k / 16 + 1);
    for (int64_t r = lo; r < hi; r++) {
        const float *row;
        if (j->f32) {
            row = (const float *)j->x + r * k;
        } else {
            const uint16_t *x = (const uint16_t *)j->x + r * k;
            for (int64_t c = 0; c < k; c++) v[c] = f32_of_bits((uint32_t)x[c] << 16);
            row = v;
        }
        ct_quant_row(row, k, j->g, !j->f32, j->packed + r * (k / 2), j->scales + r * (k / 16), denom, codes);
    }
    free(v);
}

static void kc_ct_task(void *ctx, int64_t t) {
    kc_ct_job *j = ctx;
    int64_t a, b;
    kc_range(j->rows, j->ntasks, t, &a, &b);
    kc_ct_rows(j, a, b);
}

/* rows x k of bf16 (f32 = 0: the block amax / 6 rounded to bf16) or fp32 values on `threads` threads. */
void kc_ct_quant_mt(const void *x, int64_t rows, int64_t k, float g, int32_t f32, uint8_t *packed, uint8_t *scales,
                    int32_t threads) {
    kc_ct_job j = {x, rows, k, kc_tasks(rows, k, threads, KC_MIN_SPLIT), g, f32, packed, scales};
    kc_parallel(kc_ct_task, &j, j.ntasks, threads);
}

/* --- weights quantized from their codes: Kimi K2.5's INT4 pack-quantized, DeepSeek's 128x128 block FP8 ---------
 * Each row decoded into a buffer the cache holds, then amax'd or quantized as the fp32 row it is: the values of
 * recipe_cpu.c kc_int4_rows and kernels/src/encodings.py decode_int4, (code - 8) * scale, or of decode_fp8_block,
 * e4m3(code) * scale_inv of the code's tile, each one IEEE multiply, so the bytes of kc_amax_f32 / kc_quant_f32 /
 * kc_ct_quant_mt on the decoded weight. Why: decoded whole, the weight is 4 bytes a value written to memory and read
 * back twice, for a source of half a byte or one (compute_early.py). */

/* One row: `packed` k/2 bytes (codes + 8, two a byte, the low nibble first), `scale` k/(2*half) fp32 scales. */
static inline void int4_row(const uint8_t *restrict packed, const float *restrict scale, int64_t k, int64_t half,
                            float *restrict out) {
    for (int64_t g = 0; g < k / (2 * half); g++) {
        const float sc = scale[g];
        const uint8_t *p = packed + g * half;
        float *o = out + 2 * g * half;
        for (int64_t b = 0; b < half; b++) {
            o[2 * b] = (float)((int32_t)(p[b] & 15u) - 8) * sc;
            o[2 * b + 1] = (float)((int32_t)(p[b] >> 4) - 8) * sc;
        }
    }
}

/* The amax bits of int4_row's values without decoding them: a group's largest |code - 8| times its scale's magnitude,
 * one IEEE multiply, is the largest |(code - 8) * scale| of the group bit for bit (rounding to nearest is monotonic
 * and symmetric, and |code - 8| <= 8 is exact in fp32); an overflow is infinity in both. Why: the amax pass decoded
 * every value to read one maximum a group (benchmarks/RESULTS.md, issue 38's session 36 section). */
static inline int32_t int4_top(const uint8_t *restrict p, int64_t n) {
    /* the largest |code - 8| of n packed bytes (both nibbles) */
    int32_t top = 0;
    for (int64_t b = 0; b < n; b++) {
        const int32_t lo = (int32_t)(p[b] & 15u) - 8, hi = (int32_t)(p[b] >> 4) - 8;
        const int32_t a = lo < 0 ? -lo : lo, c = hi < 0 ? -hi : hi;
        top = a > top ? a : top;
        top = c > top ? c : top;
    }
    return top;
}

/* a group's amax bits from its largest |code - 8| and its scale, folded into the running maximum m */
static inline uint32_t int4_group_amax(uint32_t m, int32_t top, float scale) {
    const uint32_t bits = bits_of_f32((float)top * scale) & 0x7FFFFFFFu;
    return bits > m ? bits : m;
}

static inline uint32_t int4_row_amax(const uint8_t *restrict packed, const float *restrict scale, int64_t k,
                                     int64_t half) {
    uint32_t m = 0;
    for (int64_t g = 0; g < k / (2 * half); g++) m = int4_group_amax(m, int4_top(packed + g * half, half), scale[g]);
    return m;
}

#ifdef KC_HAVE_AVX512_ROW
/* int4_row_amax on AVX-512, for groups of whole 16-byte chunks (`half` a multiple of 16): each chunk's largest
 * |code - 8| (saturating byte differences, both nibbles, then a maximum within each 128-bit lane) into `tops`
 * (k/32 bytes), then the scalar row's multiply and maximum a group. */
AVX512 static uint32_t int4_row_amax_avx512(const uint8_t *restrict packed, const float *restrict scale, int64_t k,
                                            int64_t half, uint8_t *restrict tops) {
    const int64_t n = k / 2;
    const __m512i low = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
    int64_t b = 0;
    for (; b + 64 <= n; b += 64) {
        const __m512i x = _mm512_loadu_si512((const void *)(packed + b));
        const __m512i lo = _mm512_and_si512(x, low), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
        __m512i a = _mm512_max_epu8(_mm512_or_si512(_mm512_subs_epu8(lo, eight), _mm512_subs_epu8(eight, lo)),
                                    _mm512_or_si512(_mm512_subs_epu8(hi, eight), _mm512_subs_epu8(eight, hi)));
        a = _mm512_max_epu8(a, _mm512_bsrli_epi128(a, 8));
        a = _mm512_max_epu8(a, _mm512_bsrli_epi128(a, 4));
        a = _mm512_max_epu8(a, _mm512_bsrli_epi128(a, 2));
        a = _mm512_max_epu8(a, _mm512_bsrli_epi128(a, 1));
        uint8_t lanes[64];
        _mm512_storeu_si512((void *)lanes, a);
        for (int l = 0; l < 4; l++) tops[b / 16 + l] = lanes[16 * l];
    }
    for (; b < n; b += 16) tops[b / 16] = (uint8_t)int4_top(packed + b, 16);
    uint32_t m = 0;
    for (int64_t g = 0, c = 0; g < k / (2 * half); g++) {
        uint8_t top = 0;
        for (const int64_t end = c + half / 16; c < end; c++) top = tops[c] > top ? tops[c] : top;
        m = int4_group_amax(m, top, scale[g]);
    }
    return m;
}

/* int4_row on AVX-512: 16 bytes of a group at a time, their low and high nibbles interleaved into 32 values, each
 * (code - 8) converted exactly and multiplied by the group's scale once: the scalar row's values. */
AVX512 static void int4_row_avx512(const uint8_t *restrict packed, const float *restrict scale, int64_t k,
                                   int64_t half, float *restrict out) {
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    const __m512i low = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
    for (int64_t g = 0; g < k / (2 * half); g++) {
        const float sc = scale[g];
        const __m512 vsc = _mm512_set1_ps(sc);
        const uint8_t *p = packed + g * half;
        float *o = out + 2 * g * half;
        int64_t b = 0;
        for (; b + 16 <= half; b += 16) {
            const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + b)));
            const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(x, low), eight);
            const __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(x, 4), eight);
            _mm512_storeu_ps(o + 2 * b, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, first, hi)), vsc));
            _mm512_storeu_ps(o + 2 * b + 16,
                             _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, second, hi)), vsc));
        }
        for (; b < half; b++) {
            o[2 * b] = (float)((int32_t)(p[b] & 15u) - 8) * sc;
            o[2 * b + 1] = (float)((int32_t)(p[b] >> 4) - 8) * sc;
        }
    }
}
#endif

/* fp32 value of each float8_e4m3fn byte (no infinities; S.1111.111 is NaN), as torch's float8_e4m3fn.float() */
static float kc_e4m3[256];
static pthread_once_t kc_e4m3_once = PTHREAD_ONCE_INIT;

static void kc_e4m3_init(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        float mag = e ? (float)(8 + m) * f32_of_bits((uint32_t)(e - 10 + 127) << 23) : (float)m * 0.001953125f;
        if ((b & 0x7F) == 0x7F) mag = f32_of_bits(0x7FC00000u);
        kc_e4m3[b] = b & 0x80 ? -mag : mag;
    }
}

#ifdef KC_HAVE_AVX512_ROW
/* kc_e4m3 of 16 codes by arithmetic: a normal one's exponent and mantissa fields moved into fp32's (bias 7 -> 127), a
 * subnormal one m * 2^-9 (exact), NaN for S.1111.111, the sign bit moved over; the same values as the table. */
AVX512 static inline __m512 e4m3_16_avx512(__m128i bytes) {
    const __m512i b = _mm512_cvtepu8_epi32(bytes), mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(7))),
                                     _mm512_set1_ps(0.001953125f));
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    __m512i v = _mm512_mask_blend_epi32(_mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32(8)), _mm512_castps_si512(sub),
                                        normal);
    v = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), v,
                                _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(_mm512_or_si512(v, _mm512_slli_epi32(_mm512_srli_epi32(b, 7), 31)));
}

/* fp8_row on AVX-512: 16 values a step, the tile's tail by the table. */
AVX512 static void fp8_row_avx512(const uint8_t *restrict q, const float *restrict scale, int64_t k, int64_t bn,
                                  float *restrict out) {
    for (int64_t c0 = 0, t = 0; c0 < k; c0 += bn, t++) {
        const float sc = scale[t];
        const __m512 vsc = _mm512_set1_ps(sc);
        const int64_t w = k - c0 < bn ? k - c0 : bn;
        int64_t c = 0;
        for (; c + 16 <= w; c += 16)
            _mm512_storeu_ps(out + c0 + c, _mm512_mul_ps(e4m3_16_avx512(_mm_loadu_si128((const __m128i *)(q + c0 + c))),
                                                         vsc));
        for (; c < w; c++) out[c0 + c] = kc_e4m3[q[c0 + c]] * sc;
    }
}
#endif

/* One row of k e4m3 codes, `scale` the fp32 scales of its tile row (one each `bn` columns). */
static inline void fp8_row(const uint8_t *restrict q, const float *restrict scale, int64_t k, int64_t bn,
                           float *restrict out) {
#ifdef KC_HAVE_AVX512_ROW
    if (kc_use_avx512()) {
        fp8_row_avx512(q, scale, k, bn, out);
        return;
    }
#endif
    for (int64_t c0 = 0, t = 0; c0 < k; c0 += bn, t++) {
        const float sc = scale[t];
        const int64_t w = k - c0 < bn ? k - c0 : bn;
        for (int64_t c = 0; c < w; c++) out[c0 + c] = kc_e4m3[q[c0 + c]] * sc;
    }
}

typedef struct {
    const uint8_t *packed; /* INT4: k/2 bytes a row; FP8: k codes a row */
    const float *scale;    /* INT4: `groups` a row; FP8: `groups` a tile row of `bm` rows, one each `bn` columns */
    int64_t rows, k, groups, bm, bn, ntasks; /* bm = 0: INT4 */
    float s2;       /* ModelOpt's weight_scale_2, or compressed-tensors' global scale g (ct) */
    int ct;         /* compressed-tensors' arithmetic (kc_ct_quant_mt's fp32 rows) */
    uint32_t *amax; /* the amax pass: each task's amax bits (no codes written) */
    uint8_t *out, *scales;
    uint16_t *bf16; /* the decode pass: the values rounded to bf16 (no amax, no codes) */
} kc_rowsq_job;

/* fp32 -> bf16 bits, rounded to nearest even, a NaN of either sign 0xFFFF: torch's CPU Tensor.to(torch.bfloat16)
 * (ATen's vectorized cvtfp32_bf16; tests/test_early.py holds the bytes to torch's). */
static inline uint16_t bf16_bits_torch(float f) {
    const uint32_t u = bits_of_f32(f);
    return f != f ? 0xFFFFu : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

CLONES static void kc_rowsq_rows(const kc_rowsq_job *j, int64_t lo, int64_t hi, int64_t t) {
    const int64_t k = j->k, half = j->bm ? 0 : k / j->groups / 2;
    float *v = malloc(sizeof(float) * (size_t)(k + 2 * (k / 16 + 16)) + (size_t)k);
    float *denom = v + k; /* quant_row's k/16 + 1, or quant_row_f32_avx512's 2 * (k/16 + 16) */
    uint8_t *codes = (uint8_t *)(denom + 2 * (k / 16 + 16));
#ifdef KC_HAVE_AVX512_ROW
    const int avx512 = kc_use_avx512();
#endif
    const float s2 = j->ct || j->s2 > 0.0f ? j->s2 : 1.0f; /* kc_quant_f32's */
    uint32_t m = 0;
    for (int64_t r = lo; r < hi; r++) {
        if (!j->bm && j->amax) { /* an INT4 row's amax needs no decoded value */
            const uint8_t *p = j->packed + r * (k / 2);
            const float *sc = j->scale + r * j->groups;
#ifdef KC_HAVE_AVX512_ROW
            const uint32_t a = avx512 && half % 16 == 0 ? int4_row_amax_avx512(p, sc, k, half, codes)
                                                        : int4_row_amax(p, sc, k, half);
#else
            const uint32_t a = int4_row_amax(p, sc, k, half);
#endif
            m = a > m ? a : m;
            continue;
        }
        if (j->bm)
            fp8_row(j->packed + r * k, j->scale + (r / j->bm) * j->groups, k, j->bn, v);
#ifdef KC_HAVE_AVX512_ROW
        else if (avx512)
            int4_row_avx512(j->packed + r * (k / 2), j->scale + r * j->groups, k, half, v);
#endif
        else
            int4_row(j->packed + r * (k / 2), j->scale + r * j->groups, k, half, v);
        uint8_t *p = j->out ? j->out + r * (k / 2) : 0, *s = j->scales ? j->scales + r * (k / 16) : 0;
        if (j->bf16) {
            for (int64_t c = 0; c < k; c++) j->bf16[r * k + c] = bf16_bits_torch(v[c]);
        } else if (j->amax) {
            const uint32_t *bits = (const uint32_t *)v;
            for (int64_t c = 0; c < k; c++) {
                uint32_t a = bits[c] & 0x7FFFFFFFu;
                m = a > m ? a : m;
            }
        } else if (j->ct) {
            ct_quant_row(v, k, s2, 0, p, s, denom, codes);
        } else {
#ifdef KC_HAVE_AVX512_ROW
            if (avx512) {
                quant_row_f32_avx512(v, k, s2, p, s, denom);
                continue;
            }
#endif
            quant_row(v, k, s2, p, s, denom, codes);
        }
    }
    if (j->amax) j->amax[t] = m >= 0x7F800000u ? 0x7F800000u : m;
    free(v);
}

static void kc_rowsq_task(void *ctx, int64_t t) {
    kc_rowsq_job *j = ctx;
    int64_t a, b;
    kc_range(j->rows, j->ntasks, t, &a, &b);
    kc_rowsq_rows(j, a, b, t);
}

/* The amax pass of job j (its `amax` room for one entry a task: 4 a thread, up to 1024 threads), their maximum. */
static uint32_t kc_rowsq_amax(kc_rowsq_job *j, int32_t threads) {
    j->ntasks = kc_tasks(j->rows, j->k, threads > 1024 ? 1024 : threads, KC_MIN_SPLIT);
    if (!j->ntasks) return 0;
    kc_parallel(kc_rowsq_task, j, j->ntasks, threads);
    uint32_t m = 0;
    for (int64_t t = 0; t < j->ntasks; t++) m = j->amax[t] > m ? j->amax[t] : m;
    return m;
}

/* The fp32 amax bits of the decoded rows x k weight (`groups` scales a row, each of an even k/groups values):
 * 0x7F800000 where a product overflows fp32 (the caller checked the scales finite), as kc_amax_f32_mt. */
uint32_t kc_int4_amax_mt(const uint8_t *packed, const float *scale, int64_t rows, int64_t k, int64_t groups,
                         int32_t threads) {
    uint32_t parts[4 * 1024];
    kc_rowsq_job j = {packed, scale, rows, k, groups, 0, 0, 0, 0.0f, 0, parts, 0, 0, 0};
    return kc_rowsq_amax(&j, threads);
}

/* kc_quant_f32_mt (ct = 0: s2 ModelOpt's weight_scale_2) or kc_ct_quant_mt's fp32 rows (ct = 1: s2 the global
 * scale) of the decoded weight, without it in memory. */
void kc_int4_quant_mt(const uint8_t *packed, const float *scale, int64_t rows, int64_t k, int64_t groups, float s2,
                      int32_t ct, uint8_t *out, uint8_t *scales, int32_t threads) {
    kc_rowsq_job j = {packed, scale, rows, k, groups, 0, 0, kc_tasks(rows, k, threads, KC_MIN_SPLIT), s2, ct, 0, out,
                      scales, 0};
    kc_parallel(kc_rowsq_task, &j, j.ntasks, threads);
}

/* The fp32 amax bits of a block FP8 weight decoded (codes rows x k, fp32 scales [ceil(rows/bm), ceil(k/bn)]): a
 * NaN code gives 0x7F800000, as kc_amax_f32_mt (the caller checked the scales, so no product overflows). */
uint32_t kc_fp8_amax_mt(const uint8_t *codes, const float *scale, int64_t rows, int64_t k, int64_t bm, int64_t bn,
                        int32_t threads) {
    pthread_once(&kc_e4m3_once, kc_e4m3_init);
    uint32_t parts[4 * 1024];
    kc_rowsq_job j = {codes, scale, rows, k, (k + bn - 1) / bn, bm, bn, 0, 0.0f, 0, parts, 0, 0, 0};
    return kc_rowsq_amax(&j, threads);
}

/* kc_int4_quant_mt's of a block FP8 weight. */
void kc_fp8_quant_mt(const uint8_t *codes, const float *scale, int64_t rows, int64_t k, int64_t bm, int64_t bn,
                     float s2, int32_t ct, uint8_t *out, uint8_t *scales, int32_t threads) {
    pthread_once(&kc_e4m3_once, kc_e4m3_init);
    kc_rowsq_job j = {codes, scale, rows, k, (k + bn - 1) / bn, bm, bn, kc_tasks(rows, k, threads, KC_MIN_SPLIT), s2,
                      ct, 0, out, scales, 0};
    kc_parallel(kc_rowsq_task, &j, j.ntasks, threads);
}

/* A block FP8 weight decoded and rounded to bf16 as torch rounds on the CPU (a kept layer stored FP8), into `out`
 * (rows x k), a row at a time: the fp32 weight never in memory. */
void kc_fp8_decode_bf16_mt(const uint8_t *codes, const float *scale, int64_t rows, int64_t k, int64_t bm, int64_t bn,
                           uint16_t *out, int32_t threads) {
    pthread_once(&kc_e4m3_once, kc_e4m3_init);
    kc_rowsq_job j = {codes, scale, rows, k, (k + bn - 1) / bn, bm, bn, kc_tasks(rows, k, threads, KC_MIN_SPLIT), 0.0f,
                      0, 0, 0, 0, out};
    kc_parallel(kc_rowsq_task, &j, j.ntasks, threads);
}
