"""Reproduce the paper's claims on the offline benchmarks: every run, the tables, the figures.

    python scripts/reproduce.py                         # everything, 3 seeds, 2 jobs at a time, resumable
    python scripts/reproduce.py --experiments main --envs alfworld --algos grpo --seeds 0
    python scripts/reproduce.py --report                # only rebuild results/final.csv, tables, figures
    python scripts/reproduce.py --list                  # print the commands, run nothing
    python scripts/reproduce.py --batch scripts/prereg13_part_c.batch   # several commands' runs, one pool
    python scripts/reproduce.py --verify results/main/webshop_grpo_outcome_s200   # rerun one, compare

Each run is one `python rspo.py ...` command with its own directory results/<experiment>/<run>/ holding
metrics.jsonl, config.json and command.txt (the exact command line). A run made by the same command whose
metrics reach its last update is complete and is skipped on the next call; a directory made by another
command is left as it is. A run cut off midway continues from its last checkpoint (every SAVE_EVERY
updates), so the script resumes where it stopped. The trainer is deterministic on CPU: rerunning a command
at the commit that made it (config.json's git_commit) reproduces its committed metrics; --verify does so
in a temporary git worktree of that commit, for a run directory wherever it lies now (its command.txt still
names the results/<experiment>/<run>/ it was written to; the rerun goes to a temporary directory instead;
a commit from before `--reward` was renamed `--method` is given `--reward`, see for_old_trainer).

Runs go to results/. The superseded regimes' runs left the tree: results/README.md names the commit to check
out to see and regenerate them.

Every method in a comparison shares the environment settings, seeds, evaluation panel and budget of
A's updates below (SETTINGS); RSPO's own knobs stay at the paper's defaults (alpha 1/8, k 3) except in the
sweeps, which are reported as sweeps.
"""
import argparse
import csv
import json
import math
import os
import pathlib
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rspo import save_atomically   # noqa: E402 (one definition)
RESULTS = os.path.join(ROOT, "results")
SEEDS = [0, 200, 400]   # the paper's seeds
SAVE_EVERY = 3          # checkpoint every 3 updates of A: a batch cut off after hours resumes mid-run

# One setting per environment, shared by every method: the competent base learner of results/calibration/
# (a warm start by imitation of the searching demonstrator, then RL at lr 1e-4). The budget is A's updates; RSPO's
# cycles (k = 3) divide it. Evaluation samples every valid_seen and valid_unseen task (ALFWorld: 140 + 134) or
# 256 fixed test tasks (WebShop).
WARM = ["--warm-start", "1000", "--warm-start-epochs", "3", "--lr", "1e-4"]
SETTINGS = {
    "alfworld": ["--env", "alfworld", "--num-groups", "8", "--group-size", "8", "--max-steps", "30", *WARM,
                 "--updates", "100", "--eval-every", "10", "--eval-episodes", "256", "--eval-split", "valid_seen,valid_unseen"],
    # WebShop's results named item1 ... item10 and the copy term: without them the tiny policy cannot say the product
    # or the option it means (results/calibration/README.md, the last two sections; 15.6 -> 37.6 %); episodes of up to
    # 15 steps, the benchmark's own cap (results/PREREGISTRATIONS.md, pre-registration 12)
    "webshop": ["--env", "webshop", "--env-options", '{"results_names": "position"}', "--copy-term", "--num-groups", "8",
                "--group-size", "8", "--max-steps", "15", *WARM,
                "--updates", "40", "--eval-every", "10", "--eval-episodes", "256", "--eval-split", "test"],
}
# Per base algorithm, for every method and environment alike: PPO's value loss at a fifth of its default weight
# (the untrained critic's gradient through the shared tiny backbone undid PPO; adopted by the rule registered in
# results/calibration/README.md, "PPO's value coefficient, 3 seeds").
ALGO_SETTINGS = {"grpo": [], "gigpo": [], "ppo": ["--vf-coef", "0.1"]}
# Equal total cost: the base algorithm run 2.5x as many updates (RSPO's explorer adds ~1.3x A's env steps).
LONG = {env: ["--updates", str(int(2.5 * int(flags[flags.index("--updates") + 1])))] for env, flags in SETTINGS.items()}

# method name -> extra flags. `outcome` is the base algorithm; `rspo_progress` gives the explorer the env's
# aligned progress increments (the best a learned estimator could do); `rspo` uses the learned progress
# estimator (the paper's dense reward), fitted once per env and seed and shared by every run that uses it, like
# the paper's fixed PRM; `rspo_envdense` uses the environment's event-style dense reward.
LEARNED = ["--dense-reward", "learned", "--prm-path", "{results}/estimators/{env}_s{seed}.pt"]
METHODS = {
    "outcome": ["--method", "outcome"],
    "outcome_long": ["--method", "outcome", "{long}"],
    "rspo_progress": ["--method", "rspo", "--dense-reward", "progress"],
    # B at 3x A's learning rate: chosen on a probe seed by B's diagnostics (the hidden-64 regime;
    # results/PREREGISTRATIONS.md, pre-registration 2)
    "rspo_progress_elr3e-4": ["--method", "rspo", "--dense-reward", "progress", "--explorer-lr", "3e-4"],
    "rspo": ["--method", "rspo", *LEARNED],
    "rspo_envdense": ["--method", "rspo", "--dense-reward", "env"],
    "dense": ["--method", "dense", "--dense-reward", "env"],
    "dense_progress": ["--method", "dense", "--dense-reward", "progress"],
    "rspo_sampling_variance": ["--method", "rspo", *LEARNED, "--buffer-sampling", "variance"],
    "rspo_sampling_random": ["--method", "rspo", *LEARNED, "--buffer-sampling", "random"],
    "rspo_h": ["--method", "rspo", "--buffer-source", "self"],
    "rspo_o": ["--method", "rspo", "--explorer-reward", "outcome"],
    # alpha = 1/16 is half a buffer group in our 8-group batch: rspo.py replays one every other update.
    # alpha = 0 is a control, not a setting: B runs but nothing is replayed, so A is GRPO drawing its tasks
    # and samples from RSPO's random stream; its gap to GRPO is the noise every RSPO variant carries.
    **{f"rspo_alpha{a}": ["--method", "rspo", *LEARNED, "--alpha", str(a)] for a in (0, 0.0625, 0.25, 0.5)},
    **{f"rspo_k{k}": ["--method", "rspo", *LEARNED, "--k", str(k)] for k in (1, 5, 10)},
    **{f"rspo_noise{s}": ["--method", "rspo", *LEARNED, "--dense-noise", str(s)] for s in (0.1, 0.3)},
}

# experiment -> (methods, algorithms, environments), in the order they run: the most important first.
EXPERIMENTS = {
    "main": (["outcome", "rspo_progress", "rspo_progress_elr3e-4", "rspo", "rspo_envdense"], ["grpo", "ppo", "gigpo"], ["alfworld", "webshop"]),
    "dense": (["dense", "dense_progress"], ["grpo"], ["alfworld", "webshop"]),
    "equal_cost": (["outcome_long"], ["grpo"], ["alfworld", "webshop"]),
    "ablations": (["rspo_h", "rspo_o", "rspo_sampling_variance", "rspo_sampling_random"], ["grpo"], ["alfworld"]),
    "sweeps": (["rspo_alpha0", "rspo_alpha0.0625", "rspo_alpha0.25", "rspo_alpha0.5", "rspo_k1", "rspo_k5", "rspo_k10",
                "rspo_noise0.1", "rspo_noise0.3"], ["grpo"], ["alfworld"]),
    # the fair test (results/PREREGISTRATIONS.md, pre-registration 13): new seeds, a low-noise final evaluation
    "confirm": (["outcome", "rspo_progress"], ["grpo"], ["alfworld", "webshop"]),
}
CONFIRM_SEEDS = {"alfworld": list(range(1000, 4000, 200)), "webshop": list(range(1000, 3000, 200))}   # 15 and 10
FINAL_REPEATS = {"alfworld": 8, "webshop": 4}   # plays of every held-out task in the confirm runs' final evaluation


