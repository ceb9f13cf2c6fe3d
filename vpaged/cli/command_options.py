"""The records of the serving commands' own flags (vpaged/cli/serve.py), beside the engine's (EngineConfig),
the server's (ServerOptions, ServerLimits) and bench-serve's workload (WorkloadSpec): each field is one flag,
made by record_flags.add_record_flags from its metadata and default.

The sampling flags of `generate` take their defaults from SamplingParams, the record they fill, except
--max-tokens: 32 (SamplingParams' is 16), the command's default since its first release.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..serve.options import option
from ..serve.sample.params import SamplingParams
from .served_models import model_flag

_SAMPLING = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


@dataclass(frozen=True)
class ProcessOptions:
    threads: int | None = field(default=None, metadata=option("torch CPU threads", default_text="torch's choice"))


@dataclass(frozen=True)
class GenerateSampling:
    """How `vpaged generate` decodes every prompt: the fields of SamplingParams it has flags for."""

    max_tokens: int = field(default=32, metadata=option("tokens to generate at most per completion"))
    temperature: float = field(default=_SAMPLING["temperature"], metadata=option("0 = greedy"))
    top_k: int = field(default=_SAMPLING["top_k"], metadata=option("keep the k most likely tokens (-1: all)"))
    top_p: float = field(
        default=_SAMPLING["top_p"], metadata=option("keep the most likely tokens up to this probability (1: all)")
    )
    seed: int | None = field(
        default=_SAMPLING["seed"], metadata=option("the requests' seed", default_text="one from the engine's")
    )
    n: int = field(default=_SAMPLING["n"], metadata=option("completions per prompt"))
    stop_token_ids: tuple[int, ...] = field(
        default=_SAMPLING["stop_token_ids"],
        metadata=option("a token that ends a completion (repeatable)", flag="--stop-token-id", repeat=True),
    )
    ignore_eos: bool = field(
        default=_SAMPLING["ignore_eos"], metadata=option("generate past the model's end-of-sequence token")
    )

    def params(self) -> SamplingParams:
        """The SamplingParams of these flags (InvalidArgumentError for a bad value)."""
        return SamplingParams(**dataclasses.asdict(self))


@dataclass(frozen=True)
class GenerateOptions:
    """What `vpaged generate` reads besides its text prompts, and how it prints."""

    prompt_ids: tuple[str, ...] = field(
        default=(),
        metadata=option("a prompt as token ids, e.g. '1,2,3' (repeatable)", metavar="IDS", repeat=True),
    )
    stream: bool = field(default=False, metadata=option("print tokens as they are generated"))
    json: bool = field(default=False, metadata=option("print the results as JSON"))


@dataclass(frozen=True)
class ServedModelsOptions:
    """Which models `vpaged serve` serves under which names (besides MODEL), and their chat templates
    (cli/served_models.py and cli/chat_templates.py read them)."""

    models: tuple[tuple[str | None, str], ...] | None = field(
        default=None,
        metadata=option(
            "a model served under NAME (repeatable: several models, one engine each, on one KV budget)",
            flag="--model",
            metavar="NAME=PATH",
            parse=model_flag,
            repeat=True,
        ),
    )
    models_config: str | None = field(
        default=None,
        metadata=option(
            "models and their own engine options: a TOML (or .json) file of [models.NAME] tables with a path",
            metavar="FILE",
        ),
    )
    served_model_name: str | None = field(
        default=None, metadata=option("the model name clients use", default_text="MODEL")
    )
    chat_template: tuple[str, ...] | None = field(
        default=None,
        metadata=option(
            "a Jinja chat template (a file, or the template itself) in place of the tokenizer's; NAME=FILE: "
            "model NAME's only (repeatable)",
            metavar="FILE",
            repeat=True,
        ),
    )


@dataclass(frozen=True)
class BenchServeOptions:
    """Where `vpaged bench-serve` sends its workload, and how it reports."""

    url: str | None = field(
        default=None,
        metadata=option(
            "benchmark a running `vpaged serve` at this URL instead "
            "(streamed /v1/completions; peak KV and preemptions from its /metrics)"
        ),
    )
    json: bool = field(default=False, metadata=option("print the report as JSON"))
    output: str | None = field(default=None, metadata=option("also write the JSON report to this file"))
    progress: bool = field(
        default=True, metadata=option("a progress bar on stderr", flag="--no-progress", negated=True)
    )
