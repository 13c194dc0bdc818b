"""``uomp``: the user's command line. The only place that installs log handlers and catches errors.

Every failure is one line on stderr, ``error CODE: what happened; what to do``, and exit status 1
(2 for a command line argparse refuses). No traceback unless ``-v``. A closed output pipe
(``uomp audit --json | head``) ends the command silently.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import getpass
import importlib
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NoReturn

from gateway import __version__
from gateway.config import Paths, resolve_home
from gateway.errors import ErrorCode, UompError

# Each module has ``register(subparsers)``; its commands set ``func(args) -> int``. A command line
# imports only the module of its command (:data:`COMMANDS`); the others stand in the top-level help
# as name and one line, so ``uomp --help`` and a one-shot command pay none of the other commands'
# imports (aiohttp, cryptography, the conformance suite ...).
COMMAND_MODULES = (
    "gateway.cli.home",
    "gateway.cli.memory",
    "gateway.cli.proposals",
    "gateway.cli.exchange",
    "gateway.cli.guard",
    "gateway.cli.audit",
    "gateway.cli.authorize",
    "gateway.cli.trust",
    "gateway.cli.registry",
    "gateway.cli.agent",
    "gateway.cli.enroll",
    "gateway.cli.run",
    "gateway.cli.gateway",
    "gateway.cli.payload",
    "gateway.cli.status",
    "gateway.cli.doctor",
    "gateway.cli.conformance",
    "gateway.cli.dashboard",
    "gateway.cli.mcp",
    "gateway.cli.secrets",
    "gateway.cli.backup",
    "gateway.cli.uplink",
)

# Every top-level command: its module and its one line of help, in the order ``uomp --help`` lists
# them. It must say what the modules register (tests/cli/test_cli_lazy.py compares the two).
COMMANDS: dict[str, tuple[str, str]] = {
    "init": ("gateway.cli.home", "create the data directory, signing key, admin credential and CA"),
    "keys": ("gateway.cli.home", "Auth Service signing keys"),
    "memory": ("gateway.cli.memory", "add, show, list and delete Memory Items; their history and rollback"),
    "import": (
        "gateway.cli.memory",
        "import Memory Items from a CSV or JSON file (spec §12), an export, or another store's (--adapter)",
    ),
    "proposals": ("gateway.cli.proposals", "agents' proposed memory changes: list, show, approve, reject"),
    "export": ("gateway.cli.exchange", "write the whole memory store (items, versions, history) as one JSON document"),
    "guard": ("gateway.cli.guard", "the local Auth Service + Memory Guard"),
    "sessions": ("gateway.cli.guard", "see, close and revoke sessions (spec §21)"),
    "audit": ("gateway.cli.audit", "what agents asked for and got; verify the log; proofs for one event"),
    "anchor": ("gateway.cli.audit", "anchoring the audit log's checkpoints on a chain (docs/anchoring.md)"),
    "authorize": ("gateway.cli.authorize", "grant an agent access to your memory after showing what it asks for"),
    "trust": ("gateway.cli.trust", "the publisher identities you trust, by the names you give them (spec §16.4)"),
    "registry": (
        "gateway.cli.registry",
        "find agents on ERC-8004 registries and install their manifests (spec §17)",
    ),
    "ca": ("gateway.cli.agent", "the certificate authority that issues agent client certificates"),
    "agent": ("gateway.cli.agent", "issue, revoke and list agent client certificates"),
    "requests": ("gateway.cli.enroll", "agents' enrollment requests: list, approve (the consent panel), deny"),
    "enroll": (
        "gateway.cli.enroll",
        "(agent side) enroll with the line from 'uomp agent invite': make a key here, send a CSR, wait "
        "for the user's approval, write certificate and tokens to --out",
    ),
    "run": (
        "gateway.cli.run",
        "grant a local agent a session (the consent panel of uomp authorize) and start it with its "
        "token in its environment (UOM_TOKEN, UOMP_BASE_URL); the session closes when it exits",
    ),
    "gateway": ("gateway.cli.gateway", "the remote gateway (TLS 1.3 + mTLS) for agents on other machines"),
    "payload": ("gateway.cli.payload", "encrypted payloads agents sent you: list, pull (decrypt), remove"),
    "status": (
        "gateway.cli.status",
        "is the appliance running, where, its tunnel, guard health, certificates, sessions "
        "(exit 0 healthy, 1 unhealthy, 3 not running)",
    ),
    "doctor": (
        "gateway.cli.doctor",
        "check permissions, keys, CA, config, addresses vs certificate, ports and cloudflared; "
        "each problem with its fix (exit 1 when any)",
    ),
    "conformance": ("gateway.cli.conformance", "run the UOMP conformance suite against a guard or gateway"),
    "dashboard": (
        "gateway.cli.dashboard",
        "the local dashboard: print (and --open) a one-time login link; serves it here unless "
        "'uomp gateway start' already does (docs/dashboard.md)",
    ),
    "mcp": ("gateway.cli.mcp", "the agent's MCP server: any MCP client reads what the user granted"),
    "secrets": ("gateway.cli.secrets", "seal the home's private keys at rest (passphrase or OS keychain)"),
    "backup": ("gateway.cli.backup", "the whole home in one encrypted file, and back"),
    "uplink": ("gateway.cli.uplink", "the outbound uplink: a gateway on a VPS, the guard here (docs/vps.md)"),
}

# Commands that run ``gateway.cli.home.INIT_HOOKS`` (``uomp init``, ``uomp gateway start``) and the
# modules that add a step there when imported: those commands import these besides their own (and
# register only their own parsers).
# tests/cli/test_cli_lazy.py holds the list to every module that appends to INIT_HOOKS.
INIT_COMMANDS = frozenset({"init", "gateway"})
INIT_HOOK_MODULES = ("gateway.cli.initsteps",)

# Top-level options that take a value (the command word is the first token that is none of these).
_VALUE_OPTIONS = frozenset({"--home"})


def paths_from(args: argparse.Namespace, *, needs_init: bool = True) -> Paths:
    """The data directory of this command, refused (UNSAFE_PERMISSIONS) when it, ``.secrets`` or
    ``ca/`` is another user's or group/other-writable, or a parent lets another user replace it.

    ``needs_init``: refused (NOT_INITIALISED) unless ``uomp init`` made it (its signing key exists),
    before the command creates anything there. Only the commands that make a home (``init``,
    ``gateway start``) or report on one (``status``, ``doctor``, ``gateway stop``) pass False."""
    from gateway.atrest import vault  # (these import cryptography: not for --help)
    from gateway.keys import check_home

    paths = Paths(resolve_home(getattr(args, "home", None)))
    check_home(paths)
    # A sealed home (gateway/atrest/): a service unlocks it now, before it starts anything; a one-shot
    # command asks for the passphrase only if it reads a key.
    prompt = passphrase_prompt(paths)
    vault.set_prompt(prompt)
    if getattr(args, "service", False):
        vault.open_home(paths, prompt=prompt)
    if needs_init and not paths.private_jwk.exists():
        where = f"{paths.home} has not been set up" if paths.home.exists() else f"{paths.home} does not exist"
        raise UompError(
            ErrorCode.NOT_INITIALISED,
            f"data directory {where}; run 'uomp init' first (or pass --home / set UOMP_HOME to the one you use)",
        )
    return paths


def passphrase_prompt(paths: Paths) -> Callable[[], str] | None:
    """Ask in the terminal (no echo) when there is one; None otherwise (then the passphrase must
    come from UOMP_PASSPHRASE_FILE, a systemd credential or the keychain)."""
    if not sys.stdin.isatty():
        return None

    def ask() -> str:
        return getpass.getpass(f"passphrase for the keys of {paths.home}: ")

    return ask


_INVALID_CHOICE = re.compile(r"argument (?P<arg>.+?): invalid choice: '(?P<value>.*)' \(choose from (?P<choices>.*)\)$")


class Parser(argparse.ArgumentParser):
    """argparse's refusals as one line in the CLI's shape (exit 2), naming the (sub)command whose
    help to read and the closest valid name; subcommand parsers inherit it."""

    argv: ClassVar[list[str]] = []  # the command line being parsed (main sets it), for the explanations below

    def error(self, message: str) -> NoReturn:
        print(f"error USAGE: {self.prog}: {self._explain(message)}; see '{self.prog} --help'", file=sys.stderr)
        sys.exit(2)

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        """Refuse arguments no parser took, in the words of the subcommand they were given to."""
        self.error(self._unknown_flags(extras))

    def _options(self) -> list[str]:
        return [o for action in self._actions for o in action.option_strings]

    def _unknown_flags(self, extras: Sequence[str]) -> str:
        parts = []
        for tok in extras:
            close = difflib.get_close_matches(tok.split("=", 1)[0], self._options(), n=1) if tok.startswith("-") else []
            parts.append(f"{tok} (did you mean {close[0]}?)" if close else tok)
        return "unrecognized arguments: " + " ".join(parts)

    def _strangers(self) -> list[str]:
        """Flags on the command line that neither this parser nor the top level knows."""
        known = set(self._options()) | {"--home", "-v", "--verbose", "--version", "-h", "--help"}
        return [
            t
            for t in Parser.argv
            if t.startswith("-") and not re.match(r"-\d", t) and t != "--" and t.split("=", 1)[0] not in known
        ]

    def _explain(self, message: str) -> str:
        if message.startswith("the following arguments are required") and self._strangers():
            # `--sensitivty low` leaves --sensitivity missing: the misspelling is the news
            return f"{self._unknown_flags(self._strangers())}; {message}"
        m = _INVALID_CHOICE.match(message)
        if not m:
            return message
        value = m.group("value")
        # `uomp audit --limt 5`: the unknown flag left its value to a positional, whose refusal would
        # blame the value; name the flag instead.
        argv = Parser.argv
        for i in range(1, len(argv)):
            flag = argv[i - 1]
            if argv[i] == value and flag.startswith("-") and flag.split("=", 1)[0] not in self._options():
                return self._unknown_flags([flag])
        choices = re.findall(r"'([^']*)'", m.group("choices"))
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"argument {m.group('arg')}: invalid choice: '{value}'{hint}; choose from {', '.join(choices)}"


def _tag_subparsers(parser: argparse.ArgumentParser) -> None:
    """Each subcommand's parser records itself in the namespace, so main() knows whose help to cite."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(_cli_parser=sub)
                _tag_subparsers(sub)


