"""What a run writes to TensorBoard (<out>/tb), from rank 0: the step's scalars under train/, the held-out
loss and perplexity under eval/, and each MoE layer's expert load as a figure (layers x experts, labelled, with its colour scale) and
histograms under experts/, so that routing collapse shows at a glance. A resumed run purges what the
interrupted one logged after the checkpoint it resumes from, so every curve holds each step once. And what
it shows on the console as it goes (make_progress, busy_cpu_advice), and the GPU's data-sheet peak the MFU scalar is
taken against."""
import math
import sys
import time

import numpy as np
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
        figure = load_figure(loads, f"expert load at step {number}")
        self.writer.add_image("experts/load", np.asarray(figure), number, dataformats="HWC")
        for layer, row in enumerate(loads.cpu()):
            self.writer.add_histogram(f"experts/load_of_layer_{layer}", row / row.mean().clamp_min(1e-9), number)

    def __enter__(self):
        return self

    def __exit__(self, *exc):   # also on an error: what was logged before it is flushed
        if self.writer is not None:
            self.writer.close()


def load_colours(ratio: torch.Tensor) -> torch.Tensor:
    """[..., 3] RGB in [0, 1] of each load over its mean: white where balanced, towards red up to 4x the mean and
    towards blue down to a quarter of it (log scale)."""
    tilt = (ratio.float().cpu().clamp_min(1e-9).log2() / 2).clamp(-1, 1)   # -1: a quarter or less, +1: 4x or more
    over, under = tilt.clamp_min(0), (-tilt).clamp_min(0)
    return torch.stack([1 - under, 1 - over - under, 1 - over], dim=-1)   # red keeps R, blue keeps B, white keeps all


def to_image(colours: torch.Tensor):
    from PIL import Image   # Pillow: a dependency of tensorboard's
    return Image.fromarray((colours * 255).round().to(torch.uint8).contiguous().numpy())


def ticks(count: int, most: int = 8) -> list[int]:
    """Tick positions 0, s, 2s, ... below count: s the smallest power of two or 1, 2 or 5 times a power of ten that
    gives at most `most` of them."""
    steps = sorted({b * 10 ** p for b in (1, 2, 5) for p in range(7)} | {2 ** p for p in range(24)})
    step = next(s for s in steps if -(-count // s) <= most)
    return list(range(0, count, step))


def load_figure(loads: torch.Tensor, title: str, rows: str = "MoE layer", row_names=None):
    """A PIL RGB figure of loads [rows, experts] by load_colours of each over its row's mean: a cell per (row, expert), the axes labelled (`rows` down, "expert"
    across, ticks by `ticks`, rows named by row_names or numbered from 0), a colour scale of load / mean from 1/4 to 4,
    and the title. The cells take about 512 x 320 pixels for 4 to 256 experts and 2 to 64 rows (at least 1 pixel
    each), so the figure is some 680 pixels wide: readable at TensorBoard's size, where a pixel per cell is not."""
    from PIL import Image, ImageDraw, ImageFont
    count, experts = loads.shape
    names = list(range(count)) if row_names is None else list(row_names)
    cell_w, cell_h = max(1, 512 // experts), max(1, min(40, 320 // count))
    width, height = experts * cell_w, count * cell_h
    left, top, bar = 64, 32, max(height, 160)
    font = ImageFont.load_default(size=13)
    figure = Image.new("RGB", (left + width + 112, top + bar + 48), "white")
    ratio = loads.float().cpu() / loads.float().cpu().mean(1, keepdim=True).clamp_min(1e-9)
    figure.paste(to_image(load_colours(ratio)).resize((width, height), Image.NEAREST), (left, top))
    draw = ImageDraw.Draw(figure)
    draw.rectangle([left - 1, top - 1, left + width, top + height], outline="black")
    draw.text((left, 8), title, fill="black", font=font)
    for e in ticks(experts):
        x = left + e * cell_w + cell_w // 2
        draw.line([(x, top + height), (x, top + height + 4)], fill="black")
        draw.text((x, top + height + 6), str(e), fill="black", font=font, anchor="ma")
    draw.text((left + width // 2, top + height + 24), "expert", fill="black", font=font, anchor="ma")
    for r in ticks(count):
        y = top + r * cell_h + cell_h // 2
        draw.line([(left - 5, y), (left - 1, y)], fill="black")
        draw.text((left - 8, y), str(names[r]), fill="black", font=font, anchor="rm")
    label = Image.new("RGB", (int(draw.textlength(rows, font=font)) + 2, 16), "white")
    ImageDraw.Draw(label).text((1, 1), rows, fill="black", font=font)
    figure.paste(label.rotate(90, expand=True), (4, top + height // 2 - label.width // 2))
    scale_x, levels = left + width + 24, torch.linspace(2, -2, bar)   # log2 of load / mean, top to bottom
    figure.paste(to_image(load_colours(levels.exp2()[:, None].expand(-1, 14))), (scale_x, top))
    draw.rectangle([scale_x - 1, top - 1, scale_x + 14, top + bar], outline="black")
    for power, text in zip(range(2, -3, -1), ("4", "2", "1", "1/2", "1/4")):
        y = top + round((2 - power) / 4 * (bar - 1))
        draw.line([(scale_x + 14, y), (scale_x + 18, y)], fill="black")
        draw.text((scale_x + 21, y), text, fill="black", font=font, anchor="lm")
    draw.text((scale_x + 7, top + bar + 6), "load / mean", fill="black", font=font, anchor="ma")
    figure.info["cells"] = (left, top, cell_w, cell_h)   # where the cells are, for a reader of the pixels
    return figure


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


def busy_cpu_advice(load: float, cores: int, threads: int) -> str | None:
    """A line for a process whose threads (torch's default: one per core) outnumber the cores other work leaves free
    (the last minute's load average): a thread that waits for a busy core stalls every step (one process on 2 busy
    cores ran 5-9x slower with 2 threads than with 1). Advice, not a change of the count: the load average is the
    last minute's, so a run started right after another sees that one's load on cores now idle."""
    free = max(1, round(cores - load))
    if threads <= free:
        return None
    return (f"the CPU is busy (load {load:.1f} on {cores} cores) and this run uses {threads} threads: if steps are "
            f"slow, run with OMP_NUM_THREADS={free}")
