"""Several nodes, rehearsed on one machine. The launch playbook's two-node command (skills/pith-apps/launch/SKILL.md)
runs as two torchrun processes started at once: two "nodes" of one CPU process each, meeting at the command's c10d
rendezvous on localhost (gloo), train the tiny qwen3 preset 4 steps into one --out and resume it to step 6, fully
sharded (--dp 2) and as one replica per node (--dp 2 --dp-replicate 2), against one process running the same.
Of the playbook's line the test runs every torchrun option (everything before `-m`) as written but two:
`HOST:29500` becomes 127.0.0.1 and a free port, `--nproc-per-node 8` becomes 1; and the training flags after
`-m pith_apps.train` are the tiny CPU run's (TRAIN, the layout's, --steps and --out) instead of the 30B preset's.
And the playbook's SLURM script, slurm.sh, in its dry run under fake srun and scontrol, for 1, 2 and 4 nodes."""
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pith_apps.train as train_app
from distributed import free_port
from pith_engine import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "skills"))   # tests/skills: the playbooks' commands
from test_commands import ROOT, commands_in, expand  # noqa: E402

LAUNCH = ROOT / "skills/pith-apps/launch/SKILL.md"
SLURM = ROOT / "skills/pith-apps/launch/slurm.sh"
TRAIN = ["qwen3", "--batch-size", "4", "--seq-len", "32", "--device", "cpu", "--save-every", "2", "--quiet"]
LAYOUTS = {"dp2": ["--dp", "2"], "hsdp": ["--dp", "2", "--dp-replicate", "2"]}
TIMEOUT = 300   # seconds for one launch of both nodes (8-10 s here): a hang fails the test instead of stalling it


def replaced(text: str, changes) -> str:
    """text with each (old, new) of changes replaced; each old must occur exactly once, so that a changed playbook
    line fails here rather than runs something else."""
    for old, new in changes:
        assert text.count(old) == 1, (old, text)
        text = text.replace(old, new)
    return text


def two_node_launch() -> str:
    """The playbook's two-node command up to its `-m`: hatch run apps:torchrun and torchrun's options."""
    [line] = [line for line in commands_in(LAUNCH) if "--nnodes 2" in line]
    return line[:line.index(" -m ")]


def launch_two_nodes(root: Path, out: Path, steps: int, *flags) -> list[str]:
    """The two-node command, its torchrun started twice at once (a node each), with the tiny run; both nodes' output
    (stdout and stderr) once both exited 0. A node still running after TIMEOUT, or after the other failed, fails
    the test and is stopped."""
    _, torchrun = expand(replaced(two_node_launch(), [("HOST:29500", f"127.0.0.1:{free_port()}"),
                                                       ("--nproc-per-node 8", "--nproc-per-node 1")]))
    command = [*torchrun, "-m", "pith_apps.train", *TRAIN, "--steps", str(steps), "--out", str(out), *flags]
    # the nodes share this machine's cores: one thread per process (torchrun sets it only for several on a node)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    logs, nodes = [root / f"node{n}-steps{steps}.log" for n in range(2)], []
    try:
        for log in logs:
            with log.open("w") as sink:
                nodes.append(subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + TIMEOUT
        while (time.monotonic() < deadline and any(node.poll() is None for node in nodes)
               and not any(node.poll() for node in nodes)):
            time.sleep(0.5)
        codes = [node.poll() for node in nodes]
    finally:
        for node in nodes:   # left running: torchrun stops its workers on SIGTERM (SIGKILL after 30 s)
            if node.poll() is None:
                node.terminate()
                try:
                    node.wait(60)
                except subprocess.TimeoutExpired:
                    node.kill()
                    node.wait()
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], (f"exit codes {codes} (None: still running after {TIMEOUT} s or after the other node "
                             "failed)", *[output[-3000:] for output in outputs])
    return outputs


def train(out: Path, steps: int, *flags) -> list[float]:
    return train_app.train(train_app.parse_args([*TRAIN, "--steps", str(steps), "--out", str(out), *flags]))


