"""Probe (issue 13, "a copy-friendly rendering"): does the order of the compact prompt change how well the tiny
model imitates? The warm start of the main settings with the task first (rspo.py's template) or last (nearest
the action, which must repeat its object word). Warm start only, no RL; rspo.py is not changed.

    python results/diagnosis/prompt_order.py task_first|task_last [--seed 0]

One JSON line per run to prompt_order.jsonl: the warm start's stats and rspo.evaluate on valid_seen and
valid_unseen (T = 0.4).
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import rspo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = {"task_first": rspo.COMPACT_TEMPLATE,
             "task_last": "history : {history} . observation : {obs} . task : {task}"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("template", choices=sorted(TEMPLATES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rspo.COMPACT_TEMPLATE = TEMPLATES[args.template]   # build_prompt reads it at every step
    cfg = rspo.validate(rspo.build_parser().parse_args(
        ["--env", "alfworld", "--max-steps", "30", "--warm-start", "1000", "--warm-start-epochs", "3",
         "--eval-episodes", "256", "--eval-split", "valid_seen,valid_unseen", "--seed", str(args.seed),
         "--threads", "1", "--output-dir", "/tmp/prompt_order"]))
    torch.manual_seed(cfg.seed)
    policy = rspo.build_policy(cfg, torch.device("cpu"))
    start = time.time()
    stats, steps, seconds = rspo.warm_start(policy, cfg)
    out = {"template": args.template, "seed": args.seed, **stats, "warm_seconds": round(seconds),
           **rspo.evaluate(policy, cfg), "total_seconds": round(time.time() - start)}
    print(json.dumps(out))
    with open(os.path.join(HERE, "prompt_order.jsonl"), "a") as f:
        f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
