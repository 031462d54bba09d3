"""Every SKILL.md is short, says what it is for, and names only what exists: each repository path, each
pith_* dotted name (imported), each other name in backticks (found as a word in the code), each --flag (one of
the app's, a flag a script in this repository defines, or one of the few of torchrun, tensorboard and pytest)."""
import importlib
import re
from pathlib import Path

import pytest

from pith_apps.options import build_parser

ROOT = Path(__file__).resolve().parents[2]
SKILLS = sorted(ROOT.glob("skills/**/SKILL.md"))
REPO_ROOTS = ("packages/", "tests/", "bench/", "skills/", "docs/", ".ci/", "hatch.toml", "README.md")
MODULE_ROOTS = {"pith_ops/": "packages/pith-ops/src/", "pith_engine/": "packages/pith-engine/src/",
                "pith_apps/": "packages/pith-apps/src/"}
# other tools' flags a skill may show: torchrun's, tensorboard's, pytest's and pip's
PLACEHOLDER = re.compile(r"(?<![A-Za-z])(NAME|FAMILY|DIR|OUT|PATH|FILE|STEP|N)(?![a-z])")   # stands for the reader's
TOOL_FLAGS = {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-backend",
              "--rdzv-endpoint", "--rdzv-id", "--logdir", "--no-deps", "--shutdown-timeout", "--nodes"}


def code_of(text: str) -> list[str]:
    """The inline code spans and the lines of fenced blocks."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S))
    return inline + [line for block in blocks for line in block.splitlines()]


def source_text() -> str:
    files = [p for pattern in ("packages/**/*.py", "tests/**/*.py", "bench/*.py", "skills/**/*.py", "hatch.toml")
             for p in ROOT.glob(pattern) if p.name != Path(__file__).name]
    return "\n".join(p.read_text() for p in files)


def defined_flags() -> set[str]:
    parser = build_parser()
    app = set(parser._option_string_actions)
    scripts = set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", source_text()))
    return app | scripts | TOOL_FLAGS


@pytest.mark.parametrize("skill", SKILLS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_skill_is_short_and_says_what_it_is_for(skill):
    text = skill.read_text()
    front = re.match(r"---\nname: ([a-z0-9-]+)\ndescription: (.+)\n---\n", text)
    assert front and len(front.group(2)) > 20, "front matter: name and description"
    assert len(text.splitlines()) <= 170


@pytest.mark.parametrize("skill", SKILLS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_skill_names_exists(skill):
    missing = []
    for span in code_of(skill.read_text()):
        for token in re.findall(r"[\w./-]+(?:::\w+)?", span):
            if PLACEHOLDER.search(token):
                continue
            path, _, test = token.partition("::")
            path = path.rstrip(".")
            for module, folder in MODULE_ROOTS.items():
                if path.startswith(module):
                    path = folder + path
            local = skill.parent / path
            if not (path.startswith(REPO_ROOTS) or local.exists() and "/" in path):
                continue
            target = local if local.exists() else ROOT / path
            if not target.exists() or test and f"def {test}(" not in target.read_text():
                missing.append(token)
    assert not missing, missing


@pytest.mark.parametrize("skill", SKILLS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_a_skill_gives_exists(skill):
    source, missing = source_text(), []
    for span in code_of(skill.read_text()):
        for dotted in re.findall(r"\b(pith_(?:ops|engine|apps)(?:\.\w+)+)", span):
            if PLACEHOLDER.search(dotted):
                continue
            parts = dotted.split(".")
            for cut in range(len(parts), 0, -1):   # the longest importable prefix, then attributes
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                try:
                    for attribute in parts[cut:]:
                        obj = getattr(obj, attribute)
                except AttributeError:
                    missing.append(dotted)
                break
        if re.fullmatch(r"[A-Za-z_]\w*(\.\w+)*(\(.*\))?", span.strip()) and not span.startswith("pith_"):
            for name in re.findall(r"[A-Za-z_]\w*", span.split("(")[0]):
                if not PLACEHOLDER.search(name) and not re.search(rf"\b{re.escape(name)}\b", source):
                    missing.append(name)
    assert not missing, missing


@pytest.mark.parametrize("skill", SKILLS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_a_skill_shows_exists(skill):
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", "\n".join(code_of(skill.read_text()))))
    assert not flags - defined_flags(), sorted(flags - defined_flags())
