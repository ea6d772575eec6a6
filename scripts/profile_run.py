"""Where the time of a run goes: rspo.main with timers wrapped around its parts (monkeypatching, rspo.py unchanged).

    python scripts/profile_run.py                          # default: ALFWorld, outcome+GRPO, --warm-start 200, 6 updates
    python scripts/profile_run.py --env webshop            # flags replace the defaults of the same name
    python scripts/profile_run.py -- --env alfworld ...    # after --: exactly these rspo flags, no defaults

Prints two tables. Phases (exclusive, they add up to the run): warm start, evaluation, explorer B (--method rspo),
training rollouts, update, setup/other. Components (inclusive, per phase): decoding (Policy.act, the sampler; or
the demonstrator in the warm start), env construction (envs.make_env), env reset+step, prompt rendering
(build_prompt) and encoding (encode_prompt), scoring (rspo.score_steps, no gradients), forward with gradients
(Policy.forward outside scoring), backward (Tensor.backward), optimizer step, model copy (deepcopy). Each row also
has the peak RSS sampled (every 20 ms) while it ran. Wall times on a loaded machine are inflated; the shares are
the robust part. --warm-start needs ALFWorld: profile WebShop with --env webshop --warm-start 0.
"""

import contextlib
import copy
import os
import resource
import sys
import tempfile
import threading
import time
import types
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs  # noqa: E402
import rspo  # noqa: E402

DEFAULTS = ["--env", "alfworld", "--method", "outcome", "--algo", "grpo", "--warm-start", "200", "--updates", "6",
            "--eval-every", "3", "--eval-episodes", "64", "--no-save-model", "--no-progress", "--threads", "1"]
PHASES = {"warm_start": "warm start", "evaluate": "evaluation", "explorer_phase": "explorer B (--method rspo)",
          "rollout": "training rollouts", "update": "update"}

seconds, calls = defaultdict(float), defaultdict(int)   # keyed by (phase, component)
peak_rss = defaultdict(int)   # bytes: the largest resident set sampled while (phase, component) ran
active = defaultdict(int)     # (phase, component) -> how many of its calls are running now
stack = []   # phases entered, innermost last
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def sample_rss(interval=0.02):
    """Background thread: every `interval` s, the current RSS raises the peak of every part running now
    (torch's kernels release the GIL, so it samples inside long forward/backward calls too)."""
    while True:
        r = rss()
        for key, n in list(active.items()):
            if n:
                peak_rss[key] = max(peak_rss[key], r)
        time.sleep(interval)


def phase():
    return stack[-1] if stack else "setup/other"


@contextlib.contextmanager
def measured(name, is_phase=False):
    """Time the block (and sample the RSS while it runs) as `name`: a phase, or a component of the phase running
    now. A phase inside another (rollout inside evaluate/warm_start) belongs to the outer."""
    if is_phase and stack:
        yield
        return
    key = (name if is_phase else phase(), None if is_phase else name)
    if is_phase:
        stack.append(name)
    active[key] += 1
    t = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] += time.perf_counter() - t
        calls[key] += 1
        active[key] -= 1
        if is_phase:
            stack.pop()


def timed(fn, name, is_phase=False):
    def wrapper(*args, **kwargs):
        with measured(name, is_phase):
            return fn(*args, **kwargs)
    wrapper.__wrapped__ = fn
    return wrapper


def merged(argv, defaults=DEFAULTS):
    """`defaults` with each flag given in argv replaced (a flag's value is everything up to the next --flag)."""
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    out, skip = [], False
    for a in defaults:
        if a.startswith("--"):
            skip = a in given or (a.startswith("--no-") and "--" + a[5:] in given)
        if not skip:
            out.append(a)
    return out + argv


