"""Dataset plugins: the built-ins on the entry-point group, WebDataset shards and
Hugging Face datasets (every sample once per epoch on 1 and 2 processes, exact
mid-epoch resume), `slipstream data convert`, and bad input as one line."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from slipstream import Algorithm, ConfigError, Trainer, hookimpl
from slipstream.cli.main import main
from slipstream.config.schema import build_config
from slipstream.data import DataRequest, build_dataset_plugin
from slipstream.data.stream import StreamLoader

pytest.importorskip("webdataset")
pytest.importorskip("datasets")

CLASSES = ("ant", "bee", "cat")
TRAIN, VAL = 24, 6  # per split, over the three classes
SIZE = 16


def fingerprint(image: torch.Tensor) -> str:
    return hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """One set of images as an ImageFolder tree, WebDataset shards (through the CLI's
    convert) and a Hugging Face DatasetDict on disk."""
    import datasets

    root = tmp_path_factory.mktemp("data")
    tree = root / "tree"
    rng = np.random.default_rng(0)
    rows: dict[str, list] = {"train": [], "validation": []}
    for split, count in (("train", TRAIN), ("val", VAL)):
        for i in range(count):
            label = i % len(CLASSES)
            folder = tree / split / CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{i:03d}.png"
            Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(path)
            rows["train" if split == "train" else "validation"].append((path.read_bytes(), label))
    assert main(["data", "convert", "imagefolder", str(tree), "--to", "webdataset", str(root / "wds"),
                 "--shard-size", "4KB", "--no-progress"]) == 0  # fmt: skip
    features = datasets.Features(image=datasets.Image(), label=datasets.ClassLabel(names=list(CLASSES)))
    hf = datasets.DatasetDict(
        {
            split: datasets.Dataset.from_dict(
                {"image": [{"bytes": b, "path": None} for b, _ in items], "label": [y for _, y in items]},
                features=features,
            )
            for split, items in rows.items()
        }
    )
    hf.save_to_disk(str(root / "hf"))
    shards = sorted((root / "wds").glob("train-*.tar"))
    assert len(shards) > 2  # several shards, so the split across ranks is exercised
    wds = {
        "name": "webdataset",
        "urls": str(root / "wds" / f"train-{{000000..{len(shards) - 1:06d}}}.tar"),
        "eval_urls": str(root / "wds" / "val-000000.tar"),
        "shuffle_block": 4,
    }
    every = {fingerprint(torch.from_numpy(np.array(Image.open(io.BytesIO(b)))).permute(2, 0, 1))
             for b, _ in rows["train"]}  # fmt: skip
    return {"root": root, "tree": tree, "wds": wds, "hf": {"name": "huggingface", "path": str(root / "hf")},
            "every": every}  # fmt: skip


def built(options: dict, rank: int = 0, world_size: int = 1, **request):
    request = {"image_size": SIZE, "batch_size": 4, "eval_batch_size": 4, **request}
    return build_dataset_plugin(options).build(DataRequest(rank=rank, world_size=world_size, **request))


def epoch_prints(loader, epoch: int, start: int = 0) -> list[str]:
    loader.sampler.set_epoch(epoch, start)
    return [fingerprint(image) for images, _ in loader for image in images]


def test_builtins_and_installed_formats_are_listed(capsys) -> None:
    assert main(["datasets", "--json"]) == 0
    listed = {d["name"]: d for d in json.loads(capsys.readouterr().out)}
    for name in ("synthetic", "cifar10", "cifar100", "imagefolder"):
        assert listed[name]["distribution"] == "slipstream" and listed[name]["summary"]
    assert listed["webdataset"]["distribution"] == "slipstream-webdataset"
    assert listed["huggingface"]["distribution"] == "slipstream-huggingface"


def test_builtin_names_and_keys_unchanged(data) -> None:
    train = built({"name": "synthetic", "num_classes": 4, "train_size": 8, "val_size": 4}).train
    assert train.dataset.num_classes == 4 and len(train.dataset) == 8
    out = built({"name": "imagefolder", "root": str(data["tree"])})
    assert out.num_classes == 3 and out.stats is not None
    assert epoch_prints(out.train, 0)[0] in data["every"]  # the same decoded pixels as the shards


@pytest.mark.parametrize("source", ["wds", "hf"])
def test_one_process_reads_every_sample_once_in_a_seeded_order(data, source) -> None:
    out = built(data[source], seed=3)
    assert out.num_classes == 3
    first, second = epoch_prints(out.train, 0), epoch_prints(out.train, 1)
    assert sorted(first) == sorted(data["every"]) == sorted(second)
    assert first != second  # a new order each epoch ...
    assert first == epoch_prints(built(data[source], seed=3).train, 0)  # ... set by (seed, epoch)
    assert first != epoch_prints(built(data[source], seed=4).train, 0)
    images, labels = next(iter(out.eval))
    assert images.dtype == torch.uint8 and images.shape[1:] == (3, SIZE, SIZE) and labels.dtype == torch.int64


def test_stream_loader_splits_ranks_and_workers_and_resumes_exactly() -> None:
    class Numbers:  # a ShardSource whose samples are their own global index
        shard_sizes = [7, 5, 9, 3, 6]

        def read(self, shard, start, stop):
            yield from range(sum(self.shard_sizes[:shard]) + start, sum(self.shard_sizes[:shard]) + stop)

        def decode(self, raw):
            return torch.tensor([raw]), raw

    def run(world, workers, epoch=1, start=0, drop_last=True):
        out = []
        for rank in range(world):
            loader = StreamLoader(Numbers(), batch_size=4, rank=rank, world_size=world, num_workers=workers,
                                  shuffle_block=4, drop_last=drop_last)  # fmt: skip
            loader.set_epoch(epoch, start)
            out.append([labels.tolist() for _, labels in loader])
        return out

    for world in (1, 2, 3):
        every = [x for rank in run(world, 0, drop_last=False) for batch in rank for x in batch]
        assert sorted(every) == list(range(30))
        for workers in ((0, 2) if world == 2 else (0,)):
            full = run(world, workers)
            assert len({len(batches) for batches in full}) == 1  # equal batch counts: DDP needs them
            for start in range(len(full[0]) + 1) if workers == 0 else (1, 2):
                assert run(world, workers, start=start) == [batches[start:] for batches in full]


TWO_RANKS = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import torch, torch.distributed as dist
    from slipstream.data import DataRequest, build_dataset_plugin

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    seen = {}
    for source, options in json.loads(sys.argv[2]).items():
        request = DataRequest(image_size=16, batch_size=4, seed=3, rank=rank, world_size=world)
        loader = build_dataset_plugin(options).build(request).train
        seen[source] = []
        for epoch in (0, 1):
            loader.sampler.set_epoch(epoch)
            seen[source].append([hashlib.sha1(i.contiguous().numpy().tobytes()).hexdigest()
                                 for images, _ in loader for i in images])
    json.dump(seen, open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w"))
    dist.destroy_process_group()
    """
)


