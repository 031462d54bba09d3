"""The baseline side of bench/train_throughput.py: Hugging Face transformers training the same model shape.

The model is built from the same preset file as ours (transformers reads Hugging Face config keys, which
the presets are), with transformers' fastest choices that work on this machine: grouped_mm experts, and
SDPA attention (flex_attention first for GPT-OSS, whose attention sinks SDPA lacks). A step is what a user's
loop does: each micro-batch's loss divided by their number and backpropagated, the global gradient norm
clipped to 1, fused AdamW. Precision "bf16": weights, gradients and AdamW state in bf16. Precision "mixed":
fp32 weights, forwards under torch.autocast(bfloat16).
"""
import torch

ATTENTION = {"gpt_oss": ("flex_attention", "sdpa", "eager"), "qwen3_moe": ("sdpa", "eager"),
             "deepseek_v2": ("sdpa", "eager"), "qwen3_5_moe_text": ("sdpa", "eager")}


def hf_model(preset: dict, precision: str, device: str, attention: str, weights: str | None = None):
    """Drawn from the preset, or loaded from the saved weights in the folder `weights`."""
    import transformers
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    choices = dict(attn_implementation=attention, experts_implementation="grouped_mm", dtype=dtype)
    if weights:
        return transformers.AutoModelForCausalLM.from_pretrained(weights, **choices).to(device)
    with torch.device(device):   # initialized where it lives: a CPU init of billions of values takes minutes
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**preset), **choices)


def hf_step(model, optimizer, ids: torch.Tensor, precision: str) -> float:
    """One optimizer step on ids [micro-batches, seq], one sequence per micro-batch; returns the mean loss."""
    total = torch.zeros((), device=ids.device)
    for row in ids.split(1):
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=precision == "mixed"):
            loss = model(input_ids=row, labels=row).loss / ids.shape[0]
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total.item()


def hf_optimizer(model, lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                             fused=next(model.parameters()).is_cuda)


def hf_setup(preset: dict, precision: str, device: str, ids: torch.Tensor, weights: str | None = None):
    """(model, attention) with the first attention implementation that runs a forward and backward here;
    the trial's gradients are dropped."""
    failures = []
    for attention in ATTENTION[preset["model_type"]]:
        try:
            model = hf_model(preset, precision, device, attention, weights)
            with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=precision == "mixed"):
                loss = model(input_ids=ids[:1], labels=ids[:1]).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            break
        except Exception as err:   # transformers raises several types for an unsupported attention
            failures.append(f"{attention}: {type(err).__name__}: {str(err)[:100]}")
            model = None
    if model is None:
        raise RuntimeError("no attention implementation ran: " + "; ".join(failures))
    return model, attention
