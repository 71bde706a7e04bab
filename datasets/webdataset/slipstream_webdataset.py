"""WebDataset tar shards as a Slipstream data source (``data.name=webdataset``).

A sample is the consecutive tar members that share a key (``000123.jpg`` and
``000123.cls``): one image (jpg, jpeg, png, webp, ppm, bmp) and an integer class in
``.cls``. Shards are listed with the ``webdataset`` package's brace expansion, opened
with its ``gopen`` (local paths, ``file:``, ``pipe:CMD`` for object-store clients) and
read with its tar iterator; the engine's StreamLoader splits them across ranks and
workers, orders them by (seed, epoch) and resumes mid-epoch exactly.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import tarfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from slipstream.data import (
    DATASET_STATS,
    BuiltData,
    DataError,
    DataRequest,
    DatasetPlugin,
    Geometry,
    StreamLoader,
    sample_key,
)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "bmp", "tiff")
LABEL_EXT = "cls"


@dataclass
class WebDatasetConfig:
    urls: Optional[Any] = None  # a brace pattern, glob, pipe: command, or a list of them
    eval_urls: Optional[Any] = None  # the same, for evaluation; null: no evaluation data
    shuffle_block: int = 256  # samples permuted together inside a shard (held raw, per worker)
    # A shard index (slipstream data index / convert): every shard's sample count, so none
    # is read before the first batch. null: an index.json beside local shards, or count them.
    index: Optional[str] = None

    def __post_init__(self) -> None:
        if self.shuffle_block < 1:
            raise ValueError(f"data.shuffle_block must be at least 1, got {self.shuffle_block}")


def expand(urls: Any, key: str) -> list[str]:
    """The shard URLs of ``data.<key>``: brace patterns expanded, local globs matched."""
    try:
        import webdataset as wds
    except ImportError as err:
        raise DataError(f"data.name=webdataset needs the webdataset package ({err}): pip install webdataset") from None

    if urls is None or urls == "" or urls == []:
        raise DataError(f"webdataset needs data.{key}: a shard pattern like shards/train-{{000000..000099}}.tar")
    items = [urls] if isinstance(urls, str) else list(urls)
    out: list[str] = []
    for item in items:
        for url in wds.shardlists.expand_urls(str(item)):
            if _is_local(url) and any(c in url for c in "*?["):
                matched = sorted(glob.glob(_local_path(url)))
                if not matched:
                    raise DataError(f"data.{key}: {url} matches no file")
                out.extend(matched)
            else:
                out.append(url)
    if not out:
        raise DataError(f"data.{key}={urls!r} names no shard")
    local = [u for u in out if _is_local(u)]
    folders = [u for u in local if os.path.isdir(_local_path(u))]
    if folders:
        raise DataError(f"data.{key}={urls!r}: {_folder_advice(_local_path(folders[0]))}")
    missing = [u for u in local if not os.path.isfile(_local_path(u))]
    if missing and len(missing) == len(out):
        raise DataError(f"data.{key}={urls!r} matches nothing: no shard exists (first: {missing[0]})")
    if missing:
        raise DataError(
            f"data.{key}: {len(missing)} of {len(out)} shards do not exist (first: {missing[0]})"
        )
    return out


def _unreadable(data: bytes) -> str | None:
    """Why ``data`` is no image to copy into a shard (``empty``, ``not an image``), or
    None. Pillow reads the header and checks what it can without decoding (a PNG's
    checksums; not a JPEG cut short, which training names and skips)."""
    import io

    from PIL import Image

    if not data:
        return "empty (0 bytes)"
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except Exception:  # Pillow raises many kinds for a bad file
        return "not an image or damaged"
    return None


def _folder_advice(folder: str) -> str:
    """What to give for a folder of shards: the shards themselves, as a brace pattern
    (its own, when it holds NAME-000000.tar ...) or a glob."""
    base = folder.rstrip("/\\") or folder
    names = sorted(Path(base).glob("*.tar"))
    numbered: dict[str, list[str]] = {}
    for name in names:
        match = re.fullmatch(r"(.*?)(\d+)\.tar", name.name)
        if match:
            numbered.setdefault(match.group(1), []).append(match.group(2))
    if numbered:
        prefix, numbers = max(numbered.items(), key=lambda item: len(item[1]))
        pattern = f"{base}/{prefix}{{{numbers[0]}..{numbers[-1]}}}.tar"
        return (
            f"{base} is a folder, not a shard: give its shards, e.g. '{pattern}' (a brace range) or "
            f"'{base}/*.tar' (a glob; it holds {len(names)} .tar files)"
        )
    return (
        f"{base} is a folder, not a shard, and holds no .tar file: give the shards, e.g. "
        f"'{base}/shard-{{000000..000009}}.tar' or '{base}/*.tar'"
    )


def _is_local(url: str) -> bool:
    return url.startswith("file:") or "://" not in url and not url.startswith("pipe:")


def _local_path(url: str) -> str:
    return url[len("file:") :] if url.startswith("file:") else url


def split_name(name: str) -> tuple[str | None, str]:
    """(key, extension) of a tar member, as webdataset splits it (the key ends at the
    first dot of the file name)."""
    import webdataset as wds

    key, ext = wds.tariterators.base_plus_ext(name)
    return key, (ext or "").lower()


def _samples(members: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Group consecutive members by key; yield the complete samples (an image and a label)."""
    key, parts = None, {}
    for name, data in members:
        k, ext = split_name(name)
        if k is None:
            continue
        if k != key:
            if key is not None and _complete(parts):
                yield key, parts
            key, parts = k, {}
        parts[ext] = data
    if key is not None and _complete(parts):
        yield key, parts


