/* NVIDIA's K3 recipe kernels on the CPU: the closed-form MXFP4 -> NVFP4 cast and the 128x128 block FP8
 * quantizer, bit-identical to kernels/src/mxfp4_cast.py and kernels/src/fp8_block.py (torch 2.13's rounding); and
 * the INT4 pack-quantized decode of Kimi K2.5's experts, bit-identical to kernels/src/encodings.py decode_int4.
 *
 * Built and called like nvfp4_cpu.c (kernels/src/recipe_cpu.py): system C compiler at first use,
 * -ffp-contract=off (every operation one IEEE fp32 operation, as torch's); the *_mt entry points split
 * rows (the cast) or bands' tile runs (block FP8) across the caller's threads in kc_pool.c, which is
 * built into the same library ahead of this file.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CLONES __attribute__((target_clones("avx2", "default")))

#if defined(__SSE2__)
#include <emmintrin.h>
#define KC_STREAM 1
#endif

/* n bytes from src to dst, with non-temporal stores where `stream` is set, dst is 16-byte aligned and n a
 * multiple of 16 (else memcpy). Why: a plain store first reads its line (read for ownership), so an output as
 * large as the input (the cast) costs 1.5x the bytes of the memory floor, which is measured with a copy. The caller
 * ends its task with kc_stream_fence. */
static inline __attribute__((always_inline)) void kc_store(uint8_t *restrict dst, const uint8_t *restrict src,
                                                            int64_t n, int stream) {
#ifdef KC_STREAM
    if (stream && !((uintptr_t)dst & 15) && !(n & 15)) {
        for (int64_t i = 0; i < n; i += 16)
            _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
        return;
    }
#endif
    memcpy(dst, src, (size_t)n);
}

static inline void kc_stream_fence(int stream) {
#ifdef KC_STREAM
    if (stream) _mm_sfence();
#else
    (void)stream;
#endif
}

static inline float f32_of_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_of_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* 2^k in fp32 for an integer k, as torch.exp2 / float(2.0**k): subnormal below -126, 0 below -149, inf above 127. */
static inline float pow2f(int k) {
    if (k > 127) return f32_of_bits(0x7F800000u);
    if (k >= -126) return f32_of_bits((uint32_t)(k + 127) << 23);
    if (k >= -149) return f32_of_bits(1u << (k + 149));
    return 0.0f;
}

/* torch 2.13's fp32 -> float8_e4m3fn (c10 fp8e4m3fn_from_fp32_value): round to nearest even, finite overflow and
 * inf saturate to 448 (0x7E), NaN gives 0x7F; the sign is kept (also on NaN and zero). */
static inline uint8_t e4m3_of(float f) {
    uint32_t b = bits_of_f32(f);
    uint32_t sign = b & 0x80000000u;
    b ^= sign;
    uint8_t r;
    if (b >= (1087u << 20)) {
        r = b > 0x7F800000u ? 0x7F : 0x7E;
    } else if (b < (121u << 23)) {
        r = (uint8_t)(bits_of_f32(f32_of_bits(b) + f32_of_bits(141u << 23)) - (141u << 23));
    } else {
        b += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((b >> 20) & 1u);
        r = (uint8_t)(b >> 20);
        if (r == 0x7F) r = 0x7E;
    }
    return (uint8_t)(r | (sign >> 24));
}

/* float8_e4m3fn -> fp32 (exact; 0x7F / 0xFF are NaN). */
static inline float e4m3_value(uint8_t v) {
    uint32_t s = (uint32_t)(v & 0x80) << 24, e = (v >> 3) & 0xF, m = v & 7;
    if (e == 15 && m == 7) return f32_of_bits(s | 0x7FC00000u);
    if (e == 0) return f32_of_bits(s | bits_of_f32((float)m * 0.001953125f));
    return f32_of_bits(s | ((e + 120) << 23) | (m << 20));
}

