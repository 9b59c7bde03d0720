#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256

/* [Note: int8 code slots]
   The code of a scaled value q (q = x / max|x|: |q| <= 1, or a quiet NaN) is base + (q >=
   thresholds[base]), base the count of thresholds at the lower end of q's bucket (its top 16
   bits: [Note: int8 code lookup]). Where that threshold lies inside the bucket, it shares q's top
   16 bits, so the comparison is one of the low 16 bits (reversed for negative values); where it
   lies above, the code is base for the whole bucket, written (base - 1) + 1 mod 256 with a
   comparison that always holds (with 0). So each bucket needs one 32-bit entry, (base or base - 1)
   << 16 | the low bits to compare with, and the code is (entry >> 16) + (key >= (entry & 0xffff))
   mod 256: one table load per value, the rest arithmetic the compiler vectorises. All buckets
   below 2^-23 share one entry, as do all above 1.0's and all NaN and infinite ones, so the
   magnitude's bits are clamped to [SLOT_LEAST, SLOT_MOST], NaN and infinity take the next slot,
   and the sign adds SLOT_SIGN: 5894 slots (23 KiB per map; the 65536 bytes per map of the table
   before did not fit the L1 cache with their thresholds). ``lowbit_kernel.code_slots`` builds
   them from the 65536-entry table and checks every bucket's entry. */
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
        c[i] = (uint8_t)((entry[i] >> 16) + (key >= (entry[i] & 0xffffu)));
    }
}

static void encode_block(const float *x, uint8_t *c, float *scale_out, const uint32_t *slots) {
    const float scale = block_scale(largest_bits(x, BLOCK, 0));
    *scale_out = scale;
    encode_scaled(x, c, scale, slots);
}

static void decode_block(const uint8_t *c, float scale, const float *qmap, float *out) {
#pragma GCC unroll 8
    for (int i = 0; i < BLOCK; i++) out[i] = qmap[c[i]] * scale;
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

/* torch's fused Adam(W) CPU kernel on fp32, operation for operation: [Note: int8 Adam in one pass] */
typedef struct {
    float decay, l2, coeff, beta2, sq_coeff, bc2_sqrt, eps, neg_step;
    int keep_m, mode; /* mode: 0 no weight decay, 1 decoupled (AdamW), 2 L2 (Adam) */
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
        if (tail) { /* torch's scalar remainder loop fuses the other product */
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

/* The update alone on fp32 arrays (the check that it is torch's on this machine). */
void tw_adam_fp32(float *p, const float *g, float *m, float *v, int64_t n, int64_t width,
                  double step, const double *hyper) {
    Coeffs k;
    adam_coeffs(&k, hyper, step);
    int64_t split = n - n % width;
    uint32_t largest[2] = {0, 0};
    adam_elements(p, g, m, v, split, &k, 0, largest);
    adam_elements(p + split, g + split, m + split, v + split, n - split, &k, 1, largest);
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
    Coeffs k;
    double coeffs_step = -1;
    int64_t t = 0;
    for (int64_t b = block_lo; b < block_hi; b++) {
        int64_t lo = b * BLOCK, hi = lo + BLOCK;
        while (t < ntensors && ends[t] <= lo) t++;
        if (t == ntensors || starts[t] >= hi) continue;
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
                          e - split, &k, 1, largest);
        }
        largest[0] = largest_bits(m + (scanned - lo), hi - scanned, largest[0]);
        largest[1] = largest_bits(v + (scanned - lo), hi - scanned, largest[1]);
        m_scales[b] = block_scale(largest[0]);
        v_scales[b] = block_scale(largest[1]);
        encode_scaled(m, m_codes + lo, m_scales[b], m_slots);
        encode_scaled(v, v_codes + lo, v_scales[b], v_slots);
    }
}
