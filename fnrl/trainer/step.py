"""TrainState and the pure, jitted policy-gradient train step.

The model is a Flax NNX module used only as a definition: `graphdef` is static and
`params` is a plain nested dict of arrays, so optax, Orbax and `jax.jit` all see one
ordinary pytree.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fnrl.config import AlgoConfig
from fnrl.losses.correction import mismatch_metrics
from fnrl.losses.objective import Objective, as_objective, build_objective
from fnrl.models.lora import delta_change_norm, join
from fnrl.trainer.logprobs import (is_moe, model_logprobs, model_logprobs_and_router_stats,
                                   model_logprobs_and_values, value_head_init)

Params = Any


@flax.struct.dataclass
class CriticState:
    """PPO's value head on the policy's trunk (fnrl.losses.value) and its own AdamW."""
    params: Params
    opt_state: optax.OptState


@flax.struct.dataclass
class TrainState:
    step: jnp.ndarray          # number of optimizer updates applied = the policy version
    params: Params
    opt_state: optax.OptState
    critic: CriticState | None = None   # only when the algorithm uses a critic (GAE)


def lr_schedule(algo: AlgoConfig, total_steps: int = 0) -> optax.Schedule:
    """The learning rate at each update (algo.lr_schedule): a linear warmup from 0 over
    `algo.lr_warmup_steps`, then constant, or a decay to `algo.lr_end_ratio` × the rate
    at update `total_steps` (the run's steps), which a decaying schedule needs."""
    peak, warmup = algo.learning_rate, algo.lr_warmup_steps
    if algo.lr_schedule != "constant" and total_steps <= warmup:
        raise ValueError(f"algo.lr_schedule={algo.lr_schedule!r} decays until the run's last "
                         f"step, which must come after algo.lr_warmup_steps={warmup} "
                         f"(steps={total_steps})")
    rise = optax.linear_schedule(0.0, peak, warmup) if warmup else optax.constant_schedule(peak)
    end = peak * algo.lr_end_ratio
    fall = {"constant": lambda: optax.constant_schedule(peak),
            "cosine": lambda: optax.cosine_decay_schedule(peak, total_steps - warmup,
                                                          alpha=algo.lr_end_ratio),
            "linear": lambda: optax.linear_schedule(peak, end, total_steps - warmup)
            }[algo.lr_schedule]()
    return optax.join_schedules([rise, fall], [warmup]) if warmup else fall


def make_optimizer(algo: AlgoConfig, total_steps: int = 0) -> optax.GradientTransformation:
    """AdamW with global-norm clipping at the rate of `lr_schedule(algo, total_steps)`;
    a non-finite gradient skips the update entirely."""
    # A constant rate stays a float: the optimizer state is the same as without schedules.
    rate = (algo.learning_rate if algo.lr_schedule == "constant" and not algo.lr_warmup_steps
            else lr_schedule(algo, total_steps))
    inner = optax.chain(
        optax.clip_by_global_norm(algo.max_grad_norm),
        optax.adamw(rate, b1=0.9, b2=0.999, weight_decay=algo.weight_decay),
    )
    # apply_if_finite leaves params and moments untouched when the gradients are NaN/Inf
    # (train_step also checks the loss, and keeps its counters unchanged too).
    return optax.apply_if_finite(inner, max_consecutive_errors=1_000_000)


def make_critic_optimizer(algo: AlgoConfig) -> optax.GradientTransformation:
    """The value head's own AdamW at `algo.critic_lr`, clipped like the policy's: a linear
    head on the trunk wants a far larger rate than the policy (the train step keeps the
    whole state, critic included, when a step is not finite)."""
    return optax.chain(optax.clip_by_global_norm(algo.max_grad_norm),
                       optax.adamw(algo.critic_lr, b1=0.9, b2=0.999, weight_decay=0.0))


def initial_critic(algo: AlgoConfig, hidden_size: int) -> CriticState | None:
    """The critic at version 0 when `algo` uses one (a zero value head), else None."""
    if not algo.uses_critic:
        return None
    params = value_head_init(hidden_size)
    return CriticState(params=params, opt_state=make_critic_optimizer(algo).init(params))


def init_state(params: Params, optimizer: optax.GradientTransformation,
               critic: CriticState | None = None) -> TrainState:
    """Step 0: the given params, fresh optimizer moments, and the critic if any."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params), critic=critic)


def state_shardings(optimizer: optax.GradientTransformation, params: Params,
                    param_sharding: Any, critic: CriticState | None = None) -> TrainState:
    """Shardings of the TrainState `init_state` builds, without allocating it: every
    optimizer leaf shaped like a parameter (Adam's moments) is placed like that
    parameter, everything else (counters, the critic's small head) replicated. `params`
    may be abstract."""
    abstract = jax.eval_shape(functools.partial(init_state, optimizer=optimizer), params)
    mesh = jax.tree.leaves(param_sharding)[0].mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_sharding = optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, abstract.opt_state, param_sharding,
        transform_non_params=lambda _: replicated)
    critic_sharding = None if critic is None else jax.tree.map(lambda _: replicated, critic)
    return TrainState(step=replicated, params=param_sharding, opt_state=opt_sharding,
                      critic=critic_sharding)


def init_sharded_state(params: Params, optimizer: optax.GradientTransformation,
                       sharding: TrainState, critic: CriticState | None = None) -> TrainState:
    """`init_state` under jit with `sharding` as out_shardings: the Adam moments are born
    sharded (never whole on one device), and the params are donated, not copied."""
    init = jax.jit(lambda p, c: init_state(p, optimizer, c), out_shardings=sharding,
                   donate_argnums=0)
    return init(params, critic)


def place_params(params: dict, sharding: Any, dtype=None) -> dict:
    """Host params (nested dict of numpy) onto devices, leaf by leaf, in `dtype` if given.

    Each host leaf is dropped from `params` once placed (the dict is emptied), so at
    most one leaf exists twice and the peak is about one copy of the model.
    """
    def place(node, shard):
        out = {}
        for key in list(node):
            leaf = node.pop(key)
            if isinstance(leaf, dict):
                out[key] = place(leaf, shard[key])
            else:
                out[key] = jax.device_put(leaf if dtype is None else leaf.astype(dtype), shard[key])
                del leaf
        return out
    return place(params, sharding)


def token_logprobs(graphdef: nnx.GraphDef, params: Params, input_BxT: jnp.ndarray,
                   target_BxT: jnp.ndarray, positions_BxT: jnp.ndarray | None = None,
                   segment_ids_BxT: jnp.ndarray | None = None,
                   routes_BxTxLxK: jnp.ndarray | None = None, *,
                   logprob_chunk: int = 0, temperature: float = 1.0, top_k: int = -1,
                   top_p: float = 1.0) -> jnp.ndarray:
    """log π(target_t | input_≤t) for every position, in float32 (chunked over the
    sequence when logprob_chunk > 0: fnrl.trainer.logprobs), π = softmax(logits / T);
    a mixture of experts replays `routes_BxTxLxK` when given."""
    return model_logprobs(graphdef, params, input_BxT, target_BxT, positions_BxT,
                          segment_ids_BxT, routes_BxTxLxK, chunk_tokens=logprob_chunk,
                          temperature=temperature, top_k=top_k, top_p=top_p)[0]


def _model_inputs(batch):
    return (batch["input_BxT"], batch["target_BxT"], batch.get("positions_BxT"),
            batch.get("segment_ids_BxT"), batch.get("routes_BxTxLxK"))


def split_micro_batches(batch: Mapping[str, jnp.ndarray], micro_batches: int) -> dict:
    """Every array B×... -> M×(B/M)×...; micro-batch m holds rows m, m+M, m+2M, ...

    Interleaving (not contiguous blocks) keeps each micro-batch spread over all
    data-parallel shards, so no micro-batch lives on a subset of devices.
    `fnrl.trainer.batching` lays out rows with the same rule.
    """
    def split(x):
        if x.shape[0] % micro_batches:
            raise ValueError(f"batch of {x.shape[0]} rows does not split into "
                             f"{micro_batches} micro-batches")
        return x.reshape(x.shape[0] // micro_batches, micro_batches, *x.shape[1:]).swapaxes(0, 1)
    return {k: split(v) for k, v in batch.items()}


def _merge_micro_batches(x_MxBxT: jnp.ndarray) -> jnp.ndarray:
    return x_MxBxT.swapaxes(0, 1).reshape(-1, *x_MxBxT.shape[2:])


def _is_summed(key: str) -> bool:
    # Loss values are partial sums of one global normalisation (aggregation weights);
    # every other metric is a token mean within its micro-batch.
    return key == "loss" or key.endswith("/loss")


def train_step(state: TrainState, batch: Mapping[str, jnp.ndarray], ref_params: Params = None,
               controls: Mapping[str, Any] | None = None, frozen: Params = None, *, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
               loss_fn: Objective | Callable, micro_batches: int = 1,
               micro_sharding: jax.sharding.NamedSharding | None = None,
               logprob_chunk: int = 0, temperature: float = 1.0, top_k: int = -1,
               top_p: float = 1.0, critic_optimizer: optax.GradientTransformation | None = None,
               value_trunk_grad: bool = False, lora_scaling: float = 0.0
               ) -> tuple[TrainState, dict]:
    """One policy-gradient update on one batch. Pure: jit it once, with donation.

    `loss_fn` is an Objective (fnrl.losses) or a bare term. The batch is split into
    `micro_batches` whose gradients are summed: aggregation weights come from the
    whole batch first, so the update equals the unsplit one. `ref_params` (the
    frozen initial model) is needed only when the objective uses KL. `logprob_chunk`
    > 0 computes log-probs and entropy `logprob_chunk` tokens at a time, never holding
    a micro-batch's B×T×V logits (fnrl.trainer.logprobs). π (and the reference) is
    softmax(logits / `temperature`) on the `top_k` / `top_p` support: vLLM's behaviour
    log-probs are those of the distribution it sampled from, truncated and renormalised.

    `controls` (the correctness gates, fnrl.trainer.controls): {"lr_scale": the update's
    multiplier, "max"/"min": {metric: bound}}. The update is kept only if every named
    metric is within its bounds; a refused update keeps params and optimizer state but
    still advances the step (`gate_refused` = 1): unlike a non-finite step, the version
    is published, so rollouts leave weights that produced bad data.

    An objective that reads `values_BxT` (PPO with GAE, fnrl.losses.value) trains the
    state's critic too: the value head's V comes from the same trunk pass as the
    log-probs, its gradient updates the head by `critic_optimizer` (and the trunk when
    `value_trunk_grad`), and it is kept or refused with the policy's update.

    `frozen`: with LoRA (fnrl.models.lora) the state's params are the adapters alone and
    this is the rest of the model, which gets no gradient. The KL reference is then the
    base itself (the adapters zeroed, B = 0): no second copy of the model, and
    `update_ratio` is ‖Δ(s·A·B)‖ / ‖base‖ (`lora_scaling` is s): how far the update moves
    the model, as without adapters, not the adapters' own relative change.
    """
    objective = as_objective(loss_fn)
    with_values = "values_BxT" in objective.needs
    if with_values and (state.critic is None or critic_optimizer is None):
        raise ValueError("the objective uses a critic's values (GAE) but the TrainState has "
                         "no critic or no critic optimizer was given")
    needs_ref = "ref_logp_BxT" in objective.needs
    # The model the forward pass runs: the trainable params, joined to the frozen base.
    whole = (lambda trainable: trainable) if frozen is None else (  # noqa: E731
        lambda trainable: join(trainable, frozen))
    if needs_ref and ref_params is None and frozen is not None:
        ref_params = whole(jax.tree.map(jnp.zeros_like, state.params))
    if needs_ref and ref_params is None:
        raise ValueError("the objective uses KL to a reference policy but ref_params is None")
    with_entropy = "entropy_BxT" in objective.needs
    # A mixture of experts: its router's statistics every step, its balance loss if the
    # objective has the term, and the routes the engine chose replayed when the batch
    # carries them (`routes_BxTxLxK`: every forward pass below, the reference's too).
    moe = is_moe(whole(state.params))
    if "router_aux_loss" in objective.needs and not moe:
        raise ValueError("the objective's router_balance term needs a mixture-of-experts "
                         "model; this one is dense")
    if moe and with_values:
        raise ValueError("a critic (GAE) on a mixture-of-experts model is not supported")
    batch_tokens = jnp.maximum(jnp.sum(batch["mask_BxT"]), 1.0)
    batch = objective.weigh(batch)

    def micro_step(mb):
        if needs_ref:
            mb = dict(mb, ref_logp_BxT=jax.lax.stop_gradient(token_logprobs(
                graphdef, ref_params, *_model_inputs(mb), logprob_chunk=logprob_chunk,
                temperature=temperature, top_k=top_k, top_p=top_p)))

        def loss_of(trainable):
            if with_values:
                params, head = trainable
                logp_BxT, entropy_BxT, values_BxT = model_logprobs_and_values(
                    graphdef, whole(params), head, *_model_inputs(mb)[:4], chunk_tokens=logprob_chunk,
                    with_entropy=with_entropy, temperature=temperature, top_k=top_k,
                    top_p=top_p,
                    trunk_grad=value_trunk_grad)
                inputs = dict(mb, values_BxT=values_BxT)
            else:
                logp_BxT, entropy_BxT, router = model_logprobs_and_router_stats(
                    graphdef, whole(trainable), *_model_inputs(mb), chunk_tokens=logprob_chunk,
                    with_entropy=with_entropy, temperature=temperature, top_k=top_k,
                    top_p=top_p, stats=moe)
                inputs = mb
            prepared, prep_metrics = objective.prepare(logp_BxT, inputs)
            if with_entropy:
                prepared["entropy_BxT"] = entropy_BxT
            if moe:   # the balance loss weighted by the micro-batch's share of the tokens
                prepared["router_aux_loss"] = router["aux_loss"] * (
                    jnp.sum(mb["mask_BxT"]) / batch_tokens)
                prep_metrics = {**prep_metrics, **{f"router/{k}": jax.lax.stop_gradient(v)
                                                   for k, v in router.items()}}
            loss, metrics = objective(logp_BxT, prepared)
            return loss, ({**metrics, **prep_metrics}, jax.lax.stop_gradient(logp_BxT))

        (loss, (metrics, logp_BxT)), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
        return grads, dict(metrics, loss=loss), logp_BxT

    trainable = (state.params, state.critic.params) if with_values else state.params

    if micro_batches == 1:
        grads, metrics, logp_BxT = micro_step(batch)
    else:
        stacked = split_micro_batches(batch, micro_batches)
        if micro_sharding is not None:
            stacked = jax.lax.with_sharding_constraint(stacked, micro_sharding)

        def accumulate(grads_acc, mb):
            grads, metrics, logp_BxT = micro_step(mb)
            return jax.tree.map(jnp.add, grads_acc, grads), (metrics, logp_BxT)

        zeros = jax.tree.map(jnp.zeros_like, trainable)
        grads, (metrics_M, logp_MxBxT) = jax.lax.scan(accumulate, zeros, stacked)
        tokens_M = jnp.sum(stacked["mask_BxT"], axis=(1, 2))
        share_M = tokens_M / jnp.maximum(jnp.sum(tokens_M), 1.0)
        metrics = {k: jnp.sum(v) if _is_summed(k) else jnp.sum(v * share_M)
                   for k, v in metrics_M.items()}
        logp_BxT = _merge_micro_batches(logp_MxBxT)

    loss = metrics["loss"]
    grads, critic_grads = grads if with_values else (grads, None)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    if with_values:
        critic_updates, critic_opt = critic_optimizer.update(
            critic_grads, state.critic.opt_state, state.critic.params)
    # Telemetry on the whole batch: trainer π (before the update) against vLLM's μ.
    metrics = dict(metrics, **mismatch_metrics(logp_BxT, batch), grad_norm=optax.tree.norm(grads))
    if with_values:
        metrics["critic/grad_norm"] = optax.tree.norm(critic_grads)
    gate_ok = jnp.bool_(True)
    if controls is not None:
        # Scaling AdamW's update scales its learning rate (weight decay included); the
        # moments are those of the unscaled run, as with a schedule. The critic's too.
        scale = lambda tree: jax.tree.map(  # noqa: E731
            lambda u: u * controls["lr_scale"].astype(u.dtype), tree)
        updates = scale(updates)
        if with_values:
            critic_updates = scale(critic_updates)
        gate_ok = _within_bounds(metrics, controls)
        if frozen is None:
            metrics["update_ratio"] = optax.tree.norm(updates) / jnp.maximum(
                optax.tree.norm(state.params), 1e-12)
        else:
            metrics["update_ratio"] = delta_change_norm(
                state.params, optax.apply_updates(state.params, updates), lora_scaling
            ) / jnp.maximum(optax.tree.norm(frozen), 1e-12)
        metrics["gate_refused"] = 1.0 - gate_ok.astype(jnp.float32)
    params = optax.apply_updates(state.params, updates)
    # A NaN or Inf anywhere makes the global norm non-finite: one reduction, already
    # made for the metric (and by the clipping), instead of one per parameter.
    finite = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
    if with_values:
        finite = finite & jnp.isfinite(metrics["critic/grad_norm"])
    # A skipped step keeps the whole state bit for bit. apply_if_finite alone would not:
    # it looks at the gradients only (not the loss) and counts the failure in its state.
    keep = functools.partial(jnp.where, finite & gate_ok)   # keep(new, old)
    critic = state.critic
    if with_values:
        critic = CriticState(
            params=jax.tree.map(keep, optax.apply_updates(critic.params, critic_updates),
                                critic.params),
            opt_state=jax.tree.map(keep, critic_opt, critic.opt_state))
    new_state = dataclasses.replace(
        state, step=state.step + finite.astype(jnp.int32),
        params=jax.tree.map(keep, params, state.params),
        opt_state=jax.tree.map(keep, opt_state, state.opt_state), critic=critic)
    metrics["update_skipped"] = 1.0 - finite.astype(jnp.float32)
    return new_state, metrics


def _gate_metric(metrics: Mapping[str, jnp.ndarray], key: str) -> jnp.ndarray | None:
    """`key`, or the one loss term's "<term>/<key>" (a clip fraction); None if absent."""
    if key in metrics:
        return metrics[key]
    found = [v for k, v in metrics.items() if k.endswith("/" + key)]
    return found[0] if len(found) == 1 else None


def _within_bounds(metrics: Mapping[str, jnp.ndarray], controls: Mapping[str, Any]) -> jnp.ndarray:
    """True when every metric the controls bound is within its bound (NaN is not).
    A metric this objective does not report is not bounded (fnrl.policy.gates reads it
    as absent too)."""
    ok = jnp.bool_(True)
    for side, within in (("max", jnp.less_equal), ("min", jnp.greater_equal)):
        for key, bound in controls[side].items():
            value = _gate_metric(metrics, key)
            if value is not None:
                ok = ok & within(value.astype(jnp.float32), bound)
    return ok


def _with_matmul_precision(fn: Callable, precision: str) -> Callable:
    """`fn` traced under jax.default_matmul_precision(precision): the context is read
    when jit traces, so it must be entered inside the jitted function."""
    def traced(*args, **kwargs):
        with jax.default_matmul_precision(precision):
            return fn(*args, **kwargs)
    # jit names the program (and its compilation-cache entry) after the function.
    traced.__name__ = traced.__qualname__ = getattr(fn, "func", fn).__name__
    return traced


def compile_train_step(graphdef, optimizer, algo: AlgoConfig, state_sharding, batch_sharding, *,
                       micro_batches: int = 1, ref_sharding=None, objective: Objective | None = None,
                       logprob_chunk: int = 0, matmul_precision: str | None = None,
                       frozen_sharding=None, lora_scaling: float = 0.0):
    """jax.jit of `train_step` for `algo`'s objective, with explicit shardings and donation.

    `matmul_precision` ("default", "high", "highest"; None or "auto": the platform's
    default, which is TF32 for float32 on recent GPUs) is set while the step is traced.

    The result is called as step(state, batch, ref_params[, controls[, frozen]]);
    ref_params is None unless the config uses KL without LoRA (then the frozen initial
    params, placed by `ref_sharding`); controls (replicated scalars) are the gates' (see
    `train_step`); frozen, placed by `frozen_sharding`, is the base under LoRA adapters.
    Log-probs are at `algo.temperature` on the `algo.top_k` / `algo.top_p` support: the
    distribution the rollouts sample from, whose log-probs vLLM reports.
    """
    objective = objective if objective is not None else build_objective(algo)
    micro_sharding = None
    if micro_batches > 1 and isinstance(batch_sharding, jax.sharding.NamedSharding):
        micro_sharding = jax.sharding.NamedSharding(
            batch_sharding.mesh, jax.sharding.PartitionSpec(None, *batch_sharding.spec))
    critic_optimizer = (make_critic_optimizer(algo) if "values_BxT" in objective.needs
                        else None)
    step = functools.partial(train_step, graphdef=graphdef, optimizer=optimizer, loss_fn=objective,
                             micro_batches=micro_batches, micro_sharding=micro_sharding,
                             logprob_chunk=logprob_chunk, temperature=algo.temperature,
                             top_k=algo.top_k, top_p=algo.top_p,
                             critic_optimizer=critic_optimizer,
                             value_trunk_grad=algo.value_trunk_grad, lora_scaling=lora_scaling)
    if matmul_precision not in (None, "auto"):
        step = _with_matmul_precision(step, matmul_precision)
    replicated = (jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
                  if isinstance(batch_sharding, jax.sharding.NamedSharding) else None)
    jitted = jax.jit(step, in_shardings=(state_sharding, batch_sharding, ref_sharding, replicated,
                                         frozen_sharding),
                     out_shardings=(state_sharding, None), donate_argnums=0)

    # jit wants one sharding per positional argument passed: callers without gates or
    # adapters pass three, so the optional arguments are filled in here.
    def call(state, batch, ref_params=None, controls=None, frozen=None):
        return jitted(state, batch, ref_params, controls, frozen)

    call.lower = lambda state, batch, ref_params=None, controls=None, frozen=None: jitted.lower(
        state, batch, ref_params, controls, frozen)
    return call


def sft_step(state: TrainState, batch: Mapping[str, jnp.ndarray], *, graphdef: nnx.GraphDef,
             optimizer: optax.GradientTransformation, logprob_chunk: int = 0
             ) -> tuple[TrainState, dict]:
    """Supervised next-token step on masked targets (the warm start)."""

    def objective(params):
        logp_BxT = token_logprobs(graphdef, params, batch["input_BxT"], batch["target_BxT"],
                                  logprob_chunk=logprob_chunk)
        mask = batch["mask_BxT"]
        return -jnp.sum(logp_BxT * mask) / jnp.maximum(mask.sum(), 1.0)

    loss, grads = jax.value_and_grad(objective)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state), {
        "loss": loss}


def pack_sequences(prompts: list[tuple[int, ...]], responses: list[tuple[int, ...]], seq_len: int,
                   pad_id: int) -> dict[str, np.ndarray]:
    """Right-padded next-token arrays: input/target of length seq_len and a response mask.

    Position t predicts target t = token t+1; the mask is 1 where the target is a
    response token, so per-token response arrays start at index len(prompt) - 1.
    """
    b = len(prompts)
    tokens = np.full((b, seq_len + 1), pad_id, np.int32)
    mask = np.zeros((b, seq_len), np.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n = len(p) + len(r)
        if n > seq_len + 1:
            raise ValueError(f"sequence {i} has {n} tokens; the step's length is {seq_len + 1}")
        tokens[i, :n] = p + r
        mask[i, len(p) - 1:n - 1] = 1.0
    return {"input_BxT": tokens[:, :-1], "target_BxT": tokens[:, 1:], "mask_BxT": mask}


def scatter_response(values: list[tuple[float, ...]], prompt_lens: list[int], seq_len: int,
                     dtype=np.float32) -> np.ndarray:
    """Places per-response-token values at the positions `pack_sequences` masks."""
    out = np.zeros((len(values), seq_len), dtype)
    for i, (v, plen) in enumerate(zip(values, prompt_lens)):
        out[i, plen - 1:plen - 1 + len(v)] = v
    return out