def _complete(parts: dict[str, Any]) -> bool:
    return LABEL_EXT in parts and any(e in parts for e in IMAGE_EXTS)


def _label(shard: str, key: str, raw: bytes) -> int:
    try:
        value = int(raw.decode().strip())
    except (UnicodeDecodeError, ValueError):
        raise DataError(f"{shard}: sample {key} has a .cls that is no integer: {raw[:20]!r}") from None
    if value < 0:
        raise DataError(f"{shard}: sample {key} has a negative class {value}")
    return value


@dataclass
class ShardIndex:
    """Per shard: its complete samples and classes (1 + its largest label; 0: none), and
    the index file they come from (None: counted by reading the shard)."""

    samples: int
    classes: int
    source: Optional[str] = None


def index_shard(url: str) -> ShardIndex:
    """Read a shard's member names and labels (not its images): a seek past each image
    for a local file, one streamed pass for a ``pipe:`` command. A shard that is no
    readable tar is a DataError naming it."""
    labels: list[int] = []
    try:
        if _is_local(url):
            path = _local_path(url)
            with tarfile.open(path, "r:*") as tar:
                ends = [0]  # where the last member's data ends

                def local_members() -> Iterator[tuple[str, Any]]:
                    for m in tar:
                        ends[0] = max(ends[0], m.offset_data + m.size)
                        if m.isreg():
                            ext = split_name(m.name)[1]
                            yield m.name, (tar.extractfile(m).read() if ext == LABEL_EXT else b"")

                for key, parts in _samples(local_members()):
                    labels.append(_label(url, key, parts[LABEL_EXT]))
                after = tar.offset  # where a next member's header would start
            if not path.endswith((".gz", ".tgz", ".bz2", ".xz")):
                _check_whole(url, path, ends[0], after)
        else:
            for key, parts in _samples(_stream_members(url, labels_only=True)):
                labels.append(_label(url, key, parts[LABEL_EXT]))
    except (tarfile.TarError, EOFError, OSError, ValueError) as err:
        if isinstance(err, DataError):
            raise
        reason = " ".join(str(err).split()) or type(err).__name__
        raise DataError(f"shard {url} cannot be read as a tar file ({reason})") from None
    return ShardIndex(len(labels), 1 + max(labels, default=-1))


