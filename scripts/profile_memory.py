"""Memory and time of each phase of one update with a real model, measured one phase at a time.

    python scripts/profile_memory.py --model DIR [rspo flags ...]   # DIR: e.g. scripts/gguf_to_hf.py's output

Builds the policy as rspo.main does, plays one batch of rollouts (--num-groups x --group-size episodes), then
runs, each alone: scoring (score_steps, no gradients), forward with gradients, backward, Adam's first step,
and the explorer's copy (deepcopy of the agent + its own Adam step). Before each phase freed memory is handed
back to the OS (malloc_trim), so a phase's "peak above start" is its own working memory; "held after" is what
it leaves allocated (gradients, Adam state, a copy). RSS sampled every 10 ms in a background thread.
"""

import copy
import ctypes
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rspo  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
libc = ctypes.CDLL("libc.so.6")
peak = [0]


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def sampler():
    while True:
        peak[0] = max(peak[0], rss())
        time.sleep(0.01)


rows = []


def phase(name, fn):
    libc.malloc_trim(0)
    start = rss()
    peak[0] = start
    t = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t
    time.sleep(0.03)
    libc.malloc_trim(0)
    rows.append((name, seconds, start, peak[0], rss()))
    print(f"{name}: {seconds:.1f}s start {start / 2**30:.2f} GiB peak {peak[0] / 2**30:.2f} "
          f"after {rss() / 2**30:.2f}", flush=True)
    return out


def main(argv):
    cfg = rspo.configure(argv)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads or 1)
    threading.Thread(target=sampler, daemon=True).start()
    policy = phase("load model + build policy", lambda: rspo.build_policy(cfg, torch.device("cpu")))
    n_params = sum(p.numel() for p in policy.agent.parameters())
    print(f"parameters: {n_params / 1e6:.1f}M ({n_params * 4 / 2**30:.2f} GiB float32); "
          f"vocab {policy.agent.lm.get_output_embeddings().out_features}", flush=True)
    trajs = phase("rollout (decoding + env)", lambda: rspo.rollout(policy, cfg, list(range(cfg.num_groups))))
    steps = [s for t in trajs for s in t.steps]
    lens = rspo.sequence_lengths(steps)
    print(f"steps {len(steps)}; prompt+response tokens: min {min(lens)} max {max(lens)} total {sum(lens)}; "
          f"response tokens max {max(len(s.response_ids) for s in steps)}", flush=True)
    rspo.attach_rewards(trajs, "outcome", cfg)
    phase("scoring (score_steps, no grad)", lambda: rspo.score_steps(policy, steps, cfg))
    policy.agent.train()
    holder = {}

    def fwd():
        holder["out"] = [policy.forward([steps[i] for i in idx], cfg.temperature, with_entropy=True)
                         for idx in rspo.length_sorted_chunks(range(len(steps)), lens, cfg.micro_batch_size)]

    def bwd():
        for logp, mask, ent, _ in holder.pop("out"):
            ((logp * mask).sum() / mask.sum() + 0 * ent.sum()).backward()
    if cfg.micro_batch_size >= len(steps):
        phase("forward with grad (graph kept)", fwd)
        phase("backward", bwd)
    else:   # several micro-batches: each one's forward+backward in turn, as update does
        def fwd_bwd():
            for idx in rspo.length_sorted_chunks(range(len(steps)), lens, cfg.micro_batch_size):
                logp, mask, ent, _ = policy.forward([steps[i] for i in idx], cfg.temperature, with_entropy=True)
                ((logp * mask).sum() / mask.sum() + 0 * ent.sum()).backward()
        phase("forward+backward per micro-batch", fwd_bwd)
    optimizer = torch.optim.Adam(policy.agent.parameters(), lr=1e-6)
    phase("Adam step (state allocated)", optimizer.step)
    phase("zero_grad(set_to_none)", lambda: optimizer.zero_grad(set_to_none=True))
    explorer = phase("explorer copy (deepcopy)", lambda: copy.deepcopy(policy.agent))
    print("\n| phase | seconds | RSS at start GiB | peak GiB | peak above start GiB | held after GiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, s, start, top, after in rows:
        print(f"| {name} | {s:.1f} | {start / 2**30:.2f} | {top / 2**30:.2f} | {(top - start) / 2**30:.2f} | "
              f"{(after - start) / 2**30:+.2f} |")
    del explorer


if __name__ == "__main__":
    main(sys.argv[1:])
