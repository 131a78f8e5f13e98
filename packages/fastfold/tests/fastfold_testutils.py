"""Shared helpers of the fastfold tests: tiny configs, random weights and inputs, and float64
references written directly from the AlphaFold 2 supplementary algorithms (independent of the
module code: they only read the parameter tensors)."""

import math

import torch

from fastfold import EvoformerConfig, ExtraMSAConfig, TemplatePairConfig

torch.set_num_threads(1)  # the test machine is shared: no thread oversubscription

D = torch.float64
INF = 1e9


def tiny_evo(**kw):
    base = dict(c_m=12, c_z=8, c_s=6, c_hidden_msa_att=4, no_heads_msa=2, c_hidden_opm=3, c_hidden_mul=5)
    base.update(c_hidden_pair_att=4, no_heads_pair=2, transition_n=2, no_blocks=2)
    base.update(kw)
    return EvoformerConfig(**base)


def tiny_extra(**kw):
    base = dict(c_m=6, c_z=8, c_hidden_msa_att=3, no_heads_msa=2, c_hidden_opm=3, c_hidden_mul=5)
    base.update(c_hidden_pair_att=4, no_heads_pair=2, transition_n=2, no_blocks=2)
    base.update(kw)
    return ExtraMSAConfig(**base)


def tiny_template(**kw):
    base = dict(c_t=8, c_hidden_tri_att=4, no_heads=2, c_hidden_tri_mul=5, pair_transition_n=2, no_blocks=2)
    base.update(kw)
    return TemplatePairConfig(**base)


