"""Probe (issue 13, "carry a word of the context into the action"): the warm start's imitation with the object
words of each demonstration step consistently renamed at random, so that which object to take can only be read
from the step's own text, never memorised per task. Warm start only, no RL; rspo.py is not changed.

    python results/diagnosis/copy_augment.py --share 0.5 [--seed 0] [--epochs 3]

Everything else is rspo.warm_start (the same 1000 searching-demonstrator episodes of the main settings, the same
Adam, minibatches, chunking and RNG streams): --share 0 trains exactly as the warm start does. With probability
--share a step is rewritten (a fresh permutation of the object words that the demonstrations ever take, applied to
its prompt, its response and its admissible actions, the constraint its log-probs are taken under). The held-out
panel is rspo.evaluate's (valid_seen and valid_unseen, T = 0.4). One JSON line per run to copy_augment.jsonl.
"""
import argparse
import json
import os
import re
import sys
import time
from dataclasses import replace

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import rspo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MAIN = ["--env", "alfworld", "--max-steps", "30", "--warm-start", "1000", "--eval-episodes", "256",
        "--eval-split", "valid_seen,valid_unseen", "--threads", "1"]


def renamed(step, words, ids, rng):
    """The step with the object words permuted (a random bijection of `words`), in ids and in text alike."""
    perm = rng.permutation(len(words))
    by_word = {w: words[j] for w, j in zip(words, perm)}
    by_id = {i: ids[j] for i, j in zip(ids, perm)}
    adm = [" ".join(by_word.get(w, w) for w in a.split(" ")) for a in step.admissible]
    return replace(step, prompt_ids=[by_id.get(i, i) for i in step.prompt_ids],
                   response_ids=[by_id.get(i, i) for i in step.response_ids], admissible=adm)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--share", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    cfg = rspo.validate(rspo.build_parser().parse_args(
        MAIN + ["--warm-start-epochs", str(args.epochs), "--seed", str(args.seed), "--output-dir", "/tmp/copy_augment"]))
    torch.manual_seed(cfg.seed)
    policy = rspo.build_policy(cfg, torch.device("cpu"))
    start = time.time()
    trajs = rspo.rollout(policy, cfg, range(cfg.warm_start), act=rspo.expert_actor(policy, 0.0, None, searching=True),
                         group_size=1)
    steps = [s for t in trajs for s in t.steps]
    words = sorted({m.group(1) for s in steps for m in [re.match(r"take (\w+) \d+ from ", s.action)] if m})
    ids = policy.tok.convert_tokens_to_ids(words)
    assert policy.tok.unk_token_id not in ids and all(len(policy.action_ids(w)) == 1 for w in words)
    rng = np.random.default_rng(cfg.seed + 50_000)
    optimizer = torch.optim.Adam(policy.agent.parameters(), lr=cfg.warm_start_lr)
    generator, lengths, nll = torch.Generator().manual_seed(cfg.seed + 40_000), rspo.sequence_lengths(steps), []
    policy.agent.train()
    for mb in rspo.minibatches(len(steps), cfg.minibatch_size, cfg.warm_start_epochs, generator):
        tokens, loss = sum(len(steps[j].response_ids) for j in mb), 0.0
        for idx in rspo.length_sorted_chunks(mb, lengths, cfg.micro_batch_size):
            batch = [renamed(steps[j], words, ids, rng) if rng.random() < args.share else steps[j]
                     for j in idx]
            logp, mask, _, _ = policy.forward(batch, 1.0)
            part = rspo.imitation_loss(logp, mask) * (mask.sum().item() / tokens)
            part.backward()
            loss += float(part.detach())
        rspo.optimizer_step(policy, optimizer, cfg)
        nll.append(loss)
    warm_seconds = time.time() - start
    per_epoch = -(-len(steps) // cfg.minibatch_size)
    ev = rspo.evaluate(policy, cfg)
    out = {"share": args.share, "seed": args.seed, "epochs": args.epochs, "object_words": len(words),
           "demo_steps": len(steps), "nll_last_epoch": float(np.mean(nll[-per_epoch:])),
           "warm_seconds": round(warm_seconds), **ev}
    print(json.dumps(out))
    with open(os.path.join(HERE, "copy_augment.jsonl"), "a") as f:
        f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
