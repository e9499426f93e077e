"""Imported once by the fork server, so every scheduler and detokenizer starts warm.

This is the torch-free part: what a scheduler with the torch-free runner (a GGUF model in the
C forward, runtime/runner_choice.py) and the detokenizer import. The torch runner's servers
preload runtime/preload_torch.py, which adds torch and the model code; the parent picks one
(`process.set_preload`) before its first child starts, since the fork server's memory is in
every child's resident set."""

from loom.runtime.process import bound_openmp_spin

bound_openmp_spin()  # before torch loads libgomp, which reads it then

import transformers  # noqa: E402
import zmq  # noqa: E402, F401

import loom.runtime.array_runner  # noqa: E402, F401
import loom.runtime.cpu_model  # noqa: E402, F401
import loom.runtime.detokenizer  # noqa: E402, F401
import loom.runtime.scheduler.loop  # noqa: E402, F401
import loom.runtime.scheduler.scheduler  # noqa: E402, F401

# transformers imports lazily: touch what the children use (AutoConfig and AutoTokenizer
# import torch: runtime/preload_torch.py touches them)
transformers.PreTrainedTokenizerFast  # noqa: B018
