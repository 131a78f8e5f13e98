"""Loading and exporting parameters in OpenFold's and AlphaFold's naming.

[Note: the two namings]
*OpenFold* (PyTorch ``state_dict``): this package's modules carry OpenFold's attribute names, so a
stack's keys are OpenFold's minus the model prefix: ``evoformer.blocks.0.msa_att_row.mha.linear_q.weight``
-> ``blocks.0.msa_att_row.mha.linear_q.weight`` of :class:`~fastfold.EvoformerStack`. Prefixes
``evoformer.``, ``extra_msa_stack.``, ``template_embedder.template_pair_stack.`` /
``template_pair_stack.`` and wrapper prefixes ``module.``/``model.`` are stripped; OpenFold 1.x's
``blocks.N.core.<name>`` (before the pair stack was factored out) is accepted too.

*AlphaFold* (Haiku parameters, as in ``params_model_*.npz``): keys ``<scope>//<name>``, e.g.
``alphafold/alphafold_iteration/evoformer/evoformer_iteration/msa_row_attention_with_pair_bias/attention//query_w``,
with every block of a stack stacked on a leading axis. Layouts: linear ``weights`` [in, out];
attention ``query_w``/``key_w``/``value_w``/``gating_w`` [in, heads, head_dim], ``gating_b``
[heads, head_dim], ``output_w`` [heads, head_dim, out]; global attention ``key_w``/``value_w``
[in, head_dim]; outer-product ``output_w`` [c, c, out]; layer norm ``scale``/``offset``. AlphaFold
swaps left/right of the *incoming* triangle update relative to the paper (its einsum is
``kjc,kic->ijc``), so ``left_*`` maps to ``linear_b_*`` there, as OpenFold's importer does.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

__all__ = ["openfold_state_dict", "load_openfold_state_dict", "alphafold_params", "load_alphafold_params"]

_AF = "alphafold/alphafold_iteration/evoformer/"
_OF_PREFIXES = ("evoformer.", "extra_msa_stack.", "template_embedder.template_pair_stack.", "template_pair_stack.")
_LEGACY_CORE = ("msa_transition", "outer_product_mean")


# ---------------------------------------------------------------- OpenFold


def openfold_state_dict(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """``module``'s parameters under OpenFold names, each key prefixed by ``prefix`` (e.g. ``"evoformer."``)."""
    return {prefix + k: v.detach().clone() for k, v in module.state_dict().items()}


def _strip(key: str) -> str:
    for wrapper in ("module.", "model."):
        key = key.removeprefix(wrapper)
    for p in _OF_PREFIXES:
        if key.startswith(p):
            return key[len(p) :]
    return key


def _legacy(key: str) -> str:
    parts = key.split(".")
    if len(parts) > 3 and parts[0] == "blocks" and parts[2] == "core":
        inner = parts[3]
        parts[2:3] = [] if inner in _LEGACY_CORE else ["pair_stack"]
    return ".".join(parts)


def load_openfold_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], prefix: str | None = None):
    """Load an OpenFold ``state_dict`` (whole model or one stack) into ``module``. ``prefix``
    selects the stack's keys (default: the first of the known stack prefixes found); keys of
    other modules are ignored, and missing or mis-shaped parameters raise ``ValueError``."""
    keys = list(state_dict)
    if prefix is None:
        found = [p for p in _OF_PREFIXES if any(_strip_wrappers(k).startswith(p) for k in keys)]
        prefix = found[0] if found else ""
    own = {}
    for k in keys:
        bare = _strip_wrappers(k)
        if bare.startswith(prefix):
            own[_legacy(bare[len(prefix) :])] = state_dict[k]
    _copy_into(module, own, "OpenFold state_dict")


def _strip_wrappers(key: str) -> str:
    for wrapper in ("module.", "model."):
        key = key.removeprefix(wrapper)
    return key


def _copy_into(module: nn.Module, tensors: Mapping[str, torch.Tensor], what: str) -> None:
    params = module.state_dict()
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise ValueError(f"{what} lacks {len(missing)} parameters of {type(module).__name__}, e.g. {missing[:3]}")
    for name, p in params.items():
        src = (
            torch.as_tensor(np.asarray(tensors[name])) if not isinstance(tensors[name], torch.Tensor) else tensors[name]
        )
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"{what}: {name} has shape {tuple(src.shape)}, expected {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(src)


# ---------------------------------------------------------------- AlphaFold
# An entry: (scope relative to the block, haiku name, torch name relative to the block, layout kind).


