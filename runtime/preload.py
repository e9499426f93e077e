"""Imported once by the fork server, so every scheduler and detokenizer starts warm."""

import torch  # noqa: F401
import transformers
import zmq  # noqa: F401

import loom.runtime.detokenizer  # noqa: F401
import loom.runtime.model_runner  # noqa: F401
import loom.runtime.models.llama  # noqa: F401
import loom.runtime.scheduler.loop  # noqa: F401
import loom.runtime.scheduler.scheduler  # noqa: F401

# transformers imports lazily: touch what the children use
transformers.AutoConfig  # noqa: B018
transformers.AutoTokenizer  # noqa: B018
transformers.PreTrainedTokenizerFast  # noqa: B018