/* E2M1 code of fp32 x, as reference.e2m1_codes: nearest, ties to even, saturating; NaN gives 7. */
static inline uint8_t e2m1(float x) {
    float a = x < 0 ? -x : x;
    int mag = 7 - (a <= 5.0f) - (a < 3.5f) - (a <= 2.5f) - (a < 1.75f) - (a <= 1.25f) - (a < 0.75f) - (a <= 0.25f);
    return (uint8_t)(mag | ((x < 0.0f) << 3));
}

static const float E2M1_VALUES[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 8 bytes of codes with every negative zero (0x8 nibble) made 0x0. */
static inline uint64_t clear_negative_zeros(uint64_t w) {
    const uint64_t low3 = 0x7777777777777777ull, sign = 0x8888888888888888ull;
    uint64_t nonzero = ((w & low3) + low3) & sign; /* bit 3 of a nibble: its magnitude is not 0 */
    return w & (nonzero | low3);
}

/* The torch code's arithmetic for a 32-block of E8M0 byte `e` whose largest code magnitude is `mx`
 * (mxfp4_cast.cast step by step), as a rule: its e4m3 scale byte, and each of the 16 codes' output code (kept with
 * -0 made 0 where the scale times s2 is the block's 2^k, else E2M1(value / (scale * s2))). A block's result is
 * its rule applied to its codes: the rule depends on nothing else, and on `mx` only where e's exponent lies
 * outside the window around the tensor's own k_max `own` (rule_key). */
static uint8_t cast_rule(int e, int mx, int own, int m, float s2, uint8_t map[16]) {
    static const float table[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const int k = e - 127;
    const float pow2 = pow2f(k);
    const int delta = k - (own - 8);
    const float amax = delta >= -9 && delta <= 8 ? 6.0f * pow2 : table[mx] * pow2;
    float sbq = amax / (6.0f * s2);
    sbq = sbq < 0.001953125f ? 0.001953125f : sbq; /* torch.clamp: NaN passes through */
    sbq = sbq > 448.0f ? 448.0f : sbq;
    const uint8_t sb = e4m3_of(sbq);
    const float sbf = e4m3_value(sb);
    const int closed = e > 0 && sbf == pow2f(k - m);
    const float denom = sbf * s2;
    for (int c = 0; c < 16; c++) /* the values e2m1 * 2^k are exact in bf16 */
        map[c] = closed ? (uint8_t)(c == 8 ? 0 : c) : e2m1(E2M1_VALUES[c] * pow2 / denom);
    return sb;
}

/* The index of a block's rule among 256 x 8: its E8M0 byte, and its largest code magnitude where the rule
 * depends on it. */
static inline int rule_key(const uint8_t *src, int e, int own) {
    const int delta = e - 127 - (own - 8);
    if (delta >= -9 && delta <= 8) return e * 8;
    int mx = 0;
    for (int j = 0; j < 16; j++) {
        int lo = src[j] & 7, hi = (src[j] >> 4) & 7;
        mx = lo > mx ? lo : mx;
        mx = hi > mx ? hi : mx;
    }
    return e * 8 + mx;
}

/* The rules a cast has met, each computed the first time a block needs it. Why: a block outside the closed form's
 * window (an all-zero block's E8M0 0, a lossy exponent) costs its rule's 16 divisions, on subnormal floats for
 * small exponents, some 20x a block in the window; a tensor meets a few of the 2048 rules. */
typedef struct {
    uint8_t have[256 * 8], sb[256 * 8], map[256 * 8][16];
} cast_rules;

static inline uint8_t cast_block(cast_rules *rules, const uint8_t *src, int e, int own, int m, float s2,
                                 uint8_t *dst) {
    const int key = rule_key(src, e, own);
    if (!rules->have[key]) {
        rules->sb[key] = cast_rule(e, key & 7, own, m, s2, rules->map[key]);
        rules->have[key] = 1;
    }
    const uint8_t *map = rules->map[key];
    for (int j = 0; j < 16; j++) dst[j] = (uint8_t)(map[src[j] & 15] | (map[src[j] >> 4] << 4));
    return rules->sb[key];
}

/* The cast of `rows` rows of an MXFP4 tensor: packed [rows, 16 * kb] bytes, E8M0 scale [rows, kb]
 * (kb 32-blocks a row), under own k_max `own` (the tensor's) and the group's `shared` k_max.
 * Writes codes [rows, 16 * kb] and e4m3 scales [rows, 2 * kb]; returns NVIDIA's lossless count
 * (blocks with k >= shared - 17 or E8M0 == 0).
 * Per E8M0 value, a table says whether its blocks are closed-form whatever their codes (an exponent in the
 * window: their scale is a power of two, 2^(k - m)) and gives that scale's byte; runs of such blocks are a
 * masked copy of 8-byte words; any other block is computed as the torch code computes it (cast_block). */
CLONES int64_t kc_cast_mxfp4(const uint8_t *packed, const uint8_t *scale, int64_t rows, int64_t kb, int32_t own,
                             int32_t shared, uint8_t *out, uint8_t *sb_out, int stream) {
    const int m = shared - 8;
    const float s2 = pow2f(m);
    uint8_t fast[256], fast_sb[256], lossless_of[256];
    for (int e = 0; e < 256; e++) {
        const int k = e - 127, delta = k - (own - 8), kmm = k - m;
        fast[e] = e > 0 && delta >= -9 && delta <= 8 && kmm >= -9 && kmm <= 8 && k < 126;
        fast_sb[e] = fast[e] ? e4m3_of(pow2f(kmm)) : 0;
        lossless_of[e] = (k >= shared - 17) | (e == 0);
    }
    int64_t lossless = 0;
    cast_rules rules;
    memset(rules.have, 0, sizeof rules.have);
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *sc = scale + r * kb;
        const uint8_t *src = packed + r * 16 * kb;
        uint8_t *dst = out + r * 16 * kb, *sbo = sb_out + r * 2 * kb;
        int all_fast = 1;
        for (int64_t i = 0; i < kb; i++) {
            all_fast &= fast[sc[i]];
            lossless += lossless_of[sc[i]];
            sbo[2 * i] = sbo[2 * i + 1] = fast_sb[sc[i]];
        }
        if (all_fast) { /* through a buffer in L1, 256 bytes at a time, so that the stores can stream */
            uint64_t buf[32];
            for (int64_t c0 = 0; c0 < 16 * kb; c0 += 256) {
                const int64_t nb = 16 * kb - c0 < 256 ? 16 * kb - c0 : 256;
                memcpy(buf, src + c0, (size_t)nb);
                for (int64_t j = 0; j < nb / 8; j++) buf[j] = clear_negative_zeros(buf[j]);
                kc_store(dst + c0, (const uint8_t *)buf, nb, stream);
            }
            continue;
        }
        for (int64_t i = 0; i < kb; i++) {
            if (fast[sc[i]]) {
                uint64_t w[2];
                memcpy(w, src + 16 * i, 16);
                w[0] = clear_negative_zeros(w[0]);
                w[1] = clear_negative_zeros(w[1]);
                memcpy(dst + 16 * i, w, 16);
            } else {
                sbo[2 * i] = sbo[2 * i + 1] = cast_block(&rules, src + 16 * i, sc[i], own, m, s2, dst + 16 * i);
            }
        }
    }
    kc_stream_fence(stream);
    return lossless;
}

/* torch's bf16 rounding of a finite fp32 (c10 round_to_nearest_even), as the fp32 bits of the bf16. */
static inline uint32_t bf16_round(uint32_t b) { return (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u; }

/* e4m3_of of a finite fp32 f rounded to bf16 (torch's double rounding), branch-free (masks, not branches) so
 * that the loops over a row vectorize. */
static inline uint8_t e4m3_of_bf16(float f) {
    uint32_t b = bits_of_f32(f);
    uint32_t t = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u; /* bf16_round */
    uint32_t a = t & 0x7FFFFFFFu;
    uint32_t normal = (a + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
    normal = normal < 0x7Eu ? normal : 0x7Eu; /* from 464 up (finite): saturating, as torch 2.13 */
    uint32_t sub = bits_of_f32(f32_of_bits(a) + 16384.0f) - (141u << 23); /* below 2^-6: to the grid 2^-9 */
    uint32_t below = -(uint32_t)(a < (121u << 23));
    return (uint8_t)((sub & below) | (normal & ~below) | ((t >> 24) & 0x80u));
}

/* e4m3 byte (in 32 bits) of torch's e4m3(bf16(q)) from qs = 2^8 q, |q| <= 450 (no saturation): bf16 rounding
 * by adding half an ulp to the bits (no tie can occur, see fp8_segment), e4m3 rounding by Veltkamp's split to 4
 * significant bits (ties to even: checked on every bf16 value), e4m3's exponent field read off the bits (the 2^8
 * scaling adds 128 + e4m3's bias to fp32's), below 2^-6 (4 scaled) the grid 2^-9 (1/2 scaled) by adding 2^22. */
static inline uint32_t e4m3_scaled(float qs) {
    uint32_t t = bits_of_f32(qs) + 0x8000u;
    float y = f32_of_bits(t & 0x7FFF0000u);
    float g = y * 1048577.0f;
    float hi = g + (y - g);
    uint32_t normal = bits_of_f32(hi) >> 20;
    uint32_t sub = bits_of_f32(y + 4194304.0f);
    uint32_t below = -(uint32_t)(y < 4.0f);
    return (((sub & below) | (normal & ~below)) & 0x7Fu) | ((t >> 24) & 0x80u);
}

/* e4m3 bytes of one row segment (at most 128 values): torch's e4m3(bf16(x / s)). Where s >= 2^-100 the quotient is
 * x * (2^8 / s) (then 2^8 / s is a normal number), whose bf16 rounding is the exact quotient's: the exact quotient
 * of two bf16 values is never within 2^-17 of a bf16 rounding boundary unless it is on the grid, and the product
 * is within 2^-23 of it; a tile's quotients stay below 450 (its scale is its amax / 448 rounded to bf16, normal).
 * Below, a true division and torch's saturating rounding (a subnormal scale lets quotients pass 448).
 * Codes go through 32-bit lanes, then are narrowed to bytes in a loop of their own (vectorizes twice as fast).
 * Always inlined: as a call it ran its default (SSE2) build from the AVX2 clone of the caller (seen with perf). */
static inline __attribute__((always_inline)) void fp8_segment(const uint16_t *restrict x, int64_t n, float s,
                                                              uint8_t *restrict q, int stream) {
    if (s < 7.888609052210118e-31f) {
        for (int64_t j = 0; j < n; j++) q[j] = e4m3_of_bf16(f32_of_bits((uint32_t)x[j] << 16) / s);
        return;
    }
    const float r = 256.0f * (1.0f / s);
    uint32_t lanes[128];
    uint8_t bytes[128];
    for (int64_t j = 0; j < n; j++) lanes[j] = e4m3_scaled(f32_of_bits((uint32_t)x[j] << 16) * r);
    for (int64_t j = 0; j < n; j++) bytes[j] = (uint8_t)lanes[j];
    kc_store(q, bytes, n, stream);
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* e4m3_scaled of 8 lanes (the same IEEE operations, in the same order) from 8 bf16 values and r = 2^8 / s. */
__attribute__((target("avx2"))) static inline __m256i e4m3_scaled8(__m128i bf16, __m256 r) {
    __m256 qs = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16), 16)), r);
    __m256i t = _mm256_add_epi32(_mm256_castps_si256(qs), _mm256_set1_epi32(0x8000));
    __m256 y = _mm256_castsi256_ps(_mm256_and_si256(t, _mm256_set1_epi32(0x7FFF0000)));
    __m256 g = _mm256_mul_ps(y, _mm256_set1_ps(1048577.0f));
    __m256 hi = _mm256_add_ps(g, _mm256_sub_ps(y, g));
    __m256i normal = _mm256_srli_epi32(_mm256_castps_si256(hi), 20);
    __m256i sub = _mm256_castps_si256(_mm256_add_ps(y, _mm256_set1_ps(4194304.0f)));
    __m256 below = _mm256_cmp_ps(y, _mm256_set1_ps(4.0f), _CMP_LT_OQ);
    __m256i mag = _mm256_and_si256(_mm256_blendv_epi8(normal, sub, _mm256_castps_si256(below)),
                                   _mm256_set1_epi32(0x7F));
    return _mm256_or_si256(mag, _mm256_and_si256(_mm256_srli_epi32(t, 24), _mm256_set1_epi32(0x80)));
}

