"""Write the MindSpore sample files under tests/data/mindspore/ with MindSpore itself.

Run with MindSpore 2.x (CPU; ``pip install mindspore numpy``), from this folder: ``python make_samples.py``.
MindSpore's semi-auto parallel does not run on CPU, so the 4-device save is done the way each
rank of such a job saves (``save_checkpoint`` of its slices), with MindSpore's own code for every
decision: the strategy file is written with MindSpore's ``node_strategy_pb2``, each rank's slice
is cut by ``mindspore.parallel._tensor._load_tensor`` (what ``load_distributed_checkpoint``
uses), and with ``remove_redundancy=True`` the rank that keeps each parameter is chosen by
``mindspore.train._utils.get_parameter_redundancy`` + ``remove_param_redundancy`` (what
``ModelCheckpoint(remove_redundancy=True)`` uses).

What it writes (values: ``full()`` below, also in ``expected.json``):

* ``strategy.ckpt``: dev_matrix [2, 2]; w1 (8, 4) and w4 (4, 2) tensor_map [1, -1]; w2 (4, 4) and w3 (2, 4)
  [-1, -1];
  b (4,) and b2 (2,) [0]. Names only the parameters (``only_trainable_params=True``, the default).
* ``redundant/rank_N/net.ckpt``: every rank's slices, ``adam_m.X`` sliced like ``X``.
* ``dedup/rank_N/net.ckpt``: the same with ``remove_redundancy=True``: each block in one
  replica's file only.
* ``safetensors/rank_N/net.safetensors``: ``save_checkpoint(..., format="safetensors")``.
* ``single/``: a single-device ``ModelCheckpoint`` folder after 3 epochs of ``Model.train``
  (``lenet-1_2.ckpt``, ``lenet-2_2.ckpt``, ``lenet-3_2.ckpt``).
"""

import json
import shutil
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn
from mindspore.parallel._tensor import _load_tensor
from mindspore.train import node_strategy_pb2
from mindspore.train._utils import get_parameter_redundancy, remove_param_redundancy

HERE = Path(__file__).parent
LAYOUT = {"w1": ([2, 2], [1, -1], (8, 4)), "w2": ([2, 2], [-1, -1], (4, 4)), "b": ([2, 2], [0], (4,)),
          "w3": ([2, 2], [-1, -1], (2, 4)), "b2": ([2, 2], [0], (2,)), "w4": ([2, 2], [1, -1], (4, 2))}


def full() -> dict:
    out = {}
    for i, (name, (_, _, shape)) in enumerate(LAYOUT.items()):
        n = int(np.prod(shape))
        out[name] = (np.arange(n, dtype=np.float32) + 100 * i).reshape(shape)
        out[f"adam_m.{name}"] = out[name] / 10
    return out


def write_strategy(path: Path) -> None:
    msg = node_strategy_pb2.ParallelStrategyMap()
    msg.current_stage = 0
    for name, (dev, tmap, _) in LAYOUT.items():
        item = msg.parallel_layout_item.add()
        item.param_name = name
        lay = item.parallel_layouts
        lay.dev_matrix.add().dim.extend(dev)
        lay.tensor_map.add().dim.extend(tmap)
        lay.field = 0
        lay.opt_weight_shard_step = 0
        lay.opt_weight_shard_size = 0
    path.write_bytes(msg.SerializeToString())


def rank_values(rank: int) -> dict:
    values = {}
    for name, value in full().items():
        dev, tmap, _ = LAYOUT[name.split(".")[-1]]
        values[name] = _load_tensor(Tensor(value), dev, tmap, rank_id=rank)
    values["global_step"] = np.array([12], np.int32)
    return values


def save(path: Path, values: dict, **kwargs) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ms.save_checkpoint([{"name": k, "data": Tensor(v)} for k, v in values.items()], str(path), **kwargs)


class LeNetish(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(4, 3)
        self.fc2 = nn.Dense(3, 2)

    def construct(self, x):
        return self.fc2(ms.ops.relu(self.fc1(x)))


def single_device(folder: Path) -> None:
    import mindspore.dataset as ds
    from mindspore.train import CheckpointConfig, Model, ModelCheckpoint

    ms.set_seed(0)
    data = ds.NumpySlicesDataset({"x": np.ones((8, 4), np.float32), "y": np.zeros(8, np.int32)},
                                 shuffle=False).batch(4)
    net = LeNetish()
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
                  nn.Momentum(net.trainable_params(), 0.1, 0.9))
    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=5)
    model.train(3, data, callbacks=[ModelCheckpoint(prefix="lenet", directory=str(folder), config=config)],
                dataset_sink_mode=False)


def main() -> None:
    for name in ("redundant", "dedup", "safetensors", "single"):
        shutil.rmtree(HERE / name, ignore_errors=True)
    write_strategy(HERE / "strategy.ckpt")
    keep = remove_param_redundancy(get_parameter_redundancy(str(HERE / "strategy.ckpt")))
    keep = {rank: {p for p in params} for rank, params in keep.items()}
    for rank in range(4):
        values = rank_values(rank)
        save(HERE / "redundant" / f"rank_{rank}" / "net.ckpt", values)
        mine = {k: v for k, v in values.items() if k.split(".")[-1] in keep.get(rank, set()) or k == "global_step"}
        save(HERE / "dedup" / f"rank_{rank}" / "net.ckpt", mine, remove_redundancy=True)
        save(HERE / "safetensors" / f"rank_{rank}" / "net.safetensors", values, format="safetensors")
    single_device(HERE / "single")
    doc = {"mindspore": ms.__version__, "dedup_keeps": {str(r): sorted(p) for r, p in sorted(keep.items())},
           **{k: v.tolist() for k, v in full().items()}}
    (HERE / "expected.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(doc["dedup_keeps"])


if __name__ == "__main__":
    main()
