import os

import pytest
from gpu_probe import HAS_GPU


def pytest_collection_finish(session):
    """The ranks of `run_ranks` fork from a server that imports torch & co. once: start it while
    the first tests run, where a selected test's module uses run_ranks (tests/support/mp.py)."""
    if any(getattr(getattr(item, "module", None), "run_ranks", None) is not None for item in session.items):
        from mp import start_forkserver

        start_forkserver()


def pytest_collection_modifyitems(config, items):
    config._nccl_ddp_items = items
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found by CuPy)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- "slow" means over 2 s, setup and teardown included: report unmarked tests that take longer
SLOW_LIMIT_S = float(os.environ.get("NCCL_DDP_SLOW_LIMIT_S", "2"))
_durations: dict = {}


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def _unmarked_over_limit(config) -> list:
    marked = {item.nodeid for item in getattr(config, "_nccl_ddp_items", []) if "slow" in item.keywords}
    return sorted(
        ((d, n) for n, d in _durations.items() if d > SLOW_LIMIT_S and n not in marked), reverse=True
    )


def pytest_sessionfinish(session, exitstatus):
    """NCCL_DDP_STRICT_SLOW=1 (scripts/test.sh --fast in CI): an unmarked test over the limit fails
    the run."""
    if (
        os.environ.get("NCCL_DDP_STRICT_SLOW") == "1"
        and exitstatus == 0
        and _unmarked_over_limit(session.config)
    ):
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Lists the tests not marked `slow` that took over SLOW_LIMIT_S, so that `--fast` stays fast."""
    over = _unmarked_over_limit(config)
    if not over:
        return
    terminalreporter.section(f"unmarked tests over {SLOW_LIMIT_S:.0f} s, setup included (mark them slow)")
    for d, n in over:
        terminalreporter.write_line(f"{d:6.2f} s  {n}")
