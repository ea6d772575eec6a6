"""RSPO's policy loss for verl: loss_mode "rspo" (actor_rollout_ref.actor.policy_loss.loss_mode=rspo).

The formula is rspo.shifted_clip_per_token (PAPER: the off-policy clip centred on c = pi_old / pi_B, with
verl's dual clip); verl's own agg_loss aggregates it, so every loss_agg_mode and the dp / micro-batch
normalisation (config.global_batch_info) are verl's.

Where pi_behaviour comes from: verl's actor (verl.workers.utils.losses.ppo_loss) hands a registered policy
loss only response_mask, old_log_probs, advantages and rollout_is_weights; a batch field of our own would
never reach it. rollout_is_weights is the field whose meaning RSPO's c already has: verl's decoupled rollout
correction puts pi_old / pi_rollout there, and c = pi_old / pi_behaviour is that ratio with B (or A's own
sampler) as the rollout policy. So the batch carries c there (rspo_verl.buffer.set_behaviour_weights) and this
loss recovers log pi_behaviour = log pi_old - log c. The alternative, a loss function of our own through the
workers' set_loss_fn, would have to copy ppo_loss (entropy, KL, metric aggregation, global batch info) and
drift with it. The price: verl's own rollout correction, which writes the same field, cannot run beside RSPO
(rspo_verl.buffer.check_rollout_correction says so before training starts).
"""
import torch

import rspo
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss
from verl.utils.torch_functional import masked_mean


def clip_range(config):
    """The shifted clip's eps: verl's clip_ratio. The paper's clip is symmetric, so a clip_ratio_low or
    clip_ratio_high that differs from it (DAPO's clip-higher) is refused rather than silently ignored."""
    eps = config.clip_ratio
    for name in ("clip_ratio_low", "clip_ratio_high"):
        value = config.get(name, None)
        if value is not None and value != eps:
            raise ValueError(f"loss_mode=rspo clips symmetrically around c with clip_ratio={eps}; "
                             f"{name}={value} is not supported (set it to clip_ratio or null)")
    return eps


def behaviour_log_prob(old_log_prob, rollout_is_weights):
    """log pi_behaviour = log pi_old - log c, c = pi_old / pi_behaviour carried in rollout_is_weights;
    no weights: every token is on-policy (c = 1, pi_behaviour = pi_old)."""
    if rollout_is_weights is None:
        return old_log_prob
    return old_log_prob - torch.log(rollout_is_weights)


@register_policy_loss("rspo")
def compute_policy_loss_rspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                             config=None, rollout_is_weights=None):
    """verl's PolicyLossFn for RSPO: -min(rho A, clip(rho, c - eps, c + eps) A), rho = pi / pi_behaviour, with
    the dual clip -clip_ratio_c * c * A for A < 0 (rspo.shifted_clip_per_token), aggregated by verl's
    agg_loss. With c = 1 on every token it is verl's "vanilla" loss. Returns (loss, metrics) as verl's
    losses do."""
    if config is None:
        raise ValueError("loss_mode=rspo needs the actor config (clip_ratio, clip_ratio_c, "
                         "global_batch_info)")
    behav = behaviour_log_prob(old_log_prob, rollout_is_weights)
    per_token, clipped = rspo.shifted_clip_per_token(log_prob, old_log_prob, behav, advantages,
                                                     clip_range(config), config.get("clip_ratio_c", 3.0))
    loss = agg_loss(loss_mat=per_token, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                    **config.global_batch_info)
    centre = torch.ones_like(old_log_prob) if rollout_is_weights is None else rollout_is_weights
    metrics = {"actor/pg_clipfrac": masked_mean(clipped, response_mask).detach().item(),
               "actor/ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach().item(),
               "actor/rspo_clip_centre": masked_mean(centre, response_mask).detach().item()}
    return loss, metrics
