"""How a checkpoint's HDF5 files hold arrays: one fletcher32-checksummed dataset each
(bfloat16 as uint16 with a `dtype` attribute, since h5py stores ml_dtypes' bfloat16 as an
opaque type), and a reader that checks each file against the manifest before HDF5 opens
it and reads tensors, or the elements of optimizer state a rank needs, from any layout —
only datasets the file itself holds (reached by hard links, their bytes stored in the
file), each checked for shape and type before it is read, and weights and optimizer
state for values no checkpoint of hpcpipe's holds (NaN, infinities, negative second
moments) once read."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from hpcpipe.checkpoint.manifest import CheckpointError
from hpcpipe.model.sharding import piece_shard
from hpcpipe.util.files import open_regular

# What h5py raises on files it cannot make sense of (besides OSError for damaged chunks).
H5_ERRORS = (OSError, KeyError, RuntimeError, TypeError, ValueError)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def store(group, name: str, array: np.ndarray, **attrs):
    """One dataset with the fletcher32 checksum; bfloat16 goes in as uint16 + attribute."""
    dtype = array.dtype.name
    if dtype == "bfloat16":
        array = array.view(np.uint16)
    data = np.ascontiguousarray(array)
    ds = group.create_dataset(name, data=data, fletcher32=data.size > 0,
                              chunks=data.shape if data.size else None)
    ds.attrs["dtype"] = dtype
    for key, value in attrs.items():
        ds.attrs[key] = value
    return ds


def member(f, key: str, where: str):
    """The object at path `key` of an open file, reached by hard links only: a soft or
    external link could lead to another file, and a checkpoint never reads outside its
    folder."""
    import h5py

    node = f
    for part in key.split("/"):
        link = node.get(part, getlink=True) if isinstance(node, h5py.Group) else None
        if link is None:
            raise CheckpointError(f"{where}: has no dataset {key!r}")
        if not isinstance(link, h5py.HardLink):
            raise CheckpointError(f"{where}: {key} is an HDF5 {type(link).__name__} (to "
                                  f"another place or file); a checkpoint holds its own data")
        node = node[part]
    return node


def dataset(f, key: str, where: str):
    """The dataset at path `key` of an open file (see `member`)."""
    import h5py

    ds = member(f, key, where)
    if not isinstance(ds, h5py.Dataset):
        raise CheckpointError(f"{where}: {key} is an HDF5 {type(ds).__name__}, not a dataset")
    return ds


def _check_stored(ds, where: str):
    """Only bytes the file itself stores are read: HDF5 can map a dataset onto other files
    (external storage, a virtual dataset) and declare one far larger than what it stores
    (chunks never written read as the fill value), which would be read, or allocated,
    unchecked. hpcpipe writes every dataset whole and uncompressed."""
    if ds.is_virtual or ds.external:
        raise CheckpointError(f"{where}: dataset {ds.name} keeps its data in other files; a "
                              f"checkpoint's datasets hold their own bytes")
    stored = ds.id.get_storage_size()
    if stored < ds.nbytes or ds.nbytes > ds.file.id.get_filesize():
        raise CheckpointError(f"{where}: dataset {ds.name} declares {ds.nbytes:,} bytes but "
                              f"the file stores {stored:,} of them (never written, or not a "
                              f"file hpcpipe wrote)")


def text_attr(obj, key: str, where: str) -> str | None:
    """A string attribute (None when absent); another type is refused, naming it."""
    value = obj.attrs.get(key)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if value is not None and not isinstance(value, str):
        raise CheckpointError(f"{where}: {obj.name} has attribute {key} = {str(value)[:40]}, "
                              f"not a string")
    return value


def is_bfloat16(ds, where: str) -> bool:
    return text_attr(ds, "dtype", where) == "bfloat16" and ds.dtype == np.uint16


def read_dataset(ds, where: str) -> np.ndarray:
    _check_stored(ds, where)
    try:
        data = ds[()]
    except OSError as e:  # fletcher32 mismatch, truncated chunk
        raise CheckpointError(f"{where}: dataset {ds.name} cannot be read ({e}); the file is "
                              f"damaged") from None
    if is_bfloat16(ds, where):
        import ml_dtypes

        data = data.view(ml_dtypes.bfloat16)
    return data


def check_values(data: np.ndarray, where: str, what: str, second_moment: bool = False):
    """Refuse weights or optimizer state that are not finite, and second moments below
    zero, naming `what` and how many elements. hpcpipe never saves such values — a step
    whose gradient is not finite is skipped (train/step.py, optim/post_validation.py) and
    Adam's exp_avg_sq is an average of squares — so they come from a damaged or edited
    file, and would turn every later step (or an exported model) into NaN."""
    bad = data.size - int(np.count_nonzero(np.isfinite(data)))
    if bad:
        raise CheckpointError(f"{where}: {what} holds {bad:,} NaN or infinite value(s) of "
                              f"{data.size:,}; hpcpipe never saves such values (a step whose "
                              f"gradient is not finite is skipped): the file is damaged or "
                              f"was edited")
    negative = int(np.count_nonzero(data < 0)) if second_moment else 0
    if negative:
        raise CheckpointError(f"{where}: {what} holds {negative:,} negative value(s) of "
                              f"{data.size:,}; a second moment (an average of squares) "
                              f"never is: the file is damaged or was edited")
    return data


def _floats(ds, where: str) -> bool:
    return ds.dtype.kind == "f" or is_bfloat16(ds, where)


def read_flat(f, key: str, where: str, like, whose: str) -> np.ndarray:
    """Dataset `key` of the open file `f` (at `where`), which must hold as many floats as
    `like` (a flat array): one message naming `whose` it should have matched otherwise
    (checked before anything is read)."""
    ds = dataset(f, key, where)
    if ds.shape != tuple(like.shape) or not _floats(ds, where):
        raise CheckpointError(f"{where}: {key} holds {ds.dtype} of shape {ds.shape}, {whose} "
                              f"{like.shape[0]} floats")
    return read_dataset(ds, where)


def check_records(f, name: str, where: str, manifest: dict, part: str | None = None):
    """Refuse a file whose records do not match its place in the checkpoint `manifest`:
    its own name, the step, the part. A file of a format-3 checkpoint must carry them;
    one of before (format 2) is checked on what it carries (`file`, if anything)."""
    recorded = text_attr(f, "file", where)
    if recorded is not None and recorded != name:
        raise CheckpointError(f"{where}: holds {recorded[:80]!r}, written for another rank "
                              f"(files swapped or copied over)")
    if "parts" not in manifest:
        return
    if recorded is None or "step" not in f.attrs:
        raise CheckpointError(f"{where}: has no record of the step and rank it was written "
                              f"for (a file of a checkpoint of before, copied in?)")
    step = _int(f, "step", where)
    if step != manifest["step"]:
        raise CheckpointError(f"{where}: written at step {step}, but this checkpoint is of "
                              f"step {manifest['step']}: a file of another checkpoint "
                              f"(copied in from an older one?)")
    held = part if part is None else text_attr(f, "part", where)
    if held != part:
        raise CheckpointError(f"{where}: holds {held!r} state, where this checkpoint lists "
                              f"its {part!r} state")


def attr_text(value) -> str:
    """An attribute's value as a refusal shows it: text quoted (the text '1' is no 1), an
    array's rows on one line."""
    text = repr(value) if isinstance(value, (str, bytes)) else str(value)
    return " ".join(text.split())