/* fp8_segment of a whole 128-value tile row with s >= 2^-100, in AVX2 intrinsics: 32 codes a step narrowed to
 * bytes in registers and stored at once (GCC's version goes through two buffers on the stack). */
__attribute__((target("avx2"))) static void fp8_row128_avx2(const uint16_t *restrict x, float s,
                                                             uint8_t *restrict q, int stream) {
    const __m256 r = _mm256_set1_ps(256.0f * (1.0f / s));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const int aligned = stream && !((uintptr_t)q & 31);
    for (int j = 0; j < 128; j += 32) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(x + j)), b = _mm256_loadu_si256((const __m256i *)(x + j + 16));
        __m256i c0 = e4m3_scaled8(_mm256_castsi256_si128(a), r), c1 = e4m3_scaled8(_mm256_extracti128_si256(a, 1), r);
        __m256i c2 = e4m3_scaled8(_mm256_castsi256_si128(b), r), c3 = e4m3_scaled8(_mm256_extracti128_si256(b, 1), r);
        __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
        w = _mm256_permutevar8x32_epi32(w, order);
        if (aligned)
            _mm256_stream_si256((__m256i *)(q + j), w);
        else
            _mm256_storeu_si256((__m256i *)(q + j), w);
    }
}
#define KC_HAVE_FP8_AVX2 1
#endif

