"""RSPO's verl plug-in checked against verl's own code, on a CPU: both sides are computed here, on the same
inputs.

    bash integrations/ci.sh                                  # builds verl's environment once, runs these
    <verl venv>/bin/python -m pytest -q integrations/verl    # in an environment with verl 0.9.1 and rspo-verl

Our side is rspo.py's functions (shifted_clip_loss, grpo_advantages, gae_advantages, kl_k3, value_loss,
buffer_order) and the plug-in; verl's side is verl.trainer.ppo.core_algos and the actor's ppo_loss. Skipped,
with the reason, where verl is not installed. RSPO_CROSSCHECK_LOG=FILE appends each maximum difference there.
"""
import inspect
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl", reason="no verl here: integrations/ci.sh builds its venv")
from verl.trainer.ppo import core_algos  # noqa: E402

# Read before this file imports rspo_verl itself: only verl's entry-point discovery can have registered it.
REGISTERED_AT_IMPORT = "rspo" in core_algos.POLICY_LOSS_REGISTRY

import rspo  # noqa: E402
from rspo_verl import buffer as rb  # noqa: E402
from rspo_verl.loss import compute_policy_loss_rspo  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

torch.set_num_threads(1)
MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def report(name, diff):
    """Append a cross-check's maximum difference to $RSPO_CROSSCHECK_LOG (ci.sh prints them)."""
    path = os.environ.get("RSPO_CROSSCHECK_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"verl  {name:<58} max |diff| = {diff:.3g}\n")


def close(name, ours, theirs, atol=1e-6):
    """Assert ours == theirs within atol and report the maximum difference."""
    diff = (torch.as_tensor(ours).double() - torch.as_tensor(theirs).double()).abs().max().item()
    report(name, diff)
    assert diff <= atol, f"{name}: max |ours - verl| = {diff:.3g} > {atol}"


# ----------------------------------------------------------------------------------------------
# verl's API, as this plug-in uses it: a version that changes one fails here, naming it


def _params(fn):
    return list(inspect.signature(fn).parameters)


API = {
    "verl.plugins entry-point group read at `import verl` (VERL_USE_EXTERNAL_PLUGINS)":
        lambda: all(k in inspect.getsource(verl) for k in ("verl.plugins", "VERL_USE_EXTERNAL_PLUGINS")),
    "core_algos.register_policy_loss / get_policy_loss_fn / POLICY_LOSS_REGISTRY":
        lambda: callable(core_algos.register_policy_loss) and core_algos.get_policy_loss_fn("vanilla"),
    "PolicyLossFn signature (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, "
    "rollout_is_weights)":
        lambda: _params(core_algos.compute_policy_loss_vanilla) == [
            "old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "config",
            "rollout_is_weights"],
    "core_algos.agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, "
    "loss_scale_factor)":
        lambda: _params(core_algos.agg_loss) == [
            "loss_mat", "loss_mask", "loss_agg_mode", "dp_size", "batch_num_tokens", "global_batch_size",
            "loss_scale_factor"],
    "workers.utils.losses.ppo_loss(config, model_output, data) passes rollout_is_weights to the policy loss":
        lambda: _params(ppo_loss)[:3] == ["config", "model_output", "data"]
        and "rollout_is_weights=rollout_is_weights" in inspect.getsource(ppo_loss),
    "ActorConfig fields clip_ratio(_low/_high), clip_ratio_c, loss_agg_mode, global_batch_info, "
    "policy_loss.loss_mode":
        lambda: all(hasattr(actor_config("token-mean"), k) for k in (
            "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode",
            "global_batch_info", "loss_scale_factor")) and actor_config("token-mean").policy_loss.loss_mode,
    "core_algos.compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon, "
    "norm_adv_by_std_in_grpo)":
        lambda: _params(core_algos.compute_grpo_outcome_advantage)[:5] == [
            "token_level_rewards", "response_mask", "index", "epsilon", "norm_adv_by_std_in_grpo"],
    "core_algos.compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)":
        lambda: _params(core_algos.compute_gae_advantage_return) == [
            "token_level_rewards", "values", "response_mask", "gamma", "lam"],
    "core_algos.kl_penalty(logprob, ref_logprob, kl_penalty='low_var_kl')":
        lambda: _params(core_algos.kl_penalty) == ["logprob", "ref_logprob", "kl_penalty"],
    "core_algos.compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode)":
        lambda: _params(core_algos.compute_value_loss)[:6] == [
            "vpreds", "returns", "values", "response_mask", "cliprange_value", "loss_agg_mode"],
    "DataProto.concat / select / select_idxs / from_dict / to_tensordict":
        lambda: all(callable(getattr(DataProto, k)) for k in (
            "concat", "select", "select_idxs", "from_dict", "to_tensordict")),
    "RolloutCorrectionConfig fields rollout_is, rollout_rs, bypass_mode":
        lambda: all(hasattr(RolloutCorrectionConfig(), k)
                    for k in ("rollout_is", "rollout_rs", "bypass_mode")),
}


@pytest.mark.parametrize("api", list(API))
def test_verl_api_this_plugin_uses(api):
    try:
        ok = API[api]()
    except Exception as e:   # an import, attribute or signature that moved
        ok, why = False, f"{type(e).__name__}: {e}"
    else:
        why = "changed"
    assert ok, f"verl {verl.__version__}: {api} {why}; rspo_verl was written against verl 0.9.1"


def test_plugin_registered_by_verls_entry_point_and_switched_off_by_verls_switch():
    assert REGISTERED_AT_IMPORT, "`import verl` did not load rspo_verl: is rspo-verl installed?"
    assert core_algos.get_policy_loss_fn("rspo") is compute_policy_loss_rspo
    probe = ("import verl; from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R; "
             "print('rspo' in R)")
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="none")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


