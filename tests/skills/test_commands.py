"""Every command the README, MAP.md, docs/, the skills' SKILL.md files and pith-ops' README give, read from those
files and run as written: `hatch run apps:<script or program>` and `hatch test` as hatch runs them (hatch.toml's
scripts, the environment's programs, pytest), from a scratch folder that sees the repository's folders, so that
relative outputs stay there. Training lines run shortened: `--steps` appended (and a scratch `--out`), the only
change. A command that cannot run here is listed with the reason (a GPU, several nodes, a server, the network), a
test of the suite that runs the same line read from its file, or the suite itself; a command in no list fails."""
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "MAP.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "skills").glob("**/SKILL.md")), ROOT / "packages/pith-ops/README.md", ROOT / "AGENTS.md"]
STARTS = ("hatch ", "python ", "python3 ", "torchrun ", "pip ", "PYTHONPATH=", "OMP_NUM_THREADS=", "PITH_SLOW=")
PLACEHOLDER = re.compile(r"(?<![A-Za-z0-9])(FAMILY|NAME|CHECKPOINT|OUT|HF_FOLDER|DIR|P|N|F|B|W|X)(?![A-Za-z0-9])|<out>")

# Lines that cannot run on a 2-core CPU machine without a network, and why.
ELSEWHERE = {
    "hatch run apps:tensorboard --logdir runs": "a server: it serves until stopped",
    "pip install hatch": "installs hatch, which runs these tests (.ci/run installs it the same way)",
    "pip install pith-ops": "pith-ops is not on PyPI yet; tests/ops/test_install.py installs packages/pith-ops",
    'pip install "pith-ops[interpret]"': "the same; tests/ops/test_install.py installs packages/pith-ops[interpret]",
    'pip install "pith-ops[fla]"': "fla-core's kernels need a GPU",
    "pip install torch --index-url https://download.pytorch.org/whl/cpu": "downloads torch's CPU build (this "
                                                                         "machine's test environment runs it)",
    "pip install fla-core": "fla-core's kernels need a GPU",
    "PYTHONPATH=packages/pith-ops/src:packages/pith-engine/src:packages/pith-apps/src python3 bench/train_throughput.py":
        "a GPU benchmark (bench/RESULTS.md)",
    "hatch run apps:train qwen3 --preset 30b-a3b --layers 4 --seq-len 4096 --batch-size 8 --micro-batch-size 1":
        "the 4-layer cut of Qwen3-30B-A3B: a GPU of 80 GB or more",
    "hatch run apps:torchrun --nproc-per-node 8 -m pith_apps.train qwen3 --preset 30b-a3b --seq-len 4096 "
    "--batch-size 64 --pp 8 --micro-batch-size 1 --out runs/qwen3-30b": "8 GPUs",
    "hatch run apps:torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id "
    "qwen3-30b -m pith_apps.train qwen3 --preset 30b-a3b --seq-len 4096 --batch-size 64 --pp 16 --micro-batch-size 1 "
    "--out runs/qwen3-30b": "2 nodes of 8 GPUs; tests/apps/test_multinode.py runs its torchrun options on 2 CPU nodes of "
                            "one process on localhost, and slurm.sh's dry run gives it on every node",
    "hatch run apps:torchrun --nproc-per-node 8 -m pith_apps.train qwen3 --preset 30b-a3b --device cuda --seq-len 4096 "
    "--batch-size 64 --pp 4 --ep 2 --micro-batch-size 1 --recompute full": "8 GPUs (plan-layout's output)",
}
# Lines a test of the suite runs as read from its SKILL.md, with more checks of its output than a run here.
BY_TEST = {
    "skills/pith-apps/capture-profile/profile_steps.py": "test_skill_scripts.py::test_the_profile_has_its_trace_kernels_and_five_stages",
    "skills/pith-apps/collect-routing-trace/trace_routing.py": "test_skill_scripts.py::test_the_routing_trace_is_the_apps_run_and_its_routing",
    "skills/pith-ops/add-kernel/tests_template.py": "test_skill_scripts.py::test_the_kernel_template_passes_its_test_and_the_test_catches_a_wrong_kernel",
    "skills/pith-apps/add-new-model/parity_template.py": "test_skill_scripts.py::test_the_parity_template_passes_on_each_family_and_catches_a_wrong_model",
    "skills/pith-apps/add-routing-variant/routing_template.py": "test_skill_scripts.py::test_the_routing_template_passes_and_catches_a_wrong_router",
    "skills/pith-apps/add-attention-variant/attention_template.py": "test_skill_scripts.py::test_the_attention_template_passes_and_catches_a_wrong_variant",
    "skills/pith-apps/estimate-memory/estimate_memory.py": "test_estimate_memory.py::test_the_skills_example_prints_what_its_skill_md_shows",
    "skills/pith-apps/plan-layout/plan_layout.py": "test_plan_layout.py::test_the_skills_example_prints_what_its_skill_md_shows",
}
STEPS = {"train": "10", "torchrun": "2", "validate": "4"}   # the shortened runs' --steps


