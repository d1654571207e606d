/* kvferry's page checksum on the CPU (implemented in kvf_checksum.c, built into the cffi
 * module kvferry.transfer._checksum by build_checksum.py). A byte function: it knows
 * nothing of requests, transfers or UCX, and links nothing but libc.
 *
 * The function is kvferry.engine.integrity.page_checksums_reference: each page's bytes
 * are unsigned 16-bit words w_i in the machine's byte order (single bytes when the page's
 * byte count is odd), s1 = sum w_i mod P, s2 = sum (i+1) w_i mod P with P = 2^31 - 1,
 * packed s1 * 2^31 + s2. Every word is below P, so no change to one word leaves s1 as it
 * was. Integer arithmetic, so any summation order gives exactly the reference's value.
 *
 * Between the KVF_CDEF markers: the declarations build_checksum.py hands to cffi's cdef
 * (plain C, no preprocessor lines). */
#ifndef KVF_CHECKSUM_H
#define KVF_CHECKSUM_H

#include <stdint.h>

/* KVF_CDEF_BEGIN */

/* One checksum per listed page into out[0..n): page p is the page_bytes bytes at
 * base + p * page_stride (any stride, pages may overlap; page_bytes >= 0). Every page is
 * checked against [0, pool_pages) before any is read: returns -1 when all are inside,
 * else the index in `pages` of the first outside (out is then left unwritten). Reads
 * nothing else, holds no state: safe to call with the GIL released, from any thread. */
int64_t kvf_page_checksums(const void *base, int64_t page_stride, int64_t page_bytes,
                           int64_t pool_pages, const int64_t *pages, int64_t n,
                           int64_t *out);

/* The same function over byte runs: out[i] is the checksum of the lengths[i] bytes at
 * base + offsets[i], read as words of `unit` bytes (2 or 1; every length a multiple of
 * it), the run's own first word at index 0. Every run is checked against [0, base_bytes)
 * before any is read: returns -1 when all are inside, else the index of the first run
 * outside or of a length that is negative or not a multiple of `unit` (out is then left
 * unwritten). A region's checksum is put together from its runs' (kvferry.engine
 * .run_checksum): the function is linear in the words, with a shift of index. */
int64_t kvf_run_checksums(const void *base, int64_t base_bytes, const int64_t *offsets,
                          const int64_t *lengths, int64_t n, int unit, int64_t *out);

/* KVF_CDEF_END */

#endif /* KVF_CHECKSUM_H */
