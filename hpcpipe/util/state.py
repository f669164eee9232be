"""The checkpoint state protocol: what every stateful part of a rank says about itself.

A checkpoint holds parts — the stage parameters, the optimizer shards, PowerSGD's error
feedback and Q, the outer loop's state (local SGD, DiLoCo), the asynchronous pipeline's
weight versions. Each is one class beside the code whose state it is, written once after
this protocol (as torchtitan's checkpointer takes `Stateful`s: a part says what it holds
and how it is laid out; the checkpointer owns files, the manifest and retention):

    class PowerSGDState(Stateful):
        name = "powersgd"        # its files' prefix (powersgd-r00003.h5), its manifest key
        kind = "PowerSGD state of one rank (error feedback, Q)"
        per = RANK               # one file per world rank; PIPELINE: per pipeline rank
        layout_keys = (...)      # the manifest's layout entries its files depend on

        def writes(self) -> bool: ...            # whether this rank writes a file
        def state(self) -> dict[str, Entry]: ...  # host arrays by dataset path
        def held_by(self, manifest) -> str | None: ...  # why a checkpoint must hold it
        def load(self, saved) -> None: ...       # from the checkpoint (a `Saved`)

`state()` is called on every rank (a part that gathers, as the parameters do across
tensor shards, runs its collective there) and returns None on a rank that writes
nothing. The checkpointer (hpcpipe/checkpoint/parts.py) writes each entry as one HDF5
dataset with the records every state file carries — the format version, the part and
what it holds, the file's own name, the step, the writer's grid coordinates, the grid's
shape and the layout entries its `layout_keys` name — and refuses, before `load` sees
them, a file whose records do not match its place: another step's (copied in from an
older checkpoint), another rank's (swapped). `held_by(manifest)` says when a checkpoint
must hold the part (PowerSGD's state where the layout records a PowerSGD rank): a part
the manifest says the run had and that is missing is refused, never restarted silently.

`load(saved)` reads through `Saved` (what the checkpointer hands it: the manifest, this
rank's file, every file of the part, tensors and optimizer segments by name from any
layout), whose arrays come back checked — shape, floats, finite, second moments never
negative — with one StateError naming the file and the dataset otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcpipe.util.errors import HpcpipeError

RANK, PIPELINE = "rank", "pipeline"  # one file per world rank, or per pipeline rank


class StateError(HpcpipeError):
    """A part's state that cannot be loaded; the message names the file and the dataset."""


@dataclass(frozen=True)
class Entry:
    """One array of a part's state (a host array) and the attributes stored with it."""

    array: object
    attrs: dict = field(default_factory=dict)


class Stateful:
    """Base of a checkpointed part of a rank's state: see the module's docstring. A new
    part is one subclass; the checkpointer needs nothing else."""

    name: str = ""
    kind: str = ""
    per: str = RANK
    layout_keys: tuple = ()  # () : its files load under any layout
    # "tensors": its entries are whole parameters, by name (the manifest's tensors);
    # "pieces": segments of flattened optimizer state (attributes tensor, start, stop)
    index: str | None = None

    def writes(self) -> bool:
        return True

    def state(self) -> dict | None:
        raise NotImplementedError

    def attributes(self) -> dict:
        """Attributes of the file itself beside the records (flags, a kind)."""
        return {}

    def held_by(self, manifest: dict) -> str | None:
        """Why a checkpoint with `manifest` must hold this part (the manifest's own
        words: "layout.powersgd_rank = 4"), or None where it may lack it."""
        return None

    def load(self, saved) -> None:
        raise NotImplementedError
