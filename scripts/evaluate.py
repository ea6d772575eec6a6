"""Evaluate a run's saved model on another held-out panel, with the run's own settings.

    python scripts/evaluate.py runs/alfworld_outcome_grpo_s0 --split valid_unseen --episodes 256

Reads RUN_DIR/config.json (environment, caps, prompt, evaluation temperature, seed) and RUN_DIR/model (written
unless the run had --no-save-model), samples the panel with rspo.evaluate and prints its metrics as JSON.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rspo  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--split", default=None, help="held-out split (default: the run's --eval-split)")
    p.add_argument("--episodes", type=int, default=None, help="panel size (default: the run's --eval-episodes)")
    a = p.parse_args(argv)
    config, model = os.path.join(a.run_dir, "config.json"), os.path.join(a.run_dir, "model")
    if not os.path.isfile(config) or not os.path.isdir(model):
        p.error(f"{a.run_dir}: needs config.json and model/ (a run made without --no-save-model)")
    with open(config) as f:
        settings = json.load(f)
    cfg = rspo.build_parser().parse_args([])
    for k, v in settings.items():
        if hasattr(cfg, k):
            setattr(cfg, k, v)
    cfg.model, cfg.warm_start, cfg.device = model, 0, "auto"   # evaluate wherever this machine can
    cfg.eval_split, cfg.eval_episodes = a.split or cfg.eval_split, a.episodes or cfg.eval_episodes
    try:
        rspo.fill_defaults(rspo.validate(cfg))
        torch.set_num_threads(cfg.threads or torch.get_num_threads())
        policy = rspo.build_policy(cfg, rspo.pick_device(cfg.device))
    except rspo.ConfigError as e:
        p.error(str(e))
    print(json.dumps({"run": a.run_dir, "split": cfg.eval_split, **rspo.evaluate(policy, cfg)}))


if __name__ == "__main__":
    main()
