"""A preempted run's stop message is said by rank 0 only, whichever launcher named the ranks (torch's
RANK, or MLX's MLX_RANK: every rank of an MLX run used to print it)."""

from __future__ import annotations

import pytest

from dtlab.cliargs import run_command
from dtlab.errors import Preempted


def _preempted() -> int:
    raise Preempted("stopped by SIGINT after step 2")


@pytest.mark.parametrize("env", ["RANK", "MLX_RANK", "OMPI_COMM_WORLD_RANK"])
def test_only_rank_0_says_the_stop(
    env: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("RANK", "MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "DTLAB_MESSAGES_DIR"):
        monkeypatch.delenv(name, raising=False)
    said = []
    for rank in ("0", "1"):
        monkeypatch.setenv(env, rank)
        code = run_command(_preempted)
        said.append(capsys.readouterr().err)
        assert code == Preempted("").exit_code
    assert said[0].count("preempted: stopped by SIGINT after step 2") == 1
    assert said[1] == "", said[1]
