"""Print the calibration table (results/calibration/README.md) from the runs' metrics.

    python scripts/calibration_table.py           # the runs in results/calibration/*/
    python scripts/calibration_table.py DIR       # the runs in DIR/*/ instead
"""
import glob
import json
import os
import sys

CALIBRATION = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "calibration")
for path in sorted(glob.glob(os.path.join(CALIBRATION, "*", "metrics.jsonl"))):
    recs = [json.loads(line) for line in open(path) if line.strip()]
    evals = [r for r in recs if "eval/success" in r]
    trains = [r for r in recs if "train/success" in r]
    last = trains[-1]
    per_update = last["time/A_seconds"] / last["updates/A"]
    flags = open(os.path.join(os.path.dirname(path), "command.txt")).read().split("--output-dir")[0]
    flags = flags.replace("python rspo.py ", "")
    curve = " → ".join(f"{100 * r['eval/success']:.1f}" for r in evals)
    score = f" (score {evals[0]['eval/score']:.2f} → {evals[-1]['eval/score']:.2f})" if "webshop" in flags else ""
    print(f"| {os.path.basename(os.path.dirname(path))} | `{flags.strip()}` | {curve}{score} | "
          f"{max(100 * r['eval/success'] for r in evals[1:]):.1f} | {last['update']} | "
          f"{recs[0]['time/warmstart_seconds']:.0f} | {per_update:.1f} |")