def test_two_processes_split_every_epoch_between_them(data, tmp_path) -> None:
    from test_distributed import _torchrun

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    result = _torchrun(str(script), str(tmp_path), json.dumps({"wds": data["wds"], "hf": data["hf"]}))
    assert result.returncode == 0, result.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for source in ("wds", "hf"):
        for epoch in (0, 1):
            a, b = r0[source][epoch], r1[source][epoch]
            assert len(a) == len(b) == TRAIN // 2
            assert sorted(a + b) == sorted(data["every"]), (source, epoch)  # each sample once


class Prints(Algorithm):
    name = "prints"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    @hookimpl(tryfirst=True)
    def batch_start(self, state) -> None:
        self.seen.extend(fingerprint(image) for image in state.batch[0].cpu())


def fit(options: dict, run_dir: Path, duration: str, **kwargs) -> tuple[Trainer, Prints]:
    import timm

    out = built(options, seed=5)
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=out.num_classes)
    prints = Prints()
    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), train_data=out.train,
                      eval_data=out.eval, max_duration=duration, algorithms=[prints], run_dir=run_dir, seed=5,
                      normalize=out.stats, eval_interval=None, progress_bar=False, verbose=False, **kwargs)  # fmt: skip
    trainer.fit()
    return trainer, prints


