"""`governor run` and its clients: status, why, hold, reload, record, metrics; and install-service."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from governor.daemon.signals import hold_hangups
from policies.decision import HoldAsk, State

if TYPE_CHECKING:
    from governor.daemon.client import ControlClient


def default_control_socket(env: Mapping[str, str] | None = None, euid: int | None = None) -> Path:
    """$GOVERNOR_CONTROL_SOCKET, else where the daemon would put it, in the daemon's order: this user's runtime
    directory (as `governor run` by this user would choose it), then the system daemon's. A directory that another
    user owns or can write is skipped with a warning: a socket there could be anyone's."""
    from governor.daemon.config import default_dirs
    from governor.unixsock import private_dir_problem

    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    if env.get("GOVERNOR_CONTROL_SOCKET"):
        return Path(env["GOVERNOR_CONTROL_SOCKET"])
    from govbase.errors import GovernorError

    candidates = dict.fromkeys([default_dirs(env, euid)[0] / "control.sock", default_dirs({}, 0)[0] / "control.sock"])
    safe: list[Path] = []
    problems: list[str] = []
    for sock in candidates:
        problem = private_dir_problem(sock.parent, euid) if sock.parent.exists() else None
        if problem is not None:
            print(f"governor: not using {sock}: {problem}", file=sys.stderr)
            problems.append(problem)
        elif sock.exists():
            return sock
        else:
            safe.append(sock)
    if not safe:
        raise GovernorError(f"no trustworthy control socket: {'; '.join(problems)}")
    return safe[0]  # nobody runs yet: the error names where this user's daemon would listen


def _client(args: argparse.Namespace) -> ControlClient:
    from governor.daemon.client import ControlClient

    return ControlClient(args.control_socket or default_control_socket())


def _launched_as_governor() -> bool:
    """`governor ...` or `python -m governor ...`, not a test calling main() in-process."""
    return Path(sys.argv[0]).name in ("governor", "__main__.py") and "run" in sys.argv[1:]


def _run(args: argparse.Namespace) -> int:
    if _launched_as_governor() and not os.environ.get("GOVERNOR_NO_REEXEC"):
        # The full CLI has imported every subcommand's modules (uvicorn, gguf, numpy: ~30 MB) that a daemon living
        # for months would keep for nothing: become the lean entry point instead (same pid, for systemd).
        # A SIGHUP meanwhile is held for the loop (a blocked signal stays blocked and pending across exec).
        hold_hangups()
        os.execv(sys.executable, [sys.executable, "-m", "governor.daemon", *sys.argv[1:]])
    return run_daemon(args)


def run_daemon(args: argparse.Namespace) -> int:
    hold_hangups()  # a reload asked while the daemon starts up (build reads the policy) waits for it
    from governor.daemon.app import build
    from governor.daemon.config import load_config

    overrides = {
        "policy": args.policy,
        "root": args.root,
        "models": args.models,
        "control_socket": args.control_socket,
        "engine_socket": args.engine_socket,
        "state_dir": args.state_dir,
        "group": args.group,
        "metrics_textfile": args.metrics_textfile,
        "udev": False if args.no_udev else None,
        "engine": args.engine,
        "llama_server": args.llama_server,
        "engine_url": args.engine_url,
    }
    return build(load_config(args.config, overrides)).run()


def _status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from governor.daemon.render import status_table

    client = _client(args)
    status = client.request("status")["status"]
    if args.json:
        print(json.dumps(status))
    else:
        status_table(status, Console())
    return 0


def _why(args: argparse.Namespace) -> int:
    from rich.console import Console

    from governor.daemon.render import routes_table, why_table

    client = _client(args)
    answer = client.request("why", n=args.n)
    decisions, routes = answer["decisions"], answer.get("routes") or []
    if args.json:
        for d in decisions:
            print(json.dumps(d))
        for r in routes:
            print(json.dumps({"request": r}))
    else:
        why_table(decisions, Console())
        if routes:
            routes_table(routes, Console())
    return 0


def _hold_flags() -> list[str]:
    return ["--" + name.replace("_", "-") for name in HoldAsk.model_fields if name != "state"]


