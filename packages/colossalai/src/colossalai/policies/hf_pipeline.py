"""Pipeline stages of Hugging Face causal language models (GPT-2, Llama): what each stage of
``colossal.pipeline`` runs in place of the model's own ``forward``.

[Note: a Hugging Face model cut into pipeline stages]
The split itself is data for ``colossal.pipeline``: the policy names the block sequence
(``HFPolicy.pp_blocks``: ``transformer.h``, ``model.layers``); the embeddings registered before it
go to the first stage, the final norm and the LM head after it to the last. What a stage *runs* is
the model's own forward, cut at the block boundaries:

* **first stage** (``embed``): GPT-2 ``drop(wte(ids) + wpe(positions))``; Llama ``embed_tokens(ids)``.
* **every block** (``block_call``): the decoder layer with the arguments the model's forward gives
  it: the 4-D attention mask that ``transformers.masking_utils.create_causal_mask`` builds from the
  user's ``attention_mask`` (causal plus key padding, for the model's attention implementation),
  the ``position_ids``, ``use_cache=False`` and no cache; Llama also gets the rotary
  ``(cos, sin)`` of those positions. Mask and angles are built once per micro-batch on each rank
  (kept in the micro-batch's extras dict, ``[Note: per-micro-batch extras]`` in
  ``colossal.pipeline.stages``), since every rank is handed the whole batch.
* **last stage** (``head``): final norm, then ``lm_head``: the logits ``(b, T, V)`` the user's
  criterion sees (``labels`` are the pipeline's targets; the shift of causal LM loss is the
  criterion's, as in ``model.loss_function``).

Only the hidden state ``(b, T, C)`` crosses stages. Llama's rotary embedding is registered after
the norm, so the pipeline would leave its ``inv_freq`` buffer (not a checkpoint entry) real on the
last stage only: each rank keeps a private copy of the module, outside the model, for its blocks.
GPT-2's tied ``wte``/``lm_head`` is one logical weight held by the first and the last stage, its
gradient summed over the two (``[Note: tied embeddings]`` in ``colossal.pipeline.stages``).

Nothing here imports ``transformers`` at module level.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

__all__ = ["PIPELINE_EXTRAS", "hf_stage_fns"]

PIPELINE_EXTRAS = ("attention_mask", "position_ids")
"""Keys a Hugging Face pipeline batch may hold besides ``input_ids`` (each ``(B, T)``)."""

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


def _private_rotary(model: nn.Module, device: torch.device) -> nn.Module:
    """A copy of the model's rotary embedding on ``device``, outside the model (rebuilt from the
    config when the model's is still on the meta device)."""
    rotary = model.model.rotary_emb
    if any(b.is_meta for b in rotary.buffers()):
        return type(rotary)(config=model.config, device=device)
    return copy.deepcopy(rotary).to(device)


def hf_stage_fns(model_type: str, model: nn.Module, device: torch.device):
    """``(embed, head, block_call)`` for ``colossal.pipeline.PipelineParallel`` of a Hugging Face
    causal LM of ``model_type`` (``[Note: a Hugging Face model cut into pipeline stages]``). Call
    it before the pipeline splits the model (Llama copies its rotary embedding)."""
    if model_type == "gpt2":
        return _gpt2_embed, _gpt2_head, functools.partial(_gpt2_block, model)
    if model_type == "llama":
        return _llama_embed, _llama_head, functools.partial(_llama_block, model, _private_rotary(model, device))
    raise NotImplementedError(f"{model_type}: no pipeline stages; supported: gpt2, llama")
