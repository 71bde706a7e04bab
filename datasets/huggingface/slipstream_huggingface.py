"""Hugging Face datasets on disk as a Slipstream data source (``data.name=huggingface``).

``data.path`` is a ``datasets.load_from_disk`` folder, or local parquet / arrow files
(a file, a glob, or a folder of them; a file whose name or folder starts with a split
name, as the Hub lays them out, belongs to that split). Nothing is fetched: the
``datasets`` package runs offline. Arrow tables are random access, so the engine's
own EpochSampler orders, splits across ranks and resumes them exactly; images are
decoded from their stored bytes to uint8 on the host (torchvision.io, PIL fallback).
"""

from __future__ import annotations

import glob
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.data import Dataset

from slipstream.data import DATASET_STATS, DataError, DataRequest, DatasetPlugin, Geometry, SkipLog

SPLITS = ("train", "validation", "valid", "val", "test")
EVAL_SPLITS = ("validation", "valid", "val", "test")


@dataclass
class HuggingFaceConfig:
    path: Optional[str] = None  # a load_from_disk folder, or parquet/arrow files (a file, glob or folder)
    split: str = "train"
    # null: the first of validation, valid, val, test that exists (none: no evaluation data)
    eval_split: Optional[str] = None
    image_column: str = "image"
    label_column: str = "label"


