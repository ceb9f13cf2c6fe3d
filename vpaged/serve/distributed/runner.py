"""Rank 0's model runner: before each forward, the other ranks get the Step (the store operations that led to
it and its packed inputs) on the control group; then every rank runs the same forward, whose tensor-parallel
layers all-reduce inside transformers. Sampling stays on rank 0: the tokens it draws reach the other ranks as
the next step's input ids, the only place they need them."""

from __future__ import annotations

from dataclasses import replace

from ..runner import ModelRunner
from ..scheduler import StepPlan
from .group import Group
from .messages import Step
from .mirror import RecordingStore, StoreOp


def describe(plan: StepPlan, inputs: dict, ops: tuple[StoreOp, ...] = ()) -> Step:
    """The step as the other ranks rebuild it (handles are rank 0's)."""
    return Step(
        ops=ops,
        decodes=tuple((seq.handle, seq.num_computed) for seq in plan.decodes),
        prefills=tuple((seq.handle, start, n) for seq, start, n in plan.prefills),
        input_ids=tuple(inputs["input_ids"][0].tolist()),
        position_ids=tuple(inputs["position_ids"][0].tolist()),
        logits_to_keep=tuple(inputs["logits_to_keep"].tolist()),
    )


class TensorParallelRunner(ModelRunner):
    """ModelRunner on rank 0 of a tensor-parallel engine (the store is rank 0's RecordingStore)."""

    def __init__(self, model, store: RecordingStore, config, group: Group):
        super().__init__(model, store, config)
        self.group = group
        self._step: Step | None = None

    def prepare(self, plan: StepPlan):
        inputs, step, samplers = super().prepare(plan)
        self._step = describe(plan, inputs)
        return inputs, step, samplers

    def forward(self, inputs: dict, step):
        # The operations are taken here: every one the scheduler made up to this forward.
        self.group.send(replace(self._step, ops=self.store.take()))
        return super().forward(inputs, step)
