"""ModelRunner: one packed forward per step (the model's DirectForward where it has one, else transformers').

All scheduled tokens - one per decoding sequence, then each prefill chunk - form a single batch row with
their position_ids. The model runs with attn_implementation="vpaged" and gets the step's StepAttention as
the `vpaged_step` forward kwarg (transformers passes it through every decoder layer to the attention
function), plus a placeholder 4D mask so that transformers builds no [T, T] mask. Logits are computed only
for the rows that sample (logits_to_keep), i.e. the last token of each sequence that reaches its end; a
request that asks for prompt_logprobs also keeps the rows of its prompt positions (prompt_logprob_rows), after
the sampling rows, so that requests which do not ask keep the last-position-only path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ..hf.attention import NAME as ATTN_NAME  # importing it registers attn_implementation="vpaged"
from .scheduler import StepPlan

if TYPE_CHECKING:
    from .config import EngineConfig
    from .direct_forward import DirectForward
    from .sequence import Sequence
    from .stores import KVStore


class PromptRows(NamedTuple):
    """Prompt positions first .. first + count - 1 of seq, at packed rows row .. row + count - 1: their logits
    give the logprobs of prompt tokens first + 1 .. first + count (SamplingParams.prompt_logprobs)."""

    seq: Sequence
    first: int
    count: int
    row: int


def prompt_logprob_rows(plan: StepPlan) -> list[PromptRows]:
    """The prompt rows of a step whose logits a request asked for and does not have yet (each prompt
    position once, also across chunks and recomputation); empty when no request of the step asks."""
    out = []
    row = len(plan.decodes)
    for seq, start, n in plan.prefills:
        req = seq.request
        if req.prompt_logprobs is not None:
            first = max(start, len(req.prompt_logprobs) - 1)  # entry p + 1 comes from position p
            end = min(start + n, req.prompt_len - 1)  # the last prompt position predicts a generated token
            if end > first:
                out.append(PromptRows(seq, first, end - first, row + first - start))
        row += n
    return out


class ModelRunner:
    """Runs the model on a step's plan; the store supplies the step's attention (KVStore.step_attention)."""

    def __init__(self, model, store: KVStore, config: EngineConfig, direct: DirectForward | None = None):
        """direct: the model's DirectForward, which then runs every step (the engine builds it where the model
        qualifies); None: the transformers forward."""
        self.model = model
        self.store = store
        self.direct = direct
        self.device = device = config.model.device
        # Handed to the model as a prepared 4D mask: transformers returns such a mask untouched instead of
        # building one, and the vpaged attention function ignores it in a packed step.
        self._mask_placeholder = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)

    def prepare(self, plan: StepPlan):
        """Inputs of the packed forward and the sequences whose next token it yields (in logits order)."""
        ids = [seq.tokens[seq.num_computed] for seq in plan.decodes]
        positions = [seq.num_computed for seq in plan.decodes]
        keep = list(range(len(plan.decodes)))
        samplers = list(plan.decodes)
        row_offsets = []
        row = len(ids)
        for seq, start, n in plan.prefills:
            ids += seq.tokens[start : start + n]
            positions += range(start, start + n)
            row_offsets.append(row)
            row += n
            if start + n == len(seq.tokens):
                keep.append(row - 1)
                samplers.append(seq)
        for rows in prompt_logprob_rows(plan):
            keep += range(rows.row, rows.row + rows.count)
        step = self.store.step_attention(plan.decodes, plan.prefills, row_offsets, row)
        dev = self.device
        inputs = dict(
            input_ids=torch.tensor([ids], device=dev),
            position_ids=torch.tensor([positions], device=dev),
            logits_to_keep=torch.tensor(keep, device=dev),
        )
        return inputs, step, samplers

    def forward(self, inputs: dict, step) -> torch.Tensor:
        """Logits [len(keep), vocab] of the packed step: the sampling rows, then any prompt rows."""
        if inputs["logits_to_keep"].numel() == 0:
            inputs = dict(inputs, logits_to_keep=torch.zeros(1, dtype=torch.long, device=self.device))
            self._run(inputs, step)
            return torch.empty((0, 0), device=self.device)
        return self._run(inputs, step)

    def _run(self, inputs: dict, step) -> torch.Tensor:
        if self.direct is not None:
            return self.direct.forward(
                inputs["input_ids"][0], inputs["position_ids"][0], inputs["logits_to_keep"], step
            )
        if self.model.config._attn_implementation != ATTN_NAME:
            # Someone switched the model to another implementation (e.g. to run model.generate on it with
            # SDPA): the packed step needs ours, which serves plain generate() calls just as well.
            self.model.set_attn_implementation(ATTN_NAME)
        with torch.inference_mode():
            out = self.model(**inputs, attention_mask=self._mask_placeholder, use_cache=False, vpaged_step=step)
        return out.logits[0]
