"""How far one update of a run is from the floor of its arithmetic, on one core (docs/performance.md).

    python scripts/floor.py                       # ALFWorld, the main runs' settings (scripts/reproduce.py)
    python scripts/floor.py --threads 2 ...       # flags replace the defaults of the same name

Warm-starts the policy as the main runs do, plays one training batch, then times (best of --repeats) and counts
the FLOPs (torch's FlopCounterMode) of the parts of one update of A: the rollout (decoding: prefill and new
tokens), rspo.update (forward with gradients, backward, and whatever scoring the update does; Adam is negligible), and
a scoring pass over the batch (score_steps: part of every update before the sampler recorded log-probs). The floor of each
part is its FLOPs over what this machine sustains on matmuls of the update's shapes (measured here, same
threads). Prints one table: seconds, GFLOP, achieved GFLOP/s, floor seconds and the ratio.
"""
import copy
from dataclasses import replace
import os
import sys
import time

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rspo  # noqa: E402

DEFAULTS = ["--env", "alfworld", "--method", "outcome", "--algo", "grpo", "--num-groups", "8", "--group-size", "8",
            "--max-steps", "30", "--warm-start", "1000", "--warm-start-epochs", "3", "--lr", "1e-4", "--threads", "1",
            "--no-save-model", "--no-progress"]


def merged(defaults, given):
    """The defaults with every flag given on the command line replaced by its given value."""
    out, i = [], 0
    while i < len(defaults):
        if defaults[i] in given:
            i += 1
            while i < len(defaults) and not defaults[i].startswith("--"):
                i += 1
        else:
            out.append(defaults[i])
            i += 1
    return out + given


def best_time(fn, repeats):
    """The fastest of `repeats` calls (s): the least disturbed by anything else on the machine."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def flops(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def matmul_rate(policy, tokens, repeats=5):
    """GFLOP/s this machine sustains on the update's matmuls: each linear weight of the model against `tokens`
    rows (one micro-batch), forward shapes."""
    total, seconds = 0, 0.0
    for w in {tuple(m.weight.shape) for m in policy.agent.lm.modules() if isinstance(m, torch.nn.Linear)}:
        x, weight = torch.randn(tokens, w[1]), torch.randn(w[1], w[0])
        seconds += best_time(lambda: x @ weight, repeats)
        total += 2 * tokens * w[0] * w[1]
    return total / seconds / 1e9


def main(argv):
    cfg = rspo.configure(merged(DEFAULTS, argv))
    repeats = 3
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    torch.manual_seed(cfg.seed)
    policy = rspo.build_policy(cfg, torch.device("cpu"))
    rspo.warm_start(policy, cfg)
    seeds = np.random.default_rng(cfg.seed).integers(0, cfg.train_tasks, cfg.num_groups)
    trajs = rspo.rollout(policy, cfg, seeds)
    rspo.attach_rewards(trajs, "outcome", cfg)
    steps = [s for t in trajs for s in t.steps]
    lengths = rspo.sequence_lengths(steps)
    rows = {}

    def play():
        with rspo.own_rng(cfg.seed, policy.device):   # the same batch each time
            rspo.rollout(policy, cfg, seeds)
    rows["rollout (decoding)"] = best_time(play, repeats), flops(play)

    def learn():   # a fresh copy each time: every repeat does the same update
        learner = replace(policy, agent=copy.deepcopy(policy.agent))
        optimizer = torch.optim.Adam(learner.agent.parameters(), lr=cfg.lr)
        return lambda: rspo.update(learner, optimizer, trajs, cfg, torch.Generator().manual_seed(0))
    rows["update (rspo.update)"] = min(best_time(learn(), 1) for _ in range(repeats)), flops(learn())
    rows["a scoring pass over the batch (score_steps)"] = (best_time(lambda: rspo.score_steps(policy, steps, cfg), repeats),
                                                    flops(lambda: rspo.score_steps(policy, steps, cfg)))
    per_pass = int(np.mean(sorted(lengths)[-cfg.micro_batch_size:])) * cfg.micro_batch_size
    rate = matmul_rate(policy, per_pass)
    print(f"batch: {len(trajs)} episodes, {len(steps)} steps, {sum(lengths)} tokens (mean {np.mean(lengths):.1f}); "
          f"--micro-batch-size {cfg.micro_batch_size}, --threads {torch.get_num_threads()}; matmuls of the model's "
          f"linear shapes at {per_pass} rows: {rate:.1f} GFLOP/s\n")
    print("| part | seconds | GFLOP | GFLOP/s | floor seconds | ratio to floor |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (sec, fl) in rows.items():
        floor = fl / 1e9 / rate
        print(f"| {name} | {sec:.2f} | {fl / 1e9:.1f} | {fl / 1e9 / sec:.1f} | {floor:.2f} | {sec / floor:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
