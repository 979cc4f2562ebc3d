"""horovodrun's command line mapped onto nccl-ddp-run (nccl_ddp/launch/horovodrun.py), and the
Horovod op/scale argument checks; no processes are started here."""

import socket

import pytest

from nccl_ddp.errors import ConfigError
from nccl_ddp.horovod.common import Adasum, Average, Max, Sum, resolve_op, split_counts
from nccl_ddp.launch.horovodrun import to_nccl_ddp_run


def test_np_and_local_hosts_become_nproc_per_node():
    args, env = to_nccl_ddp_run(["-np", "2", "-H", "localhost:4", "python", "train.py", "--lr", "1"])
    assert args == ["--nproc-per-node", "2", "--nnodes", "1", "train.py", "--lr", "1"]
    assert env == {}
    args, _ = to_nccl_ddp_run(["-np", "1", "python3", "-m", "pkg.train"])
    assert args[-2:] == ["-m", "pkg.train"]
    args, _ = to_nccl_ddp_run(["-np", "2", "./train.sh", "x"])
    assert args[-3:] == ["--no-python", "./train.sh", "x"]


def test_hostfile_and_fusion_threshold(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text(f"# comment\nlocalhost slots=1\n{socket.gethostname()}:2\n")
    args, env = to_nccl_ddp_run(
        ["-np", "3", "--hostfile", str(hosts), "--fusion-threshold-mb", "8", "python", "t.py"]
    )
    assert args[:2] == ["--nproc-per-node", "3"]
    assert env == {"HOROVOD_FUSION_THRESHOLD": str(8 * 2**20)}


@pytest.mark.parametrize(
    "argv, match",
    [
        (["-np", "2", "-H", "otherhost:2", "python", "t.py"], r"\['otherhost'\] are not this machine"),
        (["-np", "5", "-H", "localhost:4", "python", "t.py"], "-np 5 is more than the 4 slots"),
        (["-np", "0", "python", "t.py"], "-np must be >= 1"),
        (["-np", "2"], "no command given"),
        (["-np", "2", "-H", "localhost:x", "python", "t.py"], "is not host:slots"),
    ],
)
def test_bad_command_lines_are_named(argv, match):
    with pytest.raises(ConfigError, match=match):
        to_nccl_ddp_run(argv)


def test_ops_and_their_refusals():
    assert resolve_op(None, None, "w") == Average
    assert resolve_op(None, False, "w") == Sum
    assert resolve_op(Max, None, "w") == Max
    with pytest.raises(ConfigError, match="Adasum is not supported"):
        resolve_op(Adasum, None, "hvd.allreduce")
    with pytest.raises(ConfigError, match="unknown op 42"):
        resolve_op(42, None, "hvd.allreduce")
    with pytest.raises(ConfigError, match="not both"):
        resolve_op(Sum, True, "hvd.allreduce")


def test_reducescatter_split_is_horovods():
    assert split_counts(5, 2) == (3, 2)
    assert split_counts(7, 3) == (3, 2, 2)
    assert split_counts(1, 2) == (1, 0)


def test_fusion_threshold_is_the_bucket_cap(monkeypatch):
    from nccl_ddp.horovod.common import fusion_threshold_mb

    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    assert fusion_threshold_mb() is None  # our default (25 MiB)
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(64 * 2**20))
    assert fusion_threshold_mb() == 64.0
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "64MB")
    with pytest.raises(ConfigError, match="HOROVOD_FUSION_THRESHOLD='64MB' is not a whole number of bytes"):
        fusion_threshold_mb()


def test_horovods_launcher_variables_are_read(monkeypatch):
    """Started by Horovod's own launcher (gloo mode): HOROVOD_RANK/SIZE/LOCAL_* become ours."""
    from nccl_ddp.horovod.common import _map_horovod_launcher_vars
    from nccl_ddp.job.env import resolve_env

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # restored after the test
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    horovods = {
        "HOROVOD_RANK": "1",
        "HOROVOD_SIZE": "2",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
    }
    for k, v in {**horovods, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(k, v)
    _map_horovod_launcher_vars()
    env = resolve_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 2, 1, 2)


def test_launchers_export_horovods_rank_variables_before_init():
    """nccl-ddp-run (and so horovodrun) gives each worker HOROVOD_RANK/SIZE/LOCAL_*/CROSS_* as
    Horovod's launcher does: a script may read them before hvd.init()."""
    from nccl_ddp.launch.config import LaunchConfig
    from nccl_ddp.launch.launcher import worker_env

    config = LaunchConfig(
        entrypoint="train.py",
        nnodes=2,
        node_rank=1,
        nproc_per_node=2,
        master_addr="n0",
        master_port=5,
        secret="s",
    )
    env = worker_env(config, 2, 1, 1, 5, "s", 6)
    got = {k: env[k] for k in env if k.startswith("HOROVOD_") and k[8:] in _RANK_VARS}
    assert got == {
        "HOROVOD_RANK": "3",
        "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "2",
    }


_RANK_VARS = {"RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"}