def run_dir(experiment, env, algo, method, seed):
    return os.path.join(RESULTS, experiment, f"{env}_{algo}_{method}_s{seed}")


def method_flags(env, method, seed):
    flags = []
    for f in METHODS[method]:
        flags += LONG[env] if f == "{long}" else [f.format(env=env, seed=seed, results=os.path.relpath(RESULTS, ROOT))]
    return flags


def command(experiment, env, algo, method, seed):
    out = run_dir(experiment, env, algo, method, seed)
    final = ["--final-eval-repeats", str(FINAL_REPEATS[env])] if experiment == "confirm" else []
    return [sys.executable, os.path.join(ROOT, "rspo.py"), *SETTINGS[env], *final, "--algo", algo,
            *ALGO_SETTINGS[algo], *method_flags(env, method, seed), "--seed", str(seed), "--output-dir",
            os.path.relpath(out, ROOT), "--no-save-model", "--no-progress"]


def flag(cmd, name):
    """The value argparse uses: the one after the flag's last occurrence (None if absent)."""
    if name not in cmd:
        return None
    last = len(cmd) - 1 - cmd[::-1].index(name)
    return cmd[last + 1]


def read_metrics(path):
    """A run's records ([] before it starts). A run killed while writing leaves a torn last line: it is
    left out, so the run counts as incomplete. A line before the last that is not JSON is a damaged file."""
    file = os.path.join(path, "metrics.jsonl")
    try:
        with open(file) as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except FileNotFoundError:
        return []
    records = []
    for n, line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n != lines[-1][0]:
                raise ValueError(f"{file}: line {n} is not JSON (only a torn last line is expected)") from None
    return records


def command_line(cmd):
    """command.txt's text: the command as run from the repository root, without the run-control flags."""
    return shlex.join(["python", "rspo.py", *cmd[2:]]) + "\n"


def recorded(path):
    """The command.txt of the run in `path` (None if it has none)."""
    try:
        with open(os.path.join(path, "command.txt")) as f:
            return f.read()
    except FileNotFoundError:
        return None


def holds_run(path):
    """rspo.py has written a run into `path` (what makes it refuse the directory without --overwrite/--resume)."""
    return any(os.path.exists(os.path.join(path, f)) for f in ("metrics.jsonl", "config.json"))


def complete(path, cmd):
    """The run in `path` was made by exactly `cmd` (any other flag makes another run) and reached the
    evaluation after its last update."""
    records = read_metrics(path)
    return recorded(path) == command_line(cmd) and bool(records) \
        and records[-1].get("updates/A") == int(flag(cmd, "--updates")) and "eval/success" in records[-1]


# Every run of a batch, and every --verify rerun, on one torch thread: runs go side by side (--jobs), and the thread
# count moves float rounding. rspo.py's default was 1 thread until the runs of pre-registration 13.
THREADS = ["--threads", "1"]


def run_control(path):
    """Flags that say how to run, not what: they stay out of command.txt. `path` holds nothing yet or an
    incomplete run of the same command (execute checks command.txt): continue it from its last checkpoint,
    or start it again if it stopped before its first one."""
    flags = [*THREADS, "--save-every", str(SAVE_EVERY)]
    if os.path.isfile(os.path.join(path, "checkpoint", "state.pt")):   # rspo.CHECKPOINT, written atomically
        return flags + ["--resume"]
    return flags + ["--overwrite"] if holds_run(path) else flags


def plan(args):
    """Jobs in EXPERIMENTS order; seeds innermost, so two workers rarely need the same estimator at once. The fair
    test (confirm) runs its own seeds by default, in pairs (both methods of a seed, then the next seed), so a batch
    cut short leaves whole pairs."""
    jobs = []
    for experiment in args.experiments:
        methods, algos, env_names = EXPERIMENTS[experiment]
        for algo in algos:
            for env in env_names:
                chosen = [m for m in methods if not args.methods or m in args.methods]
                if env not in args.envs or algo not in args.algos:
                    continue
                if experiment == "confirm":
                    jobs += [(experiment, env, algo, m, seed) for seed in args.seeds or CONFIRM_SEEDS[env] for m in chosen]
                else:
                    jobs += [(experiment, env, algo, m, seed) for m in chosen for seed in args.seeds or SEEDS]
    return jobs


FITTING = defaultdict(threading.Lock)   # estimator file -> held by the run that fits it
LAUNCH = "# reproduce.py launched this run under: "   # a line of stdout.txt before each (re)start's output


def git_state():
    """(commit, whether tracked .py files have uncommitted changes) of this checkout, or (None, None) outside a
    repository: config.json records it, so a committed run can be rerun at its own code (--verify)."""
    try:
        def git(*args):
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no", "--", "*.py"))
    except (OSError, subprocess.CalledProcessError):
        return None, None


def software_stack():
    """What besides the commit decides a run's numbers: sampling at T > 0 turns a last-bit difference in the
    logits into another trajectory, so one commit and seed give other runs under other library versions or
    other CPU kernels (torch and MKL pick AVX2 or AVX-512 code by the machine). rspo.py runs under this
    interpreter, so its stack is this one's."""
    import platform
    import numpy
    import torch
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": numpy.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def launches(path):
    """The (re)starts of the run in `path`, oldest first: what each was launched under (LAUNCH lines of stdout.txt)."""
    try:
        with open(os.path.join(path, "stdout.txt")) as f:
            return [json.loads(line[len(LAUNCH):]) for line in f if line.startswith(LAUNCH)]
    except OSError:
        return []


def provenance(started):
    """config.json's provenance from a run's launches: the commit of the last one, the software stack it started
    under first and each other stack it was resumed under, in order of change (a run resumed under another stack
    is no single stack's run)."""
    stacks = [started[0]["stack"]]
    for launch in started[1:]:
        if launch["stack"] != stacks[-1]:
            stacks.append(launch["stack"])
    return {"git_commit": started[-1]["git_commit"], "git_dirty": started[-1]["git_dirty"], "stack": stacks[0],
            **({"resumed_under": stacks[1:]} if len(stacks) > 1 else {})}