@pytest.mark.parametrize("source", ["wds", "hf"])
def test_resume_mid_epoch_is_bit_exact(data, tmp_path, source) -> None:
    straight, seen = fit(data[source], tmp_path / "straight", "9ba", checkpoint_interval=None)
    fit(data[source], tmp_path / "split", "4ba", checkpoint_interval="4ba")  # stops in epoch 0 (6 batches)
    resumed, tail = fit(data[source], tmp_path / "split", "9ba",
                        load_path=tmp_path / "split" / "checkpoints" / "latest.pt")  # fmt: skip
    assert tail.seen == seen.seen[4 * 4 :]  # the samples the first run had not reached, in order
    for a, b in zip(straight.state.model.parameters(), resumed.state.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_convert_writes_shards_that_train_and_refuses_bad_input(data, tmp_path, capsys) -> None:
    names = sorted(p.name for p in (data["root"] / "wds").iterdir())
    assert "classes.json" in names and "val-000000.tar" in names
    with tarfile.open(data["root"] / "wds" / "train-000000.tar") as tar:
        members = tar.getnames()
    assert {Path(m).suffix for m in members} == {".png", ".cls"}
    assert json.loads((data["root"] / "wds" / "classes.json").read_text()) == list(CLASSES)
    # Bad input: one line, exit 2, nothing written.
    for argv, expected in (
        (["data", "convert", "imagefolder", str(tmp_path / "none"), "--to", "webdataset", str(tmp_path / "o")],
         "is not a directory"),
        (["data", "convert", "imagefolder", str(data["tree"]), "--to", "webdataset", str(tmp_path / "o"),
          "--shard-size", "12XB"], "--shard-size"),
        (["data", "convert", "imagefolder", str(data["tree"]), "--to", "webdataset", str(data["root"] / "wds")],
         "already holds"),
    ):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert expected in err and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def _bad(data, **options) -> str:
    with pytest.raises(Exception) as info:
        built({**data["wds"], **options})
    return str(info.value)


def test_bad_shards_are_one_line_before_training(data, tmp_path) -> None:
    root = data["root"] / "wds"
    assert "matches nothing" in _bad(data, urls=str(tmp_path / "x-{0..3}.tar"))
    assert "matches no file" in _bad(data, urls=str(tmp_path / "*.tar"))
    assert "do not exist" in _bad(data, urls=[str(root / "train-000000.tar"), str(tmp_path / "gone.tar")])
    broken = tmp_path / "broken.tar"
    broken.write_bytes((root / "train-000000.tar").read_bytes()[:700])  # cut inside a member
    assert "cannot be read as a tar file" in _bad(data, urls=str(broken))
    with pytest.raises(ConfigError, match=r"data.urls is not read by data.name=synthetic"):
        build_config(overrides=["data.urls=a.tar"])
    with pytest.raises(ConfigError, match=r"did you mean 'webdataset'"):
        build_config(overrides=["data.name=webdatset"])
    with pytest.raises(ConfigError, match=r"data.shuffle_block"):
        build_config(overrides=["data.name=webdataset", "data.shuffle_block=0"])


def test_pipe_urls_and_an_unreadable_image_is_skipped_and_named(data, tmp_path, capfd) -> None:
    source = data["root"] / "wds" / "train-000000.tar"
    corrupt = tmp_path / "corrupt.tar"
    with tarfile.open(source) as tar, tarfile.open(corrupt, "w") as out:
        bad = next(m.name for m in tar.getmembers() if m.name.endswith(".png"))
        for member in tar.getmembers():
            payload = tar.extractfile(member).read()
            if member.name == bad:  # the first sample's image: not an image any more
                payload = b"not an image at all"
                member.size = len(payload)
            out.addfile(member, io.BytesIO(payload))
    out = built({**data["wds"], "urls": f"pipe:cat {corrupt}", "eval_urls": None})
    prints = epoch_prints(out.train, 0)
    assert len(prints) == out.train.batches_per_epoch * 4  # nothing dropped: the next image stands in
    err = capfd.readouterr().err
    assert "skipping unreadable image" in err and bad in err


def test_huggingface_bad_input_is_one_line(data, tmp_path) -> None:
    def bad(**options) -> str:
        with pytest.raises(Exception) as info:
            built({**data["hf"], **options})
        return str(info.value)

    assert "is not a column" in bad(image_column="img") and "image, label" in bad(image_column="img")
    assert "is not a column" in bad(label_column="y")
    assert "matches nothing" in bad(path=str(tmp_path / "nothing*"))
    assert "its splits: train, validation" in bad(split="training")


def test_huggingface_parquet_files(data, tmp_path) -> None:
    import datasets

    hf = datasets.load_from_disk(data["hf"]["path"])
    for split in ("train", "validation"):
        hf[split].to_parquet(str(tmp_path / "data" / f"{split}-00000-of-00001.parquet"))
    out = built({"name": "huggingface", "path": str(tmp_path / "data")})
    assert sorted(epoch_prints(out.train, 0)) == sorted(data["every"])
    assert sum(len(images) for images, _ in out.eval) == VAL
    only_train = built({"name": "huggingface", "path": str(tmp_path / "data" / "train-00000-of-00001.parquet")})
    assert only_train.eval is None  # no evaluation split: no evaluation, said in docs/data.md


def test_example_dataset_plugin_installs_and_is_found(tmp_path, monkeypatch) -> None:
    import shutil

    from slipstream.data.sources import discover_datasets

    source = shutil.copytree(Path(__file__).resolve().parents[1] / "examples" / "npz_dataset", tmp_path / "src")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(source)], check=True, capture_output=True)  # fmt: skip
    monkeypatch.syspath_prepend(str(site))
    assert discover_datasets()["npz"].distribution == "slipstream-npz-dataset"
    rng = np.random.default_rng(0)
    for name, n in (("train", 16), ("val", 8)):
        np.savez(tmp_path / f"{name}.npz", images=rng.integers(0, 256, (n, 12, 12, 3), dtype=np.uint8),
                 labels=np.arange(n) % 2)  # fmt: skip
    options = {"name": "npz", "file": str(tmp_path / "train.npz"), "eval_file": str(tmp_path / "val.npz")}
    out = built(options, batch_size=8)
    assert out.num_classes == 2 and len(epoch_prints(out.train, 0)) == 16
    with pytest.raises(ConfigError, match=r"data.files is not read by data.name=npz \(did you mean 'file'\?\)"):
        build_dataset_plugin({**options, "files": "x"})


