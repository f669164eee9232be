"""The parts of a checkpoint as files: each Stateful part's state written as one HDF5 file
per writer with the records every state file carries, and read back through `Saved`,
which checks those records before a part sees a byte (util/state.py has the protocol).

    <name>-r00003.h5    a part kept per world rank (optimizer shards, PowerSGD, local SGD)
    <name>-pp001.h5     a part kept per pipeline rank, by its first replica's first tensor
                        shard (parameters, the asynchronous pipeline's weight version)

Records (file attributes): format_version, kind ("hpcpipe ..."), part, file (its own
name), step, rank ([dp, pp, tp] of the writer), layout ([dp, pp, tp] of the grid) and
part_layout (JSON: the manifest layout's entries the part's files depend on). A manifest of
format 3 lists each part's files under "parts"; a file of such a checkpoint whose records
name another file (swapped between ranks), another step (copied from an older
checkpoint) or another part is refused by name. Checkpoints written before the records
(format 2) carry none but the parameters' and optimizer's `file`: their files are taken
on their manifest's word — its SHA-256 of every file, which its own digest covers, is what
vouched for them when they were written — and their parts are told apart by name.
"""

from __future__ import annotations

import json
import os

import numpy as np

from hpcpipe.checkpoint.hdf5 import (
    attr_text,
    check_values,
    dataset,
    member,
    read_dataset,
    read_flat,
    sha256,
    store,
)
from hpcpipe.checkpoint.manifest import FORMAT_VERSION
from hpcpipe.util.files import write_buffered
from hpcpipe.util.state import PIPELINE, StateError

_TP_PART = ("tp", "part")  # the attributes that say which part of a tensor a segment is


def file_name(part, grid) -> str:
    """This rank's file of `part`."""
    if part.per == PIPELINE:
        return f"{part.name}-pp{grid.pp_rank:03d}.h5"
    return f"{part.name}-r{grid.rank:05d}.h5"


def records(part_name: str, kind: str, name: str, step: int, coords, shape, layout: dict):
    """The attributes every state file carries (the module's docstring)."""
    return {"format_version": FORMAT_VERSION, "kind": f"hpcpipe {kind}", "part": part_name,
            "file": name, "step": int(step), "rank": [int(c) for c in coords],
            "layout": [int(n) for n in shape],
            "part_layout": json.dumps(layout, sort_keys=True)}


def write(folder: str, name: str, entries: dict, attrs: dict, index: str | None) -> dict:
    """One state file of `entries` (dataset path → util.state.Entry) with the file
    attributes `attrs`, built in memory and written atomically (files.write_buffered: a
    full disk is one OSError, or a refusal before writing); returns its manifest entry."""
    import h5py

    def build(buffer):
        with h5py.File(buffer, "w") as f:
            for key, entry in entries.items():
                store(f, key, np.asarray(entry.array), **entry.attrs)
            for key, value in attrs.items():
                f.attrs[key] = value

    path = os.path.join(folder, name)
    write_buffered(path, build)
    entry = {"file": name, "size": os.path.getsize(path), "sha256": sha256(path),
             "part": attrs["part"]}
    if index == "tensors":
        entry["tensors"] = {key: {"shape": list(e.array.shape)} for key, e in entries.items()}
    elif index == "pieces":
        entry["pieces"] = _pieces(entries)
    return entry


def _pieces(entries: dict) -> dict:
    """tensor → [(start, stop, its part record or None)] of the optimizer segments among
    `entries` (each segment once, whatever kinds of state it has)."""
    out, seen = {}, set()
    for entry in entries.values():
        a = entry.attrs
        shard = {k: [int(v) for v in a[k]] for k in _TP_PART if k in a}
        key = (a["tensor"], int(a["start"]), json.dumps(shard, sort_keys=True))
        if key not in seen:
            seen.add(key)
            out.setdefault(a["tensor"], []).append((int(a["start"]), int(a["stop"]),
                                                    shard or None))
    return out


def listed(manifest: dict, name: str) -> list[str] | None:
    """The files of part `name` the manifest lists (format 3: its "parts"; before: its
    files named `name-*`), or None where a format-3 manifest records no such part."""
    if "parts" in manifest:
        return manifest["parts"].get(name)
    return sorted(f for f in manifest["files"] if f.startswith(f"{name}-")) or None


