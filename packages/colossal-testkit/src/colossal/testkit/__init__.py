"""colossal.testkit: what the Colossal test suites share, in one test-only package.

* :mod:`colossal.testkit.gpt`: the small nanoGPT-style GPT of the cross-package contract (module
  names ``wte``, ``wpe``, ``blocks.*.{ln_1, attn.{q,k,v,out}_proj, ln_2, mlp.{fc_in, fc_out}}``,
  ``ln_f``, ``lm_head``), for the tests of packages that may not import ``colossalai``;
* :mod:`colossal.testkit.parity`: per-tensor relative-error checks against a reference, and the
  plain single-process PyTorch training run that parallel engines are compared with;
* :mod:`colossal.testkit.ops`: :class:`OpCounter`, the operators a block dispatches (an engine's
  host cost per step, measured directly);
* :mod:`colossal.testkit.checkpoint`: the checkpoint-guarantee fixtures (a model family with
  missing and mis-shaped entries, file damage) of the engines' save/load tests.

Test-only: it is declared in the ``test`` extra of the packages that use it and never imported by
any package's ``src/`` (``tools/check_arrows.py`` enforces both). It depends on torch alone.
"""

from colossal.testkit.checkpoint import (
    MISMATCH_LINES,
    MISSING,
    call_on_rank0_only,
    damage_file,
    guarantee_case,
    guarantee_model,
)
from colossal.testkit.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig, randomize_biases_
from colossal.testkit.lora import LowRankAdapted, add_adapters
from colossal.testkit.ops import OpCounter
from colossal.testkit.parity import (
    TOL,
    assert_close,
    lm_loss,
    max_rel_err,
    random_batches,
    rel_err,
    train_reference,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "randomize_biases_",
    "LowRankAdapted",
    "add_adapters",
    "OpCounter",
    "TOL",
    "rel_err",
    "assert_close",
    "max_rel_err",
    "lm_loss",
    "random_batches",
    "train_reference",
    "MISMATCH_LINES",
    "MISSING",
    "damage_file",
    "guarantee_model",
    "call_on_rank0_only",
    "guarantee_case",
]
