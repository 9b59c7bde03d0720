#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TW_AVX2 1 /* [Note: int8 kernels in AVX2] */
#endif

#define BLOCK 256

/* [Note: int8 code slots]
   The code of a scaled value q (q = x / max|x|: |q| <= 1, or a quiet NaN) is base + (q >=
   thresholds[base]), base the count of thresholds at the lower end of q's bucket (its top 16 bits:
   [Note: int8 code lookup]). Where that threshold lies inside the bucket, it shares q's top 16
   bits, so the comparison is one of the low 16 bits (reversed for negative values); where it lies
   above, the code is base for the whole bucket. So each bucket needs one 32-bit entry, (base <<
   16) + (0x10000 - the low bits t to compare with) (or base << 16 without a threshold inside), and
   the code is bits 16..23 of entry + key: the sum carries into bit 16 exactly when key >= t (key <
   0x10000 never carries from an entry without one). One table load per value and an addition. All
   buckets below 2^-23 share one entry, as do all above 1.0's and all NaN and infinite ones, so the
   magnitude's bits are clamped to [SLOT_LEAST, SLOT_MOST], NaN and infinity take the next slot,
   and the sign adds SLOT_SIGN: 5894 slots (23 KiB per map; the 65536 bytes per map of the table
   before did not fit the L1 cache with their thresholds). ``lowbit_kernel.code_slots`` builds them
   from the 65536-entry table and checks every bucket's entry. */
#define SLOT_LEAST 0x34000000u /* 2^-23: exponent 104, mantissa 0 */
#define SLOT_MOST 0x3f810000u  /* above 1.0's bucket: every threshold is below */
#define SLOT_FIRST 0x3400u     /* SLOT_LEAST >> 16 */
#define SLOT_SIGN 2947u        /* slots per sign: (SLOT_MOST >> 16) - SLOT_FIRST + 2 */

static inline uint32_t code_slot(uint32_t bits) {
    uint32_t a = bits & 0x7fffffffu;
    uint32_t nan = a >= 0x7f800000u; /* or infinity */
    a = a < SLOT_LEAST ? SLOT_LEAST : (a > SLOT_MOST ? SLOT_MOST : a);
    return ((a >> 16) - SLOT_FIRST) + nan + ((0u - (bits >> 31)) & SLOT_SIGN);
}

/* the largest of |x[0..n)|'s bits: non-negative floats order as their bits do, NaN above inf */
static inline uint32_t largest_bits(const float *x, int64_t n, uint32_t largest) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t a;
        memcpy(&a, x + i, 4);
        a &= 0x7fffffffu;
        largest = a > largest ? a : largest;
    }
    return largest;
}

/* a block's scale from its largest magnitude's bits (NaN when any value is NaN), at least 1e-12 */
static inline float block_scale(uint32_t largest) {
    float scale;
    memcpy(&scale, &largest, 4);
    if (largest <= 0x7f800000u && scale < 1e-12f) scale = 1e-12f;
    return scale;
}

/* [Note: int8 kernels in AVX2]
   Where the compiler targets AVX2 with FMA (``-march=native`` on such a machine; the build is
   cached per machine), the block loops are written with intrinsics; elsewhere the plain C loops
   below run (the same operations, vectorised or not by the compiler). The table lookups stay
   scalar loads (AVX2 gathers measured slower on AMD Zen 3), but each is one instruction that loads
   into a lane of a vector register (vinsertps/vpinsrd with a memory operand, written in inline
   assembly: GCC splits the intrinsics into a load and an insert, 7% slower here), the indices read
   two codes or two slots at a time into a general register, instead of a store and a reload per
   value. The update is the same IEEE operations as the plain loop, lane by lane
   (``_mm256_sqrt_ps`` and ``_mm256_div_ps`` round correctly, ``_mm256_fmadd_ps`` where ``fmaf``
   is), so the bits are the same; ``tw_adam_fp32`` runs this vector code too, so ``one_pass_width``
   checks it against torch's kernel. A block that one tensor covers with no element of its scalar
   remainder (all but a tensor's ends) is decoded, updated and its largest magnitudes found in one
   loop, then encoded in another (the scale needs the whole block first): ``fused_block``. */
#ifdef TW_AVX2

/* one load inserted into lane `lane` of v: a single instruction with a memory operand (GCC
   emits a separate load and a register insert for the intrinsics) */
