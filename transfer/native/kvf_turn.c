/* The in-place turn of KV rows (see kvf_turn.h for the function).
 *
 * Why one pass: an array of a * b vectors ([a, b, vec] -> [b, a, vec]) is a few tens of
 * KiB in a KV layout (a block's heads x tokens x one head's bytes), so it is copied whole
 * into a scratch that stays in cache, then each vector is written back to its turned
 * place. Memory sees one read and one write of each byte, as in a memcpy; the torch
 * reference gathers, transposes and scatters, three of each. A vector is a head's bytes
 * (64-512 in practice): those sizes get copies of a constant size, which the compiler
 * turns into inline wide moves instead of a call to memcpy per vector. */
#include "kvf_turn.h"

#include <stdlib.h>
#include <string.h>

/* [a, b, vec] in `from` written turned into `arr` as [b, a, vec]: source [x, y] lands at
 * [y, x]. Inlined with a constant `vec` at the call sites that have one. */
static inline __attribute__((always_inline)) void kvf_scatter(unsigned char *arr,
                                                              const unsigned char *from,
                                                              int64_t a, int64_t b, size_t vec)
{
    for (int64_t x = 0; x < a; x++) {
        const unsigned char *src = from + (size_t)x * (size_t)b * vec;
        unsigned char *dst = arr + (size_t)x * vec;
        for (int64_t y = 0; y < b; y++)
            memcpy(dst + (size_t)y * (size_t)a * vec, src + (size_t)y * vec, vec);
    }
}

int64_t kvf_turn_rows(void *base, int64_t row_stride, int64_t rows, const int64_t *index,
                      int64_t n, int64_t outer, int64_t a, int64_t b, int64_t vec_bytes)
{
    if (outer <= 0 || a <= 0 || b <= 0 || vec_bytes <= 0)
        return -2;
    for (int64_t i = 0; i < n; i++)
        if (index[i] < 0 || index[i] >= rows)
            return i;
    if (n == 0 || a == 1 || b == 1) /* [1, b] and [a, 1] are their own turns */
        return -1;
    const size_t span = (size_t)a * (size_t)b * (size_t)vec_bytes;
    unsigned char *scratch = malloc(span);
    if (scratch == NULL)
        return -2;
    for (int64_t i = 0; i < n; i++) {
        unsigned char *row = (unsigned char *)base + index[i] * row_stride;
        for (int64_t o = 0; o < outer; o++) {
            unsigned char *arr = row + (size_t)o * span;
            memcpy(scratch, arr, span);
            switch (vec_bytes) { /* a head's bytes: fixed sizes copy as inline wide moves */
            case 64: kvf_scatter(arr, scratch, a, b, 64); break;
            case 128: kvf_scatter(arr, scratch, a, b, 128); break;
            case 256: kvf_scatter(arr, scratch, a, b, 256); break;
            case 512: kvf_scatter(arr, scratch, a, b, 512); break;
            default: kvf_scatter(arr, scratch, a, b, (size_t)vec_bytes); break;
            }
        }
    }
    free(scratch);
    return -1;
}
