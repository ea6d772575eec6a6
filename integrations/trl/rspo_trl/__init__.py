"""RSPO (Reward-Swap Policy Optimization, arXiv 2607.04713) for TRL's GRPOTrainer (TRL 1.16).

    rollout = ReplayRollout(sample=my_sampler, alpha=1 / 8)    # my_sampler: A's own rollouts, TRL's contract
    trainer = RSPOGRPOTrainer(model, reward_funcs=swapped_reward(my_reward), args=GRPOConfig(...),
                              train_dataset=prompts, rollout_func=rollout)
    rollout.refill(buffer_rows(...B's fresh batch...), "reward", generator)   # every RSPO cycle
    trainer.train()

TRL's supported hooks only: RSPOGRPOTrainer overrides _compute_loss alone (the shifted clip), and the buffer's
groups enter through rollout_func, which returns B's completions with B's log-probs as the rows' sampler
log-probs. TRL removed its own GRPO replay buffer because subclasses overriding
_generate_and_score_completions broke with every release; nothing here touches it. The formulas are rspo.py's,
imported, not copied.

Which log-probs: TRL computes pi_old (old_per_token_logps, or the policy's detached log-probs when the batch
is used once) and keeps the sampler's log-probs as sampling_per_token_logps. RSPO's pi_behaviour is the
sampler's: B's on replayed rows, A's own sampler's on A's rows, so c = pi_old / pi_behaviour is pi_old / pi_B
on replayed rows and 1 on A's own rows (up to the sampler's numerics: with vLLM, c then corrects that mismatch
the way TRL's vllm_importance_sampling_correction would, which must be off so the correction is not applied
twice).
"""
from dataclasses import dataclass, field

import torch

import rspo
from trl import GRPOTrainer

OUTCOME = "rspo_outcome"                       # the rollout's extra column: a replayed row's swapped reward
LOSS_TYPES = ("dapo", "bnpo", "grpo")          # TRL's aggregations this loss reproduces (test_rspo_trl.py)


@dataclass
class BufferRow:
    """One completion of B's fresh batch, reward-swapped: what rollout_func hands TRL for a replayed row."""
    group: int
    prompt_ids: list
    completion_ids: list
    logprobs: list            # B's sampler's log-prob of each completion token
    rewards: torch.Tensor     # tensor([outcome]): the swapped reward (rspo.ReplayBuffer ranks by its sum)


