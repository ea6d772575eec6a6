"""Where the warm-started learner fails: its held-out episodes step by step, against the searching demonstrator.

    python results/diagnosis/failures.py alfworld                        # the warm start of the main settings, seed 0
    python results/diagnosis/failures.py alfworld --model runs/grpo_u60/model   # a saved policy (below)
    python results/diagnosis/failures.py alfworld --model runs/h128_l4 --warm-start 1000   # a larger model, imitated
    python results/diagnosis/failures.py webshop [--lowercase | --alias]
    python results/diagnosis/failures.py webshop --alias --copy-term     # the main WebShop settings' warm start
    python results/diagnosis/failures.py webshop --alias --seed 0 --model runs/ws_copy_s0/model   # and its RL (below)

The policy samples every held-out task at the evaluation temperature (rspo.evaluate's panel and RNG stream, so its
success equals the run's eval/success; the searching demonstrator's own success on the panel is printed beside it).
At each step the searching demonstrator's action in the same state is recorded beside the policy's (envs
`searching_action()`: what a non-privileged expert would do here). ALFWorld: each failed episode is classified by
what happened to the task's object (taken / seen but never taken / never seen; and whether another object was
taken). WebShop: agreement with the demonstrator by the kind of step it takes (search, product click, option,
navigation, buy), on test tasks and on train tasks the demonstrations did not cover, and each failed episode by
whether it bought, whether the goal's product, and which of the reward's terms fell short (type, attributes,
options, price); and, for the policy's episodes and the demonstrator's, how those that went back from a product page
ended (reopening a product left before, or opening only new ones). --lowercase gives the tiny model a lower-cased
word-level tokenizer (one token for 'B0ABC' in a page and 'b0abc' in the click, for 'Office' and 'office'); --alias
shows and clicks a results page's products as item1, item2, ... (rspo.py's `--env-options
'{"results_names": "position"}'`). Any other flag goes to rspo.py's parser (e.g. --copy-term for a warm start with
the copy term; a saved model brings its own). rspo.py is not changed.

runs/grpo_u60 is GRPO seed 0 of the main settings stopped at update 60 (its training equals
../main/alfworld_grpo_outcome_s0's up to there; only the evaluation schedule differs), saving its model:
    python rspo.py --env alfworld --num-groups 8 --group-size 8 --max-steps 30 --warm-start 1000 --warm-start-epochs 3 \
      --lr 1e-4 --updates 60 --eval-every 20 --eval-episodes 140 --algo grpo --method outcome --seed 0 \
      --output-dir runs/grpo_u60 --no-progress
runs/ws_copy_sS is ../main/webshop_grpo_outcome_sS's command (from its command.txt) with `--output-dir runs/ws_copy_sS`
and without `--no-save-model`; its metrics equal that run's record for record.
"""
import argparse
import collections
import os
import re
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import envs  # noqa: E402
import rspo  # noqa: E402

SETTINGS = {"alfworld": ["--max-steps", "30", "--eval-split", "valid_seen", "--eval-episodes", "140"],
            "webshop": ["--max-steps", "10", "--eval-split", "test", "--eval-episodes", "256"]}


def lowercase_tokenizer():
    orig = rspo.build_tiny_tokenizer

    def build(words):
        from tokenizers import normalizers
        tok = orig(sorted({w.lower() for w in words}))
        tok.backend_tokenizer.normalizer = normalizers.Lowercase()
        return tok
    rspo.build_tiny_tokenizer = build


def step_kind(env_name, demo):
    if env_name == "alfworld":
        return demo.split()[0]
    if demo.startswith("search"):
        return "search"
    if re.match(r"click\[(b0|item\d)", demo):
        return "product"
    return {"click[buy now]": "buy", "click[< prev]": "nav", "click[next >]": "nav", "click[back to search]": "nav",
            "click[description]": "info", "click[features]": "info", "click[reviews]": "info"}.get(demo, "option")


def play(policy, cfg, split, seeds):
    """The panel's episodes, with (kind, policy action == demonstrator action) per step."""
    log = []

    def act(prompts, admissible, environments):
        out = policy.act(prompts, admissible, cfg.eval_temperature)
        for (_, action, *_), env in zip(out, environments):
            demo = env.searching_action()
            log.append((step_kind(cfg.env, demo), action == demo, step_kind(cfg.env, action)))
        return out
    with rspo.own_rng(cfg.seed + rspo.EVAL_SEED_OFFSET, policy.device):   # rspo.evaluate's stream
        trajs = rspo.rollout(policy, cfg, seeds, split, cfg.eval_temperature, act=act, group_size=1)
    return trajs, log


def alfworld_failures(trajs, split):
    counts = collections.Counter()
    for t in trajs:
        if t.won:
            counts["won"] += 1
            continue
        obj = envs.generate_layout(split, t.task_seed)["task"]["obj"]
        took = [bool(re.match(rf"take {obj} \d", s.action)) for s in t.steps if s.action.startswith("take ")]
        seen = any(re.search(rf"\b{obj} \d", s.obs) for s in t.steps)
        what = "took the task's object" if any(took) else "saw it, never took it" if seen else "never saw it"
        counts[f"failed: {what}" + (", took another object" if not all(took) else "")] += 1
    return counts


