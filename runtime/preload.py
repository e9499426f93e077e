"""Imported once by the fork server, so every scheduler and detokenizer starts warm."""

from loom.runtime.process import bound_openmp_spin

bound_openmp_spin()  # before torch loads libgomp, which reads it then

import torch  # noqa: E402, F401
import transformers  # noqa: E402
import zmq  # noqa: E402, F401

import loom.runtime.detokenizer  # noqa: E402, F401
import loom.runtime.model_runner  # noqa: E402, F401
import loom.runtime.models.llama  # noqa: E402, F401
import loom.runtime.scheduler.loop  # noqa: E402, F401
import loom.runtime.scheduler.scheduler  # noqa: E402, F401

# transformers imports lazily: touch what the children use
transformers.AutoConfig  # noqa: B018
transformers.AutoTokenizer  # noqa: B018
transformers.PreTrainedTokenizerFast  # noqa: B018