def buffer_rows(prompt_ids, completion_ids, logprobs, outcomes, num_generations):
    """B's fresh batch (PAPER step 3) as BufferRows: TRL's layout, num_generations consecutive rows a group,
    each row's reward the task's outcome (the reward swap), B's log-probs kept."""
    return [BufferRow(i // num_generations, p, c, lp, torch.tensor([float(o)]))
            for i, (p, c, lp, o) in enumerate(zip(prompt_ids, completion_ids, logprobs, outcomes))]


@dataclass
class ReplayRollout:
    """TRL rollout_func for RSPO's mixed batch (PAPER step 4): of the generation batch's groups, A plays all
    but m = rspo.replay_groups(alpha, groups, u) with `sample` (A's own rollouts: TRL's rollout_func
    contract), and the next m buffer groups (rspo.ReplayBuffer order) fill the rest, with B's log-probs and
    their outcome."""
    sample: callable
    alpha: float
    buffer: rspo.ReplayBuffer = field(default_factory=rspo.ReplayBuffer)
    update: int = 0           # A's updates this cycle; one rollout_func call per update (num_iterations = 1)

    def refill(self, rows, mode="reward", generator=None):
        """A new cycle: B's swapped rows (buffer_rows), groups ordered by rspo.buffer_order."""
        self.buffer.refill(rows, mode, generator)
        self.update = 0

    def __call__(self, prompts, trainer):
        g = trainer.num_generations
        groups = len(prompts) // g
        self.update += 1
        m = rspo.replay_groups(self.alpha, groups, self.update) if self.buffer.groups else 0
        own = self.sample(prompts[:(groups - m) * g], trainer)
        replayed = [row for group in self.buffer.take(m, first_id=groups - m) for row in group]
        if len(replayed) != m * g:
            raise ValueError(f"buffer groups must have num_generations={g} rows each")
        out = {k: list(own[k]) + [getattr(r, k) for r in replayed]
               for k in ("prompt_ids", "completion_ids", "logprobs")}
        out[OUTCOME] = [None] * len(own["completion_ids"]) + [float(r.rewards.sum()) for r in replayed]
        return out


def swapped_reward(reward_func):
    """The reward swap on TRL's side: a replayed row's reward is its stored outcome (the rollout's
    rspo_outcome column), A's own rows get reward_func's. Wrap each of GRPOTrainer's reward_funcs with
    it."""
    def reward(prompts, completions, **kwargs):
        outcome = kwargs.get(OUTCOME) or [None] * len(prompts)
        own = reward_func(prompts=prompts, completions=completions, **kwargs)
        return [r if o is None else o for r, o in zip(own, outcome)]
    reward.__name__ = getattr(reward_func, "__name__", "reward")
    return reward


def check_supported(trainer):
    """Refuse the GRPOConfig options this loss does not reproduce, naming them, rather than ignore them."""
    args = trainer.args
    refused = {
        f"loss_type={trainer.loss_type!r} (supported: {', '.join(LOSS_TYPES)})":
            trainer.loss_type not in LOSS_TYPES,
        "epsilon_high != epsilon (the shifted clip is symmetric)":
            trainer.epsilon_high != trainer.epsilon_low,
        "importance_sampling_level='sequence'": trainer.importance_sampling_level != "token",
        "top_entropy_quantile < 1": trainer.top_entropy_quantile < 1.0,
        "off_policy_mask_threshold": trainer.off_policy_mask_threshold is not None,
        "delta (two-sided clip)": args.delta is not None,
        "entropy_coef / adaptive entropy": trainer._entropy_bonus_enabled,
        "router aux loss": trainer.aux_loss_enabled,
        "vllm_importance_sampling_correction (c already corrects for the sampler)":
            trainer.use_vllm and trainer.vllm_importance_sampling_correction,
        "use_bias_correction_kl with beta != 0": trainer.beta != 0.0 and args.use_bias_correction_kl,
    }
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise ValueError(f"RSPOGRPOTrainer does not support: {'; '.join(bad)}")


def behaviour_logps(inputs, old):
    """log pi_behaviour per token: the sampler's (sampling_per_token_logps: B's on replayed rows, A's
    sampler's on A's rows); pi_old where the sampler gave none, or a token it could not score (NaN, TRL's
    convention): c = 1."""
    sampled = inputs.get("sampling_per_token_logps")
    if sampled is None:
        return old
    return torch.where(torch.isnan(sampled), old, sampled)


def aggregate(per_token, mask, trainer, inputs):
    """TRL's aggregation of a per-token loss for its loss_type, as GRPOTrainer._compute_loss scales it for
    gradient accumulation: dapo = token-sum / the generation batch's tokens (its token-mean, verl's
    token-mean); bnpo = token-mean per micro-batch; grpo = mean over sequences of their token-mean."""
    train = trainer.model.training
    steps = trainer.current_gradient_accumulation_steps if train else 1.0
    if trainer.loss_type == "dapo":
        tokens = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        tokens = tokens * steps / trainer.args.steps_per_generation if train else tokens
        return (per_token * mask).sum() / tokens
    if trainer.loss_type == "bnpo":
        return rspo.masked_mean(per_token, mask) / steps
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / steps


class RSPOGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose loss is RSPO's shifted clip (PAPER: off-policy clip centred on c = pi_old / pi_B,
    with verl's dual clip), for replayed and own rows alike. Overrides _compute_loss only; the replayed
    rows come from ReplayRollout through rollout_func, their rewards through swapped_reward."""
    clip_ratio_c = 3.0        # the dual clip's bound on pi / pi_old for A < 0 (verl's and rspo.py's default)

    def _compute_loss(self, model, inputs):
        check_supported(self)
        completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        logps, _, _ = self._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), completion_ids.size(1))
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old      # the batch's first use: pi_old is the policy now
        behav = behaviour_logps(inputs, old)
        adv = inputs["advantages"]
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        per_token, clipped = rspo.shifted_clip_per_token(logps, old, behav, adv, self.epsilon_low,
                                                         self.clip_ratio_c)
        if self.beta != 0.0:
            per_token = per_token + self.beta * rspo.kl_k3(logps, inputs["ref_per_token_logps"])
        loss = aggregate(per_token, mask, self, inputs)
        mode = "train" if self.model.training else "eval"
        centre = torch.exp(old - behav)
        for name, x in (("clip_ratio/region_mean", clipped), ("rspo/clip_centre_mean", centre)):
            local = rspo.masked_mean(x, mask)
            self._metrics[mode][name].append(self.accelerator.gather(local).nanmean().item())
        return loss
