"""What a run shows: the progress lines and bar (run_log.make_progress) and the expert-load figure TensorBoard and
the routing-trace skill draw (run_log.load_figure)."""
import numpy as np
import pytest
import torch

import pith_apps.train as train_app
from pith_apps.run_log import load_figure, make_progress, ticks


def test_without_a_terminal_progress_is_a_line_every_twentieth_of_the_run(capsys):
    args = train_app.parse_args(["qwen3", "--steps", "50"])
    update = make_progress(10, args, terminal=False)   # resumed at step 10: 40 steps to go
    for step in range(40):
        update(5.0 - step / 10, 1234.5)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 20 and lines[0].startswith("step 12/50: loss 4.900, 1,234 tokens/s, eta ")
    assert lines[-1] == "step 50/50: loss 1.100, 1,234 tokens/s, eta 0m00s"


def test_an_evaluation_shows_its_held_out_loss_in_the_progress(capsys):
    """Without a terminal, a step that evaluated prints its line (between the twentieths too) with the held-out loss;
    on a terminal the bar shows the last one beside the loss."""
    args = train_app.parse_args(["qwen3", "--steps", "40"])
    update = make_progress(0, args, terminal=False)
    for step in range(3):
        update(5.0, 1000.0, 4.25 if step == 2 else None)   # step 3 evaluated; the twentieths are every 2nd step
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("step 3/40: loss 5.000, held-out loss 4.250, 1,000 tokens/s, eta ")
    update = make_progress(38, args, terminal=True)   # the bar's last 2 steps: it closes, showing its last state
    update(5.0, 1000.0, 4.25)
    update(4.0, 1000.0)
    assert "loss=4.000, held_out=4.250, tok_s=1,000" in capsys.readouterr().err


def dark_pixels(figure, box) -> int:
    """Pixels darker than mid-grey in box (left, top, right, bottom): text and tick marks, on a white ground."""
    return int((np.asarray(figure.crop(box)).astype(int).sum(-1) < 3 * 128).sum())


@pytest.mark.parametrize("rows,experts", [(2, 4), (2, 8), (48, 128), (64, 256)])   # tiny ... Qwen3-30B-A3B, beyond
def test_the_expert_load_figure_is_readable_at_its_size_with_its_labels_and_scale(rows, experts):
    """Some 690 x 240-400 pixels whatever the shape (TensorBoard shows an image at its size: one pixel per cell
    was a 16 x 32 thumbnail); each cell at least 2 x 5 pixels; a cell at 4x its row's mean is pure red, one at a
    quarter pure blue, balanced ones white (8-bit colours); text (title, tick labels, axis names, the scale's
    4 ... 1/4 and its name) in the bands above, below, left of the cells and right of the colour scale."""
    loads = torch.ones(rows, experts)
    loads[0] = torch.tensor([4.0] + [(experts - 4) / (experts - 1)] * (experts - 1))      # mean 1, expert 0 at 4x
    loads[1] = torch.tensor([0.25] + [(experts - 0.25) / (experts - 1)] * (experts - 1))  # mean 1, expert 0 at 1/4
    figure = load_figure(loads, "expert load at step 7")
    left, top, cell_w, cell_h = figure.info["cells"]
    width, height = figure.size
    assert 640 <= width <= 720 and 230 <= height <= 420 and cell_w >= 2 and cell_h >= 5
    centre = lambda row, expert: (left + expert * cell_w + cell_w // 2, top + row * cell_h + cell_h // 2)
    assert figure.getpixel(centre(0, 0)) == (255, 0, 0) and figure.getpixel(centre(1, 0)) == (0, 0, 255)
    balanced = load_figure(torch.full((rows, experts), 3.0), "")
    assert balanced.getpixel(centre(rows - 1, experts - 1)) == (255, 255, 255)
    plot_right, plot_bottom = left + experts * cell_w, top + rows * cell_h
    assert dark_pixels(figure, (left, 0, plot_right, top - 4)) > 50                  # the title
    assert dark_pixels(figure, (left, plot_bottom + 2, plot_right, height)) > 50     # expert ticks and "expert"
    assert dark_pixels(figure, (0, top, left - 2, plot_bottom)) > 50                 # row ticks and "MoE layer"
    assert dark_pixels(figure, (plot_right + 40, top, width, height)) > 50           # the scale's labels
    assert dark_pixels(balanced, (left, 0, plot_right, top - 4)) == 0                # (no title given: none drawn)


def test_ticks_are_at_most_eight_round_numbers_from_zero():
    assert ticks(2) == [0, 1] and ticks(8) == list(range(8)) and ticks(48) == list(range(0, 48, 8))
    assert ticks(128) == list(range(0, 128, 16)) and ticks(256) == list(range(0, 256, 32)) and ticks(61) == list(range(0, 61, 8))
