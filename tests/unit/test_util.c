#include "test_util.h"

#include <dirent.h>
#include <math.h>
#include <string.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

/* FR_<NAME>_DIR, the variable that points at checkpoint `name`. */
static void dir_variable(const char *name, char *var, size_t cap)
{
    size_t n = (size_t)snprintf(var, cap, "FR_");
    for (const char *c = name; *c && n + 5 < cap; c++) var[n++] = (char)(*c >= 'a' && *c <= 'z' ? *c - 32 : *c);
    snprintf(var + n, cap - n, "_DIR");
}

const char *fr_test_model_dir(const char *name)
{
    char var[64];
    dir_variable(name, var, sizeof var);
    const char *env = getenv(var);
    static char dir[4096], probe[4200];
    if (env && *env) snprintf(dir, sizeof dir, "%s", env);
    else snprintf(dir, sizeof dir, "../shared/models/%s", name);
    struct stat st;
    snprintf(probe, sizeof probe, "%s/config.json", dir);
    return stat(probe, &st) == 0 ? dir : NULL;
}

const char *fr_test_require_model(const char *name)
{
    const char *dir = fr_test_model_dir(name);
    if (!dir) {
        char var[64];
        dir_variable(name, var, sizeof var);
        fprintf(stderr, "SKIP: %s checkpoint not found (set %s or place it at ../shared/models/%s)\n", name, var,
                name);
    }
    return dir;
}

const char *fr_test_tq6_dir(void) { return fr_test_model_dir("tq6"); }

const char *fr_test_require_tq6(void) { return fr_test_require_model("tq6"); }

uint64_t fr_test_u64(fr_test_rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

float fr_test_uniform(fr_test_rng *r) { return (float)(fr_test_u64(r) >> 40) * 0x1p-24f; }

float fr_test_normal(fr_test_rng *r)
{
    float u1 = fr_test_uniform(r), u2 = fr_test_uniform(r);
    if (u1 < 1e-12f) u1 = 1e-12f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}

void fr_test_clear_dir(const char *dir, int remove_self)
{
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[4096];
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            unlink(p);
        }
    closedir(d);
    if (remove_self) rmdir(dir);
}
