"""Build a bigger tiny policy for the capacity ablation, WITHOUT editing rspo.py.

    python results/diagnosis/build_model.py runs/diag_tiny_h128_l4 --hidden 128 --layers 4

Same word-level tokenizer as rspo.py's tiny model (offline ALFWorld, default options), a randomly initialised
Llama seeded like rspo.build_tiny_model, saved with an rspo.json so `--model DIR` runs it in tiny mode
(compact prompt, constrained decoding, lr 1e-3). The directory is rebuildable, so its weights are not committed.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import rspo  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--hidden", type=int, default=128)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()

tok = rspo.build_tiny_tokenizer(rspo.tiny_vocabulary("alfworld", "offline", {}))
config = LlamaConfig(vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                     num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
                     max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
torch.manual_seed(a.seed)
model = AutoModelForCausalLM.from_config(config)
model.save_pretrained(a.out)
tok.save_pretrained(a.out)
with open(os.path.join(a.out, "rspo.json"), "w") as f:
    json.dump({"prompt": "compact", "action_mode": "constrained", "lr": 0.001}, f)
print(a.out, sum(p.numel() for p in model.parameters()), "parameters")
