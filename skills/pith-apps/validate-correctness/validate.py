"""Check a change or a parallel layout against a reference run: the same pith-train run twice, step by step, its
loss and gradient norm compared within a tolerance; prints PASS or FAIL (exit status 0 or 1).

  hatch run apps:python skills/pith-apps/validate-correctness/validate.py --against HEAD -- qwen3 --steps 20 --device cpu
      this checkout's code against the code of git revision `HEAD` (or of a checkout folder), one process each
  hatch run apps:python skills/pith-apps/validate-correctness/validate.py --layout "--ep 2" -- qwen3 --steps 20 --device cpu
      this checkout on the processes the layout needs (torchrun) against itself on one process

Each side is the app itself (`python -m pith_apps.train`, the code of its tree first on PYTHONPATH) in a process of
its own; the per-step `train/loss` and `train/grad_norm` come from its TensorBoard log.
"""
import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("pith-ops", "pith-engine", "pith-apps")


def run_app(tree: Path, app: list[str], out: Path, processes: int = 1) -> dict[str, list[float]]:
    """Train with the app of `tree`; -> {"loss": [...], "grad_norm": [...]} per step, from its TensorBoard log."""
    launcher = [sys.executable, "-m", "pith_apps.train"] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), "-m",
        "pith_apps.train"]
    path = os.pathsep.join(str(tree / "packages" / name / "src") for name in PACKAGES)
    done = subprocess.run([*launcher, *app, "--out", str(out), "--save-every", "0", "--quiet"], capture_output=True,
                          text=True, env=os.environ | {"PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")})
    if done.returncode:
        sys.exit(f"validate: the run in {tree} failed:\n{done.stderr[-2000:]}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    log = EventAccumulator(str(out / "tb")).Reload()
    return {name: [event.value for event in log.Scalars(f"train/{name}")] for name in ("loss", "grad_norm")}


def reference_tree(against: str, scratch: Path) -> Path:
    """A checkout folder as it is, or git revision `against` of this repository checked out into scratch."""
    if Path(against).is_dir():
        return Path(against)
    tree = scratch / "reference"
    done = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), against],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"validate: --against {against} is neither a folder nor a git revision here: {done.stderr.strip()}")
    return tree


def sizes_of(layout: str, names: str = "dp|ep|pp|cp") -> int:
    """The product of the layout's sizes among `names`: its processes, or (dp|ep) its data ranks."""
    return math.prod(int(size) for size in re.findall(rf"--(?:{names})[ =](\d+)", layout))


def one_process_flags(app: list[str], layout: str) -> list[str]:
    """The app's flags for the one-process side: each of its micro-batches the rows of one micro-batch of all the
    layout's data ranks together (so a load-balancing loss over a micro-batch balances the same tokens)."""
    flags = list(app)
    for index, flag in enumerate(flags[:-1]):
        if flag == "--micro-batch-size":
            flags[index + 1] = str(int(flags[index + 1]) * sizes_of(layout, "dp|ep"))
    return flags


def compare(reference: dict, candidate: dict, tolerance: float) -> bool:
    """Print the step-by-step table and the verdict; True when every relative difference is within tolerance."""
    gaps = {name: [abs(new - ref) / abs(ref) for ref, new in zip(reference[name], candidate[name])]
            for name in ("loss", "grad_norm")}
    print("step      loss ref      loss new   rel diff   grad ref   grad new   rel diff")
    for step, row in enumerate(zip(reference["loss"], candidate["loss"], gaps["loss"], reference["grad_norm"],
                                   candidate["grad_norm"], gaps["grad_norm"]), 1):
        print(f"{step:>4}  {row[0]:>12.6f}  {row[1]:>12.6f}  {row[2]:>9.2e}  {row[3]:>9.4f}  {row[4]:>9.4f}  {row[5]:>9.2e}")
    worst = {name: max(values, default=math.inf) for name, values in gaps.items()}
    # step 1 starts from the same weights: the math's own difference, before training amplifies rounding (SKILL.md)
    first = {name: values[0] if values else math.inf for name, values in gaps.items()}
    passed = len(reference["loss"]) == len(candidate["loss"]) and max(worst.values()) <= tolerance
    print(f"{'PASS' if passed else 'FAIL'}: largest relative difference of the loss {worst['loss']:.2e}, of the "
          f"gradient norm {worst['grad_norm']:.2e}, over {len(candidate['loss'])} steps (at step 1: "
          f"{first['loss']:.2e} and {first['grad_norm']:.2e}); tolerance {tolerance:.0e}")
    return passed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--against", help="a git revision of this repository, or a checkout folder, to compare with")
    side.add_argument("--layout", help="pith-train layout flags (\"--ep 2\", \"--dp 2 --pp 2\") to compare with one "
                      "process")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest relative difference of the loss and "
                        "the gradient norm at any step (default: 1e-4; float32 on CPU across layouts: ~1e-7 at step "
                        "1, which later steps can amplify past it: SKILL.md tells rounding from a bug)")
    parser.add_argument("app", nargs=argparse.REMAINDER, help="-- then the pith-train flags of the run")
    own = parser.parse_args(argv)
    app = [flag for flag in own.app if flag != "--"]
    with tempfile.TemporaryDirectory(prefix="pith-validate-") as scratch:
        scratch = Path(scratch)
        if own.layout:
            reference = run_app(ROOT, one_process_flags(app, own.layout), scratch / "one-process")
            candidate = run_app(ROOT, app + own.layout.split(), scratch / "layout", sizes_of(own.layout))
        else:
            tree = reference_tree(own.against, scratch)
            try:
                reference = run_app(tree, app, scratch / "reference")
            finally:
                if tree.parent == scratch:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                                   capture_output=True)
            candidate = run_app(ROOT, app, scratch / "candidate")
        sys.exit(0 if compare(reference, candidate, own.tolerance) else 1)


if __name__ == "__main__":
    main()
