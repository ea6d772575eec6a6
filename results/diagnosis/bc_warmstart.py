"""Probe: how far does imitation of a NON-privileged (searching) expert take the same tiny policy, with the same
compact prompt (--history 2) and constrained decoding? Evidence for "warm-start by imitation" (no RL here).

    python results/diagnosis/bc_warmstart.py --episodes 1000 --epochs 6 --output-dir results/diagnosis/bc_searching

Collects --episodes train-split episodes (tasks 0..N-1, one each) of the searching expert of baselines.py, each
step rendered exactly as rspo.rollout renders the policy's own steps (expert_actor-style response ids), then
minimises the token-mean negative log-likelihood of the expert's action under the decoding constraint (Adam,
lr 1e-3, minibatches of 128 steps), evaluating on the diagnosis panel (128 valid_seen tasks, T = 0.4, 30 steps,
rspo.evaluate's own RNG stream) after every epoch. Writes metrics.jsonl; --save-model DIR keeps the weights in
rspo's tiny-model format, so (without --memory) `python rspo.py --model DIR ...` can continue from them by RL.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import numpy as np  # noqa: E402
import torch  # noqa: E402

import rspo  # noqa: E402
from baselines import searching_action  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--episodes", type=int, default=1000)
p.add_argument("--epochs", type=int, default=6)
p.add_argument("--history", type=int, default=2)
p.add_argument("--memory", action="store_true",
               help="use memory_prompt.py's prompt (inventory from own past actions + last 2 actions; --history 30)")
p.add_argument("--output-dir", required=True)
p.add_argument("--save-model", default=None)
a = p.parse_args()
os.makedirs(a.output_dir, exist_ok=True)
if a.memory:
    import memory_prompt  # noqa: E402,F401  (patches rspo.build_prompt)
    a.history = 30

cfg = rspo.build_parser().parse_args(["--env", "alfworld", "--max-steps", "30", "--eval-episodes", "128",
                                      "--eval-split", "valid_seen", "--seed", "0", "--threads", "1",
                                      "--history", str(a.history)])
rspo.validate(cfg)
torch.manual_seed(0)
torch.set_num_threads(1)
policy = rspo.build_policy(cfg, torch.device("cpu"))
start = time.time()
searched = {}


def act(prompts, admissibles, environments):
    out = []
    for env in environments:
        action = searching_action(env, searched.setdefault(id(env), set()))
        out.append((policy.action_ids(action) + [policy.tok.eos_token_id], action, False))
    return out


trajs = rspo.rollout(policy, cfg, range(a.episodes), "train", 1.0, act=act, group_size=1)
steps = [s for t in trajs for s in t.steps]
print(f"{len(trajs)} expert episodes, {len(steps)} steps, success {np.mean([t.won for t in trajs]):.3f}", flush=True)
opt = torch.optim.Adam(policy.agent.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(0)
lengths = rspo.sequence_lengths(steps)
log = open(os.path.join(a.output_dir, "metrics.jsonl"), "w")


def record(epoch, loss):
    rec = {"epoch": epoch, "bc/nll": loss, "bc/expert_steps": len(steps), **rspo.evaluate(policy, cfg),
           "time/seconds": round(time.time() - start, 1)}
    log.write(json.dumps(rec) + "\n")
    log.flush()
    print(json.dumps(rec), flush=True)


record(0, None)
for epoch in range(1, a.epochs + 1):
    policy.agent.train()
    perm, total, n = torch.randperm(len(steps), generator=gen).tolist(), 0.0, 0
    for i in range(0, len(perm), 128):
        mb = perm[i:i + 128]
        tokens = sum(len(steps[j].response_ids) for j in mb)
        for idx in rspo.length_sorted_chunks(mb, lengths, 64):
            logp, mask, _, _ = policy.forward([steps[j] for j in idx], 1.0)
            loss = -(logp * mask).sum() / tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(policy.agent.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        n += 1
    record(epoch, total / n)
if a.save_model:
    rspo.save_model(policy, cfg, a.save_model)