/* 128x128 block FP8 of bf16 x [n, k], tiles [t0, t1) of the 128-row band `band`: e4m3 bytes q [n, k] and fp32
 * scales [ceil(n/128), ceil(k/128)] (the tile's amax / 448 rounded to bf16, as fp8_block.quantize). Returns 1 if
 * one of these tiles holds a NaN or an Inf (its output is then not torch's: the caller uses torch), else 0.
 * Row by row (streaming): the amax of each tile, then its codes (the tiles are then in cache). */
CLONES int32_t kc_fp8_tiles(const uint16_t *x, int64_t n, int64_t k, int64_t band, int64_t t0, int64_t t1,
                                   uint8_t *q, float *scales, int stream) {
    const int64_t tk = (k + 127) / 128;
    uint16_t amax[t1 - t0 > 0 ? t1 - t0 : 1];
    int32_t bad = 0;
    const int64_t r0 = band * 128, r1 = r0 + 128 < n ? r0 + 128 : n;
    float *sc = scales + band * tk;
#ifdef KC_HAVE_FP8_AVX2
    const int avx2 = __builtin_cpu_supports("avx2");
#endif
    memset(amax, 0, sizeof(uint16_t) * (size_t)(t1 - t0));
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t t = t0; t < t1; t++) {
            const int64_t c0 = t * 128, w = (t + 1) * 128 < k ? 128 : k - c0;
            const uint16_t *seg = x + r * k + c0;
            uint16_t m = amax[t - t0];
            for (int64_t c = 0; c < w; c++) {
                uint16_t a = seg[c] & 0x7FFF; /* |x| orders like its bits, NaN above inf */
                m = a > m ? a : m;
            }
            amax[t - t0] = m;
        }
    }
    for (int64_t t = t0; t < t1; t++) {
        if (amax[t - t0] >= 0x7F80) {
            bad = 1;
            sc[t] = 0.0f;
        } else { /* bf16 amax / 448 in fp32, rounded to bf16: exactly torch's bf16 division by a scalar */
            sc[t] = f32_of_bits(bf16_round(bits_of_f32(f32_of_bits((uint32_t)amax[t - t0] << 16) / 448.0f)));
        }
    }
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t t = t0; t < t1; t++) {
            const int64_t c0 = t * 128, w = (t + 1) * 128 < k ? 128 : k - c0;
            if (sc[t] == 0.0f) /* an all-zero tile: codes 0, as the torch code */
                memset(q + r * k + c0, 0, (size_t)w);
#ifdef KC_HAVE_FP8_AVX2
            else if (avx2 && w == 128 && sc[t] >= 7.888609052210118e-31f)
                fp8_row128_avx2(x + r * k + c0, sc[t], q + r * k + c0, stream);
#endif
            else
                fp8_segment(x + r * k + c0, w, sc[t], q + r * k + c0, stream);
        }
    }
    kc_stream_fence(stream);
    return bad;
}

