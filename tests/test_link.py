"""Bandwidth-capped links: parsing, the namespace's life (always removed), the rate really enforced,
and a clear error without the permission to create one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from dtlab.bench.link import Link, link_namespace, measure_link, parse_links
from dtlab.errors import DtlabError

CAN = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(not CAN, reason="needs root and iproute2 (ip, tc)")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_links_parse_and_bad_ones_are_named() -> None:
    assert parse_links("none, 100mbit,2.5GBIT") == [
        Link("none", None), Link("100mbit", 1e8), Link("2.5gbit", 2.5e9),
    ]  # fmt: skip
    for bad, message in [
        ("1.5foo", "'1.5foo' is not a rate"),
        ("100mb", "'100mb' is not a rate"),
        ("0kbit", "allowed rates are 1kbit to 1000gbit"),
        ("5000gbit", "allowed rates are 1kbit to 1000gbit"),
        ("1gbit,1gbit", "names a link twice"),
        ("", "'' is not a rate"),
    ]:
        with pytest.raises(DtlabError, match=message):
            parse_links(bad)


@needs_root
def test_the_namespace_lives_only_inside_and_caps_the_rate() -> None:
    before = _namespaces()
    with link_namespace(parse_links("100mbit")[0]) as prefix:
        name = prefix[-1]
        assert name in _namespaces() - before
        rate = measure_link(prefix, 8 << 20)
        assert 70e6 < rate < 110e6, rate  # the cap, not loopback's gigabytes per second
    assert _namespaces() == before
    with pytest.raises(RuntimeError, match="inside"), link_namespace(parse_links("1gbit")[0]):
        raise RuntimeError("inside")
    assert _namespaces() == before
    with link_namespace(parse_links("none")[0]) as prefix:
        assert prefix == []


def _as_nobody(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in this interpreter with root dropped (user nobody, no groups)."""
    return subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", code],
        capture_output=True, text=True,
    )  # fmt: skip


@needs_root
def test_without_permission_it_is_a_clear_error_and_nothing_is_created() -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to drop root")
    # A checkout in a directory only root can read (a mktemp -d one) leaves nobody unable to start
    # this interpreter or import dtlab: there is then no message of dtlab's to judge.
    probe = _as_nobody("import dtlab.bench.link")
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        pytest.skip(f"user nobody cannot run {sys.executable} with dtlab from here ({last})")
    before = _namespaces()
    proc = _as_nobody(
        "from dtlab.bench.link import link_namespace, parse_links\n"
        "with link_namespace(parse_links('100mbit')[0]): pass\n"
    )
    assert proc.returncode != 0
    assert "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)" in proc.stderr
    assert _namespaces() == before


def test_the_time_to_loss_model_shares_the_link_between_the_ranks() -> None:
    """Every rank sends its wire bytes through the namespace's one rate-limited loopback at once: the
    prediction counts all of them (DDP at 100 Mbit/s measured 2.08 s of communication a step, twice
    what one rank's bytes alone would take)."""
    from dtlab.bench.lowcomm import NPROC, predict

    common = {"method": "ddp", "wire_bytes_per_step": 1e6}
    rows = [
        {**common, "link": "none", "link_measured_bps": 1e12, "mean_step_time_s": 0.5},
        {**common, "link": "100mbit", "link_measured_bps": 1e8, "mean_step_time_s": 0.7},
    ]
    predict(rows)
    compute = 0.5 - 8 * NPROC * 1e6 / 1e12
    assert rows[0]["compute_time_s"] == rows[1]["compute_time_s"] == pytest.approx(compute)
    assert rows[1]["predicted_step_time_s"] == pytest.approx(compute + 8 * NPROC * 1e6 / 1e8)
