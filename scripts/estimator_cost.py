"""What fitting the learned progress estimator (--dense-reward learned) costs, and what each setting buys.

    python scripts/estimator_cost.py                                   # WebShop, the main settings
    python scripts/estimator_cost.py --env alfworld --max-steps 30     # flags replace the defaults of the same name
    python scripts/estimator_cost.py --variants "" "--prm-freeze"      # each variant: extra rspo flags

The policy is warm-started once (as every run does), then the estimator is fitted once per variant from that same
starting policy (the fit has its own RNG streams and leaves the policy untouched). Printed per variant: the CPU
seconds of the data collection and of the fit (process time: with one torch thread on an otherwise idle machine
this is the wall time; on a loaded one the wall time is not), the fit's wall seconds (with `--threads 2` in a
variant, the fit runs on two threads: compare wall seconds on an idle machine), the tokens per step the estimator
reads, and the fit's held-out loss, sum error and per-step correlation with the progress increments.
"""

import os
import shlex
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import profile_run  # noqa: E402  (scripts/: its flag merging)
import rspo  # noqa: E402

DEFAULTS = ["--env", "webshop", "--num-groups", "8", "--group-size", "8", "--max-steps", "10", "--warm-start",
            "1000", "--warm-start-epochs", "3", "--lr", "1e-4", "--dense-reward", "learned", "--threads", "1",
            "--no-progress"]


def parse(argv):
    """(rspo flags: DEFAULTS overridden by argv's, variants)."""
    variants = [""]
    if "--variants" in argv:
        i = argv.index("--variants")
        variants, argv = argv[i + 1:], argv[:i]
    return profile_run.merged(argv, DEFAULTS), variants


def fit_once(policy, argv):
    """Fit a fresh estimator for the run `argv` describes, from `policy`: (CPU seconds collecting, CPU seconds
    fitting, wall seconds fitting, env steps, mean tokens per step, the fit's stats)."""
    cfg = rspo.configure(argv)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    dense = rspo.build_dense_source(policy, cfg)
    fitting, wall, fit = [0.0], [0.0], rspo.fit_estimator

    def timed_fit(*args, **kwargs):
        start, start_wall = time.process_time(), time.perf_counter()
        try:
            return fit(*args, **kwargs)
        finally:
            fitting[0] += time.process_time() - start
            wall[0] += time.perf_counter() - start_wall
    rspo.fit_estimator = timed_fit
    try:
        cpu = time.process_time()
        stats, steps, _ = rspo.fit_or_load_estimator(dense, policy, cfg)
        seconds = time.process_time() - cpu
    finally:
        rspo.fit_estimator = fit
    tokens = np.mean([len(s.prompt_ids) + len(s.response_ids) for t in dense.train_trajs + dense.heldout_trajs for s in t.steps])
    return seconds - fitting[0], fitting[0], wall[0], steps, tokens, stats


def main(argv=None):
    flags, variants = parse(sys.argv[1:] if argv is None else argv)
    cfg = rspo.configure(flags)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    policy = rspo.build_policy(cfg, rspo.pick_device(cfg.device))
    cpu = time.process_time()
    rspo.warm_start(policy, cfg)
    print(f"warm start: {time.process_time() - cpu:.0f} CPU s ({shlex.join(flags)})")
    print("| variant | CPU s: collect | CPU s: fit | wall s: fit | env steps | tokens / step | held-out loss | sum error |"
          " corr(progress) | corr after step 1 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for variant in variants:
        collect, fitting, wall, steps, tokens, s = fit_once(policy, flags + shlex.split(variant))
        print(f"| {variant or '(defaults)'} | {collect:.0f} | {fitting:.0f} | {wall:.0f} | {steps} | {tokens:.0f} | {s['prm/heldout_loss']:.3f} | "
              f"{s['prm/heldout_sum_error']:.3f} | {s['prm/heldout_corr_progress']:.3f} | "
              f"{s['prm/heldout_corr_progress_after_first']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
