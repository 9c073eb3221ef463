/* fp4rollout quant: a black-box window on the FP4 quantizers. Reads rows of D
 * little-endian float32 values and writes the dequantized rows, so tests and
 * people can check the quantizers against their own implementation. */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "attention/microscale.h"
#include "base/atomic_file.h"
#include "app/cli.h"

static const char usage_text[] =
    "usage: fp4rollout quant --format nvfp4|mxfp4 [--scale-search] [--dual] --dim D IN OUT\n"
    "\n"
    "Reads IN as rows of D little-endian float32 values, quantizes each row in\n"
    "blocks along the row (NVFP4: 16 values per E4M3 scale; MXFP4: 32 per E8M0\n"
    "scale) and writes the dequantized float32 rows to OUT.\n"
    "\n"
    "  --format F       nvfp4 or mxfp4\n"
    "  --scale-search   pick each block scale by least squared error\n"
    "                   (NVFP4: amax/6 or amax/4; MXFP4: 2^e or 2^(e+1))\n"
    "  --dual           dual-residual quantization: write q1 + q2 where\n"
    "                   q1 = Q(x) and q2 = Q(x - q1)\n"
    "  --dim D          values per row, a multiple of the block size\n"
    "\n"
    "IN's size must be a multiple of 4*D bytes. OUT is written whole or not at\n"
    "all (a temporary file renamed into place).\n";

static int quantize_file(FILE *in, FILE *out, fr_fp4_format f, int search, int dual, int d)
{
    float *x = malloc(sizeof(float) * (size_t)d * 3), *y = x ? x + d : NULL, *r = x ? y + d : NULL;
    if (!x) return fr_fail(FR_ENOMEM, "out of memory");
    fr_status st = FR_OK;
    while (!st && fread(x, sizeof(float), (size_t)d, in) == (size_t)d) {
        if (dual) {
            st = fr_fp4_quantize_dual(f, search, x, d, y, r);
            for (int i = 0; !st && i < d; i++) y[i] += r[i];
        } else {
            st = fr_fp4_fake_quantize(f, search, x, d, y);
        }
        if (!st && fwrite(y, sizeof(float), (size_t)d, out) != (size_t)d)
            st = fr_fail(FR_EIO, "write failed");
    }
    if (!st && ferror(in)) st = fr_fail(FR_EIO, "read failed");
    free(x);
    return st;
}

/* The options of this command (app/cli_args.c reads them with getopt_long). */
static const struct option own_opts[] = {
    {"format", required_argument, 0, 0}, {"scale-search", no_argument, 0, 0}, {"dual", no_argument, 0, 0},
    {"dim", required_argument, 0, 0}, {0, 0, 0, 0},
};

int fr_cli_quant(int argc, char **argv)
{
    const char *cmd = "quant", *format = NULL, *paths[2] = {0};
    int search = 0, dual = 0, d = 0, n_paths = 0;
    if (fr_cli_wants_help(argc, argv)) { fputs(usage_text, stdout); return 0; }
    if (fr_cli_args(cmd, &argc, &argv, (const struct option *const[]){own_opts, NULL})) return 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--format") == 0 && i + 1 < argc) format = argv[++i];
        else if (strcmp(a, "--scale-search") == 0) search = 1;
        else if (strcmp(a, "--dual") == 0) dual = 1;
        else if (strcmp(a, "--dim") == 0 && i + 1 < argc) {
            if (fr_cli_int(cmd, "--dim", argv[++i], 1, 1 << 24, &d)) return 2;
        } else if (a[0] == '-' && a[1]) return fr_cli_usage_error(cmd, "unknown or incomplete option '%s'", a);
        else if (n_paths < 2) paths[n_paths++] = a;
        else return fr_cli_usage_error(cmd, "unexpected argument '%s'", a);
    }
    fr_fp4_format f;
    if (!format) return fr_cli_usage_error(cmd, "--format is required");
    if (fr_fp4_format_parse(format, &f)) return fr_cli_usage_error(cmd, "%s", fr_last_error());
    if (!d) return fr_cli_usage_error(cmd, "--dim is required");
    if (d % fr_fp4_block_size(f))
        return fr_cli_usage_error(cmd, "--dim %d is not a multiple of the %s block size %d", d,
                                  format, fr_fp4_block_size(f));
    if (n_paths != 2) return fr_cli_usage_error(cmd, "expected IN and OUT paths");

    struct stat sb;
    if (stat(paths[0], &sb) != 0) {
        fprintf(stderr, "fp4rollout quant: cannot read '%s'\n", paths[0]);
        return 1;
    }
    if (sb.st_size % ((off_t)d * 4) != 0) {
        fprintf(stderr, "fp4rollout quant: '%s' has %lld bytes, not a multiple of %d (rows of %d float32)\n",
                paths[0], (long long)sb.st_size, d * 4, d);
        return 1;
    }
    FILE *in = fopen(paths[0], "rb");
    if (!in) {
        fprintf(stderr, "fp4rollout quant: cannot open '%s'\n", paths[0]);
        return 1;
    }
    fr_atomic_file out;
    fr_status st = fr_atomic_file_open(&out, paths[1]);
    if (!st) {
        st = quantize_file(in, out.f, f, search, dual, d);
        fr_status cst = fr_atomic_file_close(&out, st == FR_OK);
        if (!st) st = cst;
    }
    fclose(in);
    if (st) {
        fprintf(stderr, "fp4rollout quant: %s\n", fr_last_error());
        return 1;
    }
    return 0;
}
