"""Screen (issue 13): which tiny model, or which order of the compact prompt, learns fastest from the
demonstrations? The main settings' imitation (1,000 searching-demonstrator episodes, Adam lr 1e-3, minibatches of
128 steps, seed 0), evaluated after every epoch on all of valid_seen and valid_unseen (rspo.evaluate, T = 0.4);
WebShop variants (ws_*) on its 256 test tasks (10 steps). No RL. Each variant replaces rspo.build_tiny_model (or
the compact template, or the tokenizer) in this process only.

    python results/diagnosis/model_screen.py h64 --epochs 6      # the tiny model before 2026-12-02 (hidden 64)
    python results/diagnosis/model_screen.py h128 --epochs 4     # rspo.py's tiny model since then
    python results/diagnosis/model_screen.py ws_h128_lower --epochs 3   # WebShop, a lower-cased vocabulary
    python results/diagnosis/model_screen.py ws_h128_alias --epochs 3   # WebShop, results named item1, item2, ...
    python results/diagnosis/model_screen.py ws_h128_alias --epochs 8 --demos 3000   # more demonstrations
    python results/diagnosis/model_screen.py ws_h128_alias --epochs 4 --minibatch-size 32   # any rspo.py flag
    python results/diagnosis/model_screen.py ws_h128_copy_alias --epochs 4   # a copy term in the output (--copy-term)

One JSON line per run to model_screen.jsonl: the variant, its parameters, the number of demonstrations, and per
epoch the token-mean NLL, held-out success on both splits, seconds since the demonstrations were played, and
`demo_prob`: the policy's mean probability (T = 1, under the decoding constraint) of the demonstrator's action on
the demonstrator's own held-out episodes (the first held-out split's first 256 tasks), by the kind of step
(failures.step_kind) -- which decision the imitation has learned, without sampling.
"""
import argparse
import json
import os
import random
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import failures  # noqa: E402  (this folder: its lower-cased tokenizer)
import rspo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# name -> (architecture, hidden, layers, heads, compact template or None for rspo.py's)
VARIANTS = {
    "h64": ("llama", 64, 2, 4, None),
    "h64_gpt2": ("gpt2", 64, 2, 4, None),   # learned absolute positions instead of RoPE
    "h64_task_both": ("llama", 64, 2, 4, "task : {task} . history : {history} . observation : {obs} . task : {task}"),
    "h64_task_last": ("llama", 64, 2, 4, "history : {history} . observation : {obs} . task : {task}"),
    "h64_heads8": ("llama", 64, 2, 8, None),
    "h64_layers3": ("llama", 64, 3, 4, None),
    "h128": ("llama", 128, 2, 4, None),
    "ws_h128": ("llama", 128, 2, 4, None),
    # one word for the page's 'B0NKJW8DEX' and the click's 'b0nkjw8dex' (failures.py's lower-cased tokenizer)
    "ws_h128_lower": ("llama", 128, 2, 4, None),
    # the policy sees and clicks a results page's products as item1, item2, ... (envs.PositionNamedResults)
    "ws_h128_alias": ("llama", 128, 2, 4, None),
    # a pointer-style copy term in the output (rspo.py's --copy-term; the earlier rows ran a monkeypatch of the same
    # computation, copy_bias in 6b33a7b): WebShop with the same rendering, and ALFWorld
    "ws_h128_copy_alias": ("llama", 128, 2, 4, None),
    "h128_copy": ("llama", 128, 2, 4, None),
    # wider, or deeper, with the same rendering: is the option copy a matter of capacity?
    "ws_h256_alias": ("llama", 256, 2, 4, None),
    "ws_h128_l4_alias": ("llama", 128, 4, 4, None),
}


def clicked(action):
    """What a WebShop action clicks ('click[x]' -> 'x'), or None for any other action."""
    return action[len("click["):-1] if action.startswith("click[") else None


def builder(arch, hidden, layers, heads):
    """rspo.build_tiny_model with another size or architecture (FFN 4 x hidden, tied embeddings, seeded alike)."""
    def build(vocab_size, tok, seed):
        from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
        special = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       tie_word_embeddings=True)
        if arch == "llama":
            config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden,
                                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                 max_position_embeddings=1024, **special)
        else:
            config = GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=1024,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **special)
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)
    return build