def _load(path: str) -> dict[str, Any]:
    """Split name -> datasets.Dataset, from disk only."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # never reach for the Hub
    try:
        import datasets
    except ImportError as err:
        raise DataError(f"data.name=huggingface needs the datasets package ({err}): pip install datasets") from None

    datasets.disable_progress_bars()
    p = Path(path)
    if p.is_dir() and any((p / f).exists() for f in ("dataset_dict.json", "state.json", "dataset_info.json")):
        try:
            loaded = datasets.load_from_disk(str(p))
        except (FileNotFoundError, ValueError, OSError) as err:
            raise DataError(f"data.path={path}: cannot load it with datasets.load_from_disk ({err})") from None
        return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.suffix in (".parquet", ".arrow"))
    elif p.is_file():
        files = [str(p)]
    else:
        files = sorted(glob.glob(path))
    if not files:
        raise DataError(
            f"data.path={path} matches nothing: give a datasets.save_to_disk folder, or parquet/arrow files"
        )
    by_split: dict[str, list[str]] = {}
    for f in files:
        rel = Path(f).relative_to(p) if p.is_dir() else Path(Path(f).name)
        words = [part.split("-")[0].split(".")[0].split("_")[0].lower() for part in rel.parts]
        split = next((w for w in words if w in SPLITS), "train")
        by_split.setdefault(split, []).append(f)
    out = {}
    for split, group in by_split.items():
        try:
            if all(f.endswith(".parquet") for f in group):
                out[split] = datasets.Dataset.from_parquet(group)
            else:
                out[split] = datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in group])
        except Exception as err:  # pyarrow raises its own types for a file that is no table
            reason = " ".join(str(err).split())[:300] or type(err).__name__
            raise DataError(f"data.path={path}: cannot read the {split} files ({reason})") from None
    return out


class HFImages(Dataset):
    """A datasets.Dataset as ``(uint8 3 x S x S, int)`` items, decoded from the stored
    bytes; an unreadable image is named and replaced by the next readable one, or, with
    ``replace=False`` (the evaluated split), left out of its batch: a stand-in would be
    evaluated, and counted, twice."""

    def __init__(
        self, table: Any, image_column: str, label_column: str, geometry: Geometry, where: str, replace: bool = True
    ) -> None:
        import datasets

        self.where = where
        self.replace = replace
        self.image_column, self.label_column = image_column, label_column
        feature = table.features[image_column]
        if isinstance(feature, datasets.Image):
            table = table.cast_column(image_column, datasets.Image(decode=False))
        elif not (isinstance(feature, datasets.Value) and feature.dtype in ("binary", "large_binary")):
            raise DataError(
                f"data.image_column={image_column!r} in {where} holds {feature}, not images "
                "(an Image feature or encoded image bytes)"
            )
        self.table = table.select_columns([image_column, label_column])
        self.geometry = geometry  # the crop, taken while each image is decoded
        self.keyed = geometry.random  # the loader's sampler gives keys with the epoch
        self.skips = SkipLog("dataset" if replace else None)

    def __len__(self) -> int:
        return len(self.table)

    def _decode(self, value: Any, index: int, key: Any = None) -> torch.Tensor:
        name = f"{self.where}[{index}]"
        if isinstance(value, dict):
            data = value.get("bytes")
            if data is None and value.get("path"):
                name = value["path"]
                try:
                    data = Path(value["path"]).read_bytes()
                except OSError as err:
                    raise DataError(f"cannot read {name}: {err.strerror}") from None
            value = data
        if value is None:
            raise DataError(f"{name} holds no image")
        return self.geometry.decode(value, name, index if key is None else key)

    def _item(self, index: int) -> tuple[torch.Tensor, int]:
        for offset in range(len(self)):
            i = (index + offset) % len(self)
            row = self.table[i]
            try:
                return self._decode(row[self.image_column], i, index), int(row[self.label_column])
            except DataError as err:
                self.skips.warn(f"{self.where}[{i}]", str(err))
        raise DataError(f"none of the {len(self)} images of {self.where} can be decoded")

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self._item(index)

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        # One columnar read per batch instead of one per row.
        rows = self.table[[int(i) for i in indices]]
        out = []
        for i, value, label in zip(indices, rows[self.image_column], rows[self.label_column], strict=True):
            try:
                out.append((self._decode(value, i), int(label)))
            except DataError as err:
                self.skips.warn(f"{self.where}[{i}]", str(err))
                if self.replace:
                    out.append(self._item((i + 1) % len(self)))
        # A batch of none is no batch: stand-ins, named already, where nothing could be read.
        return out or [self._item(i) for i in indices]


def _num_classes(tables: list[Any], column: str) -> int:
    import datasets
    import pyarrow.compute as pc

    feature = tables[0].features[column]
    if isinstance(feature, datasets.ClassLabel):
        return feature.num_classes
    if not (isinstance(feature, datasets.Value) and "int" in feature.dtype):
        raise DataError(f"data.label_column={column!r} holds {feature}, not integer classes")
    top = max(int(pc.max(t.data.column(column)).as_py() or 0) for t in tables)
    return top + 1


class HuggingFaceDataset(DatasetPlugin):
    """Hugging Face datasets from disk (data.path, data.split, data.image_column, data.label_column), no network."""

    name = "huggingface"
    config_class = HuggingFaceConfig
    locations = ("path",)
    stats = DATASET_STATS["imagefolder"]  # ImageNet's: what a set of photos usually has

    def datasets(self, request: DataRequest) -> tuple[Any, Any, int]:
        c = self.config
        if not c.path:
            raise DataError("huggingface needs data.path: a datasets.save_to_disk folder or parquet/arrow files")
        splits = _load(c.path)
        if c.split not in splits:
            raise DataError(f"data.split={c.split!r} is not in {c.path}; its splits: {', '.join(splits)}")
        eval_split = c.eval_split or next((s for s in EVAL_SPLITS if s in splits), None)
        if eval_split is not None and eval_split not in splits:
            raise DataError(
                f"data.eval_split={eval_split!r}: {c.path} has no such split; its splits: {', '.join(splits)}"
            )
        if eval_split is None:  # no evaluation: said, not left for the summary's missing accuracy to tell
            warnings.warn(
                f"slipstream: data.path={c.path} has no evaluation split ({', '.join(EVAL_SPLITS)}; its splits: "
                f"{', '.join(splits)}): the run trains without evaluation and reports no accuracy; "
                "name one with data.eval_split=NAME",
                stacklevel=2,
            )
        names = [c.split] if eval_split is None else [c.split, eval_split]  # no eval split: no evaluation
        tables = [splits[name] for name in names]
        for table, split in zip(tables, names, strict=True):
            for key, column in (("image_column", c.image_column), ("label_column", c.label_column)):
                if column not in table.column_names:
                    raise DataError(
                        f"data.{key}={column!r} is not a column of {c.path} ({split}); "
                        f"its columns: {', '.join(table.column_names)}"
                    )
        train, *val = (
            HFImages(t, c.image_column, c.label_column, request.geometry("train" if s == c.split else "eval"),
                     f"{c.path}:{s}", replace=s == c.split)  # fmt: skip
            for t, s in zip(tables, names, strict=True)
        )
        return train, (val[0] if val else None), _num_classes(tables, c.label_column)
