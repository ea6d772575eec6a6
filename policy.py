"""The LLM policy rspo.py trains: any Hugging Face causal LM, or a tiny one built offline, with the prompts,
constrained or free decoding, the log-probs the update needs, and where it runs (device, dtype, saving).

rspo.py holds the method and its trainer; this file is the agent it trains (as nanoGPT keeps model.py
apart from train.py). Nothing here knows about RSPO: a Policy renders states as prompts, samples actions
(act) and scores responses (forward).
"""
import contextlib
import json
import os
import re
import shutil
import string

import torch
import torch.nn as nn
import torch.utils.checkpoint

import envs


class ConfigError(ValueError):
    """Bad user input: reported as one line and exit code 2, never a traceback."""


def length_sorted_chunks(indices, lengths, size):
    """Split indices into passes of `size` samples of similar length (lengths[i]), so little is padding.
    The loss is a token-weighted sum over chunks, so the grouping does not change the gradient."""
    ordered = sorted(indices, key=lambda i: lengths[i])
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


# ----------------------------------------------------------------------------------------------
# Policy: any Hugging Face causal LM (or a tiny one built offline), with a value head for PPO

PUNCTUATION = list(string.punctuation)
SPECIALS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]

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
    the observation, the admissible actions).
    Compact (tiny model): task, the last actions and the observation; the admissible actions are
    enforced by constrained decoding instead of being listed."""
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
    """verl-agent's projection: the text inside <action>...</action>, stripped and lower-cased; valid
    only with a <think>...</think> block too. Invalid responses are sent to the env as they are."""
    m = re.search(r"<action>(.*?)</action>", text, re.S)
    if m is None or "<think>" not in text or "</think>" not in text:
        return text.strip(), False
    return m.group(1).strip().lower(), True


def build_tiny_tokenizer(words):
    """Word-level tokenizer built in memory: every word of the environment, every punctuation mark."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(SPECIALS + sorted(set(words) | set(PUNCTUATION)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation("isolated")])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   bos_token="[BOS]", eos_token="[EOS]", padding_side="left",
                                   model_input_names=["input_ids", "attention_mask"])


def tiny_vocabulary(env_name, backend, env_options):
    """The environment's words plus the prompt templates' words (for backend="real", the offline
    words: envs.vocabulary drops the real-only options; the rest of the real text maps to [UNK])."""
    templates = (COMPACT_TEMPLATE + FULL_BODY + "".join(FULL_TEMPLATE.values())
                 + " think action Observation Action")
    return envs.vocabulary(env_name, backend=backend, **env_options) + re.findall(r"\w+", templates)


def build_tiny_model(vocab_size, tok, seed):
    """A small Llama (hidden 128, 2 layers, 4 heads, FFN 512; 0.56M parameters with ALFWorld's words) from a
    config, no network. Hidden 128, not 64: it learns to act on the task's words far faster
    (results/diagnosis/README.md at 25efb16)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def saved_settings(model):
    """How a model saved by this script was trained (model/rspo.json: prompt, action mode, lr, the copy term's
    w), or {}: a saved tiny model passed back as --model DIR is run the way it learned."""
    path = os.path.join(os.path.expanduser(model), "rspo.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def load_pretrained(name, dtype, flag="--model"):
    """Any causal LM id or local directory (a GGUF file: convert it first, scripts/gguf_to_hf.py). A directory
    this script saved a tiny model into reloads its word-level tokenizer as it was saved. flag: named in
    errors."""
    if name.endswith(".gguf"):
        raise ConfigError(f"{flag} {name}: a GGUF file; convert it first: "
                          f"python scripts/gguf_to_hf.py {name} DIR")
    if name.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(name)):
        raise ConfigError(f"{flag} {name}: no such directory")
    # after HF_HUB_OFFLINE is set (read at import)
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    tokenizer = PreTrainedTokenizerFast if saved_settings(name).get("prompt") == "compact" else AutoTokenizer
    try:
        tok = tokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except (OSError, ValueError, ImportError) as e:
        if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false", "no", "off"):
            raise ConfigError(f"{flag} {name}: not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                              f"set; download it first (`hf download {name}`) or pass a local directory"
                              ) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{flag} {name}: cannot load: {first}") from None
    distinct_pad(model, tok)
    tok.padding_side = "left"
    return model, tok


def distinct_pad(model, tok):
    """Give the tokenizer a pad token that is no end-of-turn id (adding one when needed), so every end of turn
    stops a response and response masks never confuse padding with a real stop. Qwen2.5-Instruct pads with
    <|endoftext|>, which its generation_config also lists as an end of turn; many checkpoints pad with EOS."""
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
    Qwen2.5-Instruct's top_k 20, top_p 0.8, repetition_penalty 1.05, or a min_p): set it aside during the
    call, so only the fields Policy.generate sets apply."""
    from transformers import GenerationConfig
    saved, lm.generation_config = lm.generation_config, GenerationConfig()
    try:
        yield
    finally:
        lm.generation_config = saved