def step_probs(policy, steps, chunk):
    """The policy's probability of each step's recorded response in its state (T = 1, the decoding constraint)."""
    policy.agent.eval()
    with torch.no_grad():
        return [p for i in range(0, len(steps), chunk)
                for p in policy.forward(steps[i:i + chunk], 1.0)[0].sum(-1).exp().tolist()]


def demo_prob(policy, steps, cfg):
    """Mean probability the policy gives the demonstrator's action, by the kind of step, at T = 1."""
    by_kind = {}
    for s, p in zip(steps, step_probs(policy, steps, cfg.micro_batch_size)):
        by_kind.setdefault(failures.step_kind(cfg.env, s.action), []).append(p)
    return {k: round(float(np.mean(v)), 3) for k, v in sorted(by_kind.items())}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("variant", choices=sorted(VARIANTS))
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--demos", type=int, default=1000, help="demonstration episodes (rspo.py's --warm-start)")
    args, rspo_flags = p.parse_known_args()   # any other flag goes to rspo.py's parser (e.g. --minibatch-size 32)
    arch, hidden, layers, heads, template = VARIANTS[args.variant]
    rspo.build_tiny_model = builder(arch, hidden, layers, heads)
    if template:
        rspo.COMPACT_TEMPLATE = template
    if args.variant.endswith("_lower"):
        failures.lowercase_tokenizer()
    env = (["--env", "webshop", "--max-steps", "10", "--eval-episodes", "256", "--eval-split", "test"]
           if args.variant.startswith("ws_") else
           ["--env", "alfworld", "--eval-episodes", "140", "--eval-split", "valid_seen,valid_unseen"])
    cfg = rspo.validate(rspo.build_parser().parse_args(
        [*env, "--seed", str(args.seed), "--method", "outcome", "--warm-start", str(args.demos), "--no-progress",
         *(["--env-options", '{"results_names": "position"}'] if "_alias" in args.variant else []),
         *(["--copy-term"] if "_copy" in args.variant else []), *rspo_flags]))
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    policy = rspo.build_policy(cfg, torch.device("cpu"))
    start = time.time()
    # rspo.warm_start's data, optimizer, minibatches and RNG stream, with an evaluation after every epoch
    trajs = rspo.rollout(policy, cfg, range(cfg.warm_start), group_size=1,
                         act=rspo.expert_actor(policy, 0.0, None, searching=True))
    steps = [s for t in trajs for s in t.steps]
    held = [s for t in rspo.rollout(policy, cfg, range(256), cfg.eval_split.split(",")[0], group_size=1,
                                    act=rspo.expert_actor(policy, 0.0, None, searching=True)) for s in t.steps]
    optimizer = torch.optim.Adam(policy.agent.parameters(), lr=cfg.warm_start_lr)
    generator, lengths, curve = torch.Generator().manual_seed(cfg.seed + 40_000), rspo.sequence_lengths(steps), []
    for epoch in range(1, args.epochs + 1):
        policy.agent.train()
        nll = []
        for mb in rspo.minibatches(len(steps), cfg.minibatch_size, 1, generator):
            tokens, loss = sum(len(steps[j].response_ids) for j in mb), 0.0
            for idx in rspo.length_sorted_chunks(mb, lengths, cfg.micro_batch_size):
                logp, mask, _, _ = policy.forward([steps[j] for j in idx], 1.0)
                part = rspo.imitation_loss(logp, mask) * (mask.sum().item() / tokens)
                part.backward()
                loss += float(part.detach())
            rspo.optimizer_step(policy, optimizer, cfg)
            nll.append(loss)
        ev = rspo.evaluate(policy, cfg)
        success = {split: ev[f"{'eval' if i == 0 else 'eval_' + split}/success"]   # rspo.evaluate's keys
                   for i, split in enumerate(cfg.eval_split.split(","))}
        curve.append({"epoch": epoch, "nll": float(np.mean(nll)), **success, "score": ev["eval/score"],
                      "seconds": time.time() - start, "demo_prob": demo_prob(policy, held, cfg),
                      **({"copy_w": policy.agent.copy_weight.item()} if cfg.copy_term else {})})
        print(args.variant, curve[-1], flush=True)
    with open(os.path.join(HERE, "model_screen.jsonl"), "a") as f:
        f.write(json.dumps({"variant": args.variant, "seed": args.seed, "demos": args.demos, "flags": rspo_flags,
                            "parameters": sum(q.numel() for q in policy.agent.lm.parameters()), "curve": curve}) + "\n")


if __name__ == "__main__":
    main()
