"""RSPO: Reward-Swap Policy Optimization for multi-turn LLM agents: the method and its trainer.

Paper: Q. Liu, T. Guo, R. Qiao, X. Sun, "RSPO: Reward-Swap Policy Optimization for Multi-Turn LLM
Agents", arXiv 2607.04713 (2026). No official code is public; this is a reference implementation.

    python rspo.py --algo grpo --env alfworld                  # RSPO+GRPO, tiny model, CPU, minutes
    python rspo.py --algo ppo --env webshop --method outcome   # the base algorithm alone
    python rspo.py --model Qwen/Qwen2.5-1.5B-Instruct --lr 1e-6 --beta 0.01 ...  # a real model on a GPU

Two copies of the agent. A (the one that is evaluated) only ever learns from outcome rewards. Every
cycle, an explorer B <- copy(A) is trained for k updates on dense (process) rewards, then B's fresh
trajectories are relabelled with the outcome reward ("reward swap") into a replay buffer, and A is
trained for k updates on batches that mix n groups of its own rollouts with m buffer groups,
J = (1 - alpha) J_on + alpha J_off, alpha = m / (n + m). Off-policy tokens are clipped around
c = pi_old / pi_B instead of 1. The base algorithm (GRPO, PPO or GiGPO) is otherwise unchanged.

Paper -> code (Algorithm 1; train reads top to bottom in this order):
    B <- copy(A); k updates of B on dense rewards   explore (relabel_dense, --dense-reward)
    B's fresh batch, relabelled with the outcome    reward_swap
    the replay buffer, priority order, cursor       ReplayBuffer (buffer_order, --buffer-sampling)
    m_u buffer groups + n_u own groups per update   replay_groups, train
    shifted clip around c = pi_old / pi_B           shifted_clip_loss (Step.behav_logp: the sampler's)
    base algorithm                                  grpo_advantages, gigpo_advantages, gae_advantages, update

Layout: the method first (the RSPO core, a block to copy whole: the reward swap, the buffer, the shifted
clip; then the base algorithms' math, rollout, update and the RSPO cycle), then the machinery (what each
update logs, warm start, learned dense reward, flags, checkpoints, main). The agent it trains (any Hugging
Face causal LM or a tiny one: prompts, decoding, log-probs, device) is policy.py; the environments, envs.py.
The README has the RSPO-specific checklist, docs/checklist.md the rest.
"""
import argparse
import contextlib
import copy
import json
import math
import os
import pathlib
import random
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from fractions import Fraction

import numpy as np
import torch
import torch.nn as nn
import torch.utils.checkpoint
from tqdm.auto import tqdm

import envs
from policy import (Agent, ConfigError, Policy, build_lm, build_policy, build_prompt, length_sorted_chunks,
                    pick_device, save_model, saved_settings)


# ==============================================================================================
# The RSPO core (PAPER steps 3-4 and the off-policy clip): copy this block whole into another trainer.
# It depends on nothing defined below it and works on plain data: trajectories with an outcome each, in
# groups, and per-token log-prob tensors. It needs: import math, torch;
# from dataclasses import dataclass, field, replace; from fractions import Fraction.
# README, "Copying the RSPO core", maps it onto a TRL or verl batch.
# >>> RSPO core begins


def masked_mean(x, mask):
    """Token-mean of x over mask (verl's loss_agg_mode='token-mean')."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def shifted_clip_per_token(logp, old_logp, behav_logp, advantages, clip_eps=0.2, clip_ratio_c=3.0):
    """RSPO's clipped surrogate per token (PAPER: off-policy clip centre), before any aggregation.

    rho = pi_theta / pi_behav, clip centre c = pi_theta_old / pi_behav,
    L = -min(rho * A, clip(rho, c - eps, c + eps) * A), and for A < 0 verl's dual clip (Ye et al. 2020,
    arXiv 1912.09729, eq. 5): L = min(L, -clip_ratio_c * c * A), i.e. pi_theta / pi_theta_old counts at most
    clip_ratio_c (the factor c carries the bound into the off-policy frame: inferred, the paper is silent).
    On-policy tokens pass behav_logp = old_logp, so c = 1 and this is PPO's clip (Schulman et al. 2017,
    eq. 7) with verl's dual clip; buffer tokens pass the explorer B's log-probs. advantages broadcast over
    tokens. Returns (loss per token, 1.0 where the clipped branch is the one taken, as verl counts it)."""
    ratio = torch.exp(logp - behav_logp)
    centre = torch.exp(old_logp - behav_logp)
    clipped = torch.maximum(torch.minimum(ratio, centre + clip_eps), centre - clip_eps)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    dual = torch.maximum(surrogate, clip_ratio_c * centre * advantages)
    surrogate = torch.where(advantages < 0, dual, surrogate)
    return -surrogate, (clipped * advantages < ratio * advantages).float()


def shifted_clip_loss(logp, old_logp, behav_logp, advantages, mask, clip_eps=0.2, clip_ratio_c=3.0):
    """shifted_clip_per_token, token-mean over mask (verl's loss_agg_mode='token-mean'). Returns (loss, clip
    fraction: the share of tokens where the clipped branch is the one taken)."""
    loss, clipped = shifted_clip_per_token(logp, old_logp, behav_logp, advantages, clip_eps, clip_ratio_c)
    return masked_mean(loss, mask), masked_mean(clipped, mask)


def outcome_rewards(num_steps, won, invalid, scale=10.0, penalty=0.1):
    """Outcome reward vector: scale * won on the final step, zeros elsewhere, minus the format penalty
    on unparseable steps (verl-agent's convention)."""
    r = torch.tensor([-penalty * float(b) for b in invalid])
    r[num_steps - 1] += scale * float(won)
    return r


@dataclass
class Step:
    prompt_ids: list          # token ids of the rendered state
    response_ids: list        # token ids the policy produced (incl. EOS when it produced one)
    admissible: list | None   # the decoding constraint in constrained mode, None in generate mode
    obs: str                  # environment observation: GiGPO's anchor
    action: str
    dense: float              # the process reward for this step: the env's, or relabelled (relabel_dense)
    invalid: bool             # unparseable response (generate mode)
    behav_logp: torch.Tensor | None = None  # the sampler's log-probs of response_ids (None: a demonstrator)
    progress_gain: float = 0.0  # change of the env's info["progress"] (--dense-reward progress, diagnostics)


@dataclass
class Trajectory:
    steps: list
    group: int
    task_seed: int
    task_type: str
    won: bool
    score: float
    rewards: torch.Tensor = None   # the per-step reward vector the learner will see


def reward_swap(trajs, scale=10.0, penalty=0.1):
    """The reward swap (PAPER step 3): the explorer's trajectories with every step's reward replaced by
    the task's outcome reward (zeros except the final step), keeping the explorer's log-probs."""
    return [replace(t, rewards=outcome_rewards(len(t.steps), t.won, [s.invalid for s in t.steps], scale,
                                               penalty)) for t in trajs]


def groups_of(trajs):
    """{group id: [trajectories]} in group order."""
    out = {}
    for t in trajs:
        out.setdefault(t.group, []).append(t)
    return out


def buffer_order(outcomes, mode, generator=None):
    """Order in which A replays buffer groups (PAPER: reward-based > variance-based > random).

    outcomes: one 1-D tensor of outcome scores per group, groups of any size (or a [num_groups, group_size]
    tensor). reward: highest group mean first; variance: highest group std first (the groups with a GRPO
    signal); random: a random order. Ties are broken at random. A's j-th update of the cycle takes the next
    m groups of this order."""
    perm = torch.randperm(len(outcomes), generator=generator)
    if mode == "random":
        return perm
    priority = torch.stack([o.float().mean() if mode == "reward" else o.float().std(unbiased=False)
                            for o in outcomes])
    return perm[torch.argsort(-priority[perm], stable=True)]


def replay_groups(alpha, num_groups, update):
    """m_u, the buffer groups in A's batch at update u (1-based); the other num_groups - m_u are on-policy.
    PAPER: alpha = m / (n + m). m_u = ceil(alpha N u) - ceil(alpha N (u - 1)) is alpha N at every update when
    alpha N is whole, and alpha N on average when it is not (alpha = 1/16 with N = 8: one group every other
    update, from the first), so a small alpha needs no bigger batch. Exact fractions: no float rounding."""
    share = Fraction(alpha).limit_denominator(10 ** 6) * num_groups
    return math.ceil(share * update) - math.ceil(share * (update - 1))


@dataclass
class ReplayBuffer:
    """PAPER step 4: one cycle's swapped groups in replay order, and a cursor. Refilled every cycle; A's
    update u takes the next m_u groups (replay_groups), wrapping around when the cycle needs more than it
    holds."""
    groups: list = field(default_factory=list)   # lists of trajectories, highest priority first
    cursor: int = 0                              # groups handed out this cycle

    def refill(self, trajs, mode, generator):
        """A new cycle: the trajectories' groups ordered by --buffer-sampling (buffer_order), the cursor
        at 0."""
        groups = list(groups_of(trajs).values())
        if groups:   # each group ranked by its own episodes, however many (a trainer may drop some)
            outcomes = [torch.stack([t.rewards.sum() for t in g]) for g in groups]
            groups = [groups[i] for i in buffer_order(outcomes, mode, generator).tolist()]
        self.groups, self.cursor = groups, 0

    def take(self, m, first_id):
        """The next m groups, renumbered first_id, first_id + 1, ... so they never share an id with A's own
        groups (GRPO/GiGPO normalise within a group)."""
        out = [[replace(t, group=first_id + j) for t in self.groups[(self.cursor + j) % len(self.groups)]]
               for j in range(m)]
        self.cursor += m
        return out


# <<< RSPO core ends
# ==============================================================================================


# ----------------------------------------------------------------------------------------------
# The base algorithms: small pure functions, tensors in and out; the reward vector a learner sees


def _group_normalise(values, group_ids, norm_std, eps):
    """(x - mean_g) / (std_g + eps) within each group (unbiased std); a group of one gets 0."""
    out = torch.zeros_like(values, dtype=torch.float32)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        x = values[idx].float()
        if x.numel() < 2:
            continue
        centred = x - x.mean()
        out[idx] = centred / (x.std() + eps) if norm_std else centred
    return out


def grpo_advantages(scores, group_ids, norm_std=True, eps=1e-6):
    """GRPO (Shao et al. 2024, eq. 3 of DeepSeekMath): A_i = (S_i - mean_g S) / (std_g S + eps).

    scores: one episode score S = sum_t r_t per trajectory; group_ids: its group. norm_std=False gives
    S - mean_g S (Dr. GRPO / TRL's scale_rewards=False). A group of one has no baseline: A = 0.
    """
    return _group_normalise(scores, group_ids, norm_std, eps)


def discounted_returns(rewards, traj_ids, gamma):
    """R_t = r_t + gamma * R_{t+1} within each trajectory; rows of a trajectory are in time order."""
    out = torch.zeros_like(rewards, dtype=torch.float32)
    running, prev = 0.0, None
    for i in range(len(rewards) - 1, -1, -1):
        tid = int(traj_ids[i])
        running = float(rewards[i]) + (gamma * running if tid == prev else 0.0)
        out[i], prev = running, tid
    return out


def gigpo_advantages(step_rewards, traj_ids, group_ids, anchors, gamma=0.95, omega=1.0, norm_std=True,
                     eps=1e-6):
    """GiGPO (Feng et al. 2025, arXiv 2505.10978, eqs. 5-8): A = A^E + omega * A^S per step row.

    Episode level A^E: GRPO advantage of S = sum_t r_t over the trajectories of a group, broadcast to
    every row of the trajectory. Step level A^S: the discounted return R_t (gamma) normalised within the
    rows sharing the same group AND anchor state (the environment observation); a state seen once gets 0.
    anchors: a sequence of hashables (observation strings) or an integer tensor.
    """
    traj_ids, group_ids = torch.as_tensor(traj_ids), torch.as_tensor(group_ids)
    uniq, row_traj = torch.unique(traj_ids, return_inverse=True)
    scores = torch.zeros(len(uniq)).index_add_(0, row_traj, step_rewards.float())
    traj_group = torch.zeros(len(uniq), dtype=torch.long).index_copy_(0, row_traj, group_ids.long())
    a_episode = grpo_advantages(scores, traj_group, norm_std, eps)[row_traj]
    if not torch.is_tensor(anchors):
        codes = {}
        anchors = torch.tensor([codes.setdefault(s, len(codes)) for s in anchors])
    # One key per (group, anchor) pair: the step-level groups of GiGPO.
    step_groups = group_ids.long() * (int(anchors.max()) + 1 if len(anchors) else 1) + anchors.long()
    a_step = _group_normalise(discounted_returns(step_rewards, traj_ids, gamma), step_groups, norm_std, eps)
    return a_episode + omega * a_step


def gae_advantages(rewards, values, traj_ids, gamma, lam):
    """Turn-level GAE (Schulman et al. 2016, eq. 16): delta_t = r_t + gamma V_{t+1} - V_t,
    A_t = delta_t + gamma lam A_{t+1}, with V = 0 after a trajectory's last step (the episode end, or
    the step limit, is treated as terminal). Returns (advantages, returns = advantages + values)."""
    adv = torch.zeros_like(values, dtype=torch.float32)
    running, next_value, prev = 0.0, 0.0, None
    for i in range(len(rewards) - 1, -1, -1):
        tid = int(traj_ids[i])
        if tid != prev:
            running, next_value = 0.0, 0.0
        delta = float(rewards[i]) + gamma * next_value - float(values[i])
        running = delta + gamma * lam * running
        adv[i], next_value, prev = running, float(values[i]), tid
    return adv, adv + values.float()


def kl_k3(logp, ref_logp):
    """k3 estimator of KL(pi || pi_ref) per token (Schulman 2020; verl's low_var_kl): exp(d) - d - 1,
    d = log pi_ref - log pi. Non-negative, 0 where the two agree. As verl: d clamped to [-20, 20] and the
    estimate to [0, 10], so one token the reference finds impossible cannot dominate the loss."""
    d = (ref_logp - logp).clamp(-20, 20)
    return (torch.exp(d) - d - 1).clamp(max=10)


def value_loss(values, old_values, returns, clip):
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), mean."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2).mean()