# ----------------------------------------------------------------------------------------------
# Batches as verl's trainer holds them: left-padded prompts, right-padded responses, a uid per group


def make_batch(n, seed, prompt_len=4, resp_len=6, group_size=2, prefix="a"):
    """A verl batch of n rows with random lengths, log-probs and per-row advantages, groups of group_size."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, prompt_len + 1, (n,), generator=g)
    r_len = torch.randint(1, resp_len + 1, (n,), generator=g)
    p_mask = (torch.arange(prompt_len) >= prompt_len - p_len[:, None]).long()   # left padding
    r_mask = (torch.arange(resp_len) < r_len[:, None]).long()                  # right padding
    prompts = torch.randint(3, 50, (n, prompt_len), generator=g) * p_mask
    responses = torch.randint(3, 50, (n, resp_len), generator=g) * r_mask
    attention = torch.cat([p_mask, r_mask], dim=1)
    tensors = {"prompts": prompts, "responses": responses,
               "input_ids": torch.cat([prompts, responses], dim=1),
               "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
               "response_mask": r_mask,
               "old_log_probs": -torch.rand(n, resp_len, generator=g) * 2 * r_mask,
               "rm_scores": torch.zeros(n, resp_len),
               "advantages": torch.randn(n, 1, generator=g) * r_mask}
    uids = np.array([f"{prefix}{i // group_size}" for i in range(n)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids})


def actor_config(mode, loss_mode="rspo", **kw):
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=mode,
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode), **kw)


def scatter_log_prob(log_prob, batch):
    """The actor's model output for log_prob [bs, resp_len]: a flat (total tokens) tensor in verl's no-padding
    layout, where a response token's log-prob sits one position before the token (no_padding_2_padding)."""
    attention = batch.batch["attention_mask"]
    ends = attention.sum(1).cumsum(0)
    r_len = batch.batch["response_mask"].sum(1)
    idx = torch.cat([torch.arange(int(e - r - 1), int(e - 1)) for e, r in zip(ends, r_len)])
    values = log_prob[batch.batch["response_mask"].bool()]
    return torch.zeros(int(attention.sum()), dtype=values.dtype).index_put((idx,), values)


def verl_ppo_loss(batch, log_prob, config, dp_size=1, batch_num_tokens=None, global_batch_size=None):
    """verl's actor loss, verl.workers.utils.losses.ppo_loss, on this batch as the engine hands it a
    micro-batch: to_tensordict, left_right_2_no_padding, the global batch info, the model's log-probs
    unpadded."""
    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                         global_batch_size=global_batch_size)
    return ppo_loss(config, {"log_probs": scatter_log_prob(log_prob, batch)}, data)