def execute(job):
    """Run one job unless its directory holds it complete or holds another command's run: (job, status, seconds)."""
    path, cmd = run_dir(*job), command(*job)
    made_by = recorded(path)
    # A run made by another command (or by hand, without command.txt) is never overwritten nor counted.
    if made_by != command_line(cmd) and (made_by is not None or holds_run(path)):
        return job, f"made with other flags: left as it is (remove {path} to rerun)", 0.0
    if complete(path, cmd):
        return job, "done before", 0.0
    control = run_control(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "command.txt"), "w") as f:
        f.write(command_line(cmd))
    estimator = flag(cmd, "--prm-path")
    # The first run that needs an estimator fits it; another run needing the same one waits for the file.
    lock = FITTING[estimator] if estimator and not os.path.exists(os.path.join(ROOT, estimator)) else nullcontext()
    resumed = "--resume" in control
    commit, dirty = git_state()
    now = {"git_commit": commit, "git_dirty": dirty, "stack": software_stack()}
    before = launches(path) if resumed else []
    if before and before[-1]["stack"] != now["stack"]:
        print(f"warning: {path} ran under {before[-1]['stack']} and resumes under {now['stack']}: its sampled "
              "actions may then differ from an uninterrupted run's")
    with lock:
        start = time.time()
        with open(os.path.join(path, "stdout.txt"), "a" if resumed else "w") as log:
            log.write(LAUNCH + json.dumps(now) + "\n")
            log.flush()
            rc = subprocess.run(cmd + control, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc == 0:   # the provenance of a finished run joins its config.json
        with open(os.path.join(path, "config.json")) as f:
            config = {**json.load(f), **provenance(launches(path))}
        save_atomically(os.path.join(path, "config.json"),
                        lambda p: pathlib.Path(p).write_text(json.dumps(config, indent=1)))
    return job, "ok" if rc == 0 else f"failed (exit {rc}, see {path}/stdout.txt)", time.time() - start


# ----------------------------------------------------------------------------------------------
# Report: final.csv, Markdown tables, figures


def mean_of(records, key):
    values = [r[key] for r in records if key in r]
    return statistics.mean(values) if values else float("nan")


def novel_win_share(replayed_wins, own_wins):
    """Share of the replayed successes on task types A's own rollouts have not won yet: where the explorer
    leads A. replayed_wins: {type: successful episodes in this update's replayed groups}; own_wins: A's
    running totals "train/wins/<type>", this update's rollouts included. None when nothing replayed was won.
    """
    won = sum(replayed_wins.values())
    if not won:
        return None
    return sum(n for kind, n in replayed_wins.items() if not own_wins.get(f"train/wins/{kind}")) / won


def novel_type_wins(records):
    """Mean over updates of novel_win_share, from the running totals train/wins/<type> and buffer/wins/<type>:
    one definition for every run, also those logged when the share was taken before A's own wins of the same
    update were counted (which made every first update's share 1)."""
    shares, before = [], {}
    for r in records:
        totals = {k: v for k, v in r.items() if k.startswith("buffer/wins/")}
        share = novel_win_share({k.split("/")[2]: v - before.get(k, 0) for k, v in totals.items()}, r)
        shares += [] if share is None else [share]
        before.update(totals)
    return statistics.mean(shares) if shares else float("nan")


def final_rows(results):
    """One row per complete run under the directory `results`. Costs count everything a user pays: A, the
    explorer B and the progress estimator's fit (data collection + training; shared by the runs of one env
    and seed, charged to each)."""
    rows = []
    for experiment in sorted(os.listdir(results)) if os.path.isdir(results) else []:
        if experiment not in EXPERIMENTS:
            continue
        for name in sorted(os.listdir(os.path.join(results, experiment))):
            path = os.path.join(results, experiment, name)
            records = read_metrics(path)
            if not records or "eval/success" not in records[-1] or len(records) < 2:
                continue
            with open(os.path.join(path, "config.json")) as f:
                cfg = json.load(f)
            last = records[-1]
            if last["updates/A"] != cfg["updates"]:
                continue
            steps = {k: last.get(f"env_steps/{k}", 0) for k in ("A", "B", "prm")}
            secs = {k: last.get(f"time/{k}_seconds", 0.0) for k in ("A", "B", "prm")}
            rows.append({
                "experiment": experiment, "env": cfg["env"], "algo": cfg["algo"],
                "method": name[len(f"{cfg['env']}_{cfg['algo']}_"):name.rindex("_s")], "seed": cfg["seed"],
                "success": last["eval/success"], "score": last["eval/score"], "a_updates": last["updates/A"],
                "env_steps_total": sum(steps.values()), "wall_seconds": round(sum(secs.values()), 1),
                **{f"env_steps_{k}": v for k, v in steps.items()},
                **{f"seconds_{k}": round(v, 1) for k, v in secs.items()},
                "start_success": records[0]["eval/success"],
                "train_success": mean_of(records[1:], "train/success"),
                "explorer_success": mean_of(records[1:], "explorer/success"),
                "buffer_groups_with_success": mean_of(records[1:], "buffer/groups_with_success"),
                "distinct_states": last.get("train/distinct_states", 0),
                **{k: v for k, v in records[0].items() if k.startswith("prm/heldout")},
                "measure": cfg["eval_split"].split(",")[0],   # the split of eval/success (rspo.py's first --eval-split)
                "estimator_data": (f"{cfg.get('prm_model', 'tiny')} backbone, {cfg.get('prm_warmup_episodes')} + "
                             f"{cfg.get('prm_expert_episodes')} episodes, {cfg.get('prm_epochs')} passes"),
                **{k: v for k, v in last.items() if k.startswith("eval/success/") or "/wins/" in k},
                **({"warmstart_success": records[0]["eval/success"], "env_steps_warmstart": last["env_steps/warmstart"],
                    "seconds_warmstart": round(last["time/warmstart_seconds"], 1)} if "env_steps/warmstart" in last else {}),
                **({"unseen_success": last["eval_valid_unseen/success"]} if "eval_valid_unseen/success" in last else {}),
                **({"final_success": last["final/success"]} if "final/success" in last else {}),
                **{k.replace("/", "_"): v for k, v in last.items()   # per panel: final_valid_seen/success
                   if k.startswith("final_") and k.endswith("/success")},
                # the replay's diagnostics: how far the explorer is from A on the replayed tokens, and the share of replayed
                # groups with mixed outcomes (runs logged before rspo.py had them: none)
                **{k.split("/")[1]: mean_of(records[1:], k) for k in ("buffer/explorer_kl", "buffer/clip_centre_p10",
                   "buffer/clip_centre_p90", "buffer/groups_mixed") if any(k in r for r in records)},
                **({"novel_type_wins": novel_type_wins(records)} if any(k.startswith("buffer/wins/") for k in last) else {}),
                "restarts": restarts(cfg, stdout_text(path)), "cpu": run_kernels(cfg),
                "path": os.path.relpath(path, ROOT)})
    return rows


def run_kernels(cfg):
    """The CPU kernels a run's config.json says it ran on ("AVX512"; "AVX512>AVX2" when resumed on another machine;
    "" for runs made before the stack was recorded): one seed's trajectory on one kernel set differs from another's
    in the last bits, and so in its samples."""
    stacks = [cfg.get("stack", {}), *cfg.get("resumed_under", [])]
    return ">".join(s["cpu_capability"] for s in stacks if "cpu_capability" in s)


RESUMED_AT = re.compile(r"\(resumed at update (\d+)\)")   # rspo.py's end-of-run line of a resumed process


def stdout_text(path):
    """The stdout.txt of the run in `path` ("" if it has none)."""
    try:
        with open(os.path.join(path, "stdout.txt")) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def restarts(cfg, stdout):
    """How a run's metrics were made, from its own config.json (`cfg`: the flags of its last process) and
    stdout.txt text, for final.csv's `restarts`. "fresh": one process from update 0; "overwritten": the last
    process was given --overwrite (it replaced an earlier, unfinished start's files and ran from update 0);
    "resumed@U1;U2": continued from its checkpoint (--resume), once per entry, in order, at the update that
    rspo.py's end-of-run line names; "?" where no line names it (a resumed process cut off before its end, or
    an rspo.py from before the line said so). Each launch appended to stdout.txt after the first (LAUNCH
    lines) is a resume, as reproduce.py rewrites the file at each fresh start. Without LAUNCH lines stdout.txt
    holds the last process alone: resumes before it, and an --overwrite start resumed later, go unseen."""
    # the output of each launch; text before the first LAUNCH line is one of its own (an older reproduce.py's
    # start, resumed by this one)
    launched = [[]]
    for line in stdout.splitlines():
        if line.startswith(LAUNCH):
            launched.append([])
        launched[-1].append(line)
    launched = ["\n".join(lines) for lines in launched if lines]
    if len(launched) > 1:
        resumed = [m.group(1) if (m := RESUMED_AT.search(text)) else "?" for text in launched[1:]]
    else:
        resumed = RESUMED_AT.findall(stdout) or (["?"] if cfg.get("resume") else [])
    if resumed:
        return "resumed@" + ";".join(resumed)
    return "overwritten" if cfg.get("overwrite") else "fresh"


def finite(values):
    """Drop NaN: a diagnostic the method does not have (e.g. explorer success without an explorer)."""
    return [v for v in values if not math.isnan(v)]


def pct(values):
    values = finite(values)
    if not values:
        return "–"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.1f} ± {100 * sd:.1f}"


def num(values, fmt="{:.0f}"):
    values = finite(values)
    return fmt.format(statistics.mean(values)) if values else "–"


def table(head, lines):
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *["| " + " | ".join(c) + " |" for c in lines], ""]


def groups(rows, experiments):
    """(env, algo, method) -> rows, in a stable order."""
    out = {}
    for r in sorted(rows, key=lambda r: (r["env"], r["algo"], list(METHODS).index(r["method"]), r["seed"])):
        if r["experiment"] in experiments:
            out.setdefault((r["env"], r["algo"], r["method"]), []).append(r)
    return out