@pytest.mark.parametrize("source", ["wds", "hf"])
def test_eval_and_export_rebuild_a_plugin_datasets_run_from_its_checkpoint(data, tmp_path, capsys, source) -> None:
    """The dataset plugin's own keys (webdataset's urls, huggingface's path) travel in the
    checkpoint's config: eval and export rebuild the run from it alone."""
    run = tmp_path / "run"
    keys = [f"data.{k}={v}" for k, v in data[source].items()]
    assert main(["train", "--recipe", "default", "-q", *keys, "model.name=test_resnet", "data.image_size=16",
                 "data.batch_size=8", "data.num_workers=0", "trainer.max_duration=2ba",
                 f"trainer.run_dir={run}"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run)]) == 0
    result = json.loads(capsys.readouterr().out)
    if source == "wds":  # the fixture's eval_urls name the first of the val shards
        with tarfile.open(data["wds"]["eval_urls"]) as tar:
            expected = sum(name.endswith(".cls") for name in tar.getnames())
    else:
        expected = VAL
    assert result["samples"] == expected and result["data"] == data[source]["name"]
    assert main(["export", "--checkpoint", str(run), "--format", "torchscript", "-o", str(tmp_path / "m.pt")]) == 0
    assert (tmp_path / "m.pt").is_file()


def test_a_shard_cut_short_is_one_line_and_home_is_expanded(data, tmp_path, monkeypatch) -> None:
    root = data["root"] / "wds"
    whole = (root / "train-000000.tar").read_bytes()
    with tarfile.open(root / "train-000000.tar") as tar:
        last = [m for m in tar.getmembers() if m.name.endswith(".png")][-1]  # an image: not read to index
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole[: last.offset_data + last.size // 2])  # inside the last image's data
    message = _bad(data, urls=str(cut))
    assert "is cut short" in message or "cannot be read as a tar file" in message
    cut.write_bytes(whole[: last.offset + 100])  # inside its header: tarfile alone took it for the end
    assert "is cut short" in _bad(data, urls=str(cut))
    monkeypatch.setenv("HOME", str(data["root"]))
    home = built({**data["wds"], "urls": "~/wds/train-{000000..000001}.tar", "eval_urls": "~/wds/val-000000.tar"})
    assert len(home.train.dataset.shard_sizes) == 2


def test_a_resume_with_other_workers_of_a_stream_is_warned_about(data, tmp_path) -> None:
    fit(data["wds"], tmp_path / "split", "4ba", checkpoint_interval="4ba")
    latest = tmp_path / "split" / "checkpoints" / "latest.pt"
    payload = torch.load(latest, weights_only=True)
    payload["config"] = {**payload["config"], "data": {"num_workers": 1}}  # as a CLI run with 1 worker records
    torch.save(payload, latest)
    with pytest.warns(UserWarning, match="data.num_workers=1 and this run has 0: this data's order depends on"):
        fit(data["wds"], tmp_path / "split", "5ba", load_path=latest)


def test_a_last_batch_of_one_sample_is_warned_about_and_named_if_batch_norm_meets_it(tmp_path) -> None:
    import timm
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.rand(9, 3, 16, 16), torch.arange(9) % 4), batch_size=4)
    model = timm.create_model("test_resnet", num_classes=4)
    with pytest.warns(Warning, match="last batch of each epoch holds 1 sample \\(9 samples in batches of 4\\)"):
        trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), train_data=loader,
                          max_duration="1ep", run_dir=tmp_path / "run", progress_bar=False, verbose=False)
    with pytest.raises(ConfigError, match="a training batch of 1 sample\\(s\\) reached a batch-norm layer"):
        trainer.fit()


