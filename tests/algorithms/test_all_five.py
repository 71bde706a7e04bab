"""The five design-card algorithms at once, as `slipstream train --algorithms
mixed_precision,channels_last,stepwise_lr,image_size_curriculum,gpu_augmentation` builds
them: every effect is present in the same short run, and each disappears with `no:`."""

import pytest
import torch

from helpers import Probe
from slipstream.config.schema import build_config
from slipstream.run.build import build_trainer

FIVE = "mixed_precision,channels_last,stepwise_lr,image_size_curriculum,gpu_augmentation"
TINY = [
    "model.name=resnet18",
    "data.image_size=32",
    "data.train_size=64",
    "data.val_size=16",
    "data.batch_size=16",
    "trainer.max_duration=3ep",
    "trainer.eval_interval=3ep",
    "trainer.progress_bar=false",
]
# A key under algorithms.NAME enables NAME (overrides come after --algorithms), so the
# curriculum's settings are given only to the run that has it.
CURRICULUM = [
    # auto would pick fp32 on a CPU without bf16 units; the effect shown is autocast's.
    "algorithms.mixed_precision.dtype=bf16",
    "algorithms.image_size_curriculum.initial_scale=0.5",
    "algorithms.image_size_curriculum.delay=0.25",
    "algorithms.image_size_curriculum.finetune=0.25",
]


def run(tmp_path, algorithms: str, overrides: list[str] = ()) -> dict[str, list]:
    seen: dict[str, list] = {"raw": [], "inputs": [], "outputs": [], "lr": [], "eval": []}

    def raw(state):  # the probe is registered last, so its batch_start runs first
        seen["raw"].append(normalize(state.batch[0]))

    def inputs(state):
        seen["inputs"].append(state.batch[0].detach().clone())

    # Unmeasured auto (each plugin's fallback: bf16 where native, NHWC): every effect shows.
    where = [f"trainer.run_dir={tmp_path / 'run'}", "trainer.autotune=false"]
    cfg = build_config(None, algorithms, [*TINY, *overrides, *where])
    trainer = build_trainer(cfg, verbose=False)
    # The engine normalises every batch after batch_start; compare like with like.
    def normalize(x):
        return trainer.normalize((x, None))[0]

    trainer.pm.register(
        Probe(
            batch_start=raw,
            before_forward=inputs,
            after_forward=lambda s: seen["outputs"].append(s.outputs.dtype),
            after_optimizer_step=lambda s: seen["lr"].append(s.optimizer.param_groups[0]["lr"]),
            eval_batch_start=lambda s: seen["eval"].append(tuple(s.batch[0].shape[-2:])),
        )
    )
    trainer.fit()
    seen["weights_cl"] = [
        m.weight.is_contiguous(memory_format=torch.channels_last)
        for m in trainer.state.unwrapped_model.modules()
        if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1)  # 1x1: both layouts agree
    ]
    return seen


@pytest.fixture(scope="module")
def together(tmp_path_factory):
    return run(tmp_path_factory.mktemp("five"), FIVE, CURRICULUM)


def test_every_effect_in_one_run(together):
    seen = together
    # mixed_precision: the forward ran under bf16 autocast
    assert set(seen["outputs"]) == {torch.bfloat16}
    # channels_last: weights and (resized, augmented) inputs are NHWC
    assert seen["weights_cl"] and all(seen["weights_cl"])
    assert all(x.is_contiguous(memory_format=torch.channels_last) for x in seen["inputs"])
    # stepwise_lr: the LR moves inside the first epoch (4 optimizer steps per epoch)
    assert len(set(seen["lr"][:4])) == 4
    # image_size_curriculum: sizes grow from half to full; evaluation at full size
    sizes = [x.shape[-1] for x in seen["inputs"]]
    assert sizes[0] == 16 and sizes[-1] == 32 and sizes == sorted(sizes)
    assert set(seen["eval"]) == {(32, 32)}
    # gpu_augmentation: full-size batches differ from the raw (normalised) ones, same shapes
    full = [(r, x) for r, x in zip(seen["raw"], seen["inputs"], strict=True) if x.shape == r.shape]
    assert full and any(not torch.equal(r, x) for r, x in full)


def test_no_removes_each_effect(tmp_path):
    off = run(tmp_path, FIVE + "," + ",".join(f"no:{name}" for name in FIVE.split(",")))
    assert set(off["outputs"]) == {torch.float32}
    assert not any(off["weights_cl"])
    assert len(set(off["lr"])) == 1
    assert {x.shape[-1] for x in off["inputs"]} == {32}
    assert all(torch.equal(r, x) for r, x in zip(off["raw"], off["inputs"], strict=True))