def paired_difference(rs, rows):
    """Success minus the base algorithm's (method `outcome`, experiment main) on the same env, algo and seed."""
    base = {(r["env"], r["algo"], r["seed"]): r["success"] for r in rows
            if r["experiment"] == "main" and r["method"] == "outcome"}
    diffs = [r["success"] - base[r["env"], r["algo"], r["seed"]] for r in rs
             if r["method"] != "outcome" and (r["env"], r["algo"], r["seed"]) in base]
    return pct(diffs) if diffs else "–"


# Student's t, two-sided 95 %, by degrees of freedom (n - 1 for n paired seeds)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093}
# The pre-registered comparisons of results/PREREGISTRATIONS.md, (env, algo, method, base method), each a table in
# tables.md:
# pre-registration 5, the primary first
REGISTERED = [("alfworld", "grpo", "rspo_progress", "outcome"),
              ("alfworld", "gigpo", "rspo_progress", "outcome"), ("alfworld", "ppo", "rspo_progress", "outcome"),
              ("alfworld", "grpo", "rspo", "outcome"), ("alfworld", "grpo", "rspo_envdense", "outcome"),
              *[("webshop", "grpo", m, "outcome") for m in ("rspo_progress", "rspo", "rspo_envdense")],
              # pre-registration 6: Figure 3 (dense reward only), Table 2's ablations, Table 1's WebShop rows
              *[(env, "grpo", m, base) for env in ("alfworld", "webshop") for m, base in
                (("dense", "outcome"), ("dense_progress", "outcome"), ("dense_progress", "rspo_progress"))],
              *[("alfworld", "grpo", m, base) for m in EXPERIMENTS["ablations"][0] for base in ("rspo", "outcome")],
              ("webshop", "gigpo", "rspo_progress", "outcome"), ("webshop", "ppo", "rspo_progress", "outcome"),
              # pre-registration 7: Table 1's learned-source rows for GiGPO and PPO
              *[(env, a, "rspo", "outcome") for env in ("alfworld", "webshop") for a in ("gigpo", "ppo")],
              # pre-registration 8: Table 2's sweeps, each setting against the default knobs; the control also against GRPO
              *[("alfworld", "grpo", m, "rspo") for m in EXPERIMENTS["sweeps"][0]],
              ("alfworld", "grpo", "rspo_alpha0", "outcome")]

def paired_interval(diffs):
    """(mean, low, high): the mean of paired differences and its 95 % Student-t interval (NaN below 2 pairs)."""
    m = statistics.mean(diffs)
    if len(diffs) < 2:
        return m, float("nan"), float("nan")
    half = T975[len(diffs) - 1] * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return m, m - half, m + half


def interval_text(diffs):
    """'+m [+lo, +hi]' in points for paired differences given as fractions; '–' for none."""
    if not diffs:
        return "–"
    m, lo, hi = paired_interval(diffs)
    return f"{100 * m:+.1f} " + ("[one seed: no interval]" if math.isnan(lo) else f"[{100 * lo:+.1f}, {100 * hi:+.1f}]")


def last_evaluations(row, n=3):
    """Mean held-out success over a run's last n evaluations (a less noisy end point)."""
    evals = [r["eval/success"] for r in read_metrics(os.path.join(ROOT, row["path"])) if "eval/success" in r]
    return statistics.mean(evals[-n:])


def paired_runs(rows, env, algo, method, base_method="outcome", base_experiment="main"):
    """[(base run, run)] by seed: `method` on `env` and `algo` against `base_method` of `base_experiment` on the same
    seed. A method's name says its experiment (main, or ablations / sweeps for Table 2); the confirm experiment has
    seeds of its own, so its runs pair only with its own base."""
    base = {r["seed"]: r for r in rows
            if (r["experiment"], r["env"], r["algo"], r["method"]) == (base_experiment, env, algo, base_method)}
    return [(base[r["seed"]], r) for r in sorted(rows, key=lambda r: r["seed"])
            if (r["env"], r["algo"], r["method"]) == (env, algo, method) and r["seed"] in base]


def primary_table(rows, env, algo, method, base_method="outcome"):
    """A pre-registered comparison (REGISTERED): final held-out success of `method` minus `base_method`'s (main), paired by
    seed, with the mean difference and its 95 % interval; beside it the pre-registered secondary end points where
    the runs have them (valid_unseen; the mean of the last three evaluations). [] before its first run."""
    pairs = paired_runs(rows, env, algo, method, base_method)
    if not pairs:
        return []
    base = {r["seed"]: b for b, r in pairs}
    rs = [r for _, r in pairs]
    ends = {"success": lambda r: r["success"], "unseen_success": lambda r: r["unseen_success"],
            "last 3": last_evaluations}
    ends = {k: f for k, f in ends.items() if k == "last 3" or all(k in r and k in base[r["seed"]] for r in rs)}
    diffs = {k: [f(r) - f(base[r["seed"]]) for r in rs] for k, f in ends.items()}
    lines = [[str(r["seed"]), f"{100 * base[r['seed']]['success']:.1f}", f"{100 * r['success']:.1f}",
              *[f"{100 * d[i]:+.1f}" for d in diffs.values()]] for i, r in enumerate(rs)]
    summary = [interval_text(d) for d in diffs.values()]
    summary[0] = f"**{summary[0]}**"
    lines.append([f"mean (n = {len(rs)})", f"{100 * statistics.mean(base[r['seed']]['success'] for r in rs):.1f}",
                  f"{100 * statistics.mean(r['success'] for r in rs):.1f}", *summary])
    names = {"success": f"Δ {rs[0]['measure']} (the measure)", "unseen_success": "Δ valid_unseen", "last 3": "Δ mean of the last 3 evaluations"}
    base_name = algo if base_method == "outcome" else f"{base_method}+{algo}"
    return [f"## Pre-registered comparison: {method}+{algo} vs {base_name} on {env} (results/PREREGISTRATIONS.md)", "",
            "Final held-out success (%), paired by seed; mean differences with their 95 % Student-t intervals.", "",
            *table(["seed", base_name, f"{method}+{algo}", *[names[k] for k in diffs]], lines)]


def confirm_pairs(rows, env, method="rspo_progress"):
    """Pre-registration 13's pairs on `env`, [(GRPO, `method`+GRPO)] by seed, once every registered seed has both
    runs; [] before (the reading waits for all of them)."""
    pairs = paired_runs(rows, env, "grpo", method, base_experiment="confirm")
    return pairs if len(pairs) == len(CONFIRM_SEEDS[env]) else []


