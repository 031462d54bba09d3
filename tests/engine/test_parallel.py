import itertools

import pytest

from pith_engine.parallel import Parallel, LayoutError


def test_ranks_are_laid_out_pp_dp_cp_ep_outer_to_inner():
    sizes = dict(pp=2, dp=3, cp=2, ep=2)
    grid = list(itertools.product(*(range(n) for n in sizes.values())))   # row-major = rank order
    for rank, coords in enumerate(grid):
        layout = Parallel(**sizes, rank=rank)
        assert tuple(layout.coords.values()) == coords
        for dims in (("ep",), ("dp", "cp"), ("pp",), ("dp", "cp", "ep")):
            expected = [r for r, c in enumerate(grid)
                        if all(c[i] == coords[i] for i, name in enumerate(sizes) if name not in dims)]
            assert layout.ranks_along(*dims) == expected


def test_single_process_layout():
    layout = Parallel.build()
    assert (layout.pp, layout.dp, layout.cp, layout.ep, layout.rank) == (1, 1, 1, 1, 0)
    assert layout.ranks_along("dp", "ep") == [0]


@pytest.mark.parametrize("sizes,message", [
    (dict(dp=2), r"pp x dp x cp x ep = 1 x 2 x 1 x 1 = 2, but the world has 1 processes"),
    (dict(ep=0), r"--ep=0 must be a positive integer"),
])
def test_impossible_world_layouts_are_named(sizes, message):
    with pytest.raises(LayoutError, match=message):
        Parallel.build(**sizes)


@pytest.mark.parametrize("layout,model,message", [
    (dict(ep=3), dict(num_experts=8), "num_experts=8 cannot be split over ep=3"),
    (dict(pp=2), dict(num_layers=3), r"num_hidden_layers=3 is fewer than the 2 x pp = 4"),
    (dict(cp=2), dict(seq_len=6), r"seq_len=6 must be divisible by 2 x cp = 4"),
])
def test_models_that_cannot_be_cut_are_named(layout, model, message):
    sizes = dict(num_layers=8, num_experts=8, seq_len=64) | model
    with pytest.raises(LayoutError, match=message):
        Parallel(**layout).check_model(**sizes)


def test_a_single_layer_model_needs_no_pipeline_chunks():
    Parallel().check_model(num_layers=1, num_experts=8, seq_len=64)   # raises on a regression
    with pytest.raises(LayoutError, match=r"num_hidden_layers=1 is fewer than the 2 x pp = 4"):
        Parallel(pp=2).check_model(num_layers=1, num_experts=8, seq_len=64)
