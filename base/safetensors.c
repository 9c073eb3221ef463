#include "base/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

size_t fr_st_tensor_numel(const fr_st_tensor *t)
{
    size_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
    return n;
}

void fr_st_shape_str(char *buf, size_t size, int ndim, const int64_t *shape)
{
    if (!size) return;
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (used < size) snprintf(buf + used, size - used, "]");
}

/* ---- header parsing ------------------------------------------------------- */

#define ST_MAX_HEADER_BYTES 100000000

struct fr_st_header {
    int n;
    fr_st_tensor *tensors; /* sorted by name, so lookups can bisect */
    char *names;        /* one block holding every name */
};

/* cJSON keeps numbers as doubles; below 2^53 every integer is exact, and no
 * real offset or dimension comes near it. */
static int json_u64(const cJSON *v, uint64_t *out)
{
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!(d >= 0.0 && d <= 9007199254740992.0)) return 0; /* also rejects NaN */
    uint64_t u = (uint64_t)d;
    if ((double)u != d) return 0;
    *out = u;
    return 1;
}

/* Fills t from one header entry; data_len bounds the offsets. */
static fr_status parse_entry(const cJSON *e, const char *label, const char *name,
                             const uint8_t *data, uint64_t data_len, fr_st_tensor *t)
{
    if (!cJSON_IsObject(e))
        return fr_fail(FR_EFORMAT, "%s: tensor %s: entry is not a JSON object", label, name);

    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    if (!cJSON_IsString(dt))
        return fr_fail(FR_EFORMAT, "%s: tensor %s: missing or non-string \"dtype\"", label, name);
    if (!fr_dtype_from_file_name(dt->valuestring, strlen(dt->valuestring), &t->dtype))
        return fr_fail(FR_EFORMAT, "%s: tensor %s: unknown dtype \"%s\"", label, name,
                       dt->valuestring);

    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(e, "shape");
    if (!cJSON_IsArray(shape))
        return fr_fail(FR_EFORMAT, "%s: tensor %s: missing or non-array \"shape\"", label, name);
    int ndim = cJSON_GetArraySize(shape);
    if (ndim > FR_ST_MAX_DIMS)
        return fr_fail(FR_EUNSUPPORTED, "%s: tensor %s: %d dimensions, at most %d supported",
                       label, name, ndim, FR_ST_MAX_DIMS);
    /* Multiply with overflow checks: a hostile shape must not wrap into a
     * small byte count that then passes the size check. */
    size_t nbytes = fr_dtype_size(t->dtype);
    int i = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, shape) {
        uint64_t v;
        if (!json_u64(d, &v))
            return fr_fail(FR_EFORMAT, "%s: tensor %s: shape[%d] is not a non-negative integer",
                           label, name, i);
        if (__builtin_mul_overflow(nbytes, v, &nbytes))
            return fr_fail(FR_EFORMAT, "%s: tensor %s: shape overflows the size arithmetic",
                           label, name);
        t->shape[i++] = (int64_t)v;
    }
    t->ndim = ndim;

    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    uint64_t begin, end;
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 ||
        !json_u64(cJSON_GetArrayItem(offs, 0), &begin) ||
        !json_u64(cJSON_GetArrayItem(offs, 1), &end))
        return fr_fail(FR_EFORMAT,
                       "%s: tensor %s: \"data_offsets\" must be [begin, end] of non-negative integers",
                       label, name);
    if (begin > end || end > data_len)
        return fr_fail(FR_EFORMAT,
                       "%s: tensor %s: data_offsets [%llu, %llu] out of range of the %llu-byte data region",
                       label, name, (unsigned long long)begin, (unsigned long long)end,
                       (unsigned long long)data_len);
    if (end - begin != nbytes) {
        char dims[200];
        fr_st_shape_str(dims, sizeof dims, t->ndim, t->shape);
        return fr_fail(FR_EFORMAT, "%s: tensor %s: data_offsets span %llu bytes, but %s %s needs %zu",
                       label, name, (unsigned long long)(end - begin), fr_dtype_file_name(t->dtype), dims,
                       nbytes);
    }
    t->nbytes = nbytes;
    t->data = data + begin;
    return FR_OK;
}

static int cmp_tensor(const void *a, const void *b)
{
    return strcmp(((const fr_st_tensor *)a)->name, ((const fr_st_tensor *)b)->name);
}

static int is_json_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

void fr_st_header_free(fr_st_header **h)
{
    if (!h || !*h) return;
    free((*h)->tensors);
    free((*h)->names);
    free(*h);
    *h = NULL;
}