def mixed_batch(seed=0):
    """A's 6 own rows (3 groups) + 2 buffer groups of B's (swapped, B's log-probs), old_log_probs for every
    row, c set: what update_actor gets. Returns (batch, log pi_theta leaf)."""
    a = make_batch(6, seed)
    b = make_batch(8, seed + 1, prefix="b")
    b.batch["token_level_rewards"] = torch.rand(8, 6)            # B's dense rewards, to be swapped away
    swapped = rb.reward_swap_batch(b, won=[1, 1, 0, 0, 1, 0, 0, 0])
    buffer = rb.BatchBuffer()
    buffer.refill(swapped, "reward", torch.Generator().manual_seed(0))
    batch = rb.mix_batch(a, buffer.take(2), reward_key="rm_scores")
    g = torch.Generator().manual_seed(seed + 2)
    mask = batch.batch["response_mask"]
    batch.batch["old_log_probs"] = -torch.rand(mask.shape, generator=g) * 2 * mask   # A scores every row
    batch = rb.set_behaviour_weights(batch)
    log_prob = (batch.batch["old_log_probs"] + 0.4 * torch.randn(mask.shape, generator=g)) * mask
    return batch, log_prob.requires_grad_()


# ----------------------------------------------------------------------------------------------
# The loss: through verl's real ppo_loss path, against verl's vanilla, on hand values


def test_rspo_loss_through_verls_ppo_loss_equals_shifted_clip_loss():
    """verl's actor path (ppo_loss -> get_policy_loss_fn('rspo') -> agg_loss) gives rspo.shifted_clip_loss,
    value and gradient, on a batch mixing A's rows (c = 1) and buffer rows (c = pi_old / pi_B != 1)."""
    batch, log_prob = mixed_batch()
    bt = batch.batch
    assert (bt["rollout_is_weights"][bt["rspo_replayed"] > 0] != 1).any(), "buffer rows must have c != 1"
    mask = bt["response_mask"]
    loss, metrics = verl_ppo_loss(batch, log_prob, actor_config("token-mean"),
                                  batch_num_tokens=int(mask.sum()), global_batch_size=len(batch))
    (g_verl,) = torch.autograd.grad(loss, log_prob)
    ours, clipfrac = rspo.shifted_clip_loss(log_prob, bt["old_log_probs"], bt["behav_log_probs"],
                                            bt["advantages"], mask)
    (g_ours,) = torch.autograd.grad(ours, log_prob)
    close("ppo_loss(loss_mode=rspo) vs shifted_clip_loss: loss", loss.detach(), ours.detach())
    close("ppo_loss(loss_mode=rspo) vs shifted_clip_loss: d loss / d logp", g_verl, g_ours, atol=1e-7)
    close("ppo_loss(loss_mode=rspo) vs shifted_clip_loss: clip fraction", metrics["actor/pg_clipfrac"].values,
          clipfrac)


def test_kl_loss_through_ppo_loss_is_kl_k3():
    """actor.use_kl_loss with kl_loss_type=low_var_kl adds kl_loss_coef * token-mean of rspo.kl_k3."""
    batch, log_prob = mixed_batch(seed=3)
    mask = batch.batch["response_mask"]
    batch.batch["ref_log_prob"] = (batch.batch["old_log_probs"] - 0.3) * mask
    info = {"batch_num_tokens": int(mask.sum()), "global_batch_size": len(batch)}
    config = actor_config("token-mean", use_kl_loss=True, kl_loss_coef=0.01)
    with_kl, _ = verl_ppo_loss(batch, log_prob, config, **info)
    bt = batch.batch
    pg, _ = rspo.shifted_clip_loss(log_prob, bt["old_log_probs"], bt["behav_log_probs"], bt["advantages"],
                                   mask)
    ours = pg + 0.01 * rspo.masked_mean(rspo.kl_k3(log_prob, bt["ref_log_prob"]), mask)
    close("ppo_loss(use_kl_loss, low_var_kl) vs shifted_clip_loss + beta kl_k3", with_kl.detach(),
          ours.detach())


