"""A zoo of small PyTorch models, one module per model family (``feedforward``, ``residual``,
``attention``, ``recurrent``, ``interfaces``, ``hf``) for precondfx's tests and benchmarks (not shipped: the
demo's own models are in ``precondfx.demo``, registered here too).

Every builder is a function ``builder(seed: int = 0, **options) -> (model, sample)``:

* ``model`` is a freshly initialised ``nn.Module`` (left in training mode);
* ``sample`` is what the model is called with: a tensor (``model(sample)``), a
  tuple of positional inputs (``model(*sample)``) or a dict of keyword inputs
  (``model(**sample)``).  A dict sample may also carry non-tensor keyword
  arguments the call needs (e.g. ``use_cache=False`` for GPT-2).  Use
  :func:`call` to run a model on its sample and :func:`main_tensor` to pick
  the main output tensor (logits) out of whatever the model returns.

Builders are deterministic for a given ``seed`` (parameters and sample) and do
not disturb the caller's global RNG state.  The defaults are tiny: a forward and
backward pass on CPU takes a few milliseconds to tens of milliseconds.

The models are written in plain PyTorch (no torchvision / timm) and cover the
patterns the preconditioning pass has to deal with: max pools that can and
cannot be folded into a strided conv, BatchNorm and other normalisations,
residual adds, concatenations, transposed convs, depthwise convs, attention
(hand-written and ``nn.MultiheadAttention``), recurrent layers, tied and shared
weights, several inputs, keyword inputs, dict outputs and data-dependent
control flow.  Hugging Face ``transformers`` models (built from tiny configs,
no downloads) are registered only when ``transformers`` can be imported.

>>> from tests import zoo
>>> model, sample = zoo.build("mlp")
>>> zoo.main_tensor(zoo.call(model, sample)).shape
torch.Size([32, 10])
"""
from tests.zoo.registry import (HAS_TRANSFORMERS, TAGS, ZOO, Builder, build, call,  # noqa: F401
                                describe, main_tensor, names)
from tests.zoo.feedforward import *  # noqa: F401,F403
from tests.zoo.residual import *  # noqa: F401,F403
from tests.zoo.attention import *  # noqa: F401,F403
from tests.zoo.recurrent import *  # noqa: F401,F403
from tests.zoo.interfaces import *  # noqa: F401,F403
from tests.zoo.hf import *  # noqa: F401,F403
