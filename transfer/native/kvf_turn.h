/* kvferry's in-place turn of KV rows between heads-major and token-major order on the CPU
 * (implemented in kvf_turn.c, built into the cffi module kvferry.transfer._turn by
 * build_turn.py). A byte function: it knows nothing of requests, transfers or UCX, and
 * links nothing but libc.
 *
 * The function is kvferry.engine.pool.turn_rows_reference: each listed row holds `outer`
 * arrays of shape [a, b, vec_bytes] one after another, and each becomes [b, a, vec_bytes]
 * in the same bytes. A pool page that landed token-major ([layers, 2, tokens, heads,
 * head_dim] turned to [layers, 2, heads, tokens, head_dim]) is one row with outer =
 * layers * 2; a vLLM cache's layer span is one row with outer = 1.
 *
 * Between the KVF_CDEF markers: the declarations build_turn.py hands to cffi's cdef
 * (plain C, no preprocessor lines). */
#ifndef KVF_TURN_H
#define KVF_TURN_H

#include <stdint.h>

/* KVF_CDEF_BEGIN */

/* Turn rows index[0..n) in place: row r is the outer * a * b * vec_bytes dense bytes at
 * base + r * row_stride. Every listed row is checked against [0, rows) before any is
 * touched: returns -1 when all are inside and the rows were turned, the index in `index`
 * of the first row outside (nothing touched), or -2 when the dimensions are not positive
 * or the scratch of one array (a * b * vec_bytes bytes) could not be allocated (nothing
 * touched). Each array goes through that scratch once: read whole, written back turned.
 * Holds no state: safe to call with the GIL released, from any thread; rows listed twice
 * are turned twice. */
int64_t kvf_turn_rows(void *base, int64_t row_stride, int64_t rows, const int64_t *index,
                      int64_t n, int64_t outer, int64_t a, int64_t b, int64_t vec_bytes);

/* KVF_CDEF_END */

#endif /* KVF_TURN_H */