#define LOAD_INTO_PS(v, address, lane) \
    __asm__("vinsertps %2, %1, %0, %0" : "+x"(v) : "m"(*(address)), "i"((lane) << 4))
#define LOAD_INTO_EPI32(v, address, lane) \
    __asm__("vpinsrd %2, %1, %0, %0" : "+x"(v) : "m"(*(address)), "i"(lane))

/* the map's values of codes[0..8): two codes per 16-bit read, each split by a byte move */
static inline __m256 lookup8(const float *table, const uint8_t *codes) {
    uint16_t c[4];
    memcpy(c, codes, 8);
    __m128 lo = _mm_load_ss(table + (c[0] & 0xff)), hi = _mm_load_ss(table + (c[2] & 0xff));
    LOAD_INTO_PS(lo, table + (c[0] >> 8), 1);
    LOAD_INTO_PS(hi, table + (c[2] >> 8), 1);
    LOAD_INTO_PS(lo, table + (c[1] & 0xff), 2);
    LOAD_INTO_PS(hi, table + (c[3] & 0xff), 2);
    LOAD_INTO_PS(lo, table + (c[1] >> 8), 3);
    LOAD_INTO_PS(hi, table + (c[3] >> 8), 3);
    return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

/* the code slots' entries of eight slot numbers */
static inline __m256i entries8(const uint32_t *slots, const uint32_t *slot) {
    uint64_t a, b, c, d;
    memcpy(&a, slot, 8);
    memcpy(&b, slot + 2, 8);
    memcpy(&c, slot + 4, 8);
    memcpy(&d, slot + 6, 8);
    __m128i lo = _mm_cvtsi32_si128((int)slots[(uint32_t)a]);
    __m128i hi = _mm_cvtsi32_si128((int)slots[(uint32_t)c]);
    LOAD_INTO_EPI32(lo, slots + (a >> 32), 1);
    LOAD_INTO_EPI32(hi, slots + (c >> 32), 1);
    LOAD_INTO_EPI32(lo, slots + (uint32_t)b, 2);
    LOAD_INTO_EPI32(hi, slots + (uint32_t)d, 2);
    LOAD_INTO_EPI32(lo, slots + (b >> 32), 3);
    LOAD_INTO_EPI32(hi, slots + (d >> 32), 3);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

static inline uint32_t largest_lane(__m256i x) {
    __m128i a = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    a = _mm_max_epu32(a, _mm_shuffle_epi32(a, 0x4e));
    a = _mm_max_epu32(a, _mm_shuffle_epi32(a, 0xb1));
    return (uint32_t)_mm_cvtsi128_si32(a);
}

static inline __m256i magnitude_bits(__m256 x) {
    return _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff));
}

/* code_slot of eight scaled values into slot[0..8), and their compare keys */
static inline __m256i slots_and_keys(__m256 q, uint32_t *slot) {
    const __m256i least = _mm256_set1_epi32(SLOT_LEAST), most = _mm256_set1_epi32(SLOT_MOST);
    __m256i bits = _mm256_castps_si256(q), neg = _mm256_srai_epi32(bits, 31);
    __m256i a = magnitude_bits(q);
    __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f7fffff)); /* -1: NaN or inf */
    a = _mm256_min_epi32(_mm256_max_epi32(a, least), most);
    __m256i s = _mm256_sub_epi32(_mm256_srli_epi32(a, 16), _mm256_set1_epi32(SLOT_FIRST));
    __m256i sign = _mm256_and_si256(neg, _mm256_set1_epi32(SLOT_SIGN));
    s = _mm256_add_epi32(_mm256_sub_epi32(s, nan), sign);
    _mm256_store_si256((__m256i *)slot, s);
    return _mm256_and_si256(_mm256_xor_si256(bits, neg), _mm256_set1_epi32(0xffff));
}

/* slots_and_keys where the block's scale is finite, so |q| <= 1 and no q is NaN or infinite:
   only the lower clamp is left */
