"""OneFlow front end: the global-view sharded save and load of seed 001, without OneFlow.

OneFlow saves a big model by moving its state dict onto a "model file"
placement (``flow.utils.global_view.to_global(state_dict, placement, sbp)``),
then each rank of that placement saves its local part (``to_local``) with
``flow.save`` into its own folder. Here the local parts go into one reshard
checkpoint instead, every tensor one zarr array whose shards are the
placement's blocks, and can be loaded back onto any other placement and SBP.

* :func:`to_global` gives the layout OneFlow's ``to_global`` would give every
  tensor of a nested state dict; :func:`to_local` cuts whole arrays into one
  rank's pieces (``to_local(to_global(...))``), structure kept.
* :func:`save_oneflow` is ``flow.save(to_local(model_file_state_dict), dir)``:
  each rank of the placement writes its local pieces (no communication).
* :func:`load_oneflow` is ``to_global(flow.load(dir), placement, sbp)`` followed
  by ``to_local`` on any placement and SBP: each rank reads only its own region.
* :func:`load_flow_save` (from :mod:`.flow_save`): OneFlow's own
  ``flow.save`` folders (``pickled_data`` + ``tensor_N/meta`` + ``tensor_N/out``),
  read without OneFlow and without unpickling; :func:`load_local` reads one
  rank's folder of either kind.
* :func:`save_npz` / :func:`load_npz` (from :mod:`.npz`): one rank's
  local state dict as a folder of plain ``.npz`` + JSON.

``sbp`` is one SBP for every tensor, a tuple for an N-d placement, or a
callback ``(state_dict, tensor) -> sbp`` as in OneFlow (compare tensors with
``is``; the callback is given the very state dict passed in). SBPs are OneFlow
objects, their ``str``, or the strings of :class:`sbp` (``split(d)``,
``broadcast``). Splits are OneFlow's balanced ones (the first ``S % k`` pieces
one longer); ``partial_sum`` cannot be saved.

Names are kept as OneFlow wrote them: a graph's state dict nests module state
dicts whose keys hold dots (``sd["module_pipeline"]["m_stage3.linear.weight"]``).
The stored dotted name is ``module_pipeline.m_stage3.linear.weight``; the key
path is recorded too (``origin["path"]`` of the layout) so that
:func:`load_oneflow` gives back the same nesting.

OneFlow's ``flow.save`` keeps a folder's structure in a pickle
(``pickled_data``): reshard never unpickles it (that runs code) but decodes the
state-dict subset of its opcodes statically, and refuses anything else, naming it.
"""

from .placement import (
    global_shapes,
    load_flow_save,
    load_local,
    load_npz,
    load_oneflow,
    placement_layouts,
    placement_ranks,
    save_npz,
    save_oneflow,
    sbp,
    tensor_paths,
    to_global,
    to_local,
    walk,
)

__all__ = ["global_shapes", "load_flow_save", "load_local", "load_npz", "load_oneflow", "placement_layouts",
           "placement_ranks", "save_npz", "save_oneflow", "sbp", "tensor_paths", "to_global", "to_local", "walk"]