def cut_response(row, stop_ids):
    """A generated row up to and including its first stop id. A row without one ran to max_new_tokens,
    so all of it is real: generate pads only after a row has stopped, and never with a stop id."""
    for j, t in enumerate(row):
        if t in stop_ids:
            return row[:j + 1]
    return row


def copy_features(prompts, vocab):
    """[B, vocab]: log(1 + n_v), n_v the number of times token v occurs in each prompt (the input of
    --copy-term)."""
    counts = torch.zeros(len(prompts), vocab)
    for row, ids in zip(counts, prompts):
        row.index_add_(0, torch.tensor(ids, dtype=torch.long), torch.ones(len(ids)))
    return counts.log1p()


class CopyTerm:
    """generate's logits processor for --copy-term: the bias Agent.logits adds, added where the sampler draws
    (HF runs it before the temperature, as Policy.head divides after it: sampler = learner)."""

    def __init__(self, bias):
        self.bias = bias

    def __call__(self, input_ids, scores):
        return scores + self.bias.to(scores.device)


class SampledLogProbs:
    """generate's last logits processor: records log pi(token) of every sampled token under the distribution
    the sampler draws from (the processed scores / T: after the constraint and the copy term, as Policy.head),
    so the update needs no scoring pass for the policy's own steps. At each call it reads the token chosen at
    the previous call (the last input id) from that call's log-softmax; result() adds the last one."""

    def __init__(self, temperature):
        self.temperature, self.last, self.logps = temperature, None, []

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.logps.append(self.last.gather(1, input_ids[:, -1:]))
        self.last = torch.log_softmax(scores.float() / self.temperature, -1)
        return scores

    def result(self, new_tokens):
        """[B, new tokens]: the log-probs of the generated tokens (rows that stopped early hold their
        padding's)."""
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
        """The output layer on chosen positions' hidden states [B, R, H] (check_logits_path: the model's own
        logits), plus with --copy-term the pointer-style copy term w * copy_features [B, vocab] (See et al.,
        2017): a token the prompt holds (a product's name, an option's value) is easier to say."""
        logits = self.lm.get_output_embeddings()(hidden)
        return logits if copy is None else logits + self.copy_weight * copy.unsqueeze(1)

    def copy_bias(self, prompts):
        """copy_features of these prompts, or None without --copy-term."""
        if self.copy_weight is None:
            return None
        vocab = self.lm.get_output_embeddings().out_features
        return copy_features(prompts, vocab).to(self.copy_weight.device)


def check_logits_path(agent, name):
    """The update computes logits as the output layer on the final hidden state, at response positions only
    (full-vocabulary logits at every prompt token would not fit in memory). Refuse a model whose forward does
    more than that (e.g. Gemma-2's logit soft-capping), whose sampled and learned distributions would differ.
    """
    ids = torch.arange(min(8, agent.lm.config.vocab_size), device=agent.lm.device).unsqueeze(0)
    with torch.no_grad():
        own = agent.lm(input_ids=ids, use_cache=False).logits.float()
        ours = agent.logits(agent.hidden(ids, torch.ones_like(ids))).float()
    if not torch.allclose(own, ours, rtol=1e-4, atol=1e-4):
        raise ConfigError(f"--model {name}: its logits are not its output layer applied to the last hidden "
                          "state (e.g. Gemma-2's soft-capping), which is how rspo.py scores responses")