static inline __m256i finite_slots_and_keys(__m256 q, uint32_t *slot) {
    __m256i bits = _mm256_castps_si256(q), neg = _mm256_srai_epi32(bits, 31);
    __m256i a = _mm256_max_epi32(magnitude_bits(q), _mm256_set1_epi32(SLOT_LEAST));
    __m256i s = _mm256_sub_epi32(_mm256_srli_epi32(a, 16), _mm256_set1_epi32(SLOT_FIRST));
    s = _mm256_add_epi32(s, _mm256_and_si256(neg, _mm256_set1_epi32(SLOT_SIGN)));
    _mm256_store_si256((__m256i *)slot, s);
    return _mm256_and_si256(_mm256_xor_si256(bits, neg), _mm256_set1_epi32(0xffff));
}

/* 32 codes: byte 2 of each entry + key, in order */
static inline void store_codes32(uint8_t *c, const uint32_t *slot, const __m256i *key,
                                 const uint32_t *slots) {
    const __m256i pick[4] = {
        _mm256_setr_epi8(2, 6, 10, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                         2, 6, 10, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
        _mm256_setr_epi8(-1, -1, -1, -1, 2, 6, 10, 14, -1, -1, -1, -1, -1, -1, -1, -1,
                         -1, -1, -1, -1, 2, 6, 10, 14, -1, -1, -1, -1, -1, -1, -1, -1),
        _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 2, 6, 10, 14, -1, -1, -1, -1,
                         -1, -1, -1, -1, -1, -1, -1, -1, 2, 6, 10, 14, -1, -1, -1, -1),
        _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 2, 6, 10, 14,
                         -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 2, 6, 10, 14)};
    __m256i packed = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
        __m256i sum = _mm256_add_epi32(entries8(slots, slot + 8 * k), key[k]);
        packed = _mm256_or_si256(packed, _mm256_shuffle_epi8(sum, pick[k]));
    }
    /* lane 0 holds elements 0..3 of each group of eight, lane 1 elements 4..7 */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i *)c, _mm256_permutevar8x32_epi32(packed, order));
}

static void encode_scaled(const float *x, uint8_t *c, float scale, const uint32_t *slots) {
    uint32_t slot[BLOCK] __attribute__((aligned(32)));
    __m256i key[BLOCK / 8];
    const __m256 s = _mm256_set1_ps(scale);
    for (int i = 0; i < BLOCK; i += 8)
        key[i / 8] = slots_and_keys(_mm256_div_ps(_mm256_loadu_ps(x + i), s), slot + i);
    for (int i = 0; i < BLOCK; i += 32) store_codes32(c + i, slot + i, key + i / 8, slots);
}

static void decode_block(const uint8_t *c, float scale, const float *qmap, float *out) {
    const __m256 s = _mm256_set1_ps(scale);
    for (int i = 0; i < BLOCK; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(lookup8(qmap, c + i), s));
}

#else

