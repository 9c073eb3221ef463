#include "rollout/model/checkpoint.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* One tensor visible through the checkpoint and the shard that holds it. */
typedef struct {
    const fr_st_tensor *t; /* t->name is the sort key; it lives in the shard */
    int file;
} ck_entry;

struct fr_checkpoint {
    fr_model_config cfg;
    char *dir;
    int n_files;
    fr_st_file **files;
    int n_entries;
    ck_entry *entries; /* sorted by name */
};

static char *join(const char *dir, const char *name)
{
    char *p = NULL;
    return asprintf(&p, "%s/%s", dir, name) < 0 ? NULL : p;
}

static int exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

static int cmp_entry(const void *a, const void *b)
{
    return strcmp(((const ck_entry *)a)->t->name, ((const ck_entry *)b)->t->name);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Reads a whole (small) file as a NUL-terminated string. */
static fr_status slurp(const char *path, char **out)
{
    char eb[128];
    *out = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) return fr_fail(FR_EIO, "%s: cannot open: %s", path, strerror_r(errno, eb, sizeof eb));
    struct stat sb;
    char *buf = NULL;
    fr_status rc = FR_OK;
    if (fstat(fileno(fp), &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size > (64 << 20))
        rc = fr_fail(FR_EIO, "%s: not a regular file of at most 64 MiB", path);
    else if (!(buf = malloc((size_t)sb.st_size + 1)))
        rc = fr_fail(FR_ENOMEM, "%s: no memory", path);
    else if (fread(buf, 1, (size_t)sb.st_size, fp) != (size_t)sb.st_size)
        rc = fr_fail(FR_EIO, "%s: short read", path);
    fclose(fp);
    if (rc != FR_OK) {
        free(buf);
        return rc;
    }
    buf[sb.st_size] = '\0';
    *out = buf;
    return FR_OK;
}

static fr_status open_single(fr_checkpoint *c, const char *path)
{
    c->files = calloc(1, sizeof *c->files);
    if (!c->files) return fr_fail(FR_ENOMEM, "%s: no memory", path);
    fr_status rc = fr_st_file_open(path, &c->files[0]);
    if (rc != FR_OK) return rc;
    c->n_files = 1;
    int n = fr_st_file_count(c->files[0]);
    c->entries = calloc(n ? (size_t)n : 1, sizeof *c->entries);
    if (!c->entries) return fr_fail(FR_ENOMEM, "%s: no memory", path);
    for (int i = 0; i < n; i++) c->entries[i] = (ck_entry){fr_st_file_tensor(c->files[0], i), 0};
    c->n_entries = n; /* the file lists tensors in name order already */
    return FR_OK;
}

/* Shard names come from a file we do not control; keep them inside dir. */
static int plain_file_name(const char *s)
{
    return s[0] && strchr(s, '/') == NULL && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

static fr_status open_sharded(fr_checkpoint *c, const char *index_path, const cJSON *map)
{
    int n = cJSON_GetArraySize(map);
    const cJSON *e;
    cJSON_ArrayForEach(e, map)
        if (!cJSON_IsString(e) || !plain_file_name(e->valuestring))
            return fr_fail(FR_EFORMAT, "%s: weight_map entry %s must name a file in the folder",
                           index_path, e->string);

    /* The distinct shard names, sorted, so each shard is opened once and an
     * entry finds its shard by bisection. */
    char **shards = malloc((n ? (size_t)n : 1) * sizeof *shards);
    if (!shards) return fr_fail(FR_ENOMEM, "%s: no memory", index_path);
    int ns = 0;
    cJSON_ArrayForEach(e, map) shards[ns++] = e->valuestring;
    qsort(shards, (size_t)ns, sizeof *shards, cmp_str);
    int u = 0;
    for (int i = 0; i < ns; i++)
        if (u == 0 || strcmp(shards[u - 1], shards[i]) != 0) shards[u++] = shards[i];
    ns = u;

    fr_status rc = FR_OK;
    c->files = calloc(ns ? (size_t)ns : 1, sizeof *c->files);
    c->entries = calloc(n ? (size_t)n : 1, sizeof *c->entries);
    if (!c->files || !c->entries) {
        rc = fr_fail(FR_ENOMEM, "%s: no memory", index_path);
        goto done;
    }
    for (int i = 0; i < ns && rc == FR_OK; i++) {
        char *path = join(c->dir, shards[i]);
        rc = path ? fr_st_file_open(path, &c->files[i]) : fr_fail(FR_ENOMEM, "%s: no memory", index_path);
        free(path);
        if (rc == FR_OK) c->n_files++;
    }
    if (rc != FR_OK) goto done;

    cJSON_ArrayForEach(e, map) {
        char **hit = bsearch(&e->valuestring, shards, (size_t)ns, sizeof *shards, cmp_str);
        int f = (int)(hit - shards);
        const fr_st_tensor *t = fr_st_file_find(c->files[f], e->string);
        if (!t) {
            rc = fr_fail(FR_EFORMAT, "%s: tensor %s is listed in weight_map but absent from shard %s",
                         index_path, e->string, fr_st_file_path(c->files[f]));
            goto done;
        }
        c->entries[c->n_entries++] = (ck_entry){t, f};
    }
    qsort(c->entries, (size_t)c->n_entries, sizeof *c->entries, cmp_entry);
    for (int i = 1; i < c->n_entries; i++)
        if (strcmp(c->entries[i - 1].t->name, c->entries[i].t->name) == 0) {
            rc = fr_fail(FR_EFORMAT, "%s: tensor %s appears twice in weight_map", index_path,
                         c->entries[i].t->name);
            goto done;
        }
done:
    free(shards);
    return rc;
}

static fr_status open_index(fr_checkpoint *c, const char *index_path)
{
    char *text = NULL;
    fr_status rc = slurp(index_path, &text);
    if (rc != FR_OK) return rc;
    cJSON *root = cJSON_Parse(text);
    const cJSON *map = root ? cJSON_GetObjectItemCaseSensitive(root, "weight_map") : NULL;
    if (!root)
        rc = fr_fail(FR_EFORMAT, "%s: not valid JSON", index_path);
    else if (!cJSON_IsObject(map))
        rc = fr_fail(FR_EFORMAT, "%s: missing or non-object key \"weight_map\"", index_path);
    else
        rc = open_sharded(c, index_path, map);
    cJSON_Delete(root);
    free(text);
    return rc;
}

fr_status fr_checkpoint_open(const char *dir, fr_checkpoint **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_checkpoint_open: out is NULL");
    *out = NULL;
    if (!dir) return fr_fail(FR_EINVAL, "fr_checkpoint_open: dir is NULL");

    fr_checkpoint *c = calloc(1, sizeof *c);
    char *cfg_path = NULL, *index_path = NULL, *single_path = NULL;
    fr_status rc = FR_OK;
    if (!c || !(c->dir = strdup(dir)) || !(cfg_path = join(dir, "config.json")) ||
        !(index_path = join(dir, "model.safetensors.index.json")) ||
        !(single_path = join(dir, "model.safetensors"))) {
        rc = fr_fail(FR_ENOMEM, "%s: no memory", dir);
        goto done;
    }
    if ((rc = fr_model_config_load(cfg_path, &c->cfg)) != FR_OK) goto done;
    if (exists(index_path))
        rc = open_index(c, index_path);
    else if (exists(single_path))
        rc = open_single(c, single_path);
    else
        rc = fr_fail(FR_EIO, "%s: neither model.safetensors nor model.safetensors.index.json exists", dir);
done:
    free(cfg_path);
    free(index_path);
    free(single_path);
    if (rc != FR_OK) fr_checkpoint_close(&c);
    *out = c;
    return rc;
}

const fr_model_config *fr_checkpoint_config(const fr_checkpoint *c) { return c ? &c->cfg : NULL; }

static const ck_entry *lookup(const fr_checkpoint *c, const char *name)
{
    if (!c || !name || c->n_entries == 0) return NULL;
    fr_st_tensor key_t = {.name = name};
    ck_entry key = {&key_t, 0};
    return bsearch(&key, c->entries, (size_t)c->n_entries, sizeof *c->entries, cmp_entry);
}

const fr_st_tensor *fr_checkpoint_find(const fr_checkpoint *c, const char *name)
{
    const ck_entry *e = lookup(c, name);
    return e ? e->t : NULL;
}

fr_status fr_checkpoint_load_f32(const fr_checkpoint *c, const char *name, int ndim,
                                 const int64_t *shape, float *dst)
{
    if (!c || !name || !dst || ndim < 0 || ndim > FR_ST_MAX_DIMS || (ndim && !shape))
        return fr_fail(FR_EINVAL, "fr_checkpoint_load_f32: bad arguments for tensor %s", name ? name : "(null)");
    const ck_entry *e = lookup(c, name);
    if (!e) return fr_fail(FR_EFORMAT, "%s: missing tensor %s", c->dir, name);
    const fr_st_tensor *t = e->t;
    const char *file = fr_st_file_path(c->files[e->file]);

    fr_status st = fr_st_check_shape(t, file, ndim, shape);
    if (st) return st;
    if (t->dtype != FR_DTYPE_F32 && t->dtype != FR_DTYPE_F16 && t->dtype != FR_DTYPE_BF16)
        return fr_fail(FR_EUNSUPPORTED, "%s: tensor %s has dtype %s; expected F32, F16 or BF16", file,
                       name, fr_dtype_file_name(t->dtype));
    return fr_st_tensor_to_f32(t, dst, fr_st_tensor_numel(t));
}

void fr_checkpoint_close(fr_checkpoint **c)
{
    if (!c || !*c) return;
    for (int i = 0; i < (*c)->n_files; i++) fr_st_file_close(&(*c)->files[i]);
    free((*c)->files);
    free((*c)->entries);
    free((*c)->dir);
    free(*c);
    *c = NULL;
}