def confirm_table(rows, env, method="rspo_progress"):
    """Pre-registration 13 on `env`: the confirm experiment's pairs (GRPO and `method`+GRPO, one seed each), read only
    when every registered seed has both runs: before that, how many pairs are in and nothing else. Then per seed
    and the mean paired difference with its 95 % t interval: final/success (the measure), valid_seen at the last
    update (eval/success), the mean of the last three evaluations; secondary 3, final/success per held-out panel
    where there are several; and secondary 1 on ALFWorld, the old measure pooled with pre-registration 5's seeds
    (main)."""
    pairs = confirm_pairs(rows, env, method)
    title = f"## Pre-registration 13: {method}+grpo vs grpo on {env}, the confirm experiment (results/PREREGISTRATIONS.md)"
    if not pairs:
        n = len(paired_runs(rows, env, "grpo", method, base_experiment="confirm"))
        return [title, "", f"{n} of {len(CONFIRM_SEEDS[env])} pairs complete: read when all are in.", ""]
    ends = {"Δ final/success (the measure)": lambda r: r["final_success"], "Δ eval/success, last update": lambda r: r["success"],
            "Δ mean of the last 3 evaluations": last_evaluations}
    diffs = {k: [f(b) - f(a) for a, b in pairs] for k, f in ends.items()}
    lines = [[str(b["seed"]), f"{100 * a['final_success']:.1f}", f"{100 * b['final_success']:.1f}",
              *[f"{100 * d[i]:+.1f}" for d in diffs.values()]] for i, (a, b) in enumerate(pairs)]
    lines.append([f"mean (n = {len(pairs)})", f"{100 * statistics.mean(a['final_success'] for a, _ in pairs):.1f}",
                  f"{100 * statistics.mean(b['final_success'] for _, b in pairs):.1f}",
                  *[interval_text(d) for d in diffs.values()]])
    out = [title, "", "final/success (%): every held-out task played several times after the last update; paired by "
           "seed, mean differences with their 95 % Student-t intervals.", "",
           *table(["seed", "grpo", f"{method}+grpo", *diffs], lines)]
    panels = [k for k in pairs[0][0] if k.startswith("final_") and k.endswith("_success") and k != "final_success"]
    if len(panels) > 1:
        out += ["Secondary 3, per panel: " + "; ".join(f"Δ {k[len('final_'):-len('_success')]} "
                                                       f"{interval_text([b[k] - a[k] for a, b in pairs])}"
                                                       for k in panels), ""]
    mixed = [(a, b) for a, b in pairs if a.get("cpu") != b.get("cpu")]
    if mixed:   # added after part A was read and before part B was: docs/reproduction.md, "Determinism"
        same = [b["final_success"] - a["final_success"] for a, b in pairs if a.get("cpu") == b.get("cpu")]
        out += ["CPU kernels differ between the arms of " + ", ".join(f"seed {b['seed']} ({a.get('cpu') or '?'} / "
                                                                       f"{b.get('cpu') or '?'})" for a, b in mixed)
                + f" (exploratory): Δ final/success over the other {len(same)} pairs {interval_text(same)}", ""]
    old = [r["success"] - b["success"] for b, r in paired_runs(rows, env, "grpo", method)]
    if old:
        pooled = old + diffs["Δ eval/success, last update"]
        out += [f"Secondary 1: Δ eval/success at the last update, pooled with pre-registration 5's {len(old)} seeds "
                f"(n = {len(pooled)}): {interval_text(pooled)}", ""]
    return out


# Table 1 of the paper (Qwen2.5-1.5B-Instruct, 3 seeds): RSPO+X minus X, points; the paper gives no spread.
PAPER_GAINS = {"alfworld": {"grpo": 5.7, "gigpo": 1.6, "ppo": 8.6}, "webshop": {"grpo": 5.5, "gigpo": 7.9, "ppo": 12.0}}
# Where the main experiment's RSPO rows of the current regime were registered (WebShop's: the 15-step regime).
MAIN_REGISTRATION = {"alfworld": "pre-registration 5", "webshop": "pre-registration 13, part C"}


def table1_effects(rows):
    """The paper's Table 1 gains beside ours: {(env, algo): (paper's gain in points, our paired differences, reading)}.
    Ours: RSPO (the progress source)+X minus X per seed, as fractions ([] until they are read). For GRPO the
    confirmatory reading (pre-registration 13, final/success) once all its pairs are in; until then, and for GiGPO
    and PPO, the main experiment's (held-out success after the last update; registered in MAIN_REGISTRATION), drawn
    once the registered seeds (SEEDS) all have both runs: before that no pairs, and the reading says how many are in."""
    out = {}
    for env, gains in PAPER_GAINS.items():
        for algo, paper in gains.items():
            pairs, key, reading = confirm_pairs(rows, env), "final_success", "pre-registration 13"
            if algo != "grpo" or not pairs:
                pairs, key, reading = paired_runs(rows, env, algo, "rspo_progress"), "success", MAIN_REGISTRATION[env]
                if len(pairs) < len(SEEDS):   # a part is read only when all its pairs are in
                    pairs, reading = [], f"{len(pairs)} of {len(SEEDS)} pairs in" if pairs else "not run"
            out[env, algo] = paper, [r[key] - b[key] for b, r in pairs], reading
    return out


def table1_table(rows):
    """tables.md's view of table1_effects."""
    lines = [[env, algo, f"{paper:+.1f}", interval_text(diffs) if diffs else reading, str(len(diffs)),
              reading if diffs else "–"] for (env, algo), (paper, diffs, reading) in table1_effects(rows).items()]
    return ["## The paper's Table 1 beside ours", "",
            "RSPO+X minus X in points: the paper's (Qwen2.5-1.5B-Instruct, 3 seeds, no spread given) and ours (the "
            "progress source, paired by seed, mean [95 % t interval]); drawn in `table1.png`.", "",
            *table(["env", "base", "paper", "ours", "seeds", "reading"], lines)]


def results_table(rows, experiments, reference=()):
    """Success (and WebShop's score, ALFWorld's task types) with the costs, mean ± std over seeds.
    reference: methods of the main experiment shown first, for the (env, algo) pairs the table has."""
    out = []
    pairs = {(r["env"], r["algo"]) for r in rows if r["experiment"] in experiments}
    sel = {**groups([r for r in rows if r["method"] in reference and (r["env"], r["algo"]) in pairs], {"main"}),
           **groups(rows, experiments)}
    for env in sorted({k[0] for k in sel}):
        types = sorted({t for (e, _, _), rs in sel.items() if e == env for r in rs for t in r
                        if t.startswith("eval/success/")})
        # The new regime's warm start: its own success is the start; RL's gain over it is paired per seed.
        warm = any("warmstart_success" in r for rs in sel.values() for r in rs)
        unseen = any("unseen_success" in r for (e, _, _), rs in sel.items() if e == env for r in rs)
        head = ["algo", "method", "n", "success (start → end)", "Δ vs outcome (same seeds)",
                *(["RL's gain over the warm start"] if warm else []), *(["valid_unseen"] if unseen else []),
                *(["score"] if env == "webshop" else []),
                "A updates", "env steps (all)", "seconds (all)", *[t.split("/")[-1].replace("_", " ") for t in types]]
        lines = []
        for (e, algo, method), rs in sel.items():
            if e == env:
                lines.append([algo, method, str(len(rs)),
                              f"{pct([r['start_success'] for r in rs])} → **{pct([r['success'] for r in rs])}**",
                              paired_difference(rs, rows),
                              *([pct([r["success"] - r["start_success"] for r in rs])] if warm else []),
                              *([pct([r.get("unseen_success", float("nan")) for r in rs])] if unseen else []),
                              *([pct([r["score"] for r in rs])] if env == "webshop" else []),
                              str(rs[0]["a_updates"]), num([r["env_steps_total"] for r in rs]),
                              num([r["wall_seconds"] for r in rs]), *[pct([r.get(t, float("nan")) for r in rs]) for t in types]])
        out += [f"### {env}", "", *table(head, lines)]
    return out


def diagnostics_table(rows, experiments):
    """One row per (env, algo, method); the mixed-group share and the explorer's distance from A only where runs
    logged them."""
    kl = any("explorer_kl" in r for r in rows)
    mixed = any("groups_mixed" in r for r in rows)   # logged since 2026-12-03
    head = ["env", "algo", "method", "A's training success", "explorer success", "buffer groups with a success",
            *(["buffer groups with a success and a failure"] if mixed else []),
            *(["KL(B ‖ A) per token", "clip centre p10 / p90", "replayed wins on types A had not won (%)"] if kl else []),
            "distinct states (A)", "env steps A / B / estimator", "seconds A / B / estimator"]
    lines = []
    for (env, algo, method), rs in groups(rows, experiments).items():
        def val(k, fmt):
            return num([r.get(k, float("nan")) for r in rs], fmt)
        lines.append([env, algo, method, pct([r["train_success"] for r in rs]), pct([r["explorer_success"] for r in rs]),
                      pct([r["buffer_groups_with_success"] for r in rs]),
                      *([pct([r.get("groups_mixed", float("nan")) for r in rs])] if mixed else []),
                      *([val("explorer_kl", "{:.4f}"), f"{val('clip_centre_p10', '{:.2f}')} / {val('clip_centre_p90', '{:.2f}')}",
                         pct([r.get("novel_type_wins", float("nan")) for r in rs])] if kl else []),
                      num([r["distinct_states"] for r in rs]),
                      " / ".join(num([r[f"env_steps_{k}"] for r in rs]) for k in ("A", "B", "prm")),
                      " / ".join(num([r[f"seconds_{k}"] for r in rs]) for k in ("A", "B", "prm"))])
    return table(head, lines)