@pytest.mark.parametrize("source", ["wds", "hf"])
def test_autoresume_finds_data_that_moved(data, tmp_path, capsys, source) -> None:
    """Issue 44, case 9: a requeued job whose data was staged elsewhere (data.urls,
    data.eval_urls, data.path: the dataset's ``locations``) autoresumes; another key that
    changes training is still refused."""
    import shutil

    moved = tmp_path / "staged"
    shutil.copytree(data["root"] / ("wds" if source == "wds" else "hf"), moved)
    here = {k: str(v).replace(str(data["root"] / ("wds" if source == "wds" else "hf")), str(moved))
            for k, v in data[source].items()}  # fmt: skip
    assert here != data[source]
    run = tmp_path / "run"
    common = ["train", "--recipe", "default", "-q", "model.name=test_resnet", "data.image_size=16",
              "data.batch_size=8", "data.num_workers=0", "trainer.checkpoint_interval=2ba",
              "trainer.eval_interval=null", "trainer.autoresume=true", f"trainer.run_dir={run}"]  # fmt: skip
    assert main([*common, *(f"data.{k}={v}" for k, v in data[source].items()), "trainer.max_duration=2ba"]) == 0
    resumed = [*common, *(f"data.{k}={v}" for k, v in here.items()), "trainer.max_duration=4ba"]
    assert main(resumed) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["batches"] == 4 and "resumed_with_changes" not in summary
    capsys.readouterr()
    assert main([*resumed, "trainer.max_duration=6ba", "optimizer.lr=0.5"]) == 2
    assert "these keys differ: optimizer.lr" in capsys.readouterr().err


def _shard_with_unreadable(path: Path, count: int, bad: set[int]) -> Path:
    """A shard of ``count`` 8x8 PNGs (labels 0..2), those at ``bad`` not images."""
    with tarfile.open(path, "w") as tar:
        for i in range(count):
            buffer = io.BytesIO()
            Image.new("RGB", (8, 8), (9 * i, 0, 0)).save(buffer, format="PNG")
            for ext, payload in (("png", b"not an image" if i in bad else buffer.getvalue()),
                                 ("cls", str(i % 3).encode())):
                member = tarfile.TarInfo(f"{i:06d}.{ext}")
                member.size = len(payload)
                tar.addfile(member, io.BytesIO(payload))
    return path


@pytest.mark.parametrize("workers", [0, 1])
def test_issue_44_case_12_unreadable_shard_images_are_named_once_for_the_run_by_key(
    tmp_path, capfd, monkeypatch, workers
) -> None:
    """Issue 44, case 12: WebDataset's unreadable-image warnings started afresh every
    epoch (each epoch's stream, and its workers, kept their own log) so they went on past
    their cap, and named the image `<_io.BytesIO object at 0x...>`; now the loader's log
    names each sample by shard and key, once, up to the cap for the whole run."""
    from slipstream.data import decode

    monkeypatch.setattr(decode, "MAX_NAMED", 2)
    shard = _shard_with_unreadable(tmp_path / "bad.tar", 12, bad={1, 4, 7})
    out = built({"name": "webdataset", "urls": str(shard), "shuffle_block": 1}, num_workers=workers)
    for epoch in range(3):
        assert len(epoch_prints(out.train, epoch)) == 12  # training: the next image stands in
    err = capfd.readouterr().err
    assert err.count("skipping unreadable image") == 2, err
    assert err.count("further ones are skipped without a message") == 1, err
    assert f"{shard}:000001.png (not an image file" in err and "BytesIO" not in err


