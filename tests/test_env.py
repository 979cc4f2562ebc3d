import pytest

from nccl_ddp.errors import ConfigError
from nccl_ddp.job.env import DistEnv, resolve_env, slurm_first_node, slurm_tasks_on_node

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "NCCL_DDP_SECRET": "s3",
}


def test_single_process_defaults():
    env = resolve_env(environ={})
    assert env == DistEnv(0, 1, 0, 1, "127.0.0.1", 0, "", False)


def test_torchrun_variables():
    env = resolve_env(environ=dict(TORCHRUN, NCCL_DDP_STORE_HOSTED="1"))
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 4, 1, 2)
    assert (env.master_addr, env.master_port, env.secret) == ("10.0.0.1", 29500, "s3")
    assert env.store_hosted_externally
    assert "s3" not in repr(env)


def test_explicit_args_beat_environment():
    env = resolve_env(rank=3, master_addr="h", master_port=1234, environ=TORCHRUN)
    assert (env.rank, env.world_size, env.master_addr, env.master_port) == (3, 4, "h", 1234)


def test_torchrun_beats_slurm_and_ompi():
    environ = dict(
        TORCHRUN, SLURM_PROCID="0", SLURM_NTASKS="8", OMPI_COMM_WORLD_RANK="2", OMPI_COMM_WORLD_SIZE="3"
    )
    assert resolve_env(environ=environ).world_size == 4


def test_slurm():
    environ = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_NODEID": "1",
        "SLURM_NODELIST": "gpu[03-04]",
        "MASTER_PORT": "2000",
    }
    env = resolve_env(environ=environ)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.master_addr == "gpu03"
    env = resolve_env(environ=dict(environ, MASTER_ADDR="10.1.1.1"))
    assert env.master_addr == "10.1.1.1"


def test_slurm_master_falls_back_to_launch_node():
    environ = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_NODELIST": "rack[1-2]-n[01-04]",
        "SLURM_LAUNCH_NODE_IPADDR": "10.2.0.9",
        "MASTER_PORT": "2000",
    }
    assert slurm_first_node(environ["SLURM_NODELIST"]) is None
    assert resolve_env(environ=environ).master_addr == "10.2.0.9"


def test_slurm_parsers():
    assert slurm_tasks_on_node("4(x2),3", 2) == 3
    assert slurm_tasks_on_node("2", 0) == 2
    assert slurm_first_node("node1,node2") == "node1"
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE"):
        slurm_tasks_on_node("four", 0)


def test_openmpi():
    environ = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "3",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
        "MASTER_PORT": "2000",
    }
    env = resolve_env(environ=environ)
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (2, 3, 2, "127.0.0.1")


@pytest.mark.parametrize(
    "environ, match",
    [
        (dict(TORCHRUN, RANK="4"), "RANK"),
        (dict(TORCHRUN, RANK="-1"), "RANK"),
        (dict(TORCHRUN, WORLD_SIZE="two"), "WORLD_SIZE"),
        (dict(TORCHRUN, WORLD_SIZE="0"), "WORLD_SIZE"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "MASTER_PORT"),
        (dict(TORCHRUN, MASTER_PORT="70000"), "MASTER_PORT"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR"),
        ({k: v for k, v in TORCHRUN.items() if k != "WORLD_SIZE"}, "WORLD_SIZE"),
        (dict(TORCHRUN, LOCAL_RANK="2"), "LOCAL_RANK"),
        (dict(TORCHRUN, LOCAL_WORLD_SIZE="0"), "LOCAL_WORLD_SIZE"),
    ],
)
def test_inconsistent_values_raise(environ, match):
    with pytest.raises(ConfigError, match=match):
        resolve_env(environ=environ)


def test_single_node_needs_no_master_addr():
    environ = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "2000"}
    env = resolve_env(environ=environ)
    assert (env.master_addr, env.local_world_size, env.local_rank) == ("127.0.0.1", 2, 0)


def test_store_port_defaults_to_master_port_and_follows_the_launcher():
    assert resolve_env(environ=TORCHRUN).store_port == 29500
    assert resolve_env(environ=dict(TORCHRUN, NCCL_DDP_STORE_PORT="29611")).store_port == 29611
    # under torchrun its agent's store holds MASTER_PORT: ours takes the next port
    agent = dict(TORCHRUN, TORCHELASTIC_USE_AGENT_STORE="True")
    assert resolve_env(environ=agent).store_port == 29501
    with pytest.raises(ConfigError, match="NCCL_DDP_STORE_PORT=70000"):
        resolve_env(environ=dict(TORCHRUN, NCCL_DDP_STORE_PORT="70000"))