def _ln(scope, pt):
    return [(scope, "scale", f"{pt}.weight", "plain"), (scope, "offset", f"{pt}.bias", "plain")]


def _lin(scope, pt):
    return [(scope, "weights", f"{pt}.weight", "linear"), (scope, "bias", f"{pt}.bias", "plain")]


def _att(scope, pt, global_kv=False):
    kv = "linear" if global_kv else "mha_w"
    return [
        (scope, "query_w", f"{pt}.linear_q.weight", "mha_w"),
        (scope, "key_w", f"{pt}.linear_k.weight", kv),
        (scope, "value_w", f"{pt}.linear_v.weight", kv),
        (scope, "gating_w", f"{pt}.linear_g.weight", "mha_w"),
        (scope, "gating_b", f"{pt}.linear_g.bias", "mha_b"),
        (scope, "output_w", f"{pt}.linear_o.weight", "mha_o"),
        (scope, "output_b", f"{pt}.linear_o.bias", "plain"),
    ]


def _tri_mul(scope, pt, incoming):
    left, right = ("b", "a") if incoming else ("a", "b")
    out = _ln(f"{scope}/layer_norm_input", f"{pt}.layer_norm_in") + _ln(
        f"{scope}/center_layer_norm", f"{pt}.layer_norm_out"
    )
    out += _lin(f"{scope}/left_projection", f"{pt}.linear_{left}_p") + _lin(
        f"{scope}/right_projection", f"{pt}.linear_{right}_p"
    )
    out += _lin(f"{scope}/left_gate", f"{pt}.linear_{left}_g") + _lin(f"{scope}/right_gate", f"{pt}.linear_{right}_g")
    return out + _lin(f"{scope}/output_projection", f"{pt}.linear_z") + _lin(f"{scope}/gating_linear", f"{pt}.linear_g")


def _tri_att(scope, pt):
    out = _ln(f"{scope}/query_norm", f"{pt}.layer_norm") + _att(f"{scope}/attention", f"{pt}.mha")
    return out + [(scope, "feat_2d_weights", f"{pt}.linear.weight", "linear")]


def _transition(scope, pt):
    return (
        _ln(f"{scope}/input_layer_norm", f"{pt}.layer_norm")
        + _lin(f"{scope}/transition1", f"{pt}.linear_1")
        + _lin(f"{scope}/transition2", f"{pt}.linear_2")
    )


def _pair_entries(pt):
    return (
        _tri_mul("triangle_multiplication_outgoing", f"{pt}tri_mul_out", False)
        + _tri_mul("triangle_multiplication_incoming", f"{pt}tri_mul_in", True)
        + _tri_att("triangle_attention_starting_node", f"{pt}tri_att_start")
        + _tri_att("triangle_attention_ending_node", f"{pt}tri_att_end")
        + _transition("pair_transition", f"{pt}pair_transition")
    )


def _evoformer_block_entries(global_col: bool):
    row = "msa_row_attention_with_pair_bias"
    out = _ln(f"{row}/query_norm", "msa_att_row.layer_norm_m") + _ln(f"{row}/feat_2d_norm", "msa_att_row.layer_norm_z")
    out += [(row, "feat_2d_weights", "msa_att_row.linear_z.weight", "linear")] + _att(
        f"{row}/attention", "msa_att_row.mha"
    )
    if global_col:
        col = "msa_column_global_attention"
        out += _ln(f"{col}/query_norm", "msa_att_col.layer_norm_m")
        out += _att(f"{col}/attention", "msa_att_col.global_attention", global_kv=True)
    else:
        col = "msa_column_attention"
        out += _ln(f"{col}/query_norm", "msa_att_col._msa_att.layer_norm_m") + _att(
            f"{col}/attention", "msa_att_col._msa_att.mha"
        )
    out += _transition("msa_transition", "msa_transition")
    opm = "outer_product_mean"
    out += _ln(f"{opm}/layer_norm_input", f"{opm}.layer_norm") + _lin(f"{opm}/left_projection", f"{opm}.linear_1")
    out += _lin(f"{opm}/right_projection", f"{opm}.linear_2")
    out += [
        (opm, "output_w", f"{opm}.linear_out.weight", "opm_w"),
        (opm, "output_b", f"{opm}.linear_out.bias", "plain"),
    ]
    return out + _pair_entries("pair_stack.")


