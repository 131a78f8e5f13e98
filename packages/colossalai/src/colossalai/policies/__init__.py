"""Built-in parallelization policies: how the hybrid plugin splits a model family it knows.

* Hugging Face ``transformers`` families, chosen from ``model.config.model_type``
  (:data:`HF_POLICIES`: ``gpt2``, ``llama``, ``bert``, ``vit``, ``mixtral``), in :mod:`.hf`;
* the ``colossalai`` PaLM, in :mod:`.palm`.

Nothing here imports ``transformers`` at module level: it is an optional extra
(``pip install colossal-stack[hf]``), imported only when a Hugging Face model is sequence-parallel.
"""

from colossalai.policies.hf import HF_POLICIES, HFPolicy, hf_policy
from colossalai.policies.palm import PaLMPolicy

__all__ = ["HF_POLICIES", "HFPolicy", "PaLMPolicy", "hf_policy"]
