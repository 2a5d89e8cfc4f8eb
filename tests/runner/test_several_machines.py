"""Several machines: DeepSpeed's hostfile, torchrun's rendezvous started on every node (NNODES, NODE_RANK,
MASTER_ADDR, MASTER_PORT) and Slurm (srun, one task per node: the same read from Slurm's variables). The slow
tests run two "nodes" on this machine, each a process of the script with its CPU ranks, sharing one folder as
nodes share a file system."""
import os
import re
import subprocess

import pytest

from sat_patches.core.ports import free_port
from sat_patches.runner import cluster, finetune_run
from test_finetune_scripts import ROOT, SCRIPTS, run
from test_global_batch import gpu_box


@pytest.mark.parametrize("nodelist, first", [("node[01-04]", "node01"), ("a,b", "a"), ("gpu7", "gpu7"),
                                             ("n[3,5-7],m1", "n3"), ("rack1-n[08-10]-ib,x", "rack1-n08-ib")])
def test_the_first_host_of_a_slurm_node_list(nodelist, first, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the list's own first entry
    assert cluster.first_host(nodelist) == first


SLURM = {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
         "SLURM_NTASKS": "2", "SLURM_GPUS_ON_NODE": "8"}


def test_inside_srun_the_nodes_come_from_slurms_variables_and_the_users_settings_win():
    env = finetune_run.settings(dict(SLURM, MODEL_KIND="cogvlm", CUDA_VISIBLE_DEVICES="0"))
    assert (env["NNODES"], env["NODE_RANK"], env["MASTER_ADDR"], env["NUM_GPUS_PER_WORKER"]) == ("2", "1", "gpu07", "8")
    env = finetune_run.settings(dict(SLURM, MODEL_KIND="cogvlm", CUDA_VISIBLE_DEVICES="0", MASTER_ADDR="10.0.0.9"))
    assert env["MASTER_ADDR"] == "10.0.0.9"
    outside = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}  # sbatch's own shell, not a job step
    assert finetune_run.settings(dict(outside, MODEL_KIND="cogvlm", CUDA_VISIBLE_DEVICES="0"))["NNODES"] == "1"


def test_every_node_starts_its_ranks_under_torchrun_and_a_hostfile_keeps_deepspeeds_launcher(tmp_path):
    box = dict(gpu_box(tmp_path, "8x80"), NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29400")
    out = run(SCRIPTS["cogvlm"], box, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    [cmd] = [line for line in out.stdout.splitlines() if line.startswith("+ ")]
    assert re.search(r"-m torch\.distributed\.run --nproc-per-node 8 --nnodes 2 --node-rank 1 "
                     r"--master-addr 10\.0\.0\.1 --master-port 29400 -m sat_patches\.launch -m sat_patches finetune train ", cmd), cmd
    assert "global batch 64 = micro-batch 4 x accumulation 1 x 16 data-parallel ranks (upstream's)" in out.stdout
    assert "node 1 of 2: torchrun's rendezvous at 10.0.0.1:29400" in out.stdout
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two machines\nworker-1 slots=8\nworker-2 slots=8\n")
    out = run(SCRIPTS["cogvlm"], dict(gpu_box(tmp_path, "8x80"), HOST_FILE=str(hostfile)), cwd=tmp_path)
    [cmd] = [line for line in out.stdout.splitlines() if line.startswith("+ ")]
    assert f"deepspeed --master_port 16666 --hostfile {hostfile} --num_nodes 2 --num_gpus 8 --module" in cmd, cmd
    assert "x 16 data-parallel ranks" in out.stdout  # NNODES from the hostfile's hosts


@pytest.mark.parametrize("env, message", [
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"},
     "NODE_RANK=2 is out of range for NNODES=2: set NODE_RANK to this node's index, 0 to 1"),
    ({"NNODES": "2"}, "NNODES=2 without HOST_FILE: start this script on every node with NODE_RANK=<0 to 1> and "
                      "MASTER_ADDR=<node 0's address>"),
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1", "NUM_GPUS_PER_WORKER": "2",
      "CUDA_VISIBLE_DEVICES": "0,1", "MP_SIZE": "4"},
     "MP_SIZE=4 does not divide the 2 ranks of a node (NUM_GPUS_PER_WORKER=2): a model-parallel group stays within a "
     "node; set MP_SIZE to one of [1, 2]"),
    ({"CPU_RANKS": "2", "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "GLOBAL_BATCH": "3"},
     "GLOBAL_BATCH=3 is not a multiple of the 2 data-parallel ranks (4 ranks / MP_SIZE=2): set GLOBAL_BATCH to a "
     "multiple of 2"),
    (dict(SLURM, SLURM_NTASKS="16"), "Slurm runs 16 copies of this script on 2 node(s): it starts every rank of its "
                                     "node itself, so run one task per node: srun --nodes=2 --ntasks-per-node=1 bash "
                                     "finetune_cogvlm.sh"),
], ids=["node-rank", "no-rendezvous", "mp-within-a-node", "global-batch", "slurm-tasks"])
def test_what_cannot_work_across_nodes_is_refused_with_what_to_set(tmp_path, monkeypatch, capsys, env, message):
    for name in ("LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    gpus = {} if "CPU_RANKS" in env else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(8)))}
    for name, value in dict(gpus, **env, DRY_RUN="1", MODEL_KIND="cogvlm").items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    assert finetune_run.main([]) == 2
    out, err = capsys.readouterr()
    assert message in err, err
    assert "+ " not in out


# the shortest run that trains, saves and can be resumed: 2 steps on 8 samples, no evaluation, no merge
SHORT = {"CPU_RANKS": "2", "MP_SIZE": "2", "TRAIN_ITERS": "2", "SAVE_INTERVAL": "2", "LOG_INTERVAL": "1",
         "EVALUATE": "0", "MERGE": "0", "DEMO_TRAIN_SAMPLES": "8", "DEMO_VALID_SAMPLES": "1"}


def script_env(env):
    e = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")
         and not k.startswith("SLURM_")}
    return dict(e, PYTHONPATH=ROOT, **env)