fr_status fr_st_parse_header(const uint8_t *buf, size_t len, const char *label, fr_st_header **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_st_parse_header: out is NULL");
    *out = NULL;
    if (!label) label = "<memory>";
    if (!buf && len) return fr_fail(FR_EINVAL, "%s: buffer is NULL", label);
    if (len < 8)
        return fr_fail(FR_EFORMAT, "%s: truncated: %zu bytes, a safetensors file needs at least 8",
                       label, len);

    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)buf[i] << (8 * i);
    /* The reference implementation's cap; it also bounds the header copy a
     * hostile length could otherwise make us allocate. */
    if (hlen > ST_MAX_HEADER_BYTES)
        return fr_fail(FR_EFORMAT, "%s: header length %llu exceeds the %d-byte limit", label,
                       (unsigned long long)hlen, ST_MAX_HEADER_BYTES);
    if (hlen > len - 8)
        return fr_fail(FR_EFORMAT, "%s: header length %llu runs past the end of the %zu-byte file",
                       label, (unsigned long long)hlen, len);
    if (hlen == 0) return fr_fail(FR_EFORMAT, "%s: empty JSON header", label);

    /* cJSON wants a NUL-terminated string; the header in the file has none. */
    char *text = malloc((size_t)hlen + 1);
    if (!text) return fr_fail(FR_ENOMEM, "%s: no memory for a %llu-byte header", label,
                              (unsigned long long)hlen);
    memcpy(text, buf + 8, (size_t)hlen);
    text[hlen] = '\0';

    fr_status rc = FR_OK;
    fr_st_header *h = NULL;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(text, &end, 0);
    if (!root) {
        rc = fr_fail(FR_EFORMAT, "%s: header is not valid JSON (error near byte %td)", label,
                     end ? end - text : (ptrdiff_t)0);
        goto done;
    }
    /* The format pads the header with spaces; anything else after the JSON
     * (an embedded NUL included) means a corrupt header. */
    for (const char *p = end; p < text + hlen; p++)
        if (!is_json_space(*p)) {
            rc = fr_fail(FR_EFORMAT, "%s: unexpected bytes after the JSON header at byte %td",
                         label, p - text);
            goto done;
        }
    if (!cJSON_IsObject(root)) {
        rc = fr_fail(FR_EFORMAT, "%s: header is not a JSON object", label);
        goto done;
    }

    int n = 0;
    size_t names_len = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, root) {
        if (strcmp(e->string, "__metadata__") == 0) continue; /* free-form strings */
        n++;
        names_len += strlen(e->string) + 1;
    }

    h = calloc(1, sizeof *h);
    if (h) h->tensors = calloc(n ? (size_t)n : 1, sizeof *h->tensors);
    if (h) h->names = malloc(names_len ? names_len : 1);
    if (!h || !h->tensors || !h->names) {
        rc = fr_fail(FR_ENOMEM, "%s: no memory for %d tensor entries", label, n);
        goto done;
    }

    const uint8_t *data = buf + 8 + hlen;
    uint64_t data_len = len - 8 - hlen;
    char *np = h->names;
    cJSON_ArrayForEach(e, root) {
        if (strcmp(e->string, "__metadata__") == 0) continue;
        fr_st_tensor *t = &h->tensors[h->n];
        size_t nl = strlen(e->string) + 1;
        memcpy(np, e->string, nl);
        t->name = np;
        np += nl;
        rc = parse_entry(e, label, t->name, data, data_len, t);
        if (rc != FR_OK) goto done;
        h->n++;
    }

    /* cJSON keeps repeated keys, so duplicates surface as neighbours here. */
    qsort(h->tensors, (size_t)h->n, sizeof *h->tensors, cmp_tensor);
    for (int i = 1; i < h->n; i++)
        if (strcmp(h->tensors[i - 1].name, h->tensors[i].name) == 0) {
            rc = fr_fail(FR_EFORMAT, "%s: duplicate tensor name %s", label, h->tensors[i].name);
            goto done;
        }

done:
    cJSON_Delete(root);
    free(text);
    if (rc != FR_OK) fr_st_header_free(&h);
    *out = h;
    return rc;
}

int fr_st_header_count(const fr_st_header *h) { return h ? h->n : 0; }

const fr_st_tensor *fr_st_header_tensor(const fr_st_header *h, int i)
{
    return h && i >= 0 && i < h->n ? &h->tensors[i] : NULL;
}

static int cmp_key(const void *key, const void *elem)
{
    return strcmp((const char *)key, ((const fr_st_tensor *)elem)->name);
}

const fr_st_tensor *fr_st_header_find(const fr_st_header *h, const char *name)
{
    if (!h || !name || h->n == 0) return NULL;
    return bsearch(name, h->tensors, (size_t)h->n, sizeof *h->tensors, cmp_key);
}

/* ---- mapped files ------------------------------------------------------------ */

struct fr_st_file {
    fr_st_header *hdr;
    void *map;
    size_t map_len;
    char *path;
};

