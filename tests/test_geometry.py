"""Issue 41: the images' geometry as vision users know it. A random resized crop taken
from the whole decoded image while it is decoded, seeded per (sample, epoch) so any
number of workers and a resume give the same crops; the evaluation at its own size
with timm's crop_pct; EXIF orientation and every image mode as 3-channel uint8;
reduced-size JPEG decoding; one line for each bad option."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import TINY_RUN, error_lines
from slipstream.cli.main import main
from slipstream.config.schema import build_config
from slipstream.data import DataRequest, Geometry, SampleKey, build_dataset_plugin
from slipstream.data.geometry import geometries
from slipstream.errors import ConfigError

W, H = 120, 90  # photo-shaped: 4:3


def photo(seed: int, size: tuple[int, int] = (W, H)) -> Image.Image:
    """A smooth picture (gradients and a disc), so that a crop and its position show."""
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    cx, cy, r = rng.uniform(0.3, 0.7) * w, rng.uniform(0.3, 0.7) * h, min(w, h) / 4
    disc = ((x - cx) ** 2 + (y - cy) ** 2 < r * r) * 120
    rgb = np.stack([x * 255 / w, y * 255 / h, disc + 60], axis=-1)
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    for split, count in (("train", 12), ("val", 6)):
        for i in range(count):
            folder = root / split / f"c{i % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            photo(i).save(folder / f"{i:02d}.jpg", quality=92)
    return root


def loaders(tree: Path, workers: int = 0, **data):
    cfg = build_config(None, None, ["data.name=imagefolder", f"data.root={tree}", "data.image_size=32",
                                    *(f"data.{k}={json.dumps(v)}" for k, v in data.items())])  # fmt: skip
    plugin = build_dataset_plugin(dict(cfg.data))
    train, evaluation = geometries(cfg.data, type(plugin).photos, seed=5)
    request = DataRequest(image_size=32, batch_size=4, eval_batch_size=3, num_workers=workers, seed=5,
                          train_geometry=train, eval_geometry=evaluation)  # fmt: skip
    return plugin.build(request)


def epoch(loader, number: int, start: int = 0) -> torch.Tensor:
    loader.sampler.set_epoch(number, start)
    return torch.cat([images for images, _ in loader])


def test_photos_train_on_random_resized_crops_seeded_per_sample_and_epoch(tree):
    built = loaders(tree)
    first, again, second = epoch(built.train, 0), epoch(built.train, 0), epoch(built.train, 1)
    assert first.shape == (12, 3, 32, 32) and first.dtype == torch.uint8
    assert torch.equal(first, again)  # the same (sample, epoch): the same crop
    # Another epoch: the same samples, other crops (epoch 1's order differs too, so compare as sets).
    assert not torch.equal(first.sort(0).values, second.sort(0).values)
    # Two workers and a resume in the middle of the epoch give the very same images.
    assert torch.equal(epoch(loaders(tree, workers=2).train, 0), first)
    assert torch.equal(epoch(built.train, 0, start=1), first[4:])


def test_the_crop_comes_from_the_whole_image_not_a_centre_square(tree):
    """Over many draws the crops' centres spread over the whole 4:3 picture, beyond the
    centre square that a resize-then-crop pipeline keeps."""
    geometry = Geometry(32, crop="random_resized", seed=1)
    lefts = [geometry.box(W, H, geometry.generator(SampleKey(i, 0)))[0] for i in range(200)]
    rights = [geometry.box(W, H, geometry.generator(SampleKey(i, 0)))[2] for i in range(200)]
    assert min(lefts) < (W - H) / 2 - 5 and max(rights) > (W + H) / 2 + 5


def test_turning_it_off_gives_the_centre_crop_of_before(tree):
    built = loaders(tree, train_crop="center", hflip=0)
    first = epoch(built.train, 0)
    assert torch.equal(first.sort(0).values, epoch(built.train, 1).sort(0).values)  # no random draw
    # The shorter side to 32 and the centre square, as torchvision's Resize + CenterCrop.
    from torchvision.transforms import v2

    expected = v2.Compose([v2.Resize(32), v2.CenterCrop(32)])(
        torch.from_numpy(np.array(Image.open(tree / "train" / "c0" / "00.jpg"))).permute(2, 0, 1)
    )
    built.train.sampler.set_epoch(0)
    index = built.train.dataset.samples.index((str(tree / "train" / "c0" / "00.jpg"), 0))
    got = built.train.dataset[index][0]
    assert (got.float() - expected.float()).abs().mean() < 3  # one resampling step against two


def test_evaluation_at_its_own_size_with_timms_crop_pct(tree):
    built = loaders(tree, eval_image_size=48, crop_pct=0.5)
    images = torch.cat([images for images, _ in built.eval])
    assert images.shape == (6, 3, 48, 48)
    # crop_pct 0.5: the centre half of the shorter side, so the picture's left edge is gone.
    plain = photo(0)
    left_edge = np.array(plain)[:, :5].mean()
    assert abs(images[0].float().mean().item() - left_edge) > 1
    assert torch.equal(torch.cat([i for i, _ in built.eval]), images)  # evaluation draws nothing


def test_defaults_differ_for_photos_and_data_made_at_its_size(tree):
    photos = geometries(build_config(None, None, ["data.name=imagefolder", f"data.root={tree}"]).data, True)
    made = geometries(build_config(None, None, []).data, False)
    assert (photos[0].crop, photos[0].hflip, photos[1].crop_pct) == ("random_resized", 0.5, 0.875)
    assert (made[0].crop, made[0].hflip, made[1].crop_pct) == ("none", 0.0, 1.0)
    # Synthetic data is drawn at the evaluation's size rather than resized to it.
    built = build_dataset_plugin({"name": "synthetic", "train_size": 8, "val_size": 4}).build(
        DataRequest(image_size=16, batch_size=4, eval_batch_size=4,
                    train_geometry=made[0].__class__(16), eval_geometry=made[1].__class__(24, crop="none"))
    )  # fmt: skip
    assert next(iter(built.eval))[0].shape[-1] == 24 and type(built.eval.dataset).__name__ == "SyntheticShapes"


def exif_rotated(angle_tag: int) -> bytes:
    """photo(3) stored sideways with the EXIF orientation that makes it upright again."""
    upright = photo(3)
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # what tag 6 turns back by 270
    exif = Image.Exif()
    exif[0x0112] = angle_tag
    out = io.BytesIO()
    stored.save(out, "JPEG", quality=95, exif=exif.tobytes())
    return out.getvalue()


def test_exif_orientation_and_every_mode_come_out_as_upright_rgb():
    geometry = Geometry(24, crop="none", reduced_decoding=False)
    upright = geometry.load(_jpeg(photo(3)))
    rotated = geometry.load(exif_rotated(6))
    assert (upright.float() - rotated.float()).abs().mean() < 4
    sideways = geometry.load(_jpeg(photo(3).transpose(Image.Transpose.ROTATE_90)))  # no tag: stays sideways
    assert (upright.float() - sideways.float()).abs().mean() > 20
    colour = Image.new("RGB", (40, 30), (200, 100, 50))
    sixteen = Image.fromarray((np.full((30, 40), 40000)).astype(np.uint16))
    for name, image, fmt in (("grey", colour.convert("L"), "PNG"), ("palette", colour.convert("P"), "PNG"),
                             ("cmyk", colour.convert("CMYK"), "JPEG"), ("alpha", colour.convert("RGBA"), "PNG"),
                             ("16-bit", sixteen, "PNG")):  # fmt: skip
        out = io.BytesIO()
        image.save(out, fmt)
        got = geometry.load(out.getvalue())
        assert got.shape == (3, 24, 24) and got.dtype == torch.uint8, name
    assert abs(int(got[0, 0, 0]) - round(40000 * 255 / 65535)) <= 1  # 16-bit scaled, not clipped to white


def _jpeg(image: Image.Image, quality: int = 95) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)
    return out.getvalue()


def test_reduced_size_decoding_looks_like_full_decoding():
    """A 32 px crop of a 480x360 JPEG: decoded at 1/8 scale with draft, against the full
    decode. How it was checked: the mean absolute difference over the picture is under 2
    levels of 255 here (PSNR above 35 dB), not visible."""
    data = _jpeg(photo(7, (480, 360)), 90)
    for crop in ("center", "none"):
        reduced = Geometry(32, crop=crop).load(data)
        full = Geometry(32, crop=crop, reduced_decoding=False).load(data)
        mse = (reduced.float() - full.float()).pow(2).mean().item()
        assert 10 * np.log10(255**2 / max(mse, 1e-9)) > 35, crop


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.crop_pct=0", "data.crop_pct is the centre crop's fraction of the shorter side, in (0, 1], got 0"),
        ("data.scale=[0.9,0.1]", "data.scale must be [low, high] with 0 < low <= high, got [0.9, 0.1]"),
        ("data.ratio=[-1,1]", "data.ratio must be [low, high] with 0 < low <= high, got [-1.0, 1.0]"),
        ("data.eval_image_size=4", "data.eval_image_size must be at least 8 pixels"),
        ("data.train_crop=random", "data.train_crop must be one of random_resized, center, none, got 'random'"),
        ("data.interpolation=nearest", "data.interpolation must be one of bilinear, bicubic"),
    ],
)
def test_a_bad_geometry_option_is_one_line_and_writes_nothing(tmp_path, capsys, override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):  # fmt: skip
        build_config(None, None, [override])
    assert main(["train", *TINY_RUN, override, f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and message in lines[0]
    assert not (tmp_path / "run").exists()


def test_train_at_one_resolution_and_evaluate_a_checkpoint_at_another(tree, tmp_path, capsys):
    """The run evaluates with its evaluation geometry (data.eval_image_size, crop_pct),
    and `slipstream eval` tests its checkpoint at another resolution."""
    run = tmp_path / "run"
    common = ["data.name=imagefolder", f"data.root={tree}", "model.name=test_resnet", "data.batch_size=4"]
    assert main(["train", "-q", *common, "data.image_size=24", "data.eval_image_size=32", "trainer.max_duration=2ba",
                 "trainer.autotune=false", f"trainer.run_dir={run}"]) == 0  # fmt: skip
    config = (run / "config.yaml").read_text()
    assert "eval_image_size: 32" in config and "train_crop: random_resized" in config  # what ran
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "data.eval_image_size=48", "data.crop_pct=0.95"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["eval_image_size"] == 48 and result["crop_pct"] == 0.95 and result["samples"] == 6
