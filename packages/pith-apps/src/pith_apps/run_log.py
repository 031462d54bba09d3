"""What a run writes to TensorBoard (<out>/tb), from rank 0: the step's scalars under train/, the held-out
loss and perplexity under eval/, and each MoE layer's expert load as a heatmap image (layers x experts) and
histograms under experts/, so that routing collapse shows at a glance. A resumed run purges what the
interrupted one logged after the checkpoint it resumes from, so every curve holds each step once. And what
it shows on the console as it goes (make_progress), and the GPU's data-sheet peak the MFU scalar is taken against."""
import math
import sys
import time

import torch


PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}   # bf16 dense, NVIDIA's data sheets


def peak_tflops(device: torch.device) -> float | None:
    """The GPU's bf16 dense peak by its name (PEAK_TFLOPS), for the MFU scalar (each GPU's share of the run's
    training FLOP/s against it); None when unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for model, peak in PEAK_TFLOPS.items() if model in name), None)


class RunLog:
    def __init__(self, tb_folder, start: int, lead: bool, images_every: int):
        self.images_every, self.writer = images_every, None
        if lead:
            from torch.utils.tensorboard import SummaryWriter  # heavy import: only when training
            self.writer = SummaryWriter(str(tb_folder), purge_step=start + 1 if start else None)

    def step(self, number: int, scalars: dict, routing, last: bool):
        """routing: (expert loads [MoE layers, experts], aux loss) of the step (update_expert_bias), or None."""
        if self.writer is None:
            return
        if routing is not None:
            loads, aux = routing
            scalars = scalars | dict(aux_loss=aux.item())
            if number % self.images_every == 0 or last:
                self.expert_load(number, loads)
        for name, value in scalars.items():
            self.writer.add_scalar(f"train/{name}", value, number)

    def eval(self, number: int, loss: float):
        if self.writer is not None:
            self.writer.add_scalar("eval/loss", loss, number)
            self.writer.add_scalar("eval/perplexity", math.exp(min(loss, 700.0)), number)

    def expert_load(self, number: int, loads: torch.Tensor):
        self.writer.add_image("experts/load", load_heatmap(loads), number, dataformats="CHW")
        for layer, row in enumerate(loads.cpu()):
            self.writer.add_histogram(f"experts/load_of_layer_{layer}", row / row.mean().clamp_min(1e-9), number)

    def __enter__(self):
        return self

    def __exit__(self, *exc):   # also on an error: what was logged before it is flushed
        if self.writer is not None:
            self.writer.close()


def load_heatmap(loads: torch.Tensor, cell: int = 8) -> torch.Tensor:
    """[3, layers x cell, experts x cell] RGB in [0, 1]: each expert's load over its layer's mean, white where
    balanced, towards red up to 4x the mean and towards blue down to a quarter of it (log scale)."""
    ratio = loads.float().cpu() / loads.float().cpu().mean(1, keepdim=True).clamp_min(1e-9)
    tilt = (ratio.clamp_min(1e-9).log2() / 2).clamp(-1, 1)   # -1: a quarter of the mean or less, +1: 4x or more
    over, under = tilt.clamp_min(0), (-tilt).clamp_min(0)
    image = torch.stack([1 - under, 1 - over - under, 1 - over])   # red keeps R, blue keeps B, white keeps all
    return image.repeat_interleave(cell, 1).repeat_interleave(cell, 2)


def make_progress(start: int, args, terminal: bool | None = None):
    """update(loss, tokens_per_s, held_out loss or None) after each step: a progress bar with the ETA on a terminal
    (stderr), the last held-out loss beside the loss; elsewhere (a log file, a job scheduler) a line every twentieth
    of the run, at its end and at each evaluation, which the line then gives."""
    if args.quiet:
        return lambda loss, tokens_per_s, held_out=None: None
    if not (sys.stderr.isatty() if terminal is None else terminal):
        return progress_lines(start, args.steps)
    from tqdm import tqdm
    bar = tqdm(total=args.steps, initial=start, desc=f"train {args.model}", unit="step", dynamic_ncols=True)
    shown = {}

    def update(loss, tokens_per_s, held_out=None):
        if held_out is not None:
            shown["held_out"] = f"{held_out:.3f}"
        bar.set_postfix({"loss": f"{loss:.3f}", **shown, "tok_s": f"{tokens_per_s:,.0f}"}, refresh=False)
        bar.update()
        if bar.n == args.steps:
            bar.close()
    return update


def progress_lines(start: int, steps: int):
    every, tic, done = max(1, (steps - start) // 20), time.perf_counter(), [start]

    def update(loss, tokens_per_s, held_out=None):
        done[0] += 1
        if (done[0] - start) % every == 0 or done[0] == steps or held_out is not None:
            left = (time.perf_counter() - tic) / (done[0] - start) * (steps - done[0])
            evaluated = "" if held_out is None else f", held-out loss {held_out:.3f}"
            print(f"step {done[0]}/{steps}: loss {loss:.3f}{evaluated}, {tokens_per_s:,.0f} tokens/s, "
                  f"eta {int(left // 60)}m{int(left % 60):02d}s", flush=True)
    return update