fr_status fr_st_file_open(const char *path, fr_st_file **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_st_file_open: out is NULL");
    *out = NULL;
    if (!path) return fr_fail(FR_EINVAL, "fr_st_file_open: path is NULL");

    char eb[128];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return fr_fail(FR_EIO, "%s: cannot open: %s", path, strerror_r(errno, eb, sizeof eb));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return fr_fail(FR_EIO, "%s: not a readable regular file", path);
    }

    fr_st_file *f = calloc(1, sizeof *f);
    char *p = strdup(path);
    if (!f || !p) {
        close(fd);
        free(f);
        free(p);
        return fr_fail(FR_ENOMEM, "%s: no memory", path);
    }
    f->path = p;
    f->map_len = (size_t)sb.st_size;
    /* mmap refuses length 0; an empty file goes to the parser as an empty
     * image so it reports the same "truncated" message as any short file. */
    if (f->map_len > 0) {
        f->map = mmap(NULL, f->map_len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (f->map == MAP_FAILED) {
            f->map = NULL;
            fr_status rc = fr_fail(FR_EIO, "%s: mmap failed: %s", path,
                                   strerror_r(errno, eb, sizeof eb));
            close(fd);
            fr_st_file_close(&f);
            return rc;
        }
    }
    close(fd); /* the mapping stays valid without the descriptor */

    fr_status rc = fr_st_parse_header(f->map ? f->map : (const void *)"", f->map_len, path, &f->hdr);
    if (rc != FR_OK) {
        fr_st_file_close(&f);
        return rc;
    }
    *out = f;
    return FR_OK;
}

const char *fr_st_file_path(const fr_st_file *f) { return f ? f->path : NULL; }
int fr_st_file_count(const fr_st_file *f) { return f ? fr_st_header_count(f->hdr) : 0; }
const fr_st_tensor *fr_st_file_tensor(const fr_st_file *f, int i) { return f ? fr_st_header_tensor(f->hdr, i) : NULL; }
const fr_st_tensor *fr_st_file_find(const fr_st_file *f, const char *name)
{
    return f ? fr_st_header_find(f->hdr, name) : NULL;
}

void fr_st_file_close(fr_st_file **f)
{
    if (!f || !*f) return;
    fr_st_header_free(&(*f)->hdr);
    if ((*f)->map) munmap((*f)->map, (*f)->map_len);
    free((*f)->path);
    free(*f);
    *f = NULL;
}

/* ---- conversion --------------------------------------------------------------- */

static float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {
        /* Zero or subnormal: mant * 2^-24 is exact in float32, and negating
         * keeps -0 distinct. */
        float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (mant << 13)); /* inf; NaN keeps its payload */
    return f32_from_bits(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

fr_status fr_st_tensor_to_f32(const fr_st_tensor *t, float *dst, size_t n_elems)
{
    if (!t) return fr_fail(FR_EINVAL, "fr_st_tensor_to_f32: tensor is NULL");
    size_t n = fr_st_tensor_numel(t);
    if (n_elems != n)
        return fr_fail(FR_EINVAL, "tensor %s has %zu elements, caller expected %zu", t->name, n,
                       n_elems);
    if (n && !dst) return fr_fail(FR_EINVAL, "tensor %s: destination is NULL", t->name);

    /* Assemble each value from bytes: the data is little-endian and unaligned
     * by format, and this reads it correctly on any host. */
    const uint8_t *p = t->data;
    switch (t->dtype) {
    case FR_DTYPE_F32:
        for (size_t i = 0; i < n; i++, p += 4)
            dst[i] = f32_from_bits((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                                   (uint32_t)p[3] << 24);
        return FR_OK;
    case FR_DTYPE_BF16: /* bfloat16 is the top half of a float32 */
        for (size_t i = 0; i < n; i++, p += 2)
            dst[i] = f32_from_bits(((uint32_t)p[0] | (uint32_t)p[1] << 8) << 16);
        return FR_OK;
    case FR_DTYPE_F16:
        for (size_t i = 0; i < n; i++, p += 2) dst[i] = f16_to_f32((uint16_t)(p[0] | p[1] << 8));
        return FR_OK;
    default:
        return fr_fail(FR_EUNSUPPORTED, "tensor %s has dtype %s; only F32, F16 and BF16 convert to float32",
                       t->name, fr_dtype_file_name(t->dtype));
    }
}

fr_status fr_st_check_shape(const fr_st_tensor *t, const char *file, int ndim, const int64_t *shape)
{
    int same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (same) return FR_OK;
    char have[200], want[200];
    fr_st_shape_str(have, sizeof have, t->ndim, t->shape);
    fr_st_shape_str(want, sizeof want, ndim, shape);
    return fr_fail(FR_EFORMAT, "%s: tensor %s has shape %s, expected %s", file, t->name, have, want);
}