def win_count(row, who, kind):
    """A run's successful episodes of task type `kind` ("train": A's own, "buffer": replayed): 0 for a type
    it never won, NaN ("–") when it has no such counts at all (no buffer without RSPO)."""
    has = any(c.startswith(f"{who}/wins/") for c in row)
    return row.get(f"{who}/wins/{kind}", 0 if has else float("nan"))


def wins_table(rows, experiments):
    """Successful training episodes per task type over the whole run: A's own rollouts / the buffer groups
    replayed to A (mean over seeds; runs logged before rspo.py counted them are left out)."""
    sel = {k: [r for r in rs if any("/wins/" in c for c in r)] for k, rs in groups(rows, experiments).items()}
    sel = {k: rs for k, rs in sel.items() if rs}
    out = []
    for env in sorted({k[0] for k in sel}):
        types = sorted({c.split("/")[-1] for (e, _, _), rs in sel.items() if e == env for r in rs for c in r
                        if "/wins/" in c})
        head = ["algo", "method", "n", *[t.replace("_", " ") for t in types]]
        lines = [[algo, method, str(len(rs)), *[" / ".join(num([win_count(r, who, t) for r in rs])
                                                          for who in ("train", "buffer")) for t in types]]
                 for (e, algo, method), rs in sel.items() if e == env]
        out += [f"### {env}", "", *table(head, lines)]
    return out


def estimator_table(rows):
    """The progress estimator's fit on its held-out episodes, one row per env and seed (the file is shared), with
    its data: the backbone, episodes of the starting policy + of the noisy expert, passes (20 % held out)."""
    head = ["env", "seed", "data", "held-out loss", "mean abs(sum r_hat - R)", "corr(r_hat, progress gain)",
            "same, first steps left out"]
    seen, lines = set(), []
    for r in sorted(rows, key=lambda r: (r["env"], r["seed"])):
        if "prm/heldout_loss" in r and (r["env"], r["seed"]) not in seen:
            seen.add((r["env"], r["seed"]))
            lines.append([r["env"], str(r["seed"]), r["estimator_data"], *[f"{r[f'prm/heldout_{k}']:.3f}" for k in
                          ("loss", "sum_error", "corr_progress", "corr_progress_after_first")]])
    return table(head, lines)


def at_cost(records, key, budget):
    """The last evaluation of a run reached within `budget` of cost `key` (A's env steps or seconds)."""
    evals = [r for r in records if "eval/success" in r and r[key] <= budget]
    return evals[-1] if evals else None


def equal_cost_table(rows):
    """RSPO+GRPO against GRPO given the same total env steps, or the same total seconds, as RSPO used, per seed;
    then per env and RSPO method the mean paired difference RSPO - GRPO at equal cost with its 95 % interval
    (pre-registration 6). RSPO's cost includes the estimator's fit, shared by the runs of one env and seed but
    charged in full."""
    methods = [m for m in ("rspo", "rspo_progress") if any(r["method"] == m for r in rows)]
    head = ["env", "RSPO method", "seed", "RSPO success", "RSPO env steps",
            "GRPO at equal A updates", "GRPO at equal env steps (updates)", "RSPO seconds", "GRPO at equal seconds (updates)"]
    lines, diffs = [], defaultdict(lambda: ([], []))   # (env, method) -> RSPO - GRPO at equal env steps, seconds
    for r in [r for r in rows if r["experiment"] == "main" and r["algo"] == "grpo" and r["method"] in methods]:
        long = [x for x in rows if x["experiment"] == "equal_cost" and x["env"] == r["env"] and x["seed"] == r["seed"]]
        base = [x for x in rows if x["experiment"] == "main" and x["env"] == r["env"] and x["seed"] == r["seed"]
                and x["algo"] == "grpo" and x["method"] == "outcome"]
        if not long or not base:
            continue
        records = read_metrics(os.path.join(ROOT, long[0]["path"]))
        by_steps = at_cost(records, "env_steps/A", r["env_steps_total"])
        by_time = at_cost(records, "time/A_seconds", r["wall_seconds"])
        def show(x):   # "whole run": the longer run ended inside the budget (it never reached RSPO's cost)
            return "–" if x is None else f"{100 * x['eval/success']:.1f} ({x['update']}" + \
                (", whole run)" if x["update"] == records[-1]["update"] else ")")
        lines.append([r["env"], r["method"], str(r["seed"]), f"{100 * r['success']:.1f}", f"{r['env_steps_total']}",
                      f"{100 * base[0]['success']:.1f}", show(by_steps), f"{r['wall_seconds']:.0f}", show(by_time)])
        for d, x in zip(diffs[r["env"], r["method"]], (by_steps, by_time)):
            d += [] if x is None else [r["success"] - x["eval/success"]]
    for (env, method), (steps, secs) in diffs.items():
        lines.append([env, method, f"mean Δ RSPO − GRPO (n = {len(steps)})", "", "", "",
                      interval_text(steps), "", interval_text(secs)])
    return table(head, lines)


def papers_shape(records, drop=0.10, window=10):
    """Figure 3's shape in one dense-only run (pre-registration 6): the final held-out success at least `drop` below
    the run's best evaluation while the mean dense return per episode of the last `window` updates is above that of
    the first `window`. Returns (best evaluation's record, final success, first dense return, last, shape?)."""
    evals = [x for x in records if "eval/success" in x]
    ret = [x["train/dense_return"] for x in records if "train/dense_return" in x]
    best = max(evals, key=lambda x: x["eval/success"])   # the first of equals
    first, last = statistics.mean(ret[:window]), statistics.mean(ret[-window:])
    final = evals[-1]["eval/success"]
    return best, final, first, last, round(best["eval/success"] - final, 9) >= drop and last > first


def shape_table(rows):
    """Figure 3's shape (papers_shape) per dense-only run, and per env and dense source how many seeds show it."""
    head = ["env", "dense source", "seed", "best (update)", "final", "dense return, first 10 updates", "last 10",
            "the paper's shape"]
    lines = []
    for (env, _, method), rs in groups(rows, {"dense"}).items():
        shapes = [papers_shape(read_metrics(os.path.join(ROOT, r["path"]))) for r in rs]
        for r, (best, final, first, last, shape) in zip(rs, shapes):
            lines.append([env, method, str(r["seed"]), f"{100 * best['eval/success']:.1f} ({best['update']})",
                          f"{100 * final:.1f}", f"{first:.3f}", f"{last:.3f}", "yes" if shape else "no"])
        lines.append([env, method, f"{sum(s[-1] for s in shapes)} of {len(shapes)} seed" + "s" * (len(shapes) > 1), "", "", "", "", ""])
    intro = ["The paper's shape per run (the rule of results/PREREGISTRATIONS.md's pre-registration 6): the final held-out "
             "success",
             "at least 10 points below the run's best evaluation while the mean dense return per episode of the last 10",
             "updates is above that of the first 10.", ""]
    return intro + table(head, lines) if lines else []