def command_word(argv: Sequence[str]) -> str | None:
    """The top-level command of a command line (the first token that is not a global option or
    its value), or None."""
    skip = False
    for tok in argv:
        if skip:
            skip = False
            continue
        if tok == "--":
            return None
        if tok in _VALUE_OPTIONS:
            skip = True
            continue
        if tok.startswith("-"):
            continue
        return tok
    return None


def modules_for(argv: Sequence[str] | None) -> tuple[str, ...]:
    """The command modules a command line needs: its command's own, and those with an init step
    when it runs the init hooks; all of them when it names no known command (to suggest one) or
    ``argv`` is None (the whole parser)."""
    if argv is None:
        return COMMAND_MODULES
    word = command_word(argv)
    if word is None:
        return ()
    if word not in COMMANDS:
        return COMMAND_MODULES
    own = COMMANDS[word][0]
    if word in INIT_COMMANDS:
        return (own, *(m for m in INIT_HOOK_MODULES if m != own))
    return (own,)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``uomp`` argument parser: every command registered (``argv`` None), or only what the
    command line ``argv`` needs (:func:`modules_for`), the rest as name and help."""
    parser = Parser(
        prog="uomp",
        description="User-Owned Memory Protocol appliance: your memory store, its guard, and the "
        "mTLS gateway that lets remote agents read exactly what you granted.",
    )
    parser.add_argument("--version", action="version", version=f"uomp {__version__}")
    parser.add_argument("--home", help="data directory (default: $UOMP_HOME or ~/.uomp)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = modules_for(argv)
    word = command_word(argv) if argv is not None else None
    # the command's own module registers its parsers; an init-step module is only imported (its
    # step joins INIT_HOOKS at import), so none of its commands' own imports are paid
    own = {COMMANDS[word][0]} if word in COMMANDS else set(wanted)
    for name, (module, text) in COMMANDS.items():
        if module in own:
            if name not in sub.choices:
                importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=text)
    for module in wanted:
        if module not in own:
            importlib.import_module(module)
        elif not any(m == module for m, _t in COMMANDS.values()):  # commands not in COMMANDS: registered all the same
            importlib.import_module(module).register(sub)
    _tag_subparsers(parser)
    return parser


REST_COMMANDS = ("run",)  # commands whose arguments after the first `--` are a command line of their own


def _split_rest(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``uomp [--home H] [-v] run ... -- COMMAND...``: (what argparse reads, COMMAND...); for every
    other command (argv, None), argparse's own ``--`` rule unchanged."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 2 if argv[i] == "--home" else 1
    if i < len(argv) and argv[i] in REST_COMMANDS and "--" in argv[i:]:
        cut = argv.index("--", i)
        return argv[:cut], argv[cut + 1 :]
    return argv, None


# C0 controls and DEL, escaped in a log message: one record is one line, whatever text it quotes
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)} | {0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}


_TEXT_CONTROLS = {c: v for c, v in _CONTROLS.items() if c != 0x0A}  # a traceback keeps its line breaks


class OneLineFormatter(logging.Formatter):
    """Every line that starts at the left margin is a record of its own: a newline or other control
    character in text a message quotes (a name a peer sent) is escaped, and the lines of a traceback
    or stack that follow their record are indented, so an exception's text cannot start a line of
    its own either. Nobody can forge a line of the service's log."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.translate(_CONTROLS)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join("  " + line for line in text.translate(_TEXT_CONTROLS).split("\n"))


