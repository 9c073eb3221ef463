#include "kvcache/block_table.h"

#include <limits.h>
#include <stdlib.h>

void fr_block_table_init(fr_block_table *t)
{
    if (!t)
        return;
    t->blocks = NULL;
    t->n = 0;
    t->cap = 0;
}

/* Room for at least want ids; leaves t untouched on failure. */
static fr_status reserve(fr_block_table *t, int want)
{
    if (want <= t->cap)
        return FR_OK;
    int cap = t->cap ? t->cap : 8;
    while (cap < want)
        cap = cap > INT_MAX / 2 ? INT_MAX : cap * 2;
    int *p = realloc(t->blocks, (size_t)cap * sizeof *p);
    if (!p)
        return fr_fail(FR_ENOMEM, "cannot grow block table to %d entries", cap);
    t->blocks = p;
    t->cap = cap;
    return FR_OK;
}

fr_status fr_block_table_push(fr_block_table *t, int block)
{
    if (!t)
        return fr_fail(FR_EINVAL, "fr_block_table_push: table is NULL");
    if (block < 0)
        return fr_fail(FR_EINVAL, "cannot push KV block id %d", block);
    if (t->n == INT_MAX)
        return fr_fail(FR_ENOMEM, "block table is full (%d entries)", t->n);
    fr_status st = reserve(t, t->n + 1);
    if (st != FR_OK)
        return st;
    t->blocks[t->n++] = block;
    return FR_OK;
}

fr_status fr_block_table_fork(const fr_block_table *src, int n_shared,
                              fr_block_allocator *a, fr_block_table *dst)
{
    if (!src || !a || !dst)
        return fr_fail(FR_EINVAL, "fr_block_table_fork: NULL argument");
    if (dst->n != 0)
        return fr_fail(FR_EINVAL, "fork target already holds %d blocks; release it first",
                       dst->n);
    if (n_shared < 0 || n_shared > src->n)
        return fr_fail(FR_EINVAL, "cannot share %d blocks of a %d-block table", n_shared,
                       src->n);
    fr_status st = reserve(dst, n_shared);
    if (st != FR_OK)
        return st;
    for (int i = 0; i < n_shared; i++) {
        st = fr_block_incref(a, src->blocks[i]);
        if (st != FR_OK) {
            /* Undo the references already taken so a failed fork is a no-op. */
            while (i-- > 0)
                fr_block_decref(a, src->blocks[i]);
            return st;
        }
        dst->blocks[i] = src->blocks[i];
    }
    dst->n = n_shared;
    return FR_OK;
}

void fr_block_table_release(fr_block_table *t, fr_block_allocator *a)
{
    if (!t)
        return;
    /* A failing decref means the table listed a block it did not own, a bug
     * elsewhere; the rest are still released so the pool does not leak. */
    for (int i = 0; i < t->n; i++)
        fr_block_decref(a, t->blocks[i]);
    free(t->blocks);
    fr_block_table_init(t);
}
