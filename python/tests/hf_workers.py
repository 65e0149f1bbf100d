"""What each rank runs in ``test_hf.py``: small Hugging Face models (configs made here, no
download) sharded with ``collsched.torch.fully_shard`` per block and on the root, against the
same model unsharded in the same process: interface, training (no_sync micro-batches, a
frozen layer, SGD with momentum), a checkpoint saved and loaded into a model built from
other values, and ``generate()``. Comparisons that fail raise here, naming what differed;
what was compared goes back to the test."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

VOCAB = 64
PAD = 0
STEPS = 3
SPLIT = 2
MICRO = 2
# SGD with momentum: the checkpoint carries a state per element.
LR, MOMENTUM = 0.05, 0.9
# Relative and absolute tolerance of the trained parameters and losses (f32; the reference
# sums the ranks' gradients in another order than the reduction does).
RTOL, ATOL = 2e-6, 1e-7


def build(kind: str, seed: int) -> torch.nn.Module:
    """A tiny model of ``kind`` from ``seed`` (dropout off: both runs draw nothing)."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind in ("llama", "llama-tied"):
        cfg = tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=kind == "llama-tied",
            pad_token_id=PAD,
            bos_token_id=1,
            eos_token_id=2,
            attn_implementation="eager",
        )
        return tf.LlamaForCausalLM(cfg)
    if kind == "t5":
        cfg = tf.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=48,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            pad_token_id=PAD,
            eos_token_id=2,
            decoder_start_token_id=PAD,
        )
        return tf.T5ForConditionalGeneration(cfg)
    if kind == "bert":
        cfg = tf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=3,
            pad_token_id=PAD,
        )
        return tf.BertForSequenceClassification(cfg)
    raise ValueError(kind)


def blocks(kind: str, model: torch.nn.Module) -> list[torch.nn.Module]:
    if kind.startswith("llama"):
        return list(model.model.layers)
    if kind == "t5":
        return [*model.encoder.block, *model.decoder.block]
    return list(model.bert.encoder.layer)


def freeze(kind: str, model: torch.nn.Module) -> None:
    """One layer not trained, in both models."""
    part = {
        "llama": lambda m: m.model.layers[0].mlp,
        "llama-tied": lambda m: m.model.layers[1].self_attn,
        "t5": lambda m: m.encoder.block[0].layer[1],
        "bert": lambda m: m.bert.embeddings.position_embeddings,
    }[kind](model)
    for p in part.parameters():
        p.requires_grad_(False)


