"""The `turnrl` command line: serve one service, start all four, run training, call services.

    turnrl serve {tool,reward,rollout,trainer} [--config F] [--host H] [--port N] [key=value ...]
    turnrl up [--config F] [--launcher local|ray] [--check] [key=value ...]
    turnrl run --config F [--launcher local|ray] [--resume | --resume-from CKPT] [key=value ...]
    turnrl eval --config F --model PATH [--output DIR] [--launcher local|ray] [key=value ...]
    turnrl health --addr H:P [--service NAME]
    turnrl tool list [--addr H:P]
    turnrl tool call NAME 'JSON-ARGS' [--addr H:P] [--session-kwargs JSON]
    turnrl score --data-source S --ground-truth G (--response TEXT | --input FILE.jsonl) [--addr H:P]
    turnrl report RUN [--output FILE.html]
    turnrl show RUN [--step N] [--eval] [-n K] [--tokens]

Every `key=value` is a config override (e.g. `tool.server.port=0`). Client commands print JSON
on stdout, read a bearer token from $TURNRL_AUTH_TOKEN, and exit non-zero on failure.
"""

import argparse
import asyncio
import importlib
import sys
from pathlib import Path

from rich.console import Console

from turnrl import __version__, service_main
from turnrl.config import DEFAULT_PORTS
from turnrl.errors import ConfigError
from turnrl_cli import client_commands, launcher, run_report, run_show
from turnrl_cli.model_paths import load_with_tiny_model
from turnrl_cli.run_folder import RunFolderError