static void encode_scaled(const float *x, uint8_t *c, float scale, const uint32_t *slots) {
    uint32_t bits[BLOCK], slot[BLOCK], entry[BLOCK];
    for (int i = 0; i < BLOCK; i++) {
        float q = x[i] / scale;
        memcpy(bits + i, &q, 4);
        slot[i] = code_slot(bits[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < BLOCK; i++) entry[i] = slots[slot[i]];
    for (int i = 0; i < BLOCK; i++) {
        uint32_t key = (bits[i] & 0xffffu) ^ ((0u - (bits[i] >> 31)) & 0xffffu);
        c[i] = (uint8_t)((entry[i] + key) >> 16);
    }
}

static void decode_block(const uint8_t *c, float scale, const float *qmap, float *out) {
#pragma GCC unroll 8
    for (int i = 0; i < BLOCK; i++) out[i] = qmap[c[i]] * scale;
}

#endif

static void encode_block(const float *x, uint8_t *c, float *scale_out, const uint32_t *slots) {
    const float scale = block_scale(largest_bits(x, BLOCK, 0));
    *scale_out = scale;
    encode_scaled(x, c, scale, slots);
}

void tw_quantize(const float *values, uint8_t *codes, float *scales, int64_t nblocks,
                 const uint32_t *slots) {
    for (int64_t b = 0; b < nblocks; b++)
        encode_block(values + b * BLOCK, codes + b * BLOCK, scales + b, slots);
}

void tw_dequantize(const uint8_t *codes, const float *scales, float *out, int64_t nblocks,
                   const float *qmap) {
    for (int64_t b = 0; b < nblocks; b++)
        decode_block(codes + b * BLOCK, scales[b], qmap, out + b * BLOCK);
}

/* torch's fused Adam(W) CPU kernel on fp32, operation for operation:
   [Note: int8 Adam in one pass] */

/* [Note: torch's remainder]
   torch runs the last numel % width elements of each tensor through a scalar loop compiled in
   the same translation unit as its vector loop, and the compiler contracts that loop's
   exp_avg_sq differently per build: in the AVX2 build fma(v, beta2, (1 - beta2) * g * g), in
   the AVX512 build as the vector lanes do, fma((1 - beta2) * g, g, v * beta2) (seen on an Ice
   Lake Xeon: with the AVX2 rule 1-2 elements of 15 differed and the one pass was never used
   there). hyper[6] says which: 1 the AVX2 rule, 0 the lanes' (``lowbit_kernel.hyper_values``,
   by torch's CPU capability); ``one_pass_width`` still checks the result bit for bit. */
typedef struct {
    float decay, l2, coeff, beta2, sq_coeff, bc2_sqrt, eps, neg_step;
    int keep_m, mode; /* mode: 0 no weight decay, 1 decoupled (AdamW), 2 L2 (Adam) */
    int remainder;    /* adam_loop's `tail` for torch's scalar remainder: [Note: torch's remainder] */
} Coeffs;

static void adam_coeffs(Coeffs *k, const double *hyper, double step) {
    double lr = hyper[0], beta1 = hyper[1], beta2 = hyper[2], eps = hyper[3], wd = hyper[4];
    double bc1 = 1 - pow(beta1, step), bc2 = 1 - pow(beta2, step);
    float weight = (float)(1 - beta1);
    k->keep_m = fabsf(weight) < 0.5f;
    k->coeff = k->keep_m ? weight : weight - 1.0f;
    k->beta2 = (float)beta2;
    k->sq_coeff = (float)(1 - beta2);
    k->bc2_sqrt = (float)sqrt(bc2);
    k->eps = (float)eps;
    k->neg_step = (float)(-(lr / bc1));
    k->decay = (float)(1 - lr * wd);
    k->l2 = (float)wd;
    k->mode = wd != 0 ? (hyper[5] != 0 ? 1 : 2) : 0;
    k->remainder = hyper[6] != 0;
}

static inline void adam_loop(float *restrict p, const float *restrict g, float *restrict m,
                             float *restrict v, int64_t n, const Coeffs *k, const int mode,
                             const int tail, uint32_t *largest) {
    const float decay = k->decay, l2 = k->l2, coeff = k->coeff, beta2 = k->beta2;
    const float sq_coeff = k->sq_coeff, bc2_sqrt = k->bc2_sqrt, eps = k->eps;
    const float neg_step = k->neg_step;
    const int keep_m = k->keep_m;
    uint32_t m_largest = largest[0], v_largest = largest[1];
    for (int64_t i = 0; i < n; i++) {
        float param = p[i], grad = g[i];
        if (mode == 1) param = param * decay;
        if (mode == 2) grad = fmaf(param, l2, grad);
        float avg = m[i];
        avg = fmaf(coeff, grad - avg, keep_m ? avg : grad);
        float fresh = sq_coeff * grad;
        float avg_sq;
        if (tail) { /* torch's AVX2 scalar remainder loop fuses the other product */
            fresh = fresh * grad;
            avg_sq = fmaf(v[i], beta2, fresh);
        } else {
            float kept = v[i] * beta2;
            avg_sq = fmaf(fresh, grad, kept);
        }
        float denom = sqrtf(avg_sq) / bc2_sqrt;
        denom = denom + eps;
        float delta = neg_step * avg;
        delta = delta / denom;
        p[i] = param + delta;
        m[i] = avg;
        v[i] = avg_sq;
        uint32_t m_bits, v_bits; /* the encode's block scan, while the values are in registers */
        memcpy(&m_bits, &avg, 4);
        memcpy(&v_bits, &avg_sq, 4);
        m_bits &= 0x7fffffffu;
        v_bits &= 0x7fffffffu;
        m_largest = m_bits > m_largest ? m_bits : m_largest;
        v_largest = v_bits > v_largest ? v_bits : v_largest;
    }
    largest[0] = m_largest;
    largest[1] = v_largest;
}

static void adam_elements(float *p, const float *g, float *m, float *v, int64_t n,
                          const Coeffs *k, const int tail, uint32_t *largest) {
    if (tail) {
        if (k->mode == 1) adam_loop(p, g, m, v, n, k, 1, 1, largest);
        else if (k->mode == 2) adam_loop(p, g, m, v, n, k, 2, 1, largest);
        else adam_loop(p, g, m, v, n, k, 0, 1, largest);
    } else {
        if (k->mode == 1) adam_loop(p, g, m, v, n, k, 1, 0, largest);
        else if (k->mode == 2) adam_loop(p, g, m, v, n, k, 2, 0, largest);
        else adam_loop(p, g, m, v, n, k, 0, 0, largest);
    }
}

#ifdef TW_AVX2
/* adam_loop's vector case (tail 0) on eight lanes: the same operations in the same order */
static inline __attribute__((always_inline)) void adam8(float *p, const float *g, __m256 *m,
                                                        __m256 *v, const Coeffs *k,
                                                        const int mode) {
    __m256 param = _mm256_loadu_ps(p), grad = _mm256_loadu_ps(g), avg = *m;
    if (mode == 1) param = _mm256_mul_ps(param, _mm256_set1_ps(k->decay));
    if (mode == 2) grad = _mm256_fmadd_ps(param, _mm256_set1_ps(k->l2), grad);
    __m256 keep = _mm256_castsi256_ps(_mm256_set1_epi32(k->keep_m ? -1 : 0));
    avg = _mm256_fmadd_ps(_mm256_set1_ps(k->coeff), _mm256_sub_ps(grad, avg),
                          _mm256_blendv_ps(grad, avg, keep));
    __m256 fresh = _mm256_mul_ps(_mm256_set1_ps(k->sq_coeff), grad);
    __m256 avg_sq = _mm256_fmadd_ps(fresh, grad, _mm256_mul_ps(*v, _mm256_set1_ps(k->beta2)));
    __m256 denom = _mm256_div_ps(_mm256_sqrt_ps(avg_sq), _mm256_set1_ps(k->bc2_sqrt));
    denom = _mm256_add_ps(denom, _mm256_set1_ps(k->eps));
    __m256 delta = _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(k->neg_step), avg), denom);
    _mm256_storeu_ps(p, _mm256_add_ps(param, delta));
    *m = avg;
    *v = avg_sq;
}

