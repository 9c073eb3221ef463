#include "kvcache/block_allocator.h"

#include <limits.h>
#include <stdlib.h>

struct fr_block_allocator {
    int n;          /* total blocks */
    int *refcount;  /* per block; 0 = free */
    int *free_ids;  /* stack of free ids, top at free_ids[n_free - 1] */
    int n_free;
};

fr_status fr_block_allocator_new(int n_blocks, fr_block_allocator **out)
{
    if (!out)
        return fr_fail(FR_EINVAL, "fr_block_allocator_new: out is NULL");
    *out = NULL;
    if (n_blocks < 1)
        return fr_fail(FR_EINVAL, "KV block count %d must be at least 1", n_blocks);
    fr_block_allocator *a = calloc(1, sizeof *a);
    if (a) {
        a->refcount = calloc((size_t)n_blocks, sizeof *a->refcount);
        a->free_ids = malloc((size_t)n_blocks * sizeof *a->free_ids);
    }
    if (!a || !a->refcount || !a->free_ids) {
        fr_block_allocator_destroy(&a);
        return fr_fail(FR_ENOMEM, "cannot allocate bookkeeping for %d KV blocks", n_blocks);
    }
    a->n = n_blocks;
    /* Pushed highest first so the first pops are 0, 1, 2, ... */
    for (int i = 0; i < n_blocks; i++)
        a->free_ids[i] = n_blocks - 1 - i;
    a->n_free = n_blocks;
    *out = a;
    return FR_OK;
}

void fr_block_allocator_destroy(fr_block_allocator **a)
{
    if (!a || !*a)
        return;
    free((*a)->refcount);
    free((*a)->free_ids);
    free(*a);
    *a = NULL;
}

fr_status fr_block_alloc(fr_block_allocator *a, int *block)
{
    return fr_block_alloc_n(a, 1, block);
}

fr_status fr_block_alloc_n(fr_block_allocator *a, int n, int *blocks)
{
    if (!a || (n > 0 && !blocks))
        return fr_fail(FR_EINVAL, "fr_block_alloc_n: NULL allocator or output");
    if (n < 0)
        return fr_fail(FR_EINVAL, "cannot allocate %d KV blocks", n);
    /* Checked up front so a failure leaves nothing half allocated. */
    if (n > a->n_free) {
        if (n == 1)
            return fr_fail(FR_ENOMEM, "no free KV block (%d in use)", a->n - a->n_free);
        return fr_fail(FR_ENOMEM, "no %d free KV blocks: %d free (%d in use)", n,
                       a->n_free, a->n - a->n_free);
    }
    for (int i = 0; i < n; i++) {
        int b = a->free_ids[--a->n_free];
        a->refcount[b] = 1;
        blocks[i] = b;
    }
    return FR_OK;
}

/* An allocator and a block id within it (who names the caller). */
static fr_status check_block(const fr_block_allocator *a, const char *who, int block)
{
    if (!a)
        return fr_fail(FR_EINVAL, "%s: allocator is NULL", who);
    if (block < 0 || block >= a->n)
        return fr_fail(FR_EINVAL, "KV block %d out of range [0, %d)", block, a->n);
    return FR_OK;
}

fr_status fr_block_incref(fr_block_allocator *a, int block)
{
    fr_status st = check_block(a, "fr_block_incref", block);
    if (st)
        return st;
    if (a->refcount[block] == 0)
        return fr_fail(FR_EINVAL, "cannot share KV block %d: it is free", block);
    if (a->refcount[block] == INT_MAX)
        return fr_fail(FR_EINVAL, "KV block %d refcount would overflow", block);
    a->refcount[block]++;
    return FR_OK;
}

fr_status fr_block_decref(fr_block_allocator *a, int block)
{
    fr_status st = check_block(a, "fr_block_decref", block);
    if (st)
        return st;
    if (a->refcount[block] == 0)
        return fr_fail(FR_EINVAL, "KV block %d is already free (double free)", block);
    /* The stack cannot overflow: a block is pushed only on its 1 -> 0 step. */
    if (--a->refcount[block] == 0)
        a->free_ids[a->n_free++] = block;
    return FR_OK;
}

int fr_block_refcount(const fr_block_allocator *a, int block)
{
    if (!a || block < 0 || block >= a->n)
        return -1;
    return a->refcount[block];
}

int fr_block_free_count(const fr_block_allocator *a) { return a ? a->n_free : 0; }

int fr_block_total(const fr_block_allocator *a) { return a ? a->n : 0; }
