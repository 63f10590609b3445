"""The contract between the generated model repository and the code that serves it.

One namespace for what ``builders`` write into every ``config.pbtxt`` and what the runtime
reads back, so a name or a default is changed in one place:

- ``names``: model names, tensor names and config parameter keys (``contract.TEXT_INPUT``);
- ``interfaces``: each model's tensors (name, data type, dims, optional or not) and the
  parameter keys it reads (``contract.LLM.input_names``);
- ``parameters``: every parameter's one default and bound, how values parse, and the embedding
  cache policy with its to/from-parameters mapping (``contract.CachePolicy``).

Plain data: importable without Triton, torch or vLLM. ``builders`` render configs from it;
``model.py`` files, the BLS calls and ``python_backends.runtime.model_params.ModelParameters`` read
names and defaults from it (tests/unit/test_contract.py checks both sides against it).
"""

# One namespace on purpose: callers write ``contract.X`` whichever part X lives in.
from python_backends.contract.interfaces import *  # noqa: F403
from python_backends.contract.names import *  # noqa: F403
from python_backends.contract.parameters import *  # noqa: F403