def commands_in(doc: Path) -> list[str]:
    """The command lines of a file: the lines of fenced blocks (joined over trailing backslashes, without a trailing
    # comment) and inline code of three words or more, that start with a command."""
    text = doc.read_text()
    lines = [line for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S)
             for line in re.sub(r"\\\n\s*", "", block).splitlines()]
    lines += [span for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
              if len(span.split()) >= 3]
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in lines]
    return [line for line in lines if line.startswith(STARTS)]


def commands() -> dict[str, Path]:
    """Each command line of DOCS -> the first file giving it."""
    found = {}
    for doc in DOCS:
        for line in commands_in(doc):
            found.setdefault(line, doc)
    return found


def doc_command(doc: str, containing: str) -> tuple[dict, list[str]]:
    """expand() of the one command line of `doc` (a path from the root) that contains `containing`: for a test that
    runs a playbook's line as its SKILL.md gives it."""
    [line] = [line for line in commands_in(ROOT / doc) if containing in line]
    return expand(line)


def shown_output(doc: str, first_words: str) -> list[str]:
    """The lines of the fenced block of `doc` whose first line starts with first_words: an output the file shows."""
    blocks = re.findall(r"```\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)
    [block] = [block for block in blocks if block.startswith(first_words)]
    return block.splitlines()


def verdict(line: str) -> str:
    if line in ELSEWHERE:
        return "elsewhere"
    if PLACEHOLDER.search(line):
        return "template"
    if any(script in line for script in BY_TEST):
        return "by test"
    if re.match(r"(PITH_SLOW=1 )?hatch (test|run ops-oldest:test)\b", line) and not line.startswith("hatch test skills"):
        return "suite"
    return "run"


def expand(line: str) -> tuple[dict, list[str]]:
    """(environment variables, argv) of a line as hatch runs it in the test environment's interpreter."""
    words = shlex.split(line)
    env = {}
    while re.match(r"[A-Z_]+=", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    scripts = tomllib.loads((ROOT / "hatch.toml").read_text())["envs"]["apps"]["scripts"]
    if words[:2] == ["hatch", "test"]:
        return env, [sys.executable, "-m", "pytest", *[word for word in words[2:] if word != "--"]]
    assert words[:2] == ["hatch", "run"] and words[2].startswith("apps:"), line
    program, args = words[2].split(":", 1)[1], words[3:]
    if program in scripts:
        return env, [*shlex.split(scripts[program].replace("{args}", "").replace("python", sys.executable, 1)), *args]
    if program == "torchrun":
        return env, [sys.executable, "-m", "torch.distributed.run", *args]
    assert program == "python", line
    return env, [sys.executable, *args]


def shortened(argv: list[str], scratch: Path) -> list[str]:
    """A training line's argv with --steps (and a scratch --out for the app itself) appended."""
    text = " ".join(argv)
    if "validate.py" in text:
        return [*argv, "--steps", STEPS["validate"]]
    if "pith_apps.train" in text and "--help" not in argv:
        kind = "torchrun" if "torch.distributed.run" in text else "train"
        return [*argv, "--steps", STEPS[kind], "--out", str(scratch / "run"), "--save-every", "0"]
    return argv


def scratch_folder(tmp_path: Path) -> Path:
    """A folder that sees the repository's folders: commands read skills/, tests/ ... and write their outputs here."""
    for name in ("packages", "skills", "tests", "bench", "docs", ".ci", "hatch.toml"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


LINES = commands()
RUN = sorted(line for line in LINES if verdict(line) == "run")


def test_every_command_is_run_or_says_why_not():
    """Each line has a verdict; each ELSEWHERE and BY_TEST entry is still given somewhere; a test that runs a
    SKILL.md's line reads it from that file (its source names the SKILL.md); the suite's lines name test paths
    pytest collects, and `hatch test` itself is what .ci/run runs."""
    verdicts = {line: verdict(line) for line in LINES}
    for line, kind in verdicts.items():   # each line to run is one hatch runs: a script or program of its apps env
        if kind in ("run", "template"):
            expand(line)
    assert not set(ELSEWHERE) - set(LINES), set(ELSEWHERE) - set(LINES)
    for script, test in BY_TEST.items():
        given = [line for line in LINES if script in line]
        file, name = test.split("::")
        source = (ROOT / "tests/skills" / file).read_text()
        body = source[source.index(f"def {name}("):]
        body = body[:body.find("\ndef ", 1) if "\ndef " in body[1:] else len(body)]
        skill_md = (Path(script).parent / "SKILL.md").as_posix()
        assert given and skill_md in body and "doc_command(" in body, (script, test)
    suite = [line for line, kind in verdicts.items() if kind == "suite"]
    ci = (ROOT / ".ci/run").read_text()
    assert "hatch test" in suite and "\nhatch test\n" in ci and "hatch run ops-oldest:test" in ci
    paths = sorted({word for line in suite for word in line.split()[2:] if word.startswith("tests/")})
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *paths], cwd=ROOT,
                               capture_output=True, text=True)
    assert collected.returncode == 0, collected.stdout[-2000:]
    for path in paths:
        assert f"{path}" in collected.stdout, path
    assert len(RUN) >= 8   # the training lines, the torchrun layouts, validate (12 when written)


@pytest.mark.parametrize("line", RUN)
def test_the_command_runs_as_written(line, tmp_path):
    """Exit 0; a training line's loss falls by more than 1.0 in its 10 steps (the tiny presets went from 5.49-5.60
    to 4.33-4.38) or, in 2 steps under torchrun, ends within 0.5 of where it began; validate prints PASS; --help
    lists the flags; the pipeline simulator's largest bubble is its closed form."""
    env, argv = expand(line)
    scratch = scratch_folder(tmp_path)
    done = subprocess.run(shortened(argv, scratch), capture_output=True, text=True, cwd=scratch,
                          env=os.environ | env | {"PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    if "validate.py" in line:
        assert re.search(r"^PASS: ", done.stdout, flags=re.M), done.stdout[-2000:]
    elif "--help" in line:
        assert "--recompute" in done.stdout and "--batch-size" in done.stdout
    elif "pith_engine.dualpipev" in line:   # the simulated bubbles' largest is the closed form printed beside them
        bubbles, formula = re.search(r"bubble per rank ([\d., ]+) \(.*= ([\d.]+)$", done.stdout.strip()).groups()
        assert max(map(float, bubbles.split(", "))) == float(formula)
    else:
        first, last = map(float, re.search(r"trained steps 1-\d+: loss ([\d.]+) -> ([\d.]+)", done.stdout).groups())
        assert last < first - 1.0 if "torchrun" not in line else last < first + 0.5