def tables(rows):
    """tables.md: the fair test (pre-registration 13) and the pre-registered comparisons (REGISTERED), then every
    experiment's table."""
    out = ["# Results tables (generated by `python scripts/reproduce.py --report`)", "",
           "Held-out success (%) at the start and end of training, mean ± std over the seeds (n); WebShop's",
           "score is the mean purchase reward × 100. Costs include the explorer B and the progress estimator's fit.", "",
           *[line for env in ("alfworld", "webshop") for line in confirm_table(rows, env)],
           *table1_table(rows),
           *[line for comparison in REGISTERED for line in primary_table(rows, *comparison)],
           "## Main comparison: base algorithm vs RSPO (learned progress estimator) vs RSPO (env dense reward)", "",
           *results_table(rows, {"main"}),
           "## Diagnostics", "", "explorer success: B's success on its last training batch of each cycle, mean over",
           "cycles; buffer groups: the share of A's replayed buffer groups holding a success; distinct states:",
           "observations A saw during training (the paper's Appendix E).", "",
           *diagnostics_table(rows, {"main", "ablations", "sweeps"}),
           "Successful training episodes per task type, summed over the run: A's own rollouts / episodes of the",
           "buffer groups replayed to A (mean over seeds). Which kinds of task the explorer brings successes on.", "",
           *wins_table(rows, {"main", "ablations", "sweeps"}),
           "The learned progress estimator:", "", *estimator_table(rows),
           "## Equal total cost (RSPO+GRPO vs GRPO run longer)", "",
           "GRPO's held-out success at its last evaluation within RSPO's total env steps (A + B + estimator)",
           "or total seconds; in brackets the updates of A it had made by then.", "",
           *equal_cost_table(rows),
           "## Dense reward only (Figure 3)", "", *results_table(rows, {"dense"}, ("outcome",)),
           *shape_table(rows),
           "## Ablations (Table 2)", "", *results_table(rows, {"ablations"}, ("outcome", "rspo")),
           "## Sweeps of RSPO's knobs within the paper's ranges", "", *results_table(rows, {"sweeps"}, ("outcome", "rspo"))]
    return "\n".join(out)


def curve(rows):
    """(updates, mean, min, max) of held-out success over runs at each evaluation (runs share their
    evaluation updates)."""
    runs = [[(x["update"], x["eval/success"]) for x in read_metrics(os.path.join(ROOT, r["path"]))
             if "eval/success" in x] for r in rows]
    n = min(len(c) for c in runs)
    return ([statistics.mean(c[i][0] for c in runs) for i in range(n)],
            [statistics.mean(c[i][1] for c in runs) for i in range(n)],
            [min(c[i][1] for c in runs) for i in range(n)], [max(c[i][1] for c in runs) for i in range(n)])


def figures(rows, results):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figures")
        return
    # The paper's Table 1 beside ours (table1_effects): one panel per benchmark, one column per base algorithm.
    effects = table1_effects(rows)
    fig, axes = plt.subplots(1, len(PAPER_GAINS), figsize=(9, 3.5), sharey=True)
    for ax, env in zip(axes, PAPER_GAINS):
        for x, algo in enumerate(PAPER_GAINS[env]):
            paper, diffs, reading = effects[env, algo]
            ax.plot(x - 0.12, paper, "D", color="C1", label=None if x else "paper (Qwen2.5-1.5B, 3 seeds)")
            if not diffs:
                ax.annotate(reading, (x + 0.12, 0), rotation=90, ha="center", va="bottom", fontsize=8)
                continue
            m, lo, hi = (100 * v for v in paired_interval(diffs))
            err = None if math.isnan(lo) else [[m - lo], [hi - m]]
            ax.errorbar(x + 0.12, m, yerr=err, fmt="o", color="C0", capsize=3,
                        label=None if x else "ours (tiny model), 95 % interval")
            ax.annotate(f"{len(diffs)} seeds", (x + 0.17, m), fontsize=7, va="center")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set(xticks=range(len(PAPER_GAINS[env])), xticklabels=[a.upper() for a in PAPER_GAINS[env]],
               xlim=(-0.5, len(PAPER_GAINS[env]) - 0.5), title=env)
    axes[0].set_ylabel("RSPO+X minus X (points)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(os.path.join(results, "table1.png"))
    plt.close(fig)
    main = groups(rows, {"main"})
    for env in sorted({k[0] for k in main}):
        algos = sorted({k[1] for k in main if k[0] == env})
        fig, axes = plt.subplots(1, len(algos), figsize=(4.5 * len(algos), 3.5), squeeze=False)
        for ax, algo in zip(axes[0], algos):
            for (e, a, method), rs in main.items():
                if (e, a) == (env, algo):
                    xs, ys, lo, hi = curve(rs)
                    ax.plot(xs, ys, "o-", label=f"{method} (n={len(rs)})")
                    ax.fill_between(xs, lo, hi, alpha=0.15)
            ax.set(title=f"{env}: {algo}", xlabel="updates of A", ylabel="held-out success (mean, min-max)")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(results, f"curves_{env}.png"))
        plt.close(fig)
        # Equal total cost: success against all env steps paid (A + explorer + estimator).
        long = groups(rows, {"equal_cost"}).get((env, "grpo", "outcome_long"))
        seeds = {r["seed"] for r in long or []}   # the RSPO runs GRPO was run longer for, as in equal_cost_table
        rspo = [(f"RSPO+GRPO ({m})", [r for r in main[env, "grpo", m] if r["seed"] in seeds])
                for m in ("rspo_progress", "rspo") if (env, "grpo", m) in main]
        if rspo and long:
            fig, ax = plt.subplots(figsize=(5, 3.5))
            for colour, (label, rs) in enumerate([("GRPO (run longer)", long), *rspo]):
                runs = [read_metrics(os.path.join(ROOT, r["path"])) for r in rs]
                for i, rec in enumerate(runs):
                    ev = [x for x in rec if "eval/success" in x]
                    cost = [x["env_steps/A"] + x["env_steps/B"] + x.get("env_steps/prm", 0) for x in ev]
                    ax.plot(cost, [x["eval/success"] for x in ev], "o-", color=f"C{colour}",
                            alpha=0.7, label=label if i == 0 else None)
            ax.set(title=f"{env}: equal total cost", xlabel="env steps (A + explorer + estimator)",
                   ylabel="held-out success")
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(os.path.join(results, f"equal_cost_{env}.png"))
            plt.close(fig)
    # Figure 3: one panel per dense source, held-out success against the dense return it climbs; the base
    # algorithm's mean curve (outcome reward, same seeds and warm start) for reference.
    dense = groups(rows, {"dense"})
    for env in sorted({k[0] for k in dense}):
        panels = [(key, rs) for key, rs in dense.items() if key[0] == env]
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
        for ax, ((_, algo, method), rs) in zip(axes[0], panels):
            ax2 = ax.twinx()
            seeds = {r["seed"] for r in rs}
            base = [r for r in main.get((env, algo, "outcome"), []) if r["seed"] in seeds]
            if base:
                xs, ys, _, _ = curve(base)
                ax.plot(xs, ys, "--", color="grey", label=f"{algo}, outcome reward (mean)")
            for i, r in enumerate(rs):
                records = read_metrics(os.path.join(ROOT, r["path"]))
                ev = [x for x in records if "eval/success" in x]
                tr = [x for x in records if "train/dense_return" in x]
                ax.plot([x["update"] for x in ev], [x["eval/success"] for x in ev], "o-", color="C0", alpha=0.7,
                        label="held-out success" if i == 0 else None)
                ret = [x["train/dense_return"] for x in tr]   # smoothed over 10 updates: one batch is noisy
                ax2.plot([x["update"] for x in tr], [statistics.mean(ret[max(0, j - 9):j + 1]) for j in range(len(ret))],
                         color="C3", alpha=0.7)
            ax.set(xlabel="updates (dense reward only)", title=f"{env}: {method} ({len(rs)} seeds)")
            ax.set_ylabel("held-out success", color="C0")
            ax2.set_ylabel("dense return (training, 10-update mean)", color="C3")
            ax.legend(fontsize=8, loc="lower left")
        fig.tight_layout()
        fig.savefig(os.path.join(results, f"dense_only_{env}.png"))
        plt.close(fig)


FIELDS = ["experiment", "env", "algo", "method", "seed", "success", "score", "a_updates", "env_steps_total",
          "wall_seconds", "env_steps_A", "env_steps_B", "env_steps_prm", "seconds_A", "seconds_B", "seconds_prm",
          "train_success", "explorer_success", "buffer_groups_with_success", "distinct_states", "final_success",
          "final_valid_seen_success", "final_valid_unseen_success", "warmstart_success", "unseen_success",
          "env_steps_warmstart", "seconds_warmstart", "explorer_kl",
          "clip_centre_p10", "clip_centre_p90", "novel_type_wins", "groups_mixed", "restarts", "cpu", "path"]