def random_loss_inputs(seed, bs=8, t=7):
    """log-probs with ratios pi / pi_old from about 0.1 to 10 (both clips and the dual clip active), signed
    advantages, ragged masks."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(t) < torch.randint(1, t + 1, (bs, 1), generator=g)).float()
    old = -torch.rand(bs, t, generator=g) * 3
    logp = (old + torch.randn(bs, t, generator=g) * 1.2).requires_grad_()
    adv = torch.randn(bs, 1, generator=g).expand(bs, t).contiguous()
    return old, logp, adv, mask


@pytest.mark.parametrize("mode", MODES)
def test_rspo_with_c_one_is_verls_vanilla_in_every_aggregation_mode(mode):
    """On-policy tokens (c = 1): the plug-in's loss, gradient and clip fraction are verl's vanilla PPO loss
    with its dual clip (clip_ratio_c = 3), in each loss_agg_mode."""
    old, logp, adv, mask = random_loss_inputs(seed=MODES.index(mode))
    ratio = torch.exp(logp.detach() - old)
    assert ((ratio > 3) & (adv < 0) & (mask > 0)).any(), "the dual clip must be exercised"
    out = {}
    for name in ("rspo", "vanilla"):
        loss_fn = core_algos.get_policy_loss_fn(name)
        loss, metrics = loss_fn(old, logp, adv, mask, mode, actor_config(mode, name))
        out[name] = (loss.detach(), torch.autograd.grad(loss, logp)[0], metrics["actor/pg_clipfrac"])
    close(f"rspo (c = 1) vs vanilla, {mode}: loss", out["rspo"][0], out["vanilla"][0])
    close(f"rspo (c = 1) vs vanilla, {mode}: gradient", out["rspo"][1], out["vanilla"][1], atol=1e-7)
    close(f"rspo (c = 1) vs vanilla, {mode}: clip fraction", out["rspo"][2], out["vanilla"][2])


def test_shifted_clip_hand_values():
    """The paper's off-policy clip by hand, one token per case (eps = 0.2, clip_ratio_c = 3):
    L = -min(rho A, clip(rho, c - eps, c + eps) A), and for A < 0 at most -3 c A."""
    cases = [  # (pi, pi_old, pi_B, A, expected L)
        (0.30, 0.20, 0.10, 1.0, -2.2),    # rho 3.0, c 2.0: clipped at c + eps = 2.2
        (0.19, 0.20, 0.10, 1.0, -1.9),    # rho 1.9 inside [1.8, 2.2]: unclipped
        (0.10, 0.20, 0.10, -1.0, 1.8),    # rho 1.0 < c - eps = 1.8, A < 0: clipped at 1.8
        (0.90, 0.20, 0.10, -1.0, 6.0),    # rho 9.0, A < 0: dual clip 3 * c = 6
        (0.12, 0.10, 0.10, 1.0, -1.2),    # c = 1: PPO's clip at 1 + eps
    ]
    pi, old, behav, adv, expected = (torch.tensor(col, dtype=torch.float64) for col in zip(*cases))
    config = actor_config("token-sum")
    loss, _ = compute_policy_loss_rspo(old.log()[:, None], pi.log()[:, None], adv[:, None],
                                       torch.ones(len(cases), 1), "token-sum", config,
                                       rollout_is_weights=(old / behav)[:, None])
    per_token, _ = rspo.shifted_clip_per_token(pi.log(), old.log(), behav.log(), adv)
    close("shifted clip, hand values (5 tokens)", per_token, expected, atol=1e-12)
    close("loss_mode=rspo token-sum, hand values", loss, expected.sum(), atol=1e-12)


def test_asymmetric_clip_is_refused():
    old, logp, adv, mask = random_loss_inputs(seed=0)
    with pytest.raises(ValueError, match="clip_ratio_high"):
        compute_policy_loss_rspo(old, logp, adv, mask, "token-mean",
                                 actor_config("token-mean", clip_ratio_high=0.28))


# ----------------------------------------------------------------------------------------------
# Micro-batches and data-parallel ranks, as verl's own CPU tests check its losses


def shards(batch, log_prob, k):
    step = len(batch) // k
    return [(batch.slice(i, i + step), log_prob[i:i + step]) for i in range(0, len(batch), step)]


@pytest.mark.parametrize("mode", MODES)
def test_rspo_loss_is_micro_batch_and_dp_invariant(mode):
    """Through ppo_loss with verl's global batch info: the sum over micro-batches (gradient accumulation) and
    the mean over dp ranks (FSDP's gradient averaging, dp_size forwarded) equal the whole mini-batch's
    loss."""
    batch, log_prob = mixed_batch(seed=7)
    mask = batch.batch["response_mask"]
    info = {"batch_num_tokens": int(mask.sum()), "global_batch_size": len(batch)}
    config = lambda: actor_config(mode, loss_scale_factor=mask.shape[1])   # noqa: E731  (fresh per call)
    whole = verl_ppo_loss(batch, log_prob, config(), **info)[0]
    for k in (2, 5):                                                    # 10 rows: 5 or 2 per shard
        micro = sum(verl_ppo_loss(b, lp, config(), **info)[0] for b, lp in shards(batch, log_prob, k))
        close(f"rspo via ppo_loss, {mode}: {k} micro-batches summed vs whole", micro.detach(), whole.detach())
        ranks = torch.stack([verl_ppo_loss(b, lp, config(), dp_size=k, **info)[0]
                             for b, lp in shards(batch, log_prob, k)])
        close(f"rspo via ppo_loss, {mode}: dp_size={k} ranks averaged vs whole", ranks.mean().detach(),
              whole.detach())


# ----------------------------------------------------------------------------------------------
# The base algorithms' math: rspo.py's functions against verl's estimators


@pytest.mark.parametrize("norm_std", [True, False])
def test_grpo_advantages_equal_verls_grpo_with_one_row_per_trajectory(norm_std):
    """Single-turn verl (a row is a trajectory, its score the sum of its token rewards): verl's
    compute_grpo_outcome_advantage = rspo.grpo_advantages (unbiased std, eps 1e-6), groups of 2 to 5."""
    g = torch.Generator().manual_seed(0)
    groups = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 4, 4])
    n, t = len(groups), 5
    mask = (torch.arange(t) < torch.randint(1, t + 1, (n, 1), generator=g)).float()
    rewards = torch.zeros(n, t)
    rewards[torch.arange(n), mask.sum(1).long() - 1] = (torch.rand(n, generator=g) > 0.5) * 10.0
    rewards[4:6] = 0.0                                                         # a group with one success
    theirs, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, np.array(groups.tolist()),
                                                          norm_adv_by_std_in_grpo=norm_std)
    ours = rspo.grpo_advantages(rewards.sum(1), groups, norm_std=norm_std)
    close(f"grpo_advantages vs compute_grpo_outcome_advantage (norm_std={norm_std})", ours[:, None] * mask,
          theirs)


def test_grpo_conventions_that_differ_from_verl():
    """Documented differences, shown: (1) a group of one: verl keeps S / (1 + eps) (mean 0, std 1), rspo gives
    0 (no baseline); (2) verl-style step rows (each step row carrying its episode's score S): verl's
    statistics weigh a trajectory by its number of steps, rspo's take each trajectory once; one row per
    trajectory agrees."""
    alone, _ = core_algos.compute_grpo_outcome_advantage(torch.tensor([[4.0]]), torch.ones(1, 1),
                                                         np.array([0]))
    assert alone.item() == pytest.approx(4.0 / (1 + 1e-6))
    assert rspo.grpo_advantages(torch.tensor([4.0]), torch.tensor([0])).item() == 0
    scores, lengths = torch.tensor([10.0, 0.0, 0.0, 10.0]), [1, 5, 2, 3]      # one group of 4 trajectories
    rows = torch.repeat_interleave(scores, torch.tensor(lengths))[:, None]
    per_step, _ = core_algos.compute_grpo_outcome_advantage(rows, torch.ones_like(rows),
                                                            np.zeros(len(rows), dtype=object))
    ours = rspo.grpo_advantages(scores, torch.zeros(4, dtype=torch.long))
    per_traj, _ = core_algos.compute_grpo_outcome_advantage(scores[:, None], torch.ones(4, 1),
                                                            np.zeros(4, dtype=object))
    close("grpo_advantages vs verl, one row per trajectory (multi-turn)", ours, per_traj[:, 0])
    gap = (torch.repeat_interleave(ours, torch.tensor(lengths)) - per_step[:, 0]).abs().max().item()
    report("grpo: rspo (per trajectory) vs verl over step rows (differs by design)", gap)
    assert gap > 0.05


def test_gae_advantages_equal_verls_gae_with_steps_as_tokens():
    """rspo's turn-level GAE = verl's compute_gae_advantage_return when each trajectory is one verl row whose
    'tokens' are its steps (reward r_t and V(s_t) per step, mask = steps taken): verl's returns are ours, and
    returns - values are our (unwhitened) advantages; verl then whitens over the batch (masked_whiten)."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 6, 4]
    t = max(lengths)
    mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).float()
    rewards = torch.randn(len(lengths), t, generator=g) * mask
    values = torch.randn(len(lengths), t, generator=g) * mask
    adv_verl, ret_verl = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma=0.95, lam=0.9)
    traj_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    adv, ret = rspo.gae_advantages(rewards[mask.bool()], values[mask.bool()], traj_ids, 0.95, 0.9)
    close("gae_advantages vs compute_gae_advantage_return: returns", ret, ret_verl[mask.bool()])
    close("gae_advantages vs verl: advantages (returns - values)", adv, (ret_verl - values)[mask.bool()])
    whitened = verl_F.masked_whiten(torch.zeros_like(mask).masked_scatter(mask.bool(), adv), mask)
    close("gae_advantages, verl's masked_whiten vs verl's advantages", whitened[mask.bool()],
          adv_verl[mask.bool()])