def dense_rewards(dense, invalid, scale=10.0, penalty=0.1):
    """Dense (process) reward vector: the per-step process reward on the outcome's scale, minus the
    format penalty. "Training on dense" and "the reward swap" are just a choice of vector."""
    return torch.tensor([scale * d - penalty * float(b) for d, b in zip(dense, invalid)])


def attach_rewards(trajs, kind, cfg, dense=None):
    """Give every trajectory its training reward vector: 'outcome' or 'dense' (relabelled first by the
    DenseSource `dense` when given: relabel_dense)."""
    if kind == "dense" and dense is not None:
        relabel_dense(trajs, dense, cfg.dense_noise, cfg)
    for t in trajs:
        inv = [s.invalid for s in t.steps]
        t.rewards = (outcome_rewards(len(t.steps), t.won, inv, cfg.reward_scale, cfg.invalid_penalty)
                     if kind == "outcome" else
                     dense_rewards([s.dense for s in t.steps], inv, cfg.reward_scale, cfg.invalid_penalty))
    return trajs


# ----------------------------------------------------------------------------------------------
# Rollout: groups of episodes, batched across environments (one decoding pass per env step)


def rollout(policy, cfg, seeds, split="train", temperature=None, act=None, group_size=None):
    """Play group_size copies of each task seed (same task, same initial state) until every episode ends,
    sampling at `temperature` (default --temperature, the one the update's log-probs use).
    Returns one Trajectory per episode; group g holds the copies of seeds[g].
    act(prompts, admissibles, environments) -> [(response_ids, action, invalid, logp)] is the action source:
    the policy's sampler by default (logp: its log-probs of the response, the behaviour policy's), or another
    agent (demonstrator, logp None) whose steps look like the policy's."""
    temperature = cfg.temperature if temperature is None else temperature
    gs = group_size or (cfg.group_size if split == "train" else 1)
    act = act or (lambda prompts, adm, _: policy.act(prompts, adm, temperature))
    games = [(g, int(s)) for g, s in enumerate(seeds) for _ in range(gs)]
    environments = [envs.make_env(cfg.env, split=split, seed=s, backend=cfg.backend, **cfg.env_options)
                    for _, s in games]
    live = []
    for env in environments:
        obs, info = env.reset()
        live.append({"obs": obs, "info": info, "history": [], "steps": [], "done": False})
    while True:
        active = [i for i, st in enumerate(live) if not st["done"]]
        if not active:
            break
        prompts, admissible = [], []
        for i in active:
            st = live[i]
            hist = st["history"][-cfg.history:] if cfg.history else []
            # verl-agent leaves ALFWorld's "help" out of the actions offered to the agent.
            admissible.append([a for a in st["info"]["admissible_actions"] if a != "help"])
            text = build_prompt(st["info"]["task"], hist, st["obs"], admissible[-1], len(st["history"]),
                                policy.compact, cfg.env)
            prompts.append(policy.encode_prompt(text))
        actions = act(prompts, admissible, [environments[i] for i in active])
        for i, prompt, adm, (resp, action, invalid, logp) in zip(active, prompts, admissible, actions):
            st = live[i]
            obs, _, done, info = environments[i].step(action)
            gain = float(info.get("progress", 0.0)) - float(st["info"].get("progress", 0.0))
            st["steps"].append(Step(prompt, resp, adm if policy.constrained else None, st["obs"], action,
                                    float(info.get("dense_reward", 0.0)), invalid, logp, gain))
            st["history"].append((st["obs"], action))
            st.update(obs=obs, info=info, done=done)
    return [Trajectory(st["steps"], g, s, st["info"]["task_type"], bool(st["info"]["won"]),
                       float(st["info"]["score"])) for st, (g, s) in zip(live, games)]


EVAL_SEED_OFFSET = 10_000   # evaluate's RNG stream is cfg.seed + this: every evaluation samples alike


def eval_panel(cfg, split):
    """The held-out panel of `split`: its first --eval-episodes tasks (all of them when it has fewer)."""
    tasks = envs.num_tasks(cfg.env, split, backend=cfg.backend, **cfg.env_options)
    return range(min(cfg.eval_episodes, tasks))


def evaluate(policy, cfg):
    """Success (overall and per task type) and score on each fixed held-out panel of --eval-split (keys
    eval/... for the first split, eval_<split>/... for another), sampled at the evaluation temperature. Uses
    its own RNG stream so evaluating never changes training."""
    out = {}
    for i, split in enumerate(cfg.eval_split.split(",")):
        prefix = "eval" if i == 0 else f"eval_{split}"
        with own_rng(cfg.seed + EVAL_SEED_OFFSET, policy.device):
            trajs = rollout(policy, cfg, eval_panel(cfg, split), split, cfg.eval_temperature)
        out[f"{prefix}/success"] = float(np.mean([t.won for t in trajs]))
        out[f"{prefix}/score"] = float(np.mean([t.score for t in trajs]))
        for kind in sorted({t.task_type for t in trajs}):
            out[f"{prefix}/success/{kind}"] = float(np.mean([t.won for t in trajs if t.task_type == kind]))
    return out


