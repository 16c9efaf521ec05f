"""The command line every service shares, `python -m <name>_svc`: read the service's own
section of a config file, then serve it. Each service's `server.main` is two calls here:

    config = service_main.load_config("tool", ToolConfig, argv)
    service_main.run("tool", serve, config)

`python -m tool_svc [--config F] [--host H] [--port N] [--log-level L] [tool.key=value ...]`
reads only the `tool:` section of F (other sections belong to other services) and takes only
overrides of it. `turnrl serve tool` (turnrl_cli) serves the same section, after checking the
whole file and giving a null `model_path` the config's tiny demo model, which a service alone
never does.
"""

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

from pydantic import Field, create_model

from turnrl.config import StrictModel, load_config_data, validate_config
from turnrl.errors import ConfigError, UnavailableError

ConfigT = TypeVar("ConfigT", bound=StrictModel)
# Exit codes, as `turnrl`'s: 1 the service could not start (its port taken), 2 a bad config.
EXIT_FAILED = 1
EXIT_USAGE = 2


def load_config(section: str, model: type[ConfigT], argv: Sequence[str] | None) -> ConfigT:
    """Parses `argv` (None: sys.argv), sets up logging, and returns the `section` of the file
    with the overrides applied, validated by `model`. A bad command line or config is printed
    with what was wrong and ends the process with exit code 2."""
    program = f"python -m {section}_svc"
    parser = argparse.ArgumentParser(
        prog=program,
        description=f"Serves the {section} service from the `{section}:` section of a config.",
        epilog=f"Config overrides go anywhere as {section}.key=value, e.g. {section}.server.port=0.",
    )
    parser.add_argument("--config", type=Path, help="turnrl YAML config file")
    parser.add_argument("--host", help="interface to bind (default from config: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind; 0 picks a free one")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    # Overrides may stand anywhere among the options, which argparse positionals do not allow.
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    if unknown := [a for a in extra if a not in overrides]:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    configure_logging(args.log_level)
    if args.host is not None:
        overrides.append(f"{section}.server.host={args.host}")
    if args.port is not None:
        overrides.append(f"{section}.server.port={args.port}")
    try:
        return _section(section, model, args.config, overrides)
    except ConfigError as e:
        _exit(program, e, EXIT_USAGE)


def configure_logging(level: str) -> None:
    """Log lines with time, level and logger to stderr, at `level` (a no-op once configured,
    as when `turnrl serve` hands over to a service's `main`)."""
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # In asyncio debug mode (tests) asyncio logs every subprocess at INFO; keep its warnings only.
    logging.getLogger("asyncio").setLevel(logging.WARNING)


def run(section: str, serve: Callable[[ConfigT], Awaitable[None]], config: ConfigT) -> NoReturn:
    """Runs `serve(config)` until it returns (on SIGTERM or SIGINT), then exits: 0, 1 when the
    service could not start (an OSError, such as a port in use) or could serve no more (an
    UnavailableError: its engine died), 2 for a ConfigError."""
    program = f"python -m {section}_svc"
    try:
        asyncio.run(serve(config))
    except ConfigError as e:
        _exit(program, e, EXIT_USAGE)
    except (OSError, UnavailableError) as e:
        _exit(program, e, EXIT_FAILED)
    sys.exit(0)


def _section(
    section: str, model: type[ConfigT], path: Path | None, overrides: Sequence[str]
) -> ConfigT:
    """`model` from the `section` of the file at `path` with `overrides`; ConfigError names a
    bad key with its section (`tool.server.prot`) and where it was set, as for the whole file."""
    outside = [o for o in overrides if not o.startswith(f"{section}.")]
    if outside:
        raise ConfigError(
            f"overrides {outside} are not in the {section} section; python -m {section}_svc "
            f"takes {section}.key=value only"
        )
    data, applied = load_config_data(path, overrides)
    only_section = create_model(
        f"{model.__name__}File",
        __base__=StrictModel,
        **{section: (model, Field(default_factory=model))},
    )
    loaded = validate_config(
        only_section, {section: data.get(section) or {}}, path=path, overrides=applied
    )
    return getattr(loaded, section)


def _exit(program: str, error: Exception, code: int) -> NoReturn:
    print(f"{program}: {error}", file=sys.stderr)
    sys.exit(code)