def install():
    for name in ("warm_start", "evaluate", "rollout", "update"):
        setattr(rspo, name, timed(getattr(rspo, name), name, is_phase=True))
    explorer_phase = rspo.Run.explorer_phase   # B's phase is a with-block in rspo.train, not a call

    @contextlib.contextmanager
    def measured_explorer_phase(run):
        with measured("explorer_phase", is_phase=True), explorer_phase(run):
            yield
    rspo.Run.explorer_phase = measured_explorer_phase
    # update's scoring and forward passes; forward inside score_steps counts as scoring
    rspo.score_steps = timed(rspo.score_steps, "scoring (score_steps)")
    forward = rspo.Policy.forward

    def forward_timed(self, *a, **k):
        if torch.is_grad_enabled():
            return timed(forward, "forward with grad")(self, *a, **k)
        return forward(self, *a, **k)
    rspo.Policy.forward = forward_timed
    torch.Tensor.backward = timed(torch.Tensor.backward, "backward")
    torch.optim.Adam.step = timed(torch.optim.Adam.step, "optimizer step")
    # the explorer's copy of A (and the KL reference's): rspo's own `copy` name only, so deepcopy's recursion
    # inside the copy module is not timed call by call
    rspo.copy = types.SimpleNamespace(deepcopy=timed(copy.deepcopy, "model copy (deepcopy)"), copy=copy.copy)
    rspo.Policy.act = timed(rspo.Policy.act, "decoding (Policy.act)")
    demonstrator = rspo.demonstrator
    rspo.demonstrator = lambda *a, **k: timed(demonstrator(*a, **k), "decoding (demonstrator)")
    rspo.Policy.encode_prompt = timed(rspo.Policy.encode_prompt, "prompt encoding (tokenizer)")
    rspo.build_prompt = timed(rspo.build_prompt, "prompt rendering (build_prompt)")
    envs.make_env = timed(envs.make_env, "env construction (make_env)")
    for cls in (envs.ALFWorldEnv, envs.WebShopEnv):
        cls.reset = timed(cls.reset, "env reset+step")
        cls.step = timed(cls.step, "env reset+step")


def gib(key):
    return f"{peak_rss[key] / 2 ** 30:.2f}" if peak_rss[key] else "-"


def table(total):
    lines = ["| phase | seconds | share of run | calls | peak RSS GiB |", "| --- | ---: | ---: | ---: | ---: |"]
    phase_total = 0.0
    for name, label in PHASES.items():
        s = seconds[(name, None)]
        phase_total += s
        if calls[(name, None)]:
            lines.append(f"| {label} | {s:.1f} | {100 * s / total:.1f}% | {calls[(name, None)]} | {gib((name, None))} |")
    lines.append(f"| setup/other (model build, logging, plot) | {total - phase_total:.1f} | "
                 f"{100 * (total - phase_total) / total:.1f}% | | |")
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # KiB on Linux
    lines.append(f"| **run** | {total:.1f} | 100% | | {maxrss:.2f} (ru_maxrss) |")
    lines += ["", "| phase | component | seconds | share of run | calls | peak RSS GiB |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    for p in list(PHASES) + ["setup/other"]:
        for (ph, comp), s in sorted(seconds.items(), key=lambda kv: -kv[1]):
            if ph == p and comp is not None:
                lines.append(f"| {PHASES.get(p, p)} | {comp} | {s:.1f} | {100 * s / total:.1f}% | "
                             f"{calls[(ph, comp)]} | {gib((ph, comp))} |")
    return "\n".join(lines)


def main(argv):
    argv = argv[1:] if argv[:1] == ["--"] else merged(argv)
    if "--output-dir" not in argv:
        argv += ["--output-dir", tempfile.mkdtemp(prefix="profile_run_")]
    torch.set_num_threads(1)
    install()
    threading.Thread(target=sample_rss, daemon=True).start()
    print("rspo", " ".join(argv), flush=True)
    t = time.perf_counter()
    rspo.main(argv)
    total = time.perf_counter() - t
    print()
    print(table(total))


if __name__ == "__main__":
    main(sys.argv[1:])