def _layout(module: nn.Module):
    """(stacked scope, per-block entries, unstacked entries with absolute scopes) of a stack."""
    from fastfold.model import EvoformerStack, ExtraMSAStack, TemplatePairStack

    if isinstance(module, EvoformerStack):
        return f"{_AF}evoformer_iteration", _evoformer_block_entries(False), _lin(f"{_AF}single_activations", "linear")
    if isinstance(module, ExtraMSAStack):
        return f"{_AF}extra_msa_stack", _evoformer_block_entries(True), []
    if isinstance(module, TemplatePairStack):
        single = f"{_AF}template_embedding/single_template_embedding/"
        return (
            f"{single}template_pair_stack/__layer_stack_no_state",
            _pair_entries(""),
            _ln(f"{single}output_layer_norm", "layer_norm"),
        )
    raise NotImplementedError(
        "AlphaFold naming is supported for EvoformerStack, ExtraMSAStack and TemplatePairStack, "
        f"not {type(module).__name__}"
    )


def _to_torch(w: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "linear":
        return w.T
    if kind == "mha_w":
        return w.reshape(w.shape[0], -1).T  # [in, H, d] -> [H*d, in]
    if kind == "mha_b":
        return w.reshape(-1)  # [H, d] -> [H*d]
    if kind in ("mha_o", "opm_w"):
        return w.reshape(-1, w.shape[-1]).T  # [H, d, out] or [c, c, out] -> [out, H*d] / [out, c*c]
    return w


def _to_af(module: nn.Module, name: str, p: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("mha_w", "mha_b", "mha_o"):
        att = module.get_submodule(name.rsplit(".", 2)[0])
        h, d = att.no_heads, att.c_hidden
        if kind == "mha_w":
            return p.T.reshape(p.shape[1], h, d)
        return p.reshape(h, d) if kind == "mha_b" else p.T.reshape(h, d, p.shape[0])
    if kind == "opm_w":
        c = int(round(p.shape[1] ** 0.5))
        return p.T.reshape(c, c, p.shape[0])
    return p.T if kind == "linear" else p


def alphafold_params(module: nn.Module) -> dict[str, np.ndarray]:
    """``module``'s parameters as AlphaFold (Haiku, ``npz``-style) arrays keyed ``<scope>//<name>``."""
    stacked, block_entries, single = _layout(module)
    params = dict(module.named_parameters())
    out: dict[str, np.ndarray] = {}
    for scope, name, pt, kind in block_entries:
        per_block = [
            _to_af(module, f"blocks.{i}.{pt}", params[f"blocks.{i}.{pt}"], kind) for i in range(len(module.blocks))
        ]
        out[f"{stacked}/{scope}//{name}"] = torch.stack(per_block).detach().cpu().numpy()
    for scope, name, pt, kind in single:
        out[f"{scope}//{name}"] = _to_af(module, pt, params[pt], kind).detach().cpu().numpy()
    return out


def _flatten(params: Mapping) -> dict:
    flat = {}
    for k, v in params.items():
        if isinstance(v, Mapping):  # Haiku's nested {scope: {name: array}}
            flat.update({f"{k}//{n}": a for n, a in v.items()})
        else:
            flat[k] = v
    return flat


def load_alphafold_params(module: nn.Module, params: Mapping) -> None:
    """Load AlphaFold parameters (flat ``<scope>//<name>`` dict as in the ``npz`` files, or Haiku's
    nested dict) into ``module``; keys of other modules are ignored."""
    flat = _flatten(params)
    stacked, block_entries, single = _layout(module)
    n_blocks = len(module.blocks)
    tensors: dict[str, torch.Tensor] = {}
    for scope, name, pt, kind in block_entries:
        key = f"{stacked}/{scope}//{name}"
        if key not in flat:
            raise ValueError(f"AlphaFold params lack {key!r} (needed for blocks.*.{pt})")
        w = torch.as_tensor(np.asarray(flat[key]))
        if w.shape[0] != n_blocks:
            raise ValueError(f"{key} stacks {w.shape[0]} blocks, the module has {n_blocks}")
        tensors.update({f"blocks.{i}.{pt}": _to_torch(w[i], kind) for i in range(n_blocks)})
    for scope, name, pt, kind in single:
        key = f"{scope}//{name}"
        if key not in flat:
            raise ValueError(f"AlphaFold params lack {key!r} (needed for {pt})")
        tensors[pt] = _to_torch(torch.as_tensor(np.asarray(flat[key])), kind)
    _copy_into(module, tensors, "AlphaFold params")
