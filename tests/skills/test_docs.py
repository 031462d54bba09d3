"""The README, AGENTS.md, MAP.md and docs/ name only what exists: every repository path they give, in code or in
prose; every file of MAP.md's tree; every function or class MAP.md's tables place in a file (defined there); every
pith_* dotted name (imported) and --flag in their code. And the README stays a quick start, the options and
pointers, and AGENTS.md one screen that says where each kind of task starts."""
import re
from pathlib import Path

import pytest

import test_skill_docs as skill_docs
from test_skill_docs import ROOT, code_of, defined_flags

DOCS = [ROOT / "README.md", ROOT / "AGENTS.md", ROOT / "MAP.md", *sorted((ROOT / "docs").glob("*.md"))]
SHORT = {"pith_ops/": "packages/pith-ops/src/pith_ops/", "pith_engine/": "packages/pith-engine/src/pith_engine/",
         "pith_apps/": "packages/pith-apps/src/pith_apps/"}
# a path in prose or code: under a top-level folder of the repository, a package's short form, or a root file
PATH = re.compile(r"(?<![\w./~-])((?:packages|docs|skills|tests|bench|\.ci|pith_ops|pith_engine|pith_apps)/[\w./-]*[\w/]"
                  r"|(?:README|AGENTS|MAP)\.md|hatch\.toml)")


def repository_path(token: str) -> Path:
    for short, long in SHORT.items():
        if token.startswith(short):
            return ROOT / (long + token[len(short):])
    return ROOT / token


def ids(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=ids)
def test_every_path_a_doc_gives_exists(doc):
    text = re.sub(r"https?://\S+", "", doc.read_text())
    missing = sorted({token for token in PATH.findall(text) if not repository_path(token).exists()})
    assert not missing, missing


@pytest.mark.parametrize("doc", DOCS, ids=ids)
def test_every_name_and_flag_a_doc_gives_exists(doc):
    skill_docs.test_every_name_a_skill_gives_exists(doc)
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", "\n".join(code_of(doc.read_text()))))
    assert not flags - defined_flags(), sorted(flags - defined_flags())


def defines(source: str, dotted: str) -> bool:
    """Whether source defines `name` (def, class or a module-level assignment) or, for `Class.member`, the class
    and a def of the member."""
    first, *rest = dotted.split(".")
    found = re.search(rf"^(?:class|def) {first}\b|^{first} *[:=]", source, flags=re.M)
    return bool(found) and all(re.search(rf"^\s+def {member}\(", source, flags=re.M) for member in rest)


def test_every_function_the_map_places_in_a_file_is_defined_there():
    """In MAP.md's tables a cell reads `file`: `name`, `name`; ... : each name defined in the file before it."""
    placed = 0
    for cell in re.findall(r"\| ([^|]*`[\w/.]+\.py`: [^|]*)\|", (ROOT / "MAP.md").read_text()):
        for path, names in re.findall(r"`([\w/.]+\.py)`: ((?:`[\w.]+`(?:, )?)+)", cell):
            source = repository_path(path).read_text()
            for name in re.findall(r"`([\w.]+)`", names):
                assert defines(source, name), f"{name} in {path}"
                placed += 1
    assert placed >= 35   # the twelve questions' and the start table's names (39 when written)


def test_every_file_of_the_maps_tree_exists():
    """The tree's `name.py` lines sit under their package's folder (`packages/<package>/` lines start one)."""
    tree = re.search(r"```\n(packages/pith-ops/.*?)```", (ROOT / "MAP.md").read_text(), flags=re.S).group(1)
    package, files = None, 0
    for line in tree.splitlines():
        top = re.match(r"(packages/pith-\w+)/", line)
        if top:
            package = ROOT / top.group(1) / "src" / top.group(1).split("/")[1].replace("-", "_")
        elif line.startswith("  ") and package is not None:
            for name in re.findall(r"([\w/]+\.py)(?=[,\s])", line.split("  ")[1] + " "):
                assert (package / name).is_file(), name
                files += 1
        else:
            package = None if not line.startswith(" ") else package
    assert files >= 30   # every module of the three packages (33 when written)


def test_the_readme_is_a_quick_start_the_options_and_pointers():
    """At most 150 lines: the long prose (tests, speed, parallelism, runs) lives in docs/, one hop away."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for doc in ("docs/runs.md", "docs/training.md", "docs/parallelism.md", "docs/speed.md", "docs/testing.md",
                "MAP.md", "docs/architecture.md"):
        assert doc in text, doc


# each kind of task AGENTS.md must say where to start: a word of its row -> the paths it must give
AGENTS_STARTS = {
    "train": ["README.md", "docs/runs.md", "docs/training.md"],
    "model": ["skills/pith-apps/add-new-model/SKILL.md"],
    "kernel": ["skills/pith-ops/add-kernel/SKILL.md"],
    "routing": ["skills/pith-apps/add-routing-variant/SKILL.md"],
    "attention": ["skills/pith-apps/add-attention-variant/SKILL.md"],
    "parallel": ["docs/parallelism.md", "skills/pith-apps/plan-layout/SKILL.md", "skills/pith-apps/launch/SKILL.md"],
}


def test_agents_md_is_one_screen_that_says_where_each_task_starts():
    """At most 60 lines; for each kind of task a line of AGENTS.md names it and gives the paths to start from, each
    of which exists; and it points to MAP.md, the full map."""
    text = (ROOT / "AGENTS.md").read_text()
    assert len(text.splitlines()) <= 60
    assert "MAP.md" in text
    for task, paths in AGENTS_STARTS.items():
        rows = [line for line in text.splitlines() if re.search(rf"\b{task}", line, flags=re.I)]
        for path in paths:
            assert any(path in row for row in rows), f"{task}: {path}"
            assert (ROOT / path).is_file(), path
