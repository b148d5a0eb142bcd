"""`megarl`'s command line: parsing, `--help` and argument errors import nothing heavy."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "yaml", "megatron", "vllm", "transformers", "transformer_engine", "wandb")


def test_parsing_help_and_argument_errors_import_nothing_heavy():
    """`megarl --help` and a mistyped option answer in a tenth of a second: the commands'
    modules (torch, 2 s) load only when a command runs (`megarl.cli` docstring)."""
    code = (
        "import sys, contextlib, io\n"
        "import megarl.cli as cli\n"
        "cli.parse_args(['train'])\n"
        "for argv in (['--help'], ['train', '--bogus'], ['convert', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), "
        "contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            cli.parse_args(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        f"bad = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