def test_kl_k3_equals_verls_low_var_kl_clamps_included():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, generator=g) * 5
    ref = logp + torch.randn(64, generator=g) * 3
    ref[:4] = torch.tensor([-40.0, 30.0, -12.0, 0.0]) + logp[:4]               # past both clamps
    close("kl_k3 vs kl_penalty(low_var_kl)", rspo.kl_k3(logp, ref),
          core_algos.kl_penalty(logp, ref, "low_var_kl"))


def test_value_loss_equals_verls_with_one_token_per_state():
    """rspo.value_loss (PPO's clipped value loss, 0.5 * mean over states) = verl's compute_value_loss with one
    token per state and token-mean."""
    g = torch.Generator().manual_seed(0)
    vpred, old, ret = (torch.randn(32, generator=g) for _ in range(3))
    theirs, _ = core_algos.compute_value_loss(vpred[:, None], ret[:, None], old[:, None], torch.ones(32, 1),
                                              cliprange_value=0.2, loss_agg_mode="token-mean")
    close("value_loss vs compute_value_loss", rspo.value_loss(vpred, old, ret, 0.2), theirs)


# ----------------------------------------------------------------------------------------------
# The buffer on DataProto


def test_reward_swap_batch_puts_outcome_rewards_on_each_steps_last_token():
    """B's dense token_level_rewards become rspo.outcome_rewards per trajectory (traj_uid, rows in time
    order): scale * won on the last step, -penalty on invalid steps; B's sampler log-probs are kept as
    behav_log_probs."""
    b = make_batch(5, seed=0)
    b.non_tensor_batch["traj_uid"] = np.array(["t0", "t0", "t0", "t1", "t1"], dtype=object)
    b.batch["token_level_rewards"] = torch.rand(5, 6)
    b.batch["rollout_log_probs"] = b.batch["old_log_probs"] - 0.5
    out = rb.reward_swap_batch(b, won=[1, 1, 1, 0, 0], invalid=[0, 1, 0, 0, 1])
    per_row = out.batch["token_level_rewards"]
    assert per_row.sum(1).tolist() == pytest.approx([0.0, -0.1, 10.0, 0.0, -0.1])
    last = b.batch["response_mask"].sum(1) - 1
    assert (per_row.abs().sum(1) == per_row[torch.arange(5), last].abs()).all(), "reward off the last token"
    assert torch.equal(out.batch["behav_log_probs"], b.batch["rollout_log_probs"])
    assert torch.equal(b.batch["old_log_probs"] - 0.5, b.batch["rollout_log_probs"]), "B's batch was changed"


