"""WebShop's option step: where the aliased warm start's probability goes when the demonstrator clicks an option.

    python results/diagnosis/option_step.py --epochs 3     # the aliased warm start of the main settings, seed 0
    python results/diagnosis/option_step.py --epochs 8

Trains rspo.warm_start (main settings, seed 0; results named item1, item2, ... by --env-options), plays
the searching demonstrator on the 256 `test` tasks, and at every step where it clicks an option value scores each
admissible action under the policy (T = 1, the decoding constraint). Prints, separately for the page's first
option click and the second (one value already chosen): the mean probability of the demonstrator's value, of the
other values offered, of `buy now` and of navigation; and the copy accuracy: how often the demonstrator's value is
the most probable of its option group (chance: 1 / the group's size). rspo.py is not changed.
"""
import argparse
import collections
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import failures  # noqa: E402
import model_screen  # noqa: E402
import rspo  # noqa: E402


def action_probs(policy, step):
    """The policy's probability of each admissible action in the step's state."""
    rows = [rspo.Step(step.prompt_ids, policy.action_ids(a) + [policy.tok.eos_token_id], step.admissible, step.obs,
                      a, 0.0, False) for a in step.admissible]
    return dict(zip(step.admissible, model_screen.step_probs(policy, rows, len(rows))))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    cfg = rspo.validate(rspo.build_parser().parse_args(
        ["--env", "webshop", "--env-options", '{"results_names": "position"}', "--max-steps", "10",
         "--warm-start", "1000", "--warm-start-epochs", str(a.epochs), "--seed", str(a.seed), "--no-progress"]))
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    policy = rspo.build_policy(cfg, torch.device("cpu"))
    stats, _, seconds = rspo.warm_start(policy, cfg)
    print(f"aliased warm start: 1000 demonstrations x {a.epochs} epochs, nll {stats['warmstart/nll']:.3f}, "
          f"{seconds:.0f} s")
    trajs = rspo.rollout(policy, cfg, range(256), "test", group_size=1,
                         act=rspo.expert_actor(policy, 0.0, None, searching=True))
    table = collections.defaultdict(lambda: collections.defaultdict(list))
    for t in trajs:
        env = rspo.envs.make_env("webshop", split="test", seed=t.task_seed, **cfg.env_options)   # as rollout
        env.reset()
        for s in t.steps:
            if failures.step_kind("webshop", s.action) == "option":
                groups = env.env._product()["options"]
                value = model_screen.clicked(s.action)
                group = next(vs for vs in groups.values() if value in vs)
                prob = action_probs(policy, s)
                values = {f"click[{v}]" for vs in groups.values() for v in vs}
                row = table["first option" if not env.env.options else "second option"]
                row["demonstrator's value"].append(prob[s.action])
                row["other values"].append(sum(prob[v] for v in values if v != s.action))
                row["buy now"].append(prob["click[buy now]"])
                row["navigation"].append(sum(prob.get(f"click[{n}]", 0.0) for n in ("< prev", "back to search")))
                in_group = [prob[f"click[{v}]"] for v in group]
                row["copy accuracy"].append(float(prob[s.action] == max(in_group)))
                row["chance"].append(1 / len(group))
            env.step(s.action)
    for situation, row in table.items():
        print(f"{situation} ({len(row['chance'])} steps): " + ", ".join(
            f"{k} {np.mean(v):.3f}" for k, v in row.items()))


if __name__ == "__main__":
    main()
