"""Every shell command the front documents show is accepted as written.

The ``bash`` blocks of README.md and the user docs are read line by line (continuations
joined, comments dropped, ``&&`` chains split). Each command is checked by the program that
would run it, without starting heavy work: ``vllm-oscar SUBCOMMAND`` and ``python
bench/serve.py`` by their own argument parsers, the OpenAI server by vLLM's parser with the
plugin registered (so ``--kv-cache-dtype oscar`` must be accepted), and scripts by their
existence. Usage synopses written with ``[optional]`` parts and ``a|b`` alternatives are
checked with every optional part present and the first alternative. Commands that only need
a CPU and seconds (``vllm-oscar bits``) also run to the end.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", "docs/serving.md", "docs/usage.md", "docs/distributed.md", "docs/gpu-vllm.md",
             "bench/README.md"]
#: Commands that run to the end here (fast, CPU only).
RUN_TO_END = {"bits"}


def documented_commands() -> list[tuple[str, str]]:
    """(document, command) for every command line of the documents' bash blocks."""
    commands = []
    for name in DOCUMENTS:
        text = (REPO / name).read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                tokens = shlex.split(line, comments=True)
                if not tokens:
                    continue
                for command in " ".join(shlex.quote(t) for t in tokens).split(" '&&' "):
                    commands.append((name, command))
    return commands


def _synopsis_to_tokens(command: str) -> list[str]:
    """Tokens of a command with [optional] brackets opened and a|b alternatives reduced to a."""
    tokens = []
    for token in shlex.split(command):
        if token not in ("[", "]", "..."):
            token = token.strip("[]")
            if "|" in token and not token.startswith("{"):
                token = token.split("|")[0]
            if token and token != "...":
                tokens.append(token)
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):  # environment assignments
        tokens.pop(0)
    return tokens


def _parse_vllm_oscar(tokens: list[str], run: bool) -> None:
    from vllm_oscar import cli

    name = tokens[1]
    assert name in cli.COMMANDS, f"unknown subcommand {name!r}"
    module = importlib.import_module(f"vllm_oscar.commands.{cli.COMMANDS[name][0]}")
    parser = argparse.ArgumentParser(prog=f"vllm-oscar {name}", exit_on_error=False)
    module.add_arguments(parser)
    parser.parse_args(tokens[2:])
    if run:
        assert cli.main(tokens[1:]) == 0


def _parse_server(tokens: list[str]) -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_oscar import register

    register()
    make_arg_parser(FlexibleArgumentParser()).parse_args(tokens[3:])


@pytest.mark.parametrize("document,command", documented_commands())
def test_documented_command_is_accepted(document: str, command: str) -> None:
    tokens = _synopsis_to_tokens(command)
    program = tokens[0]
    if program == "vllm-oscar":
        _parse_vllm_oscar(tokens, run=tokens[1] in RUN_TO_END)
    elif program in ("python", "python3") and tokens[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]:
        _parse_server(tokens)
    elif program in ("python", "python3") and tokens[1] == "bench/serve.py":
        import sys

        sys.path.insert(0, str(REPO / "bench"))
        try:
            importlib.import_module("serve").parse_args(tokens[2:])
        finally:
            sys.path.remove(str(REPO / "bench"))
    elif program in ("python", "python3", "bash", "source") and not tokens[1].startswith("-"):
        assert (REPO / tokens[1]).is_file(), f"{document}: {tokens[1]} does not exist"
    elif program in ("python", "python3") and tokens[1:3] == ["-m", "pytest"]:
        for path in tokens[3:]:
            if not path.startswith("-") and "/" in path:
                assert (REPO / path).exists(), f"{document}: {path} does not exist"
    elif program == "cp":
        assert (REPO / tokens[-2]).exists(), f"{document}: {tokens[-2]} does not exist"
    elif program in ("pip", "git", "echo", "sed", "mkdir"):
        return  # installs and checkout housekeeping: not runnable in a test
    else:
        pytest.fail(f"{document}: no check for the command {command!r}; add one here")
