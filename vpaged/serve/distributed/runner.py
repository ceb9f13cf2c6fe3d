"""Rank 0's model runner: before each forward, the other ranks get the step (the cache operations that led to
it and its packed inputs) on the control group; then every rank runs the same forward, whose tensor-parallel
layers all-reduce inside transformers. Sampling stays on rank 0: the tokens it draws reach the other ranks as
the next step's input ids, the only place they need them."""

from __future__ import annotations

from ..runner import ModelRunner
from ..scheduler import StepPlan
from .group import Group, Message
from .mirror import RecordingStore


def describe(plan: StepPlan, inputs: dict) -> tuple:
    """The step as the other ranks rebuild it: (decodes as (handle, computed tokens), prefill chunks as
    (handle, start, tokens), input ids, positions, logits rows kept); handles are rank 0's."""
    return (
        [(seq.handle, seq.num_computed) for seq in plan.decodes],
        [(seq.handle, start, n) for seq, start, n in plan.prefills],
        inputs["input_ids"][0].tolist(),
        inputs["position_ids"][0].tolist(),
        inputs["logits_to_keep"].tolist(),
    )


class TensorParallelRunner(ModelRunner):
    """ModelRunner on rank 0 of a tensor-parallel engine (the store is rank 0's RecordingStore)."""

    def __init__(self, model, store: RecordingStore, config, group: Group):
        super().__init__(model, store, config)
        self.group = group
        self._step: tuple | None = None

    def prepare(self, plan: StepPlan):
        inputs, step, samplers = super().prepare(plan)
        self._step = describe(plan, inputs)
        return inputs, step, samplers

    def forward(self, inputs: dict, step):
        self.group.send(Message("step", self.store.take(), self._step))
        return super().forward(inputs, step)
