/* The calibration file (`fp4rollout calibrate` writes it, `--calib` reads it):
 * a safetensors file beside the model with
 *   key_mean    F32 [layers][kv_heads][head_dim]  post-RoPE key mean (Appendix B)
 *   tau         F32 [1]                           P threshold (Appendix C), optional
 *   fp8_scales  F32 [layers][kv_heads][2]         FP8 K and V scales, optional
 */
#ifndef FR_CALIB_FILE_H
#define FR_CALIB_FILE_H

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The shape the tables are checked against: the model's layers, KV heads
 * and head dimension (fr_model_calib_dims in rollout/model/model_config.h). */
typedef struct {
    int layers, kv_heads, head_dim;
} fr_calib_dims;

typedef struct {
    float *key_mean;     /* [layers][kv_heads][d] */
    float tau;           /* FR_P_TAU when absent */
    int has_tau;
    float *fp8_scales;   /* NULL when absent */
} fr_calib;

/* Loads and checks shapes against the model's dims, tau in (0, 6), a finite
 * key mean and positive finite FP8 scales. */
fr_status fr_calib_load(const char *path, fr_calib_dims dims, fr_calib *out);
/* Writes key_mean, tau and (when non-NULL) fp8_scales, whole or not at all;
 * refuses what fr_calib_load would refuse. Little-endian hosts. */
fr_status fr_calib_save(const char *path, fr_calib_dims dims, const fr_calib *c);
void fr_calib_free(fr_calib *c);

#ifdef __cplusplus
}
#endif

#endif