def _hold(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from govbase.errors import GovernorError

    given = {k: v for k in HoldAsk.model_fields if (v := getattr(args, k)) is not None}
    if not given:
        raise GovernorError(f"hold what? give a STATE or {' or '.join(_hold_flags())}")
    try:
        ask = HoldAsk.model_validate(given)  # command-line text: "2" is 2 here
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = str(err["loc"][0])
        raise GovernorError(f"bad hold: {field} {given[field]}: {err['msg']}") from exc
    client = _client(args)
    fields = ask.asks() | ({} if args.ttl is None else {"ttl_s": args.ttl})
    with client.hold(**fields) as (answer, events):
        until = f"for {args.ttl:g} s" if args.ttl else "until Ctrl-C"
        print(f"hold {answer['hold']} in force {until} (hot and critical still override it)", flush=True)
        try:
            for event in events:
                if event.get("event") == "released":
                    print(f"hold {answer['hold']} released ({event.get('why')})")
                    return 0
        except KeyboardInterrupt:
            print(f"hold {answer['hold']} released")
            return 0
    print("the governor closed the connection; hold released")
    return 0


def _reload(args: argparse.Namespace) -> int:
    client = _client(args)
    answer = client.request("reload")
    print(f"policy {answer['policy']} reloaded")
    return 0


def _metrics(args: argparse.Namespace) -> int:
    client = _client(args)
    sys.stdout.write(client.request("metrics")["text"])
    return 0


def _record(args: argparse.Namespace) -> int:
    from govbase.errors import GovernorError

    client = _client(args)
    lines = 0
    try:
        out = args.file.open("w")
    except OSError as exc:
        raise GovernorError(f"{args.file}: cannot write: {exc.strerror}") from None
    try:
        with out:
            try:
                for line in client.record(args.seconds):
                    out.write(line + "\n")
                    out.flush()
                    lines += 1
            except KeyboardInterrupt:
                pass  # Ctrl-C ends a recording; what was written is kept
    except OSError as exc:  # the disk filled (ENOSPC) or failed (EIO) under the recording
        raise GovernorError(f"{args.file}: cannot write: {exc.strerror or exc}; {lines} ticks were written") from None
    print(f"recorded {lines} ticks to {args.file}", file=sys.stderr)
    return 0


def _install_service(args: argparse.Namespace) -> int:
    from governor.daemon import services

    kind = args.kind or services.detect_kind(os.environ, os.geteuid())
    run_args = ["--config", str(args.config)] if args.config else []
    files = services.plan(kind, dest=args.dest, boot_dir=args.boot_dir, args=run_args)
    if args.dry_run:
        for f in files:
            print(f"# {f.path}{' (executable)' if f.executable else ''}\n{f.text}")
    else:
        services.write(files)
        for f in files:
            print(f"wrote {f.path}")
    print(services.how_to_enable(kind))
    return 0


def add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    run = sub.add_parser("run", help="run the governor daemon: sensors -> policy -> engine, with a control socket")
    run.add_argument(
        "--config",
        type=Path,
        help="daemon config TOML (default: /etc/governor/governor.toml for root, "
        "~/.config/governor/governor.toml for a user, when present)",
    )
    run.add_argument("--policy", help="a shipped profile name or a policy TOML file (default: default)")
    run.add_argument("--root", type=Path, help="read /sys and /proc under this directory (default /)")
    run.add_argument("--models", type=Path, help="model ladder TOML (default: the demo ladder, written on first run)")
    run.add_argument("--control-socket", type=Path, help="control socket path")
    run.add_argument("--engine-socket", type=Path, help="the engine's chat socket path")
    run.add_argument("--state-dir", type=Path, help="state directory (demo models live here)")
    run.add_argument("--group", help="let this group use the control socket (mode 0660 instead of 0600)")
    run.add_argument("--metrics-textfile", type=Path, help="also write Prometheus metrics to this node_exporter file")
    run.add_argument("--no-udev", action="store_true", help="do not watch udev events; poll only")
    run.add_argument(
        "--engine",
        choices=["llama-cpp-python", "llama-server", "external"],
        help="what serves the tokens: the built-in llama-cpp-python child (default), llama.cpp's own llama-server, "
        "or a server you run (--engine-url); docs/engines.md",
    )
    run.add_argument("--llama-server", type=Path, help="the llama-server program (default: on the PATH)")
    run.add_argument("--engine-url", help="--engine external: its base URL, e.g. http://127.0.0.1:11434")
    run.set_defaults(func=_run)
    return run


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_run(sub)

    def client(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--control-socket", type=Path, help="the daemon's control socket (default: found)")
        return p

    p = client("status", "the governor's state, engine config, readings and holds")
    p.add_argument("--json", action="store_true", help="print the status as one JSON object")
    p.set_defaults(func=_status)
    p = client("why", "the last decisions with their reasons")
    p.add_argument("-n", type=int, default=15, help="how many (default 15)")
    p.add_argument("--json", action="store_true", help="one JSON object per decision")
    p.set_defaults(func=_why)
    p = client("hold", "hold a state or limits until Ctrl-C or --ttl; hot and critical still override it")
    p.add_argument("state", nargs="?", choices=[s.value for s in State], help="the state whose profile to hold")
    for flag in _hold_flags():  # --max-threads, --max-tokens-per-s, ...: a cap on that setting of the engine
        p.add_argument(flag, metavar="VALUE", help=f"cap the engine's {flag.removeprefix('--max-').replace('-', '_')}")
    p.add_argument("--ttl", type=float, help="release after this many seconds")
    p.set_defaults(func=_hold)
    p = client("reload", "reload the policy (like SIGHUP); a bad policy is reported and the last good one kept")
    p.set_defaults(func=_reload)
    p = client("record", "write the live trace (replay format: TraceRecord JSON lines) until Ctrl-C or --seconds")
    p.add_argument("file", type=Path)
    p.add_argument("--seconds", type=float, help="stop after this long")
    p.set_defaults(func=_record)
    p = client("metrics", "print the daemon's Prometheus metrics")
    p.set_defaults(func=_metrics)

    p = sub.add_parser("install-service", help="write the systemd unit or Termux service scripts for this install")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--system", dest="kind", action="store_const", const="system", help="a systemd system service")
    kind.add_argument("--user", dest="kind", action="store_const", const="user", help="a systemd user service")
    kind.add_argument("--termux", dest="kind", action="store_const", const="termux", help="termux-services + Boot")
    p.add_argument("--dest", "--prefix", type=Path, help="write under this directory instead of the usual one")
    p.add_argument("--boot-dir", type=Path, help="Termux:Boot script directory (default ~/.termux/boot)")
    p.add_argument("--config", type=Path, help="pass this config file to `governor run`")
    p.add_argument("--dry-run", action="store_true", help="print the files instead of writing them")
    p.set_defaults(func=_install_service)
