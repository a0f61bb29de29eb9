"""``CheckpointManager`` for JAX pytrees of ``jax.Array``.

Ranks are device ids (as in :mod:`reshard.store.frontends.jax.arrays`): a process
saves every shard of its local devices, replicas once; process 0 (the lowest
device id) commits. ``save`` starts the device->host copies of all shards at
once, stages them and returns; ``restore`` builds arrays on any mesh from a
committed step. jax is imported only when a manager is built.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from reshard.layouts import Layout, all_ranks
from reshard.layouts.errors import CheckpointNotFoundError, LayoutError

from ..format.tree import to_json
from ..frontends.jax import arrays as rj
from .manager import CheckpointManager


class JaxCheckpointManager:
    """Steps of a JAX training run; see :class:`reshard.store.CheckpointManager` for ``**options``.

    Parameters
    ----------
    url : str
        The root.
    like : pytree
        A pytree shaped like the ones that will be saved (``jax.Array`` leaves
        with their shardings give the layouts; numpy arrays are written by the
        lowest device; other leaves are JSON).
    **options
        ``max_to_keep``, ``keep_every``, ``keep_best``/``best_metric``,
        ``async_save``, ``max_pending``, ``commit_timeout``, ``storage_options``...
    """

    def __init__(self, url: str, like: Any = None, **options: Any) -> None:
        import jax

        if like is None:
            raise TypeError(f"JaxCheckpointManager({url!r}) needs a pytree like the ones it will save (its arrays' "
                            f"shardings give the layouts); to read a root, use "
                            f"reshard.store.CheckpointManager({url!r})")
        self.home = min(d.id for d in jax.devices())
        self.layouts = self._layouts(like)
        local = {d.id for d in jax.local_devices()}
        self.ranks = sorted(local & (all_ranks(self.layouts.values()) | {self.home}))
        self.manager = CheckpointManager(url, self.layouts, rank=self.ranks, committer=self.home, **options)

    def _layouts(self, tree: Any) -> dict[str, Layout]:
        import jax

        out = {}
        for path, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if isinstance(value, jax.Array):
                out[rj.key_name(path)] = rj.layout_of(value)
            elif rj._is_array(value):
                out[rj.key_name(path)] = Layout.single(np.shape(value), self.home)
        return out

    def __getattr__(self, name: str) -> Any:  # steps, latest_step, wait, open, metrics, close...
        return getattr(self.manager, name)

    def __enter__(self) -> JaxCheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.manager.__exit__(*exc)

    def save(self, step: int, pytree: Any, *, metrics: Any = None) -> None:
        """Stage every local device's shards of ``pytree`` as step ``step`` and return."""
        import jax

        pieces: dict[int, dict[str, Any]] = {r: {} for r in self.ranks}
        flat = jax.tree_util.tree_flatten_with_path(pytree)[0]
        for _, value in flat:  # every device->host copy in flight before the first is waited for
            if isinstance(value, jax.Array):
                value.copy_to_host_async()
        for path, value in flat:
            name = rj.key_name(path)
            layout = self.layouts.get(name)
            if isinstance(value, jax.Array) and layout is not None:
                for shard in value.addressable_shards:
                    rank = shard.device.id
                    if rank in pieces and rank in layout.ranks:
                        if rj._region(shard.index, value.shape) != layout.region(rank):
                            raise LayoutError(f"array {name!r}: device {rank} holds {shard.index}, the layout "
                                              f"the manager was built with says {layout.region(rank)}")
                        pieces[rank][name] = shard.data
            elif layout is not None:
                if self.home in pieces:
                    pieces[self.home][name] = np.asarray(value)
            else:
                leaf = to_json(value, name)
                for piece in pieces.values():
                    piece[name] = leaf
        for rank in self.ranks:
            self.manager.save(step, rank, pieces[rank], metrics=metrics)

    def restore(self, target: Any, *, step: int | None = None) -> Any:
        """A pytree like ``target`` (shardings, ``ShapeDtypeStruct`` or arrays: any mesh) from a committed step."""
        if step is None:
            step = self.manager.restorable_step()  # never older than a save of this process that returned
            if step is None:
                raise CheckpointNotFoundError(f"{self.manager.url}: no committed step")
        return rj.restore(self.manager.open(step), target)