FINAL_SEED_OFFSET = 20_000   # final_evaluation's RNG stream: cfg.seed + this


def final_evaluation(policy, cfg):
    """--final-eval-repeats N, after the last update: every task of each --eval-split panel played N times at
    the evaluation temperature, on its own RNG stream. Its success pools all panels' episodes (final/success;
    each panel's under final_<split>/success): N times the episodes of one evaluation, so a sampling error
    about 1/sqrt(N) of evaluate's, for the fair test's measure (results/PREREGISTRATIONS.md)."""
    out, won = {}, []
    with own_rng(cfg.seed + FINAL_SEED_OFFSET, policy.device):
        for split in cfg.eval_split.split(","):
            trajs = rollout(policy, cfg, eval_panel(cfg, split), split, cfg.eval_temperature,
                            group_size=cfg.final_eval_repeats)
            out[f"final_{split}/success"] = float(np.mean([t.won for t in trajs]))
            won += [t.won for t in trajs]
    return {"final/success": float(np.mean(won)), **out}


# ----------------------------------------------------------------------------------------------
# Update: one step of the base algorithm on a batch of on-policy and buffer trajectories


def _pad(rows):
    return nn.utils.rnn.pad_sequence(rows, batch_first=True)


def advantages_for(trajs, cfg, values):
    """Per-step advantages of the base algorithm from each trajectory's reward vector; PPO's returns."""
    rewards = torch.cat([t.rewards for t in trajs]).float()
    traj_ids = torch.tensor([i for i, t in enumerate(trajs) for _ in t.steps])
    group_ids = torch.tensor([t.group for t in trajs for _ in t.steps])
    if cfg.algo == "grpo":
        scores = torch.stack([t.rewards.sum() for t in trajs])
        adv = grpo_advantages(scores, torch.tensor([t.group for t in trajs]), cfg.norm_adv)[traj_ids]
        return adv, None
    if cfg.algo == "gigpo":
        anchors = [s.obs for t in trajs for s in t.steps]
        return gigpo_advantages(rewards, traj_ids, group_ids, anchors, cfg.gamma, cfg.omega,
                                cfg.norm_adv), None
    adv, returns = gae_advantages(rewards, values, traj_ids, cfg.gamma, cfg.lam)
    return (adv - adv.mean()) / (adv.std() + 1e-8), returns  # batch whitening, as in CleanRL/verl


def minibatches(n, size, epochs, generator):
    """`epochs` shuffled passes over n samples, in minibatches of `size` indices."""
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator).tolist()
        for start in range(0, n, size):
            yield perm[start:start + size]


