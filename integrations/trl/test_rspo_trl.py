"""RSPOGRPOTrainer checked against TRL's own GRPOTrainer on a CPU, and run end to end with a tiny model built
here.

    PYTHONPATH=.:integrations/trl python -m pytest -q integrations/trl     # after pip install trl==1.16.0

Skipped, with the reason, where TRL is not installed. RSPO_CROSSCHECK_LOG=FILE appends the maximum differences
and the end-to-end run's steps and seconds there (integrations/ci.sh prints them).
"""
import copy
import inspect
import os
import time

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed here: pip install trl==1.16.0")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")       # rollout_func is experimental in TRL 1.16

import rspo  # noqa: E402
import rspo_trl  # noqa: E402
from rspo_trl import RSPOGRPOTrainer, ReplayRollout, buffer_rows, swapped_reward  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

torch.set_num_threads(1)
WORDS = "go to take put the apple mug shelf desk table drawer open close look".split()
PROMPTS = ["go to the desk", "take the mug", "put the apple", "open the drawer", "look at the shelf",
           "close the drawer", "go to the table", "take the apple"]
G, STEPS = 4, 10            # num_generations; optimizer steps of the end-to-end run


def report(line):
    path = os.environ.get("RSPO_CROSSCHECK_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"trl   {line}\n")


# ----------------------------------------------------------------------------------------------
# TRL's API, as this trainer uses it: a version that changes one fails here, naming it

API = {
    "GRPOTrainer(rollout_func=...) calling rollout_func(prompts, trainer)":
        lambda: "rollout_func" in inspect.signature(GRPOTrainer.__init__).parameters
        and "self.rollout_func(prompts, self)" in inspect.getsource(GRPOTrainer._generate),
    "rollout_func output keys prompt_ids, completion_ids, logprobs (+ extra columns for reward functions)":
        lambda: '{"prompt_ids", "completion_ids", "logprobs"}' in inspect.getsource(GRPOTrainer._generate),
    "GRPOTrainer._compute_loss(model, inputs)":
        lambda: list(inspect.signature(GRPOTrainer._compute_loss).parameters) == ["self", "model", "inputs"],
    "GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep) -> 3":
        lambda: list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)[:5] == [
            "self", "model", "input_ids", "attention_mask", "logits_to_keep"],
    "inputs keys old_per_token_logps, sampling_per_token_logps, num_items_in_batch, advantages":
        lambda: all(f'"{k}"' in inspect.getsource(GRPOTrainer._generate_and_score_completions)
                    for k in ("old_per_token_logps", "sampling_per_token_logps", "num_items_in_batch",
                              "advantages")),
    "GRPOTrainer attributes read by check_supported / aggregate (loss_type, epsilon_low/high, ...)":
        lambda: all(f"self.{k} =" in inspect.getsource(GRPOTrainer.__init__) for k in (
            "loss_type", "epsilon_low", "epsilon_high", "importance_sampling_level", "top_entropy_quantile",
            "off_policy_mask_threshold", "_entropy_bonus_enabled", "aux_loss_enabled", "beta", "use_vllm",
            "vllm_importance_sampling_correction", "num_generations", "_metrics", "_logs")),
    "GRPOConfig fields loss_type, epsilon, delta, steps_per_generation, use_bias_correction_kl":
        lambda: all(hasattr(GRPOConfig, k) or k in GRPOConfig.__dataclass_fields__ for k in (
            "loss_type", "epsilon", "delta", "steps_per_generation", "use_bias_correction_kl")),
}


@pytest.mark.parametrize("api", list(API))
def test_trl_api_this_trainer_uses(api):
    try:
        ok, why = API[api](), "changed"
    except Exception as e:   # an import, attribute or signature that moved
        ok, why = False, f"{type(e).__name__}: {e}"
    assert ok, f"TRL {trl.__version__}: {api} {why}; rspo_trl was written against TRL 1.16.0"


# ----------------------------------------------------------------------------------------------
# A tiny causal LM and tokenizer built here (no network), a sampler, a task reward


def tiny_lm(seed):
    """A word-level tokenizer over WORDS and a Llama of hidden 32, one layer, from a seed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(["[PAD]", "[EOS]", "[UNK]"] + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", eos_token="[EOS]",
                                  unk_token="[UNK]",
                                  padding_side="left", model_input_names=["input_ids", "attention_mask"])
    torch.manual_seed(seed)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      pad_token_id=0, eos_token_id=1, bos_token_id=1))
    return lm, tok


def sample(lm, tok, prompts, max_new_tokens=5):
    """Completions sampled from softmax(logits) (temperature 1, no top-k/top-p) with the sampler's log-probs
    of its tokens, cut after EOS: TRL's rollout_func output."""
    from transformers import GenerationConfig
    enc = tok(prompts, return_tensors="pt", padding=True)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0,
                              eos_token_id=1, max_new_tokens=max_new_tokens, output_logits=True,
                              return_dict_in_generate=True)
    with torch.no_grad():
        out = lm.generate(**enc, generation_config=config)
    new = out.sequences[:, enc["input_ids"].shape[1]:]
    logps = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, new[..., None])[..., 0]
    rows = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for ids, lp, p in zip(new.tolist(), logps.tolist(), tok(prompts)["input_ids"]):
        n = ids.index(1) + 1 if 1 in ids else len(ids)
        rows["prompt_ids"].append(p)
        rows["completion_ids"].append(ids[:n])
        rows["logprobs"].append(lp[:n])
    return rows