/* --- one ctypes call a kernel: the work split into tasks of kc_pool.c ---------------------------------- */

typedef struct {
    const uint8_t *packed, *scale;
    int64_t rows, kb, ntasks;
    int32_t own, shared, stream;
    uint8_t *out, *sb_out;
    int64_t lossless;
} kc_cast_job;

static void kc_cast_task(void *ctx, int64_t t) {
    kc_cast_job *j = ctx;
    int64_t a, b;
    kc_range(j->rows, j->ntasks, t, &a, &b);
    int64_t n = kc_cast_mxfp4(j->packed + a * 16 * j->kb, j->scale + a * j->kb, b - a, j->kb, j->own, j->shared,
                              j->out + a * 16 * j->kb, j->sb_out + a * 2 * j->kb, j->stream);
    __atomic_fetch_add(&j->lossless, n, __ATOMIC_RELAXED);
}

/* kc_cast_mxfp4 of all `rows` on `threads` threads (the lossless count is a sum of integers: any split);
 * `stream`: codes stored non-temporally (large outputs). */
int64_t kc_cast_mxfp4_mt(const uint8_t *packed, const uint8_t *scale, int64_t rows, int64_t kb, int32_t own,
                         int32_t shared, uint8_t *out, uint8_t *sb_out, int32_t threads, int32_t stream) {
    kc_cast_job j = {packed, scale, rows, kb, kc_tasks(rows, 32 * kb, threads, KC_MIN_SPLIT), own, shared, stream,
                     out, sb_out, 0};
    kc_parallel(kc_cast_task, &j, j.ntasks, threads);
    return j.lossless;
}

