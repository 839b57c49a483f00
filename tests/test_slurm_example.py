"""configs/slurm/train.sbatch, run as Slurm runs it, on one machine as two nodes: the script
itself in bash, as sbatch starts it on the job's first node (the variables sbatch sets there,
its training options after the script's name), with stand-ins for what only a cluster has:

- `scontrol show hostnames`: the job's hosts, the first this machine (127.0.0.1); the second a
  name that resolves nowhere, so a script that met anywhere but the first host would fail;
- `srun`: the script's command once per task, `--ntasks-per-node` (the script's own #SBATCH
  line) tasks on each node, each with the variables Slurm gives a task (its node, its rank);
  the command's words are the batch shell's, expanded once on the first node, as srun gets them;
- the rendezvous port (a free one), the processes on each node (1 CPU process: there is no GPU).

The two nodes (1 process at batch 2 each) train as one process at batch 4 (test_nodes), and the
fine-tuned model is written once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TRAIN_SUBPROCESS_TIMEOUT_S
from test_node_faults import stop_all
from test_nodes import as_flags, assert_trains_as_one_process, free_port, tiny_run_settings

SCRIPT = Path(__file__).resolve().parents[1] / "configs" / "slurm" / "train.sbatch"
# The job's hosts: this machine first, then one no launcher can reach.
HOSTS = ["127.0.0.1", "unreachable-node.invalid"]

FAKE_SCONTROL = """#!/bin/sh
# scontrol show hostnames LIST: the hosts of a node list, one a line (here a list of names).
if [ "$1 $2" != "show hostnames" ] || [ "$#" -ne 3 ]; then
    echo "scontrol stand-in: only 'show hostnames LIST', not: $*" >&2
    exit 1
fi
echo "$3" | tr , '\\n'
"""

FAKE_SRUN = """#!{python}
\"\"\"srun in a job: its command as one task per task slot of every node, each with the variables
Slurm sets for a task; each task's output in $SRUN_TASK_LOGS/task-N.log; exits with the highest
task's code (128 + N for a signal N), as srun does.\"\"\"
import os, subprocess, sys

command = sys.argv[1:]
if not command or command[0].startswith("-"):
    sys.exit(f"srun stand-in: runs a command without srun options, not: {{command[:3]}}")
env = os.environ
nodes, per_node = int(env["SLURM_NNODES"]), int(env["SLURM_NTASKS_PER_NODE"])
hosts = env["SLURM_JOB_NODELIST"].split(",")
tasks = []
for rank in range(nodes * per_node):
    node = rank // per_node
    task_env = {{
        **env,
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(nodes * per_node),
        "SLURM_STEP_NODELIST": env["SLURM_JOB_NODELIST"],
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % per_node),
        "SLURMD_NODENAME": hosts[node],
    }}
    log = open(os.path.join(env["SRUN_TASK_LOGS"], f"task-{{rank}}.log"), "w")
    tasks.append(subprocess.Popen(command, env=task_env, stdout=log, stderr=subprocess.STDOUT))
codes = [task.wait() for task in tasks]
sys.exit(max(128 - code if code < 0 else code for code in codes))  # srun: the highest
"""


def sbatch_options(script: Path) -> dict[str, str]:
    """The script's `#SBATCH --name=value` lines."""
    lines = re.findall(r"^#SBATCH\s+--([\w-]+)=(\S+)", script.read_text(encoding="utf-8"), re.M)
    return dict(lines)


def stand_ins(folder: Path) -> Path:
    """A folder holding `scontrol` and `srun` stand-ins, to put first on PATH."""
    folder.mkdir()
    for name, text in {"scontrol": FAKE_SCONTROL, "srun": FAKE_SRUN}.items():
        (folder / name).write_text(text.format(python=sys.executable), encoding="utf-8")
        (folder / name).chmod(0o755)
    return folder


def slurm_job_env(tmp_path: Path, nodes: int) -> dict[str, str]:
    """What sbatch sets for the batch script (it runs on the job's first node), from the
    script's #SBATCH lines and `--nodes=<nodes>`; and what the test must set: PATH (the
    stand-ins, then this Python's environment, as the script's `source .../activate` would),
    the port, and one CPU process on each node."""
    options = sbatch_options(SCRIPT)
    per_node = int(options["ntasks-per-node"])
    nodelist = ",".join(HOSTS[:nodes])
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOBID": "4242",
        "SLURM_JOB_NAME": options["job-name"],
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_NPROCS": str(nodes * per_node),
        "SLURM_CPUS_PER_TASK": options["cpus-per-task"],
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURMD_NODENAME": HOSTS[0],
        "SLURM_SUBMIT_DIR": str(tmp_path),
    }
    logs = tmp_path / "task-logs"
    logs.mkdir()
    path = [str(stand_ins(tmp_path / "cluster-bin")), str(Path(sys.executable).parent)]
    return {
        **os.environ,
        **slurm,
        "PATH": os.pathsep.join([*path, os.environ["PATH"]]),
        "SRUN_TASK_LOGS": str(logs),
        "RDZV_PORT": str(free_port()),
        "NPROC_PER_NODE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


def run_batch_script(env: dict[str, str], train_flags: list[str], cwd: Path) -> list[str]:
    """`bash train.sbatch <train_flags>` to its end (a hang fails the test and stops every
    process it started); each task's output, in task order."""
    job = subprocess.Popen(
        ["bash", str(SCRIPT), *train_flags],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output = job.communicate(timeout=TRAIN_SUBPROCESS_TIMEOUT_S)[0]
    finally:
        stop_all([job])
    logs = sorted(Path(env["SRUN_TASK_LOGS"]).glob("task-*.log"))
    tasks = [log.read_text(encoding="utf-8") for log in logs]
    assert job.returncode == 0, output[-2000:] + "".join(task[-3000:] for task in tasks)
    return tasks


@pytest.mark.long
def test_the_slurm_script_on_two_nodes_trains_as_one_process(tmp_path, tiny_whisper_dir):
    settings = tiny_run_settings(tmp_path, tiny_whisper_dir)
    run = tmp_path / "run"
    # The script's options go to `whisper-train train`: 2 nodes x 1 process x batch 2.
    flags = [*as_flags(settings), "--only-train", "--batch-size=2", f"--output-dir={run}"]
    tasks = run_batch_script(slurm_job_env(tmp_path, nodes=2), flags, cwd=tmp_path)
    assert len(tasks) == 2  # one launcher on each node
    assert_trains_as_one_process(settings, run, tmp_path / "one")
    # Written once, by global rank 0 (on whichever node the rendezvous numbered 0).
    assert (run / "final" / "model.safetensors").is_file()
    assert sum("fine-tuned model:" in task for task in tasks) == 1, tasks
