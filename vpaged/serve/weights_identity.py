"""weights_identity(model): a string naming a model's weights, what a shared prefix store keys pages by.

Note (why not the name alone). Two processes that load different weights under one name (a fine-tune saved
over a checkpoint, a local path reused) must never exchange K/V pages. A full digest of every weight costs
about a second per GB; the identity below reads the model's name and revision, its config, and a digest of
each parameter's name, shape, dtype and first 4 KiB, which any retraining or other checkpoint changes, in
milliseconds. It cannot tell weights apart that differ only past the first 4 KiB of every tensor.
"""

from __future__ import annotations

import hashlib

import torch

SAMPLE_BYTES = 4096


def weights_identity(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    name = str(getattr(config, "name_or_path", "") or type(model).__name__)
    revision = str(getattr(config, "_commit_hash", "") or "")
    h = hashlib.blake2b(digest_size=16, person=b"vpaged-weights")
    if config is not None and hasattr(config, "to_json_string"):
        h.update(config.to_json_string(use_diff=False).encode())
    for pname, p in model.state_dict().items():
        h.update(f"{pname}:{tuple(p.shape)}:{p.dtype}".encode())
        flat = p.detach().reshape(-1)
        count = max(1, SAMPLE_BYTES // max(1, flat.element_size()))
        sample = flat[:count].to("cpu").contiguous()
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return f"{name}@{revision or 'local'}#{h.hexdigest()}"
