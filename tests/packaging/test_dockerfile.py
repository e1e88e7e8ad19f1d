"""The Dockerfile installs the way the README tells users to: each of its RUN lines is one of the README's
install commands, as written, and its smoke command is the one docs/docker.md gives."""
import os
import re

from . import release_files

ROOT = release_files.ROOT


def read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def install_commands():
    """The commands the README's install section gives: each line of its code blocks, and each `span`."""
    section = re.search(r"^## Install\n(.*?)^## ", read("README.md"), flags=re.S | re.M).group(1)
    blocks = re.findall(r"^```\n(.*?)^```", section, flags=re.S | re.M)
    prose = re.sub(r"^```\n.*?^```", "", section, flags=re.S | re.M)
    return {line for block in blocks for line in block.splitlines()} | set(re.findall(r"`([^`]+)`", prose))


def test_run_lines_are_the_readme_install_commands():
    dockerfile = read("Dockerfile")
    runs = re.findall(r"^RUN (.+)$", dockerfile, flags=re.M)
    assert not [r for r in runs if r.endswith("\\")], "a RUN line goes on to the next: keep each on one line"
    commands = install_commands()
    assert len(runs) == 2, runs  # torch from its index, then hotloop
    for run in runs:
        assert run in commands, f"the Dockerfile runs {run!r}, which the README's install section does not give"
    assert "python3 -m pip install hotloop" in runs
    assert 'python3 -m pip install ".[demo]" && python3 -m hotloop demo' in commands  # the reading itself works
    assert re.search(r"^FROM python:3\.\d+-slim$", dockerfile, flags=re.M)


def test_smoke_command_is_the_one_docs_give():
    dockerfile = read("Dockerfile")
    assert re.search(r'^CMD \["python3", "-m", "hotloop", "doctor"\]$', dockerfile, flags=re.M)
    docs = read("docs/docker.md")
    assert "docker run --rm --gpus all hotloop python3 -m hotloop doctor" in docs
