"""The fork server's preload for servers on the torch runner: runtime/preload.py, then torch,
the model runner and the model code, and the transformers classes that import torch."""

# isort: off
import loom.runtime.preload  # noqa: F401  (first: it bounds OpenMP's spin before torch loads)

# isort: on
import torch  # noqa: F401
import transformers

import loom.runtime.model_runner  # noqa: F401
import loom.runtime.models.llama  # noqa: F401

transformers.AutoConfig  # noqa: B018
transformers.AutoTokenizer  # noqa: B018
