"""Hugging Face weights in and out on 4 and 8 gloo processes with no process holding the whole model: each rank reads
only the slices of the safetensors files its shards hold (--init) and writes only its own part of the export
(--export-hf), through the app's own functions. A model of 118 MB of fp32 weights (Qwen3-MoE, 32 experts): each
rank's peak memory (RSS) while loading or exporting grows by at most 1/world of that plus 24 MB (what the gloo
processes were seen to need beyond their part: under 10 MB); the old path had rank 0 build the whole model (118 MB and
more). The loaded weights equal the one-process load bit for bit; the export is byte for byte the one-process export
and transformers loads it with our logits."""
import json
import time
from argparse import Namespace

import pytest
import torch
import torch.distributed as dist

import pith_apps.train as train_app
from conftest import relative_error
from distributed import run_on_processes
from pith_apps.config import read_json
from pith_apps import hf_checkpoint
from pith_apps.hf_checkpoint import load_hf_weights, save_hf
from pith_apps.options import MODELS, PRESETS
from pith_engine.data_parallel import local_part, this_ranks_part
from pith_engine.parallel import Parallel

WIDE = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, head_dim=64, moe_intermediate_size=256,
            num_experts=32)
MARGIN = 24 * 2**20
LAYOUTS = {4: [dict(pp=2, ep=2)], 8: [dict(dp=2, ep=4), dict(dp=8, dp_replicate=2)]}


def wide_config() -> dict:
    return read_json(PRESETS / "qwen3_tiny.json") | WIDE


def one_process_model(data: dict):
    config_cls, model_cls = MODELS["qwen3"]
    return model_cls(config_cls.from_dict(data), Parallel())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The wide model's Hugging Face folder (random weights, as our export writes it), and its one-process export."""
    root = tmp_path_factory.mktemp("hf_per_rank")
    model = one_process_model(wide_config())
    model.init_weights(seed=5)
    hf_checkpoint.MAX_SHARD_BYTES = 30 * 2**20   # several files (as set again in each process)
    save_hf(model, wide_config(), root / "hf")
    one = one_process_model(wide_config())
    load_hf_weights(one, root / "hf")
    save_hf(one, wide_config(), root / "one")
    for world in LAYOUTS:
        run_on_processes(world, ranks_body, root)
    return root


def peak_growth(work) -> int:
    """How far this process's peak resident memory rose above its memory at the start of work()."""
    open("/proc/self/clear_refs", "w").write("5")   # the peak (VmHWM) back to the current RSS
    status = lambda key: int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(key)))
    start = status("VmRSS:")
    work()
    return (status("VmHWM:") - start) * 1024


def ranks_body(rank, world, root):
    torch.set_num_threads(1)
    hf_checkpoint.MAX_SHARD_BYTES = 30 * 2**20
    data = wide_config()
    args = Namespace(init=str(root / "hf"), export_hf=None, tokenizer=None, model="qwen3", layers=None)
    train_app.hf_config_data = lambda args: data   # the app's config of the run: the wide one
    results = []
    for sizes in LAYOUTS[world]:
        parallel = Parallel.build(**sizes)
        held = None
        if parallel.pp > 1:
            chunks = train_app.chunk_layers(data["num_hidden_layers"], parallel.pp)
            held = train_app.held_layers(chunks, parallel.coords["pp"])
        config_cls, model_cls = MODELS["qwen3"]
        dist.barrier()
        tic = time.perf_counter()
        model = train_app.build_model(model_cls, config_cls.from_dict(data), parallel, torch.device("cpu"),
                                      torch.float32, 0, 32, held=held)
        loaded = peak_growth(lambda: train_app.init_from_hf(args, model))
        dist.barrier()
        seconds = time.perf_counter() - tic
        name = "-".join(f"{k}{v}" for k, v in sizes.items())
        args.export_hf = str(root / f"export-{name}")
        exported = peak_growth(lambda: train_app.export_hf(args, parallel, model, torch.float32))
        reference = one_process_model(data)   # after the measurements: every rank's part against it
        load_hf_weights(reference, root / "hf")
        full = dict(reference.named_parameters())
        unequal = [n for n, p in model.named_parameters() if not torch.equal(
            local_part(p.detach()), this_ranks_part(held_part(full, n, p, model), p))]
        results.append(dict(layout=name, loaded=loaded, exported=exported, unequal=unequal, seconds=seconds))
    every = [None] * world
    dist.all_gather_object(every, results)
    if rank == 0:
        (root / f"results-{world}.json").write_text(json.dumps(every))


