"""Async HTTP client of one vLLM generation server started by `fnrl.serving.server`."""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import io
import json
import math
import re
from collections.abc import AsyncIterator, Sequence

import aiohttp
import numpy as np

from fnrl.shell import auth
from fnrl.types import Completion, Routes, ServerError, StreamChunk  # noqa: F401 - re-exported

# Knobs the trainer cannot reproduce pinned to "no change", so the behaviour policy is
# the temperature-scaled softmax truncated by top_k and top_p, nothing else.
_NEUTRAL_SAMPLING = {
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
METRICS = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")


class RolloutClient:
    """Talks to one server; the aiohttp session is the caller's to open and close.

    Every request carries the run's API key (`api_key`, by default derived from this
    process's run secret: fnrl.shell.auth), which a server bound beyond loopback
    requires (fnrl.serving.http_auth) and one on loopback ignores."""

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        *,
        timeout_s: float = 600.0,
        control_timeout_s: float = 60.0,
        api_key: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key or auth.api_key()}"}
        self.session = session
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self._model: str | None = None

    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        seed: int | None,
        stop_token_ids: Sequence[int] = (),
        request_id: str | None = None,
        top_p: float = 1.0,
        top_k: int = -1,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
    ) -> list[Completion]:
        """Sample `n` continuations of `prompt_ids`; `request_id` makes it abortable;
        `stop` strings end a continuation (a multi-turn evaluation's tool calls)."""
        body = await self._completion_body(prompt_ids, n=n, max_tokens=max_tokens,
                                           temperature=temperature, seed=seed,
                                           stop_token_ids=stop_token_ids, request_id=request_id,
                                           top_p=top_p, top_k=top_k, ignore_eos=ignore_eos,
                                           **_stops(stop))
        reply = await self._post("/v1/completions", body, self.timeout_s)
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise ServerError(f"server {self.base_url}: asked n={n}, got {len(choices)}")
        return [self._completion(c) for c in choices]

    async def _completion_body(self, prompt_ids: Sequence[int], *, n: int, max_tokens: int,
                               temperature: float, seed: int | None,
                               stop_token_ids: Sequence[int], request_id: str | None,
                               top_p: float = 1.0, top_k: int = -1, **extra) -> dict:
        """The /v1/completions request: token ids in, token ids and sampled log-probs out."""
        body = {
            "model": await self._model_name(),
            "prompt": [int(t) for t in prompt_ids],
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
            "stop_token_ids": [int(t) for t in stop_token_ids],
            # Only the sampled token's log-prob is needed; vLLM always includes it.
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "top_p": top_p,
            "top_k": top_k,
            **_NEUTRAL_SAMPLING,
            **extra,
        }
        if request_id is not None:
            body["request_id"] = request_id
        return body

    async def generate_stream(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        temperature: float,
        seed: int | None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        request_id: str | None = None,
        top_p: float = 1.0,
        top_k: int = -1,
        stop: Sequence[str] = (),
        routes_from: int | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """One continuation of `prompt_ids`, streamed as it is sampled (server-sent events).

        Closing the iterator (or cancelling the task that reads it) drops the
        connection, and vLLM aborts the request: that is how an interrupt stops a
        trajectory. Every chunk already yielded is the caller's to keep. `timeout_s`
        bounds the wait for each chunk, not the whole stream: a response of thousands of
        tokens takes as long as it takes, a server that stops answering fails.
        `stop`: strings that end the sample (a tool call's closing tag); the ids that
        made the string are streamed like any other.

        `routes_from` (rollout routing replay; the server started with
        `--enable-scale-out --enable-return-routed-experts`): the request goes to vLLM's
        token endpoint, `/inference/v1/generate`, the one whose stream reports routes
        (`/v1/completions` reports them only unstreamed), and its last chunk carries the
        engine's routes of every position of prompt + sample from `routes_from` on
        (`StreamChunk.routes`). A last chunk without them is a ServerError.
        """
        if routes_from is None:
            body = await self._completion_body(
                prompt_ids, n=1, max_tokens=max_tokens, temperature=temperature, seed=seed,
                stop_token_ids=stop_token_ids, request_id=request_id, top_p=top_p, top_k=top_k,
                ignore_eos=ignore_eos, stream=True, **_stops(stop))
            url, parse = self.base_url + "/v1/completions", self._stream_chunk
        else:
            body = self._generate_body(
                prompt_ids, max_tokens=max_tokens, temperature=temperature, seed=seed,
                stop_token_ids=stop_token_ids, request_id=request_id, top_p=top_p, top_k=top_k,
                ignore_eos=ignore_eos, routes_from=routes_from, **_stops(stop))
            url = self.base_url + "/inference/v1/generate"
            parse = functools.partial(self._generate_chunk, context=len(prompt_ids),
                                      routes_from=routes_from, generated=[0])
        for attempt in range(2):
            yielded = False
            try:
                idle = aiohttp.ClientTimeout(total=None, sock_connect=self.control_timeout_s,
                                             sock_read=self.timeout_s)
                async with self.session.post(url, json=body, timeout=idle,
                                             headers=self._headers) as response:
                    if response.status != 200:
                        payload = await response.text()
                        response.close()
                        raise ServerError(f"POST {url} -> {response.status}: {payload[:2000]}")
                    async for raw in response.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            return
                        yielded = True
                        yield parse(json.loads(data))
                    return
            except asyncio.TimeoutError:
                raise ServerError(f"POST {url}: no answer for {self.timeout_s:g} s") from None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                # A pooled keep-alive socket the server closed as we sent: nothing was
                # generated for us, so sending once more is safe.
                if yielded or attempt:
                    raise ServerError(f"POST {url} failed: {type(e).__name__}: {e}") from e
            except aiohttp.ClientError as e:
                raise ServerError(f"POST {url} failed: {type(e).__name__}: {e}") from e

    async def kv_capacity_tokens(self) -> int:
        """The server's KV cache size in tokens (from `vllm:cache_config_info`)."""
        text = await self._get_text("/metrics")
        for line in text.splitlines():
            if line.startswith("vllm:cache_config_info{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
                if labels.get("kv_cache_size_tokens", "None") != "None":
                    return int(float(labels["kv_cache_size_tokens"]))
                blocks, size = labels.get("num_gpu_blocks"), labels.get("block_size")
                if blocks not in (None, "None") and size not in (None, "None"):
                    return int(blocks) * int(size)
        raise ServerError(f"server {self.base_url}: /metrics has no KV cache size")

    async def pull(self, relay_address: str, *, relay_timeout_s: float = 30.0,
                   min_version: int = -1, version: int = -1) -> int:
        """Load the relay's latest weights in place (`version` >= 0: exactly that version);
        returns the version now served.

        The engine does not generate while the worker asks the relay and reloads.
        After a new version is loaded the prefix cache is reset, with running requests
        preempted and recomputed, so no later token reads KV computed by old weights.
        """
        before = await self.version()
        rpc = {
            "method": "fnrl_pull",
            "args": [relay_address],
            "kwargs": {"timeout_s": relay_timeout_s, "min_version": min_version,
                       "version": version},
        }
        timeout_s = self.control_timeout_s + relay_timeout_s
        results = (await self._post("/collective_rpc", rpc, timeout_s))["results"]
        version = _same_version(results, self.base_url)
        if version != before:
            reset = await self._post(
                "/reset_prefix_cache?reset_running_requests=true", None, self.control_timeout_s
            )
            if not reset.get("success"):
                raise ServerError(f"server {self.base_url}: prefix cache reset failed")
        return version

    async def version(self) -> int:
        """The weight version served; -1 for the checkpoint it started with."""
        rpc = {"method": "fnrl_version"}
        results = (await self._post("/collective_rpc", rpc, self.control_timeout_s))["results"]
        return _same_version(results, self.base_url)

    async def metrics(self) -> dict[str, float]:
        """Load gauges from `/metrics`: KV-cache usage (0..1), running, waiting."""
        text = await self._get_text("/metrics")
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in METRICS:
                # Summed over label sets (one per model / engine).
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        missing = [m for m in METRICS if m not in values]
        if missing:
            raise ServerError(f"server {self.base_url}: /metrics lacks {missing}")
        return values

    async def _model_name(self) -> str:
        if self._model is None:
            reply = await self._get_json("/v1/models")
            self._model = reply["data"][0]["id"]
        return self._model

    def _completion(self, choice: dict) -> Completion:
        token_ids = tuple(int(t) for t in choice["token_ids"])
        lp = choice["logprobs"]
        logprobs = tuple(float(x) for x in lp["token_logprobs"])
        # Cross-check the two encodings of the sampled ids ("token_id:123" strings).
        if tuple(int(t.removeprefix("token_id:")) for t in lp["tokens"]) != token_ids:
            raise ServerError(f"server {self.base_url}: token ids and log-prob tokens differ")
        if len(logprobs) != len(token_ids) or any(math.isnan(x) for x in logprobs):
            raise ServerError(f"server {self.base_url}: bad log-probs {logprobs[:8]}")
        return Completion(token_ids, logprobs, str(choice["finish_reason"]))

    def _stream_chunk(self, chunk: dict) -> StreamChunk:
        if "error" in chunk:
            raise ServerError(f"server {self.base_url}: stream error {chunk['error']}")
        (choice,) = chunk["choices"]
        lp = choice.get("logprobs") or {}
        token_ids = tuple(int(t.removeprefix("token_id:")) for t in lp.get("tokens") or ())
        logprobs = tuple(float(x) for x in lp.get("token_logprobs") or ())
        if choice.get("token_ids") is not None and tuple(choice["token_ids"]) != token_ids:
            raise ServerError(f"server {self.base_url}: token ids and log-prob tokens differ")
        if len(logprobs) != len(token_ids) or any(math.isnan(x) for x in logprobs):
            raise ServerError(f"server {self.base_url}: bad log-probs {logprobs[:8]}")
        return StreamChunk(token_ids, logprobs, choice.get("finish_reason"))

    @staticmethod
    def _generate_body(prompt_ids: Sequence[int], *, max_tokens: int, temperature: float,
                       seed: int | None, stop_token_ids: Sequence[int], request_id: str | None,
                       top_p: float, top_k: int, ignore_eos: bool, routes_from: int,
                       stop: Sequence[str] = (), include_stop_str_in_output: bool = False) -> dict:
        """The /inference/v1/generate request: the sampling of `_completion_body`, in
        vLLM's SamplingParams fields, streamed as token ids and log-probs."""
        body = {
            "token_ids": [int(t) for t in prompt_ids],
            "sampling_params": {
                "n": 1, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                "top_p": top_p, "top_k": top_k, "ignore_eos": ignore_eos,
                "stop_token_ids": [int(t) for t in stop_token_ids], "logprobs": 0,
                "skip_special_tokens": False, "routed_experts_prompt_start": int(routes_from),
                # Stop strings are matched on text: only then is the sample detokenized.
                "stop": list(stop), "include_stop_str_in_output": include_stop_str_in_output,
                "detokenize": bool(stop), **_NEUTRAL_SAMPLING},
            "output_mode": "tokens",
            "stream": True,
        }
        if request_id is not None:
            body["request_id"] = request_id
        return body

    def _generate_chunk(self, chunk: dict, *, context: int, routes_from: int,
                        generated: list[int]) -> StreamChunk:
        """A /inference/v1/generate stream chunk; `generated` counts the request's tokens
        so far (one cell, updated here), so the last chunk's routes are checked against
        the positions they must cover."""
        if "error" in chunk:
            raise ServerError(f"server {self.base_url}: stream error {chunk['error']}")
        (choice,) = chunk["choices"]
        token_ids = tuple(int(t) for t in choice.get("token_ids") or ())
        content = (choice.get("logprobs") or {}).get("content") or ()
        if tuple(int(c["token_id"]) for c in content) != token_ids:
            raise ServerError(f"server {self.base_url}: token ids and log-prob tokens differ")
        logprobs = tuple(float(c["logprob"]) for c in content)
        if any(math.isnan(x) for x in logprobs):
            raise ServerError(f"server {self.base_url}: bad log-probs {logprobs[:8]}")
        generated[0] += len(token_ids)
        reason = choice.get("finish_reason")
        if reason is None:
            return StreamChunk(token_ids, logprobs, None)
        if choice.get("routed_experts") is None:
            raise ServerError(f"server {self.base_url}: routes were asked for (routing replay) "
                              "but the last chunk has none: was it started with "
                              "--enable-return-routed-experts?")
        routes = decode_routed_experts(choice["routed_experts"],
                                       positions=context + generated[0] - routes_from)
        return StreamChunk(token_ids, logprobs, str(reason), routes=routes,
                           routes_from=routes_from)

    async def _post(self, path: str, body: dict | None, timeout_s: float) -> dict:
        return await self._request("POST", path, body, timeout_s, text=False)

    async def _get_json(self, path: str) -> dict:
        return await self._request("GET", path, None, self.control_timeout_s, text=False)

    async def _get_text(self, path: str) -> str:
        return await self._request("GET", path, None, self.control_timeout_s, text=True)

    async def _request(self, method, path, body, timeout_s, *, text):
        url = self.base_url + path
        for attempt in range(2):
            try:
                async with self.session.request(
                    method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s),
                    headers=self._headers,
                ) as response:
                    payload = await response.text()
                    if response.status != 200:
                        # vLLM closes the connection after an endpoint raised; drop it from
                        # the pool so the next request does not reuse a dying socket.
                        response.close()
                        raise ServerError(f"{method} {url} -> {response.status}: "
                                          f"{payload[:2000]}")
                    if text:
                        return payload
                    return json.loads(payload) if payload else {}
            except asyncio.TimeoutError:
                raise ServerError(f"{method} {url} timed out after {timeout_s:g} s") from None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                # A pooled keep-alive socket the server closed as we sent ("Can not write
                # request body", seen under load): no answer came, so send once more.
                if attempt:
                    raise ServerError(f"{method} {url} failed: {type(e).__name__}: {e}") from e
            except aiohttp.ClientError as e:
                raise ServerError(f"{method} {url} failed: {type(e).__name__}: {e}") from e


def decode_routed_experts(payload: str, *, positions: int) -> Routes:
    """vLLM's `routed_experts` field (`--enable-return-routed-experts`): a base64 `.npy`
    (numpy.save) of [positions, layers, top_k] expert ids, for the `positions` of the
    request's prompt + sample it reports (from its `routed_experts_prompt_start`).
    vLLM reports one fewer, the last sampled token never having been fed; both counts
    are taken as they are (fnrl.data.partial_pool pads that last position). Any other
    count or shape is a ServerError."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(payload, validate=True)),
                        allow_pickle=False)
        if array.shape[:1] not in ((positions,), (positions - 1,)):
            raise ServerError(f"routed_experts covers {array.shape[:1]} positions where the "
                              f"request reports {positions - 1} (or {positions})")
        return Routes.of(array)
    except (binascii.Error, ValueError, EOFError, OSError) as e:
        raise ServerError(f"routed_experts is not a base64 .npy [positions, layers, top_k] "
                          f"array: {e}") from None


def _same_version(results: list, base_url: str) -> int:
    """collective_rpc returns one result per worker (as strings); they must agree."""
    versions = {int(r) for r in results}
    if len(versions) != 1:
        raise ServerError(f"server {base_url}: workers serve different versions {versions}")
    return versions.pop()


def _stops(stop: Sequence[str]) -> dict:
    """Stop strings, kept in the output (a tool call's closing tag is part of the turn).
    Only a multi-turn turn sends them: a single-turn request is unchanged."""
    return {"stop": list(stop), "include_stop_str_in_output": True} if stop else {}