def randomize_(module, seed=0, std=0.3):
    """Random weights everywhere (AlphaFold's zero-initialised output layers would hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(
                torch.randn(p.shape, generator=g, dtype=p.dtype) * std + (1.0 if name.endswith("norm.weight") else 0)
            )
    return module


def rand(*shape, seed=0, dtype=D):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def rand_mask(*shape, seed=0, dtype=D):
    mask = (torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > 0.25).to(dtype)
    mask[..., 0] = 1  # every row keeps at least one key
    return mask


# ---------------------------------------------------------------- references (Algorithms 7-19)


def ln(x, mod, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * mod.weight + mod.bias


def lin(x, mod):
    out = torch.einsum("...i,oi->...o", x, mod.weight)
    return out if mod.bias is None else out + mod.bias


def heads(x, h):
    return x.reshape(*x.shape[:-1], h, -1)


def gated_attention(mha, x_q, x_kv_batch_first, bias_fn, mask_keys):
    """Gated attention of Algorithm 7/8/13 written with explicit indices: x [B, N, c];
    logits[b, h, i, j] = q_bih . k_bjh / sqrt(d) + bias_fn(b, h, i, j) + inf * (mask[b, j] - 1)."""
    h = mha.no_heads
    q, k, v = heads(lin(x_q, mha.linear_q), h), heads(lin(x_q, mha.linear_k), h), heads(lin(x_q, mha.linear_v), h)
    g = torch.sigmoid(heads(lin(x_q, mha.linear_g), h))
    logits = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.shape[-1]) + bias_fn
    logits = logits + INF * (mask_keys[:, None, None, :] - 1)
    a = torch.softmax(logits, -1)
    o = g * torch.einsum("bhij,bjhd->bihd", a, v)
    return lin(o.reshape(*o.shape[:-2], -1), mha.linear_o)


def ref_msa_row(mod, m, z, mask):
    """Algorithm 7: b_ij^h = LinearNoBias(LN(z_ij)); attention over residues of each sequence."""
    mn = ln(m, mod.layer_norm_m)
    b = lin(ln(z, mod.layer_norm_z), mod.linear_z)  # [R, R, H]
    return gated_attention(mod.mha, mn, None, b.permute(2, 0, 1)[None], mask)


def ref_msa_col(mod, m, mask):
    """Algorithm 8: attention over sequences of each residue column."""
    att = mod._msa_att
    mn = ln(m, att.layer_norm_m).transpose(0, 1)  # [R, S, c]
    return gated_attention(att.mha, mn, None, 0.0, mask.transpose(0, 1)).transpose(0, 1)


def ref_global_col(mod, m, mask, eps=1e-10):
    """Algorithm 19."""
    ga = mod.global_attention
    mn = ln(m, mod.layer_norm_m)  # [S, R, c]
    h, d = ga.no_heads, ga.c_hidden
    q_avg = torch.einsum("sr,src->rc", mask, mn) / (mask.sum(0)[:, None] + eps)
    q = heads(lin(q_avg, ga.linear_q), h) / math.sqrt(d)  # [R, H, d]
    k, v = lin(mn, ga.linear_k), lin(mn, ga.linear_v)  # [S, R, d]
    logits = torch.einsum("rhd,srd->rhs", q, k) + INF * (mask.transpose(0, 1)[:, None, :] - 1)
    a = torch.softmax(logits, -1)
    o = torch.einsum("rhs,srd->rhd", a, v)
    g = torch.sigmoid(heads(lin(mn, ga.linear_g), h))  # [S, R, H, d]
    out = g * o[None]
    return lin(out.reshape(*out.shape[:-2], -1), ga.linear_o)


def ref_transition(mod, x, mask=None):
    """Algorithms 9 and 15 (update multiplied by the mask, as OpenFold does)."""
    out = lin(torch.relu(lin(ln(x, mod.layer_norm), mod.linear_1)), mod.linear_2)
    return out if mask is None else out * mask[..., None]


def ref_opm(mod, m, mask, eps=1e-3):
    """Algorithm 10 with the masked mean: o_ij = Linear(sum_s a_si (x) b_sj) / (eps + sum_s mask_si mask_sj)."""
    mn = ln(m, mod.layer_norm)
    a, b = lin(mn, mod.linear_1) * mask[..., None], lin(mn, mod.linear_2) * mask[..., None]
    outer = torch.einsum("sic,sje->ijce", a, b).reshape(a.shape[1], b.shape[1], -1)
    return lin(outer, mod.linear_out) / (eps + torch.einsum("si,sj->ij", mask, mask))[..., None]


def ref_tri_mul(mod, z, mask, outgoing):
    """Algorithms 11 (outgoing: sum_k a_ik b_jk) and 12 (incoming: sum_k a_ki b_kj)."""
    zn = ln(z, mod.layer_norm_in)
    a = mask[..., None] * torch.sigmoid(lin(zn, mod.linear_a_g)) * lin(zn, mod.linear_a_p)
    b = mask[..., None] * torch.sigmoid(lin(zn, mod.linear_b_g)) * lin(zn, mod.linear_b_p)
    g = torch.sigmoid(lin(zn, mod.linear_g))
    x = torch.einsum("ikc,jkc->ijc", a, b) if outgoing else torch.einsum("kic,kjc->ijc", a, b)
    return g * lin(ln(x, mod.layer_norm_out), mod.linear_z)


def ref_tri_att(mod, z, mask, starting):
    """Algorithms 13 (starting: attend over k of z_ik, bias b_jk) and 14 (ending: attend over k of
    z_kj, bias b_ki)."""
    zn = ln(z, mod.layer_norm)
    b = lin(zn, mod.linear).permute(2, 0, 1)  # [H, R, R]: b[h, x, y] = b_xy^h
    if starting:
        return gated_attention(mod.mha, zn, None, b[None], mask)
    out = gated_attention(mod.mha, zn.transpose(0, 1), None, b.transpose(1, 2)[None], mask.transpose(0, 1))
    return out.transpose(0, 1)


def ref_pair_updates(stack, z, mask, order):
    fns = {
        "tri_mul_out": lambda z: ref_tri_mul(stack.tri_mul_out, z, mask, True),
        "tri_mul_in": lambda z: ref_tri_mul(stack.tri_mul_in, z, mask, False),
        "tri_att_start": lambda z: ref_tri_att(stack.tri_att_start, z, mask, True),
        "tri_att_end": lambda z: ref_tri_att(stack.tri_att_end, z, mask, False),
        "pair_transition": lambda z: ref_transition(stack.pair_transition, z, mask),
    }
    for name in order:
        z = z + fns[name](z)
    return z


def ref_evoformer_block(block, m, z, msa_mask, pair_mask, global_col=False):
    """Algorithm 6 (one block, no dropout)."""
    m = m + ref_msa_row(block.msa_att_row, m, z, msa_mask)
    col = ref_global_col if global_col else ref_msa_col
    m = m + col(block.msa_att_col, m, msa_mask)
    m = m + ref_transition(block.msa_transition, m, msa_mask)
    z = z + ref_opm(block.outer_product_mean, m, msa_mask)
    order = ("tri_mul_out", "tri_mul_in", "tri_att_start", "tri_att_end", "pair_transition")
    return m, ref_pair_updates(block.pair_stack, z, pair_mask, order)
