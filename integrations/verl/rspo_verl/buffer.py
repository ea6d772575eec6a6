"""RSPO's buffer on verl batches (DataProto): the reward swap, the replay order, the mixed batch,
pi_behaviour.

verl's batch has one row per response: per trajectory in single-turn verl, per step in verl-agent (rows of a
trajectory share non_tensor_batch["traj_uid"] and are in time order). non_tensor_batch["uid"] names the group.
Per RSPO cycle (docs/scale.md says where each call goes in the trainer):

    swapped = reward_swap_batch(b_batch, won, invalid)       # B's fresh batch: outcome rewards, B's log-probs
    buffer.refill(swapped, "reward", generator)             # groups (uid) in rspo.buffer_order
    m = rspo.replay_groups(alpha, num_groups, u)            # A's update u: A plays num_groups - m groups
    batch = mix_batch(a_batch, buffer.take(m), "rm_scores") # before old_log_probs: A scores every row
    ...                                                     # verl: old_log_probs, values, advantages
    batch = set_behaviour_weights(batch)                    # before update_actor: c in rollout_is_weights
"""
import uuid
from dataclasses import dataclass

import numpy as np
import torch

import rspo
from verl import DataProto

BEHAV = "behav_log_probs"    # log pi_behaviour per response token: B's on buffer rows, pi_old on A's own
REPLAYED = "rspo_replayed"   # 1.0 on buffer rows, 0.0 on A's own rows


def check_rollout_correction(algorithm_config):
    """Refuse verl's rollout correction beside RSPO: it writes rollout_is_weights (where RSPO carries c) or,
    in bypass mode, replaces old_log_probs and the loss_mode itself. Call it once on config.algorithm."""
    corr = algorithm_config.get("rollout_correction", None)
    if corr is None:
        return
    active = {k: corr.get(k, None) for k in ("rollout_is", "rollout_rs", "bypass_mode")}
    active = {k: v for k, v in active.items() if v}
    if active:
        raise ValueError(f"algorithm.rollout_correction {active} collides with RSPO: loss_mode=rspo "
                         "carries its clip centre c = pi_old / pi_behaviour in rollout_is_weights, which "
                         "verl's rollout correction writes (and bypass_mode swaps the loss). Set rollout_is, "
                         "rollout_rs to null and bypass_mode to false; c already corrects for the sampler "
                         "(docs/scale.md).")


def trajectories(batch, traj_key="traj_uid"):
    """Row indices of each trajectory, in order of first appearance (a trajectory's rows in time order); a
    batch without traj_key (single-turn verl) has one row per trajectory."""
    if traj_key not in batch.non_tensor_batch:
        return [[i] for i in range(len(batch))]
    rows = {}
    for i, t in enumerate(batch.non_tensor_batch[traj_key].tolist()):
        rows.setdefault(t, []).append(i)
    return list(rows.values())


