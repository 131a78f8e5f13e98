"""Pipeline stages of Hugging Face models (GPT-2, Llama and Mixtral causal LMs, BERT masked LM, ViT image
classifier): what each stage of ``colossal.pipeline`` runs in place of the model's own ``forward``.

[Note: a Hugging Face model cut into pipeline stages]
The split itself is data for ``colossal.pipeline``: the policy names the block sequence
(``HFPolicy.pp_blocks``: ``transformer.h``, ``model.layers``, ``bert.encoder.layer``,
``vit.layers``); the embeddings registered before it go to the first stage, the final norm and the
head after it to the last. What a stage *runs* is the model's own forward, cut at the block
boundaries:

* **first stage** (``embed``): GPT-2 ``drop(wte(ids) + wpe(positions))``; Llama and Mixtral
  ``embed_tokens(ids)``; BERT ``bert.embeddings(ids, position_ids, token_type_ids)``; ViT
  ``vit.embeddings(pixel_values)``.
* **every block** (``block_call``): the layer with the arguments the model's forward gives it: the
  4-D attention mask that ``transformers.masking_utils`` builds from the user's ``attention_mask``
  (``create_causal_mask``: causal plus key padding; ``create_bidirectional_mask`` for BERT and
  ViT; each for the model's attention implementation), for the decoders the ``position_ids``,
  ``use_cache=False`` and no cache; Llama and Mixtral also get the rotary ``(cos, sin)`` of those positions.
  Mask and angles are built once per micro-batch on each rank (kept in the micro-batch's extras
  dict, ``[Note: per-micro-batch extras]`` in ``colossal.pipeline.stages``), since every rank is
  handed the whole batch.
* **last stage** (``head``): final norm, then the head: the logits the user's criterion sees
  (``(b, T, V)`` for the language models, ``(b, labels)`` for ViT; ``labels`` are the pipeline's
  targets; the shift of the causal LM loss is the criterion's, as in ``model.loss_function``).

Only the hidden state ``(b, T, C)`` crosses stages. Llama's rotary embedding is registered after
the norm, so the pipeline would leave its ``inv_freq`` buffer (not a checkpoint entry) real on the
last stage only: each rank builds a private one from the config, outside the model, for its blocks.
GPT-2's tied ``wte``/``lm_head`` is one logical weight held by the first and the last stage, its
gradient summed over the two (``[Note: tied embeddings]`` in ``colossal.pipeline.stages``).

Nothing here imports ``transformers`` at module level.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["PIPELINE_INPUTS", "hf_stage_fns"]

PIPELINE_INPUTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gpt2": ("input_ids", ("attention_mask", "position_ids")),
    "llama": ("input_ids", ("attention_mask", "position_ids")),
    "mixtral": ("input_ids", ("attention_mask", "position_ids")),
    "bert": ("input_ids", ("attention_mask", "position_ids", "token_type_ids")),
    "vit": ("pixel_values", ()),
}
"""``model_type`` -> (the input the first stage embeds, the further inputs every stage may take,
each shaped like the first: ``(B, T)``)."""

_MASK, _ROPE = "_colossal_causal_mask", "_colossal_rotary"  # derived values kept in a micro-batch's extras


def _positions(x: torch.Tensor, extras: dict) -> torch.Tensor:
    """The micro-batch's ``position_ids`` ``(b, T)``, or ``0..T-1`` as the model's forward makes them."""
    pos = extras.get("position_ids")
    return pos if pos is not None else torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, T)


def _causal_mask(config, x: torch.Tensor, extras: dict):
    """The model's own attention mask for this micro-batch (``None`` where its attention runs causal
    without one), built once and kept in ``extras``."""
    if _MASK not in extras:
        from transformers.masking_utils import create_causal_mask

        extras[_MASK] = create_causal_mask(
            config=config, inputs_embeds=x, attention_mask=extras.get("attention_mask"),
            past_key_values=None, position_ids=_positions(x, extras),
        )  # fmt: skip
    return extras[_MASK]


def _layer_out(out):
    """A decoder layer's hidden state (older ``transformers`` return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def _gpt2_embed(model: nn.Module, ids: torch.Tensor, extras: dict) -> torch.Tensor:
    t = model.transformer
    return t.drop(t.wte(ids) + t.wpe(_positions(ids, extras)))  # (b, T, C)