def held_part(full: dict, name: str, param, model) -> torch.Tensor:
    """The one-process parameter `name` cut to the experts this rank's stack holds (before FSDP's row shard)."""
    tensor = full[name].detach()
    if ".mlp.experts." in name:
        experts = model.get_submodule(name.rsplit(".", 1)[0])
        tensor = tensor[experts.first_expert:experts.first_expert + experts.local_experts]
    return tensor


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_each_rank_loads_and_exports_only_its_part(folders, world, capsys):
    fp32_bytes = sum(p.numel() * 4 for p in one_process_model(wide_config()).parameters())
    assert 110e6 < fp32_bytes < 130e6
    for rank, results in enumerate(json.loads((folders / f"results-{world}.json").read_text())):
        for result in results:
            assert result["unequal"] == [], (rank, result)
            for what in ("loaded", "exported"):
                assert result[what] <= fp32_bytes / world + MARGIN, (rank, result["layout"], what, result[what])
            with capsys.disabled():
                if rank == 0:
                    print(f"\n{world} processes, {result['layout']}: build + --init {result['seconds']:.1f} s; rank 0 "
                          f"grew {result['loaded'] / 2**20:.1f} MiB loading, {result['exported'] / 2**20:.1f} MiB "
                          f"exporting (its share: {fp32_bytes / world / 2**20:.1f} MiB)")
    for layout in LAYOUTS[world]:
        export = folders / ("export-" + "-".join(f"{k}{v}" for k, v in layout.items()))
        files = sorted(p.name for p in (folders / "one").iterdir())
        assert sorted(p.name for p in export.iterdir()) == files and len(files) > 3
        assert all((export / f).read_bytes() == (folders / "one" / f).read_bytes() for f in files)


def test_an_export_of_eight_processes_loads_in_transformers_with_our_logits(folders):
    import transformers
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folders / "export-dp8-dp_replicate2",
                                                               attn_implementation="eager")
    ours = one_process_model(wide_config())
    load_hf_weights(ours, folders / "hf")
    ids = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert relative_error(theirs(input_ids=ids).logits, ours(ids)) < 1e-5


def test_convert_of_a_checkpoint_holds_one_layer_at_a_time(folders, tmp_path):
    """pith-convert of the wide model's checkpoint (4 layers of 27 MiB, the embedding and the LM head 8 MiB each)
    grows this process's peak memory by at most the largest layer with the embedding or head, plus 24 MB; it
    writes the one-process export's tensors."""
    from safetensors.torch import load_file
    from pith_apps import convert
    saved = convert.hf_to_checkpoint(folders / "hf", tmp_path / "weights")
    model = one_process_model(wide_config())
    layer = max(sum(p.numel() * 4 for p in model.layers[n].parameters()) for n in model.layers)
    ends = sum(p.numel() * 4 for p in model.model.embed_tokens.parameters())
    del model
    grown = peak_growth(lambda: convert.checkpoint_to_hf(saved, tmp_path / "export"))
    assert grown <= layer + ends + MARGIN, (grown, layer, ends)
    exported = {k: v for f in (tmp_path / "export").glob("*.safetensors") for k, v in load_file(f).items()}
    reference = {k: v for f in (folders / "one").glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(exported) == sorted(reference) and all(torch.equal(exported[k], reference[k]) for k in exported)
