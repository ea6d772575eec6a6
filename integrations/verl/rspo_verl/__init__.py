"""RSPO (Reward-Swap Policy Optimization, arXiv 2607.04713) as a verl plug-in.

verl imports this package at `import verl` (entry-point group verl.plugins; VERL_USE_EXTERNAL_PLUGINS=none
turns plug-ins off), which registers the policy loss "rspo":
actor_rollout_ref.actor.policy_loss.loss_mode=rspo. rspo_verl.buffer has the reward swap and the replay buffer
on DataProto; docs/scale.md says where they go. The formulas are rspo.py's, imported from this repository (pip
install -e . -e integrations/verl), not copied.
"""
from rspo_verl.loss import compute_policy_loss_rspo  # noqa: F401  (registers loss_mode "rspo")

TESTED_VERL = "0.9.1"
