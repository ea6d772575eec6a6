"""RSPO: Reward-Swap Policy Optimization for multi-turn LLM agents, in one file.

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

Three parts, each under a banner: THE METHOD (the RSPO core, a block to copy whole; the base algorithms;
rollouts; the update; train, the paper's Algorithm 1), which calls nothing below it except through its
arguments; THE POLICY (any Hugging Face causal LM, or a tiny one built offline); THE MACHINERY (logging,
warm start, learned dense reward, flags, checkpoints, main). The environments are envs.py; the README
has the RSPO-specific checklist, docs/checklist.md the rest.
"""
# ==============================================================================================
# THE METHOD
# ==============================================================================================
# The RSPO core (PAPER steps 3-4 and the off-policy clip): copy this block whole, its imports
# included, into another trainer. It works on plain data: trajectories with an outcome each, in
# groups, and per-token log-prob tensors. README, "Copying the RSPO core", shows the contract.
# >>> RSPO core begins
import math
from dataclasses import dataclass, field, replace
from fractions import Fraction

import torch


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
    """Outcome reward vector: scale * won on the final step, minus the format penalty on unparseable steps."""
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
    process_reward: float     # this step's dense reward: the env's, or relabelled (--dense-reward)
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
    """Order in which A replays buffer groups (PAPER: reward-based > variance-based > random). outcomes: one
    1-D tensor of outcome scores per group, groups of any size. reward: highest group mean first; variance:
    highest group std first (the groups with a GRPO signal); random. Ties are broken at random."""
    perm = torch.randperm(len(outcomes), generator=generator)
    if mode == "random":
        return perm
    priority = torch.stack([o.float().mean() if mode == "reward" else o.float().std(unbiased=False)
                            for o in outcomes])
    return perm[torch.argsort(-priority[perm], stable=True)]


def replay_groups(alpha, num_groups, update):
    """m_u, the buffer groups in A's batch at update u (1-based), PAPER's alpha = m / (n + m):
    ceil(alpha N u) - ceil(alpha N (u - 1)) is alpha N at every update when it is whole, on average when not
    (alpha = 1/16, N = 8: one group every other update); no bigger batch for a small alpha; exact."""
    share = Fraction(alpha).limit_denominator(10 ** 6) * num_groups
    return math.ceil(share * update) - math.ceil(share * (update - 1))


@dataclass
class ReplayBuffer:
    """PAPER step 4: one cycle's swapped groups in replay order, and a cursor. Refilled every cycle; A's
    update u takes the next m_u groups (replay_groups), wrapping around when a cycle needs more."""
    groups: list = field(default_factory=list)   # lists of trajectories, highest priority first
    cursor: int = 0                              # groups handed out this cycle

    def refill(self, trajs, mode, generator):
        """A new cycle: the trajectories' groups ordered by buffer_order (mode), the cursor at 0."""
        groups = list(groups_of(trajs).values())
        if groups:   # each group ranked by its own episodes, however many (a trainer may drop some)
            outcomes = [torch.stack([t.rewards.sum() for t in g]) for g in groups]
            groups = [groups[i] for i in buffer_order(outcomes, mode, generator).tolist()]
        self.groups, self.cursor = groups, 0

    def take(self, m, first_id):
        """The next m groups, renumbered first_id, first_id + 1, ... so they never share an id with A's own
        groups (GRPO/GiGPO normalise within a group)."""
        if m and not self.groups:
            raise ValueError(f"ReplayBuffer.take({m}): the buffer is empty (refill it, or take 0 groups)")
        out = [[replace(t, group=first_id + j) for t in self.groups[(self.cursor + j) % len(self.groups)]]
               for j in range(m)]
        self.cursor += m
        return out


# <<< RSPO core ends
# The rest of the file's imports, after the block above that copies alone:
import argparse, contextlib, copy, json, os, pathlib, random, re, shutil, string, sys, time  # noqa: E401,E402
import numpy as np  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
import envs  # noqa: E402


# ---- The base algorithms: small pure functions, tensors in and out; the reward vector a learner sees -------

def _group_normalise(values, group_ids, norm_std, eps):
    """(x - mean_g) / (std_g + eps) within each group (unbiased std); a group of one gets 0."""
    out = torch.zeros_like(values, dtype=torch.float32)
    for g in torch.unique(group_ids):
        x = values[group_ids == g].float()
        if x.numel() > 1:
            out[group_ids == g] = (x - x.mean()) / (x.std() + eps) if norm_std else x - x.mean()
    return out


