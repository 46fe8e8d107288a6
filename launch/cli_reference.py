"""docs/cli.md, generated: every ``launch`` command's usage, description and options (from the click commands
themselves) and every environment variable (from ``zserve.environment``).

    .venv/bin/python -m launch.cli_reference --write    # regenerate docs/cli.md
    .venv/bin/python -m launch.cli_reference --check    # exit 1 if docs/cli.md is stale
    .venv/bin/python -m launch.cli_reference            # print the page

The page is the same on every machine: a default is shown as declared (never read from the environment, as
``--api-key``'s ``ZSERVE_API_KEY`` would be), and a default that is not a plain value (a function, which could
depend on the machine) stops the generator until the option declares a plain one and says the rest in its help.
"""

from __future__ import annotations

import argparse
import inspect
import math
import re
import sys
from pathlib import Path

import click

from zserve.environment import ENVIRONMENT, SCOPES

PAGE = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
REGENERATE = ".venv/bin/python -m launch.cli_reference --write"

_UNSET = getattr(click.core, "UNSET", None)  # click >= 8.3: the default of an option declared without one

ARGUMENTS = {
    ("launch scale", "tier"): "The tier to scale: the gateways (`api-server`) or one model's engines (`engine`).",
    ("launch scale", "count"): "How many processes the tier should have.",
    ("launch bench", "more_slos"): "More goodput SLOs, as `--goodput` takes them.",
    ("launch keys hash", "key"): "The API key to hash; left out, it is read from standard input (kept out of the "
                                 "shell's history).",
}
"""Help of the commands' arguments, which click's arguments cannot carry; a new argument without one stops the
generator."""