typedef struct {
    const uint16_t *x;
    int64_t n, k, groups;
    uint8_t *q;
    float *scales;
    int32_t bad, stream;
} kc_fp8_job;

static void kc_fp8_task(void *ctx, int64_t t) {
    kc_fp8_job *j = ctx;
    const int64_t tk = (j->k + 127) / 128, band = t / j->groups, g = t % j->groups;
    int64_t t0, t1;
    kc_range(tk, j->groups, g, &t0, &t1);
    if (kc_fp8_tiles(j->x, j->n, j->k, band, t0, t1, j->q, j->scales, j->stream))
        __atomic_store_n(&j->bad, 1, __ATOMIC_RELAXED);
}

/* 128x128 block FP8 of bf16 x [n, k] (kc_fp8_tiles) on `threads` threads; a task is one band's group of tiles, the
 * band cut in `groups` so that there are about 8 tasks a thread (56 bands on 16 threads would leave 8 threads
 * a band short), each a run of at least 4 tiles (1 KB of a row). Returns 1 if a tile holds NaN or Inf.
 * `stream`: codes stored non-temporally (large outputs). */
int32_t kc_fp8_block_bf16_mt(const uint16_t *x, int64_t n, int64_t k, uint8_t *q, float *scales, int32_t threads,
                             int32_t stream) {
    const int64_t bands = (n + 127) / 128, tk = (k + 127) / 128;
    if (!bands || !tk) return 0;
    if (threads <= 1 || n * k < KC_MIN_SPLIT) {
        int32_t bad = 0;
        for (int64_t band = 0; band < bands; band++) bad |= kc_fp8_tiles(x, n, k, band, 0, tk, q, scales, stream);
        return bad;
    }
    int64_t groups = (8 * (int64_t)threads + bands - 1) / bands, most = tk / 4 > 1 ? tk / 4 : 1;
    kc_fp8_job j = {x, n, k, groups < most ? groups : most, q, scales, 0, stream};
    kc_parallel(kc_fp8_task, &j, bands * j.groups, threads);
    return j.bad;
}