def optimizer_step(policy, optimizer, cfg):
    """Clip the gradient norm to --max-grad-norm and step; no gradients are held afterwards (B's phase needs
    the room). Returns the norm before clipping."""
    norm = float(nn.utils.clip_grad_norm_(policy.agent.parameters(), cfg.max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def sequence_lengths(steps):
    return [len(s.prompt_ids) + len(s.response_ids) for s in steps]


@torch.no_grad()
def score_steps(policy, steps, cfg):
    """log pi(response | prompt) per token and V(s) for many steps, without gradients."""
    policy.agent.eval()
    logps, values = [None] * len(steps), torch.zeros(len(steps))
    for idx in length_sorted_chunks(range(len(steps)), sequence_lengths(steps), cfg.micro_batch_size):
        logp, mask, _, v = policy.forward([steps[i] for i in idx], cfg.temperature)
        for i, row, m in zip(idx, logp.cpu(), mask.cpu()):
            logps[i] = row[:int(m.sum())]
        values[idx] = v.float().cpu()
    return logps, values


def update(policy, optimizer, trajs, cfg, generator, ref=None, replayed=()):
    """One update (the unit of the budget): old log-probs and advantages, then `epochs` passes of
    minibatch SGD on the clipped surrogate (+ KL, entropy, value terms). trajs: the policy's own fresh
    rollouts, their sampler's log-probs pi_old; replayed: buffer trajectories sampled by another policy (B, or
    RSPO_H's earlier A), scored here for pi_old. Which log-probs reach the loss: where it is called."""
    own, other = [s for t in trajs for s in t.steps], [s for t in replayed for s in t.steps]
    steps = own + other
    # A scoring pass only for what the sampler did not record: pi_old of replayed steps (PPO: V(s) of every
    # state).
    if cfg.algo == "ppo":
        scored_logp, old_values = score_steps(policy, steps, cfg)
        scored_logp = scored_logp[len(own):]
    else:
        scored_logp, old_values = score_steps(policy, other, cfg)[0], None
    old_logp = [s.behav_logp for s in own] + scored_logp
    ref_logp = score_steps(ref, steps, cfg)[0] if ref is not None else None
    diagnostics = replay_diagnostics(torch.cat([s.behav_logp for s in other]),
                                     torch.cat(scored_logp)) if other else {}
    trajs = list(trajs) + list(replayed)
    adv, returns = advantages_for(trajs, cfg, old_values)
    lengths = sequence_lengths(steps)
    policy.agent.train()
    stats, n_mb = {}, 0
    coef = {"losses/policy_loss": 1.0, "losses/entropy": -cfg.ent_coef, "losses/kl": cfg.beta,
            "losses/value_loss": cfg.vf_coef}
    for mb in minibatches(len(steps), cfg.minibatch_size, cfg.epochs, generator):
        tokens = sum(len(steps[i].response_ids) for i in mb)
        acc = {}
        for idx in length_sorted_chunks(mb, lengths, cfg.micro_batch_size):
            logp, mask, ent, values = policy.forward([steps[i] for i in idx], cfg.temperature,
                                                     with_entropy=True)
            dev = logp.device
            old = _pad([old_logp[i] for i in idx]).to(dev)
            behav = _pad([steps[i].behav_logp for i in idx]).to(dev)
            a = adv[idx].to(dev).unsqueeze(1)
            # pi_theta = logp; pi_old = old (own: sampled, replayed: scored by A); pi_behav = behav (sampled)
            pg, clipfrac = shifted_clip_loss(logp, old, behav, a, mask, cfg.clip_eps, cfg.clip_ratio_c)
            terms = {"losses/policy_loss": pg, "losses/clipfrac": clipfrac,
                     "losses/entropy": masked_mean(ent, mask),
                     "losses/approx_kl": masked_mean(kl_k3(logp, old), mask)}
            if ref_logp is not None:
                terms["losses/kl"] = masked_mean(kl_k3(logp, _pad([ref_logp[i] for i in idx]).to(dev)), mask)
            if returns is not None:
                terms["losses/value_loss"] = value_loss(values, old_values[idx].to(dev),
                                                        returns[idx].to(dev), cfg.vf_clip)
            # Each chunk's share of the minibatch: its tokens for the token-mean terms, its samples for the
            # value loss (a mean over states), so neither depends on how the minibatch is chunked.
            token_share, sample_share = mask.sum().item() / tokens, len(idx) / len(mb)
            share = {k: sample_share if k == "losses/value_loss" else token_share for k in terms}
            sum(coef[k] * share[k] * v for k, v in terms.items() if k in coef).backward()
            for k, v in terms.items():
                acc[k] = acc.get(k, 0.0) + share[k] * float(v.detach())
        acc["losses/grad_norm"] = optimizer_step(policy, optimizer, cfg)
        for k, v in acc.items():
            stats[k] = stats.get(k, 0.0) + v
        n_mb += 1
    return {**{k: v / n_mb for k, v in stats.items()}, **diagnostics}


# ----------------------------------------------------------------------------------------------
# The RSPO cycle (PAPER Algorithm 1)


def explore(policy, cfg, rng, generator, ref, dense, seen):
    """PAPER steps 1-3: B <- copy(A); k updates of B on the explorer reward; B's fresh rollouts, with
    B's log-probs (its sampler's, Step.behav_logp), swapped to outcome rewards. Returns (buffer trajectories,
    stats, B's env steps); adds the observations B met to the set `seen` (its distinct states).
    B and its Adam state exist only inside this call (train then returns their memory to the device)."""
    explorer = Policy(copy.deepcopy(policy.agent).to(policy.device), policy.tok, cfg, policy.device)
    # fresh each cycle (inferred)
    optimizer = torch.optim.Adam(explorer.agent.parameters(), lr=cfg.explorer_lr)
    env_steps, stats = 0, {}
    for _ in range(cfg.k):
        trajs = rollout(explorer, cfg, rng.integers(0, cfg.train_tasks, cfg.num_groups))
        attach_rewards(trajs, cfg.explorer_reward, cfg, dense)
        update(explorer, optimizer, trajs, cfg, generator, ref)
        env_steps += sum(len(t.steps) for t in trajs)
        stats = rollout_stats(trajs, "explorer")
        seen.update(s.obs for t in trajs for s in t.steps)
    trajs = rollout(explorer, cfg, rng.integers(0, cfg.train_tasks, cfg.num_groups))
    env_steps += sum(len(t.steps) for t in trajs)
    seen.update(s.obs for t in trajs for s in t.steps)
    stats["explorer/distinct_states"] = len(seen)
    return reward_swap(trajs, cfg.reward_scale, cfg.invalid_penalty), stats, env_steps


@dataclass
class TrainState:
    """What A's training loop carries from one update to the next besides the weights and Adam's state. A
    checkpoint holds all of it, so a resumed run continues exactly as the uninterrupted one."""
    rng: np.random.Generator     # which tasks are played (and the estimator's data splits)
    generator: torch.Generator   # minibatch order and buffer ties
    totals: dict                 # updates, env steps and seconds of A, B and the estimator
    buffer: ReplayBuffer = field(default_factory=ReplayBuffer)
    previous_own: list = field(default_factory=list)   # RSPO_H: A's own rollouts this cycle, the next buffer
    last_explorer: dict = field(default_factory=dict)  # B's last rollout stats, logged with every update
    seen_states: set = field(default_factory=set)      # A's distinct observations
    explorer_states: set = field(default_factory=set)  # B's
    wins: dict = field(default_factory=dict)


def start_run(cfg, policy, dense, optimizer, log, checkpoint):
    """Before A's first update: the warm start, the KL reference (the starting policy, frozen), the
    estimator's fit and the evaluation of line 0 -- or a checkpoint's state. A resumed run redoes the
    (deterministic) warm start only when the reference needs it; the reference is copied before a checkpoint's
    weights are loaded. Returns (TrainState, reference policy or None, the last record logged)."""
    warm = warm_start(policy, cfg) if cfg.warm_start and (checkpoint is None or cfg.beta > 0) else None
    ref = None
    if cfg.beta > 0:
        ref = Policy(copy.deepcopy(policy.agent).requires_grad_(False), policy.tok, cfg, policy.device)
    if checkpoint is not None:
        state, record = restore_checkpoint(checkpoint, policy, optimizer, dense, cfg)
        return state, ref, record
    state = TrainState(np.random.default_rng(cfg.seed), torch.Generator().manual_seed(cfg.seed),
                       {"env_steps/A": 0, "env_steps/B": 0, "updates/A": 0, "updates/B": 0,
                        "time/A_seconds": 0.0, "time/B_seconds": 0.0})
    if warm is not None:
        state.totals.update({"env_steps/warmstart": warm[1], "time/warmstart_seconds": warm[2]})
    prm_stats, prm_steps, prm_seconds = fit_dense_source(dense, policy, cfg)
    if dense.estimator is not None:
        state.totals.update({"env_steps/prm": prm_steps, "time/prm_seconds": prm_seconds})
    record = {"update": 0, **evaluate(policy, cfg), **(warm[0] if warm is not None else {}), **prm_stats,
              **state.totals}
    log(record)
    return state, ref, record


def refill_buffer(cfg, policy, optimizer, state, ref, dense):
    """The start of a cycle: the explorer phase (explore: B trained on dense rewards, its fresh batch swapped
    to outcome rewards) -- or, for RSPO_H, A's own rollouts of the previous cycle -- ordered into the buffer.
    """
    if cfg.buffer_source == "explorer":
        with offloaded(policy, optimizer, cfg.explorer_offload):
            trajs, state.last_explorer, b_steps = explore(policy, cfg, state.rng, state.generator, ref, dense,
                                                          state.explorer_states)
        release_memory(policy.device)
        state.totals["env_steps/B"] += b_steps
        state.totals["updates/B"] += cfg.k
    else:   # RSPO_H: with A's log-probs at the time
        trajs, state.last_explorer = state.previous_own, {}
    state.buffer.refill(trajs, cfg.buffer_sampling, state.generator)
    state.previous_own = []


def train(cfg, policy, dense, log, checkpoint=None, out_dir=None):
    """PAPER Algorithm 1, A's loop: with --method rspo every k updates start a cycle (refill_buffer: explore
    -> reward_swap -> buffer), then each update of A trains on its n_u = N - m_u fresh groups plus the
    buffer's next m_u groups (replay_groups). --method outcome / dense: the base algorithm alone. Checkpoints
    every --save-every."""
    optimizer = torch.optim.Adam(policy.agent.parameters(), lr=cfg.lr)
    state, ref, record = start_run(cfg, policy, dense, optimizer, log, checkpoint)
    done = state.totals["updates/A"]
    bar = tqdm(range(done + 1, cfg.updates + 1), initial=done, total=cfg.updates, disable=not cfg.progress,
               desc=f"{cfg.method}+{cfg.algo}")
    for u in bar:
        t0 = time.time()
        if cfg.method == "rspo" and (u - 1) % cfg.k == 0:
            refill_buffer(cfg, policy, optimizer, state, ref, dense)
            state.totals["time/B_seconds"] += time.time() - t0
        t1 = time.time()
        # An empty buffer (RSPO_H's first cycle) replays nothing and leaves A its whole on-policy batch.
        m = replay_groups(cfg.alpha, cfg.num_groups, u) if cfg.method == "rspo" and state.buffer.groups else 0
        trajs = rollout(policy, cfg, state.rng.integers(0, cfg.train_tasks, cfg.num_groups - m))
        attach_rewards(trajs, "dense" if cfg.method == "dense" else "outcome", cfg, dense)
        replay = state.buffer.take(m, first_id=cfg.num_groups - m)
        stats = batch_stats(cfg, state, trajs, replay)
        replayed = [t for g in replay for t in g]
        stats.update(update(policy, optimizer, trajs, cfg, state.generator, ref, replayed))
        if cfg.method == "rspo" and cfg.buffer_source == "self":
            slot = (u - 1) % cfg.k * cfg.num_groups   # this update's groups follow the cycle's earlier ones
            state.previous_own += [replace(t, group=slot + t.group) for t in trajs]
        totals = state.totals
        totals.update({"env_steps/A": totals["env_steps/A"] + sum(len(t.steps) for t in trajs),
                       "updates/A": u, "time/A_seconds": totals["time/A_seconds"] + time.time() - t1})
        record = {"update": u, **stats, **state.totals}
        if u == cfg.updates or (cfg.eval_every and u % cfg.eval_every == 0):
            record.update(evaluate(policy, cfg))
        if u == cfg.updates and cfg.final_eval_repeats:
            record.update(final_evaluation(policy, cfg))
        log(record)
        if cfg.save_every and (u % cfg.save_every == 0 or u == cfg.updates):
            save_checkpoint(out_dir, cfg, policy, optimizer, dense, state, record)
        bar.set_postfix(success=f"{stats['train/success']:.2f}", ev=record.get("eval/success", ""))
    return record


# ==============================================================================================
# The machinery: nothing below is the method. What each update logs, the warm start, the learned dense
# reward, flags, checkpoints, main (the policy wrapper is policy.py).
# ----------------------------------------------------------------------------------------------
# What each update logs besides the losses


def rollout_stats(trajs, prefix):
    """Success (overall and per task type present), returns and length of a batch of rollouts, for logging."""
    types = sorted({t.task_type for t in trajs})
    return {f"{prefix}/success": float(np.mean([t.won for t in trajs])),
            f"{prefix}/score": float(np.mean([t.score for t in trajs])),
            f"{prefix}/dense_return": float(np.mean([sum(s.dense for s in t.steps) for t in trajs])),
            f"{prefix}/episode_length": float(np.mean([len(t.steps) for t in trajs])),
            **{f"{prefix}/success/{k}": float(np.mean([t.won for t in trajs if t.task_type == k]))
               for k in types}}


def replay_diagnostics(behav_logp, old_logp):
    """How far replayed tokens' behaviour policy (the explorer B) is from A = pi_old, on tokens sampled from
    pi_behav: KL(pi_behav || pi_old) per token (kl_k3, unbiased for samples from pi_behav), and the spread of
    shifted_clip_loss's clip centre c = pi_old / pi_behav (10th and 90th percentiles; c = 1 when B equals A).
    """
    centre = torch.exp(old_logp - behav_logp).float()
    p10, p90 = torch.quantile(centre, torch.tensor([0.1, 0.9])).tolist()
    return {"buffer/explorer_kl": float(kl_k3(behav_logp, old_logp).mean()),
            "buffer/clip_centre_p10": p10, "buffer/clip_centre_p90": p90}


def count_wins(counts, trajs, prefix):
    """Running totals of successful episodes per task type, counts["{prefix}/wins/{type}"] (0 for a type
    played but never won): which kinds of task A's own rollouts and the replayed groups bring successes on."""
    for t in trajs:
        key = f"{prefix}/wins/{t.task_type}"
        counts[key] = counts.get(key, 0) + int(t.won)


def batch_stats(cfg, state, trajs, replay):
    """Logged with each update: A's rollouts, the replayed groups, the running counts of wins and states."""
    replayed = [t for g in replay for t in g]
    stats = {**rollout_stats(trajs, "train"), **state.last_explorer,
             "train/outcome_return": float(np.mean([cfg.reward_scale * t.won for t in trajs]))}
    if replay:
        stats.update({"buffer/success": float(np.mean([t.won for t in replayed])),
                      "buffer/groups_with_success": float(np.mean([any(t.won for t in g) for g in replay])),
                      # a group won by all or none of its episodes has zero group-relative advantage (GRPO)
                      "buffer/groups_mixed": float(np.mean([len({t.won for t in g}) == 2 for g in replay]))})
    state.seen_states.update(s.obs for t in trajs for s in t.steps)
    count_wins(state.wins, trajs, "train")
    count_wins(state.wins, replayed, "buffer")
    return {**stats, "train/distinct_states": len(state.seen_states), **dict(sorted(state.wins.items()))}


# ----------------------------------------------------------------------------------------------
# Warm start: imitation of a demonstrator that sees what the agent sees, before RL (SPA-RL's SFT stage)


def imitation_loss(logp, mask):
    """Behaviour cloning (SFT): the token-mean negative log-likelihood of the demonstrator's responses,
    -sum_{i,t} m_it log pi(y_it | x_i, y_i,<t) / sum_{i,t} m_it."""
    return -(logp * mask).sum() / mask.sum()


def demonstrator(policy):
    """The searching demonstrator as an action source for rollout: env.searching_action(), the scripted expert
    without its privilege, acting only on what the agent has seen. Its response ids are what the policy would
    have produced for that action: the action's tokens + EOS (constrained mode) or the <think>/<action> format
    (generate mode)."""
    def act(prompts, admissibles, environments):
        out = []
        for env in environments:
            action = env.searching_action()
            text = action if policy.constrained else f"<think></think><action>{action}</action>"
            out.append((policy.action_ids(text) + [policy.tok.eos_token_id], action, False, None))
        return out
    return act


def warm_start(policy, cfg):
    """--warm-start episodes of the searching demonstrator on train tasks 0..N-1, each step rendered as the
    policy's own, then --warm-start-epochs passes of Adam on imitation_loss in minibatches of --minibatch-size
    steps. Its own RNG streams, so every method's RL starts from the same policy. Returns stats and cost."""
    start = time.time()
    trajs = rollout(policy, cfg, range(cfg.warm_start), act=demonstrator(policy), group_size=1)
    steps = [s for t in trajs for s in t.steps]
    optimizer = torch.optim.Adam(policy.agent.parameters(), lr=cfg.warm_start_lr)
    generator, lengths, nll = torch.Generator().manual_seed(cfg.seed + 40_000), sequence_lengths(steps), []
    policy.agent.train()
    for mb in minibatches(len(steps), cfg.minibatch_size, cfg.warm_start_epochs, generator):
        tokens, loss = sum(len(steps[j].response_ids) for j in mb), 0.0
        for idx in length_sorted_chunks(mb, lengths, cfg.micro_batch_size):
            logp, mask, _, _ = policy.forward([steps[j] for j in idx], 1.0)
            part = imitation_loss(logp, mask) * (mask.sum().item() / tokens)   # token-mean over the minibatch
            part.backward()
            loss += float(part.detach())
        optimizer_step(policy, optimizer, cfg)
        nll.append(loss)
    per_epoch = -(-len(steps) // cfg.minibatch_size)
    stats = {"warmstart/episodes": len(trajs),
             "warmstart/demo_success": float(np.mean([t.won for t in trajs])),
             "warmstart/nll": float(np.mean(nll[-per_epoch:]))}
    return stats, len(steps), time.time() - start


# ----------------------------------------------------------------------------------------------
# Learned dense reward (progress estimator): SPA-RL's model, the paper's source of dense rewards


def prm_loss(step_scores, traj_ids, outcomes):
    """SPA-RL's progress-estimator objective (PAPER, "Where the dense rewards come from"):
    mean over trajectories of (sum_t r_hat_t - R)^2. traj_ids[i] in [0, len(outcomes)) names the
    trajectory of step i; R is the outcome on the estimator's scale, won in {0, 1} (see fit_estimator)."""
    sums = torch.zeros(len(outcomes), dtype=step_scores.dtype, device=step_scores.device)
    sums = sums.index_add(0, traj_ids.to(step_scores.device), step_scores)
    return ((sums - outcomes.to(sums)) ** 2).mean()


class ProgressEstimator(nn.Module):
    """r_hat(s_t, a_t) = tanh(MLP(h)) in (-1, 1), h the backbone's final hidden state at the last token of
    the step's prompt + action (SPA-RL, arXiv 2505.20732). The backbone is any causal LM; when its
    tokenizer is not the policy's, a step's text is decoded and re-encoded with its own."""
    hidden = Agent.hidden   # the same backbone call as the policy's

    def __init__(self, lm, tok, policy_tok, freeze=False):
        super().__init__()
        self.lm, self.tok, self.policy_tok = lm, tok, policy_tok
        self.retokenize = tok.get_vocab() != policy_tok.get_vocab()
        width = lm.config.hidden_size
        self.head = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))  # fp32
        nn.init.zeros_(self.head[-1].weight)   # start at r_hat = 0 everywhere: sums start at 0, not at noise
        nn.init.zeros_(self.head[-1].bias)
        self.frozen = freeze
        lm.requires_grad_(not freeze)

    def input_ids(self, step):
        ids = step.prompt_ids + step.response_ids
        if not self.retokenize:
            return ids
        return self.tok(self.policy_tok.decode(ids, skip_special_tokens=True)).input_ids

    def features(self, steps):
        """h at the last real token of each step (right-padded batch, so that token is at length - 1)."""
        seqs = [self.input_ids(s) for s in steps]
        device = next(self.lm.parameters()).device
        ids = _pad([torch.tensor(s) for s in seqs]).to(device)   # padding value 0 is masked out
        attn = _pad([torch.ones(len(s), dtype=torch.long) for s in seqs]).to(device)
        h = self.hidden(ids, attn)
        return h[torch.arange(len(seqs), device=device), torch.tensor([len(s) - 1 for s in seqs])].float()

    def forward(self, features):
        return torch.tanh(self.head(features)).squeeze(-1)


def estimator_features(estimator, steps, cfg):
    """The backbone's h for many steps, in length-sorted forward passes, returned in the steps' order.
    Differentiable unless called under no_grad (or the backbone is frozen)."""
    rows = [None] * len(steps)
    for idx in length_sorted_chunks(range(len(steps)), sequence_lengths(steps), cfg.micro_batch_size):
        for i, row in zip(idx, estimator.features([steps[i] for i in idx])):
            rows[i] = row
    return torch.stack(rows)


@torch.no_grad()
def estimate_progress(estimator, steps, cfg):
    """r_hat for every step (no gradients), on the CPU."""
    estimator.eval()
    return estimator(estimator_features(estimator, steps, cfg)).cpu() if steps else torch.zeros(0)


@dataclass
class DenseSource:
    """Where dense rewards come from: the env (info["dense_reward"] or the progress increments; estimator
    None) or a progress estimator with its optimizer and data; plus the seeded noise stream of --dense-noise.
    """
    noise_rng: np.random.Generator
    estimator: ProgressEstimator | None = None
    optimizer: torch.optim.Optimizer | None = None
    train: list = None      # trajectories the estimator is fitted on
    heldout: list = None    # trajectories kept out to report its fit
    sources: dict = None    # data source -> {"episodes", "success"} (written to config.json)


def relabel_dense(trajs, dense, sigma, cfg):
    """The one path of every dense reward: Step.dense <- progress_t - progress_{t-1} (--dense-reward
    progress), or r_hat(s_t, a_t) when an estimator is given (otherwise the env's value stays), then + N(0,
    sigma^2) per step (PAPER's robustness test). In place; attach_rewards(..., "dense") then scales it by
    --reward-scale."""
    steps = [s for t in trajs for s in t.steps]
    if cfg.dense_reward == "progress":
        for s in steps:
            s.dense = s.progress_gain
    if dense.estimator is not None:
        for s, r in zip(steps, estimate_progress(dense.estimator, steps, cfg).tolist()):
            s.dense = r
    if sigma > 0:
        for s, e in zip(steps, dense.noise_rng.normal(0.0, sigma, len(steps))):
            s.dense += float(e)
    return trajs


@torch.no_grad()
def estimator_fit(estimator, trajs, cfg):
    """Fit on trajectories: the loss, mean |sum_t r_hat_t - R| and the correlation of r_hat with the
    env's progress increments (NaN where either is constant)."""
    steps = [s for t in trajs for s in t.steps]
    if not steps:
        return {}
    scores = estimate_progress(estimator, steps, cfg)
    traj_ids = torch.tensor([i for i, t in enumerate(trajs) for _ in t.steps])
    outcomes = torch.tensor([float(t.won) for t in trajs])
    sums = torch.zeros(len(trajs)).index_add(0, traj_ids, scores)
    gains = torch.tensor([s.progress_gain for s in steps])
    later = torch.tensor([i > 0 for t in trajs for i in range(len(t.steps))])
    return {"loss": float(prm_loss(scores, traj_ids, outcomes)),
            "sum_error": float((sums - outcomes).abs().mean()), "corr_progress": _corr(scores, gains),
            # The objective only fixes sums, and the estimator tends to put the expected outcome on the
            # first step (history "none"), which is no progress; the correlation without it:
            "corr_progress_after_first": _corr(scores[later], gains[later])}


def _corr(x, y):
    """Pearson correlation; NaN when either side is constant."""
    if len(x) < 2 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(torch.corrcoef(torch.stack([x, y]))[0, 1])


def fit_estimator(dense, cfg, epochs, generator, desc="progress estimator"):
    """`epochs` passes of minibatch Adam on prm_loss over dense.train, R = won in {0, 1}: the step scores
    live in (-1, 1), so the outcome is normalised to the success indicator (the trainer's outcome reward
    divided by --reward-scale; relabelled rewards are multiplied back by it). A frozen backbone's features
    are computed once. Returns logged stats: prm/loss (last epoch, train), prm/heldout_* (the fit)."""
    est, trajs = dense.estimator, dense.train
    steps = [s for t in trajs for s in t.steps]
    rows, start = [], 0
    for t in trajs:
        rows.append(list(range(start, start + len(t.steps))))
        start += len(t.steps)
    outcomes = torch.tensor([float(t.won) for t in trajs])
    with torch.no_grad():
        cached = estimator_features(est, steps, cfg) if est.frozen else None
    bar = tqdm(range(epochs), disable=not cfg.progress, desc=desc, leave=False)
    for _ in bar:
        est.train()
        total, n = 0.0, 0
        perm = torch.randperm(len(trajs), generator=generator).tolist()
        for b in range(0, len(trajs), cfg.prm_batch_size):
            chosen = perm[b:b + cfg.prm_batch_size]
            idx = [i for c in chosen for i in rows[c]]
            if cached is not None:
                feats = cached[idx]
            else:
                feats = estimator_features(est, [steps[i] for i in idx], cfg)
            local = torch.tensor([j for j, c in enumerate(chosen) for _ in rows[c]])
            loss = prm_loss(est(feats), local, outcomes[chosen])
            dense.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(est.parameters(), cfg.max_grad_norm)
            dense.optimizer.step()
            total, n = total + float(loss.detach()) * len(chosen), n + len(chosen)
        bar.set_postfix(loss=f"{total / max(n, 1):.3f}")
    stats = {"prm/loss": total / max(n, 1) if epochs else float("nan"), "prm/train_trajectories": len(trajs)}
    stats.update({f"prm/heldout_{k}": v for k, v in estimator_fit(est, dense.heldout, cfg).items()})
    return stats


PRM_HELDOUT = 0.2   # the share of the estimator's episodes held out to report its fit


def add_estimator_data(dense, source, trajs, rng):
    """Add trajectories to the estimator's data, a seeded random PRM_HELDOUT share of them to the held-out
    set; count them by source (config.json's prm_data)."""
    order = rng.permutation(len(trajs)).tolist()
    cut = int(round(PRM_HELDOUT * len(trajs)))
    dense.train += [trajs[i] for i in order[cut:]]
    dense.heldout += [trajs[i] for i in order[:cut]]
    dense.sources[source] = {"episodes": len(trajs), "success": float(np.mean([t.won for t in trajs]))}


# What the estimator's fit depends on: a --prm-path file is reused only when all of these match.
ESTIMATOR_SETTINGS = ("env", "env_options", "backend", "seed", "model", "action_mode", "history", "max_steps",
                      "temperature", "group_size", "micro_batch_size", "max_grad_norm", "dtype", "warm_start",
                      "warm_start_epochs", "warm_start_lr", "prm_model",
                      "prm_freeze", "prm_warmup_episodes", "prm_epochs", "prm_lr", "prm_batch_size")


def load_saved_estimator(cfg):
    """--prm-path: the saved fit (dict), or None when there is no file yet. A file fitted under other
    settings is a ConfigError, so two runs never silently share different reward models."""
    if not cfg.prm_path or not os.path.exists(cfg.prm_path):
        return None
    try:
        saved = torch.load(cfg.prm_path, map_location="cpu", weights_only=False)
        settings = saved["settings"]
    except Exception as e:
        raise ConfigError(f"--prm-path {cfg.prm_path} is not a saved progress estimator ({e})") from None
    diff = [f"{k}={settings.get(k)!r} there, {getattr(cfg, k)!r} here" for k in ESTIMATOR_SETTINGS
            if settings.get(k) != getattr(cfg, k)]
    if diff:
        raise ConfigError(f"--prm-path {cfg.prm_path} was fitted with other settings: {'; '.join(diff)}")
    return saved


def dense_source(policy, cfg):
    """--dense-reward env / progress: the env's values (plus noise). learned: a progress estimator on its own
    backbone (--prm-model: the policy's architecture, whose starting weights fit_dense_source copies in; or
    its own) with its Adam, not fitted yet (fit_dense_source)."""
    dense = DenseSource(np.random.default_rng(cfg.seed + 20_000))
    if cfg.dense_reward == "learned":
        name = cfg.model if cfg.prm_model == "policy" else cfg.prm_model
        lm, tok = build_lm(name, cfg, cfg.seed + 1, flag="--prm-model")
        dense.estimator = ProgressEstimator(lm, tok, policy.tok, cfg.prm_freeze).to(policy.device)
        dense.optimizer = torch.optim.Adam([p for p in dense.estimator.parameters() if p.requires_grad],
                                           lr=cfg.prm_lr)
        dense.train, dense.heldout, dense.sources = [], [], {}
    return dense


def fit_dense_source(dense, policy, cfg):
    """A learned source: with --prm-model policy, start the estimator's backbone from the starting policy's
    weights (after the warm start); collect the starting policy's rollouts (--prm-warmup-episodes), as SPA-RL
    does, fit the estimator for --prm-epochs -- or load that fit from --prm-path. The fit draws from its own
    RNG streams, so fitting and loading leave training identical. Returns (stats, env steps, seconds), the
    last two being the fit's cost."""
    if dense.estimator is None:
        return {}, 0, 0.0
    saved = load_saved_estimator(cfg)
    if saved is not None:
        dense.estimator.load_state_dict(saved["state"])
        dense.sources = saved["sources"]
        return saved["stats"], saved["env_steps"], saved["seconds"]
    start = time.time()
    if cfg.prm_model == "policy":
        dense.estimator.lm.load_state_dict(policy.agent.lm.state_dict())
    data_rng = np.random.default_rng(cfg.seed + 30_000)
    with own_rng(cfg.seed + 30_000, policy.device):
        n = cfg.prm_warmup_episodes
        seeds = data_rng.integers(0, cfg.train_tasks, -(-n // cfg.group_size))
        trajs = rollout(policy, cfg, seeds, temperature=cfg.temperature)[:n]
        add_estimator_data(dense, "warmup", trajs, data_rng)
        stats = fit_estimator(dense, cfg, cfg.prm_epochs, torch.Generator().manual_seed(cfg.seed + 30_000))
    steps, seconds = sum(len(t.steps) for t in trajs), time.time() - start
    if cfg.prm_path:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.prm_path)), exist_ok=True)
        saved = {"settings": {k: getattr(cfg, k) for k in ESTIMATOR_SETTINGS},
                 "state": dense.estimator.state_dict(), "sources": dense.sources, "stats": stats,
                 "env_steps": steps, "seconds": seconds}
        # a run starting meanwhile never reads half a file
        save_atomically(cfg.prm_path, lambda p: torch.save(saved, p))
    return stats, steps, seconds