class SavedFile:
    """One state file of a part, open and checked (records), as a part's `load` reads it:
    every array comes back checked for shape, floats and finite values (StateError
    naming the file and the dataset)."""

    def __init__(self, f, name: str, where: str):
        self.f, self.name, self.where = f, name, where

    @property
    def coords(self) -> tuple[int, int, int] | None:
        """[dp, pp, tp] of the rank that wrote it, where recorded."""
        if self.f.attrs.get("rank") is None:
            return None
        return tuple(self.integers("rank", count=3))

    def integers(self, key: str, of: str | None = None, count: int | None = None):
        """Integer record `key` (a file attribute, or dataset `of`'s): an int, or a list of
        `count` (any length: -1); a record of text, floats or another shape — from an
        edited file, re-signed — is one StateError naming the file and the record."""
        attrs = self.f.attrs if of is None else dataset(self.f, of, self.where).attrs
        value = attrs.get(key)
        array = np.asarray(value) if value is not None else None
        shape = () if count is None else (count,)
        if count == -1 and array is not None and array.ndim == 1:
            shape = array.shape
        if array is None or array.dtype.kind not in "iu" or array.shape != shape:
            text = attr_text(value)
            wanted = "an integer" if count is None else (
                "a list of integers" if count == -1 else f"{count} integers")
            raise StateError(f"{self.where}: {'' if of is None else of + ' '}attribute "
                             f"{key} = {text[:40]}, not {wanted}; the file was edited")
        return array.tolist()

    def has(self, key: str) -> bool:
        node = self.f
        for part in key.split("/"):
            if part not in node:
                return False
            node = node[part]
        return True

    def keys(self, group: str) -> list[str]:
        """The names in `group` (hard links only: never another file's)."""
        return list(member(self.f, group, self.where))

    def attr(self, key: str, default=None):
        return self.f.attrs.get(key, default)

    def dataset_attrs(self, key: str) -> dict:
        return dict(dataset(self.f, key, self.where).attrs)

    def array(self, key: str, like=None, shape=None, whose: str = "this rank's",
              second_moment: bool = False, finite: bool = True) -> np.ndarray:
        """Dataset `key` as a host array: as many floats as the flat `like`, or of `shape`,
        finite (and not negative, for a second moment)."""
        if like is not None:
            data = read_flat(self.f, key, self.where, like, whose)
        else:
            data = read_dataset(dataset(self.f, key, self.where), self.where)
            if shape is not None and tuple(data.shape) != tuple(shape):
                raise StateError(f"{self.where}: {key} has shape {data.shape}, {whose} "
                                 f"{tuple(shape)}")
        if finite:
            data = check_values(data, self.where, key, second_moment=second_moment)
        return data


class Saved:
    """What a part's `load` is handed: the checkpoint at `path` as this rank sees it, for
    `part` — see util/state.py. `layout`: this run's (the manifest's entries' names)."""

    def __init__(self, part, reader, grid, manifest: dict, path: str, layout: dict):
        self.part, self.reader, self.grid = part, reader, grid
        self.manifest, self.path, self.mine = manifest, path, layout
        self.names = listed(manifest, part.name)

    @property
    def present(self) -> bool:
        """Whether the checkpoint holds this part (it may hold no file of it: the
        asynchronous pipeline's version before its first update)."""
        return self.names is not None

    @property
    def layout(self) -> dict:
        return self.manifest["layout"]

    @property
    def state(self) -> dict:
        return self.manifest.get("state", {})

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def file(self, name: str) -> SavedFile:
        return SavedFile(self.reader.file(name, self.part.name), name,
                         os.path.join(self.path, name))

    def own(self) -> SavedFile:
        """This rank's file of the part (StateError where the checkpoint has none)."""
        name = file_name(self.part, self.grid)
        if name not in (self.names or ()):
            raise StateError(f"{os.path.join(self.path, name)}: missing (the checkpoint "
                             f"keeps its {self.part.kind} in one file per "
                             f"{'pipeline rank' if self.part.per == PIPELINE else 'rank'})")
        return self.file(name)

    def files(self) -> list[SavedFile]:
        return [self.file(name) for name in self.names or ()]

    def same_layout(self) -> bool:
        """Whether this run's layout is the one that wrote the part's files (on its
        layout_keys)."""
        return not self._differs()

    def require_layout(self, advice: str):
        """Refuse, with one message, files written under another layout (on the part's
        layout_keys) than this run's."""
        differs = self._differs()
        if differs:
            raise StateError(
                f"{self.path}: holds {self.part.kind} for "
                f"{', '.join(f'{k} = {self.layout.get(k)}' for k in differs)}, but this run "
                f"has {', '.join(f'{k} = {self.mine.get(k)}' for k in differs)}; {advice}")

    def _differs(self) -> list[str]:
        return [k for k in self.part.layout_keys if self.layout.get(k) != self.mine.get(k)]

    def tensor(self, name: str) -> np.ndarray:
        """Parameter `name`, whole, from whichever file holds it (any layout)."""
        return self.reader.tensor(name)

    def segment(self, kind: str, name: str, where) -> np.ndarray | None:
        """Elements of the flattened `kind` optimizer state of `name` (hdf5.Reader.state)."""
        return self.reader.state(kind, name, where)