def _md(text: str) -> str:
    """Markdown-safe prose: ``*`` and word-edge ``_`` escaped outside code spans, newlines joined, ``|`` escaped
    everywhere (the text may sit in a table cell)."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):  # outside backticks
        parts[i] = re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", parts[i].replace("*", r"\*"))
        parts[i] = parts[i].replace("<", "&lt;")
    return "`".join(parts).replace("|", r"\|")


def _code(text: str) -> str:
    return f"`{text}`".replace("|", r"\|")


def _paragraphs(help_text: str | None) -> list[str]:
    text = inspect.cleandoc(help_text or "").split("\f")[0]
    return [_md(p) for p in re.split(r"\n\s*\n", text) if p.strip()]


def _number(value: float) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _range(t: click.IntRange | click.FloatRange, kind: str) -> str:
    low = f"{_number(t.min)} {'<' if t.min_open else '≤'} " if t.min is not None else ""
    high = f" {'<' if t.max_open else '≤'} {_number(t.max)}" if t.max is not None else ""
    return f"{kind}, {low}x{high}" if low or high else kind


def _value(param: click.Parameter) -> str:
    """What the option takes: choices, a number and its range, a path, or its metavar."""
    t = param.type
    if isinstance(param, click.Option) and param.is_flag:
        return "flag"
    if isinstance(t, click.Choice):
        desc = _code("|".join(map(str, t.choices)))
    elif isinstance(t, (click.IntRange, click.FloatRange)):
        desc = _range(t, "integer" if isinstance(t, click.IntRange) else "number")
    elif isinstance(t, click.Path):
        desc = "file" if not t.dir_okay else "directory" if not t.file_okay else "path"
    elif t is click.INT:
        desc = "integer"
    elif t is click.FLOAT:
        desc = "number"
    else:
        desc = "text"
    if param.metavar and isinstance(param, click.Option):
        desc = _code(param.metavar) if desc == "text" else f"{_code(param.metavar)}: {desc}"
    if param.multiple or param.nargs == -1:
        desc += ", repeatable"
    return desc


def _default(param: click.Parameter, ctx: click.Context) -> str:
    """The declared default, never one from the environment; ``—`` when there is none (the help says what
    applies then)."""
    if param.required:
        return "required"
    default = param.get_default(ctx, call=False)
    if callable(default):
        raise TypeError(f"{ctx.command_path} {param.name}: a computed default may differ between machines; "
                        "declare a plain one (None) and say what applies in the help")
    if isinstance(param, click.Option) and param.is_flag:
        return "on" if default is True else "off"
    if default is None or default is _UNSET or default == ():
        return "—"
    values = default if isinstance(default, (tuple, list)) else (default,)
    return ", ".join(_code(_number(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))
                     for v in values)


def _names(param: click.Parameter) -> str:
    if isinstance(param, click.Argument):
        return _code(param.metavar or param.name.upper())
    names = ", ".join(_code(o) for o in param.opts)
    if param.secondary_opts:
        names += " / " + " ".join(_code(o) for o in param.secondary_opts)
    return names


def _help(param: click.Parameter, ctx: click.Context) -> str:
    text = _md(getattr(param, "help", None) or ARGUMENTS.get((ctx.command_path, param.name), ""))
    envvars = getattr(param, "envvar", None) or ()
    envvars = [e for e in ((envvars,) if isinstance(envvars, str) else envvars) if e not in text]
    if envvars:  # one the help does not name already
        text += f"{' ' if text else ''}Environment: {', '.join(_code(e) for e in envvars)}."
    return text


def _command(cmd: click.Command, ctx: click.Context) -> list[str]:
    usage = f"{ctx.command_path} {' '.join(cmd.collect_usage_pieces(ctx))}"
    lines = [f"## {_code(ctx.command_path)}", "", "```", usage, "```", ""]
    for paragraph in _paragraphs(cmd.help):
        lines += [paragraph, ""]
    params = [p for p in cmd.params if not getattr(p, "hidden", False)]
    if params:
        lines += ["| Option | Value | Default | Description |", "|---|---|---|---|"]
        for p in params:
            help_text = _help(p, ctx)
            if not help_text:
                raise ValueError(f"{ctx.command_path} {p.opts[0] if p.opts else p.name}: no help text")
            lines.append(f"| {_names(p)} | {_value(p)} | {_default(p, ctx)} | {help_text} |")
        lines.append("")
    return lines


def _commands(group: click.Group, ctx: click.Context) -> list[tuple[click.Command, click.Context]]:
    """Every command under ``group``, depth first, in the order they were declared (the order of ``--help``)."""
    found = []
    for name, cmd in group.commands.items():
        if cmd.hidden:
            continue
        sub = click.Context(cmd, info_name=name, parent=ctx)
        found.append((cmd, sub))
        if isinstance(cmd, click.Group):
            found += _commands(cmd, sub)
    return found


def _environment() -> list[str]:
    lines = ["## Environment variables", "",
             "Written once in `zserve/environment.py`; a test fails when a `ZSERVE_*` name in the repository, or a "
             "variable the code reads, is missing there.", ""]
    for scope, heading in SCOPES.items():
        entries = [e for e in ENVIRONMENT if e.scope == scope]
        if not entries:
            continue
        lines += [f"### {heading}", "", "| Variable | Default | Meaning | Read by |", "|---|---|---|---|"]
        for e in entries:
            where = ", ".join(w if w.startswith("(") else _code(w) for w in e.read_by)
            lines.append(f"| {_code(e.name)} | {_md(e.default)} | {_md(e.meaning)} | {_md(where)} |")
        lines.append("")
    return lines


def render(group: click.Group | None = None, name: str = "launch") -> str:
    """The whole page."""
    if group is None:
        from .cli import main as group
    ctx = click.Context(group, info_name=name)
    commands = _commands(group, ctx)
    lines = [f"# `{name}` and environment reference", "",
             f"<!-- Generated from launch/cli.py and zserve/environment.py; do not edit. Regenerate: {REGENERATE} "
             "(tests/unit/test_cli_reference.py fails while it is stale). -->", ""]
    lines += [*_paragraphs(group.help), "",
              "Every command takes `-h`/`--help`. A default of — means none: the option's description says what "
              "applies then.", ""]
    for cmd, sub in commands:
        summary = _md(cmd.get_short_help_str(limit=200))
        anchor = sub.command_path.replace(" ", "-")
        lines.append(f"- [{_code(sub.command_path)}](#{anchor}): {summary}")
    lines.append("")
    for cmd, sub in commands:
        lines += _command(cmd, sub)
    lines += _environment()
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.cli_reference", description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help=f"write {PAGE.name} in docs/")
    action.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md differs from the commands")
    args = parser.parse_args(argv)
    page = render()
    if args.write:
        PAGE.write_text(page)
    elif args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"docs/cli.md is stale: regenerate it with {REGENERATE}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
