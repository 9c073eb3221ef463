/* fp4rollout's commands: name, option set, summary, --help text and
 * function; main dispatches on it and the option table's test reads
 * every command's --help from it. */
#include "app/cli.h"

const fr_cli_command fr_cli_commands[] = {
    {"quant", FR_CMD_QUANT, "quantize float32 rows to NVFP4/MXFP4 and write them back dequantized", fr_quant_usage,
     fr_cli_quant},
    {"generate", FR_CMD_GENERATE, "sample continuations of a prompt (n samples, log-probs, JSON lines)",
     fr_generate_usage, fr_cli_generate},
    {"rollout", FR_CMD_ROLLOUT, "run a file of prompts through the continuous-batching scheduler (JSON lines)",
     fr_rollout_usage, fr_cli_rollout},
    {"serve", FR_CMD_SERVE, "serve rollouts to trainers over ZeroMQ (docs/protocol.md), one engine", fr_serve_usage,
     fr_cli_serve},
    {"score", FR_CMD_SCORE, "write the logits at every prompt position (prefill or decode path)", fr_score_usage,
     fr_cli_score},
    {"calibrate", FR_CMD_CALIBRATE, "measure the key mean, tau and FP8 scales of a model (paper Appendices B, C)",
     fr_calibrate_usage, fr_cli_calibrate},
    {"eval-kl", FR_CMD_EVAL_KL, "teacher-forced KL of KV cache configurations against BF16 KV (Appendix A)",
     fr_eval_kl_usage, fr_cli_eval_kl},
    {"eval-task", FR_CMD_EVAL_TASK, "exact-match task accuracy of KV cache configurations, with paired tests",
     fr_eval_task_usage, fr_cli_eval_task},
    {"dashboard", FR_CMD_DASHBOARD, "serve the divergence dashboard of a finished run from its metrics_log",
     fr_dashboard_usage, fr_cli_dashboard},
    {"demo", FR_CMD_DEMO, "print the quantization error table of every format on a demo tensor", fr_demo_usage,
     fr_cli_demo},
    {"tokenize", FR_CMD_TOKENIZE, "encode a text with a Hugging Face tokenizer.json (JSON line of ids)",
     fr_tokenize_usage, fr_cli_tokenize},
    {"detokenize", FR_CMD_DETOKENIZE, "decode token ids with a Hugging Face tokenizer.json", fr_detokenize_usage,
     fr_cli_detokenize},
};
const int fr_cli_n_commands = (int)(sizeof fr_cli_commands / sizeof fr_cli_commands[0]);