/* compressed-tensors' symmetric INT4 `pack-quantized` weight decoded to fp32: `packed` [rows, 4 * words] bytes (the
 * int32 words' little-endian bytes: byte b holds element 2b in its low nibble, 2b + 1 in its high one), `scale`
 * [rows, groups] fp32, `per` = elements a group (a multiple of 2). Each value is (code - 8) * scale, one fp32
 * multiply as the torch code (kernels/src/encodings.py decode_int4) does. Returns 1 if a value overflows fp32. */
CLONES static int32_t kc_int4_rows(const uint8_t *restrict packed, const float *restrict scale, int64_t rows,
                                   int64_t words, int64_t groups, float *restrict out) {
    const int64_t k = 8 * words, half = k / groups / 2;
    float most = 0.0f;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *p = packed + r * 4 * words;
        const float *s = scale + r * groups;
        float *o = out + r * k;
        for (int64_t g = 0; g < groups; g++) {
            const float sc = s[g];
            const uint8_t *pg = p + g * half;
            float *og = o + 2 * g * half;
            for (int64_t b = 0; b < half; b++) {
                const float lo = (float)((int32_t)(pg[b] & 15u) - 8) * sc;
                const float hi = (float)((int32_t)(pg[b] >> 4) - 8) * sc;
                og[2 * b] = lo;
                og[2 * b + 1] = hi;
                most = fmaxf(most, fmaxf(fabsf(lo), fabsf(hi)));
            }
        }
    }
    return isinf(most) ? 1 : 0;
}

typedef struct {
    const uint8_t *packed;
    const float *scale;
    int64_t rows, words, groups, ntasks;
    float *out;
    int32_t bad;
} kc_int4_job;

static void kc_int4_task(void *ctx, int64_t t) {
    kc_int4_job *j = ctx;
    int64_t a, b;
    kc_range(j->rows, j->ntasks, t, &a, &b);
    if (kc_int4_rows(j->packed + a * 4 * j->words, j->scale + a * j->groups, b - a, j->words, j->groups,
                     j->out + a * 8 * j->words))
        __atomic_store_n(&j->bad, 1, __ATOMIC_RELAXED);
}

/* kc_int4_rows of all `rows` on `threads` threads (rows independent: any split gives the same values). */
int32_t kc_int4_decode_mt(const uint8_t *packed, const float *scale, int64_t rows, int64_t words, int64_t groups,
                          float *out, int32_t threads) {
    kc_int4_job j = {packed, scale, rows, words, groups, kc_tasks(rows, 8 * words, threads, KC_MIN_SPLIT), out, 0};
    kc_parallel(kc_int4_task, &j, j.ntasks, threads);
    return j.bad;
}