static inline __attribute__((always_inline)) void adam8_arrays(float *p, const float *g, float *m,
                                                               float *v, int64_t n,
                                                               const Coeffs *k, const int mode) {
    for (int64_t i = 0; i < n; i += 8) {
        __m256 avg = _mm256_loadu_ps(m + i), avg_sq = _mm256_loadu_ps(v + i);
        adam8(p + i, g + i, &avg, &avg_sq, k, mode);
        _mm256_storeu_ps(m + i, avg);
        _mm256_storeu_ps(v + i, avg_sq);
    }
}

/* A whole block of one tensor, none of it in the tensor's scalar remainder: [Note: int8 kernels
   in AVX2]. */
static inline __attribute__((always_inline)) void fused_block(
    float *restrict p, const float *restrict g, uint8_t *m_codes, uint8_t *v_codes,
    float *m_scale, float *v_scale, const Coeffs *k, const int mode, const float *m_qmap,
    const uint32_t *m_slots, const float *v_qmap, const uint32_t *v_slots) {
    float m[BLOCK] __attribute__((aligned(32))), v[BLOCK] __attribute__((aligned(32)));
    const __m256 m_in = _mm256_set1_ps(*m_scale), v_in = _mm256_set1_ps(*v_scale);
    __m256i m_largest = _mm256_setzero_si256(), v_largest = _mm256_setzero_si256();
    for (int i = 0; i < BLOCK; i += 8) {
        __m256 avg = _mm256_mul_ps(lookup8(m_qmap, m_codes + i), m_in);
        __m256 avg_sq = _mm256_mul_ps(lookup8(v_qmap, v_codes + i), v_in);
        adam8(p + i, g + i, &avg, &avg_sq, k, mode);
        _mm256_store_ps(m + i, avg);
        _mm256_store_ps(v + i, avg_sq);
        m_largest = _mm256_max_epu32(m_largest, magnitude_bits(avg));
        v_largest = _mm256_max_epu32(v_largest, magnitude_bits(avg_sq));
    }
    *m_scale = block_scale(largest_lane(m_largest));
    *v_scale = block_scale(largest_lane(v_largest));
    const __m256 m_out = _mm256_set1_ps(*m_scale), v_out = _mm256_set1_ps(*v_scale);
    uint32_t m_slot[BLOCK] __attribute__((aligned(32))), v_slot[BLOCK] __attribute__((aligned(32)));
    __m256i m_key[BLOCK / 8], v_key[BLOCK / 8];
    if (isfinite(*m_scale) && isfinite(*v_scale)) {
        for (int i = 0; i < BLOCK; i += 8) {
            __m256 mq = _mm256_div_ps(_mm256_load_ps(m + i), m_out);
            __m256 vq = _mm256_div_ps(_mm256_load_ps(v + i), v_out);
            m_key[i / 8] = finite_slots_and_keys(mq, m_slot + i);
            v_key[i / 8] = finite_slots_and_keys(vq, v_slot + i);
        }
    } else {
        for (int i = 0; i < BLOCK; i += 8) {
            __m256 mq = _mm256_div_ps(_mm256_load_ps(m + i), m_out);
            __m256 vq = _mm256_div_ps(_mm256_load_ps(v + i), v_out);
            m_key[i / 8] = slots_and_keys(mq, m_slot + i);
            v_key[i / 8] = slots_and_keys(vq, v_slot + i);
        }
    }
    for (int i = 0; i < BLOCK; i += 32) {
        store_codes32(m_codes + i, m_slot + i, m_key + i / 8, m_slots);
        store_codes32(v_codes + i, v_slot + i, v_key + i / 8, v_slots);
    }
}