def last_response_token(response_mask):
    """Index of each row's last response token, where verl puts a row's scalar reward."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    return (response_mask.bool() * (positions + 1)).argmax(dim=1)


def reward_swap_batch(batch, won, invalid=None, scale=10.0, penalty=0.1, traj_key="traj_uid"):
    """The reward swap (PAPER step 3) on B's verl batch: token_level_rewards becomes each trajectory's
    rspo.outcome_rewards (scale * won on its last step, -penalty on unparseable steps, 0 elsewhere), each
    step's reward on its row's last response token; behav_log_probs keeps B's log-probs (the sampler's
    rollout_log_probs when verl recorded them, else B's old_log_probs). won, invalid: one entry per row.
    Returns a new DataProto."""
    won = np.asarray(won, dtype=bool)
    invalid = np.zeros(len(batch), dtype=bool) if invalid is None else np.asarray(invalid, dtype=bool)
    mask = batch.batch["response_mask"]
    rewards = torch.zeros(mask.shape, dtype=torch.float32)
    last = last_response_token(mask)
    for rows in trajectories(batch, traj_key):
        r = rspo.outcome_rewards(len(rows), bool(won[rows[0]]), invalid[rows].tolist(), scale, penalty)
        rewards[rows, last[rows]] = r.float()
    sampler = "rollout_log_probs" if "rollout_log_probs" in batch.batch.keys() else "old_log_probs"
    out = DataProto(batch=batch.batch.clone(), non_tensor_batch=dict(batch.non_tensor_batch),
                    meta_info=dict(batch.meta_info))
    out.batch["token_level_rewards"] = rewards
    out.batch[BEHAV] = batch.batch[sampler].float().clone()
    return out


@dataclass
class _Trajectory:
    """What rspo.ReplayBuffer needs of a trajectory: its group and reward vector; rows: its batch rows."""
    rows: list
    group: int
    rewards: torch.Tensor


@dataclass
class BatchBuffer:
    """rspo.ReplayBuffer over a swapped verl batch: a group is the rows sharing a uid; refill orders the
    groups by rspo.buffer_order, take hands out the next m with fresh uids (and traj_uids), wrapping
    around."""
    traj_key: str = "traj_uid"
    batch: DataProto = None
    buffer: rspo.ReplayBuffer = None

    def refill(self, swapped, mode, generator):
        """A new cycle: the groups of `swapped` (reward_swap_batch's output) in replay order, cursor at 0."""
        uids = swapped.non_tensor_batch["uid"].tolist()
        group_of = {u: g for g, u in enumerate(dict.fromkeys(uids))}
        rewards = swapped.batch["token_level_rewards"].sum(dim=1)
        trajs = [_Trajectory(rows, group_of[uids[rows[0]]], rewards[rows])
                 for rows in trajectories(swapped, self.traj_key)]
        self.batch, self.buffer = swapped, rspo.ReplayBuffer()
        self.buffer.refill(trajs, mode, generator)

    def take(self, m):
        """The next m groups as one DataProto (rows in group order), each group a fresh uid so it never shares
        a group with A's rows or with a copy of itself; None when m = 0."""
        if m == 0:
            return None
        groups = self.buffer.take(m, first_id=0)
        rows = [r for group in groups for t in group for r in t.rows]
        out = self.batch.select_idxs(rows)
        uid, traj = [], []
        for group in groups:
            fresh = f"rspo-buffer-{uuid.uuid4()}"
            for t in group:
                uid += [fresh] * len(t.rows)
                traj += [f"{fresh}/{uuid.uuid4()}"] * len(t.rows)
        out.non_tensor_batch["uid"] = np.array(uid, dtype=object)
        if self.traj_key in out.non_tensor_batch:
            out.non_tensor_batch[self.traj_key] = np.array(traj, dtype=object)
        return out


def mix_batch(a_batch, replayed, reward_key="token_level_rewards"):
    """A's batch with the buffer's rows appended (PAPER step 4: n own groups + m buffer groups), for the rest
    of the step to treat alike: the buffer rows keep A's fields only, their swapped reward copied into
    reward_key (the field A's batch holds its reward in at this point: rm_scores right after generation in
    verl 0.9's trainer). Adds behav_log_probs (B's on buffer rows; A's own are filled by
    set_behaviour_weights) and the rspo_replayed flag. Call it before old_log_probs, so A scores every
    row."""
    mask = a_batch.batch["response_mask"]
    own = DataProto(batch=a_batch.batch.clone(), non_tensor_batch=dict(a_batch.non_tensor_batch),
                    meta_info=a_batch.meta_info)
    own.batch[BEHAV] = torch.zeros(mask.shape, dtype=torch.float32)
    own.batch[REPLAYED] = torch.zeros(len(a_batch))
    if replayed is None:
        return own
    keys = [k for k in a_batch.batch.keys() if k != reward_key]
    for k in keys:
        if k not in replayed.batch.keys():
            raise ValueError(f"buffer rows lack the field {k!r} that A's batch has at this point")
        if replayed.batch[k].shape[1:] != a_batch.batch[k].shape[1:]:
            raise ValueError(f"buffer rows' {k!r} has shape {tuple(replayed.batch[k].shape[1:])}, A's "
                             f"{tuple(a_batch.batch[k].shape[1:])}: B and A must share "
                             "data.max_prompt_length and data.max_response_length")
    missing = set(a_batch.non_tensor_batch) - set(replayed.non_tensor_batch)
    if missing:
        raise ValueError(f"buffer rows lack the non-tensor fields {sorted(missing)} that A's batch has")
    rows = replayed.select(batch_keys=keys + [BEHAV], non_tensor_batch_keys=list(a_batch.non_tensor_batch))
    rows = DataProto(batch=rows.batch.clone(), non_tensor_batch=rows.non_tensor_batch,
                     meta_info=a_batch.meta_info)
    rows.batch[reward_key] = replayed.batch["token_level_rewards"].to(a_batch.batch[reward_key].dtype)
    rows.batch[REPLAYED] = torch.ones(len(replayed))
    return DataProto.concat([own, rows])


def set_behaviour_weights(batch):
    """After old_log_probs (A's pi_old on every row): behav_log_probs = old_log_probs on A's own rows, and
    rollout_is_weights = c = pi_old / pi_behaviour (exactly 1 on A's own rows, 1 on padding), which carries
    pi_behaviour to loss_mode=rspo. Call it just before update_actor, after verl's own uses of the field."""
    if "rollout_is_weights" in batch.batch.keys():
        raise ValueError("rollout_is_weights is already set (verl's rollout correction?): loss_mode=rspo "
                         "carries c = pi_old / pi_behaviour there; see check_rollout_correction")
    old = batch.batch["old_log_probs"].float()
    replayed = batch.batch[REPLAYED].bool().unsqueeze(1)
    mask = batch.batch["response_mask"].bool()
    behav = torch.where(replayed, batch.batch[BEHAV], old)
    batch.batch[BEHAV] = behav
    c = torch.where(replayed & mask, torch.exp(old - behav), torch.ones_like(old))
    batch.batch["rollout_is_weights"] = c
    return batch
