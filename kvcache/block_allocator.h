/* fr_block_allocator: hands out KV cache blocks (one 128-token page of all
 * layers' KV for one sequence) by id, 0 .. n_blocks-1.
 *
 * Blocks are reference counted because the samples of one prompt share the
 * prompt's full pages: a block returns to the free pool only when its last
 * holder lets go. Alloc and free are O(1) (a stack of free ids).
 *
 * Order, so runs are reproducible: a new allocator hands out 0, 1, 2, ...;
 * after that, freed blocks are reused last-freed first (LIFO), which keeps
 * recently touched pages hot.
 *
 * Not thread safe: one scheduler owns it.
 */
#ifndef FR_BLOCK_ALLOCATOR_H
#define FR_BLOCK_ALLOCATOR_H

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_block_allocator fr_block_allocator;

/* n_blocks >= 1. */
fr_status fr_block_allocator_new(int n_blocks, fr_block_allocator **out);
/* Frees the allocator whatever is still referenced and sets *a to NULL;
 * a NULL pointer or *a == NULL is a no-op. */
void fr_block_allocator_destroy(fr_block_allocator **a);

/* One free block with refcount 1; FR_ENOMEM "no free KV block (N in use)"
 * when none is left. */
fr_status fr_block_alloc(fr_block_allocator *a, int *block);
/* n blocks (n >= 0) into blocks[0..n-1], each refcount 1: all or nothing,
 * so on FR_ENOMEM nothing changed. */
fr_status fr_block_alloc_n(fr_block_allocator *a, int n, int *blocks);
/* One more holder of an allocated block; FR_EINVAL for a free or
 * out-of-range block (sharing a free block would hand out a dangling page). */
fr_status fr_block_incref(fr_block_allocator *a, int block);
/* One holder fewer; the block is free again at 0. FR_EINVAL for a block that
 * is already free (double free) or out of range; nothing changes then. */
fr_status fr_block_decref(fr_block_allocator *a, int block);

/* The block's refcount (0 = free), or -1 for NULL or an out-of-range id. */
int fr_block_refcount(const fr_block_allocator *a, int block);
int fr_block_free_count(const fr_block_allocator *a);   /* 0 for NULL */
int fr_block_total(const fr_block_allocator *a);        /* 0 for NULL */

#ifdef __cplusplus
}
#endif

#endif
