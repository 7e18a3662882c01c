"""What the README tells a newcomer is true: its commands run after its own set-up, and it says
which torch ``make`` installs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
ACTIVATE = "source .venv/bin/activate"
COMMANDS = ("arq", "lmpool-status", "lmpool-score")
"""The installed commands the README uses."""


def test_the_readme_activates_the_venv_before_its_first_installed_command() -> None:
    """``make demo`` / ``make test`` install into ``.venv`` without activating it: the README
    must say so before its first shell line that runs an installed command."""
    assert ACTIVATE in README
    code = re.findall(r"```bash\n(.*?)```", README, re.S)
    first = next(
        block
        for block in code
        if any(re.search(rf"(^|\s){re.escape(c)}\s", block, re.M) for c in COMMANDS)
    )
    assert README.index(ACTIVATE) < README.index(first)


@pytest.mark.parametrize("command", COMMANDS)
def test_the_readme_commands_run_from_the_activated_venv(command: str) -> None:
    """With only the environment's ``bin`` folder (what activation adds) and the system's on
    ``PATH``, each command the README uses is found and runs."""
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPOOL_")}
    env["PATH"] = f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"
    res = subprocess.run(
        [command, "--help"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert "usage" in res.stdout.lower()


def test_the_readme_says_which_torch_make_installs() -> None:
    """The Makefile's default ``TORCH`` is a plain PyPI requirement (no index PyPI-only machines
    cannot reach): the README names it, does not call it a CPU build, and gives the command
    for the CPU-only one with the same version."""
    makefile = (REPO / "Makefile").read_text()
    match = re.search(r"^TORCH \?= (.+)$", makefile, re.M)
    assert match is not None
    default = match[1].strip()
    assert "--index-url" not in default and "--extra-index-url" not in default
    text = " ".join(README.split())  # as read, whatever the line breaks
    assert f"by default `{default}` from PyPI" in text
    assert "CPU build of torch" not in text and "a CPU build on the development" not in text
    cpu = f'make TORCH="{default} --index-url https://download.pytorch.org/whl/cpu"'
    assert cpu in text
    assert "The CPU build of torch" not in makefile