static void fused_block_any(float *p, const float *g, uint8_t *m_codes, uint8_t *v_codes,
                            float *m_scale, float *v_scale, const Coeffs *k,
                            const float *const *tables) {
    const float *m_qmap = tables[0], *v_qmap = tables[2];
    const uint32_t *m_slots = (const uint32_t *)tables[1], *v_slots = (const uint32_t *)tables[3];
    if (k->mode == 1)
        fused_block(p, g, m_codes, v_codes, m_scale, v_scale, k, 1, m_qmap, m_slots, v_qmap,
                    v_slots);
    else if (k->mode == 2)
        fused_block(p, g, m_codes, v_codes, m_scale, v_scale, k, 2, m_qmap, m_slots, v_qmap,
                    v_slots);
    else
        fused_block(p, g, m_codes, v_codes, m_scale, v_scale, k, 0, m_qmap, m_slots, v_qmap,
                    v_slots);
}
#endif

/* The update alone on fp32 arrays (the check that it is torch's on this machine). */
void tw_adam_fp32(float *p, const float *g, float *m, float *v, int64_t n, int64_t width,
                  double step, const double *hyper) {
    Coeffs k;
    adam_coeffs(&k, hyper, step);
    int64_t split = n - n % width;
    uint32_t largest[2] = {0, 0};
#ifdef TW_AVX2
    if (k.mode == 1) adam8_arrays(p, g, m, v, split, &k, 1);
    else if (k.mode == 2) adam8_arrays(p, g, m, v, split, &k, 2);
    else adam8_arrays(p, g, m, v, split, &k, 0);
#else
    adam_elements(p, g, m, v, split, &k, 0, largest);
#endif
    adam_elements(p + split, g + split, m + split, v + split, n - split, &k, k.remainder,
                  largest);
}

/* Blocks [block_lo, block_hi) of a shard's int8 moments: each block touched by a tensor is
   decoded, updated where the tensors lie, and encoded, while it is in the L1 cache. Tensors are
   sorted by start, do not overlap, and params[u]/grads[u] hold elements starts[u]:ends[u]; the
   last (length % width) elements of each are torch's scalar remainder. */
