"""Single-GPU training throughput of the three families against Hugging Face transformers.

Every measured configuration (side, family, micro-batches, precision) runs in a fresh Python process: this
script started again with --one, so no compiled code, allocator state or global torch setting of one run
reaches another (transformers measured right after our compiled model in one process ran up to a third
slower than alone). This process imports neither torch nor either side.

Full width, 4 decoder layers (the real presets cut), 4096-token sequences of uniform random tokens, a step of
`accum` micro-batches of one sequence; median of the steps after 2 warm-ups (6 timed steps of 8 micro-batches,
as many micro-batches' worth of shorter steps: 48 of one). Our side runs the app's own `train_step` on the
app's model, replayed from the third step as one CUDA graph as the app does on one GPU (`--no-cuda-graph`: eagerly): precision "mixed" is the app's (fp32 master weights, gradients and AdamW state, bf16 compute),
"bf16" the same step with the model cast to bf16 (each kernel that can adds its gradient into the bf16 .grad
itself: add_grads_in_kernels). The baseline (bench/hf_baseline.py) does the matching
transformers step. MFU: model FLOPs per token (6 x the matmul weights a token passes through: attention,
router, active and shared experts, LM head; plus causal attention scores, a sliding window's only up to its
width) times tokens/s, in two columns: against the bf16 matmul peak measured here (8192^3, in a process of its
own; 775-810 TFLOP/s on the H200), and against the GPU's data-sheet dense bf16 peak (989 TFLOP/s for H100 / H200 SXM,
the convention of Megatron-LM and PaLM; the app's table by the GPU's name, or --peak-tflops; none on a CPU).

  PYTHONPATH=packages/pith-ops/src:packages/pith-engine/src:packages/pith-apps/src \
    python3 bench/train_throughput.py [--families qwen3] [--accum 1 8] [--precision bf16 mixed] [--repeats 2]
        [--sides pith] [--profile] [--no-cuda-graph]
        [--fp8 [experts all]]   (each of our rows also with the app's --fp8 in each mode named; alone: experts)
        [--recompute none selective full]   (each of our rows under each activation-recompute mode)
        [--optimizer adamw muon]   (each of our rows with each optimizer)
        [--routing balanced skewed even] [--skew 4]   (each row, both sides, under each routing: "skewed" adds a
            fixed Zipf-shaped bias per expert to every router's logits, calibrated so that the heaviest expert gets
            --skew times the mean load; "even" gives every expert the same load; bench/skew.py. Every row records
            its measured load_max_mean: the heaviest expert's slots over the mean, per step and MoE layer, averaged
            over layers and steps)
  ... --parity [--precision mixed] [--lr 1e-4]: from the same transformers weights, our loss over 20 AdamW
      steps on the bundled corpus (byte tokens) against transformers'
  ... --sdpa-check: transformers alone, and after one call of our causal attention in its process
  ... --grads: from the same weights, each gradient of one step against transformers' (mixed precision),
      with transformers' own bf16-vs-mixed difference per tensor for scale
  ... --fp8-convergence [--fp8 all] [--steps 300] [--lr 1e-4] [--accum 1]: our mixed-precision loss on Markov text (a
      fixed random chain over byte tokens, new text each step, its entropy rate the floor) with and without --fp8
      (its first mode named; default experts), from the same weights
  ... --optimizer-convergence [--steps 300] [--lrs 1e-3 3e-3 1e-2]: the same with AdamW and with Muon at each learning
      rate, each optimizer's best
  ... --peak-tflops P: the data-sheet peak of the second MFU column, TFLOP/s per GPU
  ... --lift-fla-guard: both sides run fla-core's delta rule (Qwen3.5) on a Hopper GPU with Triton 3.4-3.7.0, which
      it refuses (bench/gated_delta.py's lift_fla_hopper_guard)

Writes $OUT/train_throughput.json (or parity.json, sdpa_check.json, grads.json, fp8_convergence.json,
optimizer_convergence.json) when OUT is
set.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "packages/pith-apps/src/pith_apps/presets"
REAL = {"qwen3": "30b-a3b", "deepseek_v2": "lite", "gpt_oss": "20b", "qwen3_5": "35b-a3b"}
AUX_COEFS = ("router_aux_loss_coef", "aux_loss_alpha")


def preset_dict(family: str, preset: str, layers: int, aux: bool = True) -> dict:
    data = json.loads((PRESETS / f"{family}_{preset}.json").read_text()) | {"num_hidden_layers": layers}
    if "layer_types" in data:
        data["layer_types"] = data["layer_types"][:layers]
    return data | ({} if aux else {key: 0.0 for key in AUX_COEFS if key in data})


# ---- inside a fresh process (--one) ----

def markov_chain(symbols: int = 256, sharpness: float = 3.0):
    """A fixed random Markov chain over byte tokens, each token's successor drawn from the softmax of sharpness x
    standard normal logits; -> (its transition matrix, float64, and its entropy rate in nats: the least loss a
    model can reach on its text, 2.50 at these defaults)."""
    import torch
    chain = torch.softmax(sharpness * torch.randn(symbols, symbols, dtype=torch.float64,
                                                  generator=torch.Generator().manual_seed(0)), dim=-1)
    visits = torch.full((symbols,), 1.0 / symbols, dtype=torch.float64)
    for _ in range(200):   # the stationary distribution (a dense chain mixes in a few steps)
        visits = visits @ chain
    return chain, float((visits * -(chain * chain.log()).sum(dim=-1)).sum())


def markov_windows(count: int, seq: int):
    """count sequences of seq tokens walked on markov_chain, each from a random token: new text every step, which
    no model can learn by heart (a run on the bundled 160 KB corpus memorizes it within 300 steps of 4096 tokens)."""
    import torch
    chain, _ = markov_chain()
    ends, generator = chain.cumsum(dim=-1).float(), torch.Generator().manual_seed(1)
    draws = torch.rand(seq, count, 1, generator=generator)
    tokens = torch.empty(seq, count, dtype=torch.long)
    tokens[0] = torch.randint(0, chain.shape[0], (count,), generator=generator)
    for t in range(1, seq):
        tokens[t] = torch.searchsorted(ends[tokens[t - 1]], draws[t]).squeeze(1).clamp_max(chain.shape[0] - 1)
    return tokens.T.contiguous()


def batches(count: int, rows: int, seq: int, vocab: int, data: str = "random"):
    """(input_ids, labels) per step, from `data`: "corpus", windows of the bundled corpus in byte tokens (a loss
    that falls); "markov", markov_windows (a loss that falls toward a known floor); "random", uniform random tokens
    (timing: byte tokens at init would route a few hundred distinct embeddings, crowding some experts, where a real
    tokenizer's tokens spread over the vocabulary). The last position predicts nothing, as in transformers, which
    shifts input_ids to make its labels: both sides' losses are over the same seq - 1 tokens (one token more on one
    side moved a 32-token step's gradient by ~15%)."""
    import torch
    from pith_apps.data import DEFAULT_CORPUS, ByteTokenizer, batch_at
    if data == "corpus":
        stream = torch.tensor(ByteTokenizer().encode(DEFAULT_CORPUS.read_text()))
        pairs = [batch_at(stream, step, 0, rows, seq) for step in range(count)]
    else:
        windows = (markov_windows(count * rows, seq + 1).view(count, rows, seq + 1) if data == "markov" else
                   torch.randint(0, vocab, (count, rows, seq + 1), generator=torch.Generator().manual_seed(0)))
        pairs = [(window[:, :-1], window[:, 1:].clone()) for window in windows]
    for _, labels in pairs:
        labels[:, -1] = -100
    return pairs


def pith_setup(c: dict, preset: dict, hf_weights: str | None = None):
    """The app's model and step function for configuration c (compiled, AdamW, FP8 and CUDA graph as the app
    prepares them: prepare_step), its routers skewed or even under those routings; step -> (loss, the step's slots per
    expert [MoE layers, E], the app's own count)."""
    import torch
    from pith_apps.options import MODELS, check_args, model_config, parse_args
    from pith_apps.train import build_model, layout, prepare_step, train_step
    from pith_engine.data_parallel import add_grads_in_kernels
    with tempfile.TemporaryDirectory() as folder:
        config_file = Path(folder, "config.json")
        config_file.write_text(json.dumps(preset))
        args = parse_args([c["family"], "--config", str(config_file), "--seq-len", str(c["seq"]), "--batch-size",
                           str(c["accum"]), "--micro-batch-size", "1", "--device", c["device"], "--save-every", "0",
                           "--lr", str(c["lr"]), "--weight-decay", "0"]
                          + ([] if c.get("cuda_graph", True) else ["--no-cuda-graph"])
                          + (["--fp8", c["fp8"]] if c.get("fp8") else [])
                          + ["--recompute", c.get("recompute", "none"), "--optimizer", c.get("optimizer", "adamw")])
        check_args(args)
        cfg, model_cls = model_config(args), MODELS[args.model][1]
    parallel, device = layout(args)
    mixed = c["precision"] == "mixed"   # else: the fp32 model, built without compute casts, then cast to bf16
    model = build_model(model_cls, cfg, parallel, device, torch.bfloat16 if mixed else torch.float32, args.seed,
                        args.seq_len, micro_batches=c["accum"])
    if not mixed:
        model.to(torch.bfloat16)
        add_grads_in_kernels(model)
    if hf_weights:
        from pith_apps.hf_checkpoint import load_hf_weights
        load_hf_weights(model, hf_weights)
    if c.get("routing") == "skewed":   # before prepare_step, whose compile then traces the skewed router
        from skew import skew_bias, skew_our_routers
        skew_our_routers(model, skew_bias(preset, c["skew"]), on_logits=c["family"] == "gpt_oss")
    if c.get("routing") == "even":
        from skew import even_our_routers
        even_our_routers(model)
    optimizer, graph = prepare_step(args, parallel, device, model)

    def step(number, ids, labels):
        loss, _, _, (loads, _) = train_step(args, parallel, device, model, optimizer, number, ids, labels, graph)
        return loss, loads
    return model, step


def hf_setup_step(c: dict, preset: dict, first_ids, save_to: str | None = None):
    import torch
    from hf_baseline import hf_optimizer, hf_setup, hf_step
    from skew import even_logits, skew_bias, skewed_logits, watch_hf_routers
    model, attention = hf_setup(preset, "bf16" if save_to else c["precision"], c["device"], first_ids.to(c["device"]),
                                c.get("hf_weights"))
    if save_to:   # the parity run: weights saved as drawn in bf16, then trained in the run's precision
        model.save_pretrained(save_to)
        model.to(torch.float32 if c["precision"] == "mixed" else torch.bfloat16)
    optimizer = hf_optimizer(model, c["lr"])
    routing = c.get("routing")
    loads = watch_hf_routers(model, skewed_logits(skew_bias(preset, c["skew"]).to(c["device"])) if routing == "skewed"
                             else even_logits if routing == "even" else None)
    return lambda number, ids, labels: (hf_step(model, optimizer, ids.to(c["device"]), c["precision"]), loads()), \
        attention


def touch_our_attention(device: str):
    """One forward and backward of our causal attention at MLA's shape (the --sdpa-check variant)."""
    import torch
    from pith_apps.models.layers import causal_attention
    q, k = (torch.randn(1, 16, 4096, 192, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in "qk")
    v = torch.randn(1, 16, 4096, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    causal_attention(q, k, v, 192 ** -0.5).sum().backward()


def measure(c: dict) -> dict:
    """Run configuration c here and return its row."""
    fresh = not any(name.split(".")[0] in ("torch", "transformers", "pith_apps") for name in sys.modules)
    import time

    import torch
    if os.environ.get("LIFT_FLA_GUARD"):   # --lift-fla-guard, passed down to each configuration's process
        from gated_delta import lift_fla_hopper_guard
        lift_fla_hopper_guard()
    row = dict(c, pid=os.getpid(), fresh=fresh, torch=torch.__version__)
    cuda = c["device"].startswith("cuda")
    if c["side"] == "peak":   # the matmul peak measured here; the data sheet's by the GPU's name (None on a CPU)
        from pith_apps.run_log import peak_tflops
        return row | dict(tflops=matmul_peak(c["device"]), datasheet_tflops=peak_tflops(torch.device(c["device"])))
    if c["side"] == "grads":
        return row | dict(tensors=compare_grads(c))
    torch.manual_seed(0)
    preset = preset_dict(c["family"], c["preset"], c["layers"], aux=c.get("aux", True))
    steps = batches(c["steps"], c["accum"], c["seq"], preset["vocab_size"], c.get("data", "random"))
    if c.get("data") == "markov":
        row["floor"] = markov_chain()[1]
    if c.get("touch_attention"):
        touch_our_attention(c["device"])
    if c["side"] == "pith":
        step = pith_setup(c, preset, c.get("hf_weights"))[1]
    else:
        step, row["attention"] = hf_setup_step(c, preset, steps[0][0], c.get("save_to"))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses, loads = [], [], []
    for number, (ids, labels) in enumerate(steps, 1):
        if cuda:
            torch.cuda.synchronize()
        tic = time.perf_counter()
        loss, load = step(number, ids, labels)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - tic)
        losses.append(loss)
        loads.append(load)
    timed = sorted(times[2:]) or times
    median = timed[len(timed) // 2]
    row |= dict(step_s=round(median, 4), step_s_range=[round(timed[0], 4), round(timed[-1], 4)],
                tok_s=round(c["accum"] * c["seq"] / median), losses=[round(x, 4) for x in losses])
    from skew import load_stats
    row |= load_stats(loads)
    if cuda:
        row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    if c.get("profile"):
        fp8 = f"_fp8_{c['fp8']}" if c.get("fp8") else ""
        name = f"profile_{c['side']}_{c['family']}_{c['precision']}{fp8}_{c['accum']}.txt"
        row["gpu"] = profile_step(lambda: step(len(steps) + 1, *steps[-1]), Path(os.environ.get("OUT", "."), name))
    return row


def compare_grads(c: dict) -> list[dict]:
    """From the same bf16 weights (drawn by transformers), one forward and backward of one corpus sequence on
    our model (the app's precision), on transformers' in mixed precision and, for the scale of two correct
    runs, in bf16; per Hugging Face tensor, the relative difference of each gradient to transformers' mixed
    one. Aux losses off. Our gradients are read through hf_views, in the file's layout."""
    import torch
    from hf_baseline import hf_model, hf_setup
    preset = preset_dict(c["family"], c["preset"], c["layers"], aux=False)
    ids, labels = batches(1, 1, c["seq"], preset["vocab_size"], "corpus")[0]
    folder = tempfile.mkdtemp(prefix="grads-")
    model, attention = hf_setup(preset, "bf16", c["device"], ids.to(c["device"]))
    model.save_pretrained(folder)
    del model
    ours, _ = pith_setup(c | dict(precision="mixed", accum=1), preset, folder)
    (ours.loss_sum(ids.to(c["device"]), labels.to(c["device"])) / (labels != -100).sum()).backward()
    for param in ours.parameters():
        param.data = param.grad   # hf_views now shows the gradients
    # by our parameter name, then by checkpoint name in the file's layout (which wins where the names are the
    # same): transformers' in-memory tensors are one or the other
    named = list(ours.named_parameters()) + [(name, view) for name, view, *_ in ours.hf_views()]
    grads = dict(pith={name: tensor.float().clone() for name, tensor in named})
    del ours
    for precision in ("mixed", "bf16"):
        theirs = hf_model(preset, precision, c["device"], attention, folder)
        with torch.autocast(torch.device(c["device"]).type, dtype=torch.bfloat16,
                            enabled=precision == "mixed"):
            loss = theirs(input_ids=ids.to(c["device"]), labels=ids.to(c["device"])).loss
        loss.backward()
        grads[precision] = {name: p.grad.float() for name, p in theirs.named_parameters()}
        del theirs, loss
    shutil.rmtree(folder)
    reference = grads["mixed"]

    def gap(name, side):
        return round(((grads[side][name] - reference[name]).norm() / reference[name].norm().clamp_min(1e-30)).item(), 5)
    missing = [name for name in reference if grads["pith"].get(name, reference[name][:0]).shape != reference[name].shape]
    if missing:
        raise KeyError(f"transformers' gradients {missing[:3]} (of {len(missing)}) have no counterpart of ours")
    return [dict(name=name, norm=round(reference[name].norm().item(), 6), pith_gap=gap(name, "pith"),
                 hf_bf16_gap=gap(name, "bf16")) for name in sorted(reference)]


def profile_step(run_step, path: Path) -> dict:
    """One more step under torch.profiler: its kernels, largest total first, written to path; returns how much
    of the step's span the GPU was busy (the union of kernel times) and its idle gaps over 50 us, the longest
    with the kernels before and after them."""
    import torch
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=activities) as prof:
        run_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, gaps, end, last = 0.0, [], kernels[0][0] if kernels else 0.0, ""
    for start, stop, name in kernels:
        if start > end:
            gaps.append((start - end, last[:60], name[:60]))
        busy += max(0.0, stop - max(start, end))
        end, last = max(end, stop), name if stop >= end else last
    long_gaps = sorted((g for g in gaps if g[0] > 50), reverse=True)
    summary = dict(span_ms=round((end - kernels[0][0]) / 1e3, 2) if kernels else 0.0, busy_ms=round(busy / 1e3, 2),
                   gaps_over_50us=len(long_gaps), idle_in_those_ms=round(sum(g[0] for g in long_gaps) / 1e3, 2),
                   longest_gaps=[(round(g / 1e3, 3), before, after) for g, before, after in long_gaps[:10]])
    sort_by = "cuda_time_total" if kernels else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=120, max_name_column_width=90)
    path.write_text(json.dumps(summary) + "\n" + table)
    return summary


def matmul_peak(device: str) -> float:
    """bf16 matmul TFLOP/s at 8192^3 (fp32 on a CPU, which has no fast bf16)."""
    import time

    import torch
    size, cuda = (8192, True) if device.startswith("cuda") else (512, False)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    for repeat in (3, 10):
        if cuda:
            torch.cuda.synchronize()
        tic = time.perf_counter()
        for _ in range(repeat):
            a @ a
        if cuda:
            torch.cuda.synchronize()
    return float(f"{2 * size**3 * repeat / (time.perf_counter() - tic) / 1e12:.4g}")   # a CPU's is ~0.05


# ---- the driver ----

def isolated(config: dict) -> dict:
    """config measured in a process of its own; a failure comes back as the row's error."""
    done = subprocess.run([sys.executable, __file__, "--one", json.dumps(config)], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return dict(config, error=(done.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(lines[-1])


def configurations(args) -> list[dict]:
    base = dict(layers=args.layers, seq=args.seq, device=args.device, lr=1e-4, profile=args.profile,
                cuda_graph=args.cuda_graph)
    return [base | dict(side=side, family=family, preset=args.preset or REAL[family], accum=accum, precision=precision,
                        steps=args.steps or 2 + 6 * -(-8 // accum), fp8=fp8, recompute=recompute, optimizer=optimizer,
                        routing=routing) | (dict(skew=args.skew) if routing == "skewed" else {})
            for family in args.families for precision in args.precision for accum in args.accum
            for routing in args.routing for side in args.sides
            for fp8 in ((False, *args.fp8) if args.fp8 and side == "pith" else (False,))
            for recompute in (args.recompute if side == "pith" else ["none"])
            for optimizer in (args.optimizer if side == "pith" else ["adamw"])]


def peaks(args) -> dict:
    """The two peaks per GPU an MFU is taken against, TFLOP/s: the bf16 matmul peak measured in a process of its own,
    and the data sheet's (--peak-tflops, else the app's by the GPU's name; None where unknown, as on a CPU)."""
    measured = isolated(dict(side="peak", device=args.device))
    return dict(matmul_peak=measured["tflops"], datasheet=args.peak_tflops or measured["datasheet_tflops"])


def mfu_columns(tokens_per_s_per_gpu: float, flops: float, peak: dict) -> dict:
    """MFU against each known peak of `peaks`, in %, to 3 significant digits: a slow CPU's share (under 0.05%) stays
    visible, a GPU's reads 54.4."""
    return {f"mfu_{name}_pct": float(f"{100 * tokens_per_s_per_gpu * flops / (tflops * 1e12):.3g}")
            for name, tflops in peak.items() if tflops}


def throughput_table(args) -> dict:
    from pith_apps.config import flops_per_token   # torch-free; here, not at the top, which each --one would load
    peak = peaks(args)
    rows = []
    for repeat in range(args.repeats):
        for config in configurations(args):
            row = isolated(config | dict(repeat=repeat))
            if "tok_s" in row:
                preset = preset_dict(row["family"], row["preset"], row["layers"])
                row |= mfu_columns(row["tok_s"], flops_per_token(preset, row["seq"]), peak)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    print_table(rows, peak)
    return dict(peak_tflops=peak, rows=rows)


def print_table(rows: list[dict], peak: dict):
    print("\nfamily       precision        routing  accum repeat  pith tok/s   hf tok/s  speedup  MFU(m) pith / hf  "
          "MFU(d) pith / hf  pith GiB  hf GiB  load max/mean pith / hf")
    for r in [r for r in rows if r["side"] == "pith"]:
        theirs = next((t for t in rows if t["side"] == "hf" and all(t.get(k) == r.get(k) for k in
                                                                       ("family", "precision", "routing", "accum",
                                                                        "repeat"))), {})
        precision = r["precision"] + (f"+fp8:{r['fp8']}" if r.get("fp8") else "") + \
            (f"+{r['recompute']}" if r.get("recompute", "none") != "none" else "") + \
            (f"+{r['optimizer']}" if r.get("optimizer", "adamw") != "adamw" else "")
        if "error" in r or "error" in theirs:
            print(f"{r['family']:<12} {precision:<16} {r['routing']:<8} {r['accum']:>5}  error: "
                  f"{r.get('error') or theirs['error']}")
            continue
        speedup = f"{r['tok_s'] / theirs['tok_s']:>6.2f}x" if theirs else "      -"
        mfu = [" / ".join(f"{side[f'mfu_{name}_pct']}%" if f"mfu_{name}_pct" in side else "-" for side in (r, theirs))
               for name in ("matmul_peak", "datasheet")]
        load = " / ".join(str(side.get("load_max_mean", "-")) for side in (r, theirs))
        print(f"{r['family']:<12} {precision:<16} {r['routing']:<8} {r['accum']:>5} {r['repeat']:>6}  "
              f"{r['tok_s']:>10,} {format(theirs['tok_s'], ',') if theirs else '-':>10}  {speedup}  {mfu[0]:>17}  "
              f"{mfu[1]:>17}  {r.get('peak_mem_gib', '-'):>8}  {theirs.get('peak_mem_gib', '-'):>6}  {load:>23}")
    datasheet = f"{peak['datasheet']} TFLOP/s" if peak["datasheet"] else "not known for this device (--peak-tflops)"
    print(f"MFU(m): against the bf16 matmul peak measured here, {peak['matmul_peak']} TFLOP/s; MFU(d): against the "
          f"data sheet's dense bf16 peak, {datasheet}")


def parity(args) -> dict:
    """Per family and precision: transformers draws bf16 weights, saves them and trains 20 steps (--steps); the app
    loads the same weights and trains on the same batches. Aux losses off on both sides. For scale, transformers
    also trains from those weights in the other precision: how far two correct runs drift apart."""
    rows = []
    for family, precision in [(f, p) for f in args.families for p in args.precision]:
        folder = tempfile.mkdtemp(prefix=f"parity-{family}-")
        base = dict(family=family, preset=args.preset or REAL[family], layers=args.layers, seq=args.seq,
                    steps=args.steps or 20, accum=1, device=args.device, lr=args.lr, precision=precision, aux=False, data="corpus")
        runs = []   # transformers drawing and saving the weights, ours from them, transformers in the other precision
        for extra in (dict(side="hf", save_to=folder), dict(side="pith", hf_weights=folder),
                      dict(side="hf", hf_weights=folder, precision={"bf16": "mixed"}.get(precision, "bf16"))):
            runs.append(isolated(base | extra))
            print(json.dumps(dict(family=family, **extra, losses=runs[-1].get("losses"), error=runs[-1].get("error"))),
                  flush=True)   # as each ends: a run cut short by a time limit still shows the ones before
        theirs, ours, other = runs
        shutil.rmtree(folder)
        row = dict(family=family, precision=precision, hf=theirs.get("losses") or theirs.get("error"),
                   pith=ours.get("losses") or ours.get("error"), hf_other_precision=other.get("losses") or other.get("error"))
        for name, run in (("", ours), ("hf_other_precision_", other)):
            if "losses" in theirs and "losses" in run:
                gaps = [abs(a - b) / b for a, b in zip(run["losses"], theirs["losses"])]
                row |= {f"{name}init_gap_pct": round(100 * gaps[0], 3), f"{name}max_gap_pct": round(100 * max(gaps), 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return dict(rows=rows)


def fp8_convergence(args) -> dict:
    """Per family: the app's step (mixed precision) with and without --fp8 from the same initial weights on the same
    batches of Markov text (markov_windows: never repeated, a loss floor known), args.steps steps (default 300) at
    args.lr, each run in its own process; the gap of the mean loss of the last 10 steps, and each run's excess over
    the floor."""
    rows = []
    for family in args.families:
        base = dict(side="pith", family=family, preset=args.preset or REAL[family], layers=args.layers, seq=args.seq,
                    steps=args.steps or 300, accum=args.accum[0], device=args.device, lr=args.lr, precision="mixed",
                    data="markov", fp8_mode=(args.fp8 or ["experts"])[0])
        runs = {name: isolated(base | dict(fp8=name == "fp8" and base["fp8_mode"])) for name in ("bf16", "fp8")}
        row = dict(base, **{name: run.get("losses") or run.get("error") for name, run in runs.items()})
        if all("losses" in run for run in runs.values()):
            ends, floor = {name: sum(run["losses"][-10:]) / 10 for name, run in runs.items()}, runs["bf16"]["floor"]
            row |= dict(floor=round(floor, 4), end_bf16=round(ends["bf16"], 4), end_fp8=round(ends["fp8"], 4),
                        above_floor_pct={name: round(100 * (end / floor - 1), 2) for name, end in ends.items()},
                        end_gap_pct=round(100 * abs(ends["fp8"] - ends["bf16"]) / ends["bf16"], 3),
                        tok_s=dict(bf16=runs["bf16"]["tok_s"], fp8=runs["fp8"]["tok_s"]))
        print(json.dumps({k: v for k, v in row.items() if k not in ("bf16", "fp8")}), flush=True)
        rows.append(row)
    return dict(rows=rows)


def optimizer_convergence(args) -> dict:
    """Per family: the app's step (mixed precision) with AdamW and with Muon (--optimizer muon) at each of args.lrs,
    from the same initial weights on the same batches of Markov text, args.steps steps (default 300), each run in its
    own process; per optimizer the learning rate whose mean loss over the last 10 steps is lowest, and that loss."""
    rows = []
    for family in args.families:
        base = dict(side="pith", family=family, preset=args.preset or REAL[family], layers=args.layers, seq=args.seq,
                    steps=args.steps or 300, accum=args.accum[0], device=args.device, precision="mixed", data="markov")
        row = dict(base, ends={})
        for optimizer in ("adamw", "muon"):
            for lr in args.lrs:
                run = isolated(base | dict(optimizer=optimizer, lr=lr))
                row["ends"][f"{optimizer} {lr:g}"] = (round(sum(run["losses"][-10:]) / 10, 4) if "losses" in run
                                                      else run.get("error"))
                row["floor"] = run.get("floor", row.get("floor"))
        for optimizer in ("adamw", "muon"):
            ends = {key: end for key, end in row["ends"].items() if key.startswith(optimizer) and isinstance(end, float)}
            if ends:
                best = min(ends, key=ends.get)
                row[f"best_{optimizer}"] = dict(lr=float(best.split()[1]), end=ends[best])
        print(json.dumps(row), flush=True)
        rows.append(row)
    return dict(rows=rows)


def grads_check(args) -> dict:
    rows = []
    for family in args.families:
        row = isolated(dict(side="grads", family=family, preset=args.preset or REAL[family], layers=args.layers,
                            seq=args.seq, device=args.device, lr=1e-4))
        worst = sorted(row.get("tensors", []), key=lambda t: -t["pith_gap"] / max(t["hf_bf16_gap"], 1e-6))[:8]
        print(json.dumps(dict(family=family, error=row.get("error"), worst_against_the_bf16_scale=worst)), flush=True)
        rows.append(row)
    return dict(rows=rows)


def sdpa_check(args) -> dict:
    """transformers' DeepSeek-V2-Lite step alone, and after one call of our causal attention in its process."""
    base = dict(side="hf", family="deepseek_v2", preset=args.preset or REAL["deepseek_v2"], layers=args.layers,
                seq=args.seq, steps=args.steps or 8, accum=1, device=args.device, lr=1e-4, precision="bf16")
    rows = [isolated(base | dict(touch_attention=touched)) for touched in (False, True, False, True)]
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    return dict(rows=rows)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", help=argparse.SUPPRESS)   # a configuration as JSON: measure it in this process
    parser.add_argument("--families", nargs="+", default=list(REAL), choices=list(REAL))
    parser.add_argument("--accum", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--precision", nargs="+", default=["bf16", "mixed"], choices=["bf16", "mixed"])
    parser.add_argument("--sides", nargs="+", default=["pith", "hf"], choices=["pith", "hf"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, help="steps per run, the first 2 not timed (default: 2 + 6 x ceil(8 / "
                        "accum): two runs of 6 timed single-micro-batch steps differed by 5%%)")
    parser.add_argument("--repeats", type=int, default=1, help="times the whole table is run")
    parser.add_argument("--preset", help="another preset than the real one (e.g. tiny, for a CPU check)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", action="store_true", help="also profile one more step of each run: "
                        "$OUT/profile_<side>_<family>_<precision>_<accum>.txt and the row's GPU busy / idle time")
    parser.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", help="our steps eagerly, as "
                        "the app's --no-cuda-graph (default: replayed as one CUDA graph, as the app does on one GPU)")
    parser.add_argument("--parity", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-4, help="the parity and FP8 convergence runs' "
                        "learning rate (default 1e-4)")
    parser.add_argument("--sdpa-check", action="store_true")
    parser.add_argument("--fp8", nargs="*", choices=["experts", "all"], help="each of our configurations also with "
                        "the app's --fp8 in each mode named (alone: experts)")
    parser.add_argument("--recompute", nargs="+", default=["none"], choices=["none", "selective", "full"],
                        help="each of our configurations under each of these --recompute modes (default: none)")
    parser.add_argument("--optimizer", nargs="+", default=["adamw"], choices=["adamw", "muon"],
                        help="each of our configurations with each of these --optimizer (default: adamw)")
    parser.add_argument("--routing", nargs="+", default=["balanced"], choices=["balanced", "skewed", "even"],
                        help="each configuration, both sides, under each routing (default: balanced, the init's own): "
                        "skewed biases every router's logits so that the heaviest expert gets --skew times the mean "
                        "load; even gives every expert the same load")
    parser.add_argument("--skew", type=float, default=4.0, help="skewed routing's target: the heaviest expert's load "
                        "over the mean (default 4; below experts / top-k)")
    parser.add_argument("--fp8-convergence", action="store_true", help="our loss over --steps (default 300) steps of "
                        "Markov text at --lr with and without --fp8")
    parser.add_argument("--optimizer-convergence", action="store_true", help="our loss over --steps (default 300) "
                        "steps of Markov text with AdamW and with Muon at each of --lrs")
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2], help="the optimizer convergence "
                        "runs' learning rates (default 1e-3 3e-3 1e-2)")
    parser.add_argument("--grads", action="store_true", help="gradients, tensor by tensor, against transformers'")
    parser.add_argument("--peak-tflops", type=float, help="the data-sheet dense bf16 peak per GPU for the second MFU "
                        "column (default: the app's by the GPU's name, 989 for H100 / H200; none on a CPU)")
    parser.add_argument("--lift-fla-guard", action="store_true", help="both sides run fla-core's delta rule on a "
                        "Hopper GPU with Triton 3.4-3.7.0, which it refuses (bench/gated_delta.py)")
    args = parser.parse_args()
    if args.fp8 == []:   # --fp8 alone
        args.fp8 = ["experts"]
    if args.lift_fla_guard:
        os.environ["LIFT_FLA_GUARD"] = "1"
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return
    name, result = (("parity", parity(args)) if args.parity else ("sdpa_check", sdpa_check(args)) if args.sdpa_check
                    else ("grads", grads_check(args)) if args.grads
                    else ("fp8_convergence", fp8_convergence(args)) if args.fp8_convergence
                    else ("optimizer_convergence", optimizer_convergence(args)) if args.optimizer_convergence
                    else ("train_throughput", throughput_table(args)))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{name}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