# ----------------------------------------------------------------------------------------------
# Config: the flags, and validate, the one place derived settings are filled in


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line and exit code 2, no usage dump and no traceback."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser():
    # allow_abbrev=False: a prefix is no flag (an old `--reward rspo` is refused, not read as --reward-scale).
    # Longer explanations of every flag: docs/flags.md.
    p = Parser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
               allow_abbrev=False)
    a, on_off = p.add_argument, argparse.BooleanOptionalAction
    # what to run
    a("--env", default="alfworld", choices=["alfworld", "webshop"], help="text environment")
    a("--env-options", default="{}",
      help='JSON dict passed to envs.make_env, e.g. \'{"num_receptacles": 6}\'')
    a("--backend", default="offline", choices=["offline", "real"], help="offline shim or the real benchmark")
    a("--algo", default="grpo", choices=["grpo", "ppo", "gigpo"],
      help="base algorithm (verl's adv_estimator)")
    a("--method", default="rspo", choices=["rspo", "outcome", "dense"],
      help="which method trains A: rspo: the reward-swap cycle; outcome/dense: A alone on that reward")
    # RSPO
    a("--k", type=int, default=3, help="updates of B, then of A, per RSPO cycle")
    a("--alpha", type=float, default=0.125,
      help="share of buffer groups in A's batch, alpha = m/(n+m) (on average "
      "when alpha x --num-groups is fractional)")
    a("--buffer-sampling", default="reward", choices=["reward", "variance", "random"],
      help="which buffer groups A replays first")
    a("--buffer-source", default="explorer", choices=["explorer", "self"],
      help="explorer: B's swapped trajectories (RSPO); self: A's own previous rollouts (RSPO_H)")
    a("--explorer-reward", default="dense", choices=["dense", "outcome"], help="B's reward (outcome: RSPO_O)")
    a("--explorer-lr", type=float, default=None, help="Adam lr of B's k updates (default: --lr)")
    # batch and budget
    a("--updates", type=int, default=20, help="budget: number of A's updates (the main runs: 100)")
    a("--num-groups", type=int, default=8, help="groups (tasks) per batch (paper: 16)")
    a("--group-size", type=int, default=8, help="episodes per group (TRL's num_generations)")
    a("--max-steps", type=int, default=30,
      help="cap on steps per episode (the env's own limit wins when smaller)")
    a("--history", type=int, default=2, help="past (observation, action) pairs in the prompt")
    # model, decoding, resources
    a("--model", default="tiny",
      help="'tiny' (built offline) or a Hugging Face causal LM id / local directory")
    a("--copy-term", action=on_off, default=None,
      help="add w log(1 + count in the prompt) to each token's logit, "
      "w learned (a pointer-style copy term; default: as a saved --model DIR learned, else off)")
    a("--action-mode", default="auto", choices=["auto", "constrained", "generate"],
      help="constrained: decode only admissible actions (auto for tiny); generate: <think>/<action> text")
    a("--max-new-tokens", type=int, default=256, help="generation budget per step in generate mode")
    a("--temperature", type=float, default=1.0, help="sampling temperature for training rollouts")
    a("--eval-temperature", type=float, default=0.4, help="sampling temperature for evaluation")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
      help="auto: float32 weights, bf16 autocast on CUDA; otherwise the weights' own dtype (docs/gpu.md)")
    a("--device", default="auto", help="auto (cuda -> mps -> cpu), cpu, cuda, mps, cuda:1 ...")
    a("--gradient-checkpointing", action=on_off, default=False, help="trade compute for memory")
    a("--explorer-offload", action=on_off, default=False, help="A waits in CPU memory while B trains")
    a("--generation-batch-size", type=int, default=128,
      help="prompts per generate call (bounds the KV cache; "
      "TRL's generation_batch_size)")
    # optimisation
    a("--lr", type=float, default=None, help="Adam learning rate (default 1e-4 for tiny, 1e-6 otherwise)")
    a("--warm-start", type=int, default=None,
      help="before RL, imitate this many demonstrator episodes (offline "
      "envs; default 1000 for tiny, 0 for a given --model)")
    a("--warm-start-epochs", type=int, default=3, help="passes over the demonstrations")
    a("--warm-start-lr", type=float, default=1e-3, help="Adam learning rate of the imitation")
    a("--epochs", type=int, default=1, help="passes over each batch (TRL's num_iterations)")
    a("--minibatch-size", type=int, default=128, help="step samples per optimizer step")
    a("--micro-batch-size", type=int, default=16,
      help="samples per forward pass (gradient accumulation; small "
      "passes keep activations in cache: docs/performance.md)")
    a("--clip-eps", type=float, default=0.2, help="PPO clip range epsilon")
    a("--clip-ratio-c", type=float, default=3.0,
      help="dual-clip bound for negative advantages (verl's clip_ratio_c)")
    a("--beta", type=float, default=0.0, help="KL coefficient to a frozen reference (k3 / low_var_kl)")
    a("--ent-coef", type=float, default=0.0, help="entropy bonus coefficient")
    a("--max-grad-norm", type=float, default=1.0, help="gradient-norm clip")
    a("--norm-adv", action=on_off, default=True, help="divide by the group std (TRL's scale_rewards)")
    a("--gamma", type=float, default=0.95, help="discount (GiGPO step returns, PPO GAE)")
    a("--lam", type=float, default=0.95, help="PPO GAE lambda")
    a("--omega", type=float, default=1.0, help="GiGPO weight of the step-level advantage")
    a("--vf-coef", type=float, default=0.5, help="PPO value-loss coefficient")
    a("--vf-clip", type=float, default=0.5, help="PPO value clip range (verl's cliprange_value)")
    a("--reward-scale", type=float, default=10.0, help="success reward (and dense-reward scale)")
    a("--invalid-penalty", type=float, default=0.1, help="penalty for an unparseable response")
    # dense rewards: the env's, or a learned progress estimator (SPA-RL); docs/dense-rewards.md
    a("--dense-reward", default="env", choices=["env", "progress", "learned"],
      help="env: info['dense_reward']; progress: the env's progress increments; "
      "learned: a progress estimator")
    a("--dense-noise", type=float, default=0.0,
      help="std of seeded Gaussian noise added to every dense reward")
    a("--prm-model", default="policy",
      help="estimator backbone: 'policy' (a copy of the warm-started policy), "
      "'tiny' or an HF id / path")
    a("--prm-freeze", action=on_off, default=False, help="train only the estimator's MLP head")
    a("--prm-warmup-episodes", type=int, default=256, help="estimator data: episodes of the starting policy")
    a("--prm-epochs", type=int, default=None,
      help="passes over the estimator's data (default 10 ALFWorld, 5 WebShop)")
    a("--prm-lr", type=float, default=None, help="estimator Adam lr (default 1e-3 for tiny, 1e-5 otherwise)")
    a("--prm-batch-size", type=int, default=16, help="trajectories per estimator optimizer step")
    a("--prm-path", default=None,
      help="fitted estimator file: loaded if it exists (same settings), else saved there")
    # evaluation, logging, the run directory
    a("--eval-every", type=int, default=5, help="evaluate every N updates of A (0: start and end only)")
    a("--eval-episodes", type=int, default=256, help="held-out tasks per evaluation (at most the split's)")
    a("--eval-split", default=None, help="held-out split(s), comma-separated (default: valid_seen / test)")
    a("--final-eval-repeats", type=int, default=0,
      help="after the last update, play every task of the held-out "
      "panels this many times (final/success: the fair test's low-noise measure; 0: off)")
    a("--seed", type=int, default=0, help="seeds python, numpy, torch and every environment")
    a("--threads", type=int, default=0,
      help="torch CPU threads (0: torch's default, the machine's cores; runs side "
      "by side: 1 each, as scripts/reproduce.py does)")
    a("--output-dir", default=None, help="where config.json, metrics.jsonl, model/ go (default runs/<name>)")
    a("--overwrite", action="store_true", help="replace the run already in --output-dir")
    a("--resume", action="store_true", help="continue the run in --output-dir from its latest checkpoint")
    a("--save-every", type=int, default=0, help="checkpoint every N updates of A (0: never)")
    a("--save-model", action=on_off, default=True, help="save_pretrained at the end")
    a("--progress", action=on_off, default=None, help="tqdm bar (default: if a tty)")
    return p