def grpo_advantages(scores, group_ids, norm_std=True, eps=1e-6):
    """GRPO (Shao et al. 2024, eq. 3 of DeepSeekMath): A_i = (S_i - mean_g S) / (std_g S + eps), S = sum_t r_t
    per trajectory, g its group. norm_std=False gives S - mean_g S (Dr. GRPO, TRL's scale_rewards=False). A
    group of one has no baseline: A = 0."""
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
    """GiGPO (Feng et al. 2025, arXiv 2505.10978, eqs. 5-8): A = A^E + omega * A^S per step row. Episode level
    A^E: GRPO advantage of S = sum_t r_t among a group's trajectories, on each of their rows. Step level A^S:
    the discounted return R_t (gamma) normalised among the rows sharing the group AND anchor state (the env's
    observation; hashables or an integer tensor); a state seen once gets 0."""
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
    """Turn-level GAE (Schulman et al. 2016, eq. 16): delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t +
    gamma lam A_{t+1}, V = 0 after a trajectory's last step. Returns (advantages, advantages + values)."""
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
    d = log pi_ref - log pi, clamped as verl (d to [-20, 20], the estimate to [0, 10])."""
    d = (ref_logp - logp).clamp(-20, 20)
    return (torch.exp(d) - d - 1).clamp(max=10)


def value_loss(values, old_values, returns, clip):
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), mean."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2).mean()


def dense_rewards(process_rewards, invalid, scale=10.0, penalty=0.1):
    """Dense reward vector: each step's process reward on the outcome's scale, minus the format penalty.
    "Training on dense" and "the reward swap" are just a choice of vector."""
    return torch.tensor([scale * d - penalty * float(b) for d, b in zip(process_rewards, invalid)])


def attach_rewards(trajs, kind, cfg, relabel=None):
    """Give every trajectory its training reward vector: 'outcome', or 'dense' from its steps' process
    rewards (set first by relabel(trajs), the dense-reward source, when one is given)."""
    if kind == "dense" and relabel is not None:
        relabel(trajs)
    for t in trajs:
        inv = [s.invalid for s in t.steps]
        t.rewards = (outcome_rewards(len(t.steps), t.won, inv, cfg.reward_scale, cfg.invalid_penalty)
                     if kind == "outcome" else
                     dense_rewards([s.process_reward for s in t.steps], inv, cfg.reward_scale,
                                   cfg.invalid_penalty))
    return trajs


# ---- Rollout: groups of episodes, batched across environments (one decoding pass per env step) -------------

def rollout(policy, cfg, seeds, split="train", temperature=None, act=None, group_size=None):
    """Play group_size copies of each task seed (same task, same initial state) until every episode ends, at
    `temperature` (default --temperature); one Trajectory per episode, group g the copies of seeds[g].
    act(prompts, admissibles, environments) -> [(response_ids, action, invalid, logp)]: the policy's sampler
    (logp: the behaviour log-probs) by default, or another agent (demonstrator, logp None)."""
    temperature = cfg.temperature if temperature is None else temperature
    gs = group_size or (cfg.group_size if split == "train" else 1)
    act = act or (lambda prompts, adm, _: policy.act(prompts, adm, temperature))
    games = [(g, int(s)) for g, s in enumerate(seeds) for _ in range(gs)]
    environments = [envs.make_env(cfg.env, split=split, seed=s, backend=cfg.backend, **cfg.env_options)
                    for _, s in games]
    live = [{"obs": obs, "info": info, "history": [], "steps": [], "done": False}
            for obs, info in (env.reset() for env in environments)]
    while active := [i for i, st in enumerate(live) if not st["done"]]:
        prompts, admissible = [], []
        for i in active:
            st = live[i]
            hist = st["history"][-cfg.history:] if cfg.history else []
            # verl-agent leaves ALFWorld's "help" out of the actions offered to the agent.
            admissible.append([a for a in st["info"]["admissible_actions"] if a != "help"])
            prompts.append(policy.prompt(st["info"]["task"], hist, st["obs"], admissible[-1],
                                         len(st["history"])))
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


# ---- Update: one step of the base algorithm on a batch of on-policy and buffer trajectories ----------------

def _pad(rows):
    return nn.utils.rnn.pad_sequence(rows, batch_first=True)


def length_sorted_chunks(indices, lengths, size):
    """Split indices into passes of `size` samples of similar length (lengths[i]), so little is padding."""
    ordered = sorted(indices, key=lambda i: lengths[i])
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def sequence_lengths(steps):
    return [len(s.prompt_ids) + len(s.response_ids) for s in steps]


def advantages_for(trajs, cfg, values):
    """Per-step advantages of the base algorithm from each trajectory's reward vector; PPO's returns."""
    rewards = torch.cat([t.rewards for t in trajs]).float()
    traj_ids = torch.tensor([i for i, t in enumerate(trajs) for _ in t.steps])
    group_ids = torch.tensor([t.group for t in trajs for _ in t.steps])
    if cfg.algo == "grpo":
        scores = torch.stack([t.rewards.sum() for t in trajs])
        return grpo_advantages(scores, torch.tensor([t.group for t in trajs]), cfg.norm_adv)[traj_ids], None
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


def optimizer_step(parameters, optimizer, max_grad_norm):
    """Clip the gradient norm (--max-grad-norm) and step; no gradients are held afterwards (B's phase needs
    the room). Returns the norm before clipping."""
    norm = float(nn.utils.clip_grad_norm_(parameters, max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


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


def replay_diagnostics(behav_logp, old_logp, tokens):
    """How far the replayed tokens' behaviour policy (B) is from A = pi_old: KL(pi_behav || pi_old) per token
    (kl_k3, unbiased on pi_behav's samples), the clip centre pi_old / pi_behav's 10th, 90th centiles; and the
    replayed tokens' share of the batch's `tokens`: J_off's weight in the token-mean (alpha counts groups)."""
    centre = torch.exp(old_logp - behav_logp).float()
    p10, p90 = torch.quantile(centre, torch.tensor([0.1, 0.9])).tolist()
    return {"buffer/explorer_kl": float(kl_k3(behav_logp, old_logp).mean()), "buffer/clip_centre_p10": p10,
            "buffer/clip_centre_p90": p90, "buffer/token_share": len(behav_logp) / tokens}


def update(policy, optimizer, trajs, cfg, generator, ref=None, replayed=()):
    """One update (the unit of the budget): the base algorithm's advantages, then --epochs passes of minibatch
    Adam on the clipped surrogate (+ entropy, KL and value terms). trajs: the policy's own fresh rollouts;
    replayed: buffer trajectories another policy sampled (B, or RSPO_H's earlier A); ref: the KL reference."""
    own, other = [s for t in trajs for s in t.steps], [s for t in replayed for s in t.steps]
    steps = own + other
    # pi_old of replayed steps needs a pass of this policy (PPO's V_old needs one over every state); the
    # sampler recorded its own steps' log-probs, which are pi_old there (behav_logp = old_logp: c = 1).
    if cfg.algo == "ppo":
        scored, old_values = score_steps(policy, steps, cfg)
        scored = scored[len(own):]
    else:
        scored, old_values = score_steps(policy, other, cfg)[0], None
    old_logp, behav_logp = [s.behav_logp for s in own] + scored, [s.behav_logp for s in steps]
    ref_logp = score_steps(ref, steps, cfg)[0] if ref is not None else None
    diagnostics = replay_diagnostics(torch.cat([s.behav_logp for s in other]), torch.cat(scored),
                                     sum(len(s.response_ids) for s in steps)) if other else {}
    adv, returns = advantages_for(list(trajs) + list(replayed), cfg, old_values)
    lengths, stats = sequence_lengths(steps), []
    policy.agent.train()
    for mb in minibatches(len(steps), cfg.minibatch_size, cfg.epochs, generator):
        tokens, acc = sum(len(steps[i].response_ids) for i in mb), {}
        for idx in length_sorted_chunks(mb, lengths, cfg.micro_batch_size):
            logp, mask, ent, values = policy.forward([steps[i] for i in idx], cfg.temperature, True)
            rows = lambda per_step: _pad([per_step[i] for i in idx]).to(logp.device)
            old, behav, a = rows(old_logp), rows(behav_logp), adv[idx].to(logp.device).unsqueeze(1)
            # pi_theta = logp, pi_old = old, pi_behav = behav: c = 1 on own steps, pi_old / pi_B on replayed
            pg_loss, clipfrac = shifted_clip_loss(logp, old, behav, a, mask, cfg.clip_eps, cfg.clip_ratio_c)
            entropy = masked_mean(ent, mask)
            kl = masked_mean(kl_k3(logp, rows(ref_logp)), mask) if ref is not None else 0.0
            v_loss = (value_loss(values, old_values[idx].to(logp.device), returns[idx].to(logp.device),
                                 cfg.vf_clip) if returns is not None else 0.0)
            # The minibatch's loss, accumulated over chunks of --micro-batch-size samples: each chunk's
            # token-means count by tw, its share of the minibatch's tokens, its value loss (a mean over
            # states) by sw, its share of the samples: the gradient does not depend on how it is cut.
            tw, sw = mask.sum().item() / tokens, len(idx) / len(mb)
            loss = tw * pg_loss - cfg.ent_coef * tw * entropy + cfg.beta * tw * kl + cfg.vf_coef * sw * v_loss
            loss.backward()
            logged = {"losses/policy_loss": pg_loss, "losses/clipfrac": clipfrac, "losses/entropy": entropy,
                      "losses/approx_kl": masked_mean(kl_k3(logp, old), mask),
                      **({"losses/kl": kl} if ref is not None else {}),
                      **({"losses/value_loss": v_loss} if returns is not None else {})}
            for k, v in logged.items():   # weighted as in the loss
                acc[k] = acc.get(k, 0.0) + (sw if k == "losses/value_loss" else tw) * float(v.detach())
        acc["losses/grad_norm"] = optimizer_step(policy.agent.parameters(), optimizer, cfg.max_grad_norm)
        stats.append(acc)
    return {**{k: sum(a[k] for a in stats) / len(stats) for k in stats[0]}, **diagnostics}


# ---- The RSPO cycle (PAPER Algorithm 1) --------------------------------------------------------------------

@dataclass
class TrainState:
    """What A's loop carries from one update to the next besides the weights and Adam (checkpointed): the
    algorithm's, then the bookkeeping's (Run's), which train never reads."""
    rng: np.random.Generator     # which train tasks are played
    generator: torch.Generator   # minibatch order and buffer ties
    updates: int = 0             # A's updates done
    buffer: ReplayBuffer = field(default_factory=ReplayBuffer)
    own_this_cycle: list = field(default_factory=list)   # RSPO_H: A's rollouts this cycle, the next buffer
    totals: dict = field(default_factory=dict)           # env steps, updates, seconds of A, B, warm start...
    last_explorer: dict = field(default_factory=dict)    # B's last rollout stats, logged with every update
    seen_states: set = field(default_factory=set)        # A's distinct observations
    explorer_states: set = field(default_factory=set)    # B's
    wins: dict = field(default_factory=dict)             # running wins per task type (batch_stats)


def train(cfg, A, optimizer, state, ref, relabel, run):
    """PAPER Algorithm 1: A's updates state.updates + 1 ... --updates. With --method rspo a cycle starts every
    k updates: the explorer B <- copy(A) is trained for k updates on --explorer-reward, plays a fresh batch,
    and that batch, swapped to the outcome reward, becomes the buffer. Each update of A trains on n_u fresh
    groups of its own and the buffer's next m_u groups, n_u + m_u = --num-groups. --method outcome / dense:
    the base algorithm alone. RSPO_H (--buffer-source self): the buffer is A's rollouts of the last cycle.
    ref: the KL reference or None; relabel(trajs): sets the process rewards; run: the bookkeeping."""
    tasks = lambda n: state.rng.integers(0, cfg.train_tasks, n)   # the train tasks of n groups
    a_reward = "dense" if cfg.method == "dense" else "outcome"
    for u in range(state.updates + 1, cfg.updates + 1):
        explored, cycle_starts = [], cfg.method == "rspo" and (u - 1) % cfg.k == 0   # B's batches
        if cycle_starts and cfg.buffer_source == "explorer":
            with run.explorer_phase():   # timed; with --explorer-offload A waits in host memory
                B = replace(A, agent=copy.deepcopy(A.agent).to(A.device))                  # B <- copy(A),
                b_optimizer = torch.optim.Adam(B.agent.parameters(), lr=cfg.explorer_lr)   # a fresh Adam
                for _ in range(cfg.k):   # k updates of B on the explorer reward
                    trajs = rollout(B, cfg, tasks(cfg.num_groups))
                    explored.append(attach_rewards(trajs, cfg.explorer_reward, cfg, relabel))
                    update(B, b_optimizer, explored[-1], cfg, state.generator, ref)
                explored.append(rollout(B, cfg, tasks(cfg.num_groups)))   # B's fresh batch, B's log-probs
                del B, b_optimizer   # B's memory goes back before A's phase
            swapped = reward_swap(explored[-1], cfg.reward_scale, cfg.invalid_penalty)   # the reward swap
            state.buffer.refill(swapped, cfg.buffer_sampling, state.generator)   # the buffer, by priority
        elif cycle_starts:   # RSPO_H
            state.buffer.refill(state.own_this_cycle, cfg.buffer_sampling, state.generator)
            state.own_this_cycle = []
        m = replay_groups(cfg.alpha, cfg.num_groups, u) if state.buffer.groups else 0   # m_u; n_u = N - m_u
        own = attach_rewards(rollout(A, cfg, tasks(cfg.num_groups - m)), a_reward, cfg, relabel)
        replayed = [t for g in state.buffer.take(m, first_id=cfg.num_groups - m) for t in g]
        stats = update(A, optimizer, own, cfg, state.generator, ref, replayed)   # A's update on both
        if cfg.method == "rspo" and cfg.buffer_source == "self":   # RSPO_H's next buffer, ids kept apart
            slot = (u - 1) % cfg.k * cfg.num_groups
            state.own_this_cycle += [replace(t, group=slot + t.group) for t in own]
        state.updates = u
        run.after_update(u, own, replayed, explored, stats)


# ==============================================================================================
# THE POLICY: the agent RSPO trains. Any Hugging Face causal LM (or a tiny one built offline) with a
# value head for PPO: prompts, constrained or free decoding, the log-probs, devices. Nothing in it knows
# about RSPO: a Policy renders states as prompts, samples actions (act) and scores responses (forward).
# ==============================================================================================

class ConfigError(ValueError):
    """Bad user input: reported as one line and exit code 2, never a traceback."""


COMPACT_TEMPLATE = "task : {task} . history : {history} . observation : {obs}"
FULL_TEMPLATE = {
    "alfworld": "You are an expert agent operating in the ALFRED Embodied Environment. ",
    "webshop": "You are an expert autonomous agent operating in the WebShop e-commerce game environment. ",
}
FULL_BODY = (
    "Your task is to: {task}.\nPrior to this step, you have already taken {step} step(s). Below are the "
    "most recent {n} observations and the corresponding actions you took: {history}\n"
    "You are now at step {step1} and your current observation is: {obs}\n"
    "Your admissible actions of the current situation are: [{admissible}].\n\n"
    "Now it's your turn to take an action. You should first reason step-by-step about the current "
    "situation. This reasoning process MUST be enclosed within <think> </think> tags. Once you've "
    "finished your reasoning, you should choose an admissible action for current step and present it "
    "within <action> </action> tags.")


def build_prompt(task, history, obs, admissible, step, compact, env):
    """Render the state. Full: verl-agent's prompt for `env` (its role sentence, the task, the last pairs,
    the observation, the admissible actions). Compact (a tiny model): the task, the last actions and the
    observation; constrained decoding enforces the admissible actions instead of listing them."""
    if compact:
        actions = " ; ".join(a for _, a in history) or "none"
        return COMPACT_TEMPLATE.format(task=task, history=actions, obs=obs)
    first = step - len(history) + 1   # the number of the oldest step shown
    hist = " ".join(f"[Observation {first + i}: '{o}', Action {first + i}: '{a}']"
                    for i, (o, a) in enumerate(history))
    adm = ", ".join(f"'{a}'" for a in admissible)
    return FULL_TEMPLATE[env] + FULL_BODY.format(task=task, step=step, n=len(history), history=hist or "none",
                                                 step1=step + 1, obs=obs, admissible=adm)


def parse_action(text):
    """verl-agent's projection: (the text inside <action>...</action>, stripped and lower-cased, True), valid
    only with a <think>...</think> block too; an invalid response goes to the env as it is, (text, False)."""
    m = re.search(r"<action>(.*?)</action>", text, re.S)
    valid = m is not None and "<think>" in text and "</think>" in text
    return (m.group(1).strip().lower(), True) if valid else (text.strip(), False)


def build_tiny_tokenizer(words):
    """Word-level tokenizer built in memory: every word of the environment, every punctuation mark."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    specials = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
    vocab = {w: i for i, w in enumerate(specials + sorted(set(words) | set(string.punctuation)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation("isolated")])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   bos_token="[BOS]", eos_token="[EOS]", padding_side="left",
                                   model_input_names=["input_ids", "attention_mask"])


def tiny_vocabulary(env_name, backend, env_options):
    """The environment's words and the prompts' (backend="real": the offline words; the rest is [UNK])."""
    words = COMPACT_TEMPLATE + FULL_BODY + "".join(FULL_TEMPLATE.values()) + "think action Observation Action"
    return envs.vocabulary(env_name, backend=backend, **env_options) + re.findall(r"\w+", words)


def build_tiny_model(vocab_size, tok, seed):
    """A small Llama (hidden 128, 2 layers, 4 heads, FFN 512; 0.56M parameters with ALFWorld's words), no
    network. Hidden 128, not 64: it learns to act on the task's words far faster (results/README.md)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def saved_settings(model):
    """How a model this script saved learned (its rspo.json: prompt, action mode, lr, copy term), or {}."""
    path = os.path.join(os.path.expanduser(model), "rspo.json")
    return json.loads(pathlib.Path(path).read_text()) if os.path.isfile(path) else {}


def load_pretrained(name, dtype, flag="--model"):
    """Any causal LM id or local directory (a GGUF file: convert it first, scripts/gguf_to_hf.py); a tiny
    model saved by this script reloads its word-level tokenizer. flag: named in errors."""
    if name.endswith(".gguf"):
        raise ConfigError(f"{flag} {name}: a GGUF file; convert it first: "
                          f"python scripts/gguf_to_hf.py {name} DIR")
    if name.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(name)):
        raise ConfigError(f"{flag} {name}: no such directory")
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast   # after HF_HUB_...
    tokenizer = PreTrainedTokenizerFast if saved_settings(name).get("prompt") == "compact" else AutoTokenizer
    try:
        tok = tokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except (OSError, ValueError, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false", "no", "off")
        raise ConfigError(f"{flag} {name}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                          f"download it first (`hf download {name}`) or pass a local directory"
                          if offline else f"{flag} {name}: cannot load: {first}") from None
    distinct_pad(model, tok)
    tok.padding_side = "left"
    return model, tok


def distinct_pad(model, tok):
    """Give the tokenizer a pad token that is no end-of-turn id, so every end of turn stops a response and
    masks never take padding for a stop (Qwen2.5-Instruct pads with <|endoftext|>, an end of turn too)."""
    if tok.pad_token is None or tok.pad_token_id in stop_token_ids(tok, model.generation_config):
        tok.add_special_tokens({"pad_token": "<|rspo_pad|>"})
        model.resize_token_embeddings(len(tok))


def stop_token_ids(tok, generation_config):
    """Ids that end a response: the tokenizer's EOS plus the checkpoint's generation_config EOS ids (a chat
    model's end of turn: e.g. Qwen2.5-Instruct lists <|im_end|> and <|endoftext|>). Every one stops."""
    extra = generation_config.eos_token_id
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return sorted({tok.eos_token_id, *extra} - {None})


@contextlib.contextmanager
def without_checkpoint_sampling(lm):
    """generate fills every GenerationConfig field left None from the checkpoint's generation_config (e.g.
    Qwen2.5-Instruct's top_k 20, top_p 0.8): set aside in the call, only Policy.generate's fields apply."""
    from transformers import GenerationConfig
    saved, lm.generation_config = lm.generation_config, GenerationConfig()
    try:
        yield
    finally:
        lm.generation_config = saved


def cut_response(row, stop_ids):
    """A generated row up to and including its first stop id. A row without one ran to max_new_tokens,
    so all of it is real: generate pads only after a row has stopped, and never with a stop id."""
    return next((row[:j + 1] for j, t in enumerate(row) if t in stop_ids), row)


def copy_features(prompts, vocab):
    """[B, vocab]: log(1 + n_v), n_v the times token v occurs in each prompt (the input of --copy-term)."""
    counts = torch.zeros(len(prompts), vocab)
    for row, ids in zip(counts, prompts):
        row.index_add_(0, torch.tensor(ids, dtype=torch.long), torch.ones(len(ids)))
    return counts.log1p()


@dataclass
class CopyTerm:
    """generate's logits processor for --copy-term: the bias Agent.logits adds, added where the sampler draws
    (HF runs it before the temperature, as Policy.head divides after it: sampler = learner)."""
    bias: torch.Tensor

    def __call__(self, input_ids, scores):
        return scores + self.bias.to(scores.device)


class SampledLogProbs:
    """generate's last logits processor: records log pi of each sampled token under the distribution sampled
    from (the processed scores / T, as Policy.head), so the update needs no scoring pass of its own steps.
    Each call reads the token the previous call chose (the last input id); result() adds the last one."""

    def __init__(self, temperature):
        self.temperature, self.last, self.logps = temperature, None, []

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.logps.append(self.last.gather(1, input_ids[:, -1:]))
        self.last = torch.log_softmax(scores.float() / self.temperature, -1)
        return scores

    def result(self, new_tokens):
        """[B, new tokens]: the generated tokens' log-probs (rows that stopped early hold their padding's)."""
        return torch.cat(self.logps + [self.last.gather(1, new_tokens[:, -1:])], 1)


class Agent(nn.Module):
    """A causal LM plus a scalar value head on the last prompt token (used by PPO only), and with --copy-term
    a learned weight w of the copy term."""

    def __init__(self, lm, copy_term=False):
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(lm.config.hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self.copy_weight = nn.Parameter(torch.tensor(1.0)) if copy_term else None

    def hidden(self, input_ids, attention_mask):
        """Final (normed) hidden states; logits are computed only where needed, to save memory."""
        return self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False).last_hidden_state

    def logits(self, hidden, copy=None):
        """The output layer on chosen positions' hidden states [B, R, H], plus with --copy-term w *
        copy_features (a pointer-style copy term, See et al. 2017: tokens of the prompt are easier to say)."""
        logits = self.lm.get_output_embeddings()(hidden)
        return logits if copy is None else logits + self.copy_weight * copy.unsqueeze(1)

    def copy_bias(self, prompts):
        """copy_features of these prompts, or None without --copy-term."""
        vocab = self.lm.get_output_embeddings().out_features
        return None if self.copy_weight is None else copy_features(prompts, vocab).to(self.copy_weight.device)


def check_logits_path(agent, name):
    """The update computes logits as the output layer on the final hidden state at response positions only
    (to save memory): refuse a model whose forward does more (e.g. Gemma-2's logit soft-capping)."""
    ids = torch.arange(min(8, agent.lm.config.vocab_size), device=agent.lm.device).unsqueeze(0)
    with torch.no_grad():
        own = agent.lm(input_ids=ids, use_cache=False).logits.float()
        ours = agent.logits(agent.hidden(ids, torch.ones_like(ids))).float()
    if not torch.allclose(own, ours, rtol=1e-4, atol=1e-4):
        raise ConfigError(f"--model {name}: its logits are not its output layer applied to the last hidden "
                          "state (e.g. Gemma-2's soft-capping), which is how rspo.py scores responses")


def trie_walk(node, ids):
    """The node of a Policy.trie the token ids lead to: a dict, the action string after its EOS, or None."""
    for t in ids:
        node = node.get(t) if isinstance(node, dict) else None
    return node


HEAD_CHUNK_ELEMENTS = 2 ** 25   # full-vocabulary values per chunk of Policy.head: 128 MiB per float32 copy


@dataclass(eq=False)
class Policy:
    """Tokenizer + Agent + decoding: renders a state as a prompt (prompt), samples actions (act) and scores
    responses (forward). B <- copy(A) is replace(A, agent=copy.deepcopy(A.agent))."""
    agent: nn.Module
    tok: object                         # the tokenizer
    device: torch.device
    env: str = "alfworld"               # whose verl-agent prompt the full prompt is
    compact: bool = True                # the compact prompt (a tiny model) or verl-agent's full one
    constrained: bool = True            # decode only admissible actions, or free text with <action> tags
    amp_dtype: torch.dtype | None = None   # bf16 autocast over float32 weights, or None (autocast_dtype)
    generation_batch_size: int = 128    # prompts per generate call (bounds the KV cache)
    max_new_tokens: int = 256           # the generation budget per step in generate mode

    def __post_init__(self):
        self.stop_ids = stop_token_ids(self.tok, self.agent.lm.generation_config)
        # plain ints: the tokenizer's are properties that look the token up at each read (the tries read them)
        self.eos_id, self.pad_id = self.tok.eos_token_id, self.tok.pad_token_id
        if self.pad_id in self.stop_ids:
            raise ValueError("the pad token is an end-of-turn id: give the tokenizer another (distinct_pad)")
        self._action_ids = {}

    def autocast(self):
        """bf16 autocast over the float32 weights when mixed precision is on, a no-op otherwise."""
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def prompt(self, task, history, obs, admissible, step):
        """The token ids of a state's prompt (build_prompt, then encode_prompt)."""
        return self.encode_prompt(build_prompt(task, history, obs, admissible, step, self.compact, self.env))

    def encode_prompt(self, text):
        if self.tok.chat_template:
            text = self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)
            return self.tok(text, add_special_tokens=False).input_ids
        bos = [] if self.tok.bos_token_id is None else [self.tok.bos_token_id]   # Qwen base models have none
        return bos + self.tok(text, add_special_tokens=False).input_ids

    def action_ids(self, action):
        if action not in self._action_ids:
            self._action_ids[action] = self.tok(action, add_special_tokens=False).input_ids
        return self._action_ids[action]

    def trie(self, admissible):
        """Prefix trie over the admissible actions' token ids, each ending in EOS: node -> {token: node};
        the EOS edge leads to the action string."""
        root = {}
        for a in admissible:
            node = root
            for t in self.action_ids(a):
                node = node.setdefault(t, {})
            node[self.eos_id] = a
        return root

    @torch.no_grad()
    def act(self, prompts, admissibles, temperature):
        """Sample one response per prompt: [(response_ids, action, invalid, logp)], logp the sampler's
        log-probs (None when greedy), in length-sorted generate calls of generation_batch_size prompts."""
        results = [None] * len(prompts)
        lengths = [len(p) for p in prompts]
        for idx in length_sorted_chunks(range(len(prompts)), lengths, self.generation_batch_size):
            chunk = self.generate([prompts[i] for i in idx], [admissibles[i] for i in idx], temperature)
            for i, r in zip(idx, chunk):
                results[i] = r
        return results

    def generate(self, prompts, admissibles, temperature):
        """One batched, left-padded generate call (see act)."""
        from transformers import GenerationConfig, LogitsProcessorList
        self.agent.eval()
        enc = self.tok.pad({"input_ids": prompts}, return_tensors="pt").to(self.device)
        greedy, width = temperature == 0, enc.input_ids.shape[1]
        tries = [self.trie(a) for a in admissibles] if self.constrained else None

        def allowed(b, ids):   # the trie's edges after the prefix; EOS once off it, padding once finished
            node = trie_walk(tries[b], ids[width:].tolist())
            return [self.eos_id] if node is None else list(node) if isinstance(node, dict) else [self.pad_id]

        max_new = (max(len(self.action_ids(a)) for adm in admissibles for a in adm) + 1
                   if self.constrained else self.max_new_tokens)
        # Sampler = learner: only the temperature shapes the sampled distribution (the one the update's
        # log-probs assume): every sampling field is neutral, the checkpoint's are set aside.
        neutral = dict(top_k=0, top_p=1.0, min_p=None, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
        sampling = {} if greedy else {"temperature": temperature, **neutral}
        gen = GenerationConfig(do_sample=not greedy, **sampling, repetition_penalty=1.0,
                               no_repeat_ngram_size=0, num_beams=1, max_new_tokens=max_new,
                               pad_token_id=self.pad_id, eos_token_id=self.stop_ids)
        bias = self.agent.copy_bias(prompts)
        copy_term = None if bias is None else CopyTerm(self.agent.copy_weight.detach() * bias)
        record = None if greedy else SampledLogProbs(temperature)   # last: reads what the sampler draws from
        processors = LogitsProcessorList([p for p in (copy_term, record) if p is not None])
        with self.autocast(), without_checkpoint_sampling(self.agent.lm):
            out = self.agent.lm.generate(**enc, generation_config=gen, logits_processor=processors,
                                         prefix_allowed_tokens_fn=allowed if self.constrained else None)
        logps = None if greedy else record.result(out[:, width:]).cpu()
        results = []
        for b, row in enumerate(out[:, width:].tolist()):
            resp = cut_response(row, self.stop_ids)
            action, valid = (trie_walk(tries[b], resp), True) if self.constrained else \
                parse_action(self.tok.decode(resp, skip_special_tokens=True))
            results.append((resp, action, not valid, None if greedy else logps[b, :len(resp)]))
        return results

    def batch(self, steps):
        """Right-padded prompt+response tensors, response positions, and the constraint mask. Built from
        padded Python lists, each tensor in one call (per-row tensor writes dominated small updates)."""
        seqs = [s.prompt_ids + s.response_ids for s in steps]
        L, R = max(map(len, seqs)), max(len(s.response_ids) for s in steps)
        ids = torch.tensor([seq + [self.pad_id] * (L - len(seq)) for seq in seqs])
        attn = torch.tensor([[1] * len(seq) + [0] * (L - len(seq)) for seq in seqs])
        # pos[i, j]: the position predicting response token j; padding points anywhere valid (masked)
        pos = torch.tensor([[len(s.prompt_ids) - 1 + (j if j < len(s.response_ids) else 0) for j in range(R)]
                            for s in steps])
        tgt = torch.tensor([s.response_ids + [0] * (R - len(s.response_ids)) for s in steps])
        mask = torch.tensor([[1.0] * len(s.response_ids) + [0.0] * (R - len(s.response_ids)) for s in steps])
        allowed = self.allowed_mask(steps, R).to(self.device) if self.constrained else None
        return (*(x.to(self.device) for x in (ids, attn, pos, tgt, mask)), allowed)

    def allowed_mask(self, steps, R):
        """[B, R, vocab] bool: the tokens the constraint allowed at each response position (anything at
        padding, so no row is all -inf, which would give NaN), set with one indexed write."""
        vocab = self.agent.lm.get_output_embeddings().out_features   # may exceed len(tok) (padded vocab)
        allowed = (torch.arange(R) >= torch.tensor([len(s.response_ids) for s in steps]).unsqueeze(1))
        allowed = allowed.unsqueeze(-1).repeat(1, 1, vocab)
        rows, cols, toks = [], [], []
        for i, s in enumerate(steps):   # the constraint replayed: the trie's edges along each response
            node = self.trie(s.admissible)
            for j, t in enumerate(s.response_ids):
                rows += [i] * len(node)
                cols += [j] * len(node)
                toks += list(node)
                node = node[t]
        allowed[rows, cols, toks] = True
        return allowed

    def forward(self, steps, temperature, with_entropy=False):
        """Per-token log-probs of the responses at the sampling temperature, under the same decoding
        constraint as sampling, plus entropies and V(s) at the last prompt token."""
        ids, attn, pos, tgt, mask, allowed = self.batch(steps)
        copy = self.agent.copy_bias([s.prompt_ids for s in steps])
        with self.autocast():
            h = self.agent.hidden(ids, attn)
            h_resp = torch.gather(h, 1, pos.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        del h
        parts, chunks = [], self.head_chunks(*tgt.shape)
        # With gradients and several chunks, each chunk's full-vocabulary tensors are recomputed in backward,
        # one chunk at a time, instead of all held until then (one chunk, a tiny model's, gains nothing).
        recompute = torch.is_grad_enabled() and len(chunks) > 1
        for rows in chunks:
            args = (h_resp[rows], tgt[rows], None if allowed is None else allowed[rows],
                    None if copy is None else copy[rows], temperature, with_entropy)
            parts.append(torch.utils.checkpoint.checkpoint(self.head, *args, use_reentrant=False) if recompute
                         else self.head(*args))
        logp = torch.cat([lp for lp, _ in parts]) * mask
        entropy = torch.cat([ent for _, ent in parts]) if with_entropy else None
        values = self.agent.value_head(h_resp[:, 0].float()).squeeze(-1)  # h at the last prompt token
        return logp, mask, entropy, values

    def head_chunks(self, batch, length):
        """Row slices of the batch whose [rows, length, vocab] float32 tensors hold at most
        HEAD_CHUNK_ELEMENTS (a real model's 49k-152k vocabulary makes these an update's largest tensors)."""
        vocab = self.agent.lm.get_output_embeddings().out_features
        size = max(1, HEAD_CHUNK_ELEMENTS // (length * vocab))
        return [slice(i, i + size) for i in range(0, batch, size)]

    def head(self, h_resp, tgt, allowed, copy, temperature, with_entropy):
        """Log-probs of the response tokens (and entropies) from their hidden states: the output layer (and
        copy term), the temperature, the decoding constraint and a softmax over the vocabulary."""
        with self.autocast():
            logits = self.agent.logits(h_resp, copy)
        logits = logits.float() / temperature
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        logprobs = torch.log_softmax(logits, -1)
        del logits
        logp = torch.gather(logprobs, -1, tgt.unsqueeze(-1)).squeeze(-1)
        if not with_entropy:
            return logp, None
        p = logprobs.exp()
        return logp, -(p * logprobs.masked_fill(p == 0, 0)).sum(-1)


# ---- Where the policy runs: the device, mixed precision, building and saving it ----------------------------

def pick_device(name):
    """--device: auto picks cuda -> mps -> cpu; a named device must exist here."""
    mps = bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name}: not a device (auto, cpu, cuda, cuda:1, mps)") from None
    cuda = torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    if not {"cpu": True, "cuda": cuda, "mps": mps}.get(device.type, False):
        raise ConfigError(f"--device {name}: no such device on this machine")
    return device


def autocast_dtype(name, device):
    """--dtype auto on CUDA with bf16: bf16 compute over float32 weights (as verl's FSDP); pure bf16 weights
    would round lr-1e-6 Adam steps away. None: no autocast."""
    mixed = name == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.bfloat16 if mixed else None


def enable_checkpointing(lm):
    """Recompute each layer's activations in the backward pass (non-reentrant, so inputs need no grad).
    transformers 5.23 renamed gradient_checkpointing_enable to activation_checkpointing_enable."""
    enable = getattr(lm, "activation_checkpointing_enable", None) or lm.gradient_checkpointing_enable
    enable({"use_reentrant": False})


def build_lm(name, cfg, seed, flag="--model"):
    """(causal LM, tokenizer): 'tiny' built offline from `seed`, or any HF id / local directory."""
    if name == "tiny":
        tok = build_tiny_tokenizer(tiny_vocabulary(cfg.env, cfg.backend, cfg.env_options))
        return build_tiny_model(len(tok), tok, seed), tok
    # --dtype: the weights' (and so the gradients' and Adam's) dtype; auto keeps float32 (autocast_dtype)
    return load_pretrained(name, torch.float32 if cfg.dtype == "auto" else getattr(torch, cfg.dtype), flag)


def build_policy(cfg, device, pretrained=None):
    """The policy A, with the value head and copy term saved in --model DIR if there are. pretrained: a loaded
    (model, tokenizer) to use instead of --model (tests load a real model once and train copies)."""
    lm, tok = pretrained if pretrained is not None else build_lm(cfg.model, cfg, cfg.seed)
    if cfg.gradient_checkpointing:
        enable_checkpointing(lm)
    torch.manual_seed(cfg.seed)
    agent = Agent(lm, cfg.copy_term)
    value_head = os.path.join(os.path.expanduser(cfg.model), "value_head.pt")
    if pretrained is None and os.path.isfile(value_head):
        agent.value_head.load_state_dict(torch.load(value_head, map_location="cpu"))
    if cfg.copy_term and pretrained is None:   # w as a saved model learned it (else its start, 1)
        agent.copy_weight.data.fill_(saved_settings(cfg.model).get("copy_weight", 1.0))
    agent.to(device)
    check_logits_path(agent, cfg.model)
    return Policy(agent, tok, device, cfg.env, cfg.prompt == "compact", cfg.action_mode == "constrained",
                  autocast_dtype(cfg.dtype, device), cfg.generation_batch_size, cfg.max_new_tokens)


def save_model(policy, cfg, path):
    """save_pretrained with the tokenizer, the value head and rspo.json (its prompt, action mode, lr and copy
    term's w, so --model PATH runs it the same way), written beside `path`, then renamed into place."""
    tmp, old = path + ".tmp", path + ".old"
    for p in (tmp, old):
        shutil.rmtree(p, ignore_errors=True)
    policy.agent.lm.save_pretrained(tmp)
    policy.tok.save_pretrained(tmp)
    torch.save(policy.agent.value_head.state_dict(), os.path.join(tmp, "value_head.pt"))
    copy_weight = {} if policy.agent.copy_weight is None else {"copy_weight": policy.agent.copy_weight.item()}
    with open(os.path.join(tmp, "rspo.json"), "w") as f:
        json.dump({"prompt": cfg.prompt, "action_mode": cfg.action_mode, "lr": cfg.lr, **copy_weight}, f)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


# ==============================================================================================
# THE MACHINERY: nothing below is the method. The bookkeeping around train, evaluation, the warm
# start, the learned dense reward, flags, checkpoints, main.
# ==============================================================================================
# ---- Bookkeeping: what each update logs, totals, timing, evaluation, checkpoints, the progress bar ---------

def rollout_stats(trajs, prefix):
    """Success (overall and per task type present), returns and length of a batch of rollouts, for logging."""
    mean = lambda values: float(np.mean(list(values)))
    return {f"{prefix}/success": mean(t.won for t in trajs), f"{prefix}/score": mean(t.score for t in trajs),
            f"{prefix}/dense_return": mean(sum(s.process_reward for s in t.steps) for t in trajs),
            f"{prefix}/episode_length": mean(len(t.steps) for t in trajs),
            **{f"{prefix}/success/{k}": mean(t.won for t in trajs if t.task_type == k)
               for k in sorted({t.task_type for t in trajs})}}


def batch_stats(cfg, state, own, replayed):
    """Logged with each update: A's rollouts, the replayed groups, the running counts of wins and states."""
    replay = list(groups_of(replayed).values())   # buffer groups carry ids of their own (ReplayBuffer.take)
    stats = {**rollout_stats(own, "train"), **state.last_explorer,
             "train/outcome_return": float(np.mean([cfg.reward_scale * t.won for t in own]))}
    if replay:
        stats.update({"buffer/success": float(np.mean([t.won for t in replayed])),
                      "buffer/groups_with_success": float(np.mean([any(t.won for t in g) for g in replay])),
                      # a group won by all or none of its episodes has zero group-relative advantage (GRPO)
                      "buffer/groups_mixed": float(np.mean([len({t.won for t in g}) == 2 for g in replay]))})
    state.seen_states.update(s.obs for t in own for s in t.steps)
    for prefix, trajs in (("train", own), ("buffer", replayed)):   # running wins per task type (0: never won)
        for t in trajs:
            key = f"{prefix}/wins/{t.task_type}"
            state.wins[key] = state.wins.get(key, 0) + int(t.won)
    return {**stats, "train/distinct_states": len(state.seen_states), **dict(sorted(state.wins.items()))}


class Run:
    """The bookkeeping train calls through its `run` argument: explorer_phase, and after_update after A's."""

    def __init__(self, cfg, policy, optimizer, dense_source, state, log):
        self.cfg, self.policy, self.optimizer, self.dense_source, self.state, self.log = \
            cfg, policy, optimizer, dense_source, state, log
        self.b_seconds, self.mark = 0.0, time.time()
        self.bar = tqdm(total=cfg.updates, initial=state.updates, disable=not cfg.progress,
                        desc=f"{cfg.method}+{cfg.algo}")

    @contextlib.contextmanager
    def explorer_phase(self):
        """Around B's phase: its seconds; with --explorer-offload A and its Adam state wait in host memory, so
        one copy is on the device at a time; B's memory goes back to the device afterwards."""
        start, agent, device = time.time(), self.policy.agent, self.policy.device
        release = torch.cuda.empty_cache if device.type == "cuda" else lambda: None   # freed memory back
        if self.cfg.explorer_offload:
            move_training_state(agent, self.optimizer, torch.device("cpu"))
        release()
        try:
            yield
        finally:
            if self.cfg.explorer_offload:
                move_training_state(agent, self.optimizer, device)
        release()
        self.b_seconds += time.time() - start

    def after_update(self, u, own, replayed, explored, stats):
        """After A's update u: A's batch and B's (explored: its k training batches, then its fresh one)
        counted, the record logged with an evaluation every --eval-every, a checkpoint every --save-every."""
        cfg, state, totals = self.cfg, self.state, self.state.totals
        if explored:
            state.explorer_states.update(s.obs for trajs in explored for t in trajs for s in t.steps)
            state.last_explorer = {**rollout_stats(explored[-2], "explorer"),
                                   "explorer/distinct_states": len(state.explorer_states)}
            totals["env_steps/B"] += sum(len(t.steps) for trajs in explored for t in trajs)
            totals["updates/B"] += cfg.k
        stats = {**batch_stats(cfg, state, own, replayed), **stats}
        totals.update({"env_steps/A": totals["env_steps/A"] + sum(len(t.steps) for t in own), "updates/A": u,
                       "time/A_seconds": totals["time/A_seconds"] + time.time() - self.mark - self.b_seconds,
                       "time/B_seconds": totals["time/B_seconds"] + self.b_seconds})
        record = {"update": u, **stats, **totals}
        if u == cfg.updates or (cfg.eval_every and u % cfg.eval_every == 0):
            record.update(evaluate(self.policy, cfg))
        if u == cfg.updates and cfg.final_eval_repeats:
            record.update(final_evaluation(self.policy, cfg))
        self.log(record)
        if cfg.save_every and (u % cfg.save_every == 0 or u == cfg.updates):
            save_checkpoint(cfg, self.policy, self.optimizer, self.dense_source, state, record)
        self.bar.update(1)
        self.bar.set_postfix(success=f"{stats['train/success']:.2f}", ev=record.get("eval/success", ""))
        self.b_seconds, self.mark = 0.0, time.time()


@contextlib.contextmanager
def own_rng(seed, device):
    """A private torch RNG stream (CPU, and the CUDA device in use): what it samples leaves training alone."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


EVAL_SEED_OFFSET, FINAL_SEED_OFFSET = 10_000, 20_000   # the evaluations' RNG streams: cfg.seed + these


def eval_panel(cfg, split):
    """The held-out panel of `split`: its first --eval-episodes tasks (all of them when it has fewer)."""
    tasks = envs.num_tasks(cfg.env, split, backend=cfg.backend, **cfg.env_options)
    return range(min(cfg.eval_episodes, tasks))


def evaluate(policy, cfg):
    """Success (overall, per task type) and score on each fixed held-out panel of --eval-split (eval/... for
    the first, eval_<split>/... for others), on an RNG stream of its own: evaluating never alters training."""
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


def final_evaluation(policy, cfg):
    """--final-eval-repeats N after the last update: each held-out task N times, on an RNG stream of its own;
    final/success pools the panels (the fair test's measure), final_<split>/success is each panel's."""
    out, won = {}, []
    with own_rng(cfg.seed + FINAL_SEED_OFFSET, policy.device):
        for split in cfg.eval_split.split(","):
            trajs = rollout(policy, cfg, eval_panel(cfg, split), split, cfg.eval_temperature,
                            group_size=cfg.final_eval_repeats)
            out[f"final_{split}/success"] = float(np.mean([t.won for t in trajs]))
            won += [t.won for t in trajs]
    return {"final/success": float(np.mean(won)), **out}


# ---- Warm start: imitating a demonstrator that sees what the agent sees (SPA-RL's SFT stage) ---------------

def imitation_loss(logp, mask):
    """Behaviour cloning (SFT): the token-mean negative log-likelihood of the demonstrator's responses,
    -sum_{i,t} m_it log pi(y_it | x_i, y_i,<t) / sum_{i,t} m_it."""
    return -(logp * mask).sum() / mask.sum()


def demonstrator(policy):
    """rollout's action source for the warm start: env.searching_action() (the scripted expert without its
    privilege), as the policy would say it (the action + EOS, or in <think>/<action> tags)."""
    def act(prompts, admissibles, environments):
        actions = [env.searching_action() for env in environments]
        texts = [a if policy.constrained else f"<think></think><action>{a}</action>" for a in actions]
        return [(policy.action_ids(x) + [policy.eos_id], a, False, None) for x, a in zip(texts, actions)]
    return act


def warm_start(policy, cfg):
    """--warm-start demonstrator episodes on train tasks 0..N-1, then --warm-start-epochs passes of Adam on
    imitation_loss; RNG streams of its own, so every method starts from the same policy. Stats and cost."""
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
        optimizer_step(policy.agent.parameters(), optimizer, cfg.max_grad_norm)
        nll.append(loss)
    per_epoch = -(-len(steps) // cfg.minibatch_size)
    stats = {"warmstart/episodes": len(trajs), "warmstart/nll": float(np.mean(nll[-per_epoch:])),
             "warmstart/demo_success": float(np.mean([t.won for t in trajs]))}
    return stats, len(steps), time.time() - start


# ---- Learned dense reward (progress estimator): SPA-RL's model, the paper's source of dense rewards --------

def prm_loss(step_scores, traj_ids, outcomes):
    """SPA-RL's progress-estimator objective (PAPER): mean over trajectories of (sum_t r_hat_t - R)^2, step i
    in trajectory traj_ids[i]; R is the outcome on the estimator's scale, won in {0, 1} (fit_estimator)."""
    sums = torch.zeros(len(outcomes), dtype=step_scores.dtype, device=step_scores.device)
    sums = sums.index_add(0, traj_ids.to(step_scores.device), step_scores)
    return ((sums - outcomes.to(sums)) ** 2).mean()


class ProgressEstimator(nn.Module):
    """r_hat(s_t, a_t) = tanh(MLP(h)) in (-1, 1), h the final hidden state at the step's last token (SPA-RL,
    arXiv 2505.20732); any causal LM backbone (the step's text re-encoded if its tokenizer is another)."""
    hidden = Agent.hidden   # the same backbone call as the policy's

    def __init__(self, lm, tok, policy_tok, freeze=False):
        super().__init__()
        self.lm, self.tok, self.policy_tok, self.frozen = lm, tok, policy_tok, freeze
        self.retokenize = tok.get_vocab() != policy_tok.get_vocab()
        width = lm.config.hidden_size
        self.head = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))  # fp32
        nn.init.zeros_(self.head[-1].weight)   # start at r_hat = 0 everywhere: sums start at 0, not at noise
        nn.init.zeros_(self.head[-1].bias)
        lm.requires_grad_(not freeze)

    def features(self, steps, chunk):
        """h at the last token of each step, in length-sorted passes of `chunk` steps, in the steps' order;
        differentiable unless under no_grad (or frozen)."""
        rows, device = [None] * len(steps), next(self.lm.parameters()).device
        for idx in length_sorted_chunks(range(len(steps)), sequence_lengths(steps), chunk):
            seqs = [steps[i].prompt_ids + steps[i].response_ids for i in idx]
            if self.retokenize:   # the backbone's own tokenizer on the step's text
                seqs = [self.tok(self.policy_tok.decode(x, skip_special_tokens=True)).input_ids for x in seqs]
            ids = _pad([torch.tensor(s) for s in seqs]).to(device)   # padding value 0 is masked out
            attn = _pad([torch.ones(len(s), dtype=torch.long) for s in seqs]).to(device)
            last = torch.tensor([len(s) - 1 for s in seqs])   # right-padded: the last real token
            for i, row in zip(idx, self.hidden(ids, attn)[torch.arange(len(seqs), device=device), last]):
                rows[i] = row.float()
        return torch.stack(rows)

    def forward(self, features):
        return torch.tanh(self.head(features)).squeeze(-1)

    @torch.no_grad()
    def scores(self, steps, chunk):
        """r_hat for every step (no gradients), on the CPU."""
        self.eval()
        return self(self.features(steps, chunk)).cpu() if steps else torch.zeros(0)


@dataclass
class DenseRewardSource:
    """Where dense rewards come from: the env's (no estimator) or a progress estimator; the noise's RNG."""
    noise_rng: np.random.Generator
    estimator: ProgressEstimator | None = None
    optimizer: torch.optim.Optimizer | None = None
    train_trajs: list = field(default_factory=list)     # trajectories the estimator is fitted on
    heldout_trajs: list = field(default_factory=list)   # trajectories kept out to report its fit
    sources: dict = field(default_factory=dict)         # data source -> {"episodes", "success"} (config.json)


def relabel_dense(trajs, source, sigma, cfg):
    """Every dense reward's one path, in place: Step.process_reward <- progress_t - progress_{t-1} (progress)
    or r_hat(s_t, a_t) (an estimator), else the env's; then + N(0, sigma^2) (PAPER's robustness test)."""
    steps = [s for t in trajs for s in t.steps]
    if cfg.dense_reward == "progress":
        for s in steps:
            s.process_reward = s.progress_gain
    if source.estimator is not None:
        for s, r in zip(steps, source.estimator.scores(steps, cfg.micro_batch_size).tolist()):
            s.process_reward = r
    if sigma > 0:
        for s, e in zip(steps, source.noise_rng.normal(0.0, sigma, len(steps))):
            s.process_reward += float(e)
    return trajs


def _corr(x, y):
    """Pearson correlation; NaN when either side is constant."""
    ok = len(x) > 1 and x.std() > 0 and y.std() > 0
    return float(torch.corrcoef(torch.stack([x, y]))[0, 1]) if ok else float("nan")


@torch.no_grad()
def estimator_diagnostics(estimator, trajs, cfg):
    """The estimator's fit on trajectories: the loss, mean |sum_t r_hat_t - R| and the correlation of r_hat
    with the env's progress increments (NaN where either is constant)."""
    steps = [s for t in trajs for s in t.steps]
    if not steps:
        return {}
    scores = estimator.scores(steps, cfg.micro_batch_size)
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


def fit_estimator(source, cfg, epochs, generator, desc="progress estimator"):
    """`epochs` passes of minibatch Adam on prm_loss over source.train_trajs, R = won in {0, 1} (step scores
    are in (-1, 1); relabelled rewards are scaled by --reward-scale), a frozen backbone's features computed
    once. Returns the logged prm/loss (last epoch, train) and prm/heldout_* (the fit)."""
    est, trajs, chunk = source.estimator, source.train_trajs, cfg.micro_batch_size
    steps = [s for t in trajs for s in t.steps]
    ends = np.cumsum([len(t.steps) for t in trajs]).tolist()
    rows = [range(end - len(t.steps), end) for t, end in zip(trajs, ends)]   # each trajectory's steps
    outcomes = torch.tensor([float(t.won) for t in trajs])
    with torch.no_grad():
        cached = est.features(steps, chunk) if est.frozen else None
    for _ in (bar := tqdm(range(epochs), disable=not cfg.progress, desc=desc, leave=False)):
        est.train()
        total, n, perm = 0.0, 0, torch.randperm(len(trajs), generator=generator).tolist()
        for b in range(0, len(trajs), cfg.prm_batch_size):
            chosen = perm[b:b + cfg.prm_batch_size]
            idx = [i for c in chosen for i in rows[c]]
            feats = cached[idx] if cached is not None else est.features([steps[i] for i in idx], chunk)
            local = torch.tensor([j for j, c in enumerate(chosen) for _ in rows[c]])
            loss = prm_loss(est(feats), local, outcomes[chosen])
            loss.backward()
            optimizer_step(est.parameters(), source.optimizer, cfg.max_grad_norm)
            total, n = total + float(loss.detach()) * len(chosen), n + len(chosen)
        bar.set_postfix(loss=f"{total / max(n, 1):.3f}")
    fit = estimator_diagnostics(est, source.heldout_trajs, cfg)
    return {"prm/loss": total / max(n, 1) if epochs else float("nan"), "prm/train_trajectories": len(trajs),
            **{f"prm/heldout_{k}": v for k, v in fit.items()}}


PRM_HELDOUT = 0.2   # the share of the estimator's episodes held out to report its fit


def add_estimator_data(source, origin, trajs, rng):
    """Add trajectories to the estimator's data, a seeded random PRM_HELDOUT share of them to the held-out
    set; count them by origin (config.json's prm_data)."""
    order = rng.permutation(len(trajs)).tolist()
    cut = int(round(PRM_HELDOUT * len(trajs)))
    source.train_trajs += [trajs[i] for i in order[cut:]]
    source.heldout_trajs += [trajs[i] for i in order[:cut]]
    source.sources[origin] = {"episodes": len(trajs), "success": float(np.mean([t.won for t in trajs]))}


# What the estimator's fit depends on: a --prm-path file is reused only when all of these match.
ESTIMATOR_SETTINGS = ("env", "env_options", "backend", "seed", "model", "action_mode", "history", "max_steps",
                      "temperature", "group_size", "micro_batch_size", "max_grad_norm", "dtype", "warm_start",
                      "warm_start_epochs", "warm_start_lr", "prm_model", "prm_freeze", "prm_warmup_episodes",
                      "prm_epochs", "prm_lr", "prm_batch_size")


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


def build_dense_source(policy, cfg):
    """--dense-reward env / progress: the env's values (plus noise). learned: a progress estimator on a
    backbone of its own (--prm-model) with its Adam, not fitted yet (fit_or_load_estimator)."""
    source = DenseRewardSource(np.random.default_rng(cfg.seed + 20_000))
    if cfg.dense_reward == "learned":
        name = cfg.model if cfg.prm_model == "policy" else cfg.prm_model
        lm, tok = build_lm(name, cfg, cfg.seed + 1, flag="--prm-model")
        source.estimator = ProgressEstimator(lm, tok, policy.tok, cfg.prm_freeze).to(policy.device)
        trainable = [p for p in source.estimator.parameters() if p.requires_grad]
        source.optimizer = torch.optim.Adam(trainable, lr=cfg.prm_lr)
    return source


def fit_or_load_estimator(source, policy, cfg):
    """As SPA-RL: the estimator starts as the starting policy (--prm-model policy) and is fitted on its
    rollouts (--prm-warmup-episodes); or the fit is loaded from --prm-path. RNG streams of its own, so
    fitting and loading leave training identical. Returns (stats, the fit's env steps, its seconds)."""
    if source.estimator is None:
        return {}, 0, 0.0
    saved = load_saved_estimator(cfg)
    if saved is not None:
        source.estimator.load_state_dict(saved["state"])
        source.sources = saved["sources"]
        return saved["stats"], saved["env_steps"], saved["seconds"]
    start = time.time()
    if cfg.prm_model == "policy":
        source.estimator.lm.load_state_dict(policy.agent.lm.state_dict())
    data_rng = np.random.default_rng(cfg.seed + 30_000)
    with own_rng(cfg.seed + 30_000, policy.device):
        seeds = data_rng.integers(0, cfg.train_tasks, -(-cfg.prm_warmup_episodes // cfg.group_size))
        trajs = rollout(policy, cfg, seeds, temperature=cfg.temperature)[:cfg.prm_warmup_episodes]
        add_estimator_data(source, "warmup", trajs, data_rng)
        stats = fit_estimator(source, cfg, cfg.prm_epochs, torch.Generator().manual_seed(cfg.seed + 30_000))
    steps, seconds = sum(len(t.steps) for t in trajs), time.time() - start
    if cfg.prm_path:   # written whole, then renamed: a run starting meanwhile never reads half a file
        saved = {"settings": {k: getattr(cfg, k) for k in ESTIMATOR_SETTINGS}, "sources": source.sources,
                 "state": source.estimator.state_dict(), "stats": stats, "env_steps": steps,
                 "seconds": seconds}
        save_atomically(cfg.prm_path, lambda p: torch.save(saved, p))
    return stats, steps, seconds


# ---- Config: the flags; validate checks them, fill_defaults completes them (configure does both) -----------

class Parser(argparse.ArgumentParser):
    def error(self, message):   # one line and exit code 2: no usage dump, no traceback
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser():
    """Every flag with its default (docs/flags.md explains them). allow_abbrev=False: a prefix is no flag (an
    old `--reward rspo` is refused, not read as --reward-scale)."""
    p = Parser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
               allow_abbrev=False)
    on_off = argparse.BooleanOptionalAction
    # what to run
    p.add_argument("--env", default="alfworld", choices=["alfworld", "webshop"], help="text environment")
    p.add_argument("--env-options", default="{}", help="JSON dict for envs.make_env")
    p.add_argument("--backend", default="offline", choices=["offline", "real"], help="shim or real benchmark")
    p.add_argument("--algo", default="grpo", choices=["grpo", "ppo", "gigpo"], help="verl's adv_estimator")
    p.add_argument("--method", default="rspo", choices=["rspo", "outcome", "dense"], help="or A alone")
    # RSPO
    p.add_argument("--k", type=int, default=3, help="updates of B, then of A, per RSPO cycle")
    p.add_argument("--alpha", type=float, default=0.125, help="buffer groups' share of A's batch, m/(n+m)")
    p.add_argument("--buffer-sampling", default="reward", choices=["reward", "variance", "random"])
    p.add_argument("--buffer-source", default="explorer", choices=["explorer", "self"], help="self: RSPO_H")
    p.add_argument("--explorer-reward", default="dense", choices=["dense", "outcome"], help="outcome: RSPO_O")
    p.add_argument("--explorer-lr", type=float, help="Adam lr of B (default: --lr)")
    # batch and budget
    p.add_argument("--updates", type=int, default=20, help="budget: A's updates (the main runs: 100)")
    p.add_argument("--num-groups", type=int, default=8, help="groups (tasks) per batch (paper: 16)")
    p.add_argument("--group-size", type=int, default=8, help="episodes per group (TRL's num_generations)")
    p.add_argument("--max-steps", type=int, default=30, help="steps per episode (or the env's limit)")
    p.add_argument("--history", type=int, default=2, help="past (observation, action) pairs in the prompt")
    # model, decoding, resources
    p.add_argument("--model", default="tiny", help="'tiny' (built offline), a Hugging Face id or a directory")
    p.add_argument("--copy-term", action=on_off, help="a learned copy term (default: as --model DIR learned)")
    p.add_argument("--action-mode", default="auto", choices=["auto", "constrained", "generate"])
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per step in generate mode")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of training rollouts")
    p.add_argument("--eval-temperature", type=float, default=0.4, help="sampling temperature of evaluation")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto (cuda, mps, cpu), cpu, cuda, mps, cuda:1 ...")
    p.add_argument("--gradient-checkpointing", action=on_off, default=False, help="trade compute for memory")
    p.add_argument("--explorer-offload", action=on_off, default=False, help="A waits in CPU RAM during B")
    p.add_argument("--generation-batch-size", type=int, default=128, help="prompts per generate call (TRL's)")
    # optimisation
    p.add_argument("--lr", type=float, help="Adam lr (default 1e-4 for tiny, else 1e-6)")
    p.add_argument("--warm-start", type=int, help="demonstrator episodes to imitate (tiny: 1000)")
    p.add_argument("--warm-start-epochs", type=int, default=3, help="passes over the demonstrations")
    p.add_argument("--warm-start-lr", type=float, default=1e-3, help="Adam lr of the imitation")
    p.add_argument("--epochs", type=int, default=1, help="passes over each batch (TRL's num_iterations)")
    p.add_argument("--minibatch-size", type=int, default=128, help="step samples per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=16, help="samples per forward pass")
    p.add_argument("--clip-eps", type=float, default=0.2, help="PPO clip range epsilon")
    p.add_argument("--clip-ratio-c", type=float, default=3.0, help="dual clip for A < 0 (verl's)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (k3, verl's low_var_kl)")
    p.add_argument("--ent-coef", type=float, default=0.0, help="entropy bonus coefficient")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient-norm clip")
    p.add_argument("--norm-adv", action=on_off, default=True, help="divide by the group std (scale_rewards)")
    p.add_argument("--gamma", type=float, default=0.95, help="discount (GiGPO step returns, PPO GAE)")
    p.add_argument("--lam", type=float, default=0.95, help="PPO GAE lambda")
    p.add_argument("--omega", type=float, default=1.0, help="GiGPO weight of the step-level advantage")
    p.add_argument("--vf-coef", type=float, default=0.5, help="PPO value-loss coefficient")
    p.add_argument("--vf-clip", type=float, default=0.5, help="PPO value clip (verl's cliprange_value)")
    p.add_argument("--reward-scale", type=float, default=10.0, help="success reward, dense-reward scale")
    p.add_argument("--invalid-penalty", type=float, default=0.1, help="for an unparseable response")
    # dense rewards: the env's, or a learned progress estimator (SPA-RL); docs/dense-rewards.md
    p.add_argument("--dense-reward", default="env", choices=["env", "progress", "learned"])
    p.add_argument("--dense-noise", type=float, default=0.0, help="std of noise on each dense reward")
    p.add_argument("--prm-model", default="policy", help="estimator backbone: policy, tiny, an id")
    p.add_argument("--prm-freeze", action=on_off, default=False, help="train only the estimator's head")
    p.add_argument("--prm-warmup-episodes", type=int, default=256, help="estimator data: starting policy's")
    p.add_argument("--prm-epochs", type=int, help="passes over it (ALFWorld 10, WebShop 5)")
    p.add_argument("--prm-lr", type=float, help="estimator Adam lr (tiny: 1e-3, else 1e-5)")
    p.add_argument("--prm-batch-size", type=int, default=16, help="trajectories per estimator step")
    p.add_argument("--prm-path", help="a fitted estimator: loaded if there (same settings), else saved there")
    # evaluation, logging, the run directory
    p.add_argument("--eval-every", type=int, default=5, help="evaluate every N updates (0: start and end)")
    p.add_argument("--eval-episodes", type=int, default=256, help="held-out tasks per evaluation")
    p.add_argument("--eval-split", help="held-out split(s), comma-separated (default: valid_seen / test)")
    p.add_argument("--final-eval-repeats", type=int, default=0, help="plays of each held-out task at the end")
    p.add_argument("--seed", type=int, default=0, help="seeds python, numpy, torch and every environment")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--output-dir", help="for config.json, metrics.jsonl, model/ (default runs/<name>)")
    p.add_argument("--overwrite", action="store_true", help="replace the run in --output-dir")
    p.add_argument("--resume", action="store_true", help="continue the run in --output-dir")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N updates (0: never)")
    p.add_argument("--save-model", action=on_off, default=True, help="save_pretrained at the end")
    p.add_argument("--progress", action=on_off, help="tqdm bar (default: if a terminal)")
    return p


def validate(cfg):
    """Check the flags as given; bad input is a ConfigError (one line, exit 2). Returns cfg, unchanged."""
    bounds = [("must be >= 1", lambda v: v >= 1, "group_size num_groups updates k epochs minibatch_size "
               "micro_batch_size generation_batch_size max_new_tokens max_steps eval_episodes "
               "warm_start_epochs prm_batch_size"),
              ("must be >= 0", lambda v: v >= 0, "threads warm_start eval_every final_eval_repeats "
               "save_every history beta ent_coef vf_coef invalid_penalty dense_noise prm_warmup_episodes "
               "prm_epochs"),
              ("must be > 0", lambda v: v > 0, "lr explorer_lr warm_start_lr prm_lr clip_eps vf_clip "
               "max_grad_norm reward_scale")]
    for msg, ok, names in bounds:   # None: a default that fill_defaults fills in
        for name in names.split():
            if getattr(cfg, name) is not None and not ok(getattr(cfg, name)):
                raise ConfigError(f"--{name.replace('_', '-')} {msg}")
    checks = [
        (0.0 <= cfg.alpha < 1.0, "--alpha must be in [0, 1)"),
        (cfg.method != "rspo" or replay_groups(cfg.alpha, cfg.num_groups, 1) < cfg.num_groups,
         "--alpha leaves no on-policy group"),
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
    return cfg


def fill_defaults(cfg):
    """Fill in every derived setting, the one place cfg is changed: defaults (some as a saved --model DIR
    learned them), and from one env built up front (a bad option: a one-line error) the episode cap and the
    number of train tasks. Returns cfg."""
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
    if cfg.lr is None:   # 1e-4: larger Adam steps undo a warm start (results/README.md, superseded regimes)
        cfg.lr = saved.get("lr", 1e-4 if cfg.prompt == "compact" else 1e-6)
    cfg.explorer_lr = cfg.explorer_lr or cfg.lr
    if cfg.warm_start is None:   # a model of its own (pretrained or saved by a run) has already learned
        cfg.warm_start = 1000 if cfg.model == "tiny" and cfg.backend == "offline" else 0
    model = "" if cfg.model == "tiny" else "_" + os.path.basename(os.path.normpath(cfg.model))
    cfg.output_dir = cfg.output_dir or os.path.join("runs", f"{cfg.env}_{cfg.method}_{cfg.algo}_s{cfg.seed}"
                                                            + model)
    if cfg.prm_lr is None:
        cfg.prm_lr = 1e-3 if (cfg.model if cfg.prm_model == "policy" else cfg.prm_model) == "tiny" else 1e-5
    cfg.eval_split = cfg.eval_split or {"alfworld": "valid_seen", "webshop": "test"}[cfg.env]
    if cfg.prm_epochs is None:   # WebShop's 205 trajectories overfit by 10 passes
        cfg.prm_epochs = {"alfworld": 10, "webshop": 5}[cfg.env]
    cfg.progress = sys.stderr.isatty() if cfg.progress is None else cfg.progress
    try:
        env = envs.make_env(cfg.env, split="train", seed=0, backend=cfg.backend, **cfg.env_options)
        _, info = env.reset()
        cfg.env_options["max_steps"] = min(cfg.max_steps, env.max_steps)
        cfg.train_tasks = envs.num_tasks(cfg.env, "train", backend=cfg.backend, **cfg.env_options)
        for split in cfg.eval_split.split(","):
            envs.num_tasks(cfg.env, split, backend=cfg.backend, **cfg.env_options)
    except (ValueError, RuntimeError, ImportError, TypeError, OSError) as e:
        raise ConfigError(f"--env {cfg.env}: {e}") from None
    if cfg.action_mode == "constrained" and not info.get("admissible_actions"):
        raise ConfigError(f"--action-mode constrained needs admissible actions, and {cfg.env} exposes none")
    return cfg


def configure(argv=None):
    """A run's settings from its command line: parsed, checked (validate) and completed (fill_defaults)."""
    return fill_defaults(validate(build_parser().parse_args(argv)))


# ---- Checkpoints: a run can be stopped at any point and resumed with --resume ------------------------------

CHECKPOINT = os.path.join("checkpoint", "state.pt")
RUN_CONTROL = ("overwrite", "resume", "save_every", "progress", "output_dir")   # never change results


def run_settings(cfg):
    """The settings that determine a run's results: a resumed run must have the same."""
    return {k: v for k, v in vars(cfg).items() if k not in RUN_CONTROL}


def save_checkpoint(cfg, policy, optimizer, source, state, record):
    """Everything a resumed run needs (weights, Adams, the dense-reward source, every RNG stream, the
    TrainState), written and renamed over the previous one: a kill while saving keeps the last one whole."""
    path = os.path.join(cfg.output_dir, CHECKPOINT)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    saved = {"settings": run_settings(cfg), "record": record, "agent": policy.agent.state_dict(),
             "optimizer": optimizer.state_dict(), "state": replace(state, generator=None),
             "generator": state.generator.get_state(), "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
             "source": replace(source, estimator=None, optimizer=None),
             **({} if source.estimator is None else {"estimator": source.estimator.state_dict(),
                                                     "estimator_optimizer": source.optimizer.state_dict()})}
    save_atomically(path, lambda p: torch.save(saved, p))


def load_checkpoint(cfg):
    """--resume: the checkpoint in --output-dir, or None when the directory holds no run yet. Without --resume
    or --overwrite a directory holding a run is refused, so a new run never replaces an earlier one."""
    out = cfg.output_dir
    holds_run = any(pathlib.Path(out, f).exists() for f in ("config.json", "metrics.jsonl"))
    if cfg.resume and not holds_run:
        raise ConfigError(f"--resume: {out} holds no run to resume (start one with --save-every N)")
    if cfg.overwrite or not holds_run:
        return None
    if not cfg.resume:
        raise ConfigError(f"--output-dir {out} already holds a run: --overwrite replaces it, "
                          "--resume continues it")
    path = os.path.join(out, CHECKPOINT)
    if not os.path.isfile(path):
        raise ConfigError(f"--resume: {out} holds a run but no checkpoint (--save-every); "
                          "--overwrite starts it again")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    saved, now = checkpoint["settings"], run_settings(cfg)
    diff = [f"{k}={saved.get(k)!r} there, {now.get(k)!r} here" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)]
    if diff:
        raise ConfigError(f"--resume: the run in {out} has other settings: {'; '.join(diff)}")
    return checkpoint


def restore_checkpoint(checkpoint, policy, optimizer, source):
    """Load a checkpoint into the freshly built run (the torch RNG last); returns the TrainState."""
    policy.agent.load_state_dict(checkpoint["agent"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    for k in ("noise_rng", "train_trajs", "heldout_trajs", "sources"):
        setattr(source, k, getattr(checkpoint["source"], k))
    if source.estimator is not None:
        source.estimator.load_state_dict(checkpoint["estimator"])
        source.optimizer.load_state_dict(checkpoint["estimator_optimizer"])
    state = replace(checkpoint["state"], generator=torch.Generator())
    state.generator.set_state(checkpoint["generator"])
    torch.set_rng_state(checkpoint["torch_rng"])
    if checkpoint["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(checkpoint["cuda_rng"])
    return state


# ---- Running: starting or resuming a run, the output directory, main ---------------------------------------

def start_run(cfg, policy, source, log):
    """A new run, up to A's first update: the warm start, the KL reference (the starting policy, frozen), the
    estimator's fit and the evaluation of line 0. Returns (TrainState, reference or None)."""
    warm = warm_start(policy, cfg) if cfg.warm_start else None
    ref = replace(policy, agent=copy.deepcopy(policy.agent).requires_grad_(False)) if cfg.beta > 0 else None
    state = TrainState(np.random.default_rng(cfg.seed), torch.Generator().manual_seed(cfg.seed))
    state.totals = {"env_steps/A": 0, "env_steps/B": 0, "updates/A": 0, "updates/B": 0, "time/A_seconds": 0.0,
                    "time/B_seconds": 0.0}
    if warm is not None:
        state.totals.update({"env_steps/warmstart": warm[1], "time/warmstart_seconds": warm[2]})
    prm_stats, prm_steps, prm_seconds = fit_or_load_estimator(source, policy, cfg)
    if source.estimator is not None:
        state.totals.update({"env_steps/prm": prm_steps, "time/prm_seconds": prm_seconds})
    log({"update": 0, **evaluate(policy, cfg), **(warm[0] if warm else {}), **prm_stats, **state.totals})
    return state, ref


def resume_run(cfg, policy, source, optimizer, checkpoint):
    """A run continued from its checkpoint; the KL reference is the starting policy, so with --beta > 0 the
    (deterministic) warm start is redone first. Returns (TrainState, reference or None)."""
    if cfg.beta > 0 and cfg.warm_start:
        warm_start(policy, cfg)
    ref = replace(policy, agent=copy.deepcopy(policy.agent).requires_grad_(False)) if cfg.beta > 0 else None
    return restore_checkpoint(checkpoint, policy, optimizer, source), ref


def move_training_state(agent, optimizer, device):
    """Move an agent's weights and its Adam moments to `device`. Parameters keep their identity
    (Module.to copies in place), so the optimizer still points at them; Adam's `step` stays on the CPU."""
    agent.to(device)
    for state in optimizer.state.values():
        for k, v in state.items():
            if torch.is_tensor(v) and k != "step":
                state[k] = v.to(device)


def save_atomically(path, save):
    """save(path + '.tmp'), then rename it onto path: a kill mid-write leaves the earlier file whole."""
    save(path + ".tmp")
    os.replace(path + ".tmp", path)


def check_writable(path, flag, directory=True):
    """Make the directory (a file's, if not directory) and write a probe in it: found by trying, as for root
    os.access calls anything writable, /proc included."""
    if directory and os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: is a file")
    parent = where = os.path.abspath(path if directory else os.path.dirname(os.path.abspath(path)))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path}: not writable ({parent} is a file)")
    try:
        os.makedirs(where, exist_ok=True)
        probe = os.path.join(where, f".rspo-probe-{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: not writable ({e.strerror}: {e.filename})") from None


def open_run_dir(cfg, checkpoint):
    """Prepare --output-dir: --overwrite removes the earlier run's files; --resume keeps its metrics up to the
    checkpoint (a torn last line, from a kill mid-write, is dropped). Returns the kept records."""
    out, records = cfg.output_dir, []
    for name in ("config.json", "metrics.jsonl", "checkpoint", "model") if cfg.overwrite else ():
        p = pathlib.Path(out, name)
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    if checkpoint is not None:
        for line in pathlib.Path(out, "metrics.jsonl").read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
        records = [r for r in records if r["update"] <= checkpoint["record"]["update"]]
        text = "".join(json.dumps(r) + "\n" for r in records)
        save_atomically(os.path.join(out, "metrics.jsonl"), lambda p: pathlib.Path(p).write_text(text))
    return records


def main(argv=None, pretrained=None):
    """The command line. pretrained: a loaded (model, tokenizer) instead of --model (see build_policy)."""
    parser = build_parser()
    cfg = parser.parse_args(argv)
    try:   # every check before any work, and before the output directory is touched
        fill_defaults(validate(cfg))   # cfg is not changed after this
        if cfg.prm_path:
            load_saved_estimator(cfg)   # a mismatched --prm-path fails here
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device = pick_device(cfg.device)
        policy = build_policy(cfg, device, pretrained)
        source = build_dense_source(policy, cfg)
        checkpoint = load_checkpoint(cfg)   # after the model: a bad --model is reported as such
        if cfg.prm_path:
            check_writable(cfg.prm_path, "--prm-path", directory=False)
        check_writable(cfg.output_dir, "--output-dir")
    except ConfigError as e:
        parser.error(str(e))
    out, records, start = cfg.output_dir, open_run_dir(cfg, checkpoint), time.time()

    def write_config():   # again at the end, with what the progress estimator was fitted on (prm_data)
        prm_data = {"prm_data": source.sources} if source.estimator is not None else {}
        text = json.dumps({**vars(cfg), **prm_data, "device": str(device),
                           "command": sys.argv if argv is None else argv}, indent=1)
        save_atomically(os.path.join(out, "config.json"), lambda p: pathlib.Path(p).write_text(text))
    write_config()
    print(f"{out}: config.json, metrics.jsonl", flush=True)
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        def log(record):
            records.append(record)
            f.write(json.dumps(record) + "\n")
            f.flush()
            if not cfg.progress:   # no bar (not a terminal): one line per update instead
                shown = "".join(f", {k} {record[k]:.3f}" for k in ("train/success", "eval/success")
                                if k in record)
                print(f"update {record['update']}/{cfg.updates}{shown}", flush=True)
        optimizer = torch.optim.Adam(policy.agent.parameters(), lr=cfg.lr)
        if checkpoint is None:
            state, ref = start_run(cfg, policy, source, log)
        else:
            state, ref = resume_run(cfg, policy, source, optimizer, checkpoint)
        run = Run(cfg, policy, optimizer, source, state, log)
        relabel = lambda trajs: relabel_dense(trajs, source, cfg.dense_noise, cfg)   # the dense-reward source
        train(cfg, policy, optimizer, state, ref, relabel, run)
        run.bar.close()
    write_config()
    resumed = f" (resumed at update {checkpoint['record']['update']})" if checkpoint else ""
    print(f"{out}: {cfg.updates} updates of A, {time.time() - start:.0f}s in this process{resumed}, "
          f"env steps A={records[-1]['env_steps/A']} B={records[-1]['env_steps/B']}")
    rows = [f"{k:<40} {records[0].get(k, float('nan')):>8.3f} {records[-1][k]:>8.3f}" for k in records[-1]
            if k.startswith("eval/")]
    print("\n".join([f"{'metric':<40} {'start':>8} {'end':>8}", *rows]))
    if cfg.save_model:
        save_model(policy, cfg, os.path.join(out, "model"))
    return records


if __name__ == "__main__":
    main()
