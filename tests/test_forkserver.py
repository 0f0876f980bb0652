"""The fork server's children are the processes their shims stand for: the descriptors a parent
passes a child by number (``subprocess``'s ``pass_fds``, as Inductor's compile workers are started)
are there under the same numbers, beside the shim's standard streams."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PYTHON, cli_env

SCRIPT = """
import os, sys
from dtlab.runtime import forkserver
assert forkserver.forked(), "not a fork server's child"
read_fd, write_fd = int(sys.argv[1]), int(sys.argv[2])
got = os.read(read_fd, 100)
os.write(write_fd, b"child read " + got)
print("streams still work", flush=True)
"""


@pytest.mark.skipif(sys.executable == PYTHON, reason="the tests run without a fork server")
def test_a_child_gets_the_descriptors_its_parent_passed_under_their_numbers(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    # Numbers that collide with what the server's child holds at first (low ones), and a high one.
    high = os.dup2(from_child_w, 200)
    os.close(from_child_w)
    try:
        os.write(to_child_w, b"hello")
        proc = subprocess.run(
            [PYTHON, str(script), str(to_child_r), str(high)],
            pass_fds=(to_child_r, high), env=cli_env(), capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "streams still work\n"
        assert os.read(from_child_r, 100) == b"child read hello"
    finally:
        for fd in (to_child_r, to_child_w, from_child_r, high):
            os.close(fd)
