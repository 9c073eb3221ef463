/* How much host memory a large allocation may still count on, so that a
 * program refuses work it cannot hold with a message, instead of being
 * killed by the kernel halfway through filling pages it was lent. */
#ifndef FR_HOST_MEMORY_H
#define FR_HOST_MEMORY_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes the kernel reports as available for new allocations without
 * swapping (Linux's MemAvailable); 0 when it says nothing (another system,
 * an unreadable /proc), which callers take as "unknown", not "none". */
size_t fr_host_mem_available(void);

#ifdef __cplusplus
}
#endif

#endif