def two_nodes(cwd, per_node, timeout=240):
    """The script on two "nodes" at once, ``per_node[i]`` the settings of node i: both results."""
    logs = [(open(cwd / f"node{i}.out", "w+"), open(cwd / f"node{i}.err", "w+")) for i in range(len(per_node))]
    procs = [subprocess.Popen(["bash", SCRIPTS["cogvlm"]], env=script_env(env), cwd=cwd, stdout=out, stderr=err,
                              text=True, start_new_session=True) for env, (out, err) in zip(per_node, logs)]
    try:
        codes = [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    results = []
    for p, code, (out, err) in zip(procs, codes, logs):
        out.seek(0), err.seek(0)
        results.append(subprocess.CompletedProcess(p.args, code, out.read(), err.read()))
        out.close(), err.close()
    return results


def assert_two_nodes_trained(outs, work):
    for node, out in enumerate(outs):
        assert out.returncode == 0, f"node {node}: " + (out.stdout + out.stderr)[-4000:]
        assert out.stdout.splitlines()[1] == \
            "global batch 8 = micro-batch 4 x accumulation 1 x 2 data-parallel ranks (cpu_demo.json's)"
    assert re.findall(r"^iteration (\d)/2 \| loss", outs[0].stdout, re.M) == ["1", "2"]  # rank 0 logs
    [run_dir] = [d for d in (work / "checkpoints").iterdir() if (d / "latest").is_file()]
    assert sorted(f for f in os.listdir(run_dir / "2") if "optim" in f) == [  # every rank's ZeRO shard
        f"zero_pp_rank_{dp}_mp_rank_0{mp}_optim_states.pt" for dp in (0, 1) for mp in (0, 1)]
    return run_dir


@pytest.mark.slow
@pytest.mark.multirank
def test_two_nodes_train_and_save_then_one_node_resumes_with_the_same_global_batch(tmp_path):
    """NNODES=2 with MP_SIZE=2 on each node's 2 ranks: two data-parallel groups across the nodes. Resumed on one
    node of 2 ranks, one data-parallel group: the accumulation doubles, the global batch stays 8."""
    port = str(free_port())
    nodes = [dict(SHORT, NNODES="2", NODE_RANK=str(i), MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for i in (0, 1)]
    run_dir = assert_two_nodes_trained(two_nodes(tmp_path, nodes), tmp_path / "sat_patches_demo" / "cogvlm")
    out = subprocess.run(["bash", SCRIPTS["cogvlm"]], env=script_env(dict(SHORT, TRAIN_ITERS="3", RESUME=str(run_dir))),
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert out.stdout.splitlines()[1] == \
        "global batch 8 = micro-batch 4 x accumulation 2 x 1 data-parallel rank (the resumed run's)"
    assert "finetune prepare" not in out.stdout  # the prepared model and data are used again
    assert re.findall(r"^iteration (\d)/3 \| loss", out.stdout, re.M) == ["3"]
    assert (run_dir / "latest").read_text().strip() == "3"


@pytest.mark.slow
@pytest.mark.multirank
def test_two_nodes_started_by_srun_read_slurms_variables(tmp_path):
    """What srun --nodes=2 --ntasks-per-node=1 sets in each task (the node list's first host: 127.0.0.1)."""
    slurm = {"SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_NNODES": "2", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
             "SLURM_JOB_ID": "4242", "MASTER_PORT": str(free_port())}
    nodes = [dict(SHORT, **slurm, SLURM_NODEID=str(i), SLURM_PROCID=str(i), SLURM_LOCALID="0") for i in (0, 1)]
    outs = two_nodes(tmp_path, nodes)
    assert_two_nodes_trained(outs, tmp_path / "sat_patches_demo" / "cogvlm")
    said = f"node 1 of 2 (Slurm's variables): torchrun's rendezvous at 127.0.0.1:{slurm['MASTER_PORT']}"
    assert said in outs[1].stdout