def batch(kind: str, step: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s inputs of a micro-batch: 3 sequences of 6 tokens, the first one
    left-padded by 2."""
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    ids = torch.randint(3, VOCAB, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :2] = PAD
    mask[0, :2] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if kind == "t5":
        out["labels"] = torch.randint(3, VOCAB, (3, 4), generator=g)
    elif kind == "bert":
        out["labels"] = torch.randint(0, 3, (3,), generator=g)
    else:
        labels = ids.clone()
        labels[mask == 0] = -100
        out["labels"] = labels
    return out


def generations(kind: str, model: torch.nn.Module) -> list[torch.Tensor]:
    """Greedy ``generate()`` with and without the cache, batched with left padding, and one
    sequence alone."""
    if kind == "bert":
        return []
    b = batch(kind, 99, 0, 0)
    ids, mask = b["input_ids"], b["attention_mask"]
    model.eval()
    # Under no_grad, as an evaluation: a registered method called with grad enabled would run
    # as a training pass around generate()'s own no_grad.
    with torch.no_grad():
        return _generations(model, ids, mask)


def _generations(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for use_cache in (True, False):
        out.append(
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=use_cache)
        )
    out.append(model.generate(input_ids=ids[1:2], max_new_tokens=5, do_sample=False))
    model.train()
    return out


def same_tokens(what: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> int:
    assert len(got) == len(want), f"{what}: {len(got)} generations, reference {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and torch.equal(g, w), f"{what} #{i}: tokens\n{g.tolist()}\nreference\n{w.tolist()}"
    return sum(g.numel() for g in got)


def shard(kind: str, model: torch.nn.Module) -> torch.nn.Module:
    import collsched.torch as cst

    for b in blocks(kind, model):
        cst.fully_shard(b, bucket_mb=0.01)
    model = cst.fully_shard(model, bucket_mb=0.01)
    if kind in ("t5", "llama-tied"):
        # An encoder-decoder's generate() calls the encoder outside forward (FSDP2 needs the
        # same call); a decoder-only model's works without it, and with it.
        cst.register_fsdp_forward_method(model, "generate")
    return model


def same_parameters(what: str, full: dict[str, torch.Tensor], ref: torch.nn.Module) -> int:
    want = dict(ref.named_parameters())
    assert sorted(full) == sorted(want), f"{what}: names {sorted(full)} against {sorted(want)}"
    for n, w in want.items():
        torch.testing.assert_close(full[n], w.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{what} {n}: {m}")
    return len(want)


def train_steps(kind, model, opt, ref, ref_opt, steps, rank, world) -> list[tuple[float, float]]:
    """Trains both models over ``steps`` (each ``MICRO`` micro-batches, all but the last under
    ``no_sync``); the reference takes the mean over every rank's batch. Returns (this rank's
    loss, the reference's loss of this rank's batch) per micro-batch."""
    losses = []
    for step in steps:
        for micro in range(MICRO):
            sync = micro == MICRO - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = model(**batch(kind, step, micro, rank)).loss
                loss.backward()
            ref_losses = [ref(**batch(kind, step, micro, r)).loss for r in range(world)]
            (sum(ref_losses) / world).backward()
            losses.append((loss.item(), ref_losses[rank].item()))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return losses


def run(rank: int, world: int, kind: str, path: str) -> dict[str, Any]:
    import collsched.torch as cst

    cst.init()
    ref = build(kind, 0)
    model = build(kind, 0)
    signature = inspect.signature(type(model).forward)
    cls = type(model)
    for m in (ref, model):
        freeze(kind, m)
    out: dict[str, Any] = {}
    model = shard(kind, model)
    out["interface"] = {
        "signature": inspect.signature(model.forward) == inspect.signature(ref.forward)
        and inspect.signature(type(model).forward) == signature,
        "forward": type(model).forward is cls.forward,
        "name": (type(model).__name__, type(model).__qualname__, type(model).__module__)
        == (cls.__name__, cls.__qualname__, cls.__module__),
        "isinstance": isinstance(model, cls) and isinstance(model, cst.CollschedModule),
        "config": model.config is not None and model.config.to_dict() == ref.config.to_dict(),
        "repr": repr(model).split("(", 1)[0] == cls.__name__,
    }
    out["tokens_before"] = same_tokens("generate before training", generations(kind, model), generations(kind, ref))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    losses = train_steps(kind, model, opt, ref, ref_opt, range(SPLIT), rank, world)
    out["params_saved"] = same_parameters("after the saved steps", cst.full_parameters(model), ref)
    cst.save_checkpoint(model, opt, path, step=SPLIT)
    # A model from other values, sharded, loads the checkpoint and trains on.
    other = build(kind, 7)
    freeze(kind, other)
    other = shard(kind, other)
    other_opt = torch.optim.SGD(other.parameters(), lr=LR, momentum=MOMENTUM)
    index = cst.load_checkpoint(other, other_opt, path)
    assert index["step"] == SPLIT, index
    losses += train_steps(kind, other, other_opt, ref, ref_opt, range(SPLIT, STEPS), rank, world)
    out["losses"] = losses
    full = cst.full_parameters(other)
    out["params"] = same_parameters("after the loaded steps", full, ref)
    # The trained sharded model generates what the same values generate unsharded.
    synced = build(kind, 0)
    synced.load_state_dict(full, strict=False)
    synced.tie_weights()
    out["tokens_after"] = same_tokens("generate after training", generations(kind, other), generations(kind, synced))
    out["live"] = cst.live_bytes(other)
    return out