def _check_whole(url: str, path: str, data_end: int, after: int) -> None:
    """A tar file cut short (an interrupted copy) is read by tarfile as if the archive
    ended there: the samples after the cut would be left out without a word. Found: a
    last member whose data runs past the file's end, or a partial header after it (a
    whole archive has only zero blocks there)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(min(after, size))
        tail = f.read(2 * tarfile.BLOCKSIZE)
    if data_end > size or any(tail):
        raise DataError(
            f"shard {url} is cut short: it ends at byte {size} without the end of its archive "
            "(a partial copy?); copy it again, or leave it out of data.urls"
        )


def _stream_members(url: str, labels_only: bool = False) -> Iterator[tuple[str, Any]]:
    import webdataset as wds

    def select(name: str) -> bool:
        return not labels_only or split_name(name)[1] == LABEL_EXT

    stream = wds.gopen(url)
    try:
        for item in wds.tariterators.tar_file_iterator(stream, select_files=None):
            name = item["fname"]
            yield name, (item["data"] if select(name) else b"")
    finally:
        try:
            stream.close()
        except Exception:  # a pipe stopped early exits with SIGPIPE; the samples read are what count
            pass


def index_shards(urls: list[str]) -> list[ShardIndex]:
    """Every shard's index. The shards are shared out among the ranks of a distributed
    run (each indexes 1/world of them, a few at a time, and all ranks exchange the
    results), so the pass costs one read of the headers in total, not one per rank;
    an error on any rank is raised on every rank, so none waits for the others."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    mine = list(range(rank, len(urls), world))
    result: Any
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(mine)))) as pool:  # I/O bound: threads
            result = dict(zip(mine, pool.map(index_shard, [urls[i] for i in mine]), strict=True))
    except DataError as err:
        result = str(err)
    parts = [result]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, result)
    errors = [p for p in parts if isinstance(p, str)]
    if errors:
        raise DataError(errors[0])
    merged: dict[int, ShardIndex] = {}
    for part in parts:
        merged.update(part)
    return [merged[i] for i in range(len(urls))]


INDEX_NAME = "index.json"  # what convert writes beside its shards, and a run looks for there
INDEX_FORMAT = "slipstream-webdataset-index"


def shard_name(url: str) -> str | None:
    """The file name of a shard's tar (``train-000001.tar``), for a local path, a URL or
    a ``pipe:`` command (its last word that names a tar); None where none is found."""
    if _is_local(url):
        return os.path.basename(_local_path(url))
    words = url[len("pipe:") :].split() if url.startswith("pipe:") else [url]
    names = [w.strip("'\"").split("?")[0].rstrip("/").rsplit("/", 1)[-1] for w in words]
    tars = [n for n in names if re.search(r"\.(tar|tgz)(\.\w+)?$", n)]
    return tars[-1] if tars else None


def _rewrite(index: str) -> str:
    return f"write it again for these shards: slipstream data index URLS -o {index} --overwrite"


@dataclass
class IndexFile:
    """A shard index as read: its entries by shard (a local shard by its resolved path,
    another by its URL) and by file name, for shards read from elsewhere (``pipe:``)."""

    path: str
    by_url: dict[str, dict[str, Any]]
    by_name: dict[str, list[dict[str, Any]]]

    def find(self, url: str, key: str) -> ShardIndex:
        entry = self.by_url.get(os.path.realpath(_local_path(url)) if _is_local(url) else url)
        if entry is None:
            named = self.by_name.get(shard_name(url) or "", [])
            if len(named) > 1:
                raise DataError(
                    f"data.{key}: shard {url} is not in the index {self.path} by its path, and "
                    f"{len(named)} of its shards are named {shard_name(url)}; give the index of these shards"
                )
            entry = named[0] if named else None
        if entry is None:
            raise DataError(f"data.{key}: shard {url} is not in the index {self.path}; {_rewrite(self.path)}")
        if _is_local(url) and entry.get("bytes") is not None:
            size = os.path.getsize(_local_path(url))
            if size != entry["bytes"]:
                raise DataError(
                    f"data.{key}: shard {url} has {size} bytes, its index {self.path} says {entry['bytes']} "
                    f"(the shard changed since); {_rewrite(self.path)}"
                )
        return ShardIndex(entry["samples"], entry["classes"], self.path)