def _int(f, key: str, where: str) -> int:
    value = f.attrs.get(key)
    try:
        if np.ndim(value) != 0 or int(value) != value:
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"{where}: attribute {key} = {attr_text(value)[:40]}, not an "
                              f"integer") from None


class Reader:
    """Opens the checkpoint's files on demand and reads tensors or segments of them.

    verified: the files were checked byte by byte already (a resume verifies on the root
    first); otherwise each file's size and SHA-256 are checked before HDF5 opens it, so
    a damaged file is named instead of reaching the HDF5 library."""

    def __init__(self, path: str, manifest: dict, verified: bool = False):
        self.path, self.manifest, self.files = path, manifest, {}
        self.verified = verified

    def file(self, name: str, part: str | None = None):
        """The open file `name` of the checkpoint, its records checked (check_records;
        `part`: the part it must hold)."""
        import h5py

        if name not in self.files:
            full = os.path.join(self.path, name)
            if not os.path.isfile(full):
                raise CheckpointError(f"{full}: missing (listed in the manifest)")
            if not self.verified:
                info = self.manifest["files"][name]
                if os.path.getsize(full) != info["size"] or sha256(full) != info["sha256"]:
                    raise CheckpointError(f"{full}: its size or SHA-256 differs from the "
                                          f"manifest (damaged); see `hpcpipe ckpt verify`")
            try:
                self.files[name] = h5py.File(full, "r")
            except H5_ERRORS as e:
                raise CheckpointError(f"{full}: cannot be opened ({e})") from None
            try:
                check_records(self.files[name], name, full, self.manifest, part)
            except CheckpointError:
                self.files.pop(name).close()
                raise
        return self.files[name]

    def tensor(self, name: str) -> np.ndarray:
        info = self.manifest["tensors"].get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no parameter {name!r} in the checkpoint")
        where = os.path.join(self.path, info["file"])
        ds = dataset(self.file(info["file"]), name, where)
        if tuple(ds.shape) != tuple(info["shape"]) or not _floats(ds, where):
            raise CheckpointError(f"{where}: dataset {name} is {ds.dtype} of shape "
                                  f"{ds.shape}; the manifest says floats of shape "
                                  f"{tuple(info['shape'])}")
        return check_values(read_dataset(ds, where), where, f"tensor {name}")

    def state(self, kind: str, name: str, where) -> np.ndarray | None:
        """Elements of the flattened `kind` state of tensor `name`: [t0, t1) for `where` =
        (t0, t1), or the global flat indices `where` (a tensor shard's elements); None
        when the checkpoint has none."""
        segments = self.manifest["pieces"].get(name)
        if not segments:
            if self.manifest["pieces"]:  # never a silent restart of Adam for one tensor
                raise CheckpointError(f"{self.path}: the manifest lists optimizer state for "
                                      f"other tensors but none for {name} (damaged)")
            return None
        if isinstance(where, tuple) and not any("tp" in p for p in segments):
            return self._range(kind, name, *where)
        full = self._whole(kind, name)
        if full is None:
            return None
        return full[where[0]:where[1]] if isinstance(where, tuple) else full[where]

    def _range(self, kind: str, name: str, t0: int, t1: int) -> np.ndarray | None:
        """Elements [t0, t1) from segments that are ranges of the flattened tensor."""
        out, covered = None, 0
        for p in self.manifest["pieces"][name]:
            a, b = max(t0, p["start"]), min(t1, p["stop"])
            if a >= b:
                continue
            data = self._segment_data(kind, name, p)
            if data is None:
                return None  # e.g. no master weights were saved (32-bit compute)
            if out is None:
                out = np.empty(t1 - t0, dtype=data.dtype)
            out[a - t0:b - t0] = data[a - p["start"]:b - p["start"]]
            covered += b - a
        if covered != t1 - t0:
            raise CheckpointError(f"{self.path}: optimizer state of {name} covers {covered} of "
                                  f"the {t1 - t0} elements needed; a shard file is missing")
        return out

    def _whole(self, kind: str, name: str) -> np.ndarray | None:
        """The whole flattened state, from segments of any layout (tensor shards included)."""
        shape = tuple(self.manifest["tensors"][name]["shape"])
        out, seen = None, np.zeros(int(np.prod(shape)), dtype=bool)
        for p in self.manifest["pieces"][name]:
            data = self._segment_data(kind, name, p)
            if data is None:
                return None
            if "tp" in p:
                index = piece_shard(name, shape, p).global_indices(shape)
                index = index[p["start"]:p["stop"]]
            else:
                index = np.arange(p["start"], p["stop"])
            if out is None:
                out = np.empty(seen.size, dtype=data.dtype)
            out[index], seen[index] = data, True
        if not seen.all():
            raise CheckpointError(f"{self.path}: optimizer state of {name} covers "
                                  f"{int(seen.sum())} of its {seen.size} elements; a shard "
                                  f"file is missing")
        return out

    def _segment_data(self, kind: str, name: str, p: dict) -> np.ndarray | None:
        where, key = os.path.join(self.path, p["file"]), f"{name}@{p['start']}"
        f = self.file(p["file"])
        if kind == "master" and f.get(kind, getlink=True) is None:
            return None  # a 32-bit run keeps none (format 3 writes no empty group)
        group = member(f, kind, where)
        if group.get(key, getlink=True) is None:
            if kind == "master":
                return None  # a 32-bit run keeps none: its weights are the master copy
            # Adam's moments listed in the manifest but not there: an error, never a
            # silent restart of Adam from zero.
            raise CheckpointError(f"{where}: has no {kind}/{key} dataset (the manifest lists "
                                  f"this optimizer state there); the file is damaged")
        ds = dataset(group, key, where)
        if ds.shape != (p["stop"] - p["start"],) or not _floats(ds, where):
            raise CheckpointError(f"{where}: {kind}/{key} is {ds.dtype} of shape {ds.shape}; "
                                  f"the manifest says {p['stop'] - p['start']} floats")
        recorded = _shard_record(ds, where, f"{kind}/{key}")
        if "tp" in p and recorded is not None and recorded != p["tp"]:
            raise CheckpointError(f"{where}: {kind}/{key} is tensor shard {recorded[1]} "
                                  f"of {recorded[0]}, the manifest says shard "
                                  f"{p['tp'][1]}: shard files swapped between ranks")
        return check_values(read_dataset(ds, where), where, f"{kind}/{key}",
                            second_moment=kind == "exp_avg_sq")

    def close(self):
        for f in self.files.values():
            f.close()


def _shard_record(ds, where: str, what: str) -> list[int] | None:
    """A segment's `tp` record ([shards, shard]) where it has one; text, floats or
    another shape (an edited file, re-signed) is refused naming the file and dataset."""
    value = ds.attrs.get("tp")
    if value is None:
        return None
    array = np.asarray(value)
    if array.dtype.kind not in "iu" or array.shape != (2,):
        raise CheckpointError(f"{where}: {what} attribute tp = {attr_text(value)[:40]}, "
                              f"not 2 integers; the file was edited")
    return array.tolist()
