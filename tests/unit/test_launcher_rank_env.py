"""detect_rank_env under fake zeroengine/torchrun, SLURM and OpenMPI environments."""
import pytest

from zeroengine.launcher.rank_env import RankEnv, detect_rank_env, expand_nodelist, expand_tasks_per_node


def test_no_launcher_means_single_process():
    assert detect_rank_env({}) is None
    assert detect_rank_env({"MASTER_ADDR": "x", "PATH": "/bin"}) is None


def test_torchrun_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "GROUP_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "1234"}
    r = detect_rank_env(env)
    assert r == RankEnv(rank=5, world_size=8, local_rank=1, local_world_size=4,
                        node_rank=1, master_addr="node0", master_port=1234, source="env")
    assert r.torch_env()["RANK"] == "5" and r.torch_env()["NODE_RANK"] == "1"


def test_torchrun_defaults():
    # Hand-set RANK/WORLD_SIZE: one node, local == global, default master.
    r = detect_rank_env({"RANK": "1", "WORLD_SIZE": "2"})
    assert (r.local_rank, r.local_world_size, r.node_rank) == (1, 2, 0)
    assert (r.master_addr, r.master_port) == ("127.0.0.1", 29500)
    # Node rank inferred from packed ranks when no GROUP_RANK/NODE_RANK.
    r = detect_rank_env({"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2",
                         "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n0"})
    assert r.node_rank == 1


@pytest.mark.parametrize("env, names", [
    ({"RANK": "0"}, ["RANK", "WORLD_SIZE"]),
    ({"WORLD_SIZE": "2"}, ["RANK", "WORLD_SIZE"]),
    ({"LOCAL_RANK": "0"}, ["LOCAL_RANK", "RANK", "WORLD_SIZE"]),
    ({"RANK": "2", "WORLD_SIZE": "2"}, ["RANK=2", "WORLD_SIZE=2"]),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, ["RANK=-1"]),
    ({"RANK": "0", "WORLD_SIZE": "0"}, ["WORLD_SIZE=0"]),
    ({"RANK": "x", "WORLD_SIZE": "2"}, ["RANK='x'"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, ["LOCAL_RANK"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"]),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
      "GROUP_RANK": "0", "NODE_RANK": "1", "MASTER_ADDR": "a"}, ["GROUP_RANK=0", "NODE_RANK=1"]),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
     ["MASTER_ADDR", "WORLD_SIZE=4"]),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, ["MASTER_PORT=70000"]),
])
def test_inconsistent_torch_variables(env, names):
    with pytest.raises(ValueError) as info:
        detect_rank_env(env)
    for name in names:
        assert name in str(info.value)


SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
         "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2(x2)",
         "SLURM_JOB_NODELIST": "gpu[07-08]"}


def test_slurm():
    r = detect_rank_env(SLURM)
    assert r == RankEnv(3, 4, 1, 2, 1, "gpu07", 29500, "slurm")


def test_slurm_variants():
    env = dict(SLURM, SLURM_TASKS_PER_NODE="3,1", SLURM_PROCID="3", SLURM_LOCALID="0",
               MASTER_ADDR="head", MASTER_PORT="4000")
    r = detect_rank_env(env)
    assert (r.local_world_size, r.master_addr, r.master_port) == (1, "head", 4000)
    env = {k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"}
    assert detect_rank_env(dict(env, SLURM_NTASKS_PER_NODE="2")).local_world_size == 2
    # The step's node list wins over the job's (srun may use a subset).
    r = detect_rank_env(dict(SLURM, SLURM_STEP_NODELIST="gpu08,gpu09",
                             SLURM_STEP_TASKS_PER_NODE="2,2"))
    assert r.master_addr == "gpu08"
    # RANK/WORLD_SIZE win: a zeroengine launcher started inside a SLURM job.
    r = detect_rank_env(dict(SLURM, RANK="0", WORLD_SIZE="2"))
    assert (r.source, r.world_size) == ("env", 2)


@pytest.mark.parametrize("change, names", [
    ({"SLURM_NTASKS": None}, ["SLURM_NTASKS"]),
    ({"SLURM_LOCALID": None}, ["SLURM_LOCALID"]),
    ({"SLURM_TASKS_PER_NODE": None}, ["SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"]),
    ({"SLURM_PROCID": "4"}, ["SLURM_PROCID=4", "SLURM_NTASKS=4"]),
    ({"SLURM_LOCALID": "2"}, ["SLURM_LOCALID=2", "SLURM_TASKS_PER_NODE=2"]),
    ({"SLURM_NODEID": "2"}, ["SLURM_NODEID=2", "SLURM_TASKS_PER_NODE"]),
    ({"SLURM_TASKS_PER_NODE": "2(y2)"}, ["SLURM_TASKS_PER_NODE"]),
    ({"SLURM_JOB_NODELIST": "gpu[07-08"}, ["SLURM_JOB_NODELIST"]),
])
def test_inconsistent_slurm(change, names):
    env = dict(SLURM)
    for key, value in change.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    with pytest.raises(ValueError) as info:
        detect_rank_env(env)
    for name in names:
        assert name in str(info.value)


def test_openmpi():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "MASTER_ADDR": "host0"}
    assert detect_rank_env(env) == RankEnv(2, 4, 0, 2, 1, "host0", 29500, "openmpi")
    single_node = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                   "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert detect_rank_env(single_node) == RankEnv(1, 2, 1, 2, 0, "127.0.0.1", 29500,
                                                   "openmpi")
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_SIZE"):
        detect_rank_env({"OMPI_COMM_WORLD_RANK": "0"})
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect_rank_env(dict(env, MASTER_ADDR=""))


def test_expand_nodelist():
    assert expand_nodelist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_nodelist("a1,b[8-10],c") == ["a1", "b8", "b9", "b10", "c"]
    assert expand_nodelist("r[1-2]-n[1,3]") == ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]
    for bad in ("n[1-", "n1]", "n[a-b]", "n[3-1]", ""):
        with pytest.raises(ValueError):
            expand_nodelist(bad)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