def load_index(path: str) -> IndexFile:
    """Read a shard index (``slipstream data index`` / ``convert``); a file that is
    missing or is no such index is a DataError naming it."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
            raise ValueError(f"no \"format\": \"{INDEX_FORMAT}\"")
        by_url: dict[str, dict[str, Any]] = {}
        by_name: dict[str, list[dict[str, Any]]] = {}
        for entry in data["shards"]:
            url, samples, classes = entry["url"], entry["samples"], entry["classes"]
            if not (isinstance(url, str) and isinstance(samples, int) and isinstance(classes, int)):
                raise ValueError(f"a shard entry of other types: {entry}")
            if samples < 0 or classes < 0:
                raise ValueError(f"a negative count: {entry}")
            local = _is_local(url)
            by_url[os.path.realpath(os.path.join(folder, _local_path(url))) if local else url] = entry
            by_name.setdefault(shard_name(url) or "", []).append(entry)
    except FileNotFoundError:
        raise DataError(f"data.index {path} does not exist (write one: slipstream data index URLS -o {path})") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise DataError(f"data.index {path} is not a shard index ({type(err).__name__}: {reason})") from None
    return IndexFile(path, by_url, by_name)


def shard_indexes(urls: list[str], key: str, given: Any, index: Optional[IndexFile]) -> list[ShardIndex]:
    """Every shard's sample count: from ``index`` (data.index; every shard must be in
    it), else from an index.json beside a local shard (every shard of that folder must be
    in it), else by reading the shard (index_shards). A ``pipe:`` or remote shard
    counted that way is said once: its cost, and how to write an index."""
    if index is not None:
        return [index.find(url, key) for url in urls]
    beside: dict[str, Optional[IndexFile]] = {}
    found: list[Optional[ShardIndex]] = []
    for url in urls:
        file = None
        if _is_local(url):
            candidate = os.path.join(os.path.dirname(os.path.abspath(_local_path(url))), INDEX_NAME)
            if candidate not in beside:
                beside[candidate] = load_index(candidate) if os.path.isfile(candidate) else None
            file = beside[candidate]
        found.append(file.find(url, key) if file is not None else None)
    todo = [i for i, known in enumerate(found) if known is None]
    streamed = [urls[i] for i in todo if not _is_local(urls[i])]
    if streamed:
        shown = " ".join(f"'{u}'" for u in ([given] if isinstance(given, str) else given))
        warnings.warn(
            f"slipstream: data.{key}: {len(streamed)} shard(s) are streamed through once before the first batch "
            f"to count their samples (no shard index); write one once: slipstream data index {shown} -o index.json, "
            "and give data.index=index.json",
            stacklevel=2,
        )
    for i, counted in zip(todo, index_shards([urls[i] for i in todo]) if todo else [], strict=True):
        found[i] = counted
    return [known for known in found if known is not None]


def index_entries(urls: list[str], indexes: list[ShardIndex], index_path: str) -> list[dict[str, Any]]:
    """The index's entries: a local shard by its path relative to the index's folder
    (absolute when outside it) with its size in bytes, another by its URL as given."""
    folder = os.path.dirname(os.path.abspath(index_path))
    entries = []
    for url, known in zip(urls, indexes, strict=True):
        entry: dict[str, Any] = {"url": url, "samples": known.samples, "classes": known.classes}
        if _is_local(url):
            path = os.path.abspath(_local_path(url))
            relative = os.path.relpath(path, folder)
            entry["url"] = path if relative.startswith("..") else relative
            entry["bytes"] = os.path.getsize(path)
        entries.append(entry)
    return entries


def write_index(entries: list[dict[str, Any]], path: str) -> None:
    """Write a shard index at ``path`` whole or not at all (a temporary file, then
    os.replace): one shard a line."""
    lines = ",\n".join("    " + json.dumps(e) for e in entries)
    text = f'{{\n  "format": "{INDEX_FORMAT}",\n  "version": 1,\n  "shards": [\n{lines}\n  ]\n}}\n'
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    partial = os.path.join(folder, f".{os.path.basename(path)}.partial")
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def index_urls(urls: list[str], output: str) -> dict[str, Any]:
    """``slipstream data index``: count the shards ``urls`` name (as data.urls accepts
    them) and write their index at ``output``."""
    expanded = expand(urls, "urls")
    indexes = index_shards(expanded)
    write_index(index_entries(expanded, indexes, output), output)
    return {"shards": len(expanded), "samples": sum(i.samples for i in indexes), "index": output}


class ShardSet:
    """A list of shards as the engine's StreamLoader reads them (a ShardSource)."""

    def __init__(self, urls: list[str], geometry: Geometry, indexes: Optional[list[ShardIndex]] = None) -> None:
        self.urls = urls
        self.indexes = index_shards(urls) if indexes is None else indexes
        self.shard_sizes = [i.samples for i in self.indexes]
        self.geometry = geometry  # the crop, taken while each image is decoded
        self.epoch = 0  # set by the loader's stream each epoch: random crops are per (sample, epoch)
        if sum(self.shard_sizes) == 0:
            raise DataError(
                f"the {len(urls)} shards hold no sample with an image ({', '.join(IMAGE_EXTS)}) and a .{LABEL_EXT} "
                f"label (first shard: {urls[0]})"
            )

    @property
    def num_classes(self) -> int:
        return max([1, *(i.classes for i in self.indexes)])

    def shard_name(self, shard: int) -> str:
        return self.urls[shard]

    def read(self, shard: int, start: int, stop: int) -> Iterator[Any]:
        url = self.urls[shard]
        index = start
        try:
            for position, (key, parts) in enumerate(_samples(_stream_members(url))):
                if position < start:
                    continue
                if position >= stop:
                    return
                ext = next(e for e in IMAGE_EXTS if e in parts)
                yield (url, key, ext, parts[ext], self._label(shard, key, parts[LABEL_EXT]))
                index += 1
        except (tarfile.TarError, EOFError, OSError) as err:
            reason = " ".join(str(err).split()) or type(err).__name__
            raise DataError(f"shard {url} failed after {index} samples ({reason})") from None
        if index < stop:
            known = self.indexes[shard]
            if known.source is not None:
                raise DataError(
                    f"shard {url} holds {index} samples, its index {known.source} says {known.samples}: "
                    f"the index does not match its shard; {_rewrite(known.source)}"
                )
            raise DataError(f"shard {url} holds {index} samples now, {stop} when the run started")

    def _label(self, shard: int, key: str, raw: bytes) -> int:
        label, known = _label(self.urls[shard], key, raw), self.indexes[shard]
        if label >= known.classes:
            told = f"its index {known.source}" if known.source is not None else "when the run started it"
            raise DataError(
                f"shard {self.urls[shard]}: sample {key} has class {label}, {told} held classes below {known.classes}"
                + (f"; {_rewrite(known.source)}" if known.source is not None else "")
            )
        return label

    def sample_name(self, raw: Any) -> str:
        url, key, ext = raw[:3]
        return f"{url}:{key}.{ext}"

    def decode(self, raw: Any) -> tuple[Any, int]:
        url, key, ext, data, label = raw
        name = f"{url}:{key}.{ext}"
        return self.geometry.decode(data, name, sample_key(name, self.epoch)), label

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class WebDatasetShards(DatasetPlugin):
    """WebDataset tar shards (data.urls, data.eval_urls): brace patterns, local paths, pipe: commands."""

    name = "webdataset"
    config_class = WebDatasetConfig
    locations = ("urls", "eval_urls", "index")
    streams = True  # its loader starts its workers each epoch (its split of the epoch is per epoch)
    photos = True
    stats = DATASET_STATS["imagefolder"]  # ImageNet's: what a tree of photos usually has

    def build(self, request: DataRequest) -> BuiltData:
        c = self.config
        given = load_index(c.index) if c.index else None
        urls = expand(c.urls, "urls")
        train = ShardSet(urls, request.geometry("train"), shard_indexes(urls, "urls", c.urls, given))
        evals = None
        if c.eval_urls:
            eval_urls = expand(c.eval_urls, "eval_urls")
            eval_indexes = shard_indexes(eval_urls, "eval_urls", c.eval_urls, given)
            evals = ShardSet(eval_urls, request.geometry("eval"), eval_indexes)
        common = dict(
            seed=request.seed,
            rank=request.rank,
            world_size=request.world_size,
            num_workers=request.num_workers,
            pin_memory=request.pin_memory,
        )
        train_loader = StreamLoader(
            train,
            batch_size=request.batch_size,
            shuffle=True,
            shuffle_block=c.shuffle_block,
            drop_last=request.drop_last,
            **common,
        )
        if request.drop_last and train_loader.batches_per_epoch == 0:
            raise DataError(
                f"data.urls holds {train_loader.num_samples} samples: fewer than one batch of "
                f"{request.batch_size} per process for {request.world_size} process(es)"
            )
        eval_loader = (
            StreamLoader(
                evals,
                batch_size=request.eval_batch_size,
                shuffle=False,
                drop_last=False,
                replace_unreadable=False,  # a stand-in would be evaluated, and counted, twice
                **common,
            )
            if evals is not None
            else None
        )
        num_classes = max(train.num_classes, evals.num_classes if evals is not None else 0)
        return BuiltData(train=train_loader, eval=eval_loader, num_classes=num_classes, stats=self.stats)

    @classmethod
    def convert(cls, source: str, src: str, out: str, *, shard_size: int, progress: bool = True) -> dict[str, Any]:
        """Write WebDataset shards from an ImageFolder tree; see :func:`convert_imagefolder`."""
        if source != "imagefolder":
            raise DataError(f"webdataset converts from imagefolder only, not {source!r}")
        return convert_imagefolder(src, out, shard_size=shard_size, progress=progress)

    @classmethod
    def index(cls, urls: list[str], output: str) -> dict[str, Any]:
        """Write the index of existing shards; see :func:`index_urls`."""
        return index_urls(urls, output)