def validate(cfg):
    """Check the settings (bad input: ConfigError) and fill in every derived one: the prompt and action mode,
    the learning rates, the warm start, the output directory, the held-out split, the env's episode cap and
    its number of train tasks (probe_env). The one place cfg is changed; returns it."""
    bounds = [("must be >= 1", lambda v: v >= 1, "group_size num_groups updates k epochs minibatch_size "
               "micro_batch_size generation_batch_size max_new_tokens max_steps eval_episodes "
               "warm_start_epochs prm_batch_size"),
              ("must be >= 0", lambda v: v >= 0, "threads warm_start eval_every final_eval_repeats "
               "save_every history beta ent_coef vf_coef invalid_penalty dense_noise prm_warmup_episodes "
               "prm_epochs"),
              ("must be > 0", lambda v: v > 0, "lr explorer_lr warm_start_lr prm_lr clip_eps vf_clip "
               "max_grad_norm reward_scale")]
    for msg, ok, names in bounds:   # None: a default filled in below
        for name in names.split():
            if getattr(cfg, name) is not None and not ok(getattr(cfg, name)):
                raise ConfigError(f"--{name.replace('_', '-')} {msg}")
    checks = [
        (0.0 <= cfg.alpha < 1.0, "--alpha must be in [0, 1)"),
        (cfg.temperature > 0 and cfg.eval_temperature >= 0, "temperatures must be positive"),
        (cfg.clip_ratio_c > 1, "--clip-ratio-c must be > 1"),
        (0 <= cfg.seed < 2 ** 31, "--seed must be in [0, 2^31)"),
        (0.0 <= cfg.gamma <= 1.0 and 0.0 <= cfg.lam <= 1.0, "--gamma and --lam must be in [0, 1]"),
        (not cfg.warm_start or cfg.backend == "offline",
         "--warm-start needs --backend offline (the searching demonstrator reads the offline env's state)"),
        (not (cfg.overwrite and cfg.resume), "--overwrite and --resume exclude each other"),
        (cfg.dense_reward != "learned" or cfg.prm_warmup_episodes > 0,
         "--dense-reward learned needs --prm-warmup-episodes"),
        (not cfg.prm_path or cfg.dense_reward == "learned", "--prm-path needs --dense-reward learned"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    try:
        cfg.env_options = json.loads(cfg.env_options) if isinstance(cfg.env_options, str) else cfg.env_options
    except json.JSONDecodeError as e:
        raise ConfigError(f"--env-options is not valid JSON: {e}") from None
    if not isinstance(cfg.env_options, dict):
        raise ConfigError("--env-options must be a JSON object")
    # A tiny model (built here, or saved by this script and passed back as --model DIR) reads the compact
    # prompt and decodes constrained by default; a pretrained chat model reads verl-agent's full prompt.
    saved = saved_settings(cfg.model) if cfg.model != "tiny" else {}
    cfg.prompt = "compact" if cfg.model == "tiny" else saved.get("prompt", "full")
    if cfg.action_mode == "auto":
        cfg.action_mode = saved.get("action_mode", "constrained" if cfg.prompt == "compact" else "generate")
    if cfg.copy_term is None:
        cfg.copy_term = "copy_weight" in saved
    if cfg.lr is None:   # 1e-4: larger Adam steps undo a warm start (results/diagnosis/ at 25efb16)
        cfg.lr = saved.get("lr", 1e-4 if cfg.prompt == "compact" else 1e-6)
    cfg.explorer_lr = cfg.explorer_lr or cfg.lr
    if cfg.warm_start is None:   # a model of its own (pretrained or saved by a run) has already learned
        cfg.warm_start = 1000 if cfg.model == "tiny" and cfg.backend == "offline" else 0
    cfg.output_dir = cfg.output_dir or os.path.join("runs", f"{cfg.env}_{cfg.method}_{cfg.algo}_s{cfg.seed}")
    if cfg.prm_lr is None:
        cfg.prm_lr = 1e-3 if (cfg.model if cfg.prm_model == "policy" else cfg.prm_model) == "tiny" else 1e-5
    cfg.eval_split = cfg.eval_split or {"alfworld": "valid_seen", "webshop": "test"}[cfg.env]
    # WebShop's 205 trajectories overfit by 10 passes (and 5 fit in < 2 CPU minutes)
    if cfg.prm_epochs is None:
        cfg.prm_epochs = {"alfworld": 10, "webshop": 5}[cfg.env]
    cfg.progress = sys.stderr.isatty() if cfg.progress is None else cfg.progress
    cfg.env_options["max_steps"], cfg.train_tasks = probe_env(cfg)
    if cfg.method == "rspo" and replay_groups(cfg.alpha, cfg.num_groups, 1) >= cfg.num_groups:
        raise ConfigError("--alpha leaves no on-policy group")
    return cfg


# ----------------------------------------------------------------------------------------------
# Checkpoints: a run can be stopped at any point and resumed with --resume

CHECKPOINT = os.path.join("checkpoint", "state.pt")
RUN_CONTROL = ("overwrite", "resume", "save_every", "progress", "output_dir")   # never change results


def run_settings(cfg):
    """The settings that determine a run's results: a resumed run must have the same."""
    return {k: v for k, v in vars(cfg).items() if k not in RUN_CONTROL}


def save_checkpoint(out_dir, cfg, policy, optimizer, dense, state, record):
    """Everything a resumed run needs: the weights with the value head, Adam's state, the estimator with its
    data and Adam, every RNG stream, the buffer and its cursor, the counters. Written, then renamed over the
    previous one: a run killed while saving keeps its last complete checkpoint."""
    path = os.path.join(out_dir, CHECKPOINT)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    estimator = {} if dense.estimator is None else {
        "estimator": dense.estimator.state_dict(), "estimator_optimizer": dense.optimizer.state_dict(),
        "train": dense.train, "heldout": dense.heldout, "sources": dense.sources}
    saved = {"settings": run_settings(cfg), "record": record, "agent": policy.agent.state_dict(),
             "optimizer": optimizer.state_dict(), "state": replace(state, generator=None),
             "generator": state.generator.get_state(), "noise_rng": dense.noise_rng, **estimator,
             "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    save_atomically(path, lambda p: torch.save(saved, p))


def current_names(settings):
    """Saved settings (a checkpoint's, a run's config.json) under today's names: those written before --reward
    was renamed --method hold the method as "reward"; those written before --copy-term existed ran without it.
    """
    if "reward" in settings and "method" not in settings:
        settings = {("method" if k == "reward" else k): v for k, v in settings.items()}
    return {"copy_term": False, **settings}


def load_checkpoint(cfg):
    """--resume: the checkpoint in --output-dir, or None when the directory holds no run yet. Without --resume
    or --overwrite a directory holding a run is refused, so a new run never replaces an earlier one."""
    out = cfg.output_dir
    if not any(os.path.exists(os.path.join(out, f)) for f in ("config.json", "metrics.jsonl")):
        return None
    if cfg.overwrite:
        return None
    if not cfg.resume:
        raise ConfigError(f"--output-dir {out} already holds a run: --overwrite replaces it, "
                          "--resume continues it")
    path = os.path.join(out, CHECKPOINT)
    if not os.path.isfile(path):
        raise ConfigError(f"--resume: {out} holds a run but no checkpoint (--save-every); "
                          "--overwrite starts it again")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    saved, now = current_names(checkpoint["settings"]), run_settings(cfg)
    diff = [f"{k}={saved.get(k)!r} there, {now.get(k)!r} here" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)]
    if diff:
        raise ConfigError(f"--resume: the run in {out} has other settings: {'; '.join(diff)}")
    return checkpoint


def restore_checkpoint(checkpoint, policy, optimizer, dense, cfg):
    """Load a checkpoint into the freshly built run; the global torch RNG last, as nothing may draw after it.
    Returns (TrainState, the last logged record)."""
    policy.agent.load_state_dict(checkpoint["agent"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    dense.noise_rng = checkpoint["noise_rng"]
    if dense.estimator is not None:
        dense.estimator.load_state_dict(checkpoint["estimator"])
        dense.optimizer.load_state_dict(checkpoint["estimator_optimizer"])
        dense.train, dense.heldout = checkpoint["train"], checkpoint["heldout"]
        dense.sources = checkpoint["sources"]
    state = checkpoint["state"]
    state.generator = torch.Generator()
    state.generator.set_state(checkpoint["generator"])
    torch.set_rng_state(checkpoint["torch_rng"])
    if checkpoint["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(checkpoint["cuda_rng"])
    return state, checkpoint["record"]


# ----------------------------------------------------------------------------------------------
# Running: devices, building the policy, the output directory, main


@contextlib.contextmanager
def own_rng(seed, device):
    """A private torch RNG stream (CPU, and the CUDA device in use): sampling inside never shifts the
    training stream, so evaluation or the estimator's fit leave training identical."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def probe_env(cfg):
    """Build one environment up front, so a missing backend or a bad option is a one-line error. Returns the
    episode cap (--max-steps, or the env's own limit when smaller) and the number of train tasks (validate
    fills them in)."""
    try:
        env = envs.make_env(cfg.env, split="train", seed=0, backend=cfg.backend, **cfg.env_options)
        _, info = env.reset()
        options = {**cfg.env_options, "max_steps": min(cfg.max_steps, env.max_steps)}
        train_tasks = envs.num_tasks(cfg.env, "train", backend=cfg.backend, **options)
        for split in cfg.eval_split.split(","):
            envs.num_tasks(cfg.env, split, backend=cfg.backend, **options)
    except (ValueError, RuntimeError, ImportError, TypeError, OSError) as e:
        raise ConfigError(f"--env {cfg.env}: {e}") from None
    if cfg.action_mode == "constrained" and not info.get("admissible_actions"):
        raise ConfigError(f"--action-mode constrained needs admissible actions, and {cfg.env} exposes none")
    return options["max_steps"], train_tasks


def move_training_state(agent, optimizer, device):
    """Move an agent's weights and its Adam moments to `device`. Parameters keep their identity
    (Module.to copies in place), so the optimizer still points at them; Adam's `step` stays on the CPU."""
    agent.to(device)
    for state in optimizer.state.values():
        for k, v in state.items():
            if torch.is_tensor(v) and k != "step":
                state[k] = v.to(device)


def release_memory(device):
    """Hand freed blocks back to the device, so the next phase (or another copy) can use them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def offloaded(policy, optimizer, enabled):
    """--explorer-offload: A waits in CPU memory while B trains, so one copy is on the device at a time."""
    if not enabled:
        yield
        return
    move_training_state(policy.agent, optimizer, torch.device("cpu"))
    release_memory(policy.device)
    try:
        yield
    finally:
        move_training_state(policy.agent, optimizer, policy.device)


def save_atomically(path, save):
    """save(path + '.tmp'), then rename it onto path: a kill mid-write leaves the earlier file whole (for
    --resume, or for a run reading it meanwhile)."""
    save(path + ".tmp")
    os.replace(path + ".tmp", path)


def check_writable(path, flag, directory=True):
    """A directory (or a file's directory) can be created and written in, found by trying before any work: the
    missing directories are made, a probe file is written and removed, and what was made is removed again (for
    root, os.access calls anything writable, /proc included)."""
    if directory and os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: is a file")
    where = os.path.abspath(path if directory else os.path.dirname(os.path.abspath(path)))
    missing, parent = [], where
    while not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path}: not writable ({parent} is a file)")
    made = []
    try:
        for d in reversed(missing):
            os.mkdir(d)
            made.append(d)
        probe = os.path.join(where, f".rspo-probe-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: not writable ({e.strerror}: {e.filename})") from None
    finally:
        for d in reversed(made):
            os.rmdir(d)


def open_run_dir(cfg, checkpoint):
    """Prepare --output-dir: --overwrite removes the earlier run's files; --resume keeps its metrics up to the
    checkpoint (a torn last line, from a kill mid-write, is dropped). Returns the kept records."""
    out = cfg.output_dir
    if cfg.overwrite:
        for name in ("config.json", "metrics.jsonl", "checkpoint", "model"):
            p = os.path.join(out, name)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
    os.makedirs(out, exist_ok=True)
    if checkpoint is None:
        return []
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = f.read().splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    records = [r for r in records if r["update"] <= checkpoint["record"]["update"]]
    text = "".join(json.dumps(r) + "\n" for r in records)
    save_atomically(os.path.join(out, "metrics.jsonl"), lambda p: pathlib.Path(p).write_text(text))
    return records


def summary_table(first, last):
    rows = [k for k in last if k.startswith("eval/")]
    lines = [f"{'metric':<40} {'start':>8} {'end':>8}"]
    lines += [f"{k:<40} {first.get(k, float('nan')):>8.3f} {last[k]:>8.3f}" for k in rows]
    return "\n".join(lines)


def main(argv=None, pretrained=None):
    """The command line. pretrained: see build_policy."""
    parser = build_parser()
    cfg = parser.parse_args(argv)
    try:   # every check before any work, and before the output directory is touched
        validate(cfg)   # fills in every derived setting; cfg is not changed after it
        check_writable(cfg.output_dir, "--output-dir")
        checkpoint = load_checkpoint(cfg)
        if cfg.prm_path:
            check_writable(cfg.prm_path, "--prm-path", directory=False)
            load_saved_estimator(cfg)   # a mismatched --prm-path fails here
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device = pick_device(cfg.device)
        policy = build_policy(cfg, device, pretrained)
        dense = dense_source(policy, cfg)
    except ConfigError as e:
        parser.error(str(e))
    out_dir = cfg.output_dir
    records = open_run_dir(cfg, checkpoint)

    def write_config():   # again at the end, with what the progress estimator was fitted on (prm_data)
        prm_data = {"prm_data": dense.sources} if dense.estimator is not None else {}
        text = json.dumps({**vars(cfg), **prm_data, "device": str(device),
                           "command": sys.argv if argv is None else argv}, indent=1)
        save_atomically(os.path.join(out_dir, "config.json"), lambda p: pathlib.Path(p).write_text(text))
    write_config()
    with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
        def log(record):
            records.append(record)
            f.write(json.dumps(record) + "\n")
            f.flush()
        start = time.time()
        last = train(cfg, policy, dense, log, checkpoint, out_dir)
    write_config()
    resumed = f" (resumed at update {checkpoint['record']['update']})" if checkpoint else ""
    print(f"{out_dir}: {cfg.updates} updates of A, {time.time() - start:.0f}s in this process{resumed}, "
          f"env steps A={last['env_steps/A']} B={last['env_steps/B']}")
    print(summary_table(records[0], last))
    if cfg.save_model:
        save_model(policy, cfg, os.path.join(out_dir, "model"))
    return records


if __name__ == "__main__":
    main()
