"""The combinator: weighted loss terms plus the per-step batch preparation they need.

`Objective` is what the train step calls. It is built from the config by registered
names (`build_objective`), or by hand from any terms:

    objective = Objective(terms=(("ppo_clip", 1.0, ppo_clip_loss),
                                 ("my_term", 0.1, my_term)))

Metrics come back as "<term>/<metric>" and "<term>/loss".
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp

from fnrl.losses.aggregation import AGGREGATIONS, with_weights
from fnrl.losses.core import LOSS_TERMS, Batch, LossFn, Metrics, advantages_BxT, needs_of
from fnrl.losses.correction import correct
from fnrl.losses.kl import kl_reward_advantages
from fnrl.losses.value import with_gae


@dataclasses.dataclass(frozen=True, kw_only=True)
class Objective:
    """A weighted sum of loss terms and how to prepare each step's batch for them.

    terms: (name, weight, term) triples; term(logp_BxT, batch) -> (loss, metrics).
    aggregation / norm_len: the token weighting (see fnrl.losses.aggregation).
    correction, tis_cap, mask_low, mask_high: train/inference mismatch correction.
    kl_reward_coef, kl_estimator: KL to the reference put in the reward (0 = off).
    gae: (γ, λ) to take per-token advantages by GAE from the critic's values (the batch's
        `values_BxT`, set by the train step) instead of the batch's; None = off.
    """

    terms: tuple[tuple[str, float, LossFn], ...]
    aggregation: str = "token_mean"
    norm_len: int = 0
    correction: str = "none"
    tis_cap: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 2.0
    kl_reward_coef: float = 0.0
    kl_estimator: str = "k3"
    gae: tuple[float, float] | None = None
    prefix_metrics: bool = True

    def __post_init__(self):
        if not self.terms:
            raise ValueError("an Objective needs at least one term")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; known: {sorted(AGGREGATIONS)}")

    @property
    def needs(self) -> frozenset[str]:
        """Batch keys the trainer must compute: entropy_BxT, ref_logp_BxT."""
        keys = {k for _, _, fn in self.terms for k in needs_of(fn)}
        if self.kl_reward_coef > 0:
            keys.add("ref_logp_BxT")
        if self.gae is not None:
            keys.add("values_BxT")
        return frozenset(keys)

    def weigh(self, batch: Batch) -> dict:
        """Sets the aggregation weights from the whole batch, before micro-batching."""
        return with_weights(batch, self.aggregation, self.norm_len)

    def prepare(self, logp_BxT: jnp.ndarray, batch: Batch) -> tuple[dict, Metrics]:
        """Per-micro-batch preparation from the model's log-probs (and the critic's values):
        correction, GAE, KL reward."""
        old = jax.lax.stop_gradient(logp_BxT)
        batch, metrics = correct(old, batch, kind=self.correction, tis_cap=self.tis_cap,
                                 mask_low=self.mask_low, mask_high=self.mask_high)
        metrics = {f"correction/{k}": v for k, v in metrics.items()}
        if self.gae is not None:
            batch, gae_metrics = with_gae(batch, batch["values_BxT"], gamma=self.gae[0],
                                          lam=self.gae[1])
            metrics.update({f"gae/{k}": v for k, v in gae_metrics.items()})
        if self.kl_reward_coef > 0:
            batch["adv_BxT"] = kl_reward_advantages(
                jnp.broadcast_to(advantages_BxT(batch), logp_BxT.shape), old, batch,
                coef=self.kl_reward_coef, estimator=self.kl_estimator)
        return batch, metrics

    def __call__(self, logp_BxT: jnp.ndarray, batch: Batch) -> tuple[jnp.ndarray, Metrics]:
        """Σ weight·term(logp_BxT, batch), and every term's metrics."""
        total = jnp.zeros((), jnp.float32)
        metrics: Metrics = {}
        for name, weight, fn in self.terms:
            loss, term_metrics = fn(logp_BxT, batch)
            total = total + weight * loss
            if self.prefix_metrics:
                metrics[f"{name}/loss"] = loss
                metrics.update({f"{name}/{k}": v for k, v in term_metrics.items()})
            else:
                metrics.update(term_metrics)
        return total, metrics


def as_objective(loss_fn: Objective | LossFn) -> Objective:
    """A bare term (the old `loss_fn=` API) is an Objective of one, metrics unprefixed."""
    if isinstance(loss_fn, Objective):
        return loss_fn
    return Objective(terms=(("loss", 1.0, loss_fn),), prefix_metrics=False)


def bind_term(name: str, hyperparameters: Any) -> LossFn:
    """The registered term `name` with its keyword-only hyperparameters filled in.

    Each keyword-only parameter is read from `hyperparameters` (the AlgoConfig) by
    its own name, so a new term's knob is a config field of the same name.
    """
    if name not in LOSS_TERMS:
        raise ValueError(f"unknown loss term {name!r}; registered: {sorted(LOSS_TERMS)}")
    fn = LOSS_TERMS[name]
    params = inspect.signature(fn).parameters.values()
    kwargs = {p.name: getattr(hyperparameters, p.name) for p in params
              if p.kind is p.KEYWORD_ONLY and hasattr(hyperparameters, p.name)}
    return functools.update_wrapper(functools.partial(fn, **kwargs), fn) if kwargs else fn


def build_objective(algo: Any) -> Objective:
    """The Objective an AlgoConfig describes: its loss_terms, then KL and entropy.

    KL is a term (weight kl_coef) when kl_in == "loss", or shapes the advantages
    when kl_in == "reward"; a zero coefficient adds nothing, so no reference forward
    pass is run.
    """
    terms = [(name, float(w), bind_term(name, algo)) for name, w in algo.loss_terms]
    if algo.kl_coef > 0 and algo.kl_in == "loss":
        terms.append(("kl", algo.kl_coef, bind_term("kl", algo)))
    if algo.entropy_coef > 0:
        terms.append(("entropy", algo.entropy_coef, bind_term("entropy", algo)))
    return Objective(
        terms=tuple(terms), aggregation=algo.aggregation,
        norm_len=algo.aggregation_norm_len or algo.max_new_tokens,
        correction=algo.correction, tis_cap=algo.tis_cap, mask_low=algo.mask_low,
        mask_high=algo.mask_high,
        kl_reward_coef=algo.kl_coef if algo.kl_in == "reward" else 0.0,
        kl_estimator=algo.kl_estimator,
        gae=(algo.gae_gamma, algo.gae_lambda) if algo.uses_critic else None)


def combine(*terms: tuple[str, float, Callable]) -> Objective:
    """Shorthand: combine(("ppo_clip", 1.0, fn), ...) with default preparation."""
    return Objective(terms=tuple(terms))
