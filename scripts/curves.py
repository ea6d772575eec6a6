"""Held-out curves per task type, mean over seeds, of the runs in results/main (printed as markdown).

    python scripts/curves.py > results/curves.md
    python scripts/curves.py DIR          # the runs in DIR/main instead
"""
import glob
import json
import os
import statistics
import sys
from collections import defaultdict

RESULTS = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
runs = defaultdict(list)   # (env, algo, method) -> [records with an evaluation]
for path in sorted(glob.glob(os.path.join(RESULTS, "main", "*", "metrics.jsonl"))):
    name = os.path.basename(os.path.dirname(path))
    env, algo, rest = name.split("_", 2)
    runs[env, algo, rest.rsplit("_s", 1)[0]].append([r for r in map(json.loads, open(path)) if "eval/success" in r])
for (env, algo, method), evals in sorted(runs.items()):
    keys = [k for k in evals[0][0] if k.startswith(("eval/success", "eval_valid_unseen/success"))]
    print(f"### {env} {algo} {method} ({len(evals)} seeds)\n")
    short = {"look_at_obj_in_light": "look", "pick_and_place_simple": "pick", "pick_clean_then_place_in_recep": "clean",
             "pick_cool_then_place_in_recep": "cool", "pick_heat_then_place_in_recep": "heat",
             "pick_two_obj_and_place": "two"}
    # eval/success is the whole panel; eval/success/<type> one task type (ALFWorld's) or category (WebShop's)
    kinds = [k.split("/")[2] if k.count("/") == 2 else "all" for k in keys]
    labels = [("unseen " if k.startswith("eval_") else "") + short.get(kind, kind) for k, kind in zip(keys, kinds)]
    print("| update | " + " | ".join(labels) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for i, first in enumerate(evals[0]):
        cells = [f"{100 * statistics.mean(e[i][k] for e in evals):.1f}" for k in keys]
        print(f"| {first['update']} | " + " | ".join(cells) + " |")
    print()