def _gpt2_block(model: nn.Module, block: nn.Module, x: torch.Tensor, extras: dict) -> torch.Tensor:
    mask = _causal_mask(model.config, x, extras)
    return _layer_out(block(x, None, mask, use_cache=False, position_ids=_positions(x, extras)))


def _gpt2_head(model: nn.Module, x: torch.Tensor, extras: dict) -> torch.Tensor:
    return model.lm_head(model.transformer.ln_f(x))  # (b, T, V)


def _llama_embed(model: nn.Module, ids: torch.Tensor, extras: dict) -> torch.Tensor:
    return model.model.embed_tokens(ids)  # (b, T, C)


def _llama_block(model: nn.Module, rotary: nn.Module, block: nn.Module, x: torch.Tensor, extras: dict) -> torch.Tensor:
    pos = _positions(x, extras)
    mask = _causal_mask(model.config, x, extras)
    if _ROPE not in extras:
        extras[_ROPE] = rotary(x, position_ids=pos)  # (cos, sin), each (b, T, head_dim)
    out = block(
        x, attention_mask=mask, position_ids=pos, past_key_values=None, use_cache=False,
        position_embeddings=extras[_ROPE],
    )  # fmt: skip
    return _layer_out(out)


def _llama_head(model: nn.Module, x: torch.Tensor, extras: dict) -> torch.Tensor:
    return model.lm_head(model.model.norm(x))  # (b, T, V)


def _bidirectional_mask(config, x: torch.Tensor, extras: dict):
    """The encoder's own attention mask for this micro-batch (padding only), built once."""
    if _MASK not in extras:
        from transformers.masking_utils import create_bidirectional_mask

        extras[_MASK] = create_bidirectional_mask(
            config=config, inputs_embeds=x, attention_mask=extras.get("attention_mask")
        )
    return extras[_MASK]


def _bert_embed(model: nn.Module, ids: torch.Tensor, extras: dict) -> torch.Tensor:
    return model.bert.embeddings(
        input_ids=ids, position_ids=extras.get("position_ids"), token_type_ids=extras.get("token_type_ids")
    )  # (b, T, C)


def _bert_block(model: nn.Module, block: nn.Module, x: torch.Tensor, extras: dict) -> torch.Tensor:
    return _layer_out(block(x, _bidirectional_mask(model.config, x, extras)))


def _bert_head(model: nn.Module, x: torch.Tensor, extras: dict) -> torch.Tensor:
    return model.cls(x)  # (b, T, V)


def _vit_embed(model: nn.Module, pixels: torch.Tensor, extras: dict) -> torch.Tensor:
    dtype = model.vit.embeddings.patch_embeddings.projection.weight.dtype
    return model.vit.embeddings(pixels.to(dtype))  # (b, 1 + patches, C)


def _vit_head(model: nn.Module, x: torch.Tensor, extras: dict) -> torch.Tensor:
    return model.classifier(model.vit.layernorm(x)[:, 0, :])  # the CLS token: (b, labels)


def _private_rotary(model: nn.Module, device: torch.device) -> nn.Module:
    """The model's rotary embedding rebuilt from its config on ``device``, outside the model: its
    ``inv_freq`` is a non-persistent buffer (in no checkpoint) that a model built on the meta
    device holds uninitialised, so it is computed afresh rather than copied."""
    return type(model.model.rotary_emb)(config=model.config).to(device)


def hf_stage_fns(model_type: str, model: nn.Module, device: torch.device):
    """``(embed, head, block_call)`` for ``colossal.pipeline.PipelineParallel`` of a Hugging Face
    causal LM of ``model_type`` (``[Note: a Hugging Face model cut into pipeline stages]``). Call
    it before the pipeline splits the model (Llama copies its rotary embedding)."""
    if model_type == "gpt2":
        return _gpt2_embed, _gpt2_head, functools.partial(_gpt2_block, model)
    if model_type in ("llama", "mixtral"):  # the same decoder call (Mixtral's sparse-MoE block inside)
        return _llama_embed, _llama_head, functools.partial(_llama_block, model, _private_rotary(model, device))
    if model_type == "bert":
        return _bert_embed, _bert_head, functools.partial(_bert_block, model)
    if model_type == "vit":
        return _vit_embed, _vit_head, functools.partial(_bert_block, model)  # the same call: (x, mask)
    raise NotImplementedError(f"{model_type}: no pipeline stages; supported: {', '.join(PIPELINE_INPUTS)}")
