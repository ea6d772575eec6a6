"""Evaluate (and describe the behaviour of) one saved policy on the diagnosis panel at several temperatures (same weights, same panel).

    python results/diagnosis/eval_temperature.py results/diagnosis/base/model 0 0.4 1.0 > results/diagnosis/eval_temperature.json

Sampling uses rspo.evaluate's own RNG stream (seed 0 + 10000), as in training-time evaluation; T = 0 is greedy.
Behaviour per task type: episode length; reached_any_progress (the state-based progress ever rose above 0: e.g.
a target object was picked up); max_progress; repeat_in_last4 (share of steps repeating one of the previous 4
actions: loops); distinct_action_share.
At T = 0.4 this reproduces the run's final eval/success exactly (a check that the reload is faithful).
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch  # noqa: E402

import rspo  # noqa: E402

model, temps = sys.argv[1], [float(t) for t in sys.argv[2:]]
cfg = rspo.build_parser().parse_args(["--env", "alfworld", "--model", model, "--max-steps", "30", "--eval-episodes", "128",
                                      "--eval-split", "valid_seen", "--seed", "0", "--threads", "1"])
rspo.validate(cfg)
torch.set_num_threads(1)
policy = rspo.build_policy(cfg, torch.device("cpu"))
out = {}
for t in temps:
    cfg.eval_temperature = t
    start = time.time()
    res = rspo.evaluate(policy, cfg)
    # behaviour on the same panel and RNG stream (rollout exactly as rspo.evaluate does it)
    with rspo.own_rng(cfg.seed + rspo.EVAL_SEED_OFFSET, policy.device):
        trajs = rspo.rollout(policy, cfg, range(cfg.eval_episodes), cfg.eval_split, t)
    assert abs(sum(tr.won for tr in trajs) / len(trajs) - res["eval/success"]) < 1e-9
    beh = {}
    for kind in ["all"] + sorted({tr.task_type for tr in trajs}):
        sel = [tr for tr in trajs if kind == "all" or tr.task_type == kind]
        maxprog, touched, repeat, distinct, length = [], [], [], [], []
        for tr in sel:
            acts = [s.action for s in tr.steps]
            prog, best = 0.0, 0.0
            for s in tr.steps:
                prog += s.progress_gain
                best = max(best, prog)
            maxprog.append(best)
            touched.append(best > 0)
            repeat.append(sum(a in acts[max(0, i - 4):i] for i, a in enumerate(acts)) / len(acts))
            distinct.append(len(set(acts)) / len(acts))
            length.append(len(acts))
        m = lambda xs: round(sum(xs) / len(xs), 3)  # noqa: E731
        beh[kind] = {"success": m([tr.won for tr in sel]), "episode_length": m(length),
                     "reached_any_progress": m(touched), "max_progress": m(maxprog),
                     "repeat_in_last4": m(repeat), "distinct_action_share": m(distinct)}
    res["behaviour"] = beh
    res["seconds"] = round(time.time() - start, 1)
    out[str(t)] = res
    print(t, res, file=sys.stderr)
print(json.dumps(out, indent=1))