def apple(prompts, completions, **kwargs):
    """The task's outcome: 1 when the completion says 'apple'."""
    return [float("apple" in c.split()) for c in completions]


def own_sampler(prompts, trainer):
    return sample(trainer.accelerator.unwrap_model(trainer.model), trainer.processing_class, prompts)


def make_trainer(tmp_path, rollout, model, tok, cls=RSPOGRPOTrainer, **kw):
    from datasets import Dataset
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2 * G, num_generations=G,
                      max_completion_length=5, max_steps=STEPS, learning_rate=1e-2, logging_steps=1,
                      report_to="none", use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
                      dataloader_num_workers=0, bf16=False, **kw)   # TRL's default bf16 autocasts log-probs
    return cls(model=model, reward_funcs=swapped_reward(apple), args=args, processing_class=tok,
               train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), rollout_func=rollout)


def score(lm, prompt_ids, completion_ids):
    """log pi(completion | prompt) per token, one row alone (no padding): the independent pi_old."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = lm(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]


# ----------------------------------------------------------------------------------------------
# End to end: 10 steps, buffer groups through rollout_func, c checked on every row


class Recording(RSPOGRPOTrainer):
    """The trainer under test, recording what each loss call saw (the test's own subclass)."""
    def _compute_loss(self, model, inputs):
        self.seen.append((inputs, copy.deepcopy({k: list(v) for k, v in self._logs["rewards"].items()}),
                          list(self._logs["advantages"])))
        return super()._compute_loss(model, inputs)


def test_rspo_grpo_trainer_runs_and_clips_replayed_rows_around_pi_old_over_pi_b(tmp_path, monkeypatch):
    a_lm, tok = tiny_lm(seed=0)
    b_lm, _ = tiny_lm(seed=1)                                     # the explorer B: another policy
    prompts_b = [p for p in PROMPTS[:4] for _ in range(G)]
    torch.manual_seed(1)
    b = sample(b_lm, tok, prompts_b)
    rows = buffer_rows(b["prompt_ids"], b["completion_ids"], b["logprobs"], apple(prompts_b, [
        tok.decode(c, skip_special_tokens=True) for c in b["completion_ids"]]), G)
    rollout = ReplayRollout(sample=own_sampler, alpha=0.5)        # 2 groups per update: 1 own, 1 replayed
    rollout.refill(rows, "reward", torch.Generator().manual_seed(0))
    trainer = make_trainer(tmp_path, rollout, a_lm, tok, cls=Recording)
    trainer.seen = []
    calls = []
    real = rspo.shifted_clip_per_token

    def recorded(logp, old_logp, behav_logp, *args):               # what the trainer hands the shifted clip
        lm = trainer.accelerator.unwrap_model(trainer.model)
        calls.append((old_logp.detach().clone(), behav_logp.detach().clone(),
                      [score(lm, p, c) for p, c in rows_of(trainer.seen[-1][0])]))
        return real(logp, old_logp, behav_logp, *args)

    monkeypatch.setattr(rspo, "shifted_clip_per_token", recorded)
    before = [p.detach().clone() for p in a_lm.parameters()]
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    assert trainer.state.global_step == STEPS and len(calls) == STEPS
    assert any(not torch.equal(p0, p1) for p0, p1 in zip(before, a_lm.parameters())), "A did not learn"
    buffered = {(tuple(r.prompt_ids), tuple(r.completion_ids)): r for r in rows}
    c_own, c_rep, d_adv = [], [], []
    for (inputs, rewards, advantages), (old, behav, pi_old) in zip(trainer.seen, calls):
        n_rep = 0
        for i, (p, c) in enumerate(rows_of(inputs)):
            n = len(c)
            c_used = torch.exp(old[i, :n] - behav[i, :n])
            row = buffered.get((tuple(p), tuple(c)))
            if row is None:                                        # A's own row: the sampler was pi_old
                c_own.append((c_used - 1).abs().max())
                continue
            n_rep += 1
            assert torch.equal(behav[i, :n], torch.tensor(row.logprobs)), "replayed row without B's log-probs"
            log_c = old[i, :n] - behav[i, :n]                      # c can be large: compare log c
            c_rep.append((log_c - (pi_old[i] - torch.tensor(row.logprobs))).abs().max())
        assert n_rep == G, f"{n_rep} replayed rows in an update, expected one group of {G}"
        swapped = torch.tensor(rewards["apple"])                   # generation order: own, then buffer
        groups = torch.arange(len(swapped)) // G
        theirs = torch.tensor(advantages)
        ours = rspo.grpo_advantages(swapped, groups, eps=1e-4)      # TRL: scale_rewards="group", eps 1e-4
        d_adv.append((theirs - ours).abs().max())
    own_max, rep_max = float(torch.stack(c_own).max()), float(torch.stack(c_rep).max())
    report(f"end to end: {STEPS} steps in {seconds:.1f} s; {len(c_rep)} replayed rows (c = pi_old / pi_B), "
           f"{len(c_own)} own rows (c = 1)")
    name = "max |log c - log pi_old/pi_B|, replayed rows (pi_old scored alone)"
    report(f"{name:<58} max |diff| = {rep_max:.3g}")
    report(f"{'max |c - 1| on own rows (sampler vs trainer forward)':<58} max |diff| = {own_max:.3g}")
    spread = max(float(torch.exp(pi - torch.tensor(buffered[tuple(p), tuple(c)].logprobs)).sub(1).abs().max())
                 for (inputs, _, _), (_, _, pis) in zip(trainer.seen, calls)
                 for (p, c), pi in zip(rows_of(inputs), pis) if (tuple(p), tuple(c)) in buffered)
    adv_max = float(torch.stack(d_adv).max())
    report(f"{'grpo_advantages vs TRL group advantages (own + swapped rows)':<58} max |diff| = {adv_max:.3g}")
    assert spread > 0.1, "B must be another policy, so that c != 1 is tested"
    assert rep_max < 1e-5 and own_max < 1e-5 and adv_max < 1e-5


def rows_of(inputs):
    """(prompt ids, completion ids) of each row of a TRL batch, padding removed."""
    return [(p[pm.bool()].tolist(), c[cm.bool()].tolist()) for p, pm, c, cm in zip(
        inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"])]


# ----------------------------------------------------------------------------------------------
# With c = 1 the loss is TRL's own, for each loss_type this trainer reproduces


@pytest.mark.parametrize("loss_type", rspo_trl.LOSS_TYPES)
def test_loss_with_c_one_equals_grpo_trainers_own_loss(tmp_path, loss_type):
    """Same inputs, both sides computed: RSPOGRPOTrainer._compute_loss with the sampler = pi_old (c = 1) gives
    GRPOTrainer._compute_loss's value and gradient (ratios pi / pi_old from 0.5 to 2, signed advantages)."""
    lm, tok = tiny_lm(seed=0)
    trainer = make_trainer(tmp_path, ReplayRollout(sample=own_sampler, alpha=0.0), lm, tok,
                           loss_type=loss_type)
    trainer.current_gradient_accumulation_steps = 2                # as inside an accumulation window
    torch.manual_seed(2)
    rows = sample(lm, tok, PROMPTS)
    pad = lambda xs, side: torch.nn.utils.rnn.pad_sequence(      # noqa: E731
        [torch.tensor(x) for x in xs], batch_first=True, padding_side=side)
    prompt_ids, completion_ids = pad(rows["prompt_ids"], "left"), pad(rows["completion_ids"], "right")
    completion_mask = pad([[1] * len(c) for c in rows["completion_ids"]], "right")
    old = pad(rows["logprobs"], "right") + (torch.rand(completion_ids.shape) - 0.5) * 1.2
    prompt_mask = pad([[1] * len(p) for p in rows["prompt_ids"]], "left")
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
              "completion_ids": completion_ids, "completion_mask": completion_mask,
              "advantages": torch.randn(len(PROMPTS)), "num_items_in_batch": completion_mask.sum() * 2,
              "old_per_token_logps": old, "sampling_per_token_logps": old.clone()}
    lm.train()
    out = {}
    for side in (GRPOTrainer, RSPOGRPOTrainer):
        lm.zero_grad()
        loss = side._compute_loss(trainer, lm, inputs)
        loss.backward()
        out[side.__name__] = (loss.detach(), torch.cat([p.grad.flatten() for p in lm.parameters()]))
    d_loss = (out["GRPOTrainer"][0] - out["RSPOGRPOTrainer"][0]).abs().item()
    d_grad = (out["GRPOTrainer"][1] - out["RSPOGRPOTrainer"][1]).abs().max().item()
    for what, d in (("loss", d_loss), ("gradient", d_grad)):
        report(f"{f'RSPOGRPOTrainer (c = 1) vs GRPOTrainer, {loss_type}: {what}':<58} max |diff| = {d:.3g}")
    assert d_loss < 1e-6 and d_grad < 1e-6


def test_unsupported_options_are_refused_by_name(tmp_path):
    lm, tok = tiny_lm(seed=0)
    trainer = make_trainer(tmp_path, ReplayRollout(sample=own_sampler, alpha=0.0), lm, tok, epsilon_high=0.28)
    with pytest.raises(ValueError, match="epsilon_high"):
        rspo_trl.check_supported(trainer)