void tw_adam_int8(int64_t block_lo, int64_t block_hi, int64_t width, uint8_t *m_codes,
                  float *m_scales,
                  uint8_t *v_codes, float *v_scales, int64_t ntensors, const int64_t *starts,
                  const int64_t *ends, float *const *params, const float *const *grads,
                  const double *steps, const double *hyper, const float *m_qmap,
                  const uint32_t *m_slots, const float *v_qmap, const uint32_t *v_slots) {
    float m[BLOCK], v[BLOCK];
    Coeffs k = {0};
    double coeffs_step = -1;
    int64_t t = 0, above = ntensors; /* the first tensor ending after block_lo's start */
    while (t < above) {
        int64_t mid = t + (above - t) / 2;
        if (ends[mid] <= block_lo * BLOCK) t = mid + 1;
        else above = mid;
    }
    for (int64_t b = block_lo; b < block_hi; b++) {
        int64_t lo = b * BLOCK, hi = lo + BLOCK;
        while (t < ntensors && ends[t] <= lo) t++;
        if (t == ntensors || starts[t] >= hi) continue;
#ifdef TW_AVX2
        if (starts[t] <= lo && ends[t] - (ends[t] - starts[t]) % width >= hi) {
            if (steps[t] != coeffs_step) {
                adam_coeffs(&k, hyper, steps[t]);
                coeffs_step = steps[t];
            }
            const float *tables[4] = {m_qmap, (const float *)m_slots, v_qmap,
                                      (const float *)v_slots};
            fused_block_any(params[t] + (lo - starts[t]), grads[t] + (lo - starts[t]),
                            m_codes + lo, v_codes + lo, m_scales + b, v_scales + b, &k, tables);
            continue;
        }
#endif
        decode_block(m_codes + lo, m_scales[b], m_qmap, m);
        decode_block(v_codes + lo, v_scales[b], v_qmap, v);
        /* each block's largest magnitudes: the updated elements' from the update's loop, the
           rest (between and after the tensors) scanned */
        uint32_t largest[2] = {0, 0};
        int64_t scanned = lo;
        for (int64_t u = t; u < ntensors && starts[u] < hi; u++) {
            int64_t a = starts[u] > lo ? starts[u] : lo, e = ends[u] < hi ? ends[u] : hi;
            if (a >= e) continue;
            largest[0] = largest_bits(m + (scanned - lo), a - scanned, largest[0]);
            largest[1] = largest_bits(v + (scanned - lo), a - scanned, largest[1]);
            scanned = e;
            if (steps[u] != coeffs_step) {
                adam_coeffs(&k, hyper, steps[u]);
                coeffs_step = steps[u];
            }
            int64_t tail = ends[u] - (ends[u] - starts[u]) % width;
            int64_t split = tail < a ? a : (tail > e ? e : tail);
            int64_t at = a - starts[u];
            adam_elements(params[u] + at, grads[u] + at, m + (a - lo), v + (a - lo), split - a,
                          &k, 0, largest);
            at = split - starts[u];
            adam_elements(params[u] + at, grads[u] + at, m + (split - lo), v + (split - lo),
                          e - split, &k, k.remainder, largest);
        }
        largest[0] = largest_bits(m + (scanned - lo), hi - scanned, largest[0]);
        largest[1] = largest_bits(v + (scanned - lo), hi - scanned, largest[1]);
        m_scales[b] = block_scale(largest[0]);
        v_scales[b] = block_scale(largest[1]);
        encode_scaled(m, m_codes + lo, m_scales[b], m_slots);
        encode_scaled(v, v_codes + lo, v_scales[b], v_slots);
    }
}

/* [Note: blocks claimed by threads]
   Threads sharing one update take CLAIM blocks at a time from the shared counter *next until
   block_hi, rather than one fixed range each: on a shared machine one thread is often slowed by
   other work, and with fixed halves the update waited for the slower one (measured:
   bench/results/cpu-2026-11-28/notes/int8-s6.md). Each block is still updated by exactly one
   thread, as one whole block, so the bytes do not depend on which thread took it. */
void tw_adam_int8_claimed(int64_t *next, int64_t block_hi, int64_t claim, int64_t width,
                          uint8_t *m_codes, float *m_scales, uint8_t *v_codes, float *v_scales,
                          int64_t ntensors, const int64_t *starts, const int64_t *ends,
                          float *const *params, const float *const *grads, const double *steps,
                          const double *hyper, const float *m_qmap, const uint32_t *m_slots,
                          const float *v_qmap, const uint32_t *v_slots) {
    for (;;) {
        int64_t lo = __atomic_fetch_add(next, claim, __ATOMIC_RELAXED);
        if (lo >= block_hi) return;
        int64_t hi = lo + claim < block_hi ? lo + claim : block_hi;
        tw_adam_int8(lo, hi, width, m_codes, m_scales, v_codes, v_scales, ntensors, starts, ends,
                     params, grads, steps, hyper, m_qmap, m_slots, v_qmap, v_slots);
    }
}
