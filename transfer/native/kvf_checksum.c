/* Page checksums at memory speed (see kvf_checksum.h for the function).
 *
 * Why it is fast: no per-word division and no per-word multiply. A page is cut into blocks
 * of KVF_LANES * KVF_STEPS words. Inside a block, lane k takes the words j = t*LANES + k
 * (t = 0..T-1) and keeps two uint64 running sums, Fletcher style:
 *     a_k += w;  b_k += a_k;      so  a_k = sum_t w_t,  b_k = sum_t (T - t) w_t.
 * The lane loop is adds and zero-extending loads only, which the compiler vectorises at
 * -O3 (SSE2 everywhere; an AVX2 clone picked at load time on x86-64 glibc). Per block:
 *     S = sum_k a_k = sum_j w_j,
 *     J = sum_j j w_j = LANES * sum_k (T a_k - b_k) + sum_k k a_k,
 * and the block starting at word i0 adds S to s1 and (i0 + 1) S + J to s2, each reduced
 * mod the Mersenne prime P by folds ((x & P) + (x >> 31)), never a division.
 * Bounds: w < 2^32 and T <= 256, so a_k < 2^40, b_k < 2^48 and J < 2^57: no overflow.
 * The words left after the last full group of LANES go one by one. */
#include "kvf_checksum.h"

#include <string.h>

#define KVF_P 2147483647ULL
#define KVF_LANES 16
#define KVF_STEPS 256 /* a block: 4096 words (16 KiB) */

#if defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define KVF_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef KVF_CLONES
#define KVF_CLONES
#endif

/* x mod P for any uint64 x: two Mersenne folds and one conditional subtract. */
static inline uint64_t kvf_fold(uint64_t x)
{
    x = (x & KVF_P) + (x >> 31); /* < 2^31 + 2^33 */
    x = (x & KVF_P) + (x >> 31); /* < 2^31 + 8 < 2P */
    return x >= KVF_P ? x - KVF_P : x;
}

/* The lane sums of `steps` groups of KVF_LANES words at p (unaligned is fine). */
#define KVF_LANE_SUMS(name, type)                                                          \
    KVF_CLONES static void name(const unsigned char *p, int64_t steps, uint64_t *a_out,   \
                                uint64_t *b_out)                                           \
    {                                                                                      \
        uint64_t a[KVF_LANES] = {0}, b[KVF_LANES] = {0};                                   \
        int64_t t;                                                                         \
        int k;                                                                             \
        for (t = 0; t < steps; ++t) {                                                      \
            const unsigned char *q = p + t * (int64_t)(KVF_LANES * sizeof(type));          \
            for (k = 0; k < KVF_LANES; ++k) {                                              \
                type w;                                                                    \
                memcpy(&w, q + k * sizeof(type), sizeof(type));                            \
                a[k] += w;                                                                 \
                b[k] += a[k];                                                              \
            }                                                                              \
        }                                                                                  \
        memcpy(a_out, a, sizeof(a));                                                       \
        memcpy(b_out, b, sizeof(b));                                                       \
    }

KVF_LANE_SUMS(kvf_lane_sums_u32, uint32_t)
KVF_LANE_SUMS(kvf_lane_sums_u8, uint8_t)

/* Checksum of `count` words of `unit` bytes (4 or 1) at p. */
static int64_t kvf_checksum_one(const unsigned char *p, int64_t count, int unit)
{
    uint64_t s1 = 0, s2 = 0, a[KVF_LANES], b[KVF_LANES];
    int64_t i0 = 0;
    int k;
    while (count - i0 >= KVF_LANES) {
        int64_t steps = (count - i0) / KVF_LANES;
        uint64_t sum = 0, lanes = 0, offsets = 0, ssum, j;
        if (steps > KVF_STEPS) steps = KVF_STEPS;
        if (unit == 4)
            kvf_lane_sums_u32(p + i0 * 4, steps, a, b);
        else
            kvf_lane_sums_u8(p + i0, steps, a, b);
        for (k = 0; k < KVF_LANES; ++k) {
            sum += a[k];
            lanes += (uint64_t)steps * a[k] - b[k];
            offsets += (uint64_t)k * a[k];
        }
        ssum = kvf_fold(sum);
        j = kvf_fold(KVF_LANES * lanes + offsets);
        s1 = kvf_fold(s1 + ssum);
        s2 = kvf_fold(s2 + kvf_fold(kvf_fold((uint64_t)i0 + 1) * ssum) + j);
        i0 += steps * KVF_LANES;
    }
    for (; i0 < count; ++i0) {
        uint64_t w;
        if (unit == 4) {
            uint32_t v;
            memcpy(&v, p + i0 * 4, 4);
            w = kvf_fold(v);
        } else {
            w = p[i0];
        }
        s1 = kvf_fold(s1 + w);
        s2 = kvf_fold(s2 + kvf_fold(kvf_fold((uint64_t)i0 + 1) * w));
    }
    return (int64_t)((s1 << 31) + s2);
}

int64_t kvf_page_checksums(const void *base, int64_t page_stride, int64_t page_bytes,
                           int64_t pool_pages, const int64_t *pages, int64_t n,
                           int64_t *out)
{
    const int unit = page_bytes % 4 == 0 ? 4 : 1;
    int64_t i;
    for (i = 0; i < n; ++i) {
        if (pages[i] < 0 || pages[i] >= pool_pages) return i;
    }
    for (i = 0; i < n; ++i) {
        const unsigned char *p = (const unsigned char *)base + pages[i] * page_stride;
        out[i] = kvf_checksum_one(p, page_bytes / unit, unit);
    }
    return -1;
}

int64_t kvf_run_checksums(const void *base, int64_t base_bytes, const int64_t *offsets,
                          const int64_t *lengths, int64_t n, int unit, int64_t *out)
{
    int64_t i;
    if (unit != 4 && unit != 1) return n > 0 ? 0 : -1;
    for (i = 0; i < n; ++i) {
        if (offsets[i] < 0 || lengths[i] < 0 || lengths[i] % unit
            || offsets[i] > base_bytes - lengths[i])
            return i;
    }
    for (i = 0; i < n; ++i)
        out[i] = kvf_checksum_one((const unsigned char *)base + offsets[i], lengths[i] / unit,
                                  unit);
    return -1;
}
