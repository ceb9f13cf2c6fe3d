"""ServerOptions: how the HTTP server runs (where it listens, what it logs, the defaults of requests), beside
ServerLimits (guard.py, what one request may ask). `vpaged serve` makes its flags from the fields' metadata
(vpaged/cli/record_flags.py) and passes the record's fields to serve() (server.py) by name."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import InvalidArgumentError
from ..options import option

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # uvicorn's
# The keys of tools.PARSERS, named here so that the CLI builds its flags without the server's dependencies
# (tools.py needs pydantic); tests/cli/test_cli_record_flags.py checks that the two agree.
TOOL_CALL_PARSERS = ("hermes",)


@dataclass(frozen=True)
class ServerOptions:
    host: str = field(default="127.0.0.1", metadata=option("address to listen on"))
    port: int = field(default=8000, metadata=option("port to listen on; 0 = a free port (printed when ready)"))
    log_level: str = field(default="info", metadata=option("the server's log level", choices=LOG_LEVELS))
    default_max_tokens: int = field(default=256, metadata=option("max_tokens of chat requests that give none"))
    tool_call_parser: str = field(
        default="hermes", metadata=option("how tool calls are read from outputs", choices=TOOL_CALL_PARSERS)
    )

    def __post_init__(self):
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port < 1 << 16:
            raise InvalidArgumentError(f"port must be an int in 0..65535, got {self.port!r}")
        v = self.default_max_tokens
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InvalidArgumentError(f"default_max_tokens must be an int >= 1, got {v!r}")
        if self.log_level not in LOG_LEVELS:
            raise InvalidArgumentError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise InvalidArgumentError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}"
            )
