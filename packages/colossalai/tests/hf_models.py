"""Tiny random Hugging Face models (hidden 32, 2 layers, no dropout; built locally, never
downloaded) with a batch maker and a loss for each, shared by the Hugging Face tests."""

from __future__ import annotations

import torch

B, T, V = 8, 8, 64
FAMILIES = ("gpt2", "llama", "bert", "vit")


def build(family: str):
    """The tiny model of ``family`` (seed it first)."""
    import transformers as tf

    if family == "gpt2":
        cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=32, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
        return tf.GPT2LMHeadModel(cfg)
    if family == "llama":
        cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=V, max_position_embeddings=32,
                             use_cache=False)  # fmt: skip
        return tf.LlamaForCausalLM(cfg)
    if family == "mixtral":
        cfg = tf.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=V, max_position_embeddings=32,
                               num_local_experts=4, num_experts_per_tok=2, use_cache=False)  # fmt: skip
        return tf.MixtralForCausalLM(cfg)
    if family == "bert":
        cfg = tf.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            vocab_size=V, max_position_embeddings=32, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)  # fmt: skip
        return tf.BertForMaskedLM(cfg)
    if family == "vit":
        cfg = tf.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=4, num_channels=3, num_labels=5, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)  # fmt: skip
        return tf.ViTForImageClassification(cfg)
    raise ValueError(family)


def batches(family: str, steps: int = 3) -> list[dict]:
    """``steps`` global batches. Text: right padding of 0 or 3 tokens alternating by row, so every
    contiguous half of the batch holds the same number of real tokens (dp ranks' mean losses then
    average to the global mean)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        if family == "vit":
            out.append(
                {
                    "pixel_values": torch.randn(B, 3, 16, 16, generator=g),
                    "labels": torch.randint(0, 5, (B,), generator=g),
                }
            )
            continue
        ids = torch.randint(1, V, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1::2, T - 3 :] = 0
        labels = ids.masked_fill(mask == 0, -100)
        if family == "bert":  # masked LM: predict positions 1 and 4 of every row
            keep = torch.zeros(B, T, dtype=torch.bool)
            keep[:, [1, 4]] = True
            labels = labels.masked_fill(~keep, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def loss(model, batch: dict) -> torch.Tensor:
    """The model's own loss (``labels`` given)."""
    return model(**batch).loss


def logits_of(model, x) -> torch.Tensor:
    """The model's eval-mode logits for ``input_ids=x``, as fp32 on the CPU (training mode restored)."""
    model.eval()
    with torch.no_grad():
        out = model(input_ids=x).logits.detach().float().cpu()
    model.train()
    return out
