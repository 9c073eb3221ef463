/* fp4rollout quant: a black-box window on the FP4 quantizers. Reads rows of D
 * little-endian float32 values and writes the dequantized rows, so tests and
 * people can check the quantizers against their own implementation. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "attention/microscale.h"
#include "base/atomic_file.h"
#include "app/cli.h"

const char fr_quant_usage[] =
    "usage: fp4rollout quant --format nvfp4|mxfp4 [--scale-search] [--dual] --dim D IN OUT\n"
    "\n"
    "Reads IN as rows of D little-endian float32 values, quantizes each row in\n"
    "blocks along the row (NVFP4: 16 values per E4M3 scale; MXFP4: 32 per E8M0\n"
    "scale) and writes the dequantized float32 rows to OUT.\n"
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

int fr_cli_quant(const fr_cli_values *v)
{
    const fr_cmd cmd = FR_CMD_QUANT;
    const fr_fp4_format f = (fr_fp4_format)fr_opt_int(v, FR_O_FORMAT);
    const int d = fr_opt_int(v, FR_O_DIM);
    if (d % fr_fp4_block_size(f))
        return fr_cli_usage_error(cmd, "--dim %d is not a multiple of the %s block size %d", d, fr_fp4_format_name(f),
                                  fr_fp4_block_size(f));
    if (v->n_operands != 2) return fr_cli_usage_error(cmd, "expected IN and OUT paths");
    const char *in_path = v->operands[0], *out_path = v->operands[1];
    struct stat sb;
    if (stat(in_path, &sb) != 0) {
        fprintf(stderr, "fp4rollout quant: cannot read '%s': %s\n", in_path, strerror(errno));
        return 1;
    }
    if (sb.st_size % ((off_t)d * 4) != 0) {
        fprintf(stderr, "fp4rollout quant: '%s' has %lld bytes, not a multiple of %d (rows of %d float32)\n",
                in_path, (long long)sb.st_size, d * 4, d);
        return 1;
    }
    FILE *in = fopen(in_path, "rb");
    if (!in) {
        fprintf(stderr, "fp4rollout quant: cannot open '%s': %s\n", in_path, strerror(errno));
        return 1;
    }
    fr_atomic_file out;
    fr_status st = fr_atomic_file_open(&out, out_path);
    if (!st) {
        st = quantize_file(in, out.f, f, fr_opt_int(v, FR_O_SCALE_SEARCH), fr_opt_int(v, FR_O_DUAL), d);
        fr_status cst = fr_atomic_file_close(&out, st == FR_OK);
        if (!st) st = cst;
    }
    fclose(in);
    return st ? fr_cli_fail(cmd, 1) : 0;
}
