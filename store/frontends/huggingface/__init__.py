"""Hugging Face safetensors: a file or a sharded model folder in and out, and tensor-parallel presets.

* :mod:`.read`: the safetensors header and tensors (no ``safetensors`` package needed),
  :func:`import_safetensors`.
* :mod:`.write`: :func:`export_safetensors` (one file, or numbered shards and their index).
* :mod:`.folder`: the files kept beside the weights, and replacing a folder whole.
* :mod:`.llama`: :func:`~.llama.export_llama`, a Megatron-Core Llama-style import as a ``LlamaForCausalLM``
  folder (``reshard export llama``).
* :mod:`.presets`: tensor-parallel layouts by parameter name (``reshard redivide --preset``).

MindSpore's safetensors rank files are read with :mod:`.read` too.
"""

from __future__ import annotations

from .presets import preset_layouts
from .read import import_safetensors, read_header
from .write import DEFAULT_SHARD_SIZE, export_safetensors, parse_size

__all__ = ["DEFAULT_SHARD_SIZE", "export_safetensors", "import_safetensors", "parse_size", "preset_layouts",
           "read_header"]
