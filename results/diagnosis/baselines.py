"""Reference policies on the diagnosis panel: the first 128 valid_seen tasks (the runs' held-out panel),
30-step cap (and 50 for comparison). No model involved.

- random:    uniform over the admissible actions (5 episodes per task, seeds fixed)
- expert:    envs' scripted expert (privileged: knows where every object is)
- searching: the same expert without that privilege: until it has looked into the receptacle that holds
             the object it wants to fetch, it visits receptacles in the order the intro lists them (envs.pddl_id order)
             (go to, open when closed), then follows the expert.
Also per policy: episode length, reached_any_progress (the state-based progress ever rose above 0, e.g. a target
object was picked up) and repeat_in_last4 (share of steps repeating one of the previous 4 actions), as
eval_temperature.py reports them for a trained policy.

    python results/diagnosis/baselines.py > results/diagnosis/baselines.json
"""
import json
import os
import random
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import envs  # noqa: E402

N = 128


def searching_action(env, searched):
    h = env.house
    if h.agent_at is not None and h.accessible(h.agent_at):
        searched.add(h.agent_at)
    a = env.expert_action()
    # the privileged part of the expert: walking to / opening / taking from a receptacle it has not looked into
    target = None
    for prefix in ("go to ", "open "):
        if a.startswith(prefix):
            target = a[len(prefix):]
    if a.startswith("take "):
        target = a.split(" from ")[-1]
    fetching = h.holding is None or (envs.kind(h.holding) != env.task.obj)
    if target is not None and target not in searched and fetching:
        nxt = [r for r in sorted(h.receptacles, key=envs.pddl_id) if r not in searched]
        r = h.agent_at if h.agent_at in nxt else nxt[0]
        return f"go to {r}" if h.agent_at != r else f"open {r}"
    return a


def run(policy, cap, reps=1):
    wins, lengths, touched, repeat = defaultdict(list), defaultdict(list), defaultdict(list), defaultdict(list)
    for rep in range(reps):
        for s in range(N):
            env = envs.make_env("alfworld", split="valid_seen", seed=s, max_steps=cap)
            _, info = env.reset()
            rng, searched, done, t = random.Random(1000 * rep + s), set(), False, 0
            acts, best = [], 0.0
            while not done:
                if policy == "random":
                    a = rng.choice(info["admissible_actions"])
                elif policy == "expert":
                    a = env.expert_action()
                else:
                    a = searching_action(env, searched)
                _, _, done, info = env.step(a)
                t += 1
                acts.append(a)
                best = max(best, info["progress"])
            wins[info["task_type"]].append(float(info["won"]))
            lengths[info["task_type"]].append(t)
            touched[info["task_type"]].append(float(best > 0))
            repeat[info["task_type"]].append(sum(a in acts[max(0, i - 4):i] for i, a in enumerate(acts)) / len(acts))
    allw = [w for v in wins.values() for w in v]
    alll = [x for v in lengths.values() for x in v]
    return {"success": sum(allw) / len(allw), "episode_length": sum(alll) / len(alll),
            "per_type": {k: round(sum(v) / len(v), 3) for k, v in sorted(wins.items())},
            "length_per_type": {k: round(sum(v) / len(v), 1) for k, v in sorted(lengths.items())},
            "reached_any_progress": round(sum(x for v in touched.values() for x in v) / len(allw), 3),
            "reached_any_progress_per_type": {k: round(sum(v) / len(v), 3) for k, v in sorted(touched.items())},
            "repeat_in_last4": round(sum(x for v in repeat.values() for x in v) / len(allw), 3),
            "tasks_per_type": {k: len(v) // reps for k, v in sorted(wins.items())}}


if __name__ == "__main__":
    out = {}
    for cap in (30, 50):
        out[f"random_cap{cap}"] = run("random", cap, reps=5)
        out[f"expert_cap{cap}"] = run("expert", cap)
        out[f"searching_cap{cap}"] = run("searching", cap)
    print(json.dumps(out, indent=1))