def logged_losses(out: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return [event.value for event in events.Scalars("train/loss")]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[float]:
    """One process, the same commands: steps 1-4, then --resume to 6 (each run's own learning-rate schedule, as the
    nodes have)."""
    out = tmp_path_factory.mktemp("one") / "run"
    return [*train(out, 4), *train(out, 6, "--resume")]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def two_nodes(request, tmp_path_factory) -> dict:
    """The layout on two nodes: steps 1-4, then --resume to 6, in one --out both see; each launch's node outputs."""
    root = tmp_path_factory.mktemp(request.param)
    out = root / "run"
    outputs = [launch_two_nodes(root, out, 4, *LAYOUTS[request.param]),
               launch_two_nodes(root, out, 6, *LAYOUTS[request.param], "--resume")]
    return dict(out=out, outputs=outputs)


def test_two_nodes_train_and_resume_with_the_one_process_losses(two_nodes, one_process):
    """TensorBoard's train/loss of steps 1-6 (steps 5 and 6 resumed from the checkpoint both nodes wrote at step 4):
    float32, where the layouts differ from one process in summation order only: within 1e-5 relative at every
    step; and the run learns (its last loss below its first)."""
    ours = logged_losses(two_nodes["out"])
    assert len(ours) == 6 and all(abs(a - b) <= 1e-5 * b for a, b in zip(ours, one_process)), (ours, one_process)
    assert one_process[-1] < one_process[0]


def test_rank_0_alone_prints_the_resume_and_the_last_line(two_nodes, one_process):
    """Of the two nodes one prints `trained steps 1-4: loss A -> B`, and after the resume `resumed from
    <out>/checkpoints/step-00000004 at step 4` and `trained steps 5-6: ...`, the other none of them; A and B are the
    one process's losses of those steps to the printed 3 decimals (5e-4) plus the layouts' 1e-5 relative (6e-5 at a
    loss of 6): 6e-4."""
    first, resumed = two_nodes["outputs"]
    resume = f"resumed from {two_nodes['out'] / 'checkpoints/step-00000004'} at step 4"
    assert sorted(output.count(resume) for output in resumed) == [0, 1]
    for outputs, (start, end) in ((first, (1, 4)), (resumed, (5, 6))):
        found = [re.findall(rf"^trained steps {start}-{end}: loss ([\d.]+) -> ([\d.]+)", output, flags=re.M)
                 for output in outputs]
        assert sorted(map(len, found)) == [0, 1], found
        [(a, b)] = max(found, key=len)
        assert abs(float(a) - one_process[start - 1]) <= 6e-4 and abs(float(b) - one_process[end - 1]) <= 6e-4


def test_every_rank_writes_its_shard_into_the_shared_out_and_rank_0_the_rest(two_nodes):
    """The checkpoints both nodes wrote into the one --out: the newest two (steps 4 and 6; step 2 pruned, no .tmp
    left), `latest` naming step 6, which checksums one DCP shard per rank of the 2 nodes beside rank 0's .metadata
    and is intact."""
    folder = two_nodes["out"] / "checkpoints"
    assert sorted(path.name for path in folder.iterdir()) == ["latest", "step-00000004", "step-00000006"]
    assert (folder / "latest").read_text() == "step-00000006"
    assert sorted(checkpoint.read_meta(folder / "step-00000006")["files"]) == [".metadata", "__0_0.distcp",
                                                                              "__1_0.distcp"]
    assert checkpoint.damage(folder / "step-00000006") is None


# scontrol show hostnames LIST: its hosts, one a line, for a LIST of one host or "name[first-last]"
FAKE_SCONTROL = """#!{python}
import re, sys
assert sys.argv[1:3] == ["show", "hostnames"] and len(sys.argv) == 4, sys.argv
name, first, last = re.fullmatch(r"(\\w+?)(?:\\[(\\d+)-(\\d+)\\])?", sys.argv[3]).groups()
print(*[f"{{name}}{{n:0{{len(first)}}d}}" for n in range(int(first), int(last) + 1)] if first else [name], sep="\\n")
"""
# srun in a job of $SLURM_NNODES nodes, one task per node: its options on a line, then the command once per node
# with that node's SLURM_NODEID
FAKE_SRUN = """#!/bin/bash
options=()
while [[ $1 == -* ]]; do options+=("$1"); shift; done
echo "srun ${options[*]}"
for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" || exit; done
"""


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_the_slurm_script_runs_the_two_node_launch_on_every_node_of_the_job(nodes, tmp_path):
    """The playbook's sbatch line at 1, 2 and 4 nodes: slurm.sh with the environment sbatch gives it (the job id, the
    node count and list, the GPUs its #SBATCH --gpus-per-node gives a node), PITH_DRY_RUN=1, fake srun and scontrol.
    One srun of one task per node that kills the job when a task fails; each node's line is the playbook's two-node
    command with --nnodes the job's nodes, --nproc-per-node the node's GPUs, the rendezvous at the first host's port
    29500 under the job id, and the sbatch line's training flags passed through as given."""
    words = shlex.split(re.search(r"^sbatch .*$", re.sub(r"\\\n\s*", "", LAUNCH.read_text()), flags=re.M)[0])
    assert words[1:4] == ["--nodes", "2", str(SLURM.relative_to(ROOT))]
    flags = words[4:]
    header = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", SLURM.read_text(), flags=re.M))
    assert header["ntasks-per-node"] == "1"
    hosts = [f"gpu{n:02d}" for n in range(7, 7 + nodes)]
    for name, text in (("scontrol", FAKE_SCONTROL.format(python=sys.executable)), ("srun", FAKE_SRUN)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = os.environ | {"PATH": f"{tmp_path}:{os.environ['PATH']}", "PITH_DRY_RUN": "1", "SLURM_JOB_ID": "4242",
                        "SLURM_NNODES": str(nodes), "SLURM_JOB_NODELIST": f"gpu[07-{6 + nodes:02d}]" if nodes > 1
                        else hosts[0], "SLURM_GPUS_ON_NODE": header["gpus-per-node"]}
    done = subprocess.run(["bash", str(SLURM), *flags], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    srun, *lines = done.stdout.splitlines()
    assert srun == "srun --ntasks-per-node=1 --kill-on-bad-exit=1"
    expected = replaced(two_node_launch(), [("--nnodes 2", f"--nnodes {nodes}"),
                                            ("--nproc-per-node 8", f"--nproc-per-node {header['gpus-per-node']}"),
                                            ("HOST:29500", f"{hosts[0]}:29500"),
                                            ("--rdzv-id qwen3-30b", "--rdzv-id 4242")])
    assert [line.split(": ", 1)[0] for line in lines] == [f"node {n}" for n in range(nodes)]
    for line in lines:
        assert shlex.split(line.split(": ", 1)[1]) == [*shlex.split(expected), "-m", "pith_apps.train", *flags]
