/* Page checksums at memory speed (see kvf_checksum.h for the function).
 *
 * The function reads a page as 16-bit words h_j (bytes when its length is odd). Read
 * here as 32-bit words w_i (little-endian: h_2i = w_i & 0xFFFF, h_2i+1 = w_i >> 16), with
 * u_i = h_2i + h_2i+1:
 *     s1 = sum_j h_j = sum_i u_i,
 *     s2 = sum_j (j+1) h_j = sum_i ((2i+1) u_i + h_2i+1) = 2 F - s1 + H,
 * where F = sum_i (i+1) u_i is a Fletcher sum over the 32-bit positions and H = sum_i
 * h_2i+1. A 16-bit word left over (a length of 2 mod 4) is added on its own.
 *
 * Why it is fast: no per-word division and no per-word multiply. A page is cut into blocks
 * of KVF_LANES * KVF_STEPS words. Inside a block, lane k takes the words i = t*LANES + k
 * (t = 0..T-1) and keeps three uint64 running sums:
 *     a_k += u;  b_k += a_k;  c_k += h_hi;   so  a_k = sum_t u_t,  b_k = sum_t (T - t) u_t.
 * The lane loop is adds, masks, shifts and zero-extending loads only, which the compiler
 * vectorises at -O3 (SSE2 everywhere; an AVX2 clone picked at load time on x86-64 glibc).
 * Per block:
 *     S = sum_k a_k = sum_i u_i,
 *     J = sum_i i u_i = LANES * sum_k (T a_k - b_k) + sum_k k a_k,
 * and the block starting at word i0 adds S to s1, (i0 + 1) S + J to F and sum_k c_k to
 * H, each reduced mod the Mersenne prime P by folds ((x & P) + (x >> 31)), never a
 * division. Bounds: u < 2^17 and T <= 256, so a_k < 2^25, b_k < 2^33 and J < 2^42.
 * Pages of an odd length go byte by byte through the same lanes (u = the byte, H = 0,
 * s2 = F). The words left after the last full group of LANES go one by one.
 *
 * Why 16-bit words: every word is below P, so a change to one word is never a multiple
 * of P and always moves s1 (32-bit words w and w + P summed alike). */
#include "kvf_checksum.h"

#include <string.h>

#define KVF_P 2147483647ULL
#define KVF_LANES 16
#define KVF_STEPS 256 /* a block: 4096 words (16 KiB of pairs) */

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

/* The lane sums of `steps` groups of KVF_LANES 32-bit words at p (unaligned is fine):
 * a, b of u = low half + high half, c of the high half. */
KVF_CLONES static void kvf_lane_sums_halves(const unsigned char *p, int64_t steps,
                                            uint64_t *a_out, uint64_t *b_out, uint64_t *c_out)
{
    uint64_t a[KVF_LANES] = {0}, b[KVF_LANES] = {0}, c[KVF_LANES] = {0};
    int64_t t;
    int k;
    for (t = 0; t < steps; ++t) {
        const unsigned char *q = p + t * (int64_t)(KVF_LANES * 4);
        for (k = 0; k < KVF_LANES; ++k) {
            uint32_t w;
            uint64_t hi;
            memcpy(&w, q + k * 4, 4);
            hi = w >> 16;
            a[k] += (w & 0xFFFFu) + hi;
            b[k] += a[k];
            c[k] += hi;
        }
    }
    memcpy(a_out, a, sizeof(a));
    memcpy(b_out, b, sizeof(b));
    memcpy(c_out, c, sizeof(c));
}

/* The lane sums of `steps` groups of KVF_LANES bytes at p. */
KVF_CLONES static void kvf_lane_sums_bytes(const unsigned char *p, int64_t steps,
                                           uint64_t *a_out, uint64_t *b_out)
{
    uint64_t a[KVF_LANES] = {0}, b[KVF_LANES] = {0};
    int64_t t;
    int k;
    for (t = 0; t < steps; ++t) {
        const unsigned char *q = p + t * (int64_t)KVF_LANES;
        for (k = 0; k < KVF_LANES; ++k) {
            a[k] += q[k];
            b[k] += a[k];
        }
    }
    memcpy(a_out, a, sizeof(a));
    memcpy(b_out, b, sizeof(b));
}