def report():
    """final.csv, tables.md and the figures of the runs under RESULTS, written there."""
    name = os.path.relpath(RESULTS)
    rows = final_rows(RESULTS)
    if not rows:
        print(f"no complete runs under {name}/")
        return
    with open(os.path.join(RESULTS, "final.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(RESULTS, "tables.md"), "w") as f:
        f.write(tables(rows) + "\n")
    figures(rows, RESULTS)
    print(f"{len(rows)} runs -> {name}/final.csv, {name}/tables.md, {name}/*.png")


def metrics_difference(rerun, committed):
    """None when every committed metric comes back: the same records, each committed value (wall-clock times
    aside) equal in the rerun, compared as JSON so NaN equals NaN; a rerun may log more keys (a newer trainer).
    Otherwise the first difference in words: a changed value, a record count, or the committed keys the rerun
    no longer logs while every value it does log is equal (a metric moved out of the trainer, say)."""
    if len(rerun) != len(committed):
        return f"{len(rerun)} records, committed {len(committed)}"
    missing = set()
    for n, (new, old) in enumerate(zip(rerun, committed)):
        for k, v in old.items():
            if k.startswith("time/"):
                continue
            if k not in new:
                missing.add(k)
            elif json.dumps(new[k]) != json.dumps(v):
                return (f"record {n} (update {old.get('update', '?')}): {k} = {json.dumps(new[k])}, "
                        f"committed {json.dumps(v)}")
    return f"every logged value equal, but the rerun does not log {', '.join(sorted(missing))}" if missing else None


@contextmanager
def checkout(commit):
    """The repository at `commit` in a temporary git worktree, removed afterwards (also on error)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "tree")
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", tree, commit], cwd=ROOT, check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, check=True)


def for_old_trainer(cmd, tree):
    """`cmd` as the rspo.py in `tree` reads it. `--method` was called `--reward` (same choices) until it was
    renamed; the committed command.txt files say `--method`, so at a commit whose rspo.py has no `--method` flag
    the rerun passes `--reward X` instead. Used for checked-out commits only (not --verify --here)."""
    with open(os.path.join(tree, "rspo.py")) as f:
        if re.search(r"""["']--method["']""", f.read()):   # the flag is defined there: nothing to translate
            return cmd
    return ["--reward" + a[len("--method"):] if a == "--method" or a.startswith("--method=") else a for a in cmd]


def rerun(path, tree):
    """Run `path`'s command.txt in the source tree `tree` into a temporary directory; its metrics."""
    with open(os.path.join(path, "command.txt")) as f:
        cmd = shlex.split(f.read())
    if tree != ROOT:   # a checkout of the commit that made the run: perhaps from before --method
        cmd = for_old_trainer(cmd, tree)
    estimator = flag(cmd, "--prm-path")
    if estimator and not os.path.exists(os.path.join(tree, estimator)) and os.path.exists(os.path.join(ROOT, estimator)):
        # Estimators are not committed (results/estimators/ is ignored): the rerun at an old commit loads
        # the one the runs share where it lies (rspo.py only reads an existing file, never rewrites it).
        cmd[cmd.index("--prm-path") + 1] = os.path.join(ROOT, estimator)
    with tempfile.TemporaryDirectory() as out:
        cmd[cmd.index("--output-dir") + 1] = out
        subprocess.run([sys.executable, *cmd[1:], *THREADS], cwd=tree, check=True, stdout=subprocess.DEVNULL)
        return read_metrics(out)


def verify(paths, here=False):
    """Rerun each committed run's command.txt at the commit that made it (config.json's git_commit) and
    compare its metrics; a run that names no commit reruns with the current tree. here: every run reruns with
    the current tree (do later changes keep behaviour?)."""
    ok, stack = True, software_stack()
    for path in paths:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        commit = None if here else cfg.get("git_commit")
        if commit and subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT,
                                     capture_output=True).returncode:
            print(f"{path}: FAILED: the commit that made it, {commit}, is not in this repository")
            ok = False
            continue
        if not commit and not here:
            print(f"{path}: config.json names no commit: rerun with the current tree")
        elif commit and cfg.get("git_dirty"):
            print(f"{path}: warning: made from uncommitted changes to {commit}; rerun at {commit} anyway")
        if cfg.get("stack", stack) != stack:
            print(f"{path}: warning: made under {cfg['stack']}, rerun under {stack}; sampled actions may then differ")
        if cfg.get("resumed_under"):
            print(f"{path}: warning: started under {cfg['stack']}, resumed under {cfg['resumed_under']}: no one stack "
                  "reruns it")
        with checkout(commit) if commit else nullcontext(ROOT) as tree:
            difference = metrics_difference(rerun(path, tree), read_metrics(path))
        print(f"{path}: {'identical metrics' if difference is None else 'DIFFERENT metrics: ' + difference}"
              + (f" (rerun at {commit})" if commit else " (rerun with the current tree)" if here else ""))
        ok &= difference is None
    return ok


def plan_options():
    """The options that choose a plan's runs: main's, and those of each line of a --batch file."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--experiments", nargs="+", default=list(EXPERIMENTS), choices=list(EXPERIMENTS))
    p.add_argument("--envs", nargs="+", default=["alfworld", "webshop"], choices=["alfworld", "webshop"])
    p.add_argument("--algos", nargs="+", default=["grpo", "ppo", "gigpo"], choices=["grpo", "ppo", "gigpo"])
    p.add_argument("--methods", nargs="+", choices=list(METHODS), help="only these methods (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, help=f"default {SEEDS}; the confirm experiment's own: {CONFIRM_SEEDS}")
    return p


def batch_plan(file):
    """The jobs of several plans in one list: each line of `file` holds one plan's options ('#' starts a comment),
    and the jobs keep the file's order, each once. So a batch of several commands keeps every worker busy, where the
    commands run one after another leave workers idle at each one's tail."""
    with open(file) as f:
        lines = f.readlines()
    jobs = []
    for n, line in enumerate(lines, 1):
        words = shlex.split(line, comments=True)
        if words:
            options = argparse.ArgumentParser(prog=f"{file}, line {n}", parents=[plan_options()], add_help=False)
            jobs += [job for job in plan(options.parse_args(words)) if job not in jobs]
    return jobs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[plan_options()])
    p.add_argument("--batch", metavar="FILE", help="run the plans of FILE's lines (each line: the options above) "
                                                   "in one pool, in order, instead of the options'")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (one torch thread each)")
    p.add_argument("--list", action="store_true", help="print the commands and exit")
    p.add_argument("--report", action="store_true", help="only rebuild final.csv, tables and figures")
    p.add_argument("--verify", nargs="+", metavar="RUN_DIR",
                   help="rerun these committed runs from their command.txt at the commit that made them "
                        "and check the metrics match")
    p.add_argument("--here", action="store_true",
                   help="with --verify: rerun with the current tree instead (do later changes keep behaviour?)")
    args = p.parse_args(argv)
    if args.report:
        return report()
    if args.verify:
        sys.exit(0 if verify(args.verify, args.here) else 1)
    defaults = vars(plan_options().parse_args([]))
    if args.batch and any(getattr(args, k) != v for k, v in defaults.items()):
        p.error("--batch takes each plan's options from its file's lines, not from the command line")
    try:
        jobs = batch_plan(args.batch) if args.batch else plan(args)
    except OSError as e:
        p.error(f"--batch {args.batch}: {e.strerror}")
    if args.list:
        for job in jobs:
            print(shlex.join(command(*job)))
        return
    print(f"{len(jobs)} runs, {args.jobs} at a time")
    with ThreadPoolExecutor(args.jobs) as pool:
        for job, status, seconds in pool.map(execute, jobs):
            print(f"{'/'.join(map(str, job))}: {status} {seconds:.0f}s", flush=True)
    report()


if __name__ == "__main__":
    main()