HEAD_CHUNK_ELEMENTS = 2 ** 25   # full-vocabulary values per chunk of Policy.head: 128 MiB per float32 copy


class Policy:
    """Tokenizer + Agent + decoding. Knows how to render prompts and turn states into actions."""

    def __init__(self, agent, tok, cfg, device):
        self.agent, self.tok, self.cfg, self.device = agent, tok, cfg, device
        self.compact = cfg.prompt == "compact"
        self.constrained = cfg.action_mode == "constrained"
        self.amp_dtype = autocast_dtype(cfg.dtype, device)
        self.stop_ids = stop_token_ids(tok, agent.lm.generation_config)
        # Plain ints: the tokenizer's eos_token_id/pad_token_id are properties that look the token up on every
        # read, and the tries read them once per admissible action, at every step.
        self.eos_id, self.pad_id = tok.eos_token_id, tok.pad_token_id
        if self.pad_id in self.stop_ids:
            raise ValueError("the pad token is an end-of-turn id: give the tokenizer a distinct one "
                             "(distinct_pad)")
        self._action_ids = {}

    def autocast(self):
        """bf16 autocast over the float32 weights when mixed precision is on, a no-op otherwise."""
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

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

    def allowed_tokens(self, trie, response_ids):
        """The allowed next-token set at every position of a response (the constraint, replayed)."""
        out, node = [], trie
        for t in response_ids:
            out.append(list(node.keys()))
            node = node[t]
        return out

    @torch.no_grad()
    def act(self, prompts, admissibles, temperature):
        """Sample one response per prompt. Returns [(response_ids, action, invalid, logp)] in prompt order;
        logp: the sampler's log-probs of response_ids (None when greedy). generate runs on length-sorted
        chunks of --generation-batch-size prompts, which bounds the KV cache and the padding."""
        results = [None] * len(prompts)
        for idx in length_sorted_chunks(range(len(prompts)), [len(p) for p in prompts],
                                        self.cfg.generation_batch_size):
            chunk = self.generate([prompts[i] for i in idx], [admissibles[i] for i in idx], temperature)
            for i, r in zip(idx, chunk):
                results[i] = r
        return results

    def generate(self, prompts, admissibles, temperature):
        """One batched, left-padded generate call (see act)."""
        from transformers import GenerationConfig, LogitsProcessorList
        self.agent.eval()
        enc = self.tok.pad({"input_ids": prompts}, return_tensors="pt").to(self.device)
        greedy = temperature == 0
        tries = [self.trie(a) for a in admissibles] if self.constrained else None
        width = enc.input_ids.shape[1]

        def allowed(b, ids):
            node = tries[b]
            for t in ids[width:].tolist():
                node = node.get(t) if isinstance(node, dict) else None
                if node is None:
                    return [self.eos_id]
            return list(node.keys()) if isinstance(node, dict) else [self.pad_id]

        max_new = (max(len(self.action_ids(a)) for adm in admissibles for a in adm) + 1
                   if self.constrained else self.cfg.max_new_tokens)
        # Sampler = learner: only the temperature shapes the sampled distribution, the one the update's
        # log-probs assume. Every sampling field is set to its neutral value, and the checkpoint's own
        # defaults are set aside (without_checkpoint_sampling). Every end-of-turn id stops; padding uses the
        # distinct pad.
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
            logp = None if greedy else logps[b, :len(resp)]
            if self.constrained:
                node = tries[b]
                for t in resp:
                    node = node[t]
                results.append((resp, node, False, logp))
            else:
                action, valid = parse_action(self.tok.decode(resp, skip_special_tokens=True))
                results.append((resp, action, not valid, logp))
        return results

    def batch(self, steps):
        """Right-padded prompt+response tensors, response positions, and the constraint mask. Built from
        padded Python lists, each tensor in one call (per-row tensor writes dominated small updates)."""
        seqs = [s.prompt_ids + s.response_ids for s in steps]
        L = max(map(len, seqs))
        R = max(len(s.response_ids) for s in steps)
        ids = torch.tensor([seq + [self.pad_id] * (L - len(seq)) for seq in seqs])
        attn = torch.tensor([[1] * len(seq) + [0] * (L - len(seq)) for seq in seqs])
        # pos[i, j]: the position predicting response token j; padding points anywhere valid (the mask drops
        # it)
        pos = torch.tensor([[len(s.prompt_ids) - 1 + (j if j < len(s.response_ids) else 0) for j in range(R)]
                            for s in steps])
        tgt = torch.tensor([s.response_ids + [0] * (R - len(s.response_ids)) for s in steps])
        mask = torch.tensor([[1.0] * len(s.response_ids) + [0.0] * (R - len(s.response_ids)) for s in steps])
        allowed = self.allowed_mask(steps, R) if self.constrained else None
        d = self.device
        allowed = None if allowed is None else allowed.to(d)
        return ids.to(d), attn.to(d), pos.to(d), tgt.to(d), mask.to(d), allowed

    def allowed_mask(self, steps, R):
        """[B, R, vocab] bool: the tokens the constraint allowed at each response position (anything at
        padding, so no row is all -inf, which would give NaN), set with one indexed write."""
        vocab = self.agent.lm.get_output_embeddings().out_features   # may exceed len(tok) (padded vocab)
        allowed = (torch.arange(R) >= torch.tensor([len(s.response_ids) for s in steps]).unsqueeze(1))
        allowed = allowed.unsqueeze(-1).repeat(1, 1, vocab)
        rows, cols, toks = [], [], []
        for i, s in enumerate(steps):
            for j, options in enumerate(self.allowed_tokens(self.trie(s.admissible), s.response_ids)):
                rows += [i] * len(options)
                cols += [j] * len(options)
                toks += options
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
        logp, entropy = [], []
        chunks = self.head_chunks(*tgt.shape)
        # With gradients and several chunks, keep only each chunk's hidden states for backward and recompute
        # its full-vocabulary tensors there, one chunk at a time, instead of holding every chunk's until
        # backward.
        # One chunk (a tiny model, short responses) gains nothing from the recomputation.
        recompute = torch.is_grad_enabled() and len(chunks) > 1
        for rows in chunks:
            args = (h_resp[rows], tgt[rows], None if allowed is None else allowed[rows],
                    None if copy is None else copy[rows], temperature, with_entropy)
            lp, ent = (torch.utils.checkpoint.checkpoint(self.head, *args, use_reentrant=False) if recompute
                       else self.head(*args))
            logp.append(lp)
            entropy.append(ent)
        logp = torch.cat(logp) * mask
        entropy = torch.cat(entropy) if with_entropy else None
        values = self.agent.value_head(h_resp[:, 0].float()).squeeze(-1)  # h at the last prompt token
        return logp, mask, entropy, values

    def head_chunks(self, batch, length):
        """Row slices of the batch whose [rows, length, vocab] float32 tensors hold at most
        HEAD_CHUNK_ELEMENTS (a real model's 49k-152k vocabulary makes these the largest tensors of an update;
        a tiny run has one)."""
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


# ----------------------------------------------------------------------------------------------
# Where the policy runs: the device, mixed precision, building and saving it


def mps_available():
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def pick_device(name):
    """--device: auto picks cuda -> mps -> cpu; a named device must exist here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name}: not a device (auto, cpu, cuda, cuda:1, mps)") from None
    cuda = torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    present = {"cpu": True, "cuda": cuda, "mps": mps_available()}
    if not present.get(device.type, False):
        raise ConfigError(f"--device {name}: no such device on this machine")
    return device


def autocast_dtype(name, device):
    """--dtype auto on CUDA with bf16: compute in bf16 over float32 weights (mixed precision, as verl's
    FSDP does); pure bf16 weights would round lr-1e-6 Adam steps away. None: no autocast."""
    if name == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


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
    """The policy A, with the value head saved next to --model DIR when there is one. pretrained: an already
    loaded (model, tokenizer) to use instead of loading --model (tests load a real model once and train
    copies)."""
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
    return Policy(agent, tok, cfg, device)


def save_model(policy, cfg, path):
    """save_pretrained with the tokenizer, the value head and rspo.json (the prompt, action mode and lr it
    learned with, and its copy term's w, so --model PATH runs it the same way). Written beside `path`, then
    renamed into place."""
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