/* Checksum of the `nbytes` bytes at p read as 16-bit words (halves = 1: nbytes even,
 * read as 32-bit pairs) or bytes (halves = 0). */
static int64_t kvf_checksum_one(const unsigned char *p, int64_t nbytes, int halves)
{
    const int64_t count = halves ? nbytes / 4 : nbytes; /* lane words: pairs or bytes */
    uint64_t s1 = 0, f = 0, h = 0, s2, a[KVF_LANES], b[KVF_LANES], c[KVF_LANES];
    int64_t i0 = 0;
    int k;
    while (count - i0 >= KVF_LANES) {
        int64_t steps = (count - i0) / KVF_LANES;
        uint64_t sum = 0, lanes = 0, offsets = 0, high = 0, ssum, j;
        if (steps > KVF_STEPS) steps = KVF_STEPS;
        if (halves) {
            kvf_lane_sums_halves(p + i0 * 4, steps, a, b, c);
            for (k = 0; k < KVF_LANES; ++k) high += c[k];
        } else {
            kvf_lane_sums_bytes(p + i0, steps, a, b);
        }
        for (k = 0; k < KVF_LANES; ++k) {
            sum += a[k];
            lanes += (uint64_t)steps * a[k] - b[k];
            offsets += (uint64_t)k * a[k];
        }
        ssum = kvf_fold(sum);
        j = kvf_fold(KVF_LANES * lanes + offsets);
        s1 = kvf_fold(s1 + ssum);
        f = kvf_fold(f + kvf_fold(kvf_fold((uint64_t)i0 + 1) * ssum) + j);
        h = kvf_fold(h + high);
        i0 += steps * KVF_LANES;
    }
    for (; i0 < count; ++i0) {
        uint64_t u;
        if (halves) {
            uint32_t w;
            memcpy(&w, p + i0 * 4, 4);
            u = (w & 0xFFFFu) + (w >> 16);
            h = kvf_fold(h + (w >> 16));
        } else {
            u = p[i0];
        }
        s1 = kvf_fold(s1 + u);
        f = kvf_fold(f + kvf_fold(kvf_fold((uint64_t)i0 + 1) * u));
    }
    if (!halves) return (int64_t)((s1 << 31) + f);
    /* s2 = 2F - s1 + H (mod P), all three below P */
    s2 = kvf_fold(2 * f + (KVF_P - s1) + h);
    if (nbytes % 4) { /* the last 16-bit word, alone: index 2 * count */
        uint16_t v;
        memcpy(&v, p + count * 4, 2);
        s1 = kvf_fold(s1 + v);
        s2 = kvf_fold(s2 + kvf_fold(kvf_fold((uint64_t)(2 * count + 1)) * v));
    }
    return (int64_t)((s1 << 31) + s2);
}

int64_t kvf_page_checksums(const void *base, int64_t page_stride, int64_t page_bytes,
                           int64_t pool_pages, const int64_t *pages, int64_t n,
                           int64_t *out)
{
    int64_t i;
    for (i = 0; i < n; ++i) {
        if (pages[i] < 0 || pages[i] >= pool_pages) return i;
    }
    for (i = 0; i < n; ++i) {
        const unsigned char *p = (const unsigned char *)base + pages[i] * page_stride;
        out[i] = kvf_checksum_one(p, page_bytes, page_bytes % 2 == 0);
    }
    return -1;
}

int64_t kvf_run_checksums(const void *base, int64_t base_bytes, const int64_t *offsets,
                          const int64_t *lengths, int64_t n, int unit, int64_t *out)
{
    int64_t i;
    if (unit != 2 && unit != 1) return n > 0 ? 0 : -1;
    for (i = 0; i < n; ++i) {
        if (offsets[i] < 0 || lengths[i] < 0 || lengths[i] % unit
            || offsets[i] > base_bytes - lengths[i])
            return i;
    }
    for (i = 0; i < n; ++i)
        out[i] = kvf_checksum_one((const unsigned char *)base + offsets[i], lengths[i],
                                  unit == 2);
    return -1;
}
