/* Helpers shared by the unit tests: where test data lives, a seeded RNG, and
 * the bridge server running in the test's process. */
#ifndef FR_TEST_UTIL_H
#define FR_TEST_UTIL_H

#include <stdint.h>

#include "base/fr_status.h"
#include "rollout/engine/request.h"
#include "rollout/engine/scheduler.h"
#include "rollout/engine/session.h"
#include "trainer_bridge/protocol/protocol.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The tq6 checkpoint folder ($FR_TQ6_DIR, else ../shared/models/tq6 relative
 * to the repository root the tests run from), or NULL when it is absent. A
 * test that needs it calls fr_test_require_tq6() and is skipped with a clear
 * message when it returns NULL. */
const char *fr_test_tq6_dir(void);
const char *fr_test_require_tq6(void);
/* The same for any of the test checkpoints by folder name ("tq6", "tqm",
 * "tqa", "dsmoe", "dsmoe2"): $FR_<NAME>_DIR, else ../shared/models/<name>;
 * the DeepSeek ones, which the repository holds, else models/dsmoe/<name>.
 * The returned string is overwritten by the next call. */
const char *fr_test_model_dir(const char *name);
const char *fr_test_require_model(const char *name);

/* Removes every file in dir (no subfolders), and dir itself when remove_self. */
void fr_test_clear_dir(const char *dir, int remove_self);

/* A small deterministic generator (splitmix64) so test data is reproducible. */
typedef struct { uint64_t s; } fr_test_rng;
uint64_t fr_test_u64(fr_test_rng *r);
float fr_test_uniform(fr_test_rng *r);          /* [0, 1) */
float fr_test_normal(fr_test_rng *r);           /* N(0, 1), Box-Muller */

/* Fails the calling cmocka test unless the thread's last error message
 * (fr_last_error) holds needle. */
void fr_test_error_has(const char *needle);

/* Encodes m and decodes the bytes into *out (the caller frees it with
 * fr_msg_free), the encoded length in *len when len is not NULL; fails the
 * calling test when either fails or the type changes. */
void fr_test_round_trip(const fr_msg *m, fr_msg *out, size_t *len);

/* A copy of a scheduler's result that outlives its on_done callback: the
 * tokens, the text and the routed experts copied, the other arrays left out
 * (NULL); free it with fr_sample_result_free. */
void fr_test_keep_result(fr_sample_result *dst, const fr_sample_result *src);

/* A scheduler over s that prefills in chunks of `chunk` tokens, with the
 * default sequence limit and block reserve; fails the test when refused. */
fr_scheduler *fr_test_scheduler(fr_session *s, int chunk);

/* Engine options (rollout/engine/session.h) with the defaults but for the
 * backend, the model (NULL: the default's) and the KV dtype, which every
 * test names. */
fr_engine_opts fr_test_engine_opts(fr_backend backend, const char *model, fr_kv_dtype kv);

/* The bridge server (trainer_bridge/server/server.h) on a thread of this
 * process, bound to a free loopback port, over a CPU session of the
 * synthetic model spec with kv_blocks KV pages and max_seqs sequences;
 * greedy, max_tokens by default, its log discarded. */
typedef struct fr_test_server fr_test_server;
fr_status fr_test_server_start(const char *spec, int kv_blocks, int max_seqs, int max_tokens, fr_test_server **out);
/* The same with the session in deterministic mode when deterministic is 1
 * (docs/determinism.md). */
fr_status fr_test_server_start_det(const char *spec, int kv_blocks, int max_seqs, int max_tokens, int deterministic,
                                   fr_test_server **out);
const char *fr_test_server_endpoint(const fr_test_server *l);
/* Stops its loop and frees it; returns what the loop returned. */
fr_status fr_test_server_stop(fr_test_server **l);

#ifdef __cplusplus
}
#endif

/* Fails the test when a project call does not return FR_OK. */
#define FR_OK_OR_FAIL(call)                                                                        \
    do {                                                                                           \
        fr_status st_ = (call);                                                                    \
        if (st_ != FR_OK) fail_msg("%s: %s: %s", #call, fr_status_name(st_), fr_last_error());     \
    } while (0)

/* The main() of a test binary that needs nothing prepared before its tests:
 * FR_TEST_MAIN(group_setup, group_teardown, cmocka_unit_test(a), ...).
 * Include after <cmocka.h>. The array keeps the name `tests` because cmocka
 * prints it as the group's name. */
#define FR_TEST_MAIN(group_setup, group_teardown, ...)                       \
    int main(void)                                                           \
    {                                                                        \
        const struct CMUnitTest tests[] = {__VA_ARGS__};                     \
        return cmocka_run_group_tests(tests, group_setup, group_teardown);   \
    }

/* The main() of a test binary that runs on every rank of an MPI world (the
 * fr_mpi_world pointer `world`, comm/mpi_world.h, made here): it exits 1 on
 * every rank when the tests failed on any. */
#define FR_MPI_TEST_MAIN(world, group_setup, group_teardown, ...)                     \
    int main(int argc, char **argv)                                                   \
    {                                                                                 \
        if (fr_mpi_world_init(&argc, &argv, &world)) {                                \
            fprintf(stderr, "%s: %s\n", argv[0], fr_last_error());                    \
            return 1;                                                                 \
        }                                                                             \
        const struct CMUnitTest tests[] = {__VA_ARGS__};                              \
        int failed = cmocka_run_group_tests(tests, group_setup, group_teardown);      \
        int any = failed;                                                             \
        MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, world->comm);               \
        fr_mpi_world_finalize(&world);                                                \
        return any ? 1 : 0;                                                           \
    }

#endif
