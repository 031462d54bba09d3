"""The transformers parity test of a model family, to copy as tests/apps/test_FAMILY.py; run as it is, it checks
FAMILY below. From a tiny random transformers model of the family's tiny preset, saved with save_pretrained
(the real file names and layouts), our model loads the files (pith_apps.hf_checkpoint) and must give the same
logits (1e-5 relative), loss (1e-5) and the gradient of every parameter (1e-4): float32, the same math summed in
another order."""
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[3] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "apps")]   # standalone only: under tests/apps these are importable
from conftest import relative_error  # noqa: E402
from hf_compare import GRAD_TOLERANCE, compare_forward_and_backward, load_ours, save_tiny_hf_model  # noqa: E402
from pith_apps.config import read_json  # noqa: E402
from pith_apps.options import MODELS, PRESETS  # noqa: E402

FAMILY = "qwen3"   # the family's key in pith_apps.options.MODELS; its tiny preset is presets/<FAMILY>_tiny.json


def test_the_family_matches_transformers(tmp_path):
    import transformers
    preset = read_json(PRESETS / f"{FAMILY}_tiny.json")
    # the load-balancing loss off: ours adds it in the backward, transformers only with output_router_logits
    preset |= {key: 0.0 for key in ("router_aux_loss_coef", "aux_loss_alpha") if key in preset}
    hf_model = save_tiny_hf_model(transformers.AutoConfig.for_model(**preset), tmp_path)
    ours = load_ours(*MODELS[FAMILY], tmp_path)
    theirs, mine = dict(hf_model.named_parameters()), dict(ours.named_parameters())
    assert set(mine) <= set(theirs), sorted(set(mine) - set(theirs))   # transformers' names for every parameter
    same = {name: name for name in mine if mine[name].shape == theirs[name].shape}
    # 64 positions: a wrong softmax scale cannot hide (at position 0 the softmax has one key)
    ids = torch.randint(0, preset["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    compare_forward_and_backward(hf_model, ours, ids, same)
    for name in set(mine) - set(same):   # kept transposed here (GPT-OSS's experts: [E, out, in]; [E, in, out] there)
        assert relative_error(mine[name].grad.transpose(-2, -1), theirs[name].grad) < GRAD_TOLERANCE, name