def setup_logging(verbose: bool, service: bool = False) -> None:
    """``-v``: DEBUG. A service (``gateway start``, ``guard serve``, ...) logs INFO: its stderr is the
    service's log. A one-shot command says only warnings and errors: its result is its output."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO if service else logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one ``uomp`` command; its exit code. The one place that catches errors and prints them."""
    Parser.argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(Parser.argv)
    head, rest = _split_rest(Parser.argv)
    args, extras = parser.parse_known_args(head)
    if rest is not None:
        args.command_rest = rest
    if extras:
        owner = getattr(args, "_cli_parser", parser)
        assert isinstance(owner, Parser)
        owner.unrecognized(extras)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    setup_logging(args.verbose, service=getattr(args, "service", False))
    # Whatever the caller's umask, nothing this command creates is readable or writable by others
    # (files meant to be shared, like certificates, get their mode set explicitly).
    old_umask = os.umask(0o077)
    os.umask(old_umask | 0o077)
    try:
        rc: int = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return rc
    except UompError as exc:
        print(f"error {exc.code}: {exc.message}", file=sys.stderr)
        details = exc.details or {}
        for line in details.get("lines", []):
            print(f"  {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _closed_pipe()
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            return _closed_pipe()
        _unexpected(
            exc,
            args.verbose,
            code=ErrorCode.IO_ERROR,
            what=_os_error_text(exc),
            fix="check that path and its permissions",
        )
        return 1
    except Exception as exc:  # the one place that turns any failure into one line
        _unexpected(
            exc,
            args.verbose,
            code=ErrorCode.INTERNAL,
            what=f"{type(exc).__name__}: {exc}"[:300],
            fix="this is a bug; run again with -v and report the traceback",
        )
        return 1
    finally:
        os.umask(old_umask)


def _os_error_text(exc: OSError) -> str:
    where = f" {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or type(exc).__name__}:{where}" if where else (exc.strerror or str(exc))


def _unexpected(exc: BaseException, verbose: bool, *, code: ErrorCode, what: str, fix: str) -> None:
    if verbose:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"error {code}: {what}; {fix}" + ("" if verbose else " (-v shows details)"), file=sys.stderr)


def _closed_pipe() -> int:
    """The reader went away (``| head``): say nothing, and keep Python's exit-time flush quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