def webshop_failures(trajs, split, cfg):
    """Each failed episode replayed in a fresh env: did it buy, was it the goal's product, and which of the reward's
    terms (envs.webshop_reward) fell short: type, attributes, options, price. Also: how episodes that went back from a
    product page ended (the demonstrator goes back when a named value is not offered, and never reopens a product)."""
    counts = collections.Counter()
    for t in trajs:
        env = envs.make_env("webshop", split=split, seed=t.task_seed, backend=cfg.backend, **cfg.env_options)
        env.reset()
        inner, listed, short = getattr(env, "env", env), False, None   # the env under PositionNamedResults, if any
        back, opened, reopened = False, set(), False
        target_asin = inner.catalog.products[inner.target]["asin"].lower()
        for s in t.steps:
            back |= inner.page == "item" and s.action == "click[< prev]"
            on_results = inner.page == "results"
            if s.action == "click[buy now]":
                product, goal = inner._product(), inner.goal
                values, attrs = list(goal["goal_options"].values()), goal["attributes"]
                short = [name for name, missed in (
                    ("type", envs.webshop_type_reward(product, goal) < 1),
                    ("attributes", envs.webshop_attribute_matches(product, attrs) < len(attrs)),
                    ("options", envs.webshop_option_matches(product, values, inner.options) < len(values)),
                    ("price", product["price"] > goal["price_upper"])) if missed]
                what = "the goal's product" if inner.asin == inner.target else "another product" + (
                    " (the goal's was listed on a page it saw)" if listed else "")
            env.step(s.action)
            if on_results and inner.page == "item":   # a product opened: one it had opened before?
                reopened |= inner.asin in opened
                opened.add(inner.asin)
            listed |= inner.page == "results" and target_asin in inner.clickables()   # the page's own listing
        counts["won" if t.won else "failed: never bought" if short is None else
               f"failed: bought {what}, short on {'+'.join(short)}"] += 1
        path = ("went back from a product page and reopened one" if reopened else
                "went back from a product page, opened only new ones" if back else "never went back")
        counts[f"episodes that {path}, {'won' if t.won else 'failed'}"] += 1
    return counts


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("env", choices=["alfworld", "webshop"])
    p.add_argument("--model", default="tiny")
    p.add_argument("--warm-start", type=int, default=None, help="default: rspo.py's (1000 for tiny, 0 for a --model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--alias", action="store_true")
    a, rspo_flags = p.parse_known_args()
    if a.lowercase:
        lowercase_tokenizer()
    cfg = rspo.build_parser().parse_args(["--env", a.env, "--model", a.model, "--seed", str(a.seed), *SETTINGS[a.env]]
                                         + ([] if a.warm_start is None else ["--warm-start", str(a.warm_start)])
                                         + (["--env-options", '{"results_names": "position"}'] if a.alias else [])
                                         + rspo_flags)
    rspo.validate(cfg)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    policy = rspo.build_policy(cfg, torch.device("cpu"))
    if cfg.warm_start:
        stats, _, seconds = rspo.warm_start(policy, cfg)
        print(f"warm start: {cfg.warm_start} demonstrations x {cfg.warm_start_epochs} epochs, nll "
              f"{stats['warmstart/nll']:.3f}, {seconds:.0f} s")
    panels = [(cfg.eval_split, range(cfg.eval_episodes))]
    if a.env == "webshop":   # train tasks past the demonstrations: seen products, unseen goals
        panels.append(("train", range(2000, 2000 + cfg.eval_episodes)))
    for split, seeds in panels:
        trajs, log = play(policy, cfg, split, seeds)
        # the searching demonstrator's own episodes (what imitation could reach), played as warm_start plays them
        demo = rspo.rollout(policy, cfg, seeds, split, act=rspo.expert_actor(policy, 0.0, None, searching=True),
                            group_size=1)
        print(f"{split}: success {100 * np.mean([t.won for t in trajs]):.1f} % of {len(trajs)}, "
              f"mean length {np.mean([len(t.steps) for t in trajs]):.1f}; "
              f"the searching demonstrator alone: {100 * np.mean([t.won for t in demo]):.1f} %")
        by_kind, took = collections.defaultdict(list), collections.defaultdict(collections.Counter)
        for kind, same, own in log:
            by_kind[kind].append(same)
            took[kind][own] += 1
        print("  same action as the demonstrator, by its kind of step: " + ", ".join(
            f"{k} {100 * np.mean(v):.0f} % of {len(v)}" for k, v in sorted(by_kind.items())))
        print("  the policy's kind of step where the demonstrator's was: " + "; ".join(
            f"{k}: " + ", ".join(f"{o} {n}" for o, n in c.most_common()) for k, c in sorted(took.items())))
        failed = alfworld_failures(trajs, split) if a.env == "alfworld" else webshop_failures(trajs, split, cfg)
        for what, n in sorted(failed.items(), key=lambda kv: (kv[0].startswith("episodes"), -kv[1])):
            print(f"  {n:4d}  {what}")
        if a.env == "webshop":
            print("  the demonstrator's: " + "; ".join(f"{n} {what[len('episodes that '):]}" for what, n in sorted(
                webshop_failures(demo, split, cfg).items()) if what.startswith("episodes")))


if __name__ == "__main__":
    main()