def test_issue_44_webdataset_evaluation_counts_an_unreadable_image_not_its_stand_in(tmp_path, capfd) -> None:
    """Issue 44: WebDataset evaluation counted the stand-in for an unreadable image twice
    (it replaced the unreadable one in the batch); an evaluation leaves it out instead."""
    shard = _shard_with_unreadable(tmp_path / "val.tar", 10, bad={3, 9})  # 9: the last, no image after it
    out = built({"name": "webdataset", "urls": str(shard), "eval_urls": str(shard)})
    labels = [int(y) for _, targets in out.eval for y in targets]
    assert labels == [i % 3 for i in range(10) if i not in (3, 9)]
    err = capfd.readouterr().err
    assert err.count("it is left out of the evaluation") == 2, err


def test_issue_44_case_12_a_hugging_face_dataset_without_an_evaluation_split_is_warned_about(data, tmp_path) -> None:
    """Issue 44, case 12: a Hugging Face dataset without an evaluation split turned
    evaluation off without a word."""
    import datasets

    datasets.load_from_disk(data["hf"]["path"])["train"].to_parquet(str(tmp_path / "train-00000-of-00001.parquet"))
    with pytest.warns(UserWarning, match=r"has no evaluation split .*its splits: train\): the run trains without "
                                         r"evaluation and reports no accuracy; name one with data.eval_split"):
        out = built({"name": "huggingface", "path": str(tmp_path)})
    assert out.eval is None


def test_issue_44_case_12_convert_leaves_out_empty_and_corrupt_images_with_one_line_and_a_count(
    tmp_path, capsys
) -> None:
    """Issue 44, case 12: `slipstream data convert` copied corrupt and zero-byte files
    into the shards without a word; they are left out, counted in one warning line, and
    a split none of whose images can be read is refused."""
    from helpers import colour_image_folder

    tree = colour_image_folder(tmp_path / "tree", {"a": (200, 0, 0), "b": (0, 200, 0)}, per_class=3)
    (tree / "train" / "a" / "empty.png").write_bytes(b"")
    (tree / "train" / "b" / "broken.png").write_bytes(b"\x89PNG not really")
    out = tmp_path / "wds"
    assert main(["data", "convert", "imagefolder", str(tree), "--to", "webdataset", str(out), "--no-progress"]) == 0
    captured = capsys.readouterr()
    warned = [line for line in captured.err.splitlines() if "left out of the shards" in line]
    assert len(warned) == 1 and warned[0].startswith("slipstream: warning: convert: 2 of the 8 train images"), warned
    assert "1 empty (0 bytes), 1 not an image or damaged" in warned[0]
    assert "train: 6 images in 1 shards (2 unreadable left out)" in captured.out
    with tarfile.open(out / "train-000000.tar") as tar:
        assert len([m for m in tar.getnames() if m.endswith(".png")]) == 6
    for image in (tree / "val" / "a").iterdir():
        image.write_bytes(b"")
    for image in (tree / "val" / "b").iterdir():
        image.write_bytes(b"")
    assert main(["data", "convert", "imagefolder", str(tree), "--to", "webdataset", str(tmp_path / "o2")]) == 2
    assert "none of the 6 images of val can be read (6 empty (0 bytes)" in capsys.readouterr().err


def test_issue_44_case_12_a_folder_as_data_urls_is_named_a_folder_with_the_pattern_to_give(data, tmp_path) -> None:
    """Issue 44, case 12: `data.urls=DIR` said "no shard exists" of a folder that exists."""
    folder = data["root"] / "wds"
    last = len(sorted(folder.glob("train-*.tar"))) - 1
    message = _bad(data, urls=str(folder))
    pattern = f"'{folder}/train-{{000000..{last:06d}}}.tar'"
    assert f"{folder} is a folder, not a shard: give its shards, e.g. {pattern}" in message
    assert f"'{folder}/*.tar' (a glob" in message
    (tmp_path / "empty").mkdir()
    assert "holds no .tar file" in _bad(data, urls=str(tmp_path / "empty"))


