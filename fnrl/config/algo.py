"""Configuration of the RL algorithm: loss terms, advantages, corrections, AdamW."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fnrl.config.base import check, finite, positive

# The registered names of fnrl.losses (config may not import the registries, which
# pull in JAX; tests/test_config.py keeps each tuple equal to its registry's keys).
LOSS_TERM_NAMES = ("ppo_clip", "grpo", "aipo", "decoupled_ppo", "gspo", "cispo", "sapo", "gmpo",
                   "gpg", "clip_cov", "kl_cov", "kl", "entropy", "value", "router_balance")
POLICY_TERM_NAMES = tuple(t for t in LOSS_TERM_NAMES
                          if t not in ("kl", "entropy", "value", "router_balance"))
"""The terms of the policy-gradient family: each reads the new log-probs against the
behaviour's and an advantage (the others regularise: a reference's KL, entropy, a
critic's value loss, a mixture of experts' router balance)."""
ADVANTAGE_NAMES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gpg", "opo", "passk", "gae")
AGGREGATION_NAMES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")
CORRECTION_NAMES = ("none", "token_tis", "seq_tis", "token_mask", "seq_mask")
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")
LR_SCHEDULE_NAMES = ("constant", "cosine", "linear")

# Names registered at run time on top of the built-in ones (a user's own loss term or
# advantage estimator: fnrl.losses.register calls `accept_name`).
_REGISTERED: dict[str, set[str]] = {"loss_terms": set(), "advantage": set()}


def accept_name(field: str, name: str) -> None:
    """Lets `AlgoConfig.<field>` ("loss_terms" or "advantage") name `name`."""
    _REGISTERED[field].add(name)


def known_names(field: str) -> tuple[str, ...]:
    """The names `AlgoConfig.<field>` accepts: built-in, then registered at run time."""
    builtin = {"loss_terms": LOSS_TERM_NAMES, "advantage": ADVANTAGE_NAMES}[field]
    return builtin + tuple(sorted(_REGISTERED[field] - set(builtin)))


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    """The RL algorithm: loss terms by registered name, advantages, corrections, AdamW.

    The default is GRPO with clip-higher (DAPO) and token-mean aggregation. Every
    keyword-only hyperparameter of a loss term is read from the field of the same
    name (fnrl.losses.objective.bind_term).
    """

    group_size: int = 8
    groups_per_step: int = 8
    max_new_tokens: int = 352          # the default task's longest worked solution + EOS
    # Sampling. vLLM returns the log-probs of the distribution it sampled from (after
    # temperature, top_k and top_p), and the trainer's π is softmax(logits / temperature).
    # Unless a flag sets them, the model's generation_config.json values apply
    # (`sampling_defaults`); the run's config.json holds the values used.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                     # -1: off
    learning_rate: float = 1e-4
    # The rate's schedule (fnrl.trainer.step.lr_schedule): a linear warmup from 0 over
    # lr_warmup_steps, then constant, or a cosine / linear decay to
    # lr_end_ratio × learning_rate at the run's last step (RunConfig.steps).
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    lr_end_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # Loss: (registered term name, weight) pairs (fnrl.losses.LOSS_TERMS); on the
    # command line `--algo.loss-terms aipo 1.0 gspo 0.5`.
    loss_terms: tuple[tuple[str, float], ...] = (("ppo_clip", 1.0),)
    aggregation: str = "token_mean"
    aggregation_norm_len: int = 0       # Dr.GRPO's constant; 0 -> max_new_tokens
    advantage: str = "grpo"
    adv_eps: float = 1e-6
    pass_k: int = 4                     # the `passk` advantage's k
    # PPO / decoupled PPO / dual clip. Safe by default (issue 15): for A < 0 a stale
    # token's loss is at most dual_clip_c·|A| (0 = off, the e^20·|A| case), and decoupled
    # PPO drops tokens with π_prox/μ above behaviour_cap (0 = off). docs/losses.md.
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip_c: float = 3.0            # 0 = off; else > 1 (Ye et al. 2020; verl's 3)
    behaviour_cap: float = 5.0          # decoupled PPO: drop tokens with π_prox/μ > cap; 0 = off
    # AIPO: one-sided truncation of π/μ at ρ (LlamaRL recommends 2..10).
    aipo_rho: float = 4.0
    # GSPO's sequence-ratio clip range.
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4
    # CISPO's weight clip(r, 1 - low, 1 + high); low = 1: no lower bound (the paper's).
    cispo_clip_low: float = 1.0
    cispo_clip_high: float = 3.0
    # SAPO's gate temperatures for A > 0 and A < 0 (the paper's 1.0 and 1.05).
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    # GMPO's clip range in log space (the paper's e^±0.4).
    gmpo_clip_low: float = 0.4
    gmpo_clip_high: float = 0.4
    # Clip-Cov / KL-Cov: the fraction of tokens restrained, Clip-Cov's covariance band,
    # KL-Cov's penalty coefficient (arXiv 2505.22617's defaults; kl_cov_ratio its 7B one).
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3
    kl_cov_coef: float = 1.0
    # Train/inference mismatch correction (fnrl.losses.correction).
    correction: str = "none"
    tis_cap: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 2.0
    # KL to the frozen initial model; 0 -> no reference forward pass.
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in: str = "loss"                 # "loss" (a term) or "reward" (shapes advantages)
    entropy_coef: float = 0.0
    # PPO with a critic (fnrl.losses.value): advantage "gae" with the "value" loss term.
    gae_gamma: float = 1.0
    gae_lambda: float = 0.95
    value_clip: float = 0.2             # 0 = off
    critic_lr: float = 1e-3             # the value head's AdamW rate (its own optimizer)
    value_trunk_grad: bool = False      # True: the value loss also trains the shared trunk
    # DAPO: drop zero-variance groups; soft overlong punishment over the last tokens.
    dynamic_sampling: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self):
        name = "AlgoConfig"
        positive(self, "group_size", "groups_per_step", "max_new_tokens", "learning_rate",
                 "max_grad_norm", "aipo_rho", "gspo_clip_low", "gspo_clip_high", "tis_cap")
        check(self.group_size >= 2, name, "group_size", self.group_size,
              "GRPO needs at least 2 samples per group")
        check(self.lr_schedule in LR_SCHEDULE_NAMES, name, "lr_schedule", self.lr_schedule,
              f"must be one of {LR_SCHEDULE_NAMES}")
        check(self.lr_warmup_steps >= 0, name, "lr_warmup_steps", self.lr_warmup_steps,
              "must be >= 0")
        check(0 <= self.lr_end_ratio <= 1, name, "lr_end_ratio", self.lr_end_ratio,
              "must be in [0, 1]")
        check(0 < self.clip_low < 1, name, "clip_low", self.clip_low, "must be in (0, 1)")
        check(self.clip_high > 0, name, "clip_high", self.clip_high, "must be > 0")
        check(self.temperature > 0, name, "temperature", self.temperature, "must be > 0")
        check(0 < self.top_p <= 1, name, "top_p", self.top_p, "must be in (0, 1]")
        check(self.top_k == -1 or self.top_k >= 1, name, "top_k", self.top_k,
              "must be -1 (off) or >= 1")
        # JSON gives lists back; keep one hashable canonical form.
        object.__setattr__(self, "loss_terms", tuple((str(t), float(w)) for t, w in self.loss_terms))
        check(len(self.loss_terms) > 0, name, "loss_terms", self.loss_terms,
              "must name at least one registered term with a weight")
        check(len({t for t, _ in self.loss_terms}) == len(self.loss_terms), name, "loss_terms",
              self.loss_terms, "a term is named twice")
        terms = known_names("loss_terms")
        for term, weight in self.loss_terms:
            check(term in terms, name, "loss_terms", term,
                  f"not a registered loss term; known: {terms}")
            check(term not in ("kl", "entropy"), name, "loss_terms", term,
                  "set kl_coef / entropy_coef instead")
            check(finite(weight), name, f"loss_terms[{term!r}]", weight, "must be finite")
        check(self.aggregation in AGGREGATION_NAMES, name, "aggregation", self.aggregation,
              f"must be one of {AGGREGATION_NAMES}")
        check(self.aggregation_norm_len >= 0, name, "aggregation_norm_len",
              self.aggregation_norm_len, "must be >= 0")
        check(self.advantage in known_names("advantage"), name, "advantage", self.advantage,
              f"must be one of {known_names('advantage')}")
        check(self.dual_clip_c == 0 or self.dual_clip_c > 1, name, "dual_clip_c",
              self.dual_clip_c, "must be 0 (off) or > 1")
        check(self.behaviour_cap == 0 or self.behaviour_cap > 1, name, "behaviour_cap",
              self.behaviour_cap, "must be 0 (off) or > 1")
        positive(self, "pass_k", "cispo_clip_high", "sapo_tau_pos", "sapo_tau_neg",
                 "gmpo_clip_low", "gmpo_clip_high", "kl_cov_coef")
        check(0 < self.cispo_clip_low <= 1, name, "cispo_clip_low", self.cispo_clip_low,
              "must be in (0, 1] (1: no lower bound)")
        for field in ("clip_cov_ratio", "kl_cov_ratio"):
            check(0 < getattr(self, field) <= 1, name, field, getattr(self, field),
                  "must be in (0, 1]")
        check(self.clip_cov_lb < self.clip_cov_ub, name, "clip_cov_lb..clip_cov_ub",
              (self.clip_cov_lb, self.clip_cov_ub), "need clip_cov_lb < clip_cov_ub")
        check(self.correction in CORRECTION_NAMES, name, "correction", self.correction,
              f"must be one of {CORRECTION_NAMES}")
        check(self.tis_cap >= 1, name, "tis_cap", self.tis_cap, "must be >= 1")
        check(0 <= self.mask_low < 1 < self.mask_high, name, "mask_low..mask_high",
              (self.mask_low, self.mask_high), "need 0 <= mask_low < 1 < mask_high")
        check(finite(self.kl_coef) and self.kl_coef >= 0, name, "kl_coef", self.kl_coef,
              "must be >= 0")
        check(self.kl_estimator in KL_ESTIMATOR_NAMES, name, "kl_estimator", self.kl_estimator,
              f"must be one of {KL_ESTIMATOR_NAMES}")
        check(self.kl_in in ("loss", "reward"), name, "kl_in", self.kl_in,
              "must be 'loss' or 'reward'")
        check(finite(self.entropy_coef) and self.entropy_coef >= 0, name, "entropy_coef",
              self.entropy_coef, "must be >= 0")
        check(self.overlong_buffer >= 0, name, "overlong_buffer", self.overlong_buffer,
              "must be >= 0")
        check(self.overlong_buffer < self.max_new_tokens or self.overlong_buffer == 0, name,
              "overlong_buffer", self.overlong_buffer, "must be < max_new_tokens")
        check(self.overlong_penalty >= 0, name, "overlong_penalty", self.overlong_penalty,
              "must be >= 0")
        check(0 < self.gae_gamma <= 1, name, "gae_gamma", self.gae_gamma, "must be in (0, 1]")
        check(0 <= self.gae_lambda <= 1, name, "gae_lambda", self.gae_lambda, "must be in [0, 1]")
        check(finite(self.value_clip) and self.value_clip >= 0, name, "value_clip",
              self.value_clip, "must be >= 0 (0 = off)")
        positive(self, "critic_lr")
        has_value = any(t == "value" for t, _ in self.loss_terms)
        check(has_value == (self.advantage == "gae"), name, "advantage/loss_terms",
              (self.advantage, self.loss_terms),
              "PPO with a critic needs both advantage='gae' and a 'value' loss term "
              "(the critic is trained only by the value term, and read only by GAE)")
        check(not (self.uses_critic and self.kl_coef > 0 and self.kl_in == "reward"), name,
              "kl_in", self.kl_in, "KL in the reward is not supported with GAE; use kl_in='loss'")

    @property
    def uses_critic(self) -> bool:
        """Whether the trainer holds a value head (PPO with GAE: fnrl.losses.value)."""
        return self.advantage == "gae"

    @property
    def needs_reference(self) -> bool:
        """Whether the trainer must hold the frozen initial model."""
        return self.kl_coef > 0


SAMPLING_FIELDS = ("temperature", "top_p", "top_k")


def sampling_defaults(generation_config: Mapping) -> dict[str, float | int]:
    """The AlgoConfig sampling fields a model's generation_config.json sets, as keyword
    arguments (`dataclasses.replace(algo, **...)`); HF's top_k=0 (off) becomes -1.
    `do_sample`, penalties and max lengths are not taken: RL samples always, a penalty
    would make vLLM's behaviour policy one the trainer cannot compute, and lengths are
    the run's own (algo.max_new_tokens)."""
    out: dict[str, float | int] = {}
    for key in SAMPLING_FIELDS:
        value = generation_config.get(key)
        if value is None:
            continue
        out[key] = (int(value) if int(value) > 0 else -1) if key == "top_k" else float(value)
    return out
