/* fp4rollout: entry point; dispatches to the subcommands in cli_*.c. */
#include <stdio.h>
#include <string.h>

#include "app/cli.h"

static const fr_cli_command commands[] = {
    {"quant", "quantize float32 rows to NVFP4/MXFP4 and write them back dequantized", fr_cli_quant},
    {"generate", "sample continuations of a prompt (n samples, log-probs, JSON lines)", fr_cli_generate},
    {"rollout", "run a file of prompts through the continuous-batching scheduler (JSON lines)", fr_cli_rollout},
    {"serve", "serve rollouts to trainers over ZeroMQ (docs/protocol.md), one engine", fr_cli_serve},
    {"score", "write the logits at every prompt position (prefill or decode path)", fr_cli_score},
    {"calibrate", "measure the key mean, tau and FP8 scales of a model (paper Appendices B, C)", fr_cli_calibrate},
    {"eval-kl", "teacher-forced KL of KV cache configurations against BF16 KV (Appendix A)", fr_cli_eval_kl},
    {"dashboard", "serve the divergence dashboard of a finished run from its metrics_log", fr_cli_dashboard},
    {"demo", "print the quantization error table of every format on a demo tensor", fr_cli_demo},
    {"tokenize", "encode a text with a Hugging Face tokenizer.json (JSON line of ids)", fr_cli_tokenize},
    {"detokenize", "decode token ids with a Hugging Face tokenizer.json", fr_cli_detokenize},
};
enum { N_COMMANDS = sizeof commands / sizeof commands[0] };

static void usage(FILE *out)
{
    fprintf(out, "usage: fp4rollout COMMAND [options]   (fp4rollout COMMAND --help for details)\n"
                 "       fp4rollout --version\n\n"
                 "An RL rollout engine with a 4-bit microscaling KV cache.\n"
                 "Options take '--opt value' or '--opt=value'; every command takes --log-level\n"
                 "(debug, info, warn, error, off). Exit status: 0 done, 1 failed, 2 usage error.\n\n"
                 "commands:\n");
    for (int i = 0; i < N_COMMANDS; i++) fprintf(out, "  %-10s %s\n", commands[i].name, commands[i].summary);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "version") == 0) {
        printf("fp4rollout %s\n", FR_VERSION);
        return 0;
    }
    if (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return 0;
    }
    for (int i = 0; i < N_COMMANDS; i++)
        if (strcmp(argv[1], commands[i].name) == 0) {
            int rc = commands[i].run(argc - 1, argv + 1);
            fr_cli_args_release();
            return rc;
        }
    fprintf(stderr, "fp4rollout: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