def test_issue_44_a_hugging_face_evaluation_leaves_an_unreadable_image_out(data, tmp_path, capfd) -> None:
    """Issue 44: the evaluated split's unreadable image was replaced by the next one,
    which the evaluation then counted twice; it is left out of its batch instead."""
    import datasets

    hf = datasets.load_from_disk(data["hf"]["path"])
    rows = hf["validation"].cast_column("image", datasets.Image(decode=False)).to_dict()
    rows["image"][2] = {"bytes": b"not an image", "path": None}
    broken = datasets.Dataset.from_dict(rows, features=hf["validation"].features)
    datasets.DatasetDict({"train": hf["train"], "validation": broken}).save_to_disk(str(tmp_path / "hf"))
    out = built({"name": "huggingface", "path": str(tmp_path / "hf")})
    out.eval.sampler.set_epoch(0)
    labels = [int(y) for _, targets in out.eval for y in targets]
    assert labels == [y for i, y in enumerate(rows["label"]) if i != 2]
    assert "it is left out of the evaluation" in capfd.readouterr().err


def _index(path: Path) -> dict:
    return json.loads(path.read_text())


def test_issue_41_convert_writes_an_index_and_no_shard_is_read_before_the_first_batch(
    data, tmp_path, monkeypatch
) -> None:
    """Issue 41, item 3: convert writes OUT/index.json (each shard's samples and classes);
    a run finds it beside local shards, or takes data.index, and reads no shard before its
    first batch: `pipe:` shards included (their command logs each run)."""
    import slipstream_webdataset as plugin

    from slipstream.data.sources import data_locations

    assert "data.index" in data_locations({"data": {"name": "webdataset"}})  # a resume may find it elsewhere
    root = data["root"] / "wds"
    index = _index(root / "index.json")
    assert index["format"] == "slipstream-webdataset-index"
    by_url = {e["url"]: e for e in index["shards"]}
    assert set(by_url) == {p.name for p in root.glob("*.tar")}  # relative to the index
    assert sum(e["samples"] for u, e in by_url.items() if u.startswith("train")) == TRAIN
    assert sum(e["samples"] for u, e in by_url.items() if u.startswith("val")) == VAL
    assert max(e["classes"] for e in by_url.values()) == 3

    def no_reading(url: str):
        raise AssertionError(f"{url} was read before the first batch")

    monkeypatch.setattr(plugin, "index_shard", no_reading)
    out = built(data["wds"])  # local shards: index.json beside them
    assert out.train.num_samples == TRAIN and out.num_classes == 3
    assert sorted(epoch_prints(out.train, 0)) == sorted(data["every"])
    log = tmp_path / "fetched.log"
    fetch = tmp_path / "fetch.sh"
    fetch.write_text(f'echo "$1" >> {log}\ncat "$1"\n')
    shards = sorted(root.glob("train-*.tar"))
    urls = [f"pipe:sh {fetch} {shard}" for shard in shards]
    out = built({**data["wds"], "urls": urls, "eval_urls": None, "index": str(root / "index.json")})
    assert not log.exists()  # nothing streamed to count
    assert sorted(epoch_prints(out.train, 0)) == sorted(data["every"])
    assert sorted(log.read_text().split()) == sorted(map(str, shards))  # each shard once, in the epoch


def test_issue_41_without_an_index_a_pipe_run_says_what_counting_costs(data) -> None:
    shards = sorted((data["root"] / "wds").glob("train-*.tar"))
    with pytest.warns(UserWarning, match=rf"data.urls: {len(shards)} shard\(s\) are streamed through once .*"
                                         r"slipstream data index 'pipe:cat .*' -o index.json"):  # fmt: skip
        out = built({**data["wds"], "urls": [f"pipe:cat {s}" for s in shards], "eval_urls": None})
    assert out.train.num_samples == TRAIN


