"""What ring attention keeps for the backward on each cp rank: the bytes its autograd graph saves
(torch.autograd.graph.saved_tensors_hooks, each storage counted once), one sequence at cp 1, 2 and 4 on gloo
processes, float32 on CPU."""
import torch
import torch.distributed as dist

from distributed import run_on_processes
from pith_engine.context_parallel import ring_attention, zigzag_positions

SEQ = 1024
GQA = dict(heads=8, kv_heads=1, dim=128)   # Qwen3-30B-A3B's head dim and 8 query heads a key-value head
MLA = dict(heads=16, nope=128, rope=64, v_dim=128, latent=512)   # DeepSeek-V2-Lite's attention


def saved_bytes(run) -> tuple[int, object]:
    """The bytes of the storages that run()'s autograd graph saves for its backward, each counted once, and what
    run() returned."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return sum(storages.values()), result


def gqa_inputs(generator):
    """q [1, heads, SEQ, dim] and the payload (k, v) [1, kv_heads, SEQ, dim]; no expand."""
    q = torch.randn(1, GQA["heads"], SEQ, GQA["dim"], generator=generator)
    return q, [torch.randn(1, GQA["kv_heads"], SEQ, GQA["dim"], generator=generator) for _ in "kv"], None


def mla_inputs(generator):
    """q [1, heads, SEQ, nope + rope] and the payload (latent [1, SEQ, latent], rope key [1, 1, SEQ, rope]) that
    expand turns into each head's key and value, as DeepseekV2Attention.keys_and_values does."""
    heads, nope, rope, v_dim = MLA["heads"], MLA["nope"], MLA["rope"], MLA["v_dim"]
    up = torch.randn(MLA["latent"], heads * (nope + v_dim), generator=generator) / MLA["latent"] ** 0.5

    def expand(latent, k_rope):
        k_nope, v = (latent @ up).unflatten(-1, (heads, nope + v_dim)).transpose(1, 2).split([nope, v_dim], -1)
        return torch.cat([k_nope, k_rope.expand(-1, heads, -1, -1)], -1), v
    q = torch.randn(1, heads, SEQ, nope + rope, generator=generator)
    return q, [torch.randn(1, SEQ, MLA["latent"], generator=generator),
               torch.randn(1, 1, SEQ, rope, generator=generator)], expand


def ring_memory_body(rank, world):
    singles = [dist.new_group([r]) for r in range(world)]   # every rank makes every group, in one order
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {1: singles[rank], 2: pairs[rank // 2], 4: dist.group.WORLD}
    for inputs in (gqa_inputs, mla_inputs):
        q, payload, expand = inputs(torch.Generator().manual_seed(0))
        measured = {}
        for cp, group in groups.items():
            mine = zigzag_positions(SEQ // cp, cp, rank % cp)   # every tensor's sequence is its dim -2
            q_part, *payload_part = (t.index_select(-2, mine).requires_grad_() for t in (q, *payload))
            measured[cp], (out, lse) = saved_bytes(lambda: ring_attention(q_part, tuple(payload_part), group, 0.1,
                                                                          expand=expand))
            kept = (q_part, *payload_part, out, lse)
            assert measured[cp] == sum(t.numel() * t.element_size() for t in kept), (inputs.__name__, cp)
        assert measured[2] <= 0.55 * measured[1] and measured[4] <= 0.3 * measured[1], (inputs.__name__, measured)


def test_a_ranks_saved_activations_are_its_share_of_the_sequence():
    """1024 tokens, GQA (8 query heads on one key-value head of 128 dims) and MLA (DeepSeek-V2-Lite's 16 heads, its
    latent of 512 and rope key of 64 travelling): each rank saves exactly its queries, its payload, the merged
    output and lse (asserted to the byte), so cp 2 saves 0.5 and cp 4 0.25 of cp 1's bytes (asserted: at most 0.55
    and 0.3). Measured at cp 1, 2, 4: GQA 9.03, 4.52, 2.26 MiB; MLA 22.31, 11.16, 5.58 MiB. The ring before it,
    which kept every block it received and each block's output and lse (and on CPU its scores, which shrink
    with cp too), saved GQA 81.1, 46.6, 29.4 MiB (0.36 at cp 4) and MLA 177.3, 106.7, 71.5 MiB (its keys and
    values expanded from every block: 0.40)."""
    run_on_processes(4, ring_memory_body)
