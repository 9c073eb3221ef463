/* fr_block_table: the KV blocks of one sequence, in page order (entry i holds
 * tokens [128 i, 128 (i + 1))).
 *
 * Ownership: the table holds one reference to every id it lists. push hands
 * the caller's reference over to the table (alloc then push, no incref);
 * fork takes new references; release gives them all back.
 */
#ifndef FR_BLOCK_TABLE_H
#define FR_BLOCK_TABLE_H

#include "base/fr_status.h"
#include "kvcache/block_allocator.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct { int *blocks; int n; int cap; } fr_block_table;

/* An empty table; owns no memory until the first push. */
void fr_block_table_init(fr_block_table *t);

/* Appends block (>= 0), taking over the caller's reference. On failure the
 * table is unchanged and the reference stays with the caller. */
fr_status fr_block_table_push(fr_block_table *t, int block);

/* Starts dst, a new sample of the same prompt, on the first n_shared blocks
 * of src (0 <= n_shared <= src->n): copies their ids and increfs each, so
 * the prompt's full pages are stored once. dst must be initialized and empty
 * (fresh or released), which keeps a fork from leaking dst's old references.
 * All or nothing: on failure no refcount changed and dst is still empty. */
fr_status fr_block_table_fork(const fr_block_table *src, int n_shared,
                              fr_block_allocator *a, fr_block_table *dst);

/* Decrefs every block into a (the allocator they came from), frees the
 * memory and leaves t empty and reusable. Safe on an empty table. */
void fr_block_table_release(fr_block_table *t, fr_block_allocator *a);

#ifdef __cplusplus
}
#endif

#endif
