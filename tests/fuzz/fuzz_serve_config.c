/* libFuzzer target: the serve configuration parser
 * (app/serve_config.h, fr_serve_config_parse) on arbitrary text.
 *
 * The input is handed over as it is, without a NUL. A refused text must
 * leave the configuration unchanged, byte for byte; an accepted one must
 * print as JSON (fr_serve_config_to_json) that parses back to a
 * configuration printing the same text again, and must give engine
 * options that point into it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "app/serve_config.h"
#include "tests/fuzz/fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static fr_serve_config c, before;
    fr_serve_config_default(&c);
    memcpy(&before, &c, sizeof c);
    fr_status st = fr_serve_config_parse((const char *)data, size, "fuzz.json", &c);
    if (st != FR_OK) {
        FUZZ_CHECK(st == FR_EFORMAT || st == FR_EINVAL || st == FR_EUNSUPPORTED || st == FR_ENOMEM, "status %d",
                   (int)st);
        FUZZ_CHECK(memcmp(&c, &before, sizeof c) == 0, "a refused text changed the configuration");
        FUZZ_CHECK(fr_last_error()[0] != '\0', "a refused text left no message");
        return 0;
    }
    FUZZ_CHECK(memchr(c.model, '\0', sizeof c.model) && memchr(c.calib, '\0', sizeof c.calib) &&
                   memchr(c.coordinator.bind, '\0', sizeof c.coordinator.bind),
               "a string is not terminated");
    FUZZ_CHECK(c.sampling.n_stop >= 0 && c.sampling.n_stop <= FR_SERVE_MAX_STOP_IDS, "n_stop %d",
               c.sampling.n_stop);

    fr_engine_opts o;
    fr_serve_config_engine_opts(&c, &o);
    FUZZ_CHECK(o.model == c.model && o.tp == c.tp && o.chunk == c.chunk, "engine options do not match");
    FUZZ_CHECK(o.calib == NULL || o.calib == c.calib, "engine options: calib");

    /* Print, parse the print over the defaults, print again. */
    char *once = NULL, *twice = NULL;
    st = fr_serve_config_to_json(&c, &once);
    FUZZ_CHECK(st == FR_OK && once, "an accepted configuration does not print: %s", fr_last_error());
    static fr_serve_config back;
    fr_serve_config_default(&back);
    st = fr_serve_config_parse(once, strlen(once), "printed.json", &back);
    FUZZ_CHECK(st == FR_OK, "the printed configuration is refused: %s\n%s", fr_last_error(), once);
    st = fr_serve_config_to_json(&back, &twice);
    FUZZ_CHECK(st == FR_OK && twice, "the reparsed configuration does not print: %s", fr_last_error());
    FUZZ_CHECK(strcmp(once, twice) == 0, "printing is not stable:\n%s\n---\n%s", once, twice);
    free(once);
    free(twice);
    return 0;
}
