"""Hooks the MoE engine tests put into configs (by dotted path: ``moe_helpers.X``)."""
from __future__ import annotations

import json
import os

import torch
from mmengine.hooks import Hook


class RoutingRecordHook(Hook):
    """Counts, per router, the tokens each expert received in the rank's first iteration, and writes
    them to ``work_dir/routing_rank<r>.json`` after training."""

    def before_train(self, runner):
        from sfttool.engine.runner import unwrap_model
        from sfttool.model import moe

        self.counts, self.handles = {}, []
        for name, router in moe.routers(unwrap_model(runner.model).llm):
            self.handles.append(router.register_forward_hook(self._recorder(name)))

    def _recorder(self, name):
        def record(_module, _inputs, outputs):
            if name not in self.counts:  # the first forward only
                experts = outputs[2].reshape(-1)
                self.counts[name] = torch.bincount(experts, minlength=4).tolist()
        return record

    def after_train(self, runner):
        from mmengine.dist import get_rank

        for handle in self.handles:
            handle.remove()
        with open(os.path.join(runner.work_dir, f"routing_rank{get_rank()}.json"), "w") as f:
            json.dump(self.counts, f)