def test_issue_41_data_index_writes_once_atomically_and_refuses_to_replace_a_file(data, tmp_path, capsys) -> None:
    root = data["root"] / "wds"
    output = tmp_path / "idx" / "shards.json"
    pattern = str(root / "train-*.tar")
    assert main(["data", "index", pattern, f"pipe:cat {root / 'val-000000.tar'}", "-o", str(output)]) == 0
    written = _index(output)
    converted = _index(root / "index.json")["shards"]  # train-*, then val-*: as convert wrote them
    assert written["shards"][:-1] == [{**e, "url": str(root / e["url"])} for e in converted if e["url"] < "v"]
    val = next(e for e in _index(root / "index.json")["shards"] if e["url"] == "val-000000.tar")
    assert written["shards"][-1] == {"url": f"pipe:cat {root / 'val-000000.tar'}", "samples": val["samples"],
                                     "classes": val["classes"]}  # fmt: skip
    assert [p.name for p in output.parent.iterdir()] == ["shards.json"]  # no temporary file left
    capsys.readouterr()
    before = output.read_text()
    for argv, expected in (
        (["data", "index", pattern, "-o", str(output)], "exists; give --overwrite"),
        (["data", "index", str(tmp_path / "none-*.tar"), "-o", str(tmp_path / "new.json")], "matches no file"),
        (["data", "index", pattern, "-o", str(tmp_path)], "is a directory"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert expected in err and "\n" not in err and "Traceback" not in err
    assert output.read_text() == before and not (tmp_path / "new.json").exists()
    assert main(["data", "index", str(root / "train-000000.tar"), "-o", str(output), "--overwrite"]) == 0
    assert len(_index(output)["shards"]) == 1


def test_issue_41_an_index_that_does_not_match_its_shards_is_one_line(data, tmp_path, capsys) -> None:
    import shutil

    from slipstream.data import DataError

    root = tmp_path / "wds"
    shutil.copytree(data["root"] / "wds", root)
    index = root / "index.json"
    train = str(root / "train-{000000..000001}.tar")
    entries = _index(index)
    # A shard of data.urls not in the index (data.index, or index.json beside the shards).
    kept = {**entries, "shards": [e for e in entries["shards"] if e["url"] != "train-000001.tar"]}
    index.write_text(json.dumps(kept))
    message = _bad(data, urls=train, eval_urls=None)
    assert "shard" in message and "train-000001.tar is not in the index" in message and "data index" in message
    # A local shard whose size differs from the index's.
    changed = {**entries, "shards": [{**e, "bytes": e.get("bytes", 0) + 512} for e in entries["shards"]]}
    index.write_text(json.dumps(changed))
    message = _bad(data, urls=train, eval_urls=None, index=str(index))
    assert "bytes, its index" in message and str(index) in message
    # A pipe: shard (trusted) whose count differs: said when reading finds it, naming the index.
    shard = root / "train-000000.tar"
    more = {**entries, "shards": [{**e, "samples": e["samples"] + 3} for e in entries["shards"]]}
    index.write_text(json.dumps(more))
    out = built({**data["wds"], "urls": f"pipe:cat {shard}", "eval_urls": None, "index": str(index)})
    with pytest.raises(DataError, match=rf"holds \d+ samples, its index {index} says \d+"):
        epoch_prints(out.train, 0)
    index.write_text("{}")
    assert "is not a shard index" in _bad(data, urls=train, eval_urls=None)
    # Through the CLI: one line, exit 2, before a run directory is written.
    run = tmp_path / "run"
    assert main(["train", "-q", "model.name=test_resnet", "data.name=webdataset", f"data.urls={train}",
                 f"data.index={tmp_path / 'none.json'}", "data.image_size=16", "data.batch_size=4",
                 "data.num_workers=0", f"trainer.run_dir={run}", "trainer.max_duration=1ba"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "none.json does not exist" in err and "\n" not in err and not run.exists()


@pytest.mark.parametrize("source", ["wds", "hf"])
def test_issue_41_random_crops_of_a_plugin_dataset_are_per_sample_and_epoch(data, source) -> None:
    """Issue 41: a shard stream's and a Hugging Face table's random crops are seeded by
    (seed, epoch, sample): the same with any number of workers, others next epoch."""
    from slipstream.data import Geometry

    crops = Geometry(SIZE, crop="random_resized", hflip=0.5, seed=5)

    def prints(workers: int, number: int) -> list[str]:
        loader = built(data[source], seed=5, num_workers=workers, train_geometry=crops).train
        return epoch_prints(loader, number)

    first = prints(0, 0)
    assert sorted(prints(2, 0)) == sorted(first)  # a stream's order depends on its workers, not its crops
    assert sorted(prints(0, 1)) != sorted(first)
    assert not set(first) <= data["every"]  # cropped, not the stored images
