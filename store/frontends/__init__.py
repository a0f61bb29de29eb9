"""Framework front ends: one folder per framework, and what they share.

============== ==============================================================================
folder          what
============== ==============================================================================
``torch/``      DTensor save/load, the DCP plugin, DCP import, FSDP1 flat parameters, ``.pt``
                files, the read-once exchange and its plan
``deepspeed/``  DeepSpeed ZeRO-1/2/3 in and out (reads ``.pt`` files with ``torch/``)
``megatron/``   Megatron-Core ``torch_dist`` in and out (a DCP folder: reads with ``torch/``)
``mindspore/``  MindSpore ``.ckpt`` / safetensors rank files and strategy files (safetensors
                rank files read with ``huggingface/``)
``oneflow/``    OneFlow placement + SBP, ``flow.save`` folders, ``.npz`` folders
``huggingface/`` safetensors files and Hugging Face folders in and out, TP presets
``jax/``        ``jax.Array`` pytrees, Orbax import
============== ==============================================================================

Inside a folder, module names say the step (``read``, ``write``, ``files``, ...). ``sources``
holds the checks every importer makes on its source. A framework folder imports the wings below
``frontends`` and never another framework's folder, except the shared bases named above
(``tests/test_architecture.py`` checks it). Each module imports its framework lazily, inside the
functions that need it, so ``import reshard.store`` never pulls torch or jax in.
"""
