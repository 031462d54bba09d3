"""torch.compile of the dense stages (fullgraph) against eager, per family. CPU compiles cost ~30 s a graph,
so each family compiles one tiny model once: forward and backward."""
import pytest
import torch
from torch._dynamo.utils import counters

from conftest import grad_tolerance, relative_error
from pith_apps.config import read_json
from pith_apps.options import MODELS, PRESETS
from pith_engine.compile import compile_stages

# distinct compiled graphs expected: stage 1 (+ DeepSeek's dense layer, + GPT-OSS's and Qwen3.5's second attention
# kind); more would mean a recompile per layer
GRAPHS = {"qwen3": 1, "deepseek_v2": 2, "gpt_oss": 2, "qwen3_5": 2}


@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_stages_match_eager_forward_and_backward(name):
    torch._dynamo.reset()
    counters.clear()
    config_cls, model_cls = MODELS[name]
    cfg = config_cls.from_dict(read_json(PRESETS / f"{name}_tiny.json") | {"num_hidden_layers": 4 if name == "qwen3_5" else 3} |
                               ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
                                if name == "gpt_oss" else {}))   # Qwen3.5's 4: three linear-attention layers, one full
    eager = model_cls(cfg)
    eager.init_weights(0)
    compiled = model_cls(cfg)
    compiled.load_state_dict(eager.state_dict())
    compile_stages(compiled)
    ids = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(0))
    losses = [(model.loss_sum(ids, ids) / ids.numel()) for model in (eager, compiled)]
    for loss in losses:
        loss.backward()
    # float32; inductor fuses and reorders reductions: seen up to 1.3e-6
    assert abs(losses[0].item() - losses[1].item()) < 1e-5 * losses[0].item()
    for (param_name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert relative_error(b.grad, a.grad) < grad_tolerance(name, param_name), param_name
    assert counters["stats"]["unique_graphs"] == GRAPHS[name]
