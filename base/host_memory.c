#include "base/host_memory.h"

#include <stdio.h>
#include <string.h>

size_t fr_host_mem_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[128];
    size_t kib = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %zu kB", &kib) == 1) break;
    fclose(f);
    return kib * 1024;
}