def convert_imagefolder(src: str, out: str, *, shard_size: int, progress: bool = True, seed: int = 0) -> dict[str, Any]:
    """Write ``OUT/<split>-000000.tar ...`` from ``SRC/<split>/<class>/*`` (train and val;
    or SRC's class folders as one ``train`` split). The image bytes are copied, not
    re-encoded, in an order shuffled by ``seed`` (so a shard mixes classes), with the
    class index (ImageFolder's: sorted folder names) as ``.cls``; OUT/classes.json
    lists the class names and OUT/index.json every shard's sample count (a run then reads
    no shard before its first batch). Returns the ``data.urls`` / ``data.eval_urls`` to use."""
    import webdataset as wds
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset
    from tqdm import tqdm

    root = Path(src)
    if not root.is_dir():
        raise DataError(f"convert: {src} is not a directory (an ImageFolder tree: DIR/train/<class>/*.jpg)")
    splits = [s for s in ("train", "val") if (root / s).is_dir()] or [""]
    plan: dict[str, tuple[list[tuple[str, int]], list[str]]] = {}
    for split in splits:
        folder = root / split if split else root
        try:
            classes, to_index = find_classes(str(folder))
            samples = make_dataset(str(folder), to_index, extensions=IMG_EXTENSIONS)
        except (FileNotFoundError, OSError) as err:
            raise DataError(f"convert: {folder}: {err}") from None
        random.Random(seed).shuffle(samples)
        plan[split or "train"] = (samples, classes)
    names = {tuple(c) for _, c in plan.values()}
    if len(names) > 1:
        raise DataError(f"convert: the class folders of {', '.join(plan)} under {src} differ")
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.glob("*.tar")):
        raise DataError(f"convert: {out} already holds .tar shards; choose an empty or new folder")
    if (out_dir / INDEX_NAME).exists():
        raise DataError(f"convert: {out} already holds {INDEX_NAME}; choose an empty or new folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"samples": {}, "shards": {}}
    total = sum(len(s) for s, _ in plan.values())
    bar = tqdm(total=total, unit="img", desc="convert", disable=not progress)
    counted: dict[str, list[int]] = {}  # shard file -> [samples, classes]
    for split, (samples, _classes) in plan.items():
        pattern = str(out_dir / f"{split}-%06d.tar")
        skipped: dict[str, list[str]] = {}  # why -> the files left out
        written_count = 0
        with wds.ShardWriter(pattern, maxsize=shard_size, maxcount=10**9, verbose=0) as sink:
            for path, label in samples:
                data = Path(path).read_bytes()
                why = _unreadable(data)
                bar.update(1)
                if why is not None:  # copied, it would be skipped (and named) every epoch of every run
                    skipped.setdefault(why, []).append(path)
                    continue
                ext = Path(path).suffix.lower().lstrip(".")
                ext = {"jpeg": "jpg", "jpe": "jpg", "tif": "tiff"}.get(ext, ext)
                sink.write({"__key__": f"{written_count:09d}", ext: data, LABEL_EXT: str(label)})
                written_count += 1
                shard = counted.setdefault(str(sink.fname), [0, 0])
                shard[0], shard[1] = shard[0] + 1, max(shard[1], label + 1)
        if skipped:
            left_out = sum(len(paths) for paths in skipped.values())
            counts = ", ".join(f"{len(paths)} {why}" for why, paths in skipped.items())
            first = next(iter(skipped.values()))[0]
            if not written_count:
                raise DataError(
                    f"convert: none of the {left_out} images of {split} can be read ({counts}; first: {first})"
                )
            warnings.warn(
                f"slipstream: convert: {left_out} of the {len(samples)} {split} images are left out of the shards, "
                f"unreadable ({counts}; first: {first})",
                stacklevel=2,
            )
        written = sorted(out_dir.glob(f"{split}-*.tar"))
        shards = len(written)
        result["samples"][split] = written_count
        result.setdefault("skipped", {})[split] = len(samples) - written_count
        result["shards"][split] = shards
        last = shards - 1
        result["urls" if split == "train" else "eval_urls"] = str(out_dir / f"{split}-{{000000..{last:06d}}}.tar")
    bar.close()
    # Written whole or not at all: a reader never finds half a class list.
    partial = out_dir / ".classes.json.partial"
    partial.write_text(json.dumps(next(iter(plan.values()))[1]) + "\n")
    os.replace(partial, out_dir / "classes.json")
    shards = sorted(str(p) for split in plan for p in out_dir.glob(f"{split}-*.tar"))
    counts = [ShardIndex(*counted.get(p, (0, 0))) for p in shards]
    write_index(index_entries(shards, counts, str(out_dir / INDEX_NAME)), str(out_dir / INDEX_NAME))
    result["index"] = str(out_dir / INDEX_NAME)
    return result
