"""Summarise results/diagnosis/*/metrics.jsonl into a markdown table (printed).

    python results/diagnosis/table.py > results/diagnosis/table.md
"""
import glob
import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
TYPES = [("look_at_obj_in_light", "look"), ("pick_and_place_simple", "pick"), ("pick_clean_then_place_in_recep", "clean"),
         ("pick_heat_then_place_in_recep", "heat"), ("pick_cool_then_place_in_recep", "cool"),
         ("pick_two_obj_and_place", "two")]
ORDER = ["base", "base_seed1", "history0", "history8", "history30", "memory_inventory", "cap_h128_l4", "lr3e-4", "lr3e-3", "epochs2",
         "mb512", "ent0.01", "maxsteps50", "groups16", "bc_then_grpo", "bc_then_grpo_lr1e-4", "bc_then_grpo_lr1e-4_seed1"]


def pct(x):
    return "–" if x is None else f"{100 * x:.1f}"


rows = []
for path in sorted(glob.glob(os.path.join(HERE, "*", "metrics.jsonl"))):
    name = os.path.basename(os.path.dirname(path))
    recs = [json.loads(line) for line in open(path)]
    evals = [r for r in recs if "eval/success" in r]
    trains = [r for r in recs if "train/episode_length" in r]
    if not trains:
        continue
    last_eval, last = evals[-1], trains[-1]
    tail = trains[-3:]
    log = open(os.path.join(os.path.dirname(path), "log.txt")).read()
    wall = re.search(r"wall_s=(\d+)", log)
    done = last["update"] == json.load(open(os.path.join(os.path.dirname(path), "config.json")))["updates"]
    command = open(os.path.join(os.path.dirname(path), "command.txt")).read()
    flags = command.split("--output-dir")[1].split(None, 1)
    if "memory_prompt.py" in command:
        flags = ["", "memory_prompt.py: inventory + last 2 actions in the prompt"]
    rows.append((ORDER.index(name) if name in ORDER else 99, name, {
        "flags": flags[1].strip() if len(flags) > 1 else "",
        "curve": " → ".join(pct(r["eval/success"]) for r in evals),
        "final": pct(last_eval["eval/success"]) + ("" if done else f" (upd {last_eval['update']})"),
        "types": " / ".join(pct(last_eval.get(f"eval/success/{t}")) for t, _ in TYPES),
        "train_succ": pct(sum(r["train/success"] for r in tail) / len(tail)),
        "len_first": f"{trains[0]['train/episode_length']:.1f}",
        "len": f"{sum(r['train/episode_length'] for r in tail) / len(tail):.1f}",
        "ent": f"{trains[0]['losses/entropy']:.2f} → {sum(r['losses/entropy'] for r in tail) / len(tail):.2f}",
        "states": str(last.get("train/distinct_states")),
        "wins": " / ".join(str(int(last.get(f"train/wins/{t}", 0))) for t, _ in TYPES),
        "starved": f"{sum(r['train/success'] == 0 for r in trains)} / {len(trains)}",
        "wall": f"{int(wall.group(1)) / 60:.1f}" if wall else "running",
    }))
print("| run | flags vs base | held-out success % (upd 0 → 6 → 12 → 18 → 24) | final % | final per type % "
      "(look / pick / clean / heat / cool / two) | train success % (last 3) | episode length (upd 1 → last 3) | "
      "entropy (upd 1 → last 3) | distinct states | training wins per type (cumulative) | updates without a win (zero gradient) | wall min |")
print("|" + "---|" * 12)
for _, name, d in sorted(rows):
    print(f"| {name} | `{d['flags']}` | {d['curve']} | {d['final']} | {d['types']} | {d['train_succ']} | "
          f"{d['len_first']} → {d['len']} | {d['ent']} | {d['states']} | {d['wins']} | {d['starved']} | {d['wall']} |")
