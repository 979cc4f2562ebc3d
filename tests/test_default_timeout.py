"""One default bound for every blocking wait: `nccl_ddp.job.env.DEFAULT_TIMEOUT` (300 s) is what
init_process_group, the store, the host backend, device streams and the profiler default to, and
no other module writes the number again (it was written in five places)."""

import ast
import inspect

from paths import ROOT

from nccl_ddp.comm import api
from nccl_ddp.comm.host.backend import HostProcessGroup
from nccl_ddp.device import cuda, host
from nccl_ddp.job import env
from nccl_ddp.profiling import timeline
from nccl_ddp.store import client

# a 300 that is not the default wait: torchrun's exit barrier, a bound of its own
OTHER_300 = {"nccl_ddp/launch/rendezvous.py": "EXIT_BARRIER_TIMEOUT"}


def _default(fn, name="timeout"):
    return inspect.signature(fn).parameters[name].default


def test_the_defaults_are_the_one_constant():
    assert env.DEFAULT_TIMEOUT == 300.0
    for fn in (
        api.init_process_group,
        client.connect_store,
        client.TCPStore.__init__,
        HostProcessGroup.__init__,
    ):
        assert _default(fn) is env.DEFAULT_TIMEOUT, fn.__qualname__
    # what a device event's synchronize() waits when given no timeout
    assert timeline.SYNC_TIMEOUT is host.DEFAULT_TIMEOUT is cuda.DEFAULT_TIMEOUT is env.DEFAULT_TIMEOUT


def _literal_300s(path) -> list:
    tree = ast.parse(path.read_text())
    allowed = OTHER_300.get(path.relative_to(ROOT).as_posix())
    named = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == allowed for t in node.targets)
    }
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and type(node.value) in (int, float)
        and node.value == 300
        and id(node) not in named
    ]


def test_no_module_writes_300_for_a_wait_of_its_own():
    found = {
        p.relative_to(ROOT).as_posix(): lines
        for p in sorted((ROOT / "nccl_ddp").rglob("*.py"))
        if p.name != "env.py" and "300" in p.read_text() and (lines := _literal_300s(p))
    }
    assert not found, f"use nccl_ddp.job.env.DEFAULT_TIMEOUT instead of 300 at {found}"
