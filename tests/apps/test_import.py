"""Every command, even one that only prints an error, starts by importing the app: that import must not
compile anything or load the heavy parts of torch that only training needs. Measured on a 2-core CPU:
`python -c "import pith_apps.train"` 2.7 s, `import torch` alone 2.3 s (README)."""
import subprocess
import sys

HEAVY = ("torch._dynamo", "torch._inductor", "torch.distributed.tensor", "torch.distributed.checkpoint",
         "torch.distributed.fsdp", "datasets", "torch.utils.tensorboard", "transformers")


def test_importing_the_app_loads_no_compiler_no_dtensor_no_datasets():
    probe = f"import sys, pith_apps.train; print([m for m in {HEAVY!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
