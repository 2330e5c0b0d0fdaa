"""Every `sfttool ...` command shown in README.md, docs/ and examples/ parses:
the subcommand exists, every option it uses exists, and every built-in config
it names is shipped. (Behaviour of each command is tested in its own module.)"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from sfttool.cli.main import cli
from sfttool.config import list_configs

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("README.md"))]
CONFIG_TAKING = {"train", "copy-cfg", "check-custom-dataset", "process-dataset"}


def _commands(path: Path) -> list[tuple[str, bool]]:
    """(command line, shown as a transcript with `$ `) for each sfttool call in a fenced block."""
    found = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", path.read_text(), re.S):
        block = block.replace("\\\n", " ")
        for line in block.splitlines():
            line = line.strip()
            transcript = line.startswith("$ ")
            line = line[2:] if transcript else line
            if line.startswith("sfttool "):
                found.append((line, transcript))
    return found


def _is_synopsis(line: str) -> bool:
    """Reference lines like `sfttool train CONFIG [--seed N]` or a command table's
    `sfttool env      versions of ...`: placeholders and descriptions, not a command."""
    return bool(re.search(r"\s\[-|\s[A-Z][A-Z_]{2,}\b|\S {3,}[a-z]", line.split("#")[0]))


# Synopsis lines (placeholders, a command table's descriptions) are reference text, not commands.
ALL = [(p.relative_to(ROOT).as_posix(), line, transcript)
       for p in DOCS for line, transcript in _commands(p) if not _is_synopsis(line)]


def test_the_docs_show_commands():
    assert len(ALL) >= 20


@pytest.mark.parametrize("doc,line,transcript", ALL, ids=[f"{d}:{i}" for i, (d, _, _) in enumerate(ALL)])
def test_documented_command_parses(doc, line, transcript):
    args = shlex.split(line, comments=True)[1:]
    ctx = cli.make_context("sfttool", list(args), resilient_parsing=True)
    command, rest = cli, ctx.protected_args + ctx.args
    path = []
    while isinstance(command, click.Group) and rest:
        name, command, rest = command.resolve_command(ctx, rest)
        assert command is not None, f"{doc}: unknown command in `{line}`"
        path.append(name)
        if not isinstance(command, click.Group):
            known = {opt for param in command.params for opt in param.opts + param.secondary_opts}
            unknown = [a.split("=")[0] for a in rest if a.startswith("-") and not a[1:2].isdigit()
                       and a.split("=")[0] not in known | {"--help", "-h"}]
            assert not unknown, f"{doc}: `{line}` uses options {command.name} does not have: {unknown}"
        ctx = command.make_context(name, list(rest), parent=ctx, resilient_parsing=True)
        rest = ctx.protected_args + ctx.args if isinstance(command, click.Group) else []
    if path and path[-1] in CONFIG_TAKING and not transcript:
        target = ctx.params.get("config") or ctx.params.get("name")
        if target and "/" not in target and not target.endswith(".py") and target.isidentifier():
            assert target in list_configs(), f"{doc}: `{line}` names a config that is not shipped"


def test_every_docs_page_is_linked_from_the_docs_index():
    index = (ROOT / "docs" / "README.md").read_text()
    linked = {target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", index)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md"}
    missing = sorted(pages - linked)
    assert not missing, f"docs/README.md does not link {missing}"
