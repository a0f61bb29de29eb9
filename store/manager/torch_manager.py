"""``CheckpointManager`` for torch state dicts (DTensors, plain tensors, JSON leaves).

One manager per process, built from the state dict it will save: the layouts
come from the DTensors' meshes and placements (plain tensors are replicated
over the group), the rank from ``torch.distributed``, by the same mapping as
``reshard.torch.save`` (:mod:`reshard.store.frontends.torch.mapping`: FSDP2 +
TP, expert parallelism, pipeline stages), which the ranks check they agree on
when the manager is built (collectives: build it on every rank at once).
``save(step, state_dict)`` stages this rank's local tensors (CPU or CUDA) and
returns, with no collective; a tensor whose mesh, placements or shape are not
the ones the manager was built with is refused there, naming both layouts.
``load(state_dict)`` fills a state dict of any mesh in place from a committed
step. torch is imported only when a manager is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard.layouts.errors import CheckpointNotFoundError, LayoutError, TensorNotFoundError

from ..format.tree import to_json
from ..frontends.torch import dtensor as rt
from ..frontends.torch.mapping import describe, layout_of, state_layouts
from .index import step_dir
from .manager import CheckpointManager


class TorchCheckpointManager:
    """Steps of a torch training run; see :class:`reshard.store.CheckpointManager` for ``**options``.

    Parameters
    ----------
    url : str
        The root.
    state_dict : mapping
        A state dict shaped like the ones that will be saved (e.g.
        ``{"model": ..., "optim": ...}`` from ``get_state_dict``): its
        tensors' meshes and placements give the layouts.
    process_group : ProcessGroup, optional
        The ranks taking part (default: the whole job, or this process alone).
    **options
        ``max_to_keep``, ``keep_every``, ``keep_best``/``best_metric``,
        ``async_save``, ``max_pending``, ``commit_timeout``, ``storage_options``...

    Raises
    ------
    LayoutError
        On every rank, when ranks give one tensor different layouts (naming
        the tensor, both ranks and both layouts) or a rank cannot map one;
        nothing is written, the root is not touched.
    """

    def __init__(self, url: str, state_dict: Mapping[str, Any] | None = None, *, process_group: Any = None,
                 **options: Any) -> None:
        if state_dict is None:
            raise TypeError(f"TorchCheckpointManager({url!r}) needs the state dict it will save (its tensors give "
                            f"the layouts); to read a root, use reshard.store.CheckpointManager({url!r})")
        self.rank, self.ranks = rt._group(process_group)
        self.process_group = process_group
        values = {name: value for name, _, _, value in rt._walk(state_dict)}
        self.layouts = state_layouts(values, process_group, self.rank, self.ranks)
        #: What gave each tensor its layout: a save's tensor must match it (:meth:`_check_placed`).
        self._placed = {name: _placed(values[name]) for name in self.layouts}
        self.manager = CheckpointManager(url, self.layouts, rank=self.rank, committer=self.ranks[0], **options)

    def __getattr__(self, name: str) -> Any:  # steps, latest_step, wait, open, metrics, close...
        return getattr(self.manager, name)

    def __enter__(self) -> TorchCheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.manager.__exit__(*exc)

    def save(self, step: int, state_dict: Mapping[str, Any], *, metrics: Mapping[str, float] | None = None) -> None:
        """Stage this rank's part of ``state_dict`` as step ``step`` and return (it may change at once)."""
        local: dict[str, Any] = {}
        for name, _, _, value in rt._walk(state_dict):
            if rt._is_tensor(value):
                layout = self.layouts.get(name)
                if layout is None:
                    raise TensorNotFoundError(
                        f"save: tensor {name!r} was not in the state dict this manager was built with, so it has "
                        f"no layout (the manager knows {len(self.layouts)} tensors, e.g. {sorted(self.layouts)[:3]}); "
                        "build the manager from a state dict that holds it")
                if _placed(value) != self._placed[name]:
                    self._check_placed(step, name, value, layout)
                if self.rank in layout.ranks:
                    local[name] = rt._local(value)
            else:
                local[name] = to_json(value, name)
        self.manager.save(step, self.rank, local, metrics=metrics)

    def _check_placed(self, step: int, name: str, value: Any, layout: Any) -> None:
        """Refuse a tensor of another layout than the manager's (another mesh object of the same ranks passes);
        the reason is left for the committer (:meth:`CheckpointManager.refuse`).

        Raises
        ------
        LayoutError
            Naming the tensor, the manager's layout and the tensor's.
        """
        now = layout_of(value, self.ranks, widen=True)
        if layout in (now, layout_of(value, self.ranks)):
            self._placed[name] = _placed(value)
            return
        reason = (f"tensor {name!r} on rank {self.rank} has layout {describe(now)}, but the manager was built with "
                  f"{describe(layout)} (agreed by every rank)")
        self.manager.refuse(step, self.rank, reason)
        raise LayoutError(
            f"save of step {step}: {reason}; a save's tensors keep the meshes, placements and shapes of the state "
            "dict the manager was built with: after resharding the model build a new manager. This rank saves "
            "nothing of this step, so the step is not committed")

    def load(self, state_dict: Mapping[str, Any], *, step: int | None = None, strict: bool = True) -> int:
        """Fill ``state_dict`` (any mesh) in place from a committed step (default: the latest); return the step."""
        if step is None:
            step = self.manager.restorable_step()
            if step is None:
                raise CheckpointNotFoundError(f"{self.manager.url}: no committed step")
        else:
            self.manager.settle(step)  # a step this process just saved: its commit first
        rt.load(state_dict, f"{self.manager.url}/{step_dir(step)}", strict=strict,
                process_group=self.process_group, storage_options=self.manager.storage_options)
        return step


def _placed(value: Any) -> tuple[Any, ...]:
    """``(mesh, placements, shape)`` of a DTensor, ``(None, None, shape)`` of a plain tensor."""
    if rt._is_dtensor(value):
        return value.device_mesh, tuple(value.placements), tuple(value.shape)
    return None, None, tuple(value.shape)