# The module whose `serve(config)` runs each service, given its section of the config. Imported
# only by `turnrl serve`: the rollout and trainer servers load torch, which would add seconds to
# every thin client command.
SERVER_MODULES = {
    "tool": "tool_svc.server",
    "reward": "reward_svc.server",
    "rollout": "rollout_svc.server",
    "trainer": "trainer_svc.server",
}
# Exit codes: 1 a failed request or a service that died, 2 a bad command line or config.
EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `turnrl` console script."""
    parser = build_parser()
    # Overrides may stand anywhere among the options, which argparse positionals do not allow.
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    unknown = [a for a in extra if a not in overrides]
    if unknown or (overrides and not getattr(args, "accepts_overrides", False)):
        parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
    if getattr(args, "launcher", None):
        overrides.append(f"launcher.kind={args.launcher}")
    args.overrides = overrides
    service_main.configure_logging(args.log_level)
    try:
        code = args.handler(args)
    except (ConfigError, RunFolderError) as e:
        print(f"turnrl: {e}", file=sys.stderr)
        code = EXIT_USAGE
    sys.exit(code)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnrl", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"turnrl {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve one service in the foreground")
    serve.add_argument("service", choices=sorted(SERVER_MODULES))
    _add_config_args(serve)
    serve.add_argument("--host", help="interface to bind (default from config: 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to bind; 0 picks a free one")
    serve.set_defaults(handler=_serve)

    up = commands.add_parser(
        "up", help="start the services the config does not point at (local processes or Ray)"
    )
    _add_config_args(up)
    _add_launcher_arg(up)
    up.add_argument(
        "--check",
        action="store_true",
        help="start, check each service over gRPC (health, reflection), print the table, stop",
    )
    up.set_defaults(handler=lambda a: asyncio.run(launcher.up(a.config, a.overrides, a.check)))

    run = commands.add_parser("run", help="train: start the services and submit the run")
    _add_config_args(run, config_required=True)
    _add_launcher_arg(run)
    run.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    run.add_argument(
        "--resume-from",
        metavar="CKPT",
        help="continue from this checkpoint of the run: step_000040 (under its checkpoints/) or 40",
    )
    run.set_defaults(
        handler=lambda a: asyncio.run(
            launcher.run(
                a.config, a.overrides, a.resume or a.resume_from is not None, a.resume_from
            )
        )
    )

    evaluate = commands.add_parser(
        "eval", help="evaluate a model on the held-out data (trainer.eval), without training"
    )
    _add_config_args(evaluate, config_required=True)
    _add_launcher_arg(evaluate)
    evaluate.add_argument(
        "--model", type=Path, required=True, help="the model folder the rollout service serves"
    )
    evaluate.add_argument(
        "--output",
        type=Path,
        help="folder for the metrics (summary.json) and generations (eval/); default: "
        "<trainer.output_dir>/eval-<model folder's name>",
    )
    evaluate.set_defaults(
        handler=lambda a: asyncio.run(launcher.evaluate(a.config, a.overrides, a.model, a.output))
    )

    health = commands.add_parser("health", help="exit 0 when a service reports SERVING")
    _add_client_args(health, default_port=None)
    health.add_argument("--service", default="", help="service name; default: the whole server")
    health.set_defaults(handler=lambda a: asyncio.run(client_commands.health(a)))

    tool = commands.add_parser("tool", help="call the tool service")
    tool_commands = tool.add_subparsers(dest="tool_command", required=True, metavar="ACTION")
    tool_list = tool_commands.add_parser("list", help="print the tools' schemas as JSON")
    _add_client_args(tool_list, default_port=DEFAULT_PORTS["tool"])
    tool_list.set_defaults(handler=lambda a: asyncio.run(client_commands.tool_list(a)))
    tool_call = tool_commands.add_parser("call", help="run one tool call, print the result")
    tool_call.add_argument("name", help="tool name")
    tool_call.add_argument("arguments", help="the call's arguments, a JSON object")
    tool_call.add_argument("--session-kwargs", help="JSON object passed to CreateSession")
    _add_client_args(tool_call, default_port=DEFAULT_PORTS["tool"])
    tool_call.set_defaults(handler=lambda a: asyncio.run(client_commands.tool_call(a)))

    score = commands.add_parser("score", help="score responses with the reward service")
    score.add_argument("--data-source", required=True, help="scorer key, e.g. openai/gsm8k")
    score.add_argument(
        "--ground-truth",
        type=client_commands.ground_truth_arg,
        help="reference answer as a JSON value: a number, a string, a list of gold answers, an "
        "object; text that is not JSON (Paris, '#### 18') is taken as a string, but text that "
        "opens with a quote, [ or { must parse",
    )
    response = score.add_mutually_exclusive_group(required=True)
    response.add_argument("--response", help="the response text to score")
    response.add_argument(
        "--input", type=Path, help="JSONL file; each line has 'response' and 'ground_truth'"
    )
    _add_client_args(score, default_port=DEFAULT_PORTS["reward"])
    score.set_defaults(handler=lambda a: asyncio.run(client_commands.score(a)))

    report = commands.add_parser(
        "report", help="write a run's report page: curves, summary, trajectories (one HTML file)"
    )
    report.add_argument("run", type=Path, help="the run's folder, e.g. runs/calculator-...")
    report.add_argument("--output", type=Path, help="the page's path; default RUN/report.html")
    report.set_defaults(handler=_report)

    show = commands.add_parser("show", help="print a step's dumped trajectories")
    show.add_argument("run", type=Path, help="the run's folder, e.g. runs/calculator-...")
    show.add_argument("--step", type=int, help="the step; default: the last one dumped")
    show.add_argument("--eval", action="store_true", help="the held-out generations")
    show.add_argument("-n", type=int, default=3, help="how many, rewards high to low (default 3)")
    show.add_argument("--tokens", action="store_true", help="each token too, «trained» or not")
    show.set_defaults(handler=_show)
    return parser


def _add_config_args(parser: argparse.ArgumentParser, *, config_required: bool = False) -> None:
    parser.add_argument(
        "--config", type=Path, required=config_required, help="turnrl YAML config file"
    )
    parser.set_defaults(accepts_overrides=True)
    parser.epilog = "Config overrides go anywhere as key.sub=value, e.g. tool.server.port=0."


def _add_launcher_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--launcher",
        choices=["local", "ray"],
        help="start the services as local processes or as Ray actors (sets launcher.kind; "
        "default from config: local)",
    )


def _add_client_args(parser: argparse.ArgumentParser, *, default_port: int | None) -> None:
    parser.add_argument(
        "--addr",
        required=default_port is None,
        default=None if default_port is None else f"127.0.0.1:{default_port}",
        help="host:port of the service",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline, in seconds")
    parser.add_argument("--tls-ca", type=Path, help="PEM CA bundle; enables TLS")
    parser.add_argument("--tls-cert", type=Path, help="PEM client certificate (mTLS)")
    parser.add_argument("--tls-key", type=Path, help="PEM client key (mTLS)")


def _report(args: argparse.Namespace) -> int:
    print(f"report: {run_report.write_report(args.run, args.output)}")
    return 0


def _show(args: argparse.Namespace) -> int:
    run_show.show(args.run, args.step, args.eval, args.n, args.tokens, Console())
    return 0


def _serve(args: argparse.Namespace) -> int:
    """`turnrl serve X`: checks the whole config, gives a null `model_path` the config's tiny
    model, then hands the service's own section and overrides to its `main` (`python -m
    X_svc`), which serves it (and, for a trainer of several ranks, becomes torchrun)."""
    overrides = list(args.overrides)
    if args.host is not None:
        overrides.append(f"{args.service}.server.host={args.host}")
    if args.port is not None:
        overrides.append(f"{args.service}.server.port={args.port}")
    _, overrides = load_with_tiny_model(args.config, overrides, [args.service])
    argv = [override for override in overrides if override.startswith(f"{args.service}.")]
    if args.config is not None:
        argv += ["--config", str(args.config)]
    importlib.import_module(SERVER_MODULES[args.service]).main(argv)
    return 0  # not reached: main exits with the service's status