# msrun 2.10's variables (mindspore/parallel/cluster/process_entity/_api.py), worker 1 of 2
MSRUN = {
    "MS_ROLE": "MS_WORKER",
    "RANK_ID": "1",
    "MS_NODE_ID": "1",
    "MS_WORKER_NUM": "2",
    "RANK_SIZE": "2",
    "DEVICE_ID": "1",
    "MS_SCHED_HOST": "10.0.0.7",
    "MS_SCHED_PORT": "8118",
    "MS_TOPO_TIMEOUT": "600",
}


def test_msrun_worker():
    env = resolve_env(environ=MSRUN)
    assert (env.rank, env.world_size, env.local_rank, env.source) == (1, 2, 1, "msrun")
    # next to the scheduler, below its port: MindSpore's workers count up from 8118
    assert (env.master_addr, env.store_port, env.ms_scheduler) == ("10.0.0.7", 8117, False)
    assert resolve_env(environ=dict(MSRUN, NCCL_DDP_STORE_PORT="9000")).store_port == 9000


def test_msrun_scheduler_process_is_marked():
    sched = {k: v for k, v in MSRUN.items() if k not in ("MS_NODE_ID", "DEVICE_ID")}
    env = resolve_env(environ=dict(sched, MS_ROLE="MS_SCHED", RANK_ID="0"))
    assert env.ms_scheduler


def test_msrun_without_rank_id_names_node_rank():
    # several nodes without --node_rank: MindSpore assigns ranks inside its init()
    environ = {k: v for k, v in MSRUN.items() if k not in ("RANK_ID", "MS_NODE_ID")}
    with pytest.raises(ConfigError, match="--node_rank.*get_rank"):
        resolve_env(environ=environ)


def test_lightning_launcher_has_no_rank():
    environ = {
        "WORLD_SIZE": "4",
        "NODE_RANK": "0",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "29500",
    }
    env = resolve_env(environ=environ)
    assert (env.rank, env.world_size, env.local_rank, env.source) == (1, 4, 1, "lightning")
    assert env.store_port == 29501  # rank 0's torch TCPStore holds MASTER_PORT
    env = resolve_env(environ=dict(environ, NODE_RANK="1", LOCAL_WORLD_SIZE="2"))
    assert (env.rank, env.local_world_size) == (3, 2)
    with pytest.raises(ConfigError, match="NODE_RANK=1.*LOCAL_WORLD_SIZE"):
        resolve_env(environ=dict(environ, NODE_RANK="1"))


def test_mpich_intel_pmi():
    environ = {
        "PMI_RANK": "1",
        "PMI_SIZE": "2",
        "MPI_LOCALRANKID": "1",
        "MPI_LOCALNRANKS": "2",
        "MASTER_PORT": "2000",
    }
    env = resolve_env(environ=environ)
    assert (env.rank, env.world_size, env.local_rank, env.source) == (1, 2, 1, "pmi")


@pytest.mark.parametrize(
    "environ, seen",
    [
        ({"RANK_SIZE": "8"}, "RANK_SIZE=8"),  # MindSpore rank table, no RANK_ID
        ({"PMI_SIZE": "2"}, "PMI_SIZE=2"),
        ({"SLURM_NTASKS": "4"}, "SLURM_NTASKS=4"),
        (dict(TORCHRUN, RANK="0", WORLD_SIZE="1", MS_WORKER_NUM="2"), "MS_WORKER_NUM=2"),
    ],
)
def test_a_launcher_saying_several_never_resolves_to_one(environ, seen):
    with pytest.raises(ConfigError, match=f"more than one process \\({seen}.*train alone"):
        resolve_env(environ=environ)


def test_explicit_world_of_one_under_a_launcher_of_several_is_refused():
    with pytest.raises(ConfigError, match="WORLD_SIZE=4.*from the arguments.*world_size"):
        resolve_env(rank=0, world_size=1, environ=TORCHRUN)
    assert resolve_env(rank=0, world_size=1, environ={}).source == "arguments"


def test_slurm_allocation_around_a_launcher_of_one_is_fine():
    # `sbatch --ntasks=4` whose script runs `torchrun --nproc-per-node=1`
    environ = {"RANK": "0", "WORLD_SIZE": "1", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}
    assert resolve_env(environ=environ).world_size == 1