def test_buffer_takes_groups_in_buffer_order_with_fresh_uids():
    """Groups (uid) are handed out in rspo.buffer_order of their outcomes, m at a time, wrapping around, each
    with a fresh uid; mixed into A's batch, verl's GRPO normalises every group on its own."""
    b = make_batch(8, seed=1, prefix="b")
    b.batch["token_level_rewards"] = torch.zeros(8, 6)
    b.batch["row"] = torch.arange(8.0)[:, None].expand(8, 6)                     # to follow rows around
    won = [1, 0, 1, 1, 0, 0, 0, 1]                                               # group means .5, 1, 0, .5
    swapped = rb.reward_swap_batch(b, won)
    buffer = rb.BatchBuffer()
    buffer.refill(swapped, "reward", torch.Generator().manual_seed(5))
    outcomes = [swapped.batch["token_level_rewards"][2 * k:2 * k + 2].sum(1) for k in range(4)]
    order = rspo.buffer_order(outcomes, "reward", torch.Generator().manual_seed(5)).tolist()
    taken = [buffer.take(2), buffer.take(2), buffer.take(1)]
    got = [int(r) // 2 for t in taken for r in t.batch["row"][:, 0].tolist()[::2]]
    assert got == order + order[:1], f"groups {got}, buffer_order {order}"
    a = make_batch(4, seed=2)
    mixed = rb.mix_batch(a, taken[0], reward_key="rm_scores")
    uids = mixed.non_tensor_batch["uid"].tolist()
    assert uids[:4] == a.non_tensor_batch["uid"].tolist() and len(set(uids[4:])) == 2
    assert not set(uids[4:]) & set(uids[:4]) and not set(uids[4:]) & set(b.non_tensor_batch["uid"].tolist())
    assert torch.equal(mixed.batch["rm_scores"][4:], taken[0].batch["token_level_rewards"])
    adv, _ = core_algos.compute_grpo_outcome_advantage(mixed.batch["rm_scores"], mixed.batch["response_mask"],
                                                       mixed.non_tensor_batch["uid"])
    group_ids = torch.tensor([list(dict.fromkeys(uids)).index(u) for u in uids])
    ours = rspo.grpo_advantages(mixed.batch["rm_scores"].sum(1), group_ids)
    close("grpo over A's + buffer rows (fresh uids) vs rspo per group",
          ours[:, None] * mixed.batch["response_mask"],
          adv)


def test_behaviour_weights_c_is_one_on_own_rows_and_pi_old_over_pi_b_on_buffer_rows():
    batch, _ = mixed_batch(seed=4)
    bt = batch.batch
    own, rep, mask = bt["rspo_replayed"] == 0, bt["rspo_replayed"] > 0, bt["response_mask"].bool()
    assert (bt["rollout_is_weights"][own] == 1).all()
    assert torch.equal(bt["behav_log_probs"][own], bt["old_log_probs"][own])
    expected = torch.exp(bt["old_log_probs"] - bt["behav_log_probs"])[rep][mask[rep]]
    close("c on buffer rows vs pi_old / pi_B", bt["rollout_is_weights"][rep][mask[rep]], expected, atol=0)


def test_verls_rollout_correction_collides_with_a_clear_error():
    """verl's trainer config (ppo_trainer.yaml) turns rollout correction off: rollout_is and rollout_rs null,
    bypass_mode false. Any of them on (RolloutCorrectionConfig's own default is rollout_is="sequence") is
    refused."""
    rb.check_rollout_correction(AlgoConfig())
    rb.check_rollout_correction(AlgoConfig(rollout_correction=RolloutCorrectionConfig(rollout_is=None)))
    for kw in ({}, {"rollout_is": "token"}, {"rollout_is": None, "rollout_rs": "token"},
               {"rollout_is": None, "bypass_mode": True}):
        with pytest.raises(ValueError, match="collides with RSPO"):
            rb.check_rollout_correction(AlgoConfig(rollout_correction=RolloutCorrectionConfig(**kw)))
    batch, _ = mixed_batch()
    with pytest.raises(ValueError, match="already set"):
        rb.set_behaviour_weights(batch)


def test_mix_batch_refuses_other_padding_widths():
    a, b = make_batch(4, seed=0), make_batch(4, seed=1, resp_len=8)
    b.batch["token_level_rewards"] = torch.zeros(4, 8)
    buffer = rb.BatchBuffer()
    buffer.refill(rb.reward_swap_batch(b, won=[1, 0, 0, 0]), "reward", torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="max_response_length"):
        rb.mix_batch(a, buffer.take(1), reward_key="rm_scores")
