"""How far transformers' own bfloat16 run of tq6 is from the float32 golden logits.

The CUDA engine runs the model with BF16 weights and activations; its logits
are judged against how far transformers' Qwen3ForCausalLM in bfloat16, on the
same GPU, lands from the float32 reference (golden.safetensors). This script
writes that figure, one line per prompt: "p<N> <max |diff|> <mean |diff|>
<max |golden|>", for tests/gpu/test_engine_gpu.c to read through
$FR_HF_BF16_STATS.

usage: python3 hf_bf16_reference.py TQ6_DIR OUT_FILE
"""
import sys

import torch
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 2 if len(sys.argv) != 2 else 0
    model_dir, out_path = sys.argv[1], sys.argv[2]
    golden = load_file(f"{model_dir}/golden.safetensors")
    model = Qwen3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.to("cuda").eval()
    lines = []
    with torch.no_grad():
        for p in range(7):
            ids = golden[f"p{p}.ids"].to(torch.long).unsqueeze(0).to("cuda")
            ref = golden[f"p{p}.logits_f32"].to("cuda")
            got = model(ids).logits[0].float()
            diff = (got - ref).abs()
            line = f"p{p} {diff.max().item():.6g} {diff.mean().item():.6g} {ref.abs().max().item():.6g}"
            print("transformers bf16 vs golden f32:", line, flush=True)
            lines.append(line)
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
